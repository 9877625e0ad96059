"""benchmarks/benchmark_memory.py: the corpus (Bible books, Python files), the configurations, a `--quick` run on a corpus
written here, and longrange train --segments_alone (the no-memory baseline)."""

from __future__ import annotations

import json
import random

import pytest
from script_utils import load_command, load_script

WORDS = "the and of to in that shall he unto lord his they be is him not them it with all thou thy which".split()


def write_bible(path, books=("Genesis", "Exodus", "1 Samuel", "Song of Solomon", "Ruth", "Jude"), chapters=3):
    """A Bible-shaped file: '<Book> <chapter>' headings, indented numbered verses."""
    rng = random.Random(0)
    parts = ["The Holy Bible\n\n"]  # a preamble, which stays with the first book
    for book in books:
        for chapter in range(1, chapters + 1):
            parts.append(f"{book} {chapter}\n\n")
            for verse in range(1, 8):
                parts.append(f"  {verse} " + " ".join(rng.choice(WORDS) for _ in range(20)) + ".\n")
            parts.append("\n")
    path.write_text("".join(parts))
    return path


def write_python(folder, count=10):
    (folder / "pkg").mkdir(parents=True)
    (folder / "test").mkdir()
    for i in range(count):
        body = "".join(f"def f{j}(x):\n    return x * {j} + {i}\n\n" for j in range(60))
        (folder / ("pkg" if i % 2 else ".") / f"mod{i}.py").write_text(body)
    (folder / "test" / "test_big.py").write_text("x = 1\n" * 500)  # test folders are skipped
    (folder / "tiny.py").write_text("x = 1\n")  # below the smallest size taken
    return folder


def test_bible_is_cut_into_books(tmp_path):
    bench = load_script("benchmark_memory")
    books = bench.kjv_books(write_bible(tmp_path / "kjv.txt"))
    assert [name for name, _ in books] == ["Genesis", "Exodus", "1 Samuel", "Song of Solomon", "Ruth", "Jude"]
    assert b"".join(text for _, text in books) == (tmp_path / "kjv.txt").read_bytes()  # nothing lost or repeated
    assert books[0][1].startswith(b"The Holy Bible\n\nGenesis 1\n") and b"Genesis 3\n" in books[0][1]
    assert books[2][1].startswith(b"1 Samuel 1\n") and b"Song of Solomon" not in books[2][1]
    (tmp_path / "one.txt").write_text("no headings here\n")
    with pytest.raises(SystemExit, match="book heading"):
        bench.kjv_books(tmp_path / "one.txt")


def test_python_files_sorted_evenly_spaced_and_interleaved(tmp_path):
    bench = load_script("benchmark_memory")
    folder = write_python(tmp_path / "py")
    every = bench.python_files(folder, 100, min_bytes=256)
    assert [name for name, _ in every] == sorted(name for name, _ in every) and len(every) == 10
    assert not any(name.startswith("test/") or name == "tiny.py" for name, _ in every)
    assert [name for name, _ in bench.python_files(folder, 4, min_bytes=256)] == [every[i][0] for i in (0, 2, 5, 7)]
    mixed = bench.interleave(
        {"a": [("a1", b"x" * 10), ("a2", b"x" * 10)], "b": [(f"b{i}", b"y" * 5) for i in range(4)]}
    )
    assert [name for _, name, _ in mixed] == ["a1", "b0", "b1", "a2", "b2", "b3"]


def test_configurations_and_evaluation_memories():
    bench = load_script("benchmark_memory")
    size = dict(bench.SIZES["full"])
    configs = bench.configurations(size, bench.ALL_CONFIGS)
    assert len(configs) == 10
    compressive, txl, none = configs["compressive"], configs["txl"], configs["none"]
    assert compressive["config"] == {"mem_len": 64, "c_mem_len": 16, "compression_rate": 4,
                                     "compression_function": "conv1d", "reconstruction_loss": "attention"}  # fmt: skip
    assert (txl["config"]["mem_len"], txl["config"]["c_mem_len"]) == (128, 0)  # Transformer-XL, mem_len doubled
    assert txl["config"]["reconstruction_loss"] == "none"
    assert (compressive["span"], txl["span"], none["span"]) == (128, 128, 0)
    assert none["segments_alone"] and none["config"] == compressive["config"]
    for name, info in configs.items():  # every configuration is one the model accepts
        from longrange import CompressiveConfig

        CompressiveConfig(**info["config"])
        if info["config"]["compression_function"] in ("max_pool", "mean_pool", "most_used"):
            assert info["config"]["reconstruction_loss"] == "none", name
    assert bench.eval_memory(compressive, 256) == (256, 64) and bench.eval_memory(compressive, 0) is None
    assert bench.eval_memory(txl, 256) == (256, 0) and bench.eval_memory(compressive, 16) == (16, 4)


def test_quick_run_writes_the_record_and_plot(tmp_path):
    bench = load_script("benchmark_memory")
    kjv = write_bible(tmp_path / "kjv.txt")
    python_dir = write_python(tmp_path / "py")
    out = tmp_path / "out"
    argv = ["--quick", "--kjv", str(kjv), "--python-dir", str(python_dir), "--output_dir", str(out),
            "--configs", "compressive", "txl", "none", "--seeds", "0", "1", "--validation", "0.25"]  # fmt: skip
    report = bench.main(argv)
    assert json.loads((out / "memory.json").read_text()) == json.loads(json.dumps(report))
    assert (out / "memory.png").stat().st_size > 10_000
    assert report["complete"] and report["seeds"] == [0, 1]
    assert report["command"] == "python benchmarks/benchmark_memory.py " + " ".join(argv)
    assert report["budget"]["tokens_per_run"] == 3 * 2 * 64
    assert {d["kind"] for d in report["evaluation"]["documents"]} == {"kjv", "python"}
    mem_lens = [str(m) for m in report["evaluation"]["mem_lens"]]
    for name in ("compressive", "txl", "none"):
        runs = report["runs"][name]
        assert sorted(runs) == ["0", "1"]
        for run in runs.values():
            assert list(run["eval_memory"]) == mem_lens
            assert 0 < run["bits_per_byte"] < 12 and set(run["by_corpus"]) == {"kjv", "python"}
        summary = report["summary"][name]["bits_per_byte"]
        assert summary["std"] is not None and summary["min"] <= summary["mean"] <= summary["max"]
    # a configuration's own figure is its point of the sweep at the trained memory (none: every segment alone)
    for name, m in (("compressive", "16"), ("none", "0")):
        for run in report["runs"][name].values():
            assert run["bits_per_byte"] == run["eval_memory"][m]["bits_per_byte"]
    assert report["runs"]["txl"]["0"]["eval_memory"]["32"]["c_mem_len"] == 0
    assert [(c["a"], c["b"]) for c in report["comparisons"]] == [("compressive", "txl"), ("compressive", "none"),
                                                                   ("txl", "none")]  # fmt: skip
    # the sweep goes through longrange evaluate's override: the same figure from a model loaded with it
    evaluate = load_command("evaluate")
    model = evaluate.load_model(str(out / "runs" / "compressive-seed1" / "model"), mem_len=32, c_mem_len=8).eval()
    docs = bench.interleave({"kjv": bench.kjv_books(kjv), "python": bench.python_files(python_dir, 8, 256)})
    rows, chosen, _, _ = bench.evaluation_rows(out / "corpus", docs, 0.25, 4, 128)
    assert chosen == report["evaluation"]["documents"]
    nll = evaluate.nll_with_cache(model, rows, 64).nll
    figure = bench.score(nll, 16, [d["kind"] for d in chosen])["bits_per_byte"]
    assert figure == pytest.approx(report["runs"]["compressive"]["1"]["eval_memory"]["32"]["bits_per_byte"])
    # the record redraws without training
    again = bench.main(["--plot-only", str(out / "memory.json"), "--plot", str(tmp_path / "again.png")])
    assert again["summary"] == report["summary"] and (tmp_path / "again.png").is_file()
    # --update reruns one configuration into the record and keeps the others as they were
    kept = {name: report["runs"][name] for name in ("compressive", "none")}
    updated = bench.main([*argv[:-9], "--configs", "txl", "--seeds", "0", "1", "--validation", "0.25", "--update"])
    assert {name: updated["runs"][name] for name in kept} == json.loads(json.dumps(kept))
    assert sorted(updated["runs"]["txl"]) == ["0", "1"] and updated["command"] == report["command"]
    assert [u["configs"] for u in updated["updates"]] == [["txl"]] and updated["updates"][0]["seconds"] > 0
    assert json.loads((out / "memory.json").read_text())["updates"] == json.loads(json.dumps(updated["updates"]))
    with pytest.raises(SystemExit, match="other seeds"):
        bench.main([*argv[:-9], "--configs", "txl", "--seeds", "0", "--validation", "0.25", "--update"])


@pytest.mark.slow
def test_quick_run_every_configuration(tmp_path):
    bench = load_script("benchmark_memory")
    argv = ["--quick", "--kjv", str(write_bible(tmp_path / "kjv.txt")), "--python-dir",
            str(write_python(tmp_path / "py")), "--output_dir", str(tmp_path / "out"), "--seeds", "0"]  # fmt: skip
    report = bench.main(argv)
    assert sorted(report["summary"]) == sorted(bench.ALL_CONFIGS)


def test_train_segments_alone_feeds_each_segment_without_memory(tmp_path, monkeypatch):
    from longrange import CompressiveForCausalLM

    train = load_command("train")
    seen = []
    forward = CompressiveForCausalLM.forward

    def spy(self, *args, **kwargs):
        if self.training:
            seen.append((tuple(kwargs["input_ids"].shape), kwargs.get("cache"), kwargs.get("use_cache")))
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(CompressiveForCausalLM, "forward", spy)
    data = write_bible(tmp_path / "kjv.txt")
    config = ["hidden_size=32", "num_hidden_layers=1", "num_attention_heads=2", "intermediate_size=64",
              "segment_length=16", "mem_len=16", "c_mem_len=4", "compression_rate=4"]  # fmt: skip
    common = ["--data", str(data), "--split", "0.8,0.2", "--window", "64", "--batch_size", "2", "--max_steps", "2",
              "--eval_every", "0", "--eval_tokens", "64", "--num_samples", "0", "--save_every", "0", "--log_every", "1"]  # fmt: skip
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    train.main([*common, "--output_dir", str(tmp_path / "alone"), "--segments_alone", "--config", *config])
    assert seen == [((8, 16), None, False)] * 2  # 2 rows x 4 segments: 8 rows of one segment, no memory
    seen.clear()
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    train.main([*common, "--output_dir", str(tmp_path / "streamed"), "--config", *config])
    assert [shape for shape, _, _ in seen] == [(2, 64)] * 2 and seen[1][1] is not None  # memory carried
    with pytest.raises(SystemExit, match="drop --carry_cache"):
        train.main([*common, "--output_dir", str(tmp_path / "x"), "--segments_alone", "--carry_cache"])
