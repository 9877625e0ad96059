"""Perplexity and bits per byte / character of a saved model over one long file.

    longrange evaluate runs/compressive ../shared/data/tinyshakespeare.txt --max_tokens 100000 --json out.json

Every token but the first is scored exactly once, given all the context the model can use:

* `--method cache` (default for the Compressive model): the document is fed chunk by chunk (`--chunk_length`
  tokens, default the multiple of the segment length nearest 512) with the memory cache carried across the whole
  document, so token t is predicted from everything before it that the memories kept. Any chunking gives the same
  result as one forward over the whole document.
* `--method sliding` (default for Sinkhorn and other models): windows of `--window` tokens (default: the model's
  maximum, a multiple of its bucket size) moved by `--stride` tokens; each window scores only its new tokens, so every
  token after the first window has at least `window - stride` tokens of context.

The file is read as bytes (invalid UTF-8 is fine for byte-level tokenizers). Bits per byte = total NLL / ln 2 / bytes;
bits per character is reported when the file is valid UTF-8.

`--mem_len` / `--c_mem_len` (Compressive model) evaluate with another memory than the model was trained with
(Transformer-XL's protocol: a longer memory at evaluation). They are applied to the saved config before the model is
built (so everything sized from them, such as the attention's slot capacity, follows) and validated as any config
is; no weight's shape depends on them, and a change that would alter one is refused (`check_same_parameters`).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import longrange  # noqa: F401  registers the longrange model types with the Auto classes
from longrange.commands import command_parser
from longrange.hub import check_model_source
from longrange.tokenization import decode_bytes, encode_bytes


@dataclass
class Document:
    ids: torch.Tensor  # [n] token ids
    num_bytes: int
    num_chars: int | None  # None when the file is not valid UTF-8


@dataclass
class Scores:
    nll: torch.Tensor  # [n - 1]: nll[i] is the loss of token i + 1 (nats)
    windows: list[tuple[int, int, int]] = field(default_factory=list)  # sliding: (begin, end, first scored token)


def read_document(path: str | Path, tokenizer, max_tokens: int | None = None) -> Document:
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    data = path.read_bytes()
    if not data:
        raise ValueError(f"{path} is empty: nothing to evaluate")
    ids = torch.tensor(encode_bytes(tokenizer, data), dtype=torch.long)
    if max_tokens is not None and len(ids) > max_tokens:
        ids = ids[:max_tokens]
        data = decode_bytes(tokenizer, ids.tolist())  # the bytes the kept tokens cover
    if len(ids) < 2:
        raise ValueError(f"{path} holds {len(ids)} token: at least 2 are needed to score a prediction")
    try:
        num_chars = len(data.decode("utf-8"))
    except UnicodeDecodeError:
        num_chars = None
    return Document(ids, len(data), num_chars)


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[..., k, vocab] logits predicting [..., k] targets -> [..., k] losses in nats (float32)."""
    losses = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return losses.view(targets.shape)


@torch.no_grad()
def nll_with_cache(model, ids: torch.Tensor, chunk_length: int) -> Scores:
    """Feed `ids` in chunks, carrying the model's cache; a chunk's last logits predict the next chunk's first token.

    ids: [n] (one document) or [rows, n] (several documents of the same length, each row with its own memory);
    the scores are [n - 1] or [rows, n - 1] accordingly."""
    device = next(model.parameters()).device
    rows = ids if ids.ndim == 2 else ids[None]
    losses, cache, previous = [], None, None  # previous: [rows, vocab] logits of the last token fed so far
    for start in range(0, rows.shape[1], chunk_length):
        chunk = rows[:, start : start + chunk_length].to(device)
        out = model(input_ids=chunk, cache=cache, use_cache=True)
        cache = out.cache
        logits = out.logits  # [rows, chunk, vocab]
        if previous is not None:
            logits_for_chunk = torch.cat([previous[:, None], logits[:, :-1]], dim=1)  # predicts chunk[0 .. end]
            losses.append(_token_nll(logits_for_chunk, chunk))
        else:
            losses.append(_token_nll(logits[:, :-1], chunk[:, 1:]))
        previous = logits[:, -1]
    nll = torch.cat(losses, dim=1).cpu()
    return Scores(nll if ids.ndim == 2 else nll[0])


def sliding_windows(n: int, window: int, stride: int) -> list[tuple[int, int, int]]:
    """(begin, end, first_scored) per window: tokens [first_scored, end) are scored, predicted from [begin, end)."""
    if window < 2:
        raise ValueError(f"--window must be at least 2, got {window}")
    if not 1 <= stride < window:
        raise ValueError(
            f"--stride must be between 1 and window - 1 = {window - 1} (every scored token needs context), got {stride}"
        )
    end = min(window, n)
    spans = [(0, end, 1)]
    while end < n:
        new_end = min(end + stride, n)
        spans.append((max(0, new_end - window), new_end, end))
        end = new_end
    return spans


@torch.no_grad()
def nll_sliding(
    model, ids: torch.Tensor, window: int, stride: int, multiple: int, pad_id: int, batch_size: int
) -> Scores:
    """Score each token once with sliding windows. A window shorter than a multiple of the model's bucket size is
    right-padded: the model is causal, so padding after the last real token cannot change the real tokens' logits."""
    device = next(model.parameters()).device
    spans = sliding_windows(len(ids), window, stride)
    nll = torch.empty(len(ids) - 1)
    for first in range(0, len(spans), batch_size):
        group = spans[first : first + batch_size]
        length = max(end - begin for begin, end, _ in group)
        length = -(-length // multiple) * multiple  # round up to the model's unit
        rows = torch.full((len(group), length), pad_id, dtype=torch.long)
        for row, (begin, end, _) in enumerate(group):
            rows[row, : end - begin] = ids[begin:end]
        logits = model(input_ids=rows.to(device), use_cache=False).logits  # [rows, length, vocab]
        for row, (begin, end, scored) in enumerate(group):
            # token t is predicted by the logits at position t - 1 - begin of its window
            predicting = logits[row, scored - 1 - begin : end - 1 - begin]
            nll[scored - 1 : end - 1] = _token_nll(predicting, ids[scored:end].to(device)).cpu()
    return Scores(nll, spans)


MEMORY_FIELDS = ("mem_len", "c_mem_len")


def with_memory(config, *, mem_len: int | None = None, c_mem_len: int | None = None, trust_remote_code: bool = False):
    """`config` with the memory lengths given (None: keep the saved one); the same object when nothing is given.

    The new config goes through the config class's own validation (`from_dict`), so a value the model does not
    accept (c_mem_len=0, mem_len below compression_rate, ...) is refused with the config's message. Models without a
    memory are refused, and so is any change that would alter the shape of a weight (`check_same_parameters`)."""
    overrides = {name: value for name, value in zip(MEMORY_FIELDS, (mem_len, c_mem_len)) if value is not None}
    if not overrides:
        return config
    if not all(hasattr(config, name) for name in MEMORY_FIELDS):
        raise ValueError(
            f"--mem_len / --c_mem_len apply to models with a memory (model_type 'compressive'); this "
            f"{getattr(config, 'model_type', type(config).__name__)!r} model has none"
        )
    try:
        new = type(config).from_dict({**config.to_dict(), **overrides})
    except ValueError as err:
        given = ", ".join(f"--{name} {value}" for name, value in overrides.items())
        raise ValueError(f"{given}: the model's config refuses it: {err}") from err
    check_same_parameters(config, new, trust_remote_code=trust_remote_code)
    return new


def parameter_shapes(config, trust_remote_code: bool = False) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every entry of the state dict a model built from `config` has (built on the meta device:
    no memory, no initialisation work)."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def check_same_parameters(old, new, trust_remote_code: bool = False) -> None:
    """Raise ValueError when a model built from `new` would not hold the weights of one built from `old` (a
    parameter or buffer added, removed or of another shape): the saved weights could not apply."""
    before, after = parameter_shapes(old, trust_remote_code), parameter_shapes(new, trust_remote_code)
    changed = sorted(
        f"{name} {before.get(name, 'absent')} -> {after.get(name, 'absent')}"
        for name in before.keys() | after.keys()
        if before.get(name) != after.get(name)
    )
    if changed:
        raise ValueError(
            f"this config change alters the model's weights ({'; '.join(changed[:5])}"
            f"{'; ...' if len(changed) > 5 else ''}): the saved weights cannot be used with it"
        )


def load_model(name: str, *, mem_len: int | None = None, c_mem_len: int | None = None, trust_remote_code: bool = False):
    """The saved model `name`, built from its config with the memory lengths given (see `with_memory`)."""
    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    config = with_memory(config, mem_len=mem_len, c_mem_len=c_mem_len, trust_remote_code=trust_remote_code)
    return AutoModelForCausalLM.from_pretrained(name, config=config, trust_remote_code=trust_remote_code)


def default_method(config) -> str:
    return "cache" if getattr(config, "model_type", None) == "compressive" else "sliding"


def model_unit(config) -> int:
    """The length a sliding window is padded to a multiple of (Sinkhorn: the bucket size)."""
    return int(getattr(config, "bucket_size", None) or 1)


def max_window(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    return None


def summarise(doc: Document, scores: Scores, seconds: float) -> dict[str, float | int | None]:
    total = float(scores.nll.double().sum())
    count = len(scores.nll)
    mean = total / count
    return {
        "tokens": len(doc.ids),
        "scored_tokens": count,
        "bytes": doc.num_bytes,
        "total_nll": total,
        "nll_per_token": mean,
        "perplexity": math.exp(min(mean, 700.0)),
        "bits_per_token": mean / math.log(2),
        "bits_per_byte": total / math.log(2) / doc.num_bytes,
        "bits_per_char": total / math.log(2) / doc.num_chars if doc.num_chars else None,
        "seconds": seconds,
        "tokens_per_second": count / seconds if seconds > 0 else None,
    }


def format_table(rows: dict[str, object]) -> str:
    width = max(len(k) for k in rows)
    lines = [f"| {'metric'.ljust(width)} | value |", f"| {'-' * width} | --- |"]
    for key, value in rows.items():
        if isinstance(value, float):
            value = f"{value:,.4f}" if abs(value) < 1e6 else f"{value:,.0f}"
        elif isinstance(value, int):
            value = f"{value:,}"
        lines.append(f"| {key.ljust(width)} | {value} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = command_parser("evaluate", __doc__, first_paragraph_only=True)
    p.add_argument("model", help="saved model folder or Hub id (its tokenizer is used)")
    p.add_argument("file", help="the text file to score (read as bytes)")
    p.add_argument("--method", choices=["auto", "cache", "sliding"], default="auto")
    p.add_argument("--chunk_length", type=int, default=None, help="cache method: tokens per call (default: ~512)")
    p.add_argument("--window", type=int, default=None, help="sliding method: window length (default: model maximum)")
    p.add_argument("--stride", type=int, default=None, help="sliding method: new tokens per window (default: window/2)")
    p.add_argument("--batch_size", type=int, default=4, help="sliding method: windows per forward")
    p.add_argument("--max_tokens", type=int, default=None, help="score only the first N tokens of the file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--trust_remote_code", action="store_true")
    p.add_argument("--mem_len", type=int, default=None, help="Compressive: evaluate with this memory length")
    p.add_argument("--c_mem_len", type=int, default=None, help="Compressive: evaluate with this compressed memory")
    return p.parse_args(argv)


def main(argv=None) -> tuple[dict, Scores]:
    args = parse_args(argv)
    check_model_source(args.model)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    model = load_model(args.model, mem_len=args.mem_len, c_mem_len=args.c_mem_len,
                       trust_remote_code=args.trust_remote_code)  # fmt: skip
    model.to(args.device).eval()
    config = model.config
    doc = read_document(args.file, tokenizer, args.max_tokens)
    method = default_method(config) if args.method == "auto" else args.method
    start = time.perf_counter()
    if method == "cache":
        if args.window is not None or args.stride is not None:
            raise ValueError("--window/--stride belong to --method sliding; the cache method takes --chunk_length")
        # any chunking gives the same result (the cache segments by tokens seen); ~512 tokens per call is faster
        # than one segment per call and keeps the activations small
        segment = int(getattr(config, "segment_length", 0) or 1)
        chunk = args.chunk_length or segment * max(1, 512 // segment)
        if chunk < 1:
            raise ValueError(f"--chunk_length must be positive, got {chunk}")
        limit = max_window(config)
        if getattr(config, "model_type", None) != "compressive" and limit and len(doc.ids) > limit:
            raise ValueError(
                f"--method cache over {len(doc.ids)} tokens needs a model with unbounded memory; this "
                f"{config.model_type} model has {limit} positions: use --method sliding"
            )
        scores = nll_with_cache(model, doc.ids, chunk)
        setting = {"chunk_length": chunk}
    else:
        if args.chunk_length is not None:
            raise ValueError("--chunk_length belongs to --method cache; the sliding method takes --window/--stride")
        unit, limit = model_unit(config), max_window(config)
        window = args.window or (limit // unit * unit if limit else 1024)
        if limit and window > limit:
            raise ValueError(f"--window {window} exceeds the model's maximum of {limit} positions")
        if window % unit:
            raise ValueError(f"--window {window} must be a multiple of the model's bucket_size {unit}")
        stride = args.stride or max(1, window // 2)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        scores = nll_sliding(model, doc.ids, window, stride, unit, pad_id, args.batch_size)
        setting = {"window": window, "stride": stride, "windows": len(scores.windows)}
    seconds = time.perf_counter() - start
    result = {
        "model": args.model,
        "file": str(args.file),
        "method": method,
        **setting,
        **{name: getattr(config, name) for name in MEMORY_FIELDS if hasattr(config, name)},
        **summarise(doc, scores, seconds),
    }
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result, scores


if __name__ == "__main__":
    main()
