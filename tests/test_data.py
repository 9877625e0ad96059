"""Data pipeline: corpora, deterministic splits, token streams and the batch layout used by training."""

from __future__ import annotations

import os
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch

from longrange.data import (
    RandomWindowBatcher,
    StreamBatcher,
    check_window,
    eval_windows,
    load_corpus,
    stdlib_source_files,
    tokenize_corpus,
    windows_dataset,
)
from longrange.tokenization import byte_tokenizer, train_bpe_tokenizer

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


# ---- corpora and splits ------------------------------------------------------------------------------------------


def test_single_file_is_split_by_position_90_5_5(play_file):
    raw = play_file.read_bytes()
    corpus = load_corpus(play_file, as_bytes=True)
    assert corpus.split_by == "position"
    n = len(raw)
    a, b = int(n * 0.9), int(n * 0.95)
    assert corpus.splits["train"] == [raw[:a]]
    assert corpus.splits["validation"] == [raw[a:b]]
    assert corpus.splits["test"] == [raw[b:]]


def test_tiny_shakespeare_convention_90_10_through_the_text_builder(play_file):
    text = play_file.read_text(encoding="utf-8")
    assert len(text) < len(text.encode("utf-8"))  # some characters take several bytes: the cut is by character
    corpus = load_corpus(str(play_file), split=(0.9, 0.1))
    cut = int(len(text) * 0.9)
    assert corpus.splits["train"] == [text[:cut]]
    assert corpus.splits["validation"] == [text[cut:]]
    assert corpus.splits["test"] == []


def test_folder_is_split_by_document_deterministically(tmp_path):
    docs = {f"doc{i:02d}.txt": (f"document {i} " * (10 + i)) for i in range(40)}
    for name, text in docs.items():
        (tmp_path / name).write_text(text)
    (tmp_path / ".hidden").write_text("never read")
    first = load_corpus(tmp_path, as_bytes=True)
    second = load_corpus(tmp_path, as_bytes=True)
    assert first.split_by == "document"
    assert first.splits == second.splits
    # every document lands in exactly one split, whole, and the sorted order is kept inside each split
    everything = first.splits["train"] + first.splits["validation"] + first.splits["test"]
    assert sorted(everything) == sorted(t.encode() for t in docs.values())
    for split in first.splits.values():
        positions = [list(docs.values()).index(d.decode()) for d in split]
        assert positions == sorted(positions)
    sizes = {s: sum(map(len, v)) for s, v in first.splits.items()}
    total = sum(sizes.values())
    assert abs(sizes["train"] / total - 0.9) < 0.05 and sizes["validation"] and sizes["test"]


def test_default_corpus_is_the_standard_library_sources():
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_source_files(max_bytes=300_000)
    rel = [f.relative_to(root).as_posix() for f in files]
    assert rel == sorted(rel)
    assert all(f.suffix == ".py" for f in files)
    assert not any(part in ("site-packages", "test", "tests") for r in rel for part in r.split("/")[:-1])
    assert sum(f.stat().st_size for f in files) <= 300_000
    corpus = load_corpus("stdlib", as_bytes=True, max_bytes=300_000)
    assert corpus.split_by == "document" and corpus.name == "python-stdlib"
    assert sorted(corpus.splits["train"] + corpus.splits["validation"] + corpus.splits["test"]) == sorted(
        f.read_bytes() for f in files
    )


def hub_offline(monkeypatch) -> None:
    """The Hub unreachable at once, as offline mode makes it (datasets and huggingface_hub read the variables at
    import, which an earlier test module may have done): without it, asking for a Hub name on a machine without a
    connection to the Hub retries for about 20 s before failing."""
    import datasets  # (a dependency of the package: imported here, where the test needs it)
    import huggingface_hub.constants

    for name in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE"):
        monkeypatch.setenv(name, "1")
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)


def test_bad_paths_empty_files_and_offline_hub_names_raise_clear_errors(tmp_path, play_file, monkeypatch):
    with pytest.raises(FileNotFoundError, match="no such file or folder"):
        load_corpus(tmp_path / "missing.txt")
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path / "empty.txt", as_bytes=True)
    with pytest.raises(ValueError, match="empty"):
        load_corpus(tmp_path / "empty.txt")
    empty_dir = tmp_path / "nothing"
    empty_dir.mkdir()
    with pytest.raises(FileNotFoundError, match="contains no files"):
        load_corpus(empty_dir)
    hub_offline(monkeypatch)
    with pytest.raises(
        FileNotFoundError, match="neither a local file or folder nor a loadable Hub dataset .*cannot be"
    ):
        load_corpus("some-user/some-dataset-that-is-not-here")
    with pytest.raises(ValueError, match="split"):
        load_corpus(play_file, split=(0.5, 0.2))
    tiny = tmp_path / "tiny.txt"
    tiny.write_bytes(b"abc")
    with pytest.raises(ValueError, match="validation split .* is empty"):
        load_corpus(tiny, as_bytes=True)


def test_non_utf8_bytes_are_kept_exactly_by_the_byte_path_and_refused_by_the_text_path(tmp_path):
    raw = bytes(range(256)) * 40 + b"\xff\xfe\x80 caf\xc3\xa9 \xe9t\xe9 </s> end"
    path = tmp_path / "latin1.bin"
    path.write_bytes(raw)
    corpus = load_corpus(path, as_bytes=True)
    assert b"".join(corpus.splits["train"] + corpus.splits["validation"] + corpus.splits["test"]) == raw
    streams = tokenize_corpus(corpus, byte_tokenizer())
    joined = np.concatenate([streams.ids[s] for s in ("train", "validation", "test")])
    assert joined.tolist() == list(raw)  # byte b -> id b, a literal "</s>" stays text
    assert streams.bytes_per_token("train") == 1.0
    with pytest.raises(ValueError, match="byte tokenizer"):
        load_corpus(path)


def test_bpe_streams_decode_back_to_the_documents_joined_by_eos(tmp_path):
    for i in range(6):
        (tmp_path / f"f{i}.txt").write_text(f"def function_{i}(x):\n    return x * {i}\n" * 30)
    corpus = load_corpus(tmp_path, split=(0.5, 0.25, 0.25))
    tokenizer = train_bpe_tokenizer(corpus.splits["train"], vocab_size=300)
    streams = tokenize_corpus(corpus, tokenizer)
    for split in ("train", "validation", "test"):
        ids = streams.ids[split].tolist()
        pieces, current = [], []
        for token in ids + [tokenizer.eos_token_id]:
            if token == tokenizer.eos_token_id:
                pieces.append(tokenizer.decode(current))
                current = []
            else:
                current.append(token)
        assert pieces == corpus.splits[split]


# ---- windows and batch layout ------------------------------------------------------------------------------------


def test_window_must_be_a_multiple_of_the_segment_or_bucket():
    from longrange.configuration_compressive import CompressiveConfig
    from longrange.configuration_sinkhorn import SinkhornConfig

    compressive = CompressiveConfig(segment_length=16, mem_len=16, c_mem_len=8, compression_rate=2)
    assert check_window(32, compressive) == 32
    with pytest.raises(ValueError, match="shorter than one segment_length"):
        check_window(8, compressive)
    with pytest.raises(ValueError, match="multiple of the model's segment_length 16"):
        check_window(24, compressive)
    sinkhorn = SinkhornConfig(bucket_size=8, max_position_embeddings=64, causal=True)
    assert check_window(64, sinkhorn) == 64
    with pytest.raises(ValueError, match="shorter than one bucket_size"):
        check_window(4, sinkhorn)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        check_window(128, sinkhorn)


def test_streaming_rows_continue_exactly_where_the_previous_step_stopped(play_file):
    raw = play_file.read_bytes()[:60_000]
    ids = np.frombuffer(raw, dtype=np.uint8).astype(np.int64)
    window, batch = 64, 4
    batcher = StreamBatcher(ids, window, batch)
    lane = len(ids) // batch
    steps = 5
    rows = [batcher.batch(t) for t in range(steps)]
    for b in range(batch):
        text = b"".join(bytes(r[b].tolist()) for r in rows)
        # row b over consecutive steps is one contiguous piece of the file: lane b from its start
        assert text == raw[b * lane : b * lane + steps * window]
    assert batcher.steps_per_epoch == lane // window
    assert batcher.starts_epoch(batcher.steps_per_epoch) and not batcher.starts_epoch(1)
    assert torch.equal(batcher.batch(batcher.steps_per_epoch), rows[0])  # the next epoch starts the lanes over


@pytest.mark.parametrize("streaming", [True, False])
def test_processes_and_accumulation_split_one_global_batch(streaming):
    ids = np.arange(20_000) % 997
    make = StreamBatcher if streaming else RandomWindowBatcher
    single = make(ids, 32, 8)
    two_ranks = make(ids, 32, 8, world_size=2)
    accumulate = make(ids, 32, 8, accumulation=2)
    four = make(ids, 32, 8, world_size=2, accumulation=2)
    for step in (0, 3, 17):
        whole = single.batch(step)
        assert torch.equal(torch.cat([two_ranks.batch(step, rank=r) for r in range(2)]), whole)
        assert torch.equal(torch.cat([accumulate.batch(step, micro=m) for m in range(2)]), whole)
        assert torch.equal(two_ranks.batch(step, rank=1), accumulate.batch(step, micro=1))
        assert torch.equal(torch.cat([four.batch(step, r, m) for r in range(2) for m in range(2)]), whole)
    with pytest.raises(ValueError, match="divisible"):
        make(ids, 32, 6, world_size=4)


def test_random_windows_cover_each_window_once_per_epoch_and_depend_only_on_seed_and_step():
    ids = np.arange(64 * 40)
    batcher = RandomWindowBatcher(ids, 64, 8, seed=3)
    epoch = torch.cat([batcher.batch(t) for t in range(batcher.steps_per_epoch)])
    starts = sorted(int(row[0]) for row in epoch)
    assert starts == [64 * i for i in range(40)]  # aligned, non-overlapping, each exactly once
    assert all(torch.equal(row, torch.arange(int(row[0]), int(row[0]) + 64)) for row in epoch)
    assert torch.equal(RandomWindowBatcher(ids, 64, 8, seed=3).batch(7), batcher.batch(7))
    assert not torch.equal(RandomWindowBatcher(ids, 64, 8, seed=4).batch(0), batcher.batch(0))
    assert not torch.equal(batcher.batch(batcher.steps_per_epoch), batcher.batch(0))  # reshuffled next epoch
    with pytest.raises(ValueError, match="fewer than one global batch"):
        RandomWindowBatcher(ids[:300], 64, 8)


def test_eval_windows_walk_each_lane_left_to_right():
    ids = np.arange(1000)
    batches = eval_windows(ids, 50, 3)
    lane = 1000 // 3
    assert len(batches) == lane // 50
    for b in range(3):
        assert torch.cat([x[b] for x in batches]).tolist() == list(range(b * lane, b * lane + len(batches) * 50))
    with pytest.raises(ValueError, match="fewer than one window"):
        eval_windows(ids[:10], 50, 3)


def test_windows_dataset_holds_non_overlapping_windows():
    ds = windows_dataset(np.arange(130), 32)
    assert len(ds) == 4
    assert ds[1]["input_ids"] == list(range(32, 64)) == ds[1]["labels"]
