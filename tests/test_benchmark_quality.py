"""scripts/benchmark_quality.py's summary over seeds (training itself runs in CI's `--quick` benchmark)."""

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
