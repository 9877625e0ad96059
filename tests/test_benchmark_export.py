"""benchmarks/benchmark_export.py keeps running and reporting (no timing assertions: figures are noisy)."""

from __future__ import annotations

import json

import pytest
from client_utils import require_client
from script_utils import load_script


@pytest.mark.slow  # an export and an ONNX translation of each model: about 30 s on 2 cores
def test_every_mode_of_every_model_is_timed_and_written(tmp_path):
    require_client("onnxscript")
    require_client("onnxruntime")
    out = tmp_path / "export.json"
    result = load_script("benchmark_export").main(["--quick", "--json", str(out)])
    assert json.loads(out.read_text()) == json.loads(json.dumps(result))
    assert set(result["rows"]) == {"compressive", "sinkhorn", "llama"} and result["context"] == 64
    for row in result["rows"].values():
        assert all(row[f"{mode}_ms"] > 0 for mode in ("eager", "exported", "onnxruntime"))
        assert row["export_s"] > 0 and row["state_mb"] > 0
