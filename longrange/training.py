"""Pieces shared by the training commands: config overrides, schedule, streaming evaluation, curves, samples, state.

Nothing here is imported by the modeling files, so a saved model never depends on it.
"""

from __future__ import annotations

import ast
import math
from collections.abc import Iterable

import torch


def config_keys(config_class) -> dict[str, str]:
    """The keys a model config takes from the command line, each mapped to the field it sets.

    These are the config class's own fields (not the generic `PreTrainedConfig` ones such as `dtype`) and their
    aliases: `attribute_map` (the seeds' names, e.g. `dim`, `depth`, `heads`) and `keyword_aliases` (names accepted
    by the constructor only, e.g. Sinkhorn's `temperature`).
    """
    from transformers import PreTrainedConfig

    generic = set(PreTrainedConfig.__dataclass_fields__)
    keys = {name: name for name in config_class.__dataclass_fields__ if name not in generic}
    aliases = {**config_class.attribute_map, **getattr(config_class, "keyword_aliases", {})}
    keys.update({alias: field for alias, field in aliases.items() if field in keys})
    return keys


def parse_config_overrides(items: Iterable[str], config_class) -> dict:
    """`--config KEY=VALUE ...` items -> keyword arguments for `config_class`, aliases resolved to field names.

    A value is read as a Python literal where it is one (`6`, `0.1`, `True`, `None`, `[2, 4]`), else kept as a
    string (`compression_function=max_pool`). Raises ValueError, naming the item and listing the valid keys, for a
    key the config does not define, an item without `=`, or a field given twice (also through an alias).
    """
    keys = config_keys(config_class)
    out: dict = {}
    given: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"--config expects KEY=VALUE items, got {item!r}")
        if key not in keys:
            fields = sorted(k for k, f in keys.items() if k == f)
            aliases = sorted(f"{k} (= {f})" for k, f in keys.items() if k != f)
            raise ValueError(
                f"--config: {key!r} is not a field of {config_class.__name__} nor an alias of one. "
                f"Valid keys: {', '.join(fields)}; "
                f"aliases: {', '.join(aliases) or 'none'}"
            )
        field = keys[key]
        if field in out:
            raise ValueError(f"--config: {field} is given twice ({given[field]!r} and {item!r})")
        try:
            out[field] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            out[field] = value
        given[field] = item
    return out


def warmup_cosine(warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """Learning-rate multiplier for `torch.optim.lr_scheduler.LambdaLR`: linear warm-up, then cosine to `min_ratio`.

    From step `warmup_steps` to `total_steps` this is transformers' `get_cosine_with_min_lr_schedule_with_warmup`
    (`min_lr_rate=min_ratio`), value for value (tested). It is kept rather than replaced because the two differ
    elsewhere, and the recorded runs used this one: during the warm-up it gives `(step + 1) / warmup_steps` (the
    first step trains at `1 / warmup_steps` of the peak and the peak is reached at step `warmup_steps - 1`), where
    transformers gives `step / warmup_steps` (the first step at a learning rate of 0); past `total_steps` it stays
    at `min_ratio`, where transformers' cosine rises again.
    """

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))

    return factor


def carries_cache(config) -> bool:
    """Whether a model keeps a memory that should be carried from one window to the next (Compressive)."""
    return getattr(config, "model_type", None) == "compressive"


def lm_loss_of(output) -> torch.Tensor:
    """The language-model part of a model output: `lm_loss` where the model reports it separately, else `loss`."""
    lm = getattr(output, "lm_loss", None)
    return output.loss if lm is None else lm


@torch.no_grad()
def evaluate_stream(
    model, batches: Iterable[torch.Tensor], *, carry_cache: bool, bytes_per_token: float, chars_per_token: float
) -> dict[str, float]:
    """Mean next-token loss over `batches` (from `data.eval_windows`), with the memory carried if `carry_cache`.

    Returns loss (nats per token), perplexity, bits per token, bits per byte and bits per character. Bits per byte /
    character use the split's bytes (characters) per token: exact for the byte tokenizer on ASCII text, the usual
    approximation for sub-word tokenizers.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    total, count, cache = 0.0, 0, None
    for batch in batches:
        batch = batch.to(device)
        if carry_cache:
            out = model(input_ids=batch, labels=batch, cache=cache, use_cache=True)
            cache = out.cache
        else:
            out = model(input_ids=batch, labels=batch, use_cache=False)
        predicted = batch.shape[0] * (batch.shape[1] - 1)  # labels are shifted inside the model
        total += float(lm_loss_of(out)) * predicted
        count += predicted
    model.train(was_training)
    loss = total / max(1, count)
    bits = loss / math.log(2)
    return {
        "loss": loss,
        "perplexity": math.exp(min(loss, 50.0)),
        "bits_per_token": bits,
        "bits_per_byte": bits / bytes_per_token,
        "bits_per_char": bits / chars_per_token,
    }


class TrainState:
    """The loop's own state for `accelerator.save_state`: the step (= the data position), the curves so far and the
    batch layout that saved it (processes, accumulation steps, rows per micro-step; None in older checkpoints)."""

    def __init__(self):
        self.step = 0
        self.tokens = 0
        self.history: dict[str, list] = {"train": [], "validation": []}
        self.layout: dict[str, int] | None = None

    def state_dict(self) -> dict:
        return {"step": self.step, "tokens": self.tokens, "history": self.history, "layout": self.layout}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.tokens = int(state["tokens"])
        self.history = state["history"]
        self.layout = state.get("layout")


def plot_curves(history: dict[str, list], path, title: str = "") -> None:
    """Training and validation loss (nats per token) against the optimizer step, as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.2))
    train = history.get("train", [])
    if train:
        # the language-model part, comparable with the validation loss (the reconstruction loss is drawn apart)
        lm = [r.get("lm_loss", r["loss"]) for r in train]
        ax.plot([r["step"] for r in train], lm, label="train loss (language model)", alpha=0.8)
        if any(r.get("reconstruction_loss") is not None for r in train):
            ax.plot(
                [r["step"] for r in train],
                [r.get("reconstruction_loss") or 0.0 for r in train],
                label="reconstruction loss",
                alpha=0.6,
            )
    validation = history.get("validation", [])
    if validation:
        ax.plot([r["step"] for r in validation], [r["loss"] for r in validation], "o-", label="validation loss")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (nats / token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


@torch.no_grad()
def generate_samples(
    model, tokenizer, prompts: list[str], *, max_new_tokens: int = 200, temperature: float = 0.8, top_k: int = 40
) -> list[str]:
    """Sampled continuations of `prompts` (prompt included), decoded to text."""
    from .tokenization import decode_bytes, encode_bytes

    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    samples = []
    for prompt in prompts:
        ids = encode_bytes(tokenizer, prompt.encode("utf-8"))
        if not ids:
            ids = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0]
        input_ids = torch.tensor([ids], device=device)
        out = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            max_new_tokens=max_new_tokens,
            do_sample=True,
            temperature=temperature,
            top_k=top_k,
            pad_token_id=tokenizer.pad_token_id,
            disable_compile=True,  # a few samples: compiling the decoding step (CUDA graphs) costs more than it saves
        )
        samples.append(decode_bytes(tokenizer, out[0].tolist()).decode("utf-8", errors="replace"))
    model.train(was_training)
    return samples
