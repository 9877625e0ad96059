"""benchmarks/benchmark_gpu.py keeps running and reporting on the CPU (no timing assertions: figures are noisy here)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_utils import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "benchmark_gpu.py"


def _load():
    return load_script("benchmark_gpu")


def test_a_failing_row_is_recorded_and_the_run_goes_on(tmp_path, monkeypatch, capsys):
    bench = _load()
    real_build = bench.build_step

    def build_step(row, *args, **kwargs):
        if row.precision == "tf32":
            raise RuntimeError("scatter(): Expected self.dtype to be equal to src.dtype\nsecond line")
        return real_build(row, *args, **kwargs)

    monkeypatch.setattr(bench, "build_step", build_step)
    out = tmp_path / "gpu.json"
    torch_threads = torch.get_num_threads()
    try:
        payload = bench.main(
            ["--quick", "--device", "cpu", "--no-compiled", "--rows", "llama/.*/2x64", "--out", str(out)]
        )
    finally:
        torch.set_num_threads(torch_threads)
    written = json.loads(out.read_text())
    assert written["complete"] and written["device_type"] == "cpu" and written["torch"] == torch.__version__
    rows = written["rows"]
    assert set(rows) == {"llama/llama/bf16/eager/2x64", "llama/llama/tf32/eager/2x64"}
    failed = rows["llama/llama/tf32/eager/2x64"]
    assert failed["error"] == "error: RuntimeError: scatter(): Expected self.dtype to be equal to src.dtype"
    assert "tokens_per_s" not in failed
    measured = rows["llama/llama/bf16/eager/2x64"]
    assert "error" not in measured and measured["tokens_per_s"] > 0 and len(measured["step_s"]) == 2
    assert measured["aten_ops_per_step"] > 0 and measured["parameters"] > 0
    # where the step's time went: the costliest operators (kernels on CUDA), their shares of it adding up to <= 1
    top = measured["top_work"]
    assert 0 < len(top) <= 15 and all(t["name"].startswith("aten::") and t["calls"] >= 1 for t in top)
    assert [t["us"] for t in top] == sorted((t["us"] for t in top), reverse=True) and sum(
        t["share"] for t in top
    ) <= 1.001
    assert 0 < measured["busy_s"] <= measured["median_step_s"] * 10
    assert payload["rows"].keys() == rows.keys()
    printed = capsys.readouterr().out
    assert "| llama/llama/tf32/eager/2x64 |" in printed and "error: RuntimeError" in printed


def test_ratios_pair_rows_of_the_same_precision_mode_and_shape():
    bench = _load()

    def entry(family, side, precision, mode, rate, memory=None):
        row = bench.Row(family, side, precision, mode, 8, 2048)
        return row.id, {"row": row.__dict__, "tokens_per_s": rate, "peak_memory_gib": memory}

    results = dict(
        [
            entry("sinkhorn", "ours", "tf32", "eager", 300.0, 2.0),
            entry("sinkhorn", "reference", "tf32", "eager", 200.0, 4.0),
            entry("sinkhorn", "ours", "tf32", "compiled", 600.0),
            entry("llama", "llama", "tf32", "eager", 400.0),
            entry("llama", "llama", "tf32", "compiled", 1200.0),
            entry("sinkhorn", "ours", "bf16", "eager", 500.0),
        ]
    )
    compared = bench.ratios(results)
    eager = compared["sinkhorn/ours/tf32/eager/8x2048"]
    assert eager["speed_vs_reference"] == {
        "eager": 1.5,
        "compiled": None,
        "regional": None,
        "graphs": None,
        "best": 3.0,
    }  # 600 / 200
    assert eager["speed_vs_llama"] == {
        "eager": 0.75,
        "compiled": 0.5,
        "regional": None,
        "graphs": None,
        "best": 0.5,
    }  # 600 / 1200
    assert eager["memory_vs_reference"] == 0.5
    assert compared["sinkhorn/ours/bf16/eager/8x2048"]["speed_vs_llama"]["best"] is None  # no bf16 Llama row

    # the Compressive model trained one segment at a time is compared with the same reference rows
    results = dict(
        [
            entry("compressive", "ours", "tf32", "eager", 90.0, 8.0),
            entry("compressive", "by_segment", "tf32", "eager", 120.0, 2.0),
            entry("compressive", "reference", "tf32", "eager", 100.0, 4.0),
        ]
    )
    compared = bench.ratios(results)
    assert compared["compressive/ours/tf32/eager/8x2048"]["memory_vs_reference"] == 2.0
    assert compared["compressive/by_segment/tf32/eager/8x2048"]["memory_vs_reference"] == 0.5
    assert compared["compressive/by_segment/tf32/eager/8x2048"]["speed_vs_reference"]["eager"] == 1.2
    size = {"compressive": {"shape": (8, 2048)}, "sinkhorn": {"shapes": {"tf32": [(8, 2048)], "bf16": []}}}
    met = {t["target"]: t["met"] for t in bench.targets(compared, size)}
    assert met["compressive tf32 8x2048 memory_vs_reference <= 1.0"] is False
    assert met["compressive by segment tf32 8x2048 memory_vs_reference <= 1.0"] is True
    assert met["compressive by segment tf32 8x2048 speed_vs_reference >= 1.3"] is False


def test_plan_puts_the_regional_and_cuda_graph_rows_after_their_compiled_rows_and_ratios_count_them():
    bench = _load()
    ids = [row.id for row in bench.plan(bench.sizes(False))]
    graphs = [i for i in ids if "/graphs/" in i]
    assert graphs == ["sinkhorn/ours/bf16/graphs/8x2048", "llama/llama/bf16/graphs/8x2048"]
    compiled = [i for i in ids if "/bf16/compiled/8x2048" in i and "reference" not in i and "by_segment" not in i]
    regional = [i.replace("/compiled/", "/regional/") for i in compiled]
    by_segment = "compressive/by_segment/bf16/regional/8x2048"
    regional.insert(regional.index("compressive/ours/bf16/regional/8x2048") + 1, by_segment)
    # a regional twin for every compiled row of ours (the Compressive model trained a segment at a time included)
    # and Llama, never for the references; then the graphs rows
    assert sorted(i for i in ids if "/regional/" in i) == sorted(
        i.replace("/compiled/", "/regional/")
        for i in ids
        if "/compiled/" in i and i.split("/")[1] in ("ours", "by_segment", "llama")
    )
    assert ids[ids.index(compiled[-1]) + 1 : ids.index(graphs[0])] == regional
    # the segment-at-a-time row compiled by layer comes with ours, its whole-model compilation with the references
    assert ids.index(by_segment) < ids.index("compressive/ours/tf32/compiled/8x2048")
    assert ids.index("compressive/by_segment/bf16/compiled/8x2048") > ids.index("llama/llama/bf16/regional/1x32768")
    row = bench.Row("sinkhorn", "ours", "bf16", "eager", 8, 2048)
    results = {
        r.id: {"row": r.__dict__, "tokens_per_s": rate}
        for r, rate in (
            (row, 100.0),
            (bench.Row("llama", "llama", "bf16", "eager", 8, 2048), 200.0),
            (bench.Row("sinkhorn", "ours", "bf16", "graphs", 8, 2048), 400.0),
            (bench.Row("llama", "llama", "bf16", "graphs", 8, 2048), 500.0),
        )
    }
    assert bench.ratios(results)[row.id]["speed_vs_llama"] == {
        "eager": 0.5,
        "compiled": None,
        "regional": None,
        "graphs": 0.8,
        "best": 0.8,
    }


def test_explicit_rows_train_our_models_with_the_attention_as_matrix_products():
    """tf32 eager only, one per family; built with attn_implementation="eager", trained by our step, compared with
    the same reference rows as ours."""
    bench = _load()
    ids = [row.id for row in bench.plan(bench.sizes(False))]
    assert [i for i in ids if "explicit/" in i] == [
        "compressive/explicit/tf32/eager/8x2048",
        "compressive/by_segment_explicit/tf32/eager/8x2048",
        "sinkhorn/explicit/tf32/eager/8x2048",
    ]
    size = bench.sizes(True)
    segment = size["compressive"]["segment"]
    for family, side, shape in (
        ("compressive", "explicit", size["compressive"]["shape"]),
        ("compressive", "by_segment_explicit", size["compressive"]["shape"]),
        ("sinkhorn", "explicit", (2, 64)),
    ):
        row = bench.Row(family, side, "tf32", "eager", *shape)
        model, step = bench.build_step(row, size, torch.device("cpu"), None)
        calls = []
        model.register_forward_hook(lambda module, args, kwargs, out, calls=calls: calls.append(1), with_kwargs=True)
        assert model.config._attn_implementation == "eager"
        implementations = {
            m.implementation for m in model.modules() if isinstance(getattr(m, "implementation", 0), str)
        }
        assert implementations == {"eager"}
        before = [p.detach().clone() for p in model.parameters()]
        step()  # forward, backward, AdamW: the weights move
        assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))
        # by segment: one forward (and backward) per segment of the sequence
        assert len(calls) == (shape[1] // segment if side.startswith("by_segment") else 1), (side, len(calls))
    entry = lambda side, rate, memory: (  # noqa: E731
        f"sinkhorn/{side}/tf32/eager/8x2048",
        {"row": bench.Row("sinkhorn", side, "tf32", "eager", 8, 2048).__dict__, "tokens_per_s": rate,
         "peak_memory_gib": memory},
    )  # fmt: skip
    compared = bench.ratios(dict([entry("explicit", 300.0, 3.0), entry("reference", 200.0, 2.0)]))
    assert compared["sinkhorn/explicit/tf32/eager/8x2048"]["speed_vs_reference"]["eager"] == 1.5
    assert compared["sinkhorn/explicit/tf32/eager/8x2048"]["memory_vs_reference"] == 1.5


@pytest.mark.slow  # the whole --quick run: 1-2 minutes on a loaded 2-core machine
def test_quick_mode_runs_every_row(tmp_path):
    out = tmp_path / "gpu.json"
    # the repository first, then what the session has on PYTHONPATH (the read guard of tests/conftest.py)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "OMP_NUM_THREADS": "1",
    }
    proc = subprocess.run([sys.executable, str(SCRIPT), "--quick", "--device", "cpu", "--out", str(out)], env=env,
                          capture_output=True, text=True, timeout=900)  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    payload = json.loads(out.read_text())
    rows = payload["rows"]
    families = {(r["row"]["family"], r["row"]["side"]) for r in rows.values()}
    assert families == {("compressive", "ours"), ("compressive", "reference"), ("compressive", "by_segment"),
                        ("compressive", "explicit"), ("compressive", "by_segment_explicit"), ("sinkhorn", "ours"),
                        ("sinkhorn", "reference"),
                        ("sinkhorn", "explicit"), ("llama", "llama")}  # fmt: skip
    for row_id, row in rows.items():
        assert ("tokens_per_s" in row) != ("error" in row), row_id
        if row["row"]["mode"] == "eager":
            assert "error" not in row, (row_id, row.get("error"))
    assert {t["target"].split()[0] for t in payload["targets"]} == {"compressive", "sinkhorn"}
