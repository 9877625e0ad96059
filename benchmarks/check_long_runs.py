#!/usr/bin/env python
"""Long runs with the process's resident memory (RSS) sampled along the way: does anything grow per token or step?

    python benchmarks/check_long_runs.py --json docs/benchmarks/long_runs.json   # 20,000 tokens, 1,000 steps each
    python benchmarks/check_long_runs.py --quick                                 # small counts (the test runs this)

Three runs, one after the other in this process, each from a tiny randomly initialised model (weights do not matter
for memory; the token stream is a seeded random one, so nothing is read from disk):

* generation: `CompressiveForCausalLM.generate()`, greedy, batch 1, one call for `--tokens` new tokens. A streamer
  samples RSS every `--sample_tokens` tokens while it runs. The Compressive cache is bounded (at most `mem_len` +
  `c_mem_len` memories per layer), so RSS should be flat once the cache is full; only the output ids grow (8 bytes
  per token).
* Compressive training: `longrange.trainer.MemoryTrainer` on `StreamWindows`, the memory carried from step to step
  (how the model trains on a stream, README "Training with memory"), `--steps` optimizer steps; RSS sampled every
  `--sample_steps` steps by a Trainer callback.
* Sinkhorn training: `longrange.trainer.LongrangeTrainer` on independent windows (the Sinkhorn model keeps no memory
  between windows), the same number of steps and samples.

For each run the report gives the samples, the RSS at the first sample after the warm-up and at the end, and the
least-squares growth per token / per step over the samples after the warm-up (`--warmup` of the samples are left
out: allocator pools, first-call caches and the filling Compressive memory settle there).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

# from a checkout: the package next to this folder (the user commands are in it: longrange.commands)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VOCAB = 256


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small counts: 300 tokens, 20 steps (for the tests)")
    p.add_argument("--tokens", type=int, default=20_000, help="new tokens generated in one generate() call")
    p.add_argument("--sample_tokens", type=int, default=1_000, help="RSS sample every this many tokens")
    p.add_argument("--steps", type=int, default=1_000, help="optimizer steps of each training run")
    p.add_argument("--sample_steps", type=int, default=100, help="RSS sample every this many steps")
    p.add_argument("--warmup", type=int, default=2, help="samples left out of the growth fit")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads")
    p.add_argument("--skip", nargs="*", default=[], choices=["generation", "compressive", "sinkhorn"])
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    if args.quick:
        args.tokens, args.sample_tokens, args.steps, args.sample_steps = 300, 50, 20, 5
    for name in ("tokens", "sample_tokens", "steps", "sample_steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
    return args


def rss_mb() -> float:
    """Resident set size of this process in MiB (/proc/self/status VmRSS; psutil elsewhere)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def growth(samples: list[tuple[int, float]], warmup: int) -> dict:
    """Least-squares slope of RSS over the samples after `warmup` (KiB per unit), and the first/last of them."""
    kept = samples[warmup:] if len(samples) - warmup >= 2 else samples
    xs, ys = [float(x) for x, _ in kept], [y for _, y in kept]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mean_x) ** 2 for x in xs)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / var if var else 0.0
    return {
        "fit_from": int(kept[0][0]),
        "rss_mb_first": round(kept[0][1], 2),
        "rss_mb_last": round(kept[-1][1], 2),
        "rss_mb_max": round(max(ys), 2),
        "kib_per_unit": round(slope * 1024, 4),
    }


def compressive_config(**overrides):
    from longrange import CompressiveConfig

    settings = dict(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        segment_length=32,
        mem_len=32,
        c_mem_len=16,
        compression_rate=2,
    )
    return CompressiveConfig(**{**settings, **overrides})


def sinkhorn_config():
    from longrange import SinkhornConfig

    return SinkhornConfig(
        vocab_size=VOCAB,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        bucket_size=16,
        max_position_embeddings=64,
        causal=True,
    )


def generation_run(args) -> dict:
    from transformers.generation.streamers import BaseStreamer

    from longrange import CompressiveForCausalLM

    torch.manual_seed(args.seed)
    # a medium-sized memory: 4 layers of width 128, 128 memories + 64 compressed per layer
    config = compressive_config(
        hidden_size=128,
        num_hidden_layers=4,
        intermediate_size=512,
        segment_length=64,
        mem_len=128,
        c_mem_len=64,
        compression_rate=4,
    )
    model = CompressiveForCausalLM(config).eval()
    # from 1: generate() reads a 0 (pad_token_id below) in the prompt as padding
    prompt = torch.randint(1, VOCAB, (1, 16), generator=torch.Generator().manual_seed(args.seed))

    class RssStreamer(BaseStreamer):
        def __init__(self):
            self.seen = -1  # the first put() is the prompt
            self.samples = [(0, rss_mb())]
            self.times = [(0, time.perf_counter())]

        def put(self, value):
            if self.seen < 0:
                self.seen = 0
                return
            self.seen += value.numel()
            if self.seen % args.sample_tokens == 0:
                self.samples.append((self.seen, rss_mb()))
                self.times.append((self.seen, time.perf_counter()))

        def end(self):
            pass

    streamer = RssStreamer()
    started = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            prompt,
            max_new_tokens=args.tokens,
            min_new_tokens=args.tokens,
            do_sample=False,
            pad_token_id=0,
            streamer=streamer,
        )
    seconds = time.perf_counter() - started
    generated = out.shape[1] - prompt.shape[1]
    if generated != args.tokens:
        raise RuntimeError(f"generate() gave {generated} new tokens, asked for {args.tokens}")
    samples = streamer.samples
    at = {n: round(r, 2) for n, r in samples}
    return {
        "what": "CompressiveForCausalLM.generate(), greedy, batch 1, one call",
        "model": _config_summary(config),
        "new_tokens": generated,
        "seconds": round(seconds, 1),
        "rss_mb_at_tokens": at,
        "rss_mb_at_2000": at.get(2000),
        "rss_mb_at_end": round(samples[-1][1], 2),
        "growth": growth(samples, args.warmup),
    }


class _RssCallback:
    """A TrainerCallback that samples RSS every `every` optimizer steps (and before the first)."""

    def __new__(cls, every: int):
        from transformers import TrainerCallback

        class Sampler(TrainerCallback):
            def __init__(self):
                self.samples = []

            def on_train_begin(self, args, state, control, **kwargs):
                self.samples.append((0, rss_mb()))

            def on_step_end(self, args, state, control, **kwargs):
                if state.global_step % every == 0:
                    self.samples.append((state.global_step, rss_mb()))

        return Sampler()


def training_run(args, kind: str) -> dict:
    import numpy as np
    from transformers import TrainingArguments, set_seed

    from longrange import CompressiveForCausalLM, SinkhornForCausalLM
    from longrange.data import windows_dataset
    from longrange.trainer import LongrangeTrainer, MemoryTrainer, StreamWindows

    set_seed(args.seed)
    rows, window = 4, 64
    ids = np.random.default_rng(args.seed).integers(0, VOCAB, size=args.steps * rows * window + window)
    if kind == "compressive":
        config = compressive_config()
        model = CompressiveForCausalLM(config)
        trainer_cls, dataset = MemoryTrainer, StreamWindows(ids, window)
        what = "MemoryTrainer, CompressiveForCausalLM, memory carried from step to step (StreamWindows lanes)"
    else:
        config = sinkhorn_config()
        model = SinkhornForCausalLM(config)
        trainer_cls, dataset = LongrangeTrainer, windows_dataset(ids, window)
        what = "LongrangeTrainer, SinkhornForCausalLM, independent windows (no memory between windows)"
    sampler = _RssCallback(args.sample_steps)
    with tempfile.TemporaryDirectory() as out:
        training_args = TrainingArguments(
            output_dir=out,
            max_steps=args.steps,
            per_device_train_batch_size=rows,
            learning_rate=1e-3,
            lr_scheduler_type="constant",
            max_grad_norm=1.0,
            logging_steps=args.sample_steps,
            save_strategy="no",
            report_to="none",
            use_cpu=True,
            disable_tqdm=True,
            remove_unused_columns=False,
            train_sampling_strategy="sequential",
            seed=args.seed,
        )
        trainer = trainer_cls(model=model, args=training_args, train_dataset=dataset, callbacks=[sampler])
        started = time.perf_counter()
        trainer.train()
        seconds = time.perf_counter() - started
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return {
        "what": what,
        "model": _config_summary(config),
        "steps": trainer.state.global_step,
        "rows": rows,
        "window": window,
        "seconds": round(seconds, 1),
        "final_loss": round(losses[-1], 4) if losses else None,
        "rss_mb_at_steps": {n: round(r, 2) for n, r in sampler.samples},
        "growth": growth(sampler.samples, args.warmup),
    }


def _config_summary(config) -> dict:
    keys = ("hidden_size", "num_hidden_layers", "num_attention_heads", "segment_length", "mem_len", "c_mem_len",
            "compression_rate", "bucket_size", "max_position_embeddings")  # fmt: skip
    return {k: getattr(config, k) for k in keys if hasattr(config, k)}


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    report = {
        "command": "python benchmarks/check_long_runs.py " + shlex.join(argv if argv is not None else sys.argv[1:]),
        "date": datetime.date.today().isoformat(),
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "rss_start_mb": round(rss_mb(), 2),
        "environment": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "transformers": __import__("transformers").__version__,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
        },
    }
    if "generation" not in args.skip:
        report["generation"] = generation_run(args)
        print(f"generation: {json.dumps(report['generation']['growth'])}", flush=True)
    for kind in ("compressive", "sinkhorn"):
        if kind not in args.skip:
            report[f"training_{kind}"] = training_run(args, kind)
            print(f"training {kind}: {json.dumps(report[f'training_{kind}']['growth'])}", flush=True)
    report["note"] = (
        "RSS in MiB of the whole process (runs follow one another, so a later run starts from the RSS the earlier "
        "left); growth.kib_per_unit is KiB per generated token or per optimizer step, fitted after the warm-up samples"
    )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
