"""Corpora -> one id stream per split -> fixed windows, for every script of the package.

The flow is `load_corpus` (documents per split) -> `tokenize_corpus` (one id stream per split) -> a batcher that
cuts windows out of a stream. Two batchers share one layout so that several processes and gradient accumulation
see exactly the batch a single process sees:

* `StreamBatcher` (Transformer-XL training): the stream is cut into `global_batch` contiguous lanes and row b of
  step t continues lane b exactly where step t-1 stopped, so a memory carried across steps sees real context;
* `RandomWindowBatcher`: non-overlapping windows in a seeded random order, reshuffled every epoch.

Both are pure functions of the step number (no iterator state), so an exact resume only needs the step.
Training code never enters the saved-model path: nothing here is imported by the modeling files.
"""

from __future__ import annotations

import math
import os
import sysconfig
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

SPLITS = ("train", "validation", "test")
# Fractions (train, validation, test). 90/5/5 by default; Tiny Shakespeare's convention is 90/10/0.
DEFAULT_SPLIT = (0.90, 0.05, 0.05)
# The default corpus is capped so that `longrange train` stays a few-minute job on 2 CPU cores.
DEFAULT_STDLIB_MAX_BYTES = 4_000_000
# Folders of the standard library that are not "the library": installed packages, its own (huge) test suite,
# byte-code caches.
_STDLIB_SKIP = {"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__"}


@dataclass
class Corpus:
    """Documents per split. Byte-level corpora hold `bytes` (read raw, never decoded), others `str`."""

    name: str
    splits: dict[str, list]
    split_by: str  # "document" or "position": how train/validation/test were separated
    source_files: list[str] = field(default_factory=list)

    def num_bytes(self, split: str) -> int:
        return sum(len(d) if isinstance(d, bytes) else len(d.encode("utf-8")) for d in self.splits[split])

    def num_chars(self, split: str) -> int:
        return sum(
            len(d) if isinstance(d, str) else len(d.decode("utf-8", errors="replace")) for d in self.splits[split]
        )


# ----------------------------------------------------------------------------------------------------------------
# Loading text
# ----------------------------------------------------------------------------------------------------------------


def stdlib_source_files(max_bytes: int | None = DEFAULT_STDLIB_MAX_BYTES) -> list[Path]:
    """The Python standard library's own `.py` files (found through `sysconfig`), sorted by relative path.

    Installed packages, the standard library's test suite and caches are skipped. With `max_bytes`, files are taken
    in sorted order until the total would pass the cap, so the selection is the same on every run.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for path in sorted(root.rglob("*.py"), key=lambda p: p.relative_to(root).as_posix()):
        if _STDLIB_SKIP.intersection(path.relative_to(root).parts[:-1]) or not path.is_file():
            continue
        files.append(path)
    if not files:
        raise FileNotFoundError(f"no Python source files found in the standard library folder {root}")
    if max_bytes is None:
        return files
    chosen, total = [], 0
    for path in files:
        size = path.stat().st_size
        if chosen and total + size > max_bytes:
            continue  # skip files that would pass the cap, keep trying smaller ones in order
        chosen.append(path)
        total += size
    return chosen


def load_corpus(
    source: str | os.PathLike | None = None,
    *,
    dataset_config: str | None = None,
    text_column: str = "text",
    split: Sequence[float] = DEFAULT_SPLIT,
    as_bytes: bool = False,
    max_bytes: int | None = DEFAULT_STDLIB_MAX_BYTES,
) -> Corpus:
    """Load documents and split them deterministically into train / validation / test.

    source: None or "stdlib" (the default corpus: the standard library's source files), a local text file, a local
        folder (every file below it, sorted by path), or a Hub dataset name (with `dataset_config`).
    split: fractions for (train, validation, test), summing to 1. Several documents are split by document
        (proportionally by size, interleaved in sorted order); a single document is split by position.
    as_bytes: read local files as raw bytes (for the byte tokenizer: any bytes, valid UTF-8 or not, are kept
        exactly); otherwise local files go through the `datasets` "text" builder and must be UTF-8.
    max_bytes: cap on the default corpus only (local files and Hub datasets are used whole).
    """
    split = _check_split(split)
    if source is None or str(source) == "stdlib":
        files = stdlib_source_files(max_bytes)
        docs = [p.read_bytes() for p in files] if as_bytes else _read_text_files(files)
        return _split_corpus("python-stdlib", docs, split, [str(p) for p in files])
    path = Path(source).expanduser()
    if path.is_file():
        docs = [path.read_bytes()] if as_bytes else _read_text_files([path])
        return _split_corpus(path.name, docs, split, [str(path)])
    if path.is_dir():
        files = sorted((p for p in path.rglob("*") if p.is_file() and not _hidden(p, path)), key=lambda p: p.as_posix())
        if not files:
            raise FileNotFoundError(f"the folder {path} contains no files to read text from")
        docs = [p.read_bytes() for p in files] if as_bytes else _read_text_files(files)
        return _split_corpus(path.name, docs, split, [str(p) for p in files])
    if _looks_like_local_path(str(source)):
        raise FileNotFoundError(f"no such file or folder: {source}")
    return _load_hub_dataset(str(source), dataset_config, text_column, split, as_bytes)


def _check_split(split: Sequence[float]) -> tuple[float, float, float]:
    split = tuple(float(f) for f in split)
    if len(split) == 2:
        split = (*split, 0.0)
    if len(split) != 3 or any(f < 0 for f in split) or not math.isclose(sum(split), 1.0, abs_tol=1e-6) or split[0] <= 0:
        raise ValueError(
            f"split must be 2 or 3 non-negative fractions (train, validation[, test]) summing to 1 with train > 0, got {split}"
        )
    return split


def _hidden(path: Path, root: Path) -> bool:
    return any(part.startswith(".") for part in path.relative_to(root).parts)


def _looks_like_local_path(source: str) -> bool:
    # A Hub id is "name" or "owner/name"; anything with a file suffix, several slashes or a path prefix is a path.
    return (
        source.startswith((".", "/", "~"))
        or source.count("/") > 1
        or (os.sep != "/" and os.sep in source)
        or Path(source).suffix != ""
    )


def _read_text_files(files: list[Path]) -> list[str]:
    """One document per file through the `datasets` "text" builder (UTF-8; universal newlines become "\\n")."""
    import datasets

    for f in files:
        if not f.is_file():
            raise FileNotFoundError(f"no such file: {f}")
    try:
        dataset = datasets.load_dataset(
            "text", data_files={"train": [str(f) for f in files]}, sample_by="document", split="train"
        )
    except UnicodeDecodeError as err:
        raise ValueError(
            f"could not decode the text as UTF-8 ({err}); use the byte tokenizer (--tokenizer byte), which reads "
            "raw bytes, or convert the file to UTF-8"
        ) from err
    except Exception as err:  # datasets wraps reader errors in its own exception types
        if isinstance(err.__cause__, UnicodeDecodeError) or "codec can't decode" in str(err):
            raise ValueError(
                f"could not decode the text as UTF-8 ({err}); use the byte tokenizer (--tokenizer byte), which reads "
                "raw bytes, or convert the file to UTF-8"
            ) from err
        raise
    docs = list(dataset["text"])
    if len(docs) != len(files):
        # the builder drops empty files; keep the document list aligned with the file list
        sizes = [f.stat().st_size for f in files]
        it = iter(docs)
        docs = [next(it) if size else "" for size in sizes]
    return docs


def _load_hub_dataset(name: str, config: str | None, column: str, split, as_bytes: bool) -> Corpus:
    """A Hub dataset: its own train/validation/test splits if it has them, else its train split cut by position."""
    import datasets

    try:
        dataset = datasets.load_dataset(name, config)
    except Exception as err:
        offline = os.environ.get("HF_DATASETS_OFFLINE") == "1" or os.environ.get("HF_HUB_OFFLINE") == "1"
        hint = " (HF_DATASETS_OFFLINE / HF_HUB_OFFLINE is set: the Hub cannot be reached)" if offline else ""
        raise FileNotFoundError(
            f"{name!r} is neither a local file or folder nor a loadable Hub dataset{hint}: {type(err).__name__}: {err}"
        ) from err
    names = {"validation": ("validation", "valid", "dev"), "test": ("test",), "train": ("train",)}
    found = {}
    for ours, theirs in names.items():
        for candidate in theirs:
            if candidate in dataset:
                found[ours] = dataset[candidate]
                break
    if "train" not in found:
        raise ValueError(f"Hub dataset {name!r} has no train split (splits: {list(dataset)})")
    if column not in found["train"].column_names:
        raise ValueError(f"Hub dataset {name!r} has no column {column!r} (columns: {found['train'].column_names})")

    def joined(ds) -> str | bytes:
        text = "\n".join(t for t in ds[column] if t is not None)
        return text.encode("utf-8") if as_bytes else text

    if "validation" in found:
        splits = {s: [joined(found[s])] if s in found else [] for s in SPLITS}
        corpus = Corpus(name, splits, "dataset")
        _check_nonempty(corpus)
        return corpus
    return _split_corpus(name, [joined(found["train"])], split, [])


def _split_corpus(name: str, docs: list, split: tuple[float, float, float], files: list[str]) -> Corpus:
    total = sum(len(d) for d in docs)
    if total == 0:
        raise ValueError(f"the corpus {name!r} is empty ({len(docs)} file(s), 0 bytes)")
    wanted = [i for i, f in enumerate(split) if f > 0]
    by_document = _split_by_document(docs, split)
    if by_document is not None and all(by_document[SPLITS[i]] for i in wanted):
        corpus = Corpus(name, by_document, "document", files)
    else:
        # one document (or too few to give every split one): concatenate in order and cut by position
        joiner = b"" if isinstance(docs[0], bytes) else ""
        text = joiner.join(docs)
        a = int(len(text) * split[0])
        b = int(len(text) * (split[0] + split[1]))
        pieces = {"train": text[:a], "validation": text[a:b], "test": text[b:]}
        corpus = Corpus(name, {s: [pieces[s]] if pieces[s] else [] for s in SPLITS}, "position", files)
    _check_nonempty(corpus, wanted)
    return corpus


def _split_by_document(docs: list, split: tuple[float, float, float]) -> dict[str, list] | None:
    """Assign each document, in order, to the split furthest behind its share of the bytes seen so far."""
    if len(docs) < 2:
        return None
    assigned = {s: [] for s in SPLITS}
    got = [0, 0, 0]
    seen = 0
    for doc in docs:
        seen += len(doc)
        deficit = [split[i] * seen - got[i] if split[i] > 0 else -math.inf for i in range(3)]
        i = max(range(3), key=lambda j: (deficit[j], -j))
        assigned[SPLITS[i]].append(doc)
        got[i] += len(doc)
    return assigned


def _check_nonempty(corpus: Corpus, wanted=(0, 1)) -> None:
    for i in wanted:
        s = SPLITS[i]
        if not any(len(d) for d in corpus.splits[s]):
            raise ValueError(
                f"the {s} split of corpus {corpus.name!r} is empty; use a larger corpus or other fractions"
            )


# ----------------------------------------------------------------------------------------------------------------
# Tokenising: one id stream per split
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class TokenStreams:
    """One id stream per split, plus the byte and character counts needed for bits per byte / per character."""

    ids: dict[str, np.ndarray]
    num_bytes: dict[str, int]
    num_chars: dict[str, int]

    def bytes_per_token(self, split: str) -> float:
        return self.num_bytes[split] / max(1, len(self.ids[split]))

    def chars_per_token(self, split: str) -> float:
        return self.num_chars[split] / max(1, len(self.ids[split]))


def tokenize_corpus(corpus: Corpus, tokenizer, separator_id: int | None = -1) -> TokenStreams:
    """Tokenise every split into one stream (documents joined by `separator_id`; -1 means the tokenizer's eos)."""
    if separator_id == -1:
        separator_id = tokenizer.eos_token_id
    ids, nbytes, nchars = {}, {}, {}
    for s in SPLITS:
        docs = [d for d in corpus.splits[s] if len(d)]
        pieces = [_encode(tokenizer, d) for d in docs]
        out = []
        for i, piece in enumerate(pieces):
            if i and separator_id is not None:
                out.append(np.array([separator_id], dtype=np.int64))
            out.append(piece)
        ids[s] = np.concatenate(out) if out else np.zeros(0, dtype=np.int64)
        nbytes[s] = corpus.num_bytes(s)
        nchars[s] = corpus.num_chars(s)
    return TokenStreams(ids, nbytes, nchars)


def _encode(tokenizer, doc: str | bytes) -> np.ndarray:
    from .tokenization import encode_bytes, is_byte_tokenizer

    data = doc if isinstance(doc, bytes) else doc.encode("utf-8")
    if is_byte_tokenizer(tokenizer):
        # byte b has id b: no need to go through the tokenizer for megabytes of text
        return np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    if isinstance(doc, bytes):
        try:
            doc = doc.decode("utf-8")
        except UnicodeDecodeError as err:
            raise ValueError(
                f"the text is not valid UTF-8 ({err}); only the byte tokenizer accepts arbitrary bytes"
            ) from err
    # exact byte-level encoding: a literal special-token string in the text stays text
    return np.asarray(encode_bytes(tokenizer, data), dtype=np.int64)


# ----------------------------------------------------------------------------------------------------------------
# Windows
# ----------------------------------------------------------------------------------------------------------------


def window_multiple(config) -> int:
    """The unit a training window must be a multiple of: the Compressive segment or the Sinkhorn bucket."""
    for name in ("segment_length", "bucket_size"):
        value = getattr(config, name, None)
        if value:
            return int(value)
    return 1


def check_window(window: int, config) -> int:
    """Validate a window length against a model config; returns it. Raises ValueError saying what is allowed."""
    unit = window_multiple(config)
    unit_name = "segment_length" if getattr(config, "segment_length", None) else "bucket_size"
    if window < unit:
        raise ValueError(f"window {window} is shorter than one {unit_name} ({unit}); use a multiple of {unit}")
    if window % unit:
        raise ValueError(f"window {window} must be a multiple of the model's {unit_name} {unit}")
    limit = getattr(config, "max_position_embeddings", None)
    if getattr(config, "model_type", None) == "sinkhorn" and limit and window > limit:
        raise ValueError(f"window {window} exceeds the model's max_position_embeddings {limit}")
    return window


class _Layout:
    """Which rows of a global batch belong to (rank, micro-step): rank-major, then micro-step, then row.

    With P processes and A accumulation steps of B rows, the global batch has P*A*B rows; rank r's micro-step m
    takes rows [(r*A + m)*B, (r*A + m + 1)*B). One process with A=2 therefore computes, micro-step by micro-step,
    exactly what two processes with A=1 compute side by side.
    """

    def __init__(self, global_batch: int, world_size: int, accumulation: int):
        if global_batch % (world_size * accumulation):
            raise ValueError(
                f"global batch {global_batch} must be divisible by processes x accumulation steps "
                f"({world_size} x {accumulation})"
            )
        self.global_batch = global_batch
        self.world_size = world_size
        self.accumulation = accumulation
        self.rows = global_batch // (world_size * accumulation)

    def rows_of(self, rank: int, micro: int) -> slice:
        start = (rank * self.accumulation + micro) * self.rows
        return slice(start, start + self.rows)


class StreamBatcher:
    """Transformer-XL batches: lane b of the stream feeds row b, step after step.

    ids: the id stream; window: tokens per row and step; global_batch: rows per optimizer step over all processes
    and accumulation steps. The stream is cut into `global_batch` contiguous lanes of `steps_per_epoch * window`
    tokens (the tail that does not fill a window is dropped). At step t, row b is lane b's tokens
    [t*window, (t+1)*window) (t taken modulo `steps_per_epoch`; `starts_epoch(t)` tells when memories must be reset).
    """

    def __init__(self, ids: np.ndarray, window: int, global_batch: int, world_size: int = 1, accumulation: int = 1):
        self.layout = _Layout(global_batch, world_size, accumulation)
        self.window = window
        lane = len(ids) // global_batch
        self.steps_per_epoch = lane // window
        if self.steps_per_epoch == 0:
            raise ValueError(
                f"a stream of {len(ids)} tokens cannot feed {global_batch} lanes of at least one {window}-token window"
            )
        used = self.steps_per_epoch * window
        self.lanes = torch.as_tensor(np.asarray(ids[: global_batch * lane]).reshape(global_batch, lane)[:, :used])

    def starts_epoch(self, step: int) -> bool:
        return step % self.steps_per_epoch == 0

    def batch(self, step: int, rank: int = 0, micro: int = 0) -> torch.Tensor:
        """Rows [rows_per_micro_step, window] for this rank and accumulation micro-step at optimizer step `step`."""
        t = step % self.steps_per_epoch
        return self.lanes[self.layout.rows_of(rank, micro), t * self.window : (t + 1) * self.window].clone()


class RandomWindowBatcher:
    """Non-overlapping windows in a random order drawn from `seed` and the epoch: a pure function of the step."""

    def __init__(
        self, ids: np.ndarray, window: int, global_batch: int, world_size: int = 1, accumulation: int = 1, seed: int = 0
    ):
        self.layout = _Layout(global_batch, world_size, accumulation)
        self.window = window
        count = len(ids) // window
        if count < global_batch:
            raise ValueError(
                f"a stream of {len(ids)} tokens holds {count} windows of {window}, fewer than one global batch "
                f"({global_batch})"
            )
        self.windows = torch.as_tensor(np.asarray(ids[: count * window]).reshape(count, window))
        self.steps_per_epoch = count // global_batch
        self.seed = seed
        self._order_cache: tuple[int, torch.Tensor] | None = None

    def starts_epoch(self, step: int) -> bool:
        return step % self.steps_per_epoch == 0

    def _order(self, epoch: int) -> torch.Tensor:
        if self._order_cache is None or self._order_cache[0] != epoch:
            rng = np.random.default_rng([self.seed, epoch])
            self._order_cache = (epoch, torch.as_tensor(rng.permutation(len(self.windows))))
        return self._order_cache[1]

    def batch(self, step: int, rank: int = 0, micro: int = 0) -> torch.Tensor:
        epoch, t = divmod(step, self.steps_per_epoch)
        rows = self.layout.rows_of(rank, micro)
        index = self._order(epoch)[t * self.layout.global_batch :][rows]
        return self.windows[index].clone()


def eval_windows(ids: np.ndarray, window: int, batch_size: int, max_tokens: int | None = None) -> list[torch.Tensor]:
    """Evaluation batches in streaming order: `batch_size` contiguous lanes, windows taken left to right.

    A model that carries a cache across calls (Compressive) therefore sees each lane as one long document.
    `max_tokens` caps the tokens evaluated (taken from the start of the stream).
    """
    if max_tokens is not None:
        ids = ids[:max_tokens]
    batch_size = max(1, min(batch_size, len(ids) // window))
    lane = len(ids) // batch_size
    steps = lane // window
    if steps == 0:
        raise ValueError(f"the evaluation stream has {len(ids)} tokens, fewer than one window of {window}")
    lanes = torch.as_tensor(np.asarray(ids[: batch_size * lane]).reshape(batch_size, lane))
    return [lanes[:, t * window : (t + 1) * window] for t in range(steps)]


def windows_dataset(ids: np.ndarray, window: int):
    """A `datasets.Dataset` of non-overlapping windows with `input_ids` and `labels` (the models shift labels)."""
    import datasets

    count = len(ids) // window
    if count == 0:
        raise ValueError(f"a stream of {len(ids)} tokens holds no window of {window}")
    rows = np.asarray(ids[: count * window]).reshape(count, window).tolist()
    return datasets.Dataset.from_dict({"input_ids": rows, "labels": rows})
