"""benchmarks/benchmark_quality.py's summary over seeds (training itself runs in CI's `--quick` benchmark)."""

from __future__ import annotations

import json
import math

import pytest
from script_utils import load_script


def run(data: str, seed: int, ours: float, reference: float | None, config=()) -> dict:
    row = {"family": "sinkhorn", "reference_package": "sinkhorn-transformer 0.11.4", "ours": {"bpc": ours},
           "reference": None if reference is None else {"bpc": reference}}  # fmt: skip
    return {"data": data, "seed": seed, "config": list(config), "size": {"steps": 1200}, "rows": [row]}


def test_mean_and_spread_per_corpus_side_and_config(tmp_path, capsys):
    bench = load_script("benchmark_quality")
    runs = [
        run("tinyshakespeare.txt", 0, 2.5, 2.6),
        run("tinyshakespeare.txt", 1, 2.7, None),  # one side per process: the other side's file has the rest
        run("tinyshakespeare.txt", 1, 2.7, None, config=["x=1"]),
        run("enwik8_small.xml", 0, 1.9, 2.0),
    ]
    paths = []
    for i, result in enumerate(runs):
        paths.append(tmp_path / f"{i}.json")
        paths[-1].write_text(json.dumps(result))
    reference_s1 = tmp_path / "ref1.json"
    reference_s1.write_text(
        json.dumps(
            run("tinyshakespeare.txt", 1, 0.0, 2.8)
            | {
                "rows": [
                    {
                        "family": "sinkhorn",
                        "reference_package": "sinkhorn-transformer 0.11.4",
                        "ours": None,
                        "reference": {"bpc": 2.8},
                    }
                ]
            }
        )
    )  # fmt: skip  (a reference-only run of seed 1)
    out = tmp_path / "summary.json"
    summary = bench.main(["--summarize", *map(str, [*paths, reference_s1]), "--json", str(out)])
    assert json.loads(out.read_text()) == summary
    by_key = {(s["data"], s["implementation"], s["config"]): s for s in summary}
    ours = by_key[("tinyshakespeare.txt", "longrange", "")]
    assert ours["bpc_by_seed"] == {"0": 2.5, "1": 2.7}
    assert math.isclose(ours["bpc_mean"], 2.6) and math.isclose(ours["bpc_std"], math.sqrt(0.02))
    assert (ours["bpc_min"], ours["bpc_max"]) == (2.5, 2.7)
    reference = by_key[("tinyshakespeare.txt", "sinkhorn-transformer 0.11.4", "")]
    assert reference["bpc_by_seed"] == {"0": 2.6, "1": 2.8}
    assert by_key[("tinyshakespeare.txt", "longrange", "x=1")]["bpc_by_seed"] == {"1": 2.7}
    single = by_key[("enwik8_small.xml", "longrange", "")]
    assert single["bpc_mean"] == 1.9 and single["bpc_std"] is None
    printed = capsys.readouterr().out
    assert "| tinyshakespeare.txt | sinkhorn | longrange | 1200 | 0, 1 | 2.6000 | 2.5000 - 2.7000 |" in printed
    # the same seed of the same run twice with different figures: refused
    paths[1].write_text(json.dumps(run("tinyshakespeare.txt", 0, 2.9, None)))
    with pytest.raises(SystemExit, match="seed 0 differ"):
        bench.main(["--summarize", *map(str, paths)])


def test_parity_plot_draws_the_recorded_curves_per_corpus(tmp_path):
    plot_parity = load_script("plot_parity")

    def recorded(name, side, seed, data=None, bpc=None, curve=True):
        run = {"run": name, "side": side, "seed": seed,
               "implementation": "longrange" if side == "ours" else "sinkhorn-transformer 0.11.4"}  # fmt: skip
        if data:
            run["data"] = data
        if bpc is not None:
            run["validation_bits_per_char"] = bpc
        if curve:
            run[plot_parity.CURVE] = {"200": 2.0 + seed, "100": 2.5 + seed}  # (keys out of order, as strings)
        return run

    record = {"runs": [
        recorded("j_ref_s1", "reference", 1, "tinyshakespeare.txt", 2.61),
        recorded("j_ours_s0", "ours", 0, "tinyshakespeare.txt", 2.566),
        recorded("h_reference", "reference", 0, bpc=2.634),  # no corpus recorded: Tiny Shakespeare
        recorded("k_en_ours_s1", "ours", 1, "enwik8_small.xml"),
        recorded("i_stopped", "ours", 0, "tinyshakespeare.txt", 2.9),  # not among --runs
        recorded("j_no_curve", "ours", 2, "tinyshakespeare.txt", 2.5, curve=False),
    ]}  # fmt: skip
    path, out = tmp_path / "record.json", tmp_path / "images" / "parity.png"
    path.write_text(json.dumps(record))
    by_corpus = plot_parity.main(["--record", str(path), "--runs", "j_", "k_", "h_reference", "--out", str(out)])
    assert list(by_corpus) == ["enwik8_small.xml", "tinyshakespeare.txt"]
    shakespeare = by_corpus["tinyshakespeare.txt"]
    assert [(r["side"], r["seed"]) for r in shakespeare] == [("ours", 0), ("reference", 0), ("reference", 1)]
    assert shakespeare[0] == {"label": "longrange, seed 0: 2.566 bits/char", "side": "ours", "seed": 0,
                              "steps": [100, 200], "losses": [2.5, 2.0]}  # fmt: skip
    assert by_corpus["enwik8_small.xml"][0]["label"] == "longrange, seed 1"  # no validation figure recorded
    assert out.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(SystemExit, match="no run to draw"):
        plot_parity.main(["--record", str(path), "--runs", "z_", "--out", str(out)])


@pytest.mark.parametrize("family", ["sinkhorn", "compressive"])
def test_both_sides_report_the_same_units_on_text_with_multibyte_characters(tmp_path, family):
    """The byte tokenizer's tokens are bytes: bits per character must divide by characters on both sides (the
    reference side used to report bits per byte as bits per character)."""
    pytest.importorskip("sinkhorn_transformer" if family == "sinkhorn" else "compressive_transformer_pytorch")
    from conftest import generate_play

    text = generate_play(60_000, seed=3).replace("e", "é")  # about a tenth of the characters take two bytes
    bytes_per_char = len(text.encode("utf-8")) / len(text)
    assert bytes_per_char > 1.05
    corpus = tmp_path / "accents.txt"
    corpus.write_text(text, encoding="utf-8")
    out = tmp_path / "quality.json"
    load_script("benchmark_quality").main(["--quick", "--models", family, "--data", str(corpus), "--json", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    for side in ("ours", "reference"):
        ratio = row[side]["bpc"] / row[side]["bits_per_byte"]  # = bytes per character of the validation split
        assert math.isclose(ratio, bytes_per_char, rel_tol=0.02), (side, ratio, bytes_per_char)
