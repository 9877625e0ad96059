"""benchmarks/benchmark_decoding.py keeps running and reporting on the CPU (no timing assertions: figures are noisy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from script_utils import load_script

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "benchmark_decoding.py"


@pytest.fixture
def bench():
    return load_script("benchmark_decoding")


def test_rows_are_measured_and_added_to_an_existing_json(bench, tmp_path, monkeypatch):
    out = tmp_path / "gpu.json"
    out.write_text(json.dumps({"rows": {"training": 1}}))
    real_measure = bench.measure

    def measure(row, *args):
        if row.context == 64:
            raise RuntimeError("out of memory\nsecond line")
        return real_measure(row, *args)

    monkeypatch.setattr(bench, "measure", measure)
    bench.main(["--quick", "--device", "cpu", "--rows", "(sinkhorn/ours|llama/llama)/eager", "--out", str(out)])
    written = json.loads(out.read_text())
    assert written["rows"] == {"training": 1}  # the training benchmark's rows are kept
    rows = written["decoding"]["rows"]
    assert set(rows) == {f"{f}/eager/{n}" for f in ("sinkhorn/ours", "llama/llama") for n in (32, 64)}
    measured = rows["sinkhorn/ours/eager/32"]
    assert measured["new_tokens"] == 6 and len(measured["per_token_s"]) == 5 and measured["tokens_per_s"] > 0
    assert rows["llama/llama/eager/64"]["error"] == "error: RuntimeError: out of memory"
    assert written["decoding"]["complete"]
    # the record redrawn: a plot of the measured rows and the table again, nothing measured
    monkeypatch.setattr(bench, "measure", None)
    image = tmp_path / "decoding.png"
    again = bench.main(["--plot-only", str(out), "--plot", str(image)])
    assert again["rows"] == rows and image.stat().st_size > 10_000


def test_the_prompts_hold_no_padding(bench):
    """generate() is given pad_token_id=0 and reads every 0 of a prompt without an attention mask as padding: the
    measured prompts hold none, and the prefill sees a mask of ones (transformers' Llama here, whose forward
    receives the mask generate() builds from the pad id, None when the prompt holds none)."""
    pad = bench.generate_kwargs(bench.Row("llama", "llama", "eager", 64), "cpu", "inductor")["pad_token_id"]
    assert pad == 0 and bool((bench.random_prompt(4096) != pad).all())
    size = {**bench.sizes(quick=True), "contexts": [1024]}  # (the prompt of 1,024 tokens drawn before this held two 0s)
    row = bench.Row("llama", "llama", "eager", 1024)
    model = bench.build(row, size)
    masks = []
    model.register_forward_pre_hook(lambda module, args, kw: masks.append(kw.get("attention_mask")), with_kwargs=True)
    bench.measure(row, size, bench.torch.device("cpu"), "inductor", {(row.family, row.side, row.mode): model})
    assert masks and all(mask is None or bool(mask.all()) for mask in masks)


def test_ratios_and_context_scaling(bench):
    def entry(family, side, mode, context, rate):
        row = bench.Row(family, side, mode, context)
        return row.id, {"row": row.__dict__, "tokens_per_s": rate}

    size = {"contexts": [512, 4096]}
    results = dict(
        [
            entry("sinkhorn", "ours", "compiled", 512, 1200.0),
            entry("sinkhorn", "ours", "compiled", 4096, 1000.0),
            entry("llama", "llama", "compiled", 512, 800.0),
            entry("sinkhorn", "reference", "eager", 4096, 50.0),
        ]
    )
    compared = bench.summarise(results, size)
    assert compared["sinkhorn/ours/compiled/512"] == {"vs_llama_static_compiled": 1.5, "vs_reference": None}
    long = compared["sinkhorn/ours/compiled/4096"]
    assert long["vs_reference"] == 20.0 and long["vs_llama_static_compiled"] is None
    assert long["time_per_token_4096_over_512"] == pytest.approx(1.2)


def test_a_compiled_row_that_compiles_nothing_is_an_error_not_an_eager_figure(bench, monkeypatch):
    # a "compiled" row whose generate() runs eagerly (as when a cache is not compileable)
    eager = bench.generate_kwargs(bench.Row("llama", "llama", "eager", 32), bench.torch.device("cpu"), "aot_eager")
    monkeypatch.setattr(bench, "generate_kwargs", lambda *args: eager)
    size = bench.sizes(quick=True)
    row, cpu = bench.Row("llama", "llama", "compiled", 32), bench.torch.device("cpu")
    with pytest.raises(RuntimeError, match="compiled nothing"):
        bench.measure(row, size, cpu, "aot_eager", {})
    models = {}  # nor does a row that reuses its model after another row
    bench.model_for(row, size, cpu, models)
    with pytest.raises(RuntimeError, match="compiled nothing"):
        bench.measure(row, size, cpu, "aot_eager", models)


def test_decoding_work_is_the_profiled_difference_of_two_generate_calls(bench):
    size, cpu = bench.sizes(quick=True), bench.torch.device("cpu")
    row = bench.Row("sinkhorn", "ours", "eager", 32)
    model, _ = bench.model_for(row, size, cpu, {})
    prompt = bench.torch.randint(1, 256, (1, 32))
    work = bench.decoding_work(model, prompt, bench.generate_kwargs(row, cpu, "aot_eager"), cpu, steps=2)
    top = work["top_work_per_token"]
    assert work["steps"] == 2 and work["busy_s_per_token"] > 0 and top
    assert all(t["name"].startswith("aten::") and t["calls"] > 0 and t["us"] > 0 for t in top)
