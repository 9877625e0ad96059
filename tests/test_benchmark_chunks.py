"""benchmarks/benchmark_chunks.py runs and reports on the CPU (no timing assertions: figures are noisy)."""

from __future__ import annotations

import json

from script_utils import load_script


def test_quick_run_writes_every_cell_with_equal_logits_on_both_paths(tmp_path):
    bench = load_script("benchmark_chunks")
    out = tmp_path / "chunks.json"
    record = bench.main(["--quick", "--repeats", "1", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(record))
    rows = record["rows"]
    assert [(r["context"], r["new"]) for r in rows] == [(c, n) for c in (64, 256) for n in (2, 16, 64)]
    ratio = record["settings"]["chunk_ratio"]
    for row in rows:
        assert min(row["chunk_s"], row["steps_s"], row["auto_s"], row["llama_s"]) > 0
        assert row["max_diff"] < 1e-4  # one chunk and one token at a time give the same logits
        assert row["auto_path"] == ("chunk" if ratio * row["new"] >= row["context"] + row["new"] else "steps")
    assert len(bench.table(rows).splitlines()) == 2 + len(rows)
