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


def test_text_padding_counts_each_layout_s_positions(tmp_path, monkeypatch):
    """Passages of 100, 10 and 20 bytes fill the first batch of 2 x 128 bytes (the next, cut to 128, starts a second
    one, left unfilled and not counted). Buckets of 8: one group pads all three to 104 (312 positions for 130
    tokens); at 128 tokens a call the cheapest split is {100}, {10, 20}: 104 + 2 x 24. Segments of 16: 3 x 112
    against 112 + 2 x 32."""
    bench = load_script("benchmark_packing")
    monkeypatch.setattr(bench.packing, "GROUP_COST", 128)
    text = tmp_path / "text.txt"
    text.write_bytes(b"\n\n".join([b"a" * 100, b"b" * 10, b"c" * 20, b"d" * 200, b"e" * 5]))
    record = bench.text_padding(text, dict(bench.QUICK, unit=8))
    assert (record["passages"], record["batches"]) == (5, 1)
    assert record["sinkhorn_one_group"] == 312 / 130 and record["sinkhorn_grouped"] == 152 / 130
    assert record["compressive_one_group"] == 336 / 130 and record["compressive_grouped"] == 176 / 130
