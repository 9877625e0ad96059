#!/usr/bin/env python
"""What the Compressive memory buys, at an equal training budget on long documents (byte level).

    python benchmarks/benchmark_memory.py                        # the full run: 10 configurations x seeds 0 1
    python benchmarks/benchmark_memory.py --configs compressive txl none --seeds 0 1 2
    python benchmarks/benchmark_memory.py --hidden 512 --layers 6 --steps 5000 --threads 0   # larger, e.g. on a GPU
    python benchmarks/benchmark_memory.py --quick --kjv K.txt --python-dir DIR --output_dir /tmp/m   # smoke run (CI)
    python benchmarks/benchmark_memory.py --plot-only docs/benchmarks/memory.json              # redraw, reprint
    python benchmarks/benchmark_memory.py --configs txl --update                               # rerun some, keep the rest

Corpus: the King James Bible (`--kjv`) cut into its 66 books (a book starts at its "<Book> 1" chapter heading)
and `--python-files` Python standard-library files (`--python-dir`, default this interpreter's; `.py` files of at
least `--min-doc-bytes` bytes outside test and package folders, sorted by path, that many taken evenly spaced), one
document each, interleaved by size so both kinds are spread along the stream. The documents are written to
`<output_dir>/corpus/` and `longrange train` splits them by whole documents (`--validation` of the bytes held out),
byte tokenizer (256 byte ids; its 3 special tokens make the vocabulary 259, the end-of-text id separates
documents in the training stream).

Training: every run is `longrange train` itself, with the same model size, steps, batch, window, optimizer,
schedule and data order (equal budget: steps x batch x window tokens). A compressive model streams (Transformer-XL
training): row b of every step continues lane b of the training stream, and the model carries its memory both
inside a window (one forward over `window` tokens runs window / segment segments, memories updated after each)
and across consecutive windows of a lane (the cache of the previous step, detached). Lanes run through document
boundaries, which the end-of-text id marks (as Transformer-XL trains on a concatenated corpus). Seeds change the
initialisation only (the data order is the same for every seed and configuration).

Configurations (M = --mem, C = --c-mem, r = --rate, S = --segment; span = tokens of the past a token can attend,
slots = keys it attends beside its own segment):
  compressive   mem_len M, c_mem_len C, conv1d, attention reconstruction: slots M + C, span M + C r
  txl           Transformer-XL: mem_len 2M ("mem_len doubled"), c_mem_len 0 (evicted memories are dropped, nothing
                is compressed, no reconstruction loss; mean_pool, so that no unused f_c weights are counted):
                slots 2M, span 2M. With C r = M (the default) 2M is the compressive span.
  none          the compressive config, trained and evaluated with every segment alone (`train.py
                --segments_alone`: each window's segments are separate rows, so the same tokens per step, from an
                empty memory): no memory at all. (mem_len 0 is refused by the config: mem_len >= compression_rate.)
  ablation      conv1d and dilated_conv with the autoencoding loss, conv1d without reconstruction loss (a fixed
                random convolution), dilated_conv with the attention loss, and max_pool, mean_pool, most_used
                (parameter-free: reconstruction_loss none), all with the compressive memory sizes.

Evaluation: `--eval-docs` validation documents of at least `--eval-doc-tokens` bytes (alternating Bible books and
Python files while both last), their first `--eval-doc-tokens` bytes, each document read from an empty memory
carried across the whole document (`longrange evaluate`'s `nll_with_cache`). Every token that has at least one
token of its own segment before it is scored (the first token of each segment is left out everywhere, so that
"each segment alone" scores the same tokens). Bits per byte = NLL / ln 2 / scored bytes.
`--eval-mem-lens`: the same, with the memory of evaluation changed through `longrange evaluate`'s `--mem_len` /
`--c_mem_len` code (`load_model`): mem_len m and c_mem_len scaled as trained (C / M of training, at least 1; txl
keeps 0); m = 0 means each segment alone. A configuration's own figure is at its trained memory (none: m = 0).

Writes `--json` (command, date, seeds, sizes, per configuration and seed, mean and spread; rewritten after every
run) and `--plot` (bits per byte against the evaluation memory, one line per configuration, and bars of every
configuration's own figure with the seed spread). The trained models stay in `<output_dir>/runs/`
(`longrange evaluate` reads them).

Runtime (default sizes, `--threads 1`): a training step of 8 x 512 bytes takes about 0.27-0.42 s of CPU (none the
least, most_used the most), so 300 steps about 2 minutes, and the evaluation sweep about 15 s: about 2-2.5 minutes
per configuration and seed on an idle core, about 45 minutes for the 20 runs. The record keeps each run's CPU
seconds (`train_cpu_seconds`, `eval_cpu_seconds`) beside its wall-clock seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import re
import shlex
import shutil
import sys
import sysconfig
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[1]
# from a checkout: the package next to this folder (the user commands are in it: longrange.commands)
sys.path.insert(0, str(REPO))

DEFAULT_KJV = REPO.parent / "shared" / "data" / "kjv-bible.txt"
# folders of the standard library that are not the library itself (as longrange.data.stdlib_source_files)
SKIP_FOLDERS = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}

SIZES = {
    # about 2-2.5 minutes per configuration and seed on one idle core (see "Runtime" above)
    "full": dict(hidden=128, layers=2, heads=4, segment=64, mem=64, c_mem=16, rate=4, window=512, batch=8,
                 steps=300, lr=2e-3, eval_docs=16, eval_doc_tokens=4096, eval_mem_lens=[0, 16, 32, 64, 128, 256, 512],
                 python_files=150, min_doc_bytes=4096),
    "quick": dict(hidden=32, layers=2, heads=2, segment=16, mem=16, c_mem=4, rate=4, window=64, batch=2, steps=3,
                  lr=2e-3, eval_docs=4, eval_doc_tokens=128, eval_mem_lens=[0, 8, 16, 32], python_files=8,
                  min_doc_bytes=256),
}  # fmt: skip
MAIN = ("compressive", "txl", "none")
ABLATION = (
    ("conv1d", "autoencoding"),
    ("conv1d", "none"),
    ("dilated_conv", "attention"),
    ("dilated_conv", "autoencoding"),
    ("max_pool", "none"),
    ("mean_pool", "none"),
    ("most_used", "none"),
)
ALL_CONFIGS = (*MAIN, *(f"{f}-{loss}" for f, loss in ABLATION))


# ----------------------------------------------------------------------------------------------------------------
# Configurations
# ----------------------------------------------------------------------------------------------------------------


def configurations(size: dict, names) -> dict[str, dict]:
    """name -> {config: the memory fields, segments_alone, group, slots, span, description}."""
    m, c, r = size["mem"], size["c_mem"], size["rate"]
    memory = {"mem_len": m, "c_mem_len": c, "compression_rate": r}
    out = {}
    for name in names:
        if name == "compressive":
            fields = {**memory, "compression_function": "conv1d", "reconstruction_loss": "attention"}
            entry = dict(group="main", slots=m + c, span=m + c * r,
                         description=f"memory {m} + compressed memory {c} (rate {r}, conv1d, attention loss)")  # fmt: skip
        elif name == "txl":
            fields = {"mem_len": 2 * m, "c_mem_len": 0, "compression_rate": r, "compression_function": "mean_pool",
                      "reconstruction_loss": "none"}  # fmt: skip
            entry = dict(group="main", slots=2 * m, span=2 * m, plain_memory=True,
                         description=f"Transformer-XL: memory {2 * m} (doubled), no compressed memory")  # fmt: skip
        elif name == "none":
            fields = {**memory, "compression_function": "conv1d", "reconstruction_loss": "attention"}
            entry = dict(group="main", slots=0, span=0, segments_alone=True,
                         description="no memory: every segment alone (the compressive config, never given a memory)")  # fmt: skip
        else:
            function, loss = name.rsplit("-", 1)
            fields = {**memory, "compression_function": function, "reconstruction_loss": loss}
            entry = dict(group="ablation", slots=m + c, span=m + c * r,
                         description=f"memory {m} + compressed memory {c}, {function}, reconstruction loss {loss}")  # fmt: skip
        out[name] = {"config": fields, "segments_alone": False, "plain_memory": False, **entry}
    return out


def eval_memory(info: dict, m: int) -> tuple[int, int] | None:
    """(mem_len, c_mem_len) evaluated at memory m (None: each segment alone): c_mem_len scaled as trained."""
    if m == 0:
        return None
    trained = info["config"]
    if info["plain_memory"]:  # txl: no compressed memory at any length
        return m, 0
    return m, max(1, round(m * trained["c_mem_len"] / trained["mem_len"]))


def own_memory(info: dict) -> tuple[int, int] | None:
    return None if info["segments_alone"] else (info["config"]["mem_len"], info["config"]["c_mem_len"])


# ----------------------------------------------------------------------------------------------------------------
# Corpus
# ----------------------------------------------------------------------------------------------------------------

BOOK_HEADING = re.compile(rb"^((?:[1-3] )?[A-Z][A-Za-z ]*?) (\d+)\r?$")


def kjv_books(path: Path) -> list[tuple[str, bytes]]:
    """The Bible cut at each book's first chapter heading ("Genesis 1", "1 Samuel 1"); text before the first
    heading stays with the first book."""
    data = path.read_bytes()
    starts, names, offset, current = [], [], 0, None
    for line in data.splitlines(keepends=True):
        found = BOOK_HEADING.match(line.rstrip(b"\n"))
        if found and found.group(2) == b"1" and found.group(1) != current:
            current = found.group(1)
            starts.append(offset)
            names.append(current.decode())
        offset += len(line)
    if len(starts) < 2:
        raise SystemExit(f"{path}: found {len(starts)} book heading(s) (lines like 'Genesis 1'); need at least 2")
    starts[0] = 0
    ends = [*starts[1:], len(data)]
    return [(name, data[a:b]) for name, a, b in zip(names, starts, ends)]


def python_files(folder: Path, count: int, min_bytes: int) -> list[tuple[str, bytes]]:
    """`count` .py files of at least `min_bytes` bytes, evenly spaced in path order (all of them if fewer)."""
    files = []
    for path in sorted(folder.rglob("*.py"), key=lambda p: p.relative_to(folder).as_posix()):
        if SKIP_FOLDERS.intersection(path.relative_to(folder).parts[:-1]) or not path.is_file():
            continue
        if path.stat().st_size >= min_bytes:
            files.append(path)
    if len(files) < 2:
        raise SystemExit(f"{folder}: {len(files)} .py file(s) of at least {min_bytes} bytes; need at least 2")
    if count < len(files):
        files = [files[i * len(files) // count] for i in range(count)]
    return [(path.relative_to(folder).as_posix(), path.read_bytes()) for path in files]


def interleave(kinds: dict[str, list[tuple[str, bytes]]]) -> list[tuple[str, str, bytes]]:
    """(kind, name, text) in an order that keeps each kind's share of the bytes even along the stream."""
    totals = {kind: sum(len(text) for _, text in docs) for kind, docs in kinds.items()}
    done, position, out = dict.fromkeys(kinds, 0), dict.fromkeys(kinds, 0), []
    while any(position[k] < len(kinds[k]) for k in kinds):
        kind = min((k for k in kinds if position[k] < len(kinds[k])), key=lambda k: (done[k] / totals[k], k))
        name, text = kinds[kind][position[kind]]
        out.append((kind, name, text))
        done[kind] += len(text)
        position[kind] += 1
    return out


def write_corpus(docs: list[tuple[str, str, bytes]], folder: Path) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for i, (kind, name, text) in enumerate(docs):
        safe = re.sub(r"[^A-Za-z0-9_.-]+", "_", name)
        (folder / f"d{i:04d}-{kind}-{safe}.txt").write_bytes(text)


def evaluation_rows(corpus_dir: Path, docs, validation: float, count: int, length: int):
    """The validation documents (whole documents, as train.py splits them) and the first `length` bytes of up to
    `count` of those at least that long, alternating kinds while both last: ([rows, length] ids, row info)."""
    from longrange.data import load_corpus

    corpus = load_corpus(corpus_dir, split=(1.0 - validation, validation), as_bytes=True)
    if corpus.split_by != "document":
        raise SystemExit("the corpus could not be split by whole documents: use more documents")
    label = {text: (kind, name) for kind, name, text in docs}
    held_out = [(*label[text], text) for text in corpus.splits["validation"]]
    long_enough = {"kjv": [], "python": []}
    for kind, name, text in held_out:
        if len(text) >= length:
            long_enough[kind].append((kind, name, text))
    chosen = []
    while len(chosen) < count and (long_enough["kjv"] or long_enough["python"]):
        for kind in ("kjv", "python"):
            if long_enough[kind] and len(chosen) < count:
                chosen.append(long_enough[kind].pop(0))
    if not chosen:
        raise SystemExit(f"no validation document holds {length} bytes: lower --eval-doc-tokens")
    rows = torch.tensor(
        np.stack([np.frombuffer(text[:length], dtype=np.uint8) for _, _, text in chosen]), dtype=torch.long
    )
    info = [{"kind": kind, "name": name, "bytes": len(text)} for kind, name, text in chosen]
    train_bytes = corpus.num_bytes("train")
    validation_docs = {k: sum(1 for kind, _, _ in held_out if kind == k) for k in ("kjv", "python")}
    return rows, info, train_bytes, validation_docs


# ----------------------------------------------------------------------------------------------------------------
# Evaluation
# ----------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def segments_alone_nll(model, rows: torch.Tensor, segment: int, block: int = 256) -> torch.Tensor:
    """[rows, n] -> [rows, n - 1] NLL of tokens 1.. with every segment read alone (no memory); NaN at the first
    token of each segment (nothing of its segment before it)."""
    k, n = rows.shape
    device = next(model.parameters()).device
    pieces = rows.reshape(-1, segment)
    out = torch.full((pieces.shape[0], segment), math.nan)
    for start in range(0, len(pieces), block):
        x = pieces[start : start + block].to(device)
        logits = model(input_ids=x, use_cache=False).logits
        nll = torch.nn.functional.cross_entropy(logits[:, :-1].float().transpose(1, 2), x[:, 1:], reduction="none")
        out[start : start + block, 1:] = nll.cpu()
    return out.reshape(k, n)[:, 1:]


def score(nll: torch.Tensor, segment: int, kinds: list[str]) -> dict:
    """Bits per byte over the tokens that have a token of their own segment before them, overall and per kind."""
    positions = torch.arange(1, nll.shape[1] + 1)
    keep = positions % segment != 0
    picked = nll[:, keep].double()
    if torch.isnan(picked).any():
        raise RuntimeError("a scored token has no loss")
    per_row = picked.sum(1) / math.log(2)
    out = {"bits_per_byte": float(per_row.sum() / picked.numel()), "scored_bytes": picked.numel()}
    out["by_corpus"] = {
        kind: float(per_row[[i for i, k in enumerate(kinds) if k == kind]].sum() / (picked.shape[1] * kinds.count(kind)))
        for kind in sorted(set(kinds))
    }  # fmt: skip
    return out


def evaluate_run(evaluate, model_dir: Path, rows, kinds, info: dict, size: dict, mem_lens, device="cpu") -> dict:
    """Own figure and the sweep over evaluation memories; each setting computed once."""
    results: dict = {}

    def at(setting):
        key = "alone" if setting is None else f"{setting[0]}/{setting[1]}"
        if key not in results:
            if setting is None:
                model = evaluate.load_model(str(model_dir)).to(device).eval()
                nll = segments_alone_nll(model, rows, size["segment"])
            else:
                trained = own_memory(info)
                overrides = {} if setting == trained else {"mem_len": setting[0], "c_mem_len": setting[1]}
                model = evaluate.load_model(str(model_dir), **overrides).to(device).eval()
                nll = evaluate.nll_with_cache(model, rows, size["window"]).nll
            results[key] = score(nll, size["segment"], kinds)
        return results[key]

    own = at(own_memory(info))
    sweep = {}
    for m in mem_lens:
        setting = eval_memory(info, m)
        span = 0 if setting is None else setting[0] + setting[1] * info["config"]["compression_rate"]
        sweep[str(m)] = {"mem_len": 0 if setting is None else setting[0],
                         "c_mem_len": 0 if setting is None else setting[1], "span": span, **at(setting)}  # fmt: skip
    return {"bits_per_byte": own["bits_per_byte"], "by_corpus": own["by_corpus"], "eval_memory": sweep}


# ----------------------------------------------------------------------------------------------------------------
# Training (longrange train)
# ----------------------------------------------------------------------------------------------------------------


def train_run(train, info: dict, size: dict, args, seed: int, corpus_dir: Path, out: Path) -> dict:
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    config = [f"hidden_size={size['hidden']}", f"num_hidden_layers={size['layers']}",
              f"num_attention_heads={size['heads']}", f"intermediate_size={4 * size['hidden']}",
              f"segment_length={size['segment']}", "hidden_dropout=0.0", "attention_dropout=0.0",
              *(f"{k}={v}" for k, v in info["config"].items())]  # fmt: skip
    argv = ["--model", "compressive", "--data", str(corpus_dir), "--split", f"{1 - args.validation},{args.validation}",
            "--tokenizer", "byte", "--window", str(size["window"]), "--batch_size", str(size["batch"]),
            "--max_steps", str(size["steps"]), "--learning_rate", str(size["lr"]), "--eval_every", "0",
            "--eval_tokens", str(size["window"]), "--eval_batch_size", "1", "--num_samples", "0", "--save_every", "0",
            "--seed", str(seed), "--num_threads", str(args.threads), "--log_every", str(max(1, size["steps"] // 100)),
            "--output_dir", str(out), *(["--cpu"] if args.cpu else []),
            *(["--segments_alone"] if info["segments_alone"] else []), "--config", *config]  # fmt: skip
    wall, cpu = time.perf_counter(), time.process_time()
    result = train.main(argv)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    shutil.rmtree(out / "checkpoints", ignore_errors=True)  # the model folder is kept; the optimizer state is not
    losses = [record["lm_loss"] for record in result["train_history"]]
    tail = losses[-max(1, len(losses) // 10) :]
    return {"parameters": result["parameters"], "train_seconds": wall, "train_cpu_seconds": cpu,
            "final_train_lm_loss": float(np.mean(tail)), "train_lm_loss": losses}  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Summary, tables, plot
# ----------------------------------------------------------------------------------------------------------------


def spread(values: list[float]) -> dict:
    a = np.array(values, dtype=float)
    return {"mean": float(a.mean()), "min": float(a.min()), "max": float(a.max()),
            "std": float(a.std(ddof=1)) if len(a) > 1 else None}  # fmt: skip


def summarize(report: dict) -> dict:
    summary = {}
    for name, by_seed in report["runs"].items():
        if not by_seed:
            continue
        seeds = sorted(by_seed, key=int)
        row = {"seeds": [int(s) for s in seeds], "bits_per_byte": spread([by_seed[s]["bits_per_byte"] for s in seeds])}
        row["bits_per_byte"]["by_seed"] = {s: by_seed[s]["bits_per_byte"] for s in seeds}
        kinds = by_seed[seeds[0]]["by_corpus"]
        row["by_corpus"] = {k: spread([by_seed[s]["by_corpus"][k] for s in seeds]) for k in kinds}
        row["eval_memory"] = {
            m: {**spread([by_seed[s]["eval_memory"][m]["bits_per_byte"] for s in seeds]),
                "span": by_seed[seeds[0]]["eval_memory"][m]["span"]}
            for m in by_seed[seeds[0]]["eval_memory"]
        }  # fmt: skip
        row["train_cpu_seconds"] = spread([by_seed[s]["train_cpu_seconds"] for s in seeds])["mean"]
        summary[name] = row
    return summary


def compare(summary: dict, a: str, b: str) -> dict | None:
    """a - b in bits per byte (negative: a better), per seed and in the mean, and whether the seed ranges overlap."""
    if a not in summary or b not in summary:
        return None
    x, y = summary[a]["bits_per_byte"], summary[b]["bits_per_byte"]
    seeds = [s for s in x["by_seed"] if s in y["by_seed"]]
    diff = x["mean"] - y["mean"]
    separated = x["max"] < y["min"] or y["max"] < x["min"]
    better = a if diff < 0 else b
    if len(seeds) < 2:
        verdict = f"{better} lower by {abs(diff):.4f} bits/byte (one seed: no spread to judge it by)"
    elif separated:
        verdict = f"{better} lower by {abs(diff):.4f} bits/byte; the seed ranges do not overlap"
    else:
        verdict = f"difference {diff:+.4f} bits/byte is within the seed spread: no gain measurable at this scale"
    return {"a": a, "b": b, "difference": diff, "by_seed": {s: x["by_seed"][s] - y["by_seed"][s] for s in seeds},
            "ranges_overlap": not separated, "verdict": verdict}  # fmt: skip


def tables(report: dict) -> str:
    summary, configs = report["summary"], report["configs"]
    lines = ["| config | slots / span (tokens) | parameters | bits/byte mean | min - max | std | KJV | Python | "
             "train CPU s |", "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: | ---: |"]  # fmt: skip
    for name, row in summary.items():
        b, info = row["bits_per_byte"], configs[name]
        std = "-" if b["std"] is None else f"{b['std']:.4f}"
        corpus = [f"{row['by_corpus'][k]['mean']:.4f}" if k in row["by_corpus"] else "-" for k in ("kjv", "python")]
        params = next(iter(report["runs"][name].values()))["parameters"]
        lines.append(f"| {name} | {info['slots']} / {info['span']} | {params:,} | {b['mean']:.4f} | "
                     f"{b['min']:.4f} - {b['max']:.4f} | {std} | {corpus[0]} | {corpus[1]} | "
                     f"{row['train_cpu_seconds']:.0f} |")  # fmt: skip
    mems = report["evaluation"]["mem_lens"]
    lines += ["", "Bits per byte (mean over seeds) against the evaluation mem_len (0: each segment alone):", "",
              "| config | " + " | ".join(str(m) for m in mems) + " |", "| --- |" + " ---: |" * len(mems)]  # fmt: skip
    for name, row in summary.items():
        lines.append(f"| {name} | " + " | ".join(f"{row['eval_memory'][str(m)]['mean']:.4f}" for m in mems) + " |")
    if report.get("comparisons"):
        lines += ["", *(f"- {c['a']} vs {c['b']}: {c['verdict']}" for c in report["comparisons"])]
    return "\n".join(lines)


def plot(report: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary, configs = report["summary"], report["configs"]
    mems = report["evaluation"]["mem_lens"]
    fig, (sweep, bars) = plt.subplots(1, 2, figsize=(14, 5.5), gridspec_kw={"width_ratios": [3, 2]})
    x = np.arange(len(mems))
    colors = plt.get_cmap("tab10")
    for i, (name, row) in enumerate(summary.items()):
        main = configs[name]["group"] == "main"
        mean = [row["eval_memory"][str(m)]["mean"] for m in mems]
        low = [row["eval_memory"][str(m)]["min"] for m in mems]
        high = [row["eval_memory"][str(m)]["max"] for m in mems]
        style = dict(color=colors(i % 10), lw=2.2 if main else 1.1, ls="-" if main else "--")
        sweep.plot(x, mean, marker="o", ms=3, label=name, **style)
        if main:  # the seed band of the main comparison (the ablation's would hide the lines)
            sweep.fill_between(x, low, high, color=style["color"], alpha=0.12)
        own = own_memory(configs[name])
        if (own[0] if own else 0) in mems:
            j = mems.index(own[0] if own else 0)
            sweep.plot(x[j], mean[j], marker="*", ms=13, color=style["color"], mec="black", mew=0.6)
    sweep.set_xticks(x, ["0\nalone" if m == 0 else str(m) for m in mems])
    sweep.set_xlabel("evaluation mem_len (c_mem_len scaled as trained; txl keeps 0)")
    sweep.set_ylabel("validation bits per byte")
    seeds = ", ".join(str(s) for s in report["seeds"])
    sweep.set_title(
        f"Evaluation memory (mean of seeds {seeds}; band: min-max of the main three; star: as trained)", fontsize=10
    )
    values = [v for row in summary.values() for m in mems for v in (row["eval_memory"][str(m)]["max"],)]
    if values and max(values) > 2 * min(values):
        sweep.set_yscale("log")
    sweep.grid(alpha=0.3)
    sweep.legend(fontsize=8, ncol=2)

    names = list(summary)
    y = np.arange(len(names))[::-1]
    for yi, name in zip(y, names):
        b = summary[name]["bits_per_byte"]
        color = colors(names.index(name) % 10)
        main = configs[name]["group"] == "main"
        bars.barh(yi, b["mean"], color=color, alpha=0.85 if main else 0.45,
                  xerr=[[b["mean"] - b["min"]], [b["max"] - b["mean"]]], capsize=3)  # fmt: skip
        bars.plot(list(b["by_seed"].values()), [yi] * len(b["by_seed"]), "o", color="black", ms=3.5, zorder=3)
    bars.set_yticks(y, [f"{n} ({configs[n]['span']})" for n in names], fontsize=8)
    every = [v for n in names for v in summary[n]["bits_per_byte"]["by_seed"].values()]
    if every:
        lo, hi = min(every), max(every)
        pad = max(0.02, 0.15 * (hi - lo))
        bars.set_xlim(lo - 3 * pad, hi + pad)
    bars.set_xlabel(
        "validation bits per byte at the trained memory\n(bar: mean over seeds, line: min-max, dots: seeds)"
    )
    bars.set_title("Each configuration (attention span in tokens)", fontsize=10)
    bars.grid(alpha=0.3, axis="x")
    size = report["sizes"]
    fig.suptitle(f"What the memory buys: {size['layers']} x {size['hidden']}, segment {size['segment']}, "
                 f"{size['steps']} steps of {size['batch']} x {size['window']} bytes, KJV books + Python files",
                 fontsize=11)  # fmt: skip
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def finish(report: dict, args) -> None:
    report["summary"] = summarize(report)
    report["comparisons"] = [c for c in (compare(report["summary"], "compressive", "txl"),
                                         compare(report["summary"], "compressive", "none"),
                                         compare(report["summary"], "txl", "none")) if c]  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1) + "\n")


# ----------------------------------------------------------------------------------------------------------------
# Main
# ----------------------------------------------------------------------------------------------------------------


def updated_record(new: dict, path: Path) -> dict:
    """The record at `path` with `new`'s configurations emptied for a rerun, refused unless both were made with the
    same sizes, seeds and data (so the rerun rows compare with the kept ones)."""
    if not path.is_file():
        raise SystemExit(f"--update: no record at {path} (run without --update first)")
    old = json.loads(path.read_text())
    for key in ("sizes", "seeds", "data"):
        if old.get(key) != new[key]:
            raise SystemExit(f"--update: the record at {path} was made with other {key} ({old.get(key)!r}); "
                             f"rerun everything without --update")  # fmt: skip
    old["configs"].update(new["configs"])
    old["runs"].update({name: {} for name in new["configs"]})
    old.setdefault("updates", []).append({"command": new["command"], "date": new["date"],
                                          "configs": list(new["configs"]), "versions": new["versions"]})  # fmt: skip
    return old


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny model, 3 steps, tiny evaluation (smoke run)")
    p.add_argument("--kjv", type=Path, default=DEFAULT_KJV, help="the King James Bible as one text file")
    p.add_argument("--python-dir", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                   help="folder of Python files (default: this interpreter's standard library)")  # fmt: skip
    p.add_argument("--python-files", type=int, default=None, help="how many Python files (default 150; quick 8)")
    p.add_argument("--min-doc-bytes", type=int, default=None, help="smallest Python file taken (default 4096)")
    p.add_argument("--validation", type=float, default=0.1, help="fraction of the bytes held out, whole documents")
    p.add_argument("--configs", nargs="+", default=list(ALL_CONFIGS), choices=ALL_CONFIGS)
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    for name, kind in (("hidden", int), ("layers", int), ("heads", int), ("segment", int), ("mem", int),
                       ("c-mem", int), ("rate", int), ("window", int), ("batch", int), ("steps", int), ("lr", float),
                       ("eval-docs", int), ("eval-doc-tokens", int)):  # fmt: skip
        p.add_argument(f"--{name}", type=kind, default=None, help="default: see SIZES (full / quick)")
    p.add_argument("--eval-mem-lens", type=int, nargs="+", default=None,
                   help="evaluation mem_len values (0: each segment alone); default 0 16 32 64 128 256 512")  # fmt: skip
    p.add_argument("--threads", type=int, default=1, help="torch threads (1: the CPU estimate; 0: torch's default)")
    p.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is present")
    p.add_argument("--output_dir", type=Path, default=None, help="corpus and trained models (default outputs/...)")
    p.add_argument("--json", type=Path, default=None, help="default docs/benchmarks/memory.json (quick: output_dir)")
    p.add_argument("--plot", type=Path, default=None, help="default docs/images/memory.png (quick: output_dir)")
    p.add_argument("--plot-only", type=Path, default=None, metavar="JSON", help="redraw and reprint a record")
    p.add_argument("--update", action="store_true",
                   help="rerun only --configs and replace their runs in the existing --json record (same sizes, "
                   "seeds and data), keeping the other configurations; the record lists each update")  # fmt: skip
    args = p.parse_args(argv)
    size = dict(SIZES["quick" if args.quick else "full"])
    for key in size:
        given = getattr(args, key, None)
        if given is not None:
            size[key] = given
    args.size = size
    if args.output_dir is None:
        args.output_dir = REPO / "outputs" / ("benchmark_memory_quick" if args.quick else "benchmark_memory")
    if args.json is None:
        args.json = args.output_dir / "memory.json" if args.quick else REPO / "docs" / "benchmarks" / "memory.json"
    if args.plot is None:
        args.plot = args.output_dir / "memory.png" if args.quick else REPO / "docs" / "images" / "memory.png"
    bad = [m for m in size["eval_mem_lens"] if m != 0 and m < size["rate"]]
    if bad:
        p.error(f"--eval-mem-lens: {bad} below the compression rate {size['rate']} (mem_len >= rate; 0 = no memory)")
    if size["window"] % size["segment"] or size["eval_doc_tokens"] % size["segment"]:
        p.error("--window and --eval-doc-tokens must be multiples of --segment")
    if not 0 < args.validation < 1:
        p.error("--validation must be a fraction between 0 and 1")
    return args


def new_record(argv: list[str], args, configs: dict, kinds: dict, data: tuple) -> dict:
    """The record's frame before any run: command, versions, machine, sizes, data, evaluation protocol."""
    import transformers

    size = args.size
    eval_docs, validation_docs, train_bytes = data
    tokens = size["steps"] * size["batch"] * size["window"]
    return {
        "command": "python benchmarks/benchmark_memory.py " + shlex.join(argv),
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "complete": False,
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "machine": {
            "processor": platform.processor() or platform.machine(),
            "threads": args.threads,
            "device": "cuda" if torch.cuda.is_available() and not args.cpu else "cpu",
        },
        "seeds": args.seeds,
        "sizes": size,
        "budget": {"steps": size["steps"], "batch": size["batch"], "window": size["window"], "tokens_per_run": tokens},
        "data": {
            "kjv": {"file": args.kjv.name, "books": len(kinds["kjv"]), "bytes": sum(len(t) for _, t in kinds["kjv"])},
            "python": {
                "folder": str(args.python_dir),
                "files": [n for n, _ in kinds["python"]],
                "bytes": sum(len(t) for _, t in kinds["python"]),
                "min_bytes": size["min_doc_bytes"],
            },
            "validation_fraction": args.validation,
            "validation_documents": validation_docs,
            "training_bytes": train_bytes,
        },
        "evaluation": {
            "documents": eval_docs,
            "bytes_per_document": size["eval_doc_tokens"],
            "scored_bytes_per_document": size["eval_doc_tokens"] - size["eval_doc_tokens"] // size["segment"],
            "mem_lens": size["eval_mem_lens"],
            "protocol": "each document from an empty memory carried across it; the first token of each "
            "segment is not scored; c_mem_len scaled with mem_len as trained (txl: 0)",
        },
        "configs": configs,
        "runs": {name: {} for name in configs},
    }


def main(argv=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.plot_only:
        report = json.loads(args.plot_only.read_text())
        print(tables(report))
        plot(report, args.plot)
        return report
    size = args.size
    configs = configurations(size, args.configs)
    if not args.kjv.is_file():
        raise SystemExit(f"no such file: {args.kjv} (the King James Bible is expected in ../shared/data)")
    kinds = {"kjv": kjv_books(args.kjv), "python": python_files(args.python_dir, size["python_files"],
                                                                size["min_doc_bytes"])}  # fmt: skip
    docs = interleave(kinds)
    corpus_dir = args.output_dir / "corpus"
    write_corpus(docs, corpus_dir)
    rows, eval_docs, train_bytes, validation_docs = evaluation_rows(
        corpus_dir, docs, args.validation, size["eval_docs"], size["eval_doc_tokens"]
    )
    row_kinds = [d["kind"] for d in eval_docs]
    tokens = size["steps"] * size["batch"] * size["window"]
    print(f"corpus: {len(kinds['kjv'])} Bible books ({sum(len(t) for _, t in kinds['kjv']):,} bytes) + "
          f"{len(kinds['python'])} Python files ({sum(len(t) for _, t in kinds['python']):,} bytes); "
          f"{train_bytes:,} training bytes; validation documents: {validation_docs}; evaluated: {len(eval_docs)} x "
          f"{size['eval_doc_tokens']} bytes ({', '.join(sorted(set(row_kinds)))})")  # fmt: skip
    print(f"model {size['layers']} x {size['hidden']}, {size['heads']} heads, segment {size['segment']}; "
          f"budget per run: {size['steps']} steps x {size['batch']} x {size['window']} = {tokens:,} tokens; "
          f"{len(configs)} configurations x {len(args.seeds)} seeds")  # fmt: skip
    report = new_record(argv, args, configs, kinds, (eval_docs, validation_docs, train_bytes))
    if args.update:
        report = updated_record(report, args.json)
    from longrange.commands import evaluate, train

    started, total = time.perf_counter(), len(configs) * len(args.seeds)
    done = 0
    # seed-major: a record stopped early still compares every configuration
    for seed in args.seeds:
        for name, info in configs.items():
            done += 1
            print(f"\n[{done}/{total}] {name}, seed {seed}: {info['description']}", flush=True)
            out = args.output_dir / "runs" / f"{name}-seed{seed}"
            run = train_run(train, info, size, args, seed, corpus_dir, out)
            evaluated, evaluated_cpu = time.perf_counter(), time.process_time()
            run.update(evaluate_run(evaluate, out / "model", rows, row_kinds, info, size, size["eval_mem_lens"],
                                    report["machine"]["device"]))  # fmt: skip
            run["eval_seconds"] = time.perf_counter() - evaluated
            run["eval_cpu_seconds"] = time.process_time() - evaluated_cpu
            report["runs"][name][str(seed)] = run
            print(f"[{done}/{total}] {name}, seed {seed}: validation {run['bits_per_byte']:.4f} bits/byte "
                  f"({run['train_seconds']:.0f} s training, {run['train_cpu_seconds']:.0f} s CPU; "
                  f"{run['eval_seconds']:.0f} s evaluation)", flush=True)  # fmt: skip
            finish(report, args)  # the record so far, in case the run is stopped
    if args.update:
        report["updates"][-1]["seconds"] = time.perf_counter() - started
    else:
        report["complete"] = True
        report["total_seconds"] = time.perf_counter() - started
    finish(report, args)
    print()
    print(tables(report))
    plot(report, args.plot)
    seconds = report["updates"][-1]["seconds"] if args.update else report["total_seconds"]
    print(f"\nwrote {args.json} and {args.plot} ({seconds / 60:.1f} minutes)")
    return report


if __name__ == "__main__":
    main()
