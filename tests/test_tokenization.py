"""Tokenizers save as fast tokenizers, reload through AutoTokenizer and round-trip text and raw bytes exactly."""

import json

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
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

ENDOFTEXT = "<|endoftext|>"
TEXT = "Fair is foul, and foul is fair:\nHover through the fog and filthy air. Ünïcödé ☃ 😀 \t tabs  and  spaces ."
# invalid UTF-8 everywhere: a lone continuation byte, 0xff, a truncated 3-byte sequence, NUL, and a special-token look-alike
RAW = b"\x80start \xff\xfe mid \xe2\x98 end\x00 </s> <pad> \xc3\xa9\xc3"


@pytest.fixture(scope="module")
def play(play_text) -> str:
    return play_text[:40_000]


def write_gpt2_files(folder, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    """`vocab.json` and `merges.txt` laid out as GPT-2 ships them (a `#version` line, then one merge per line)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.json").write_text(json.dumps(vocab), encoding="utf-8")
    (folder / "merges.txt").write_text("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in merges), encoding="utf-8")


@pytest.fixture(scope="module")
def gpt2_dir(tmp_path_factory, play):
    """GPT-2-format files of a byte-level BPE trained here with `tokenizers`: 500 tokens, then `<|endoftext|>` last."""
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    backend.train_from_iterator(
        [play], trainers.BpeTrainer(vocab_size=500, initial_alphabet=alphabet, show_progress=False)
    )
    folder = tmp_path_factory.mktemp("gpt2-format")
    backend.model.save(str(folder))  # vocab.json + merges.txt
    vocab = json.loads((folder / "vocab.json").read_text(encoding="utf-8"))
    merges = [tuple(line.split(" ")) for line in (folder / "merges.txt").read_text(encoding="utf-8").splitlines()[1:]]
    assert len(vocab) == 500 and len(merges) == 500 - 256
    write_gpt2_files(folder, {**vocab, ENDOFTEXT: len(vocab)}, merges)
    return folder


@pytest.fixture(scope="module")
def saved(tmp_path_factory, play, gpt2_dir):
    """Each tokenizer kind saved with save_pretrained and reloaded with AutoTokenizer."""
    folders = {}
    for name, tok in {
        "byte": byte_tokenizer(),
        "bpe": train_bpe_tokenizer([play], vocab_size=400),
        "gpt2": gpt2_tokenizer(gpt2_dir),
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
def test_saved_tokenizer_round_trips_text(saved, kind, play):
    original, reloaded = saved[kind]
    for text in (TEXT, play[:5000], " leading space", "x  .  ,"):
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


def test_bpe_compresses_and_keeps_every_byte(play):
    tok = train_bpe_tokenizer([play], vocab_size=400)
    assert len(tok) == 400
    ids = tok(play, add_special_tokens=False)["input_ids"]
    assert len(ids) < 0.7 * len(play.encode())  # merges were learned
    assert tok.unk_token_id is None  # every byte is in the alphabet: nothing can be unknown


def test_gpt2_applies_the_merges_by_rank_with_the_gpt2_byte_alphabet(tmp_path):
    # a hand-made GPT-2-format vocabulary: the 256 byte characters, three merges, <|endoftext|> last (as 50256 is)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # the GPT-2 byte-to-unicode characters
    assert "\u0120" in alphabet  # GPT-2's "Ġ": the space byte
    vocab = {char: i for i, char in enumerate(alphabet)}
    vocab.update({"bc": 256, "ab": 257, "\u0120a": 258, ENDOFTEXT: 259})
    write_gpt2_files(tmp_path, vocab, [("b", "c"), ("a", "b"), ("\u0120", "a")])
    tok = gpt2_tokenizer(tmp_path)
    # worked out by hand from the BPE definition (lowest-ranked pair first, words split before a space):
    # "abc" -> a b c -> a bc (rank 0; then "a bc" has no merge); " abc" -> Ġ a b c -> Ġ a bc -> Ġa bc
    assert tok("abc abc")["input_ids"] == [vocab["a"], 256, 258, 256]
    assert tok("abab")["input_ids"] == [257, 257]
    assert tok(f"ab{ENDOFTEXT}")["input_ids"] == [257, 259]  # the special token is recognised in text
    assert tok.eos_token_id == tok.bos_token_id == tok.pad_token_id == 259 == len(tok) - 1


def test_load_tokenizer_specs(tmp_path, play, gpt2_dir):
    assert len(load_tokenizer("byte")) == 259
    assert len(load_tokenizer("bpe", texts=[play], vocab_size=300)) == 300
    assert len(load_tokenizer(f"gpt2:{gpt2_dir}")) == 501  # vocab.json's 500 tokens and <|endoftext|>
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
