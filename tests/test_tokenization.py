"""Tokenizers save as fast tokenizers, reload through AutoTokenizer and round-trip text and raw bytes exactly."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from longrange.tokenization import (
    byte_tokenizer,
    decode_bytes,
    encode_bytes,
    gpt2_tokenizer,
    is_byte_tokenizer,
    load_tokenizer,
    train_bpe_tokenizer,
)

DATA = Path(__file__).resolve().parents[2] / "shared" / "data"
TEXT = "Fair is foul, and foul is fair:\nHover through the fog and filthy air. Ünïcödé ☃ 😀 \t tabs  and  spaces ."
# invalid UTF-8 everywhere: a lone continuation byte, 0xff, a truncated 3-byte sequence, NUL, and a special-token look-alike
RAW = b"\x80start \xff\xfe mid \xe2\x98 end\x00 </s> <pad> \xc3\xa9\xc3"


@pytest.fixture(scope="module")
def shakespeare() -> str:
    return (DATA / "tinyshakespeare.txt").read_text(encoding="utf-8")[:40_000]


@pytest.fixture(scope="module")
def saved(tmp_path_factory, shakespeare):
    """Each tokenizer kind saved with save_pretrained and reloaded with AutoTokenizer."""
    folders = {}
    for name, tok in {
        "byte": byte_tokenizer(),
        "bpe": train_bpe_tokenizer([shakespeare], vocab_size=400),
        "gpt2": gpt2_tokenizer(DATA / "gpt2-bpe"),
    }.items():
        folder = tmp_path_factory.mktemp(name)
        tok.save_pretrained(folder)
        folders[name] = (tok, AutoTokenizer.from_pretrained(folder))
    return folders


def test_byte_ids_are_utf8_byte_values_and_specials_follow():
    tok = byte_tokenizer()
    assert len(tok) == 259
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (256, 257, 258)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert ids == list(TEXT.encode("utf-8"))  # independent: Python's own UTF-8 encoder
    assert tok(TEXT)["input_ids"] == ids  # nothing is added automatically


@pytest.mark.parametrize("kind", ["byte", "bpe", "gpt2"])
def test_saved_tokenizer_round_trips_text(saved, kind, shakespeare):
    original, reloaded = saved[kind]
    for text in (TEXT, shakespeare[:5000], " leading space", "x  .  ,"):
        ids = reloaded(text, add_special_tokens=False)["input_ids"]
        assert ids == original(text, add_special_tokens=False)["input_ids"]
        assert reloaded.decode(ids) == text


@pytest.mark.parametrize("kind", ["byte", "bpe", "gpt2"])
def test_saved_tokenizer_round_trips_non_utf8_bytes(saved, kind):
    _, reloaded = saved[kind]
    ids = encode_bytes(reloaded, RAW)
    special = set(reloaded.all_special_ids)
    assert not special & set(ids)  # "</s>" in the data is data, not an end-of-sequence marker
    assert decode_bytes(reloaded, ids) == RAW
    every_byte = bytes(range(256))
    assert decode_bytes(reloaded, encode_bytes(reloaded, every_byte)) == every_byte


def test_encode_bytes_of_byte_tokenizer_is_identity():
    tok = byte_tokenizer()
    assert encode_bytes(tok, RAW) == list(RAW)
    assert decode_bytes(tok, list(RAW) + [tok.eos_token_id]) == RAW
    assert decode_bytes(tok, [tok.eos_token_id], skip_special_tokens=False) == b"</s>"


def test_bpe_compresses_and_keeps_every_byte(shakespeare):
    tok = train_bpe_tokenizer([shakespeare], vocab_size=400)
    assert len(tok) == 400
    ids = tok(shakespeare, add_special_tokens=False)["input_ids"]
    assert len(ids) < 0.7 * len(shakespeare.encode())  # merges were learned
    assert tok.unk_token_id is None  # every byte is in the alphabet: nothing can be unknown


def test_gpt2_matches_known_ids():
    tok = gpt2_tokenizer(DATA / "gpt2-bpe")
    # ids published for the GPT-2 vocabulary ("Hello world" -> 15496, 995; "<|endoftext|>" -> 50256)
    assert tok("Hello world")["input_ids"] == [15496, 995]
    assert tok.eos_token_id == 50256 == len(tok) - 1


def test_load_tokenizer_specs(tmp_path, shakespeare):
    assert len(load_tokenizer("byte")) == 259
    assert len(load_tokenizer("bpe", texts=[shakespeare], vocab_size=300)) == 300
    assert len(load_tokenizer(f"gpt2:{DATA / 'gpt2-bpe'}")) == 50257
    byte_tokenizer().save_pretrained(tmp_path)
    assert len(load_tokenizer(str(tmp_path))) == 259


def test_bad_inputs_give_clear_errors(tmp_path):
    with pytest.raises(ValueError, match="needs `texts`"):
        load_tokenizer("bpe")
    with pytest.raises(ValueError, match="no text"):
        train_bpe_tokenizer(["", ""], vocab_size=300)
    with pytest.raises(ValueError, match="vocab_size must be at least 259"):
        train_bpe_tokenizer(["abc"], vocab_size=100)
    with pytest.raises(FileNotFoundError, match="vocab.json"):
        gpt2_tokenizer(tmp_path)
    with pytest.raises(FileNotFoundError, match="no such folder"):
        load_tokenizer("./does/not/exist")
    with pytest.raises(TypeError, match="takes bytes"):
        encode_bytes(byte_tokenizer(), "a str")


def test_is_byte_tokenizer_survives_save_and_reload(saved):
    assert is_byte_tokenizer(saved["byte"][1])
    assert not is_byte_tokenizer(saved["bpe"][1])
    assert not is_byte_tokenizer(saved["gpt2"][1])
