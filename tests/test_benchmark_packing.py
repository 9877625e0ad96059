"""benchmarks/benchmark_packing.py runs and reports on the CPU (no timing assertions: figures are noisy)."""

from __future__ import annotations

import json

from script_utils import load_script


def test_quick_run_writes_both_models_with_equal_logits_in_both_layouts(tmp_path):
    bench = load_script("benchmark_packing")
    out = tmp_path / "packing.json"
    record = bench.main(["--quick", "--repeats", "1", "--group_cost", "0", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    rows = record["rows"]
    assert [r["model"] for r in rows] == ["sinkhorn", "compressive"]
    for row in rows:
        assert min(row["grouped_s"], row["one_group_s"], row["llama_s"]) > 0
        assert row["max_diff"] < 1e-4  # the groups give the logits of one group
        assert row["groups"] > 1 and 1 <= row["padded_grouped"] < row["padded_one_group"]
        assert row["tokens"] <= 2 * 128 and row["documents"] > row["groups"]
    assert record["settings"]["group_cost"] == 0 and bench.packing.GROUP_COST > 0  # (restored after the run)
    assert len(bench.table(rows).splitlines()) == 2 + len(rows)
