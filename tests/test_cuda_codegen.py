"""The code inductor writes for a GPU, generated without one (`benchmarks/count_kernels.py --device cuda`,
`benchmarks/fake_cuda.py`): compiled training and decoding steps of both models and of transformers' Llama must
generate for an H200. Runs where torch is a CUDA build and triton is installed (CI's `cuda-codegen` environment:
the device's torch 2.11 on a machine without a GPU); elsewhere skipped.

Each case failed on the code before its fix, with torch 2.11 (the device's): Sinkhorn training with 257 buckets
(the device run's "list indices must be integers or slices, not NoneType": a split scan of the routing summaries)
and every Sinkhorn decoding step ("The argument '16*((-2))' is not comparable": a clamp of index arithmetic)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

# collected here too, to run on the device's torch 2.11, whose dynamo says every torch.compile is exporting
from tests.test_export import test_is_exporting_is_true_under_torch_export_only  # noqa: F401
from tests.test_sinkhorn_compile import CONFIGS

pytest.importorskip("triton")
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="needs a CUDA build of torch (no GPU)"),
]
REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "count_kernels.py"

# one tiny Sinkhorn model of tests/test_sinkhorn_compile.py: its training step traced on the CPU, then generated for
# the fake H200 (in a process of its own: fake_cuda tells torch a GPU is present)
CONFIG_STEP = """
import json, sys
sys.path[:0] = [sys.argv[1] + "/benchmarks", sys.argv[1]]
import count_kernels, fake_cuda
from tests.test_sinkhorn_compile import batch, build, training_step
model = build(sys.argv[2], **json.loads(sys.argv[3]))
graphs = []
model.compile(backend=fake_cuda.capturing(graphs))
training_step(model, batch(model, length=int(sys.argv[4])))()
sources, _ = count_kernels._generated_code(lambda: fake_cuda.compile_for_cuda(graphs, None), "cuda")
print(json.dumps({"graphs": len(graphs), **count_kernels.launches(sources)}))
"""


def count(tmp_path, *args) -> list[dict]:
    spec = importlib.util.spec_from_file_location("count_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main(["--device", "cuda", "--quick", "--json", str(tmp_path / "k.json"), *args])


def assert_generated_for_cuda(step: dict) -> None:
    """Launches were written, and attention is CUDA's kernel (flash or memory-efficient), not the CPU's."""
    assert step["launches"] > 0 and sum(step["triton"].values()) > 0
    attention = [name for name in step["aten_fallbacks"] if "scaled_dot_product" in name]
    assert attention and all("for_cpu" not in name for name in attention), step["aten_fallbacks"]


@pytest.mark.parametrize(
    "model, shape",
    [("sinkhorn", (1, 4096)), ("sinkhorn", (2, 64)), ("compressive", (2, 64)), ("llama", (2, 64))],
)
def test_training_step_generates_for_a_gpu(tmp_path, model, shape):
    # Sinkhorn at 1 x 4,096 with 16-token buckets: 257 buckets in the causal pair, as at 1 x 32,768 on the device
    (row,) = count(tmp_path, "--models", model, "--batch", str(shape[0]), "--length", str(shape[1]))
    assert row["device"] == "cuda" and row["graphs"] == 2  # forward and backward
    assert_generated_for_cuda(row)


@pytest.mark.parametrize("model", ["sinkhorn", "compressive", "llama"])
def test_decoding_steps_generate_for_a_gpu(tmp_path, model):
    (row,) = count(tmp_path, "--models", model, "--decode", "64")
    assert row["device"] == "cuda" and row["graphs"] >= 1
    for step in row["steps"]:
        assert_generated_for_cuda(step)
    if model == "sinkhorn":  # a step that routes, and one that keeps its window (fewer launches)
        assert row["graphs"] == 2 and row["steps"][1]["launches"] < row["steps"][0]["launches"]


@pytest.mark.parametrize("name", [*CONFIGS, "causal-running-summary"])
def test_every_sinkhorn_configuration_generates_its_training_step_for_a_gpu(name):
    # 1,000 tokens in buckets of 8: 125 buckets, scans and reductions over few long rows
    overrides = {"max_position_embeddings": 1000}
    if name == "causal-running-summary":
        overrides["causal_key_summary"] = "running_mean_sum"
    config = "causal" if name == "causal-running-summary" else name
    args = [sys.executable, "-c", CONFIG_STEP, str(REPO), config, json.dumps(overrides), "1000"]
    proc = subprocess.run(args, capture_output=True, text=True, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.strip().splitlines()[-1])
    assert row["graphs"] >= 1 and row["launches"] > 0
    assert_generated_for_cuda(row)


FORWARD, BACKWARD = "_scaled_dot_product_efficient_attention", "_scaled_dot_product_efficient_attention_backward"


def attention_calls(row: dict) -> dict:
    return {k: v for k, v in row["aten_fallbacks"].items() if "scaled_dot_product" in k}


def test_regionally_compiled_training_steps_generate_for_a_gpu(tmp_path):
    """`benchmark_gpu.py`'s regional rows (each decoder layer compiled alone, as `longrange train --compile`): every
    graph generates for the H200, and each counts as often as the step runs it: Sinkhorn launches as many attention
    kernels as compiled whole; the Compressive layers one per layer and segment (2 x 2 at this size), forward and
    backward (compiled whole, the graph also holds the reconstruction loss's attention, which regional compilation
    leaves eager: outside any layer's forward)."""
    shape = ["--batch", "2", "--length", "64"]
    for model in ("sinkhorn", "compressive"):
        (regional,) = count(tmp_path, "--models", model, "--mode", "regional", *shape)
        assert regional["mode"] == "regional" and regional["graphs"] >= 2
        assert_generated_for_cuda(regional)
        if model == "sinkhorn":
            (whole,) = count(tmp_path, "--models", model, *shape)
            assert attention_calls(regional) == attention_calls(whole)
        else:
            assert attention_calls(regional) == {FORWARD: 4, BACKWARD: 4}


def test_the_compressive_model_trained_a_segment_at_a_time_generates_for_a_gpu(tmp_path):
    """`benchmark_gpu.py`'s by_segment rows compiled by layer and whole: one attending graph per memory fill (no
    memory, then memory; torch >= 2.15 also traces the leaf modules compiled alone), each generated for the H200.
    By layer: each layer's attention once per segment, forward and backward; whole: also the reconstruction loss's
    (the second segment evicts: a target without gradient and a prediction per layer)."""
    args = ["--models", "compressive", "--by-segment", "--batch", "2", "--length", "64"]  # 2 segments of 32, 2 layers
    for mode, graphs, attention in (
        ("regional", 4, {FORWARD: 4, BACKWARD: 4}),
        ("compiled", 4, {FORWARD: 8, BACKWARD: 6}),
    ):
        (row,) = count(tmp_path, *args, "--mode", mode)
        assert row["by_segment"] and row["attention_graphs"] == graphs, (mode, row["attention_graphs"])
        assert_generated_for_cuda(row)
        assert attention_calls(row) == attention, mode
