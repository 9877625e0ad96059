"""Cost against sequence length, next to full attention: training step and decoding, batch 1.

    python benchmarks/benchmark_scaling.py --device cpu          # CPU: training 512 .. 16,384 tokens, decoding 512 .. 16,384
    python benchmarks/benchmark_scaling.py --device cuda         # CUDA: training up to 65,536 tokens
    python benchmarks/benchmark_scaling.py --quick --json /tmp/scaling.json --plot /tmp/scaling.png   # smoke run (CI)
    python benchmarks/benchmark_scaling.py --rows 'train/(llama|sinkhorn)/' --lengths 512 1024 --json /tmp/part.json
    python benchmarks/benchmark_scaling.py --plot-only docs/benchmarks/scaling.json   # redraw the plot, reprint tables

Models, all of the same width, depth and heads (default hidden 256, 2 layers, 4 heads, vocabulary 256 (the
reused builders' byte-level vocabulary), feed-forward 4 x hidden; Llama's SwiGLU 8/3 x hidden, parameter-matched):
- `sinkhorn`: longrange `SinkhornForCausalLM` (bucket `--bucket`, the benchmark_sinkhorn options `COMMON`).
- `sortcut`: longrange `SinkhornForMaskedLM`, non-causal with SortCut (`n_sortcut=--n-sortcut`), same options;
  trained on the same-token cross-entropy (benchmark_sinkhorn's `lm_loss(causal=False)`). Training only.
- `compressive`: longrange `CompressiveForCausalLM` (segment / memory / compressed memory / rate), trained on the
  whole length as one forward, which runs its segments one after the other, carrying the memories.
- `reference`: sinkhorn-transformer 0.11.4 `SinkhornTransformerLM`, causal, the same option dict as `sinkhorn`.
  Training only; recorded as skipped when the package (the `bench` extra) is not installed.
- `llama`: transformers' `LlamaForCausalLM`, `attn_implementation="sdpa"` (full causal attention): the baseline.
The builders are those of benchmark_gpu.py (`build_step`, `llama`), benchmark_decoding.py (`build`) and
benchmark_sinkhorn.py (`build`, `COMMON`, `lm_loss`, `PeakMeter`).

Rows: `train/<model>/<length>` (forward + loss + backward + AdamW step) and `decode/<model>/<context>` (sinkhorn,
compressive, llama). Every row runs in a FRESH subprocess of this script (`--worker`), so its peak memory is its
own and a crash or an out-of-memory kill loses only that row; rows run in order of length, so `--budget` (seconds;
checked before each row starts, a running row is not cut short) stops the run early with the rest recorded as
skipped. A row has `--row-timeout` seconds (the subprocess group is then killed: `"error": "timeout after N s"`);
a row killed by a signal (on Linux, SIGKILL is most often the out-of-memory killer) or out of CUDA memory is
recorded as such. Once a model runs out of time or memory at one length, its longer rows of the same kind are
recorded as skipped with that reason (`--no-skip-longer` runs them anyway). `--json` is rewritten after every row.

Training: `--warmup` steps, then `--repeats` timed steps (wall clock, `torch.cuda.synchronize()` around each on
CUDA); time per token = median step time / (batch x length). Peak memory: on the CPU, the peak resident-set
increase over the worker's baseline after building the model and inputs (benchmark_sinkhorn's `PeakMeter`:
VmHWM after resetting it through /proc/self/clear_refs, or VmRSS sampled every millisecond where that file cannot
be written) over the warm-up and timed steps: activations, gradients, AdamW state and temporaries, not weights; on
CUDA, `torch.cuda.max_memory_allocated()` over the same steps (weights included: a few MiB at these sizes).
Precision: fp32 on the CPU; on CUDA by default bf16 (fp32 weights, forward under `torch.autocast(bfloat16)`), or
`--precision fp32` (TF32 matrix products).

Decoding: a random prompt of the context length, then greedy `generate(max_new_tokens=--new-tokens)` (min equal),
as generate() does by default (`--decode-compile auto`): Llama with `cache_implementation="static"`, ours with
their own caches; on CUDA generate() then compiles the decoding step (static-shape caches) by itself, on the CPU it
does not (the JSON records, per row, whether anything was compiled; `never` / `always` force it off / on). One
untimed generate() call of the same length warms up (and compiles), then one timed call with a streamer that
stamps every emitted token: the steps are timed directly, time per new token = the median gap between
consecutive tokens after the first (whose time is the prompt's forward, `prefill_s`); the mean gap is recorded too.
Weights in bf16 with `--precision bf16` (the CUDA default), else fp32.

Crossover: for each of our models and each measure (training time per token, training peak memory, decoding time
per token), the shortest measured length L such that the model is cheaper than Llama at L and at every longer
measured length, or 'none in range' (a row out of time or memory, or skipped after one, counts as infinitely
expensive; lengths where either side is unmeasured, or both failed, are left out). Printed at the end with one
table per measure (value per length, and each model's ratio to Llama) and stored under "crossovers".

Output: `--json` (default docs/benchmarks/scaling.json) and `--plot` (default docs/images/scaling.png; matplotlib
Agg, log-log, one panel per measure, drawn from the JSON), neither by default with --quick. `--plot-only JSON`
redraws the plot from a JSON and reprints its tables and crossovers.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import math
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

VOCAB = 256  # the reused builders' (benchmark_gpu.llama, benchmark_decoding.build, benchmark_compressive.build)
SEEDS = {"model": 0, "data": 1}  # torch.manual_seed before building (the builders'), torch.Generator of the inputs
TRAIN_MODELS = ("llama", "sinkhorn", "sortcut", "compressive", "reference")
DECODE_MODELS = ("llama", "sinkhorn", "compressive")
NAMES = {
    "llama": "Llama (SDPA, full attention)",
    "sinkhorn": "Sinkhorn causal (ours)",
    "sortcut": "Sinkhorn non-causal, SortCut (ours)",
    "compressive": "Compressive (ours)",
    "reference": "sinkhorn-transformer 0.11.4 (causal)",
}
# the three measures of the plot and the crossovers: (row kind, field, label, unit, scale from the field's unit)
MEASURES = {
    "train_time": ("train", "time_per_token_s", "training time per token", "µs", 1e6),
    "train_memory": ("train", "peak_memory_mib", "training peak memory", "MiB", 1.0),
    "decode_time": ("decode", "time_per_token_s", "decoding time per new token", "ms", 1e3),
}
OURS = {"train": ("sinkhorn", "sortcut", "compressive"), "decode": ("sinkhorn", "compressive")}
FAILED = ("timeout", "oom", "killed")  # statuses that count as "too expensive" (infinite cost)
REFERENCE_MISSING = "skipped: sinkhorn_transformer is not installed (the bench extra: pip install -e '.[bench]')"


def _sibling(name: str):
    """A benchmark of this folder as a module (loaded once), by path: also when this file itself was loaded by path,
    as the tests do."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@dataclass(frozen=True)
class Row:
    kind: str  # train | decode
    model: str  # llama | sinkhorn | sortcut | compressive | reference
    length: int  # training length, or decoding context

    @property
    def id(self) -> str:
        return f"{self.kind}/{self.model}/{self.length}"


def plan(size: dict) -> list[Row]:
    """Every row, by length (training before decoding at a length, Llama first)."""
    rows = [Row("train", m, n) for n in size["lengths"] for m in TRAIN_MODELS]
    rows += [Row("decode", m, n) for n in size["contexts"] for m in DECODE_MODELS]
    order = {"train": 0, "decode": 1}
    return sorted(rows, key=lambda r: (r.length, order[r.kind]))


def reference_available() -> bool:
    return importlib.util.find_spec("sinkhorn_transformer") is not None


# ----------------------------------------------------------------------------------------------------------
# worker side: one row in this (fresh) process


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward_context(device: torch.device, precision: str):
    if precision == "bf16":
        return lambda: torch.autocast(device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext


def sortcut_step(length: int, size: dict, device: torch.device, precision: str, compile_kwargs: dict | None):
    """(model, step) of the non-causal SortCut model, built like benchmark_gpu.build_step builds the causal one."""
    bench = _sibling("benchmark_sinkhorn")
    width, s = size["width"], size["sinkhorn"]
    opts = dict(
        num_tokens=VOCAB, dim=width["hidden"], depth=width["layers"], heads=width["heads"], bucket_size=s["bucket"],
        **bench.COMMON, causal=False, n_sortcut=s["n_sortcut"], max_seq_len=length,
    )  # fmt: skip
    model, forward = bench.build("ours", opts, for_mlm=True)
    generator = torch.Generator().manual_seed(SEEDS["data"])
    ids = torch.randint(0, VOCAB, (size["batch"], length + 1), generator=generator)[:, :length].to(device)
    model.to(device)
    if compile_kwargs is not None:
        model.compile(**compile_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    context = forward_context(device, precision)

    def step():
        with context():
            loss = bench.lm_loss(forward(ids), ids, False)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def build_train(row: Row, size: dict, device: torch.device, precision: str, compile_kwargs: dict | None):
    if row.model == "sortcut":
        return sortcut_step(row.length, size, device, precision, compile_kwargs)
    gpu = _sibling("benchmark_gpu")
    family, side = {
        "llama": ("llama", "llama"),
        "sinkhorn": ("sinkhorn", "ours"),
        "reference": ("sinkhorn", "reference"),
        "compressive": ("compressive", "ours"),
    }[row.model]
    gpu_row = gpu.Row(family, side, "bf16" if precision == "bf16" else "tf32",
                      "eager" if compile_kwargs is None else "compiled", size["batch"], row.length)  # fmt: skip
    return gpu.build_step(gpu_row, size, device, compile_kwargs)


class CudaPeak:
    def __init__(self, device: torch.device):
        self.device = device
        self.method = "torch.cuda.max_memory_allocated"

    def __enter__(self):
        sync(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        self.baseline_mib = torch.cuda.memory_allocated(self.device) / 2**20
        return self

    def __exit__(self, *exc):
        sync(self.device)
        self.peak_mib = torch.cuda.max_memory_allocated(self.device) / 2**20
        return False


def run_train(row: Row, spec: dict) -> dict:
    device = torch.device(spec["device"])
    compile_kwargs = {"backend": spec["compile_backend"]} if spec["compile"] else None
    size = spec["size"]
    model, step = build_train(row, size, device, spec["precision"], compile_kwargs)
    out = {"parameters": sum(p.numel() for p in model.parameters())}
    model.train()
    times, cpu_times = [], []
    meter = CudaPeak(device) if device.type == "cuda" else _sibling("benchmark_sinkhorn").PeakMeter()
    with meter:
        start = time.perf_counter()
        for _ in range(spec["warmup"]):
            step()
        sync(device)
        out["warmup_s"] = time.perf_counter() - start
        for _ in range(spec["repeats"]):
            sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            step()
            sync(device)
            times.append(time.perf_counter() - t0)
            cpu_times.append(time.process_time() - c0)
    tokens = size["batch"] * row.length
    median = statistics.median(times)
    out.update(
        step_s=times,
        cpu_step_s=cpu_times,
        median_step_s=median,
        time_per_token_s=median / tokens,
        tokens_per_s=tokens / median,
        peak_memory_mib=meter.peak_mib,
        memory_method=meter.method,
    )
    if device.type == "cuda":
        out["memory_before_steps_mib"] = meter.baseline_mib
    return out


def decode_kwargs(row: Row, device: torch.device, policy: str, backend: str) -> dict:
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)
    if row.model == "llama":
        kwargs["cache_implementation"] = "static"
    if policy == "never":
        kwargs["disable_compile"] = True
    elif policy == "always":  # what generate() does by itself on CUDA, asked for on any device (benchmark_decoding)
        from transformers import CompileConfig

        config = CompileConfig(backend=backend, mode="reduce-overhead" if backend == "inductor" else None)
        config._compile_all_devices = True
        kwargs["compile_config"] = config
    return kwargs


def run_decode(row: Row, spec: dict) -> dict:
    decoding = _sibling("benchmark_decoding")
    device, size = torch.device(spec["device"]), spec["size"]
    count = size["new_tokens"]
    family, side = ("llama", "llama") if row.model == "llama" else (row.model, "ours")
    # benchmark_decoding.build sizes the positions for the longest context of `contexts` plus the new tokens
    model = decoding.build(decoding.Row(family, side, "eager", row.length), {**size, "contexts": [row.length]})
    dtype = torch.bfloat16 if spec["precision"] == "bf16" else torch.float32
    model.to(device=device, dtype=dtype)
    out = {"parameters": sum(p.numel() for p in model.parameters()), "dtype": str(dtype).replace("torch.", "")}
    generator = torch.Generator().manual_seed(SEEDS["data"])
    # from 1: generate() reads a 0 (the pad id it is given) in the prompt as padding
    prompt = torch.randint(1, VOCAB, (1, row.length), generator=generator).to(device)
    kwargs = decode_kwargs(row, device, spec["decode_compile"], spec["compile_backend"])
    graphs = decoding.compiled_graphs()
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=count, min_new_tokens=count, **kwargs)
    sync(device)
    out["warmup_s"] = time.perf_counter() - start
    out["compiled"] = decoding.compiled_graphs() > graphs
    if spec["decode_compile"] == "always" and not out["compiled"]:
        raise RuntimeError("generate() compiled nothing: the model's cache is not compileable")
    stamps = decoding.Stamps()
    start = time.perf_counter()
    generated = model.generate(prompt, max_new_tokens=count, min_new_tokens=count, streamer=stamps, **kwargs)
    sync(device)
    total = time.perf_counter() - start
    if generated.shape[1] != row.length + count:
        raise RuntimeError(f"generated {generated.shape[1] - row.length} tokens, asked for {count}")
    # stamps[0]: the prompt handed to the streamer; stamps[1]: the first new token (the prompt's forward); then one
    # stamp per cached decoding step
    gaps = [b - a for a, b in zip(stamps.stamps[1:], stamps.stamps[2:])]
    median = statistics.median(gaps)
    return {
        **out,
        "new_tokens": count,
        "prefill_s": stamps.stamps[1] - start,
        "per_token_s": gaps,
        "time_per_token_s": median,
        "mean_token_s": statistics.fmean(gaps),
        "total_s": total,
    }


def describe_error(exc: BaseException) -> str:
    first = next((line for line in str(exc).strip().splitlines() if line.strip()), "")
    return f"error: {type(exc).__name__}: {first[:500]}"


def worker(spec: dict) -> dict:
    if spec["threads"]:
        torch.set_num_threads(spec["threads"])
    if spec["device"].startswith("cuda") and spec["precision"] == "fp32":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    row = Row(**spec["row"])
    try:
        result = run_train(row, spec) if row.kind == "train" else run_decode(row, spec)
        return {"status": "ok", **result, "threads": torch.get_num_threads()}
    except Exception as exc:  # noqa: BLE001 - a row's failure is its result
        oom = isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()
        return {"status": "oom" if oom else "error", "error": describe_error(exc)}


# ----------------------------------------------------------------------------------------------------------
# driver side


def run_row(spec: dict, timeout: float) -> dict:
    """The row in a fresh subprocess of this script (its own process group, killed whole on timeout)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if spec["threads"]:
        env["OMP_NUM_THREADS"] = str(spec["threads"])
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", json.dumps(spec)]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException as exc:  # out of time, or interrupted: the worker must not outlive the row
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        if not isinstance(exc, subprocess.TimeoutExpired):
            raise
        return {"status": "timeout", "error": f"timeout after {timeout:.0f} s"}
    lines = [line for line in stdout.splitlines() if line.startswith("RESULT ")]
    if lines:
        return json.loads(lines[-1][len("RESULT ") :])
    tail = (stderr or stdout).strip()[-2000:]
    if proc.returncode < 0:
        name = signal.Signals(-proc.returncode).name
        why = " (on Linux most often the out-of-memory killer)" if name == "SIGKILL" else ""
        return {"status": "killed", "error": f"killed by {name}{why}", "stderr_tail": tail}
    last = tail.splitlines()[-1] if tail else ""
    return {"status": "error", "error": f"worker failed (rc={proc.returncode}): {last[:500]}", "stderr_tail": tail}


def cost(rows: dict, kind: str, model: str, length: int, field: str) -> float | None:
    """A row's value of `field`; infinite when it ran (or would have run) out of time or memory; None unmeasured."""
    r = rows.get(f"{kind}/{model}/{length}")
    if r is None:
        return None
    if r.get(field) is not None:
        return r[field]
    if r.get("status") in FAILED or r.get("implied") in FAILED:
        return math.inf
    return None


def lengths_of(rows: dict, kind: str) -> list[int]:
    return sorted({r["row"]["length"] for r in rows.values() if r["row"]["kind"] == kind})


def crossovers(rows: dict) -> dict:
    """Per measure and model of ours: the shortest measured length from which it is cheaper than Llama."""
    out = {}
    for measure, (kind, field, *_) in MEASURES.items():
        for model in OURS[kind]:
            compared = []
            for n in lengths_of(rows, kind):
                ours, llama = cost(rows, kind, model, n, field), cost(rows, kind, "llama", n, field)
                if ours is None or llama is None or ours == llama == math.inf:
                    continue
                compared.append((n, ours < llama))
            crossover = None
            for n, cheaper in reversed(compared):
                if not cheaper:
                    break
                crossover = n
            if not compared:
                text = "not measured"
            elif crossover is None:
                text = "none in range"
            elif crossover == compared[0][0]:
                text = f"from {crossover:,} tokens (cheaper at every length measured)"
            else:
                text = f"from {crossover:,} tokens"
            out[f"{measure}/{model}"] = {
                "measure": measure,
                "model": model,
                "crossover": crossover,
                "text": text,
                "compared_lengths": [n for n, _ in compared],
                "cheaper_at": [n for n, cheaper in compared if cheaper],
            }
    return out


def cell(r: dict | None, field: str, scale: float) -> str:
    if r is None:
        return ""
    if r.get(field) is not None:
        value = r[field] * scale
        return f"{value:,.0f}" if value >= 100 else f"{value:.1f}" if value >= 10 else f"{value:.2f}"
    return r.get("status", "") if r.get("status") != "skipped" else "skipped"


def tables(rows: dict) -> str:
    """One markdown table per measure: Llama's value, each model's value and its ratio to Llama, per length."""
    blocks = []
    for kind, field, label, unit, scale in MEASURES.values():
        models = TRAIN_MODELS if kind == "train" else DECODE_MODELS
        others = [m for m in models if m != "llama"]
        lines = [
            f"### {label} ({unit}; ratio = model / Llama)",
            "",
            "| length | llama | " + " | ".join(f"{m} | {m} / llama" for m in others) + " |",
            "|---:|---:|" + "---:|---:|" * len(others),
        ]
        for n in lengths_of(rows, kind):
            llama = cost(rows, kind, "llama", n, field)
            cells = [f"{n:,}", cell(rows.get(f"{kind}/llama/{n}"), field, scale)]
            for m in others:
                mine = cost(rows, kind, m, n, field)
                ratio = mine / llama if mine is not None and llama and math.isfinite(llama) and llama > 0 else None
                cells += [cell(rows.get(f"{kind}/{m}/{n}"), field, scale), "" if ratio is None else f"{ratio:.2f}"]
            lines.append("| " + " | ".join(cells) + " |")
        blocks.append("\n".join(lines))
    return "\n\n".join(blocks)


def summary_lines(found: dict) -> list[str]:
    return [f"- {MEASURES[c['measure']][2]}, {c['model']}: {c['text']}" for c in found.values()]


def plot(payload: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogFormatter

    rows = payload["rows"]
    fig, axes = plt.subplots(1, len(MEASURES), figsize=(6 * len(MEASURES), 5.2))
    colors = {"llama": "black", "sinkhorn": "tab:blue", "sortcut": "tab:green", "compressive": "tab:orange",
              "reference": "tab:red"}  # fmt: skip
    for ax, (kind, field, label, unit, scale) in zip(axes, MEASURES.values()):
        lengths = lengths_of(rows, kind)
        measured, failed = [], []
        for model in TRAIN_MODELS if kind == "train" else DECODE_MODELS:
            points = [(n, cost(rows, kind, model, n, field)) for n in lengths]
            xs = [n for n, v in points if v is not None and math.isfinite(v) and v > 0]
            ys = [v * scale for n, v in points if v is not None and math.isfinite(v) and v > 0]
            style = dict(color=colors[model], marker="o", markersize=4, label=NAMES[model])
            if model == "llama":
                style["linestyle"] = "--"
            if xs:
                ax.plot(xs, ys, **style)
                measured += ys
            failed += [(n, model) for n, v in points if v == math.inf]
        if failed and measured:  # out of time or memory: an x above the highest measured point
            top = max(measured) * 2
            for n, model in failed:
                ax.plot([n], [top], marker="x", color=colors[model], markersize=8, linestyle="none")
            ax.annotate("x: out of time or memory", (0.02, 0.97), xycoords="axes fraction", va="top", fontsize=8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(LogFormatter())  # plain numbers; minor ticks labelled over a small range
        ax.yaxis.set_minor_formatter(LogFormatter(minor_thresholds=(2, 0.5)))
        if lengths:
            ax.set_xticks(lengths, [f"{n // 1024}k" if n >= 1024 and n % 1024 == 0 else str(n) for n in lengths])
        ax.set_xlabel("context length (decoding)" if kind == "decode" else "sequence length (tokens)")
        ax.set_ylabel(f"{label} ({unit})")
        ax.set_title(label)
        ax.grid(True, which="both", alpha=0.3)
    handles, labels = [], []
    for ax in axes:
        for h, lab in zip(*ax.get_legend_handles_labels()):
            if lab not in labels:
                handles.append(h)
                labels.append(lab)
    if handles:
        fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    s, machine = payload["sizes"], payload["machine"]
    w = s["width"]
    fig.suptitle(
        f"{machine['device']} ({payload['settings']['precision']}); hidden {w['hidden']}, {w['layers']} layers, "
        f"{w['heads']} heads, batch {s['batch']}; Sinkhorn bucket {s['sinkhorn']['bucket']}; Compressive segment "
        f"{s['compressive']['segment']}, memory {s['compressive']['mem']} + {s['compressive']['c_mem']}",
        fontsize=10,
    )
    fig.tight_layout(rect=(0, 0.08, 1, 0.95))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.partition(":")[2].strip()
    return platform.processor() or "cpu"


def machine(device: torch.device) -> dict:
    meminfo = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            key, _, value = line.partition(":")
            meminfo[key] = value.strip()
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_name(),
        "device_type": device.type,
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "memory": meminfo.get("MemTotal"),
        "cuda_memory_gib": torch.cuda.get_device_properties(device).total_memory / 2**30
        if device.type == "cuda"
        else None,
    }


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("transformers", "sinkhorn-transformer", "matplotlib"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    try:
        out["longrange_commit"] = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
        status = subprocess.run(["git", "status", "--porcelain", "--", "longrange", "benchmarks"], cwd=REPO,
                                capture_output=True, text=True, check=True).stdout  # fmt: skip
        out["longrange_uncommitted_changes"] = bool(status.strip())  # in the package or the benchmarks
    except (OSError, subprocess.CalledProcessError):
        out["longrange_commit"] = out["longrange_uncommitted_changes"] = None
    return out


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("--quick", action="store_true", help="tiny sizes (hidden 64, bucket 16, segment 32), lengths and contexts 64 "
        "and 128, 4 new tokens, 1 timed step, 1 thread: a smoke run (CI)")  # fmt: skip
    add("--json", type=Path, default=None, help="JSON to write, after every row (default docs/benchmarks/"
        "scaling.json; none with --quick)")  # fmt: skip
    add("--plot", type=Path, default=None, help="PNG to draw (default docs/images/scaling.png; none with --quick)")
    add("--plot-only", type=Path, default=None, metavar="JSON", help="redraw the plot from this JSON and print its "
        "tables and crossovers; runs nothing")  # fmt: skip
    add("--rows", default=None, help="regular expression: run only the rows whose id (e.g. train/llama/4096, "
        "decode/sinkhorn/512) it matches")  # fmt: skip
    add("--lengths", type=int, nargs="+", default=None, help="training lengths (default 512 .. 16,384 on the CPU, "
        ".. 65,536 on CUDA, doubling)")  # fmt: skip
    add("--contexts", type=int, nargs="+", default=None, help="decoding contexts (default 512 .. 16,384, doubling)")
    add("--new-tokens", type=int, default=None, help="new tokens per generate() call (default 32)")
    add("--hidden", type=int, default=None, help="default 256")
    add("--layers", type=int, default=None, help="default 2")
    add("--heads", type=int, default=None, help="default 4")
    add("--bucket", type=int, default=None, help="Sinkhorn bucket_size (default 64)")
    add("--n-sortcut", type=int, default=2, help="SortCut buckets of the non-causal model (default 2)")
    add("--segment", type=int, default=None, help="Compressive segment_length (default 512)")
    add("--mem", type=int, default=None, help="Compressive mem_len (default 512)")
    add("--c-mem", type=int, default=None, help="Compressive c_mem_len (default 128)")
    add("--rate", type=int, default=4, help="Compressive compression_rate (default 4)")
    add("--batch", type=int, default=1, help="training batch (default 1; decoding is always batch 1)")
    add("--precision", choices=("fp32", "bf16"), default=None, help="default bf16 on CUDA (autocast; bf16 weights "
        "for decoding), fp32 on the CPU")  # fmt: skip
    add("--warmup", type=int, default=1, help="untimed training steps per row (default 1)")
    add("--repeats", type=int, default=None, help="timed training steps per row, median reported (default 3; "
        "quick 1)")  # fmt: skip
    add("--row-timeout", type=float, default=None, help="seconds one row may take (default 600; quick 300)")
    add("--budget", type=float, default=None, help="seconds after which no row starts (default: none)")
    add("--threads", type=int, default=None, help="torch CPU threads per worker (0: torch's default; default 0, "
        "quick 1)")  # fmt: skip
    add("--compile", action="store_true", help="training rows with model.compile() (default eager)")
    add("--compile-backend", default="inductor", help="torch.compile backend (--compile, --decode-compile)")
    add("--decode-compile", choices=("auto", "never", "always"), default="auto", help="auto: as generate() does "
        "by itself (compiles the decoding step on CUDA only); never / always: force it (default auto)")  # fmt: skip
    add("--no-skip-longer", dest="skip_longer", action="store_false", help="run a model's longer rows even after "
        "it ran out of time or memory at a shorter length")  # fmt: skip
    add("--worker", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def sizes(args, device: torch.device) -> dict:
    quick = args.quick

    def pick(value, full, small):
        return value if value is not None else (small if quick else full)

    doubling = [512 * 2**i for i in range(8 if device.type == "cuda" else 6)]  # .. 65,536 / .. 16,384
    return {
        "width": {
            "hidden": pick(args.hidden, 256, 64),
            "layers": pick(args.layers, 2, 2),
            "heads": pick(args.heads, 4, 4),
        },
        "vocab": VOCAB,
        "batch": args.batch,
        "sinkhorn": {"bucket": pick(args.bucket, 64, 16), "n_sortcut": args.n_sortcut},
        "compressive": {
            "segment": pick(args.segment, 512, 32),
            "mem": pick(args.mem, 512, 32),
            "c_mem": pick(args.c_mem, 128, 8),
            "rate": args.rate,
        },
        "lengths": sorted(pick(args.lengths, doubling, [64, 128])),
        "contexts": sorted(pick(args.contexts, doubling[:6], [64, 128])),
        "new_tokens": pick(args.new_tokens, 32, 4),
    }


def metadata(size: dict, device: torch.device, settings: dict, argv) -> dict:
    """What the JSON says besides its rows: command line, date, machine, versions, sizes, seeds, method."""
    return {
        "command": [sys.executable, *sys.argv] if argv is None else [sys.executable, __file__, *argv],
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(device),
        **versions(),
        "settings": settings,
        "sizes": size,
        "seeds": SEEDS,
        # benchmark_gpu.llama_intermediate (not imported here: the driver does not import transformers)
        "llama_intermediate_size": max(64, round(8 * size["width"]["hidden"] / 3 / 64) * 64),
        "method": {
            "train": "median of --repeats timed steps (forward + loss + backward + AdamW) after --warmup, in a "
            "fresh subprocess per row; time_per_token_s = median step / (batch x length)",
            "train_memory": "CPU: peak RSS increase over the worker's baseline after building model and inputs "
            "(PeakMeter), over warm-up and timed steps; CUDA: torch.cuda.max_memory_allocated over the same steps",
            "decode": "greedy generate(), one warm-up call then one timed call; time_per_token_s = median gap "
            "between consecutive streamed tokens after the first (the steps timed directly)",
        },
    }


def report(payload: dict) -> None:
    print(tables(payload["rows"]))
    print("\nCrossover (shortest measured length from which the model is cheaper than Llama):")
    print("\n".join(summary_lines(payload["crossovers"])))


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.worker is not None:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return {}
    if args.plot_only is not None:
        payload = json.loads(args.plot_only.read_text())
        payload["crossovers"] = crossovers(payload["rows"])
        report(payload)
        target = args.plot or REPO / "docs" / "images" / "scaling.png"
        plot(payload, target)
        print(f"\nwrote {target}")
        return payload
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    if not args.quick:
        args.json = args.json or REPO / "docs" / "benchmarks" / "scaling.json"
        args.plot = args.plot or REPO / "docs" / "images" / "scaling.png"
    args.precision = args.precision or ("bf16" if device.type == "cuda" else "fp32")
    args.repeats = args.repeats if args.repeats is not None else (1 if args.quick else 3)
    args.row_timeout = args.row_timeout if args.row_timeout is not None else (300.0 if args.quick else 600.0)
    args.threads = args.threads if args.threads is not None else (1 if args.quick else 0)
    if args.warmup < 1 or args.repeats < 1 or args.new_tokens is not None and args.new_tokens < 2:
        raise SystemExit("--warmup and --repeats must be at least 1, --new-tokens at least 2")
    size = sizes(args, device)
    rows = [r for r in plan(size) if not args.rows or re.search(args.rows, r.id)]
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "worker"}
    spec = {k: settings[k] for k in ("device", "precision", "warmup", "repeats", "threads", "compile",
                                     "compile_backend", "decode_compile")}  # fmt: skip
    spec["size"] = size
    meta = metadata(size, device, settings, argv)
    results: dict[str, dict] = {}
    started = time.perf_counter()
    failed_at: dict[tuple[str, str], tuple[int, str]] = {}
    has_reference = reference_available()

    def write(final: bool) -> dict:
        payload = {**meta, "complete": final, "elapsed_s": time.perf_counter() - started, "rows": results,
                   "crossovers": crossovers(results)}  # fmt: skip
        if args.json:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(payload, indent=1) + "\n")
        return payload

    print(f"{meta['machine']['device']} | torch {meta['torch']} | transformers {meta['transformers']} | "
          f"{len(rows)} rows, row timeout {args.row_timeout:.0f} s, budget {args.budget or 'none'}", file=sys.stderr,
          flush=True)  # fmt: skip
    for row in rows:
        entry: dict = {"row": asdict(row)}
        earlier = failed_at.get((row.kind, row.model))
        if args.budget is not None and time.perf_counter() - started >= args.budget:
            entry.update(status="skipped", skipped=f"skipped: time budget of {args.budget:.0f} s spent")
        elif row.model == "reference" and not has_reference:
            entry.update(status="skipped", skipped=REFERENCE_MISSING)
        elif earlier is not None and args.skip_longer:
            entry.update(status="skipped", implied=earlier[1],
                         skipped=f"skipped: {earlier[1]} at {earlier[0]:,} tokens")  # fmt: skip
        else:
            t0 = time.perf_counter()
            entry.update(run_row({**spec, "row": asdict(row)}, args.row_timeout))
            entry["row_s"] = time.perf_counter() - t0
            if entry["status"] in FAILED:
                failed_at.setdefault((row.kind, row.model), (row.length, entry["status"]))
        results[row.id] = entry
        status = entry.get("error") or entry.get("skipped")
        if status is None and row.kind == "train":
            status = f"{entry['time_per_token_s'] * 1e6:,.1f} µs/token, peak {entry['peak_memory_mib']:,.1f} MiB"
        elif status is None:
            status = f"{entry['time_per_token_s'] * 1e3:,.2f} ms/new token (compiled: {entry['compiled']})"
        print(f"[{time.perf_counter() - started:6.0f} s] {row.id}: {status}", file=sys.stderr, flush=True)
        write(final=False)
    payload = write(final=True)
    print(f"\n{meta['machine']['device']}; torch {meta['torch']}, transformers {meta['transformers']}; "
          f"{args.precision}; {args.warmup} warm-up + {args.repeats} timed training steps; {size['new_tokens']} new "
          f"tokens per decoding row\n")  # fmt: skip
    report(payload)
    if args.json:
        print(f"\nwrote {args.json}")
    if args.plot:
        plot(payload, args.plot)
        print(f"wrote {args.plot}")
    return payload


if __name__ == "__main__":
    main()
