#!/usr/bin/env python
"""Quality side by side: validation bits per character on char-level Tiny Shakespeare (90/10 split by position).

    python benchmarks/benchmark_quality.py --quick       # tiny models, a few steps: checks that everything runs
    python benchmarks/benchmark_quality.py               # 6 layers, 256 wide, 100 steps (about 10 minutes on 2 cores)
    python benchmarks/benchmark_quality.py --models compressive --steps 500 --json results.json
    # issue 11's protocol (bucket 64, windows of 512), one side at a time, with config overrides for ours:
    python benchmarks/benchmark_quality.py --models sinkhorn --size issue11 --learning_rate 5e-4 --max_grad_norm 0.5 \
        --sides ours --config weight_routed_keys=True
    # mean and spread over seeds: in one process, or from runs made side by side (one --json per process)
    python benchmarks/benchmark_quality.py --models sinkhorn --size issue11 --steps 1200 --seeds 0 1 --json runs.json
    python benchmarks/benchmark_quality.py --summarize ours_s0.json ours_s1.json reference_s0.json reference_s1.json
    # the second corpus (enwik8-style bytes)
    python benchmarks/benchmark_quality.py --models sinkhorn --size issue11 --data ../shared/data/enwik8_small.xml

For each family the same size, steps, batch, window, optimizer (AdamW), learning-rate schedule (warm-up + cosine)
and gradient clipping are used on both sides:

* ours: `longrange train` itself (the default training loop: the Compressive model streams contiguous windows
  and carries its memory from step to step; Sinkhorn trains on shuffled windows);
* reference: compressive-transformer-pytorch 0.4.0 (its `AutoregressiveWrapper` loss, one backward per segment
  as in its training example; memories start empty in every window) and sinkhorn-transformer 0.11.4 (its `Autopadder`
  and the same shifted cross-entropy), fed the same batches in the same order.

Validation uses the same windows for everyone. Ours is reported twice where it matters: with the memory carried
across the whole validation text (how the model is meant to be used) and with a fresh memory per window (the
reference's setting), so the comparison is not flattered by context the reference never sees.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

REPO = Path(__file__).resolve().parents[1]
# from a checkout: the package next to this folder (the user commands are in it: longrange.commands)
sys.path.insert(0, str(REPO))
DEFAULT_DATA = REPO.parent / "shared" / "data" / "tinyshakespeare.txt"

SIZES = {
    # hidden, layers, heads, segment / bucket, window, batch, steps, eval tokens
    "full": dict(
        hidden=256, layers=6, heads=4, segment=64, bucket=32, window=128, batch=8, steps=100, eval_tokens=16384
    ),
    # the protocol of issue 11: 6 x 256, 4 heads, bucket 64, windows of 512, batch 8; 20 validation windows
    "issue11": dict(
        hidden=256, layers=6, heads=4, segment=128, bucket=64, window=512, batch=8, steps=400, eval_tokens=10240
    ),
    "quick": dict(hidden=32, layers=2, heads=2, segment=16, bucket=8, window=32, batch=4, steps=6, eval_tokens=1024),
}


def load_train_script():
    """`longrange train`'s module (longrange.commands.train)."""
    from longrange.commands import train

    return train


def validation_units(streams) -> dict[str, float]:
    """The validation split's bytes and characters per token, the conversions `longrange train` applies to our
    side: the reference side's losses go through the same ones, so bits per character compare like with like on
    text with multi-byte characters too (the byte tokenizer's tokens are bytes, not characters)."""
    return {"bytes_per_token": streams.bytes_per_token("validation"),
            "chars_per_token": streams.chars_per_token("validation")}  # fmt: skip


def ours(family: str, size: dict, args, workdir: Path) -> dict:
    """Train with longrange train; evaluate with and without the memory carried across validation windows."""
    from accelerate.state import AcceleratorState, GradientState

    from longrange.data import eval_windows, load_corpus, tokenize_corpus
    from longrange.tokenization import byte_tokenizer
    from longrange.training import evaluate_stream

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    common = [f"hidden_size={size['hidden']}", f"num_hidden_layers={size['layers']}",
              f"num_attention_heads={size['heads']}", f"intermediate_size={4 * size['hidden']}"]  # fmt: skip
    if family == "compressive":
        seg = size["segment"]
        config = [*common, f"segment_length={seg}", f"mem_len={seg}", f"c_mem_len={seg // 4}", "compression_rate=4"]
    else:
        config = [*common, f"bucket_size={size['bucket']}", f"max_position_embeddings={size['window']}"]
    out = workdir / f"ours-{family}"
    argv = ["--model", family, "--data", str(args.data), "--split", "0.9,0.1", "--tokenizer", "byte",
            "--window", str(size["window"]), "--batch_size", str(size["batch"]), "--max_steps", str(size["steps"]),
            "--learning_rate", str(args.learning_rate), "--eval_every", "0", "--eval_tokens", str(size["eval_tokens"]),
            "--eval_batch_size", "8", "--num_samples", "0", "--save_every", "0", "--seed", str(args.seed),
            "--num_threads", str(args.threads), "--max_grad_norm", str(args.max_grad_norm), "--log_every", "1",
            "--output_dir", str(out), "--config", *config, *args.config]  # fmt: skip
    started = time.perf_counter()
    result = load_train_script().main(argv)
    seconds = time.perf_counter() - started
    metrics = result["metrics"]
    losses = [record["lm_loss"] for record in result["train_history"]]
    row = {"bpc": metrics["bits_per_char"], "bits_per_byte": metrics["bits_per_byte"], "seconds": seconds,
           "parameters": result["parameters"], "train_loss_last20": float(np.mean(losses[-20:])),
           "train_loss": losses}  # fmt: skip
    if family == "compressive":
        # the reference's setting: memories start empty in every validation window
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(out / "model")
        corpus = load_corpus(args.data, split=(0.9, 0.1), as_bytes=True)
        streams = tokenize_corpus(corpus, byte_tokenizer())
        batches = eval_windows(streams.ids["validation"][: size["eval_tokens"]], size["window"], 8)
        fresh = evaluate_stream(model, batches, carry_cache=False, **validation_units(streams))
        row["bpc_memory_per_window"] = fresh["bits_per_char"]
    return row


def reference(family: str, size: dict, args) -> dict:
    """The reference package, trained on the batches ours sees, with the same optimizer and schedule."""
    from longrange.data import RandomWindowBatcher, StreamBatcher, eval_windows, load_corpus, tokenize_corpus
    from longrange.tokenization import byte_tokenizer
    from longrange.training import warmup_cosine

    torch.manual_seed(args.seed)
    corpus = load_corpus(args.data, split=(0.9, 0.1), as_bytes=True)
    streams = tokenize_corpus(corpus, byte_tokenizer())
    vocab = 259  # the byte tokenizer's size, as for ours
    window, batch = size["window"], size["batch"]
    if family == "compressive":
        from compressive_transformer_pytorch import AutoregressiveWrapper, CompressiveTransformer

        seg = size["segment"]
        net = CompressiveTransformer(num_tokens=vocab, dim=size["hidden"], depth=size["layers"], heads=size["heads"],
                                     seq_len=seg, mem_len=seg, cmem_len=seg // 4, cmem_ratio=4)  # fmt: skip
        model = AutoregressiveWrapper(net)
        batcher = StreamBatcher(streams.ids["train"], window, batch)

        def train_loss(x):
            # one backward per segment, as in the package's training example; losses averaged over segments
            segments = math.ceil((x.shape[1] - 1) / seg)
            total = 0.0
            for lm, aux, _ in model(x, return_loss=True):
                loss = (lm + aux) / segments
                loss.backward()
                total += float(lm.detach()) / segments
            return total

        @torch.no_grad()
        def eval_loss(x):
            losses = [float(lm) for lm, _, _ in model(x, return_loss=True)]
            return sum(losses) / len(losses)
    else:
        from sinkhorn_transformer import Autopadder, SinkhornTransformerLM

        net = SinkhornTransformerLM(num_tokens=vocab, dim=size["hidden"], depth=size["layers"], heads=size["heads"],
                                    bucket_size=size["bucket"], max_seq_len=window, causal=True)  # fmt: skip
        # The package's AutoregressiveWrapper would feed window - 1 tokens, not a bucket multiple; its Autopadder pads
        # them on the right (harmless for a causal model), and the shifted loss is the wrapper's own.
        model = Autopadder(net)
        batcher = RandomWindowBatcher(streams.ids["train"], window, batch, seed=args.seed)

        def shifted_loss(x):
            logits = model(x[:, :-1])
            return torch.nn.functional.cross_entropy(logits.transpose(1, 2), x[:, 1:])

        def train_loss(x):
            loss = shifted_loss(x)
            loss.backward()
            return float(loss.detach())

        @torch.no_grad()
        def eval_loss(x):
            return float(shifted_loss(x))

    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.learning_rate, betas=(0.9, 0.98), eps=1e-8)  # fmt: skip
    warmup = max(1, size["steps"] // 20)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(warmup, size["steps"], 0.1))
    started = time.perf_counter()
    model.train()
    losses = []
    progress = tqdm(range(size["steps"]), desc=f"train {family} (reference)", mininterval=2.0)
    for step in progress:
        losses.append(train_loss(batcher.batch(step)))
        torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        scheduler.step()
        progress.set_postfix(loss=f"{losses[-1]:.3f}", refresh=False)
    seconds = time.perf_counter() - started
    model.eval()
    batches = eval_windows(streams.ids["validation"][: size["eval_tokens"]], window, 8)
    bits = float(np.mean([eval_loss(x) for x in batches]) / math.log(2))  # per token (= per byte)
    units = validation_units(streams)
    return {
        "bpc": bits / units["chars_per_token"],
        "bits_per_byte": bits / units["bytes_per_token"],
        "seconds": seconds,
        "parameters": sum(p.numel() for p in net.parameters()),
        "train_loss_last20": float(np.mean(losses[-20:])),
        "train_loss": losses,
    }


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny models and a few steps (seconds)")
    p.add_argument("--models", nargs="*", default=["compressive", "sinkhorn"], choices=["compressive", "sinkhorn"])
    p.add_argument("--size", choices=sorted(SIZES), default="full", help="model and batch sizes (--quick: quick)")
    p.add_argument("--steps", type=int, default=None, help="override the optimizer steps")
    p.add_argument("--batch", type=int, default=None, help="override the batch size (both sides)")
    p.add_argument("--max_grad_norm", type=float, default=1.0, help="gradient clipping (both sides)")
    p.add_argument("--config", nargs="*", default=[], metavar="KEY=VALUE", help="config overrides for ours only")
    p.add_argument("--sides", nargs="+", default=["ours", "reference"], choices=["ours", "reference"])
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument(
        "--data",
        default=None,
        help="text file, or 'stdlib' (the Python standard library's sources); default: Tiny Shakespeare in "
        "../shared/data, with --quick the stdlib sources (a smoke run needs no data outside the repository)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeds", type=int, nargs="+", default=None,
                   help="several seeds, one after the other: a table of mean and spread over them follows")  # fmt: skip
    p.add_argument("--summarize", type=Path, nargs="+", default=None, metavar="JSON",
                   help="no training: mean and spread over seeds of earlier runs' --json files (for example one "
                   "process per seed and side, run side by side)")  # fmt: skip
    p.add_argument("--json", type=Path, default=None, help="also write the results here")
    p.add_argument("--seeds_done", action="store_true", help=argparse.SUPPRESS)  # (one seed of --seeds)
    p.add_argument("--threads", type=int, default=1, help="torch threads for both sides (1: fair on a shared CPU)")
    args = p.parse_args(argv)
    if args.summarize:
        summary = summarize([json.loads(path.read_text()) for path in args.summarize])
        if args.json:
            args.json.write_text(json.dumps(summary, indent=2))
        return summary
    if args.seeds and not args.seeds_done:
        runs = [main([*(argv if argv is not None else sys.argv[1:]), "--seed", str(seed), "--seeds_done"])
                for seed in args.seeds]  # fmt: skip
        summary = summarize(runs)
        if args.json:
            args.json.write_text(json.dumps({"runs": runs, "summary": summary}, indent=2))
        return summary
    torch.set_num_threads(args.threads)
    if args.data is None:
        args.data = "stdlib" if args.quick else str(DEFAULT_DATA)
    if args.data != "stdlib" and not Path(args.data).is_file():
        raise SystemExit(f"no such file: {args.data} (Tiny Shakespeare is expected in ../shared/data)")
    size = dict(SIZES["quick" if args.quick else args.size])
    if args.steps:
        size["steps"] = args.steps
    if args.batch:
        size["batch"] = args.batch
    print(
        f"{Path(args.data).name}, char level (byte tokenizer), 90/10 split; {size['layers']} layers x {size['hidden']} "
        f"wide, {size['heads']} heads, window {size['window']}, batch {size['batch']}, {size['steps']} steps, "
        f"lr {args.learning_rate}; validation on the first {size['eval_tokens']:,} bytes of the validation split"
    )
    results = {"data": Path(args.data).name, "size": size, "learning_rate": args.learning_rate,
               "max_grad_norm": args.max_grad_norm, "seed": args.seed, "config": args.config, "rows": []}  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for family in args.models:
            mine = ours(family, size, args, Path(tmp)) if "ours" in args.sides else None
            ref = reference(family, size, args) if "reference" in args.sides else None
            package = (
                "compressive-transformer-pytorch 0.4.0" if family == "compressive" else "sinkhorn-transformer 0.11.4"
            )
            results["rows"].append({"family": family, "ours": mine, "reference": ref, "reference_package": package})
    print()
    print("| model | implementation | parameters | validation bits/char | bits/byte | training time (s) |")
    print("| --- | --- | ---: | ---: | ---: | ---: |")
    for row in results["rows"]:
        mine, ref = row["ours"], row["reference"]
        label = "longrange (memory carried)" if row["family"] == "compressive" else "longrange"
        if mine:
            print(f"| {row['family']} | {label} | {mine['parameters']:,} | {mine['bpc']:.4f} | "
                  f"{mine['bits_per_byte']:.4f} | {mine['seconds']:.0f} |")  # fmt: skip
        if mine and "bpc_memory_per_window" in mine:
            print(
                f"| {row['family']} | longrange (fresh memory per window) | | {mine['bpc_memory_per_window']:.4f} | | |"
            )
        if ref:
            print(f"| {row['family']} | {row['reference_package']} | {ref['parameters']:,} | {ref['bpc']:.4f} | "
                  f"{ref['bits_per_byte']:.4f} | {ref['seconds']:.0f} |")  # fmt: skip
    if args.json and not args.seeds_done:  # (--seeds writes every seed's results at the end)
        args.json.write_text(json.dumps(results, indent=2))
    return results


def summarize(runs: list[dict]) -> list[dict]:
    """Mean and spread (min, max, sample standard deviation) of validation bits/char over seeds, for each corpus,
    family, side and config override; prints a markdown table."""
    groups: dict[tuple, dict] = {}
    for run in runs:
        for row in run["rows"]:
            for side in ("ours", "reference"):
                if not row.get(side):
                    continue
                config = " ".join(run.get("config") or []) if side == "ours" else ""
                name = "longrange" if side == "ours" else row["reference_package"]
                key = (run.get("data", "tinyshakespeare.txt"), row["family"], name, config, run["size"]["steps"])
                by_seed = groups.setdefault(key, {})
                if by_seed.get(run["seed"], row[side]["bpc"]) != row[side]["bpc"]:
                    raise SystemExit(f"two runs of {key} with seed {run['seed']} differ: pass each run once")
                by_seed[run["seed"]] = row[side]["bpc"]
    summary = []
    print()
    print("| corpus | model | implementation | steps | seeds | validation bits/char, mean | min - max | std |")
    print("| --- | --- | --- | ---: | --- | ---: | --- | ---: |")
    for (data, family, name, config, steps), by_seed in sorted(groups.items()):
        values = np.array([by_seed[seed] for seed in sorted(by_seed)])
        std = float(values.std(ddof=1)) if len(values) > 1 else None  # (one seed: no spread)
        label = f"{name} ({config})" if config else name
        seeds = ", ".join(str(seed) for seed in sorted(by_seed))
        print(f"| {data} | {family} | {label} | {steps} | {seeds} | {values.mean():.4f} | "
              f"{values.min():.4f} - {values.max():.4f} | {'-' if std is None else f'{std:.4f}'} |")  # fmt: skip
        summary.append({"data": data, "family": family, "implementation": name, "config": config, "steps": steps,
                        "bpc_by_seed": {str(k): v for k, v in sorted(by_seed.items())}, "bpc_mean": float(values.mean()),
                        "bpc_min": float(values.min()), "bpc_max": float(values.max()), "bpc_std": std})  # fmt: skip
    return summary


if __name__ == "__main__":
    main()
