"""benchmarks/benchmark_scaling.py runs every row, records failures, finds crossovers and draws its plot (no timing
assertions: figures are noisy here)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_utils import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "benchmark_scaling.py"
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture
def bench():
    return load_script("benchmark_scaling")


@pytest.fixture
def in_process_rows(bench, monkeypatch):
    """Rows run in this process instead of a fresh interpreter each (16 interpreter starts, each importing torch and
    transformers, take minutes on a loaded 2-core machine); the subprocess itself is tested below."""
    threads = torch.get_num_threads()
    monkeypatch.setattr(bench, "run_row", lambda spec, timeout: bench.worker(json.loads(json.dumps(spec))))
    yield
    torch.set_num_threads(threads)


def check_quick_payload(bench, payload: dict, plot: Path) -> None:
    rows = payload["rows"]
    expected = {f"train/{m}/{n}" for m in bench.TRAIN_MODELS for n in (64, 128)}
    expected |= {f"decode/{m}/{n}" for m in bench.DECODE_MODELS for n in (64, 128)}
    assert set(rows) == expected
    for row_id, r in rows.items():
        if row_id.startswith("train/reference/") and not bench.reference_available():
            assert r["status"] == "skipped" and r["skipped"] == bench.REFERENCE_MISSING
            continue
        assert r["status"] == "ok", (row_id, r.get("error"))
        assert r["time_per_token_s"] > 0 and r["parameters"] > 0
        if row_id.startswith("train/"):
            assert len(r["step_s"]) == 1 and r["peak_memory_mib"] is not None
        else:
            assert r["new_tokens"] == 4 and len(r["per_token_s"]) == 3 and r["compiled"] is False
    assert payload["complete"] and payload["torch"] == torch.__version__ and payload["transformers"]
    assert payload["command"] and payload["date"] and payload["machine"]["device_type"] == "cpu"
    assert payload["seeds"] == {"model": 0, "data": 1} and payload["sizes"]["width"]["hidden"] == 64
    found = payload["crossovers"]
    assert set(found) == {f"{m}/{o}" for m in ("train_time", "train_memory") for o in ("sinkhorn", "sortcut",
                          "compressive")} | {"decode_time/sinkhorn", "decode_time/compressive"}  # fmt: skip
    for c in found.values():
        assert c["compared_lengths"] == [64, 128]
        assert c["text"] == "none in range" or c["text"].startswith(f"from {c['crossover']} tokens")
    assert plot.read_bytes().startswith(PNG)


def test_quick_run_records_every_row_the_crossovers_and_the_plot(bench, in_process_rows, tmp_path, capsys):
    out, plot = tmp_path / "scaling.json", tmp_path / "scaling.png"
    payload = bench.main(["--quick", "--device", "cpu", "--json", str(out), "--plot", str(plot)])
    written = json.loads(out.read_text())
    check_quick_payload(bench, written, plot)
    assert written["rows"].keys() == payload["rows"].keys()
    printed = capsys.readouterr().out
    assert "| length | llama | sinkhorn | sinkhorn / llama |" in printed and "Crossover" in printed
    # redrawn from the JSON alone
    again = tmp_path / "again.png"
    bench.main(["--plot-only", str(out), "--plot", str(again)])
    assert again.read_bytes().startswith(PNG)


def test_reference_row_is_skipped_without_the_package(bench, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "reference_available", lambda: False)
    monkeypatch.setattr(bench, "run_row", lambda spec, timeout: pytest.fail(f"ran {spec['row']}"))
    out = tmp_path / "scaling.json"
    bench.main(["--quick", "--device", "cpu", "--rows", "train/reference/", "--json", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {"train/reference/64", "train/reference/128"}
    assert all(r["status"] == "skipped" and r["skipped"] == bench.REFERENCE_MISSING for r in rows.values())


def test_a_row_out_of_time_is_recorded_and_its_longer_rows_skipped(bench, tmp_path):
    # a real worker subprocess, killed after 1 s (importing torch and transformers, then 16,384 tokens)
    out = tmp_path / "scaling.json"
    bench.main(["--quick", "--device", "cpu", "--rows", "train/llama/", "--lengths", "16384", "32768",
                "--row-timeout", "1", "--json", str(out)])  # fmt: skip
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    first = rows["train/llama/16384"]
    assert first["status"] == "timeout" and first["error"] == "timeout after 1 s"
    longer = rows["train/llama/32768"]
    assert longer == {"row": longer["row"], "status": "skipped", "implied": "timeout",
                      "skipped": "skipped: timeout at 16,384 tokens"}  # fmt: skip
    assert payload["crossovers"]["train_time/sinkhorn"]["text"] == "not measured"


def test_budget_skips_the_rows_not_started(bench, monkeypatch, tmp_path):
    monkeypatch.setattr(bench, "run_row", lambda spec, timeout: pytest.fail(f"ran {spec['row']}"))
    out, plot = tmp_path / "scaling.json", tmp_path / "scaling.png"
    bench.main(["--quick", "--device", "cpu", "--budget", "0", "--json", str(out), "--plot", str(plot)])
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 16
    assert {r["skipped"] for r in rows.values()} == {"skipped: time budget of 0 s spent"}
    assert plot.read_bytes().startswith(PNG)  # empty panels


def synthetic(bench, values: dict[str, dict[int, object]], kind="train", field="time_per_token_s") -> dict:
    rows = {}
    for model, by_length in values.items():
        for n, value in by_length.items():
            row = bench.Row(kind, model, n)
            entry = {"row": row.__dict__}
            if isinstance(value, str):
                entry.update(status=value, error=value)
            else:
                entry.update(status="ok", **{field: value})
            rows[row.id] = entry
    return rows


def test_crossover_is_the_shortest_length_from_which_ours_stays_cheaper(bench):
    rows = synthetic(
        bench,
        {
            "llama": {512: 1.0, 1024: 2.0, 2048: 4.0, 4096: "timeout", 8192: "oom"},
            "sinkhorn": {512: 0.5, 1024: 2.0, 2048: 2.0, 4096: 2.0, 8192: "oom"},  # both out of memory: left out
            "sortcut": {512: 0.5, 1024: 3.0, 2048: 5.0, 4096: "killed", 8192: 1.0},
            "compressive": {512: 0.5, 1024: 1.0, 2048: 2.0, 4096: 3.0},  # cheaper everywhere
        },
    )
    found = bench.crossovers(rows)
    sinkhorn = found["train_time/sinkhorn"]
    assert sinkhorn["crossover"] == 2048 and sinkhorn["text"] == "from 2,048 tokens"
    assert sinkhorn["compared_lengths"] == [512, 1024, 2048, 4096] and sinkhorn["cheaper_at"] == [512, 2048, 4096]
    assert found["train_time/sortcut"]["crossover"] == 8192  # out of time at 4096 (both), measured at 8192
    assert found["train_time/sortcut"]["cheaper_at"] == [512, 8192]
    compressive = found["train_time/compressive"]
    assert compressive["crossover"] == 512 and "every length measured" in compressive["text"]
    assert found["train_memory/sinkhorn"]["text"] == "not measured"
    rows = synthetic(bench, {"llama": {512: 1.0, 1024: 2.0}, "sinkhorn": {512: 0.5, 1024: 3.0}}, kind="decode")
    assert bench.crossovers(rows)["decode_time/sinkhorn"]["text"] == "none in range"
    assert bench.cost(rows, "decode", "llama", 2048, "time_per_token_s") is None
    assert (
        bench.cost({"decode/llama/1": {"status": "skipped", "implied": "oom"}}, "decode", "llama", 1, "x") == math.inf
    )


def test_plot_only_redraws_with_failed_rows(bench, tmp_path, capsys):
    rows = synthetic(bench, {"llama": {512: 1e-4, 1024: "oom"}, "sinkhorn": {512: 2e-4, 1024: 3e-4}})
    payload = {
        "rows": rows,
        "machine": {"device": "test cpu"},
        "settings": {"precision": "fp32"},
        "sizes": {
            "width": {"hidden": 8, "layers": 1, "heads": 1},
            "batch": 1,
            "sinkhorn": {"bucket": 4},
            "compressive": {"segment": 4, "mem": 4, "c_mem": 2},
        },  # fmt: skip
    }
    source, plot = tmp_path / "scaling.json", tmp_path / "plot.png"
    source.write_text(json.dumps(payload))
    redrawn = bench.main(["--plot-only", str(source), "--plot", str(plot)])
    assert plot.read_bytes().startswith(PNG)
    assert redrawn["crossovers"]["train_time/sinkhorn"]["crossover"] == 1024
    printed = capsys.readouterr().out
    assert "| 1,024 | oom | 300 |  |" in printed and "training time per token, sinkhorn: from 1,024 tokens" in printed


@pytest.mark.slow  # the whole --quick run, one fresh interpreter per row: minutes on a loaded 2-core machine
def test_quick_mode_runs_every_row_in_subprocesses(bench, tmp_path):
    out, plot = tmp_path / "scaling.json", tmp_path / "scaling.png"
    # the repository first, then what the session has on PYTHONPATH (the read guard of tests/conftest.py)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    command = [sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--json", str(out), "--plot", str(plot)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    check_quick_payload(bench, json.loads(out.read_text()), plot)
