"""benchmarks/count_kernels.py: the kernels of a compiled training step, from inductor's Triton code generation
without a GPU. Runs only where the `triton` package is installed (it is not a dependency)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "count_kernels.py"


@pytest.mark.slow
def test_counts_forward_and_backward_launches_of_both_models(tmp_path):
    spec = importlib.util.spec_from_file_location("count_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    rows = module.main(
        ["--quick", "--length", "64", "--models", "sinkhorn", "llama", "--json", str(tmp_path / "k.json")]
    )
    by_model = {row["model"]: row for row in rows}
    for row in rows:
        assert row["graphs"] == 2  # forward and backward
        assert row["extern"].get("mm", 0) > 0 and sum(row["triton"].values()) > 0
    # a causal Sinkhorn layer routes, gathers and masks buckets around its products: more launches than Llama's
    assert by_model["sinkhorn"]["launches"] > by_model["llama"]["launches"]
