"""Fine-tune a saved longrange model (folder or Hub id) on text with `transformers.Trainer`.

    longrange finetune runs/tiny-compressive --data ../shared/data/tinyshakespeare.txt \
        --output_dir runs/ft --max_steps 200 --window 512

The data goes through `longrange.data` (the same corpus loading, tokenisation and windows as `longrange train`), with
the tokenizer saved in the model folder. Windows are a multiple of the model's segment (Compressive) or bucket
(Sinkhorn) size.

The Compressive model carries its memory across batches by default (`--carry_memory`, Transformer-XL training with
`longrange.trainer.MemoryTrainer`): every row of a batch continues one contiguous lane of the text, window after
window, with the memory it left at the previous step, as `longrange train --streaming` does; evaluation streams the
validation text the same way from an empty memory (lanes = processes x per-device eval batch). `--no-carry_memory`
trains on shuffled independent windows, each from an empty memory (the memory then spans the segments inside a
window only). The Sinkhorn model has no memory: independent shuffled windows.

Besides the usual Trainer logs, the Compressive model's two losses are logged separately (`lm_loss`,
`reconstruction_loss`, and their `eval_` versions), and evaluation reports next-token accuracy (the local `evaluate`
accuracy module, no download) and perplexity. `--push_to_hub` / `--hub_model_id` pass straight to
`TrainingArguments`; the pushed model card is the longrange one (`longrange.hub.write_model_card`).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainingArguments, set_seed

import longrange  # noqa: F401  registers the longrange model types with the Auto classes
from longrange.commands import command_parser
from longrange.data import check_window, load_corpus, tokenize_corpus, window_multiple, windows_dataset
from longrange.hub import check_model_source, example_prompt
from longrange.metrics import load_metric
from longrange.tokenization import is_byte_tokenizer
from longrange.trainer import MEMORY_TRAINER_SUPPORTED, LongrangeTrainer, MemoryTrainer, StreamWindows
from longrange.training import carries_cache


def next_token_predictions(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per position t: the argmax prediction for token t+1 and that token's loss (nats). Keeps eval memory small.

    Returns [batch, seq - 1, 2] (column 0: predicted id, exact in float32 for vocabularies below 2**24).
    """
    logits = logits[:, :-1].float()  # [batch, seq-1, vocab]: position t predicts token t+1
    targets = labels[:, 1:]  # [batch, seq-1]
    nll = torch.nn.functional.cross_entropy(
        logits.transpose(1, 2), targets.clamp_min(0), reduction="none"
    )  # [batch, seq-1]
    return torch.stack([logits.argmax(-1).float(), nll], dim=-1)


def make_compute_metrics():
    accuracy, perplexity = load_metric("accuracy"), load_metric("perplexity")

    def compute_metrics(eval_prediction) -> dict[str, float]:
        scores = np.asarray(eval_prediction.predictions)  # [rows, seq-1, 2]
        targets = np.asarray(eval_prediction.label_ids)[:, 1:]  # [rows, seq-1]
        keep = targets != -100
        result = accuracy.compute(predictions=scores[..., 0][keep].astype(np.int64), references=targets[keep])
        ppl = perplexity.compute(predictions=scores[..., 1][keep])
        result.update(perplexity=ppl["perplexity"], bits_per_token=ppl["bits_per_token"])
        return result

    return compute_metrics


def parse_args(argv=None) -> argparse.Namespace:
    p = command_parser("finetune", __doc__, first_paragraph_only=True)
    p.add_argument("model", help="saved model folder (save_pretrained) or Hub id; its tokenizer is used")
    p.add_argument("--data", default="stdlib", help="text file, folder, Hub dataset name, or 'stdlib' (default)")
    p.add_argument("--dataset_config", default=None, help="config name of a Hub dataset")
    p.add_argument("--split", type=float, nargs="+", default=[0.9, 0.1], help="train/validation[/test] fractions")
    p.add_argument("--window", type=int, default=None, help="tokens per row (default: 4 segments / 4 buckets)")
    p.add_argument(
        "--carry_memory",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="carry the Compressive memory from batch to batch over contiguous lanes of the text (default: on for "
        "the Compressive model; --no-carry_memory trains on shuffled independent windows)",
    )
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_steps", type=int, default=-1)
    p.add_argument("--num_train_epochs", type=float, default=1.0)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=8)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--learning_rate", type=float, default=1e-4)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--warmup_steps", type=int, default=0)
    p.add_argument("--lr_scheduler_type", default="cosine")
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--logging_steps", type=int, default=10)
    p.add_argument("--eval_steps", type=int, default=None, help="evaluate every N steps (default: at the end only)")
    p.add_argument("--save_steps", type=int, default=500)
    p.add_argument("--max_eval_tokens", type=int, default=200_000, help="cap on validation tokens")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--bf16", action="store_true")
    p.add_argument("--report_to", default="none", help="Trainer integrations: none, tensorboard, wandb, all")
    p.add_argument(
        "--push_to_hub", action="store_true", help="push checkpoints and the final model (TrainingArguments)"
    )
    p.add_argument("--hub_model_id", default=None, help="Hub repository for --push_to_hub (default: output_dir name)")
    p.add_argument("--trust_remote_code", action="store_true", help="allow modeling code from the folder / Hub repo")
    return p.parse_args(argv)


def training_arguments(args: argparse.Namespace) -> TrainingArguments:
    return TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.max_steps,
        num_train_epochs=args.num_train_epochs,
        per_device_train_batch_size=args.per_device_train_batch_size,
        per_device_eval_batch_size=args.per_device_eval_batch_size,
        gradient_accumulation_steps=args.gradient_accumulation_steps,
        learning_rate=args.learning_rate,
        weight_decay=args.weight_decay,
        warmup_steps=args.warmup_steps,
        lr_scheduler_type=args.lr_scheduler_type,
        max_grad_norm=args.max_grad_norm,
        logging_steps=args.logging_steps,
        eval_strategy="steps" if args.eval_steps else "no",
        eval_steps=args.eval_steps,
        save_steps=args.save_steps,
        seed=args.seed,
        bf16=args.bf16,
        report_to=args.report_to,
        push_to_hub=args.push_to_hub,
        hub_model_id=args.hub_model_id,
        remove_unused_columns=False,
        use_cpu=not torch.cuda.is_available(),
    )


def finetune_window(args: argparse.Namespace, config) -> int:
    """--window, or four segments / buckets (Sinkhorn: at most the model's positions), checked against the model."""
    unit = window_multiple(config)
    window = args.window if args.window is not None else 4 * unit
    if args.window is None and getattr(config, "model_type", None) == "sinkhorn":
        window = min(window, config.max_position_embeddings // unit * unit)
    check_window(window, config)
    return window


def finetune_datasets(streams, window: int, carry: bool, training_args: TrainingArguments, max_eval_tokens: int | None):
    """(training set, evaluation set or None): contiguous lanes when the memory is carried, else shuffled windows."""
    eval_ids = streams.ids["validation"][:max_eval_tokens]
    if carry:
        train_set = StreamWindows(streams.ids["train"], window)
        # one lane per evaluation row and process: fewer rows when the validation text is short
        lanes = len(eval_ids) // window
        rows = min(training_args.per_device_eval_batch_size, lanes // training_args.world_size)
        if 0 < rows < training_args.per_device_eval_batch_size:
            print(f"note: {len(eval_ids)} validation tokens fill {lanes} lanes of one window: evaluating {rows} rows")
            training_args.per_device_eval_batch_size = rows
        eval_set = StreamWindows(eval_ids, window) if rows > 0 else None
    else:
        train_set = windows_dataset(streams.ids["train"], window)
        eval_set = windows_dataset(eval_ids, window) if len(eval_ids) >= window else None
    if eval_set is None:
        print(f"note: the validation split has {len(eval_ids)} tokens, too few for one window of {window} per "
              "evaluation row: no evaluation")  # fmt: skip
    return train_set, eval_set


def card(args: argparse.Namespace, corpus, streams, window: int, carry: bool) -> dict:
    """The model card's training data, options and example prompt (the first characters of the training text)."""
    return {
        "dataset": f"fine-tuned on {corpus.name} ({len(streams.ids['train']):,} training tokens, windows of {window})",
        "training_args": {
            "base model": args.model,
            "max_steps": args.max_steps,
            "learning_rate": args.learning_rate,
            "batch size": args.per_device_train_batch_size * args.gradient_accumulation_steps,
            "window": window,
            "memory carried across batches": carry,
        },
        "prompt": example_prompt(corpus.splits["train"][0]) if corpus.splits["train"] else None,
    }


def main(argv=None) -> dict[str, float]:
    args = parse_args(argv)
    set_seed(args.seed)
    check_model_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    window = finetune_window(args, model.config)
    # default: carry memories where the model has them and the installed transformers supports MemoryTrainer
    carry = carries_cache(model.config) and MEMORY_TRAINER_SUPPORTED if args.carry_memory is None else args.carry_memory
    if carry and not carries_cache(model.config):
        raise ValueError(f"--carry_memory needs a model with memory (compressive), got {model.config.model_type!r}")
    byte_level = is_byte_tokenizer(tokenizer)
    corpus = load_corpus(args.data, dataset_config=args.dataset_config, split=args.split, as_bytes=byte_level)
    streams = tokenize_corpus(corpus, tokenizer)
    training_args = training_arguments(args)
    train_set, eval_set = finetune_datasets(streams, window, carry, training_args, args.max_eval_tokens)
    trainer = (MemoryTrainer if carry else LongrangeTrainer)(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        processing_class=tokenizer,
        compute_metrics=make_compute_metrics() if eval_set is not None else None,
        preprocess_logits_for_metrics=next_token_predictions,
        card=card(args, corpus, streams, window, carry),
    )
    trainer.train()
    metrics = trainer.evaluate() if eval_set is not None else {}
    trainer.save_model()  # output_dir: weights, config with auto_map, modeling code, tokenizer
    trainer.create_model_card()
    if args.push_to_hub:
        trainer.push_to_hub(commit_message="longrange fine-tuning")
    if trainer.is_world_process_zero():
        # eval_perplexity is exp(mean NLL of the predicted tokens). Trainer's eval_loss can differ slightly: it may
        # divide the summed loss by every label (n per row) although only n-1 of them are predicted.
        print(json.dumps({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, indent=1))
        print(f"saved to {Path(args.output_dir).resolve()}")
    # Trainer leaves the process group of a multi-process launch open; a gloo group still open when the interpreter
    # shuts down can abort the process (SIGABRT, "terminate called without an active exception": pytorch#190489)
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    return metrics


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
