"""Tokenizers for longrange models, all returned as transformers fast tokenizers.

Three kinds, all byte-level underneath (every string is first turned into its UTF-8 bytes, each byte shown as one
printable character by the GPT-2 byte-to-unicode table), so any text can be encoded and decoded exactly:

- `byte_tokenizer()`: one token per byte, the enwik8 convention. Ids 0..255 are the byte values themselves; the special
  tokens come after them (`<pad>` 256, `<s>` 257, `</s>` 258).
- `train_bpe_tokenizer(texts, vocab_size)`: a byte-level BPE trained with `tokenizers` on your texts.
- `gpt2_tokenizer(path)`: the GPT-2 BPE from local `vocab.json` + `merges.txt` (no download).

`load_tokenizer(spec, ...)` picks one from a short string; the commands use it for their `--tokenizer` option.

Raw bytes that are not valid UTF-8 (enwik8 has some) cannot be passed to a tokenizer that takes `str`. Use
`encode_bytes(tokenizer, data)` and `decode_bytes(tokenizer, ids)`: for the byte tokenizer they are the identity on
byte values, and for every byte-level tokenizer here `decode_bytes(tok, encode_bytes(tok, data)) == data`.

None of these tokenizers adds special tokens on its own (like GPT-2): training windows are the raw token stream.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from functools import lru_cache
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

PAD_TOKEN, BOS_TOKEN, EOS_TOKEN = "<pad>", "<s>", "</s>"
SPECIAL_TOKENS = [PAD_TOKEN, BOS_TOKEN, EOS_TOKEN]
GPT2_ENDOFTEXT = "<|endoftext|>"
DEFAULT_GPT2_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gpt2-bpe"


@lru_cache(maxsize=1)
def bytes_to_unicode() -> dict[int, str]:
    """The GPT-2 byte -> printable character table (the alphabet of `pre_tokenizers.ByteLevel`)."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    # The byte-level pre-tokenizer maps the printable latin-1 bytes to themselves and the other 68 bytes, in order,
    # to chr(256), chr(257), ...; rebuild the table that way and check it against the library's alphabet.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    if set(table.values()) != set(alphabet):
        raise RuntimeError("tokenizers' ByteLevel alphabet differs from the GPT-2 byte table this module assumes")
    return table


def _finish(backend: Tokenizer, **special) -> PreTrainedTokenizerFast:
    # clean_up_tokenization_spaces would rewrite " ." as "." on decode: never exact, so always off.
    return PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False, **special)


def _byte_level_pipeline(backend: Tokenizer, use_regex: bool) -> None:
    # add_prefix_space=False: no invented leading space, so decode(encode(text)) == text.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=use_regex)
    backend.decoder = decoders.ByteLevel()


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """One token per UTF-8 byte: ids 0..255 are byte values, then `<pad>`=256, `<s>`=257, `</s>`=258."""
    table = bytes_to_unicode()
    vocab = {table[b]: b for b in range(256)}
    for offset, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = 256 + offset
    # A BPE without merges is a plain character -> id lookup over the byte-level characters.
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    # The regex split only keeps the pieces short (the BPE word cache likes that); with no merges it cannot change ids.
    _byte_level_pipeline(backend, use_regex=True)
    backend.add_special_tokens(SPECIAL_TOKENS)
    return _finish(backend, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN)


def train_bpe_tokenizer(texts: Iterable[str], vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Train a byte-level BPE on `texts`; special tokens `<pad>`, `<s>`, `</s>` get ids 0, 1, 2."""
    minimum = 256 + len(SPECIAL_TOKENS)
    if vocab_size < minimum:
        raise ValueError(
            f"vocab_size must be at least {minimum} (256 bytes + {len(SPECIAL_TOKENS)} specials), got {vocab_size}"
        )
    backend = Tokenizer(models.BPE())
    _byte_level_pipeline(backend, use_regex=True)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        # every byte is in the vocabulary even if the training text never shows it: no unknown tokens, ever
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    seen = {"any": False}

    def _iterate():
        for text in texts:
            if text:
                seen["any"] = True
                yield text

    backend.train_from_iterator(_iterate(), trainer=trainer)
    if not seen["any"]:
        raise ValueError("train_bpe_tokenizer got no text: the iterable was empty or held only empty strings")
    return _finish(backend, pad_token=PAD_TOKEN, bos_token=BOS_TOKEN, eos_token=EOS_TOKEN)


def gpt2_tokenizer(path: str | Path = DEFAULT_GPT2_DIR) -> PreTrainedTokenizerFast:
    """The GPT-2 BPE read from `<path>/vocab.json` and `<path>/merges.txt` (offline). `<|endoftext|>` is bos, eos and pad."""
    path = Path(path)
    vocab_file, merges_file = path / "vocab.json", path / "merges.txt"
    missing = [str(f) for f in (vocab_file, merges_file) if not f.is_file()]
    if missing:
        raise FileNotFoundError(f"gpt2_tokenizer needs vocab.json and merges.txt; missing: {', '.join(missing)}")
    vocab = json.loads(vocab_file.read_text(encoding="utf-8"))
    merges = []
    for line in merges_file.read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#version"):
            merges.append(tuple(line.split(" ")))
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    _byte_level_pipeline(backend, use_regex=True)
    backend.add_special_tokens([GPT2_ENDOFTEXT])
    return _finish(backend, bos_token=GPT2_ENDOFTEXT, eos_token=GPT2_ENDOFTEXT, pad_token=GPT2_ENDOFTEXT)


def load_tokenizer(spec: str, texts: Iterable[str] | None = None, vocab_size: int = 8192) -> PreTrainedTokenizerFast:
    """Build or load a tokenizer from a short spec.

    - "byte": `byte_tokenizer()`
    - "bpe": `train_bpe_tokenizer(texts, vocab_size)`; `texts` is required
    - "gpt2" or "gpt2:<dir>": `gpt2_tokenizer(dir)` (default dir: ../shared/data/gpt2-bpe)
    - anything else: a folder written by `save_pretrained`, or a Hub id, through `AutoTokenizer.from_pretrained`
    """
    if spec == "byte":
        return byte_tokenizer()
    if spec == "bpe":
        if texts is None:
            raise ValueError('load_tokenizer("bpe") trains a new BPE and needs `texts` (an iterable of strings)')
        return train_bpe_tokenizer(texts, vocab_size=vocab_size)
    if spec == "gpt2":
        return gpt2_tokenizer()
    if spec.startswith("gpt2:"):
        return gpt2_tokenizer(spec[len("gpt2:") :])
    path = Path(spec).expanduser()
    if path.exists():
        if not path.is_dir():
            raise ValueError(f"tokenizer spec {spec!r} is a file; give the folder written by save_pretrained")
        return AutoTokenizer.from_pretrained(str(path))
    looks_like_path = spec.startswith((".", "/", "~")) or spec.count("/") > 1 or "\\" in spec
    if looks_like_path:
        raise FileNotFoundError(
            f"tokenizer spec {spec!r}: no such folder (expected 'byte', 'bpe', 'gpt2', 'gpt2:<dir>', a saved folder or a Hub id)"
        )
    return AutoTokenizer.from_pretrained(spec)  # a Hub id; needs network unless it is in the local cache


def _byte_char_ids(tokenizer: PreTrainedTokenizerFast) -> list[int]:
    """Id of each single-byte token (byte b -> its byte-level character), for byte-level tokenizers."""
    table = bytes_to_unicode()
    vocab = tokenizer.get_vocab()
    try:
        return [vocab[table[b]] for b in range(256)]
    except KeyError as err:
        raise ValueError(
            "encode_bytes/decode_bytes need a byte-level tokenizer (all 256 byte tokens in the vocabulary)"
        ) from err


def is_byte_tokenizer(tokenizer: PreTrainedTokenizerFast) -> bool:
    """True for a one-token-per-byte tokenizer whose id of byte b is b (what `byte_tokenizer()` builds and saves)."""
    table = bytes_to_unicode()
    vocab = tokenizer.get_vocab()
    if any(vocab.get(table[b]) != b for b in range(256)):
        return False
    special = set(tokenizer.all_special_tokens)
    return all(token in special or len(token) == 1 for token in vocab)


def encode_bytes(tokenizer: PreTrainedTokenizerFast, data: bytes) -> list[int]:
    """Token ids for arbitrary bytes, valid UTF-8 or not; never produces special-token ids.

    Valid UTF-8 runs go through the tokenizer as text (so BPE merges apply); each byte of an invalid sequence becomes
    its single-byte token. For the byte tokenizer the result is exactly `list(data)`.
    """
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"encode_bytes takes bytes, got {type(data).__name__}; encode str with the tokenizer itself")
    data = bytes(data)
    if is_byte_tokenizer(tokenizer):
        return list(data)  # the byte tokenizer's id of byte b is b (checked just above)
    byte_ids = _byte_char_ids(tokenizer)
    ids: list[int] = []
    start = 0
    while start < len(data):
        # find the longest valid UTF-8 prefix of data[start:]
        try:
            text = data[start:].decode("utf-8")
            end = len(data)
        except UnicodeDecodeError as err:
            text = data[start : start + err.start].decode("utf-8")
            end = start + err.start
        if text:
            ids.extend(tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"])
        if end < len(data):
            ids.append(byte_ids[data[end]])  # one undecodable byte
            end += 1
        start = end
    return ids


def decode_bytes(tokenizer: PreTrainedTokenizerFast, ids: Iterable[int], skip_special_tokens: bool = True) -> bytes:
    """The exact bytes behind `ids` (the inverse of `encode_bytes`); special tokens are dropped by default."""
    table = bytes_to_unicode()
    inverse = {char: b for b, char in table.items()}
    special = set(tokenizer.all_special_ids)
    out = bytearray()
    for token_id, token in zip(ids := list(ids), tokenizer.convert_ids_to_tokens(ids)):
        if token_id in special:
            if not skip_special_tokens:
                out += token.encode("utf-8")
            continue
        if token is None:
            raise ValueError(f"token id {token_id} is not in the vocabulary (size {len(tokenizer)})")
        out += bytes(inverse[char] for char in token)
    return bytes(out)
