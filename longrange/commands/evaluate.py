"""Perplexity and bits per byte / character of a saved model over long files.

    longrange evaluate runs/compressive ../shared/data/tinyshakespeare.txt --max_tokens 100000 --json out.json
    longrange evaluate runs/compressive a.py b.py c.py d.py          # four documents, scored as rows of one batch
    longrange evaluate runs/compressive big.txt --documents 8         # the file as 8 documents (at line breaks)

Every token but the first is scored exactly once, given all the context the model can use:

* `--method cache` (default for the Compressive model): the document is fed chunk by chunk (`--chunk_length`
  tokens, default the multiple of the segment length nearest 512) with the memory cache carried across the whole
  document, so token t is predicted from everything before it that the memories kept. Any chunking gives the same
  result as one forward over the whole document.
* `--method sliding` (default for Sinkhorn and other models): windows of `--window` tokens (default: the model's
  maximum, a multiple of its bucket size) moved by `--stride` tokens; each window scores only its new tokens, so every
  token after the first window has at least `window - stride` tokens of context.

Each file is a document of its own (scored from an empty memory); `--documents N` cuts each file into N documents
of about equal size at line breaks (each then starts from an empty memory: less context at its start than in one
pass, and a different figure). With the cache method, `--batch_size` documents run as rows of one batch (longest
first, shorter rows right-padded: a causal model's real tokens never see the padding after them), which gives each
document exactly its serial scores, several times faster than one row at a time. A progress bar counts the scored
tokens and their rate.

Files are read as bytes (invalid UTF-8 is fine for byte-level tokenizers). Bits per byte = total NLL / ln 2 / bytes,
over all documents; bits per character is reported when every file is valid UTF-8.

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
    """The file as one document (its first `max_tokens` tokens when given)."""
    (doc,) = read_documents(path, tokenizer, max_tokens)
    return doc


def read_documents(path: str | Path, tokenizer, max_tokens: int | None = None, pieces: int = 1) -> list[Document]:
    """The file (its first `max_tokens` tokens when given) as `pieces` documents of about equal size, cut at line
    breaks (a line break is one byte in UTF-8, never inside a character)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no such file: {path}")
    data = path.read_bytes()
    if not data:
        raise ValueError(f"{path} is empty: nothing to evaluate")
    if max_tokens is not None:
        ids = encode_bytes(tokenizer, data)
        if len(ids) > max_tokens:
            data = decode_bytes(tokenizer, ids[:max_tokens])  # the bytes the kept tokens cover
    docs = [make_document(part, tokenizer) for part in split_at_lines(data, pieces)]
    for i, doc in enumerate(docs):
        if len(doc.ids) < 2:
            where = f"{path}" if pieces == 1 else f"{path}, document {i + 1} of --documents {pieces},"
            raise ValueError(f"{where} holds {len(doc.ids)} token: at least 2 are needed to score a prediction")
    return docs


def make_document(data: bytes, tokenizer) -> Document:
    ids = torch.tensor(encode_bytes(tokenizer, data), dtype=torch.long)
    try:
        num_chars = len(data.decode("utf-8"))
    except UnicodeDecodeError:
        num_chars = None
    return Document(ids, len(data), num_chars)


def split_at_lines(data: bytes, pieces: int) -> list[bytes]:
    """`data` in `pieces` consecutive parts of about equal size, each ending after a line break where the text has
    one near the cut (the last part takes the rest); together they are `data`."""
    if pieces < 1:
        raise ValueError(f"--documents must be at least 1, got {pieces}")
    parts, start = [], 0
    for i in range(1, pieces):
        target = max(start + 1, len(data) * i // pieces)
        cut = data.find(b"\n", target) + 1 or target  # after the next line break (none left: at the target)
        if cut >= len(data):
            break
        parts.append(data[start:cut])
        start = cut
    return parts + [data[start:]]


def _token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[..., k, vocab] logits predicting [..., k] targets -> [..., k] losses in nats (float32)."""
    losses = F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none")
    return losses.view(targets.shape)


@torch.no_grad()
def nll_with_cache(model, ids: torch.Tensor, chunk_length: int, progress=None, lengths=None) -> Scores:
    """Feed `ids` in chunks, carrying the model's cache; a chunk's last logits predict the next chunk's first token.

    ids: [n] (one document) or [rows, n] (several documents, each row with its own memory; `lengths`: each row's
    real tokens, the rest right padding, whose scores are meaningless); the scores are [n - 1] or [rows, n - 1].
    progress: a tqdm bar, advanced by the real tokens of each chunk."""
    device = next(model.parameters()).device
    rows = ids if ids.ndim == 2 else ids[None]
    lengths = lengths or [rows.shape[1]] * rows.shape[0]
    losses, cache, previous = [], None, None  # previous: [rows, vocab] logits of the last token fed so far
    for start in range(0, rows.shape[1], chunk_length):
        if progress is not None:
            progress.update(sum(min(chunk_length, max(0, n - start)) for n in lengths))
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


def nll_documents_with_cache(model, docs: list[Document], chunk_length: int, batch_size: int, pad_id: int,
                             progress=None) -> list[Scores]:  # fmt: skip
    """Each document's scores, `batch_size` documents at a time as rows of one batch: longest first (the least
    padding), shorter rows right-padded with `pad_id`. A causal model's real tokens never attend to the padding that
    follows them, so each document gets the scores it gets alone."""
    if batch_size < 1:
        raise ValueError(f"--batch_size must be at least 1, got {batch_size}")
    order = sorted(range(len(docs)), key=lambda i: -len(docs[i].ids))
    scores: list[Scores | None] = [None] * len(docs)
    for first in range(0, len(order), batch_size):
        group = order[first : first + batch_size]
        lengths = [len(docs[i].ids) for i in group]
        rows = torch.full((len(group), lengths[0]), pad_id, dtype=torch.long)
        for row, i in enumerate(group):
            rows[row, : lengths[row]] = docs[i].ids
        nll = nll_with_cache(model, rows, chunk_length, progress, lengths).nll
        for row, i in enumerate(group):
            scores[i] = Scores(nll[row, : lengths[row] - 1])
    return scores


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
    model, ids: torch.Tensor, window: int, stride: int, multiple: int, pad_id: int, batch_size: int, progress=None
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
        if progress is not None:
            progress.update(sum(end - scored for _, end, scored in group) + (1 if first == 0 else 0))
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


def summarise(docs: list[Document], scores: Scores, seconds: float) -> dict[str, float | int | None]:
    """Totals over the documents (`scores`: all their token scores, concatenated)."""
    total = float(scores.nll.double().sum())
    count = len(scores.nll)
    mean = total / count
    num_bytes = sum(doc.num_bytes for doc in docs)
    num_chars = None if any(doc.num_chars is None for doc in docs) else sum(doc.num_chars for doc in docs)
    return {
        "documents": len(docs),
        "tokens": sum(len(doc.ids) for doc in docs),
        "scored_tokens": count,
        "bytes": num_bytes,
        "total_nll": total,
        "nll_per_token": mean,
        "perplexity": math.exp(min(mean, 700.0)),
        "bits_per_token": mean / math.log(2),
        "bits_per_byte": total / math.log(2) / num_bytes,
        "bits_per_char": total / math.log(2) / num_chars if num_chars else None,
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
        elif isinstance(value, list):
            value = ", ".join(str(v) for v in value)
        lines.append(f"| {key.ljust(width)} | {value} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = command_parser("evaluate", __doc__, first_paragraph_only=True)
    p.add_argument("model", help="saved model folder or Hub id (its tokenizer is used)")
    p.add_argument("files", nargs="+", metavar="file", help="text files to score (read as bytes), each a document")
    p.add_argument("--method", choices=["auto", "cache", "sliding"], default="auto")
    p.add_argument("--documents", type=int, default=1, help="cut each file into N documents at line breaks")
    p.add_argument("--chunk_length", type=int, default=None, help="cache method: tokens per call (default: ~512)")
    p.add_argument("--window", type=int, default=None, help="sliding method: window length (default: model maximum)")
    p.add_argument("--stride", type=int, default=None, help="sliding method: new tokens per window (default: window/2)")
    p.add_argument(
        "--batch_size", type=int, default=4, help="rows per forward: documents (cache method) or windows (sliding)"
    )
    p.add_argument("--max_tokens", type=int, default=None, help="score only the first N tokens of each file")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--json", default=None, help="also write the results to this JSON file")
    p.add_argument("--trust_remote_code", action="store_true")
    p.add_argument("--mem_len", type=int, default=None, help="Compressive: evaluate with this memory length")
    p.add_argument("--c_mem_len", type=int, default=None, help="Compressive: evaluate with this compressed memory")
    p.add_argument(
        "--num_threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1, as `longrange train`: small models gain little from more, and several "
        "threads collapse when the CPU is shared; 0 keeps torch's default)",
    )
    p.add_argument("--no_progress", action="store_true", help="no progress bar")
    return p.parse_args(argv)


def pad_id_of(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0


def score_with_cache(args, model, tokenizer, docs: list[Document], progress) -> tuple[list[Scores], dict]:
    """--method cache: every document with its memory carried from its start, `--batch_size` documents per batch."""
    config = model.config
    if args.window is not None or args.stride is not None:
        raise ValueError("--window/--stride belong to --method sliding; the cache method takes --chunk_length")
    # any chunking gives the same result (the cache segments by tokens seen); ~512 tokens per call is faster than
    # one segment per call and keeps the activations small
    segment = int(getattr(config, "segment_length", 0) or 1)
    chunk = args.chunk_length or segment * max(1, 512 // segment)
    if chunk < 1:
        raise ValueError(f"--chunk_length must be positive, got {chunk}")
    limit, longest = max_window(config), max(len(doc.ids) for doc in docs)
    if getattr(config, "model_type", None) != "compressive" and limit and longest > limit:
        raise ValueError(
            f"--method cache over {longest} tokens needs a model with unbounded memory; this "
            f"{config.model_type} model has {limit} positions: use --method sliding"
        )
    scores = nll_documents_with_cache(model, docs, chunk, args.batch_size, pad_id_of(tokenizer), progress)
    return scores, {"chunk_length": chunk, "batch_size": min(args.batch_size, len(docs))}


def score_sliding(args, model, tokenizer, docs: list[Document], progress) -> tuple[list[Scores], dict]:
    """--method sliding: windows of every document, `--batch_size` windows per forward."""
    config = model.config
    if args.chunk_length is not None:
        raise ValueError("--chunk_length belongs to --method cache; the sliding method takes --window/--stride")
    unit, limit = model_unit(config), max_window(config)
    window = args.window or (limit // unit * unit if limit else 1024)
    if limit and window > limit:
        raise ValueError(f"--window {window} exceeds the model's maximum of {limit} positions")
    if window % unit:
        raise ValueError(f"--window {window} must be a multiple of the model's bucket_size {unit}")
    stride = args.stride or max(1, window // 2)
    pad_id = pad_id_of(tokenizer)
    scores = [nll_sliding(model, d.ids, window, stride, unit, pad_id, args.batch_size, progress) for d in docs]
    return scores, {"window": window, "stride": stride, "windows": sum(len(s.windows) for s in scores)}


def main(argv=None) -> tuple[dict, Scores]:
    """Score the files; returns the results and the scores of every token (the documents' in order, concatenated;
    the windows those of the sliding method, each in its document's positions)."""
    from tqdm.auto import tqdm

    args = parse_args(argv)
    check_model_source(args.model)
    if args.num_threads:
        torch.set_num_threads(args.num_threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model, trust_remote_code=args.trust_remote_code)
    model = load_model(args.model, mem_len=args.mem_len, c_mem_len=args.c_mem_len,
                       trust_remote_code=args.trust_remote_code)  # fmt: skip
    model.to(args.device).eval()
    config = model.config
    docs = [doc for file in args.files for doc in read_documents(file, tokenizer, args.max_tokens, args.documents)]
    method = default_method(config) if args.method == "auto" else args.method
    score = score_with_cache if method == "cache" else score_sliding
    progress = tqdm(total=sum(len(doc.ids) for doc in docs), desc=f"evaluate ({method})", unit="tok",
                    unit_scale=True, dynamic_ncols=True, disable=args.no_progress)  # fmt: skip
    start = time.perf_counter()
    per_document, setting = score(args, model, tokenizer, docs, progress)
    seconds = time.perf_counter() - start
    progress.close()
    scores = Scores(torch.cat([s.nll for s in per_document]), [w for s in per_document for w in s.windows])
    result = {
        "model": args.model,
        "file": str(args.files[0]) if len(args.files) == 1 else [str(f) for f in args.files],
        "method": method,
        **setting,
        **{name: getattr(config, name) for name in MEMORY_FIELDS if hasattr(config, name)},
        **summarise(docs, scores, seconds),
    }
    print(format_table(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    return result, scores


if __name__ == "__main__":
    main()
