#!/usr/bin/env python
"""Trainer with the memory carried across batches vs Trainer without, on one long text (byte level).

    python benchmarks/benchmark_trainer_memory.py --data ../shared/data/kjv-bible.txt \
        --json docs/benchmarks/trainer_memory.json

Both runs start from the same tiny randomly initialised Compressive model and take the same steps, rows, window,
optimizer, schedule and gradient clipping through `transformers.Trainer`:

* with memory: `longrange.trainer.MemoryTrainer` on `StreamWindows` (each row continues a contiguous lane of the
  text with the memory it left at the previous step);
* without memory, same windows: `LongrangeTrainer` on exactly the windows the first run sees, in the same order
  (sequential sampling), every window from an empty memory: only the memory differs from the first run;
* without memory, shuffled: `LongrangeTrainer` on shuffled independent windows of the whole training text
  (`longrange.data.windows_dataset`), every window from an empty memory: what `Trainer` fine-tuning did before.
  Streaming lanes cover only `steps x window` tokens from each of `batch_size` starting points, shuffled windows
  the whole text: in a short run that data coverage, not the memory, can decide the comparison.

Both models are then evaluated on the same validation text (the first `--eval_tokens` bytes after the 90% training
split), once with the memory carried across the whole validation stream and once with an empty memory per window.
Bits per byte = loss / ln 2 (byte tokens).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path

import torch

# from a checkout: the package next to this folder (the user commands are in it: longrange.commands)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--data", required=True, help="one long text file (read as bytes)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch_size", type=int, default=8, help="rows per step")
    p.add_argument("--window", type=int, default=64, help="tokens per row and step (2 segments)")
    p.add_argument("--learning_rate", type=float, default=2e-3)
    p.add_argument("--eval_tokens", type=int, default=32768)
    p.add_argument("--eval_batch_size", type=int, default=8, help="validation lanes")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the results here")
    return p.parse_args(argv)


def tiny_config(vocab_size: int, window: int):
    from longrange import CompressiveConfig

    segment = window // 2
    return CompressiveConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=256,
        segment_length=segment,
        mem_len=segment,
        c_mem_len=segment // 2,
        compression_rate=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    )


def main(argv=None) -> dict:
    args = parse_args(argv)
    from transformers import TrainingArguments, set_seed

    from longrange import CompressiveForCausalLM
    from longrange.data import eval_windows, load_corpus, tokenize_corpus, windows_dataset
    from longrange.tokenization import byte_tokenizer
    from longrange.trainer import LongrangeTrainer, MemoryTrainer, StreamWindows
    from longrange.training import evaluate_stream

    torch.set_num_threads(1)
    tokenizer = byte_tokenizer()
    corpus = load_corpus(args.data, split=(0.9, 0.1), as_bytes=True)
    streams = tokenize_corpus(corpus, tokenizer)
    train_ids = streams.ids["train"]
    eval_ids = streams.ids["validation"][: args.eval_tokens]
    config = tiny_config(len(tokenizer), args.window)
    set_seed(args.seed)
    initial = CompressiveForCausalLM(config).state_dict()

    import datasets

    streamed = StreamWindows(train_ids, args.window)
    laid = streamed.laid_out(args.batch_size)
    same_windows = [laid[i]["input_ids"].tolist() for i in range(min(len(laid), args.steps * args.batch_size))]
    same_windows = datasets.Dataset.from_dict({"input_ids": same_windows, "labels": same_windows})
    runs = (
        ("with memory", MemoryTrainer, streamed, "sequential"),
        ("without memory, same windows", LongrangeTrainer, same_windows, "sequential"),
        ("without memory, shuffled", LongrangeTrainer, windows_dataset(train_ids, args.window), "random"),
    )
    results = {}
    for name, trainer_cls, train_set, sampling in runs:
        model = CompressiveForCausalLM(config)
        model.load_state_dict(initial)
        with tempfile.TemporaryDirectory() as out:
            training_args = TrainingArguments(
                output_dir=out,
                max_steps=args.steps,
                per_device_train_batch_size=args.batch_size,
                learning_rate=args.learning_rate,
                lr_scheduler_type="cosine",
                warmup_steps=max(1, args.steps // 20),
                weight_decay=0.0,
                max_grad_norm=1.0,
                logging_steps=max(1, args.steps // 10),
                save_strategy="no",
                report_to="none",
                use_cpu=True,
                disable_tqdm=True,
                remove_unused_columns=False,
                train_sampling_strategy=sampling,
                seed=args.seed,
            )
            trainer = trainer_cls(model=model, args=training_args, train_dataset=train_set)
            started = time.perf_counter()
            trainer.train()
            seconds = time.perf_counter() - started
        batches = eval_windows(eval_ids, args.window, args.eval_batch_size)
        per_token = streams.bytes_per_token("validation")
        chars = streams.chars_per_token("validation")
        carried = evaluate_stream(model, batches, carry_cache=True, bytes_per_token=per_token, chars_per_token=chars)
        fresh = evaluate_stream(model, batches, carry_cache=False, bytes_per_token=per_token, chars_per_token=chars)
        train_log = [e for e in trainer.state.log_history if "lm_loss" in e]
        results[name] = {
            "validation_bits_per_byte_memory_carried": carried["bits_per_byte"],
            "validation_bits_per_byte_fresh_memory_per_window": fresh["bits_per_byte"],
            "final_train_lm_loss": train_log[-1]["lm_loss"] if train_log else None,
            "train_seconds": seconds,
        }
        print(f"{name}: {json.dumps(results[name])}", flush=True)

    report = {
        "command": "python benchmarks/benchmark_trainer_memory.py "
        + shlex.join(argv if argv is not None else sys.argv[1:]),
        "data": f"{Path(args.data).name}: {len(train_ids):,} training bytes, {len(eval_ids):,} validation bytes "
        "(the first after the 90% split)",
        "model": {
            k: getattr(config, k)
            for k in (
                "hidden_size",
                "num_hidden_layers",
                "num_attention_heads",
                "segment_length",
                "mem_len",
                "c_mem_len",
                "compression_rate",
            )
        },  # fmt: skip
        "settings": {k: v for k, v in vars(args).items() if k != "json"},
        "tokens_per_run": args.steps * args.batch_size * args.window,
        "results": results,
        "torch": torch.__version__,
        "note": "bits per byte = validation loss / ln 2 on byte tokens; the CPU was shared, so seconds are indicative",
    }
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return report


if __name__ == "__main__":
    main()
