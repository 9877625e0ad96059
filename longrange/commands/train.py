"""Train a Compressive or Sinkhorn language model with Accelerate.

    longrange train                                   # small Compressive model, stdlib corpus, byte tokenizer
    longrange train --model sinkhorn --data ../shared/data/tinyshakespeare.txt --split 0.9,0.1
    accelerate launch --num_processes 2 -m longrange train --config hidden_size=128 --max_steps 100

Runs alone or under `accelerate launch` (data-parallel: every process takes its own rows of one global batch, so the
result does not depend on how the batch is spread over processes and accumulation steps). Writes, under
`--output_dir`: checkpoints (`accelerator.save_state`, exact resume with `--resume_from`), the trained model as a
`save_pretrained` folder with tokenizer and model card, `curves.png`, `samples.txt` and `metrics.json`.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

from longrange.commands import command_parser

# A small model that trains in a few minutes on 2 CPU cores. Any field can be overridden with --config key=value.
SMALL_CONFIGS = {
    "compressive": dict(
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=512,
        segment_length=64,
        mem_len=64,
        c_mem_len=32,
        compression_rate=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
    ),
    "sinkhorn": dict(
        hidden_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        intermediate_size=512,
        bucket_size=32,
        causal=True,
        max_position_embeddings=1024,
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = command_parser("train", __doc__)
    add_model_and_data_options(p)
    add_optimisation_options(p)
    add_output_options(p)
    args = p.parse_args(argv)
    args.split = tuple(float(x) for x in args.split.split(","))
    from longrange import CompressiveConfig, SinkhornConfig
    from longrange.training import parse_config_overrides

    config_class = {"compressive": CompressiveConfig, "sinkhorn": SinkhornConfig}[args.model]
    try:  # checked before anything is loaded or trained
        args.config = parse_config_overrides(args.config, config_class)
    except ValueError as err:
        p.error(str(err))
    if args.output_dir is None:
        corpus_name = "stdlib" if args.data is None else Path(str(args.data)).stem
        args.output_dir = f"outputs/{args.model}-{corpus_name}"
    return args


def add_model_and_data_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument("--model", choices=sorted(SMALL_CONFIGS), default="compressive")
    g.add_argument(
        "--config",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="config overrides, e.g. hidden_size=256 num_hidden_layers=6 pkm_layers=[2]; a key the model's config "
        "does not define is refused with the list of valid keys",
    )
    g = p.add_argument_group("data")
    g.add_argument(
        "--data", default=None, help="text file, folder or Hub dataset name (default: Python stdlib sources)"
    )
    g.add_argument("--dataset_config", default=None, help="Hub dataset configuration name")
    g.add_argument("--split", default="0.9,0.05,0.05", help="train,validation[,test] fractions (default 0.9,0.05,0.05)")
    g.add_argument("--max_corpus_bytes", type=int, default=4_000_000, help="cap on the default stdlib corpus")
    g.add_argument("--tokenizer", default="byte", help="byte | bpe | gpt2 | gpt2:<dir> | saved folder or Hub id")
    g.add_argument("--bpe_vocab_size", type=int, default=4096)
    g.add_argument("--window", type=int, default=None, help="tokens per row and step (default: 2 segments / 4 buckets)")
    g.add_argument(
        "--streaming",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="Transformer-XL batches: each row continues where it stopped (default: on for compressive)",
    )
    g.add_argument(
        "--carry_cache",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="carry the Compressive memory from step to step (default: on when streaming a compressive model)",
    )
    g.add_argument(
        "--segments_alone",
        action="store_true",
        help="Compressive without any memory: every segment of a window is its own row (same tokens per step), from "
        "an empty memory, in training and in validation (the no-memory baseline; implies --no-carry_cache)",
    )


def add_optimisation_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("optimisation")
    g.add_argument("--max_steps", type=int, default=1200, help="optimizer steps")
    g.add_argument("--batch_size", type=int, default=8, help="rows per process and accumulation micro-step")
    g.add_argument("--gradient_accumulation_steps", type=int, default=1)
    g.add_argument("--learning_rate", type=float, default=2e-3)
    g.add_argument("--weight_decay", type=float, default=0.01)
    g.add_argument("--warmup_steps", type=int, default=None, help="default: 5%% of max_steps")
    g.add_argument("--min_lr_ratio", type=float, default=0.1, help="cosine decays to this fraction of the peak")
    g.add_argument("--max_grad_norm", type=float, default=1.0, help="0 disables clipping")
    g.add_argument("--mixed_precision", choices=["no", "fp16", "bf16"], default="no")
    g.add_argument("--cpu", action="store_true", help="train on the CPU even when a GPU is present")
    g.add_argument(
        "--compile",
        nargs="?",
        const="regional",
        choices=["regional", "model"],
        default=None,
        help="train compiled with torch.compile (inductor, graph breaks allowed) through Accelerate's "
        "TorchDynamoPlugin. `--compile` (= regional): Accelerate's regional compilation, each decoder layer compiled "
        "alone, one graph serving every layer (first step several times shorter); `--compile model`: the whole "
        "model as one graph, as `accelerate launch --dynamo_backend inductor`. Evaluation and samples run uncompiled",
    )
    g.add_argument(
        "--num_threads",
        type=int,
        default=1,
        help="torch CPU threads per process (default 1: small models gain little from more, and several threads per "
        "process collapse when the CPU is shared; 0 keeps torch's default, better for large models on idle many-core CPUs)",
    )
    g.add_argument("--seed", type=int, default=0)


def add_output_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("evaluation, checkpoints and outputs")
    g.add_argument("--eval_every", type=int, default=200)
    g.add_argument("--eval_tokens", type=int, default=32768, help="validation tokens per evaluation (0 = all)")
    g.add_argument("--eval_batch_size", type=int, default=8)
    g.add_argument("--log_every", type=int, default=10)
    g.add_argument("--save_every", type=int, default=400, help="checkpoint every N steps (0 = only at the end)")
    g.add_argument(
        "--resume_from",
        default=None,
        help="checkpoint folder, or 'latest' (newest under output_dir); the processes, accumulation steps and "
        "--batch_size may differ from the saved run's when their product (the global batch) and --window stay",
    )
    g.add_argument("--output_dir", default=None, help="default: outputs/<model>-<corpus>")
    g.add_argument("--report_to", nargs="*", default=[], help="Accelerate trackers, e.g. tensorboard wandb")
    g.add_argument("--num_samples", type=int, default=3, help="generated samples at the end (0 = none)")
    g.add_argument("--sample_tokens", type=int, default=200)
    g.add_argument("--prompts", nargs="*", default=None, help="sample prompts (default: taken from the corpus)")


def build_config(args, tokenizer):
    from transformers import AutoConfig

    import longrange  # noqa: F401  (registers the model types)

    fields = dict(SMALL_CONFIGS[args.model])
    fields.update(args.config)  # already checked against the config's fields by parse_args
    fields.setdefault("vocab_size", len(tokenizer))
    if fields["vocab_size"] < len(tokenizer):
        raise SystemExit(f"vocab_size={fields['vocab_size']} is smaller than the tokenizer ({len(tokenizer)} tokens)")
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        fields.setdefault(name, getattr(tokenizer, name))
    return AutoConfig.for_model(args.model, **fields)


def build_optimizer(model, args) -> torch.optim.Optimizer:
    # no weight decay on biases, norms and other vectors
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": args.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=args.learning_rate, betas=(0.9, 0.98), eps=1e-8)


def load_data(args, accelerator):
    """Corpus -> tokenizer -> one stream per split. A trained BPE is built on the main process and shared."""
    from longrange.data import load_corpus, tokenize_corpus
    from longrange.tokenization import byte_tokenizer, load_tokenizer

    as_bytes = args.tokenizer == "byte"
    corpus = load_corpus(args.data, dataset_config=args.dataset_config, split=args.split, as_bytes=as_bytes,
                         max_bytes=args.max_corpus_bytes)  # fmt: skip
    if args.tokenizer == "byte":
        tokenizer = byte_tokenizer()
    elif args.tokenizer == "bpe":
        shared = Path(args.output_dir) / "tokenizer"
        if accelerator.is_main_process:
            tokenizer = load_tokenizer("bpe", texts=corpus.splits["train"], vocab_size=args.bpe_vocab_size)
            tokenizer.save_pretrained(shared)
        accelerator.wait_for_everyone()
        tokenizer = load_tokenizer(str(shared))
    else:
        tokenizer = load_tokenizer(args.tokenizer)
    return corpus, tokenizer, tokenize_corpus(corpus, tokenizer)


def default_prompts(corpus, n: int) -> list[str]:
    if corpus.name == "python-stdlib":
        return ["import ", "def ", "class "][:n] + ["\n"] * max(0, n - 3)
    text = corpus.splits["validation"][0] if corpus.splits["validation"] else corpus.splits["train"][0]
    if isinstance(text, bytes):
        text = text.decode("utf-8", errors="replace")
    # start each prompt at the beginning of a line, at evenly spaced places of the validation text
    starts = [int(i * len(text) / max(1, n)) for i in range(n)]
    starts = [0 if s == 0 else text.find("\n", s) + 1 for s in starts]
    return [text[s : s + 24] for s in starts]


def checkpoint_dirs(output_dir: Path) -> list[Path]:
    root = output_dir / "checkpoints"
    return sorted(root.glob("step_*"), key=lambda p: int(p.name.split("_")[1])) if root.is_dir() else []


def main(argv=None) -> dict:
    """Train as the options say; returns the output folder, steps, parameters, train history and final metrics."""
    from longrange.commands.train_run import TrainingRun

    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = parse_args(argv)
    run = TrainingRun(args, sys.modules[__name__])
    run.resume()
    run.train()
    return run.finish()


def write_card(folder: Path, model, tokenizer, corpus, metrics: dict, args) -> None:
    split = "/".join(f"{f:g}" for f in args.split)
    dataset = f"{corpus.name} (train/validation/test {split}, split by {corpus.split_by})"
    if corpus.name == "python-stdlib":
        dataset = f"the Python standard library's own source files, {dataset}"
    from longrange.hub import example_prompt, write_model_card

    shown = {k: v for k, v in metrics.items() if k in ("loss", "perplexity", "bits_per_byte", "bits_per_char",
                                                       "test_bits_per_byte", "test_bits_per_char")}  # fmt: skip
    training_args = {k: (list(v) if isinstance(v, tuple) else v) for k, v in vars(args).items()}
    write_model_card(folder, model=model, tokenizer=tokenizer, dataset=dataset,
                     metrics={f"validation {k}" if not k.startswith("test") else k: v for k, v in shown.items()},
                     training_args=training_args, prompt=example_prompt(corpus.splits["train"][0]))  # fmt: skip


if __name__ == "__main__":
    main()
