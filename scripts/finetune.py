"""Fine-tune a saved longrange model (folder or Hub id) on text with `transformers.Trainer`.

    python scripts/finetune.py runs/tiny-compressive --data ../shared/data/tinyshakespeare.txt \
        --output_dir runs/ft --max_steps 200 --window 512

The data goes through `longrange.data` (the same corpus loading, tokenisation and windows as `scripts/train.py`), with
the tokenizer saved in the model folder. Each training row is one fixed window whose length is a multiple of the
model's segment (Compressive) or bucket (Sinkhorn) size; the Compressive model carries its memory across the segments
inside a window (not across rows: use scripts/train.py --streaming for Transformer-XL style training).

Besides the usual Trainer logs, the Compressive model's two losses are logged separately (`lm_loss`,
`reconstruction_loss`, and their `eval_` versions), and evaluation reports next-token accuracy (the local `evaluate`
accuracy module, no download) and perplexity. `--push_to_hub` / `--hub_model_id` pass straight to
`TrainingArguments`; the pushed model card is the longrange one (`longrange.hub.write_model_card`).
"""

from __future__ import annotations

import sys
from pathlib import Path

# scripts/evaluate.py would shadow the `evaluate` library (used by the metrics) for a script run from this folder
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).resolve().parent]

import argparse  # noqa: E402
import json  # noqa: E402
from collections import defaultdict  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, Trainer, TrainingArguments, set_seed  # noqa: E402

import longrange  # noqa: E402,F401  registers the longrange model types with the Auto classes
from longrange.compat import TRAINER_COUNTS_PREDICTED_LABELS  # noqa: E402
from longrange.data import check_window, load_corpus, tokenize_corpus, window_multiple, windows_dataset  # noqa: E402
from longrange.hub import check_model_source, write_model_card  # noqa: E402
from longrange.metrics import load_metric  # noqa: E402
from longrange.tokenization import is_byte_tokenizer  # noqa: E402


class LongrangeTrainer(Trainer):
    """A Trainer that also logs the auxiliary losses a model reports (`lm_loss`, `reconstruction_loss`).

    Trainer optimises and logs `outputs.loss` only (for the Compressive model: LM loss + reconstruction loss).
    This subclass collects the parts per step and adds their means to the train and eval logs. It also keeps only the
    logits for `compute_metrics` (the cache and the loss parts are not predictions), and writes the longrange model
    card when pushing.
    """

    def __init__(self, *args, card: dict | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self._aux = {"train": defaultdict(list), "eval": defaultdict(list)}
        self.card = dict(card or {})

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        # Trainer's rule, written out: with `num_items_in_batch` the model divides the LM loss by the tokens of the
        # whole accumulated batch over all processes, so Trainer neither divides the loss by the accumulation steps
        # nor lets the gradient average over processes shrink it (it multiplies the loss by the number of
        # processes). That is right for the LM part only. The rest (the reconstruction loss) is a plain per-call mean
        # and would count `accumulation steps x processes` times over, so here it is made a mean over calls instead.
        normalised = self.model_accepts_loss_kwargs and num_items_in_batch is not None
        outputs = model(**inputs, **({"num_items_in_batch": num_items_in_batch} if normalised else {}))
        loss, lm_loss = outputs.loss, getattr(outputs, "lm_loss", None)
        processes = self.accelerator.num_processes if normalised and self.args.average_tokens_across_devices else 1
        if normalised and lm_loss is not None:
            steps = getattr(self, "current_gradient_accumulation_steps", 1) if model.training else 1
            loss = processes * lm_loss + (loss - lm_loss) / steps
        else:
            loss = loss * processes
        phase = "train" if model.training else "eval"
        if lm_loss is not None:
            if normalised:  # back to the mean over this call's predicted tokens, for the log
                predicted = inputs["labels"][..., 1:].ne(-100).sum()
                lm_loss = lm_loss * num_items_in_batch / predicted.clamp_min(1)
            self._aux[phase]["lm_loss"].append(lm_loss.detach().float())
        reconstruction = getattr(outputs, "reconstruction_loss", None)
        if reconstruction is not None:
            self._aux[phase]["reconstruction_loss"].append(reconstruction.detach().float())
        return (loss, {"logits": outputs.logits}) if return_outputs else loss

    def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
        # the divisor of the summed LM loss: the predicted tokens, `labels[..., 1:]` (transformers < 5.10.1 counted
        # every label, one per row too many; later versions count these, and this changes nothing there)
        if not TRAINER_COUNTS_PREDICTED_LABELS:
            batch_samples = [
                {**batch, "labels": batch["labels"][..., 1:]} if "labels" in batch else batch for batch in batch_samples
            ]
        return super()._get_num_items_in_batch(batch_samples, device)

    def _aux_means(self, phase: str) -> dict[str, float]:
        means = {}
        for name, values in self._aux[phase].items():
            mean = torch.stack(values).mean()
            means[name] = float(self.accelerator.reduce(mean, reduction="mean"))  # average over processes
        self._aux[phase].clear()
        return means

    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:  # a training log: the parts since the previous one
            logs.update(self._aux_means("train"))
        if "eval_loss" in logs:
            logs.update({f"eval_{name}": value for name, value in self._aux_means("eval").items()})
        super().log(logs, start_time)

    def create_model_card(self, **kwargs):
        if not self.is_world_process_zero():
            return
        # the latest evaluation; speed figures describe this machine, not the model
        metrics = {
            k: v
            for entry in self.state.log_history
            for k, v in entry.items()
            if k.startswith("eval_") and "runtime" not in k and "per_second" not in k
        }
        write_model_card(
            self.args.output_dir,
            model=self.accelerator.unwrap_model(self.model),
            tokenizer=self.processing_class,
            metrics=metrics or None,
            repo_id=self.args.hub_model_id,
            **self.card,
        )


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
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("model", help="saved model folder (save_pretrained) or Hub id; its tokenizer is used")
    p.add_argument("--data", default="stdlib", help="text file, folder, Hub dataset name, or 'stdlib' (default)")
    p.add_argument("--dataset_config", default=None, help="config name of a Hub dataset")
    p.add_argument("--split", type=float, nargs="+", default=[0.9, 0.1], help="train/validation[/test] fractions")
    p.add_argument("--window", type=int, default=None, help="tokens per row (default: 4 segments / 4 buckets)")
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


def main(argv=None) -> dict[str, float]:
    args = parse_args(argv)
    set_seed(args.seed)
    check_model_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    unit = window_multiple(model.config)
    window = args.window if args.window is not None else 4 * unit
    if args.window is None and getattr(model.config, "model_type", None) == "sinkhorn":
        window = min(window, model.config.max_position_embeddings // unit * unit)
    check_window(window, model.config)

    byte_level = is_byte_tokenizer(tokenizer)
    corpus = load_corpus(args.data, dataset_config=args.dataset_config, split=args.split, as_bytes=byte_level)
    streams = tokenize_corpus(corpus, tokenizer)
    train_set = windows_dataset(streams.ids["train"], window)
    eval_ids = streams.ids["validation"][: args.max_eval_tokens]
    eval_set = windows_dataset(eval_ids, window) if len(eval_ids) >= window else None
    if eval_set is None:
        print(f"note: the validation split has {len(eval_ids)} tokens, less than one window of {window}: no evaluation")

    training_args = training_arguments(args)
    trainer = LongrangeTrainer(
        model=model,
        args=training_args,
        train_dataset=train_set,
        eval_dataset=eval_set,
        processing_class=tokenizer,
        compute_metrics=make_compute_metrics() if eval_set is not None else None,
        preprocess_logits_for_metrics=next_token_predictions,
        card={
            "dataset": f"fine-tuned on {corpus.name} ({len(streams.ids['train']):,} training tokens, "
            f"windows of {window})",
            "training_args": {
                "base model": args.model,
                "max_steps": args.max_steps,
                "learning_rate": args.learning_rate,
                "batch size": args.per_device_train_batch_size * args.gradient_accumulation_steps,
                "window": window,
            },
        },
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
    return metrics


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
