"""benchmarks/count_kernels.py: the kernels of a compiled training step, from inductor's Triton code generation
without a GPU. Runs only where the `triton` package is installed (it is not a dependency)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "count_kernels.py"


def build_llama(module):
    """The Llama of the counted step (benchmark_gpu.py's --quick width), built here to count its products."""
    import sys

    sys.path.insert(0, str(SCRIPT.parent))
    import benchmark_gpu

    row = benchmark_gpu.Row("llama", "llama", "bf16", "eager", 1, 64)
    model, _ = benchmark_gpu.build_step(row, benchmark_gpu.sizes(True), torch.device("cpu"), {})
    return model


def compile_reports_exporting() -> bool:
    """Whether `torch.compiler.is_exporting()` is True inside torch.compile (torch 2.7-2.11)."""
    check = getattr(torch.compiler, "is_exporting", None)
    return check is not None and bool(torch.compile(lambda x: x + check(), backend="eager")(torch.zeros(())))


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
    # Llama's products counted here from the model itself: every linear layer 2 flop per weight per token forward and
    # 4 backward (input and weight gradients), causal attention over half the L x L pairs, 4 B H L L d forward and
    # 10 backward
    llama = by_model["llama"]
    model = build_llama(module)
    tokens, length = 64, 64
    heads, head_dim = model.config.num_attention_heads, model.config.hidden_size // model.config.num_attention_heads
    linear = sum(m.in_features * m.out_features for m in model.modules() if isinstance(m, torch.nn.Linear))
    # torch 2.7-2.11 answer is_exporting() with True inside torch.compile (pytorch/pytorch#176347), and then
    # transformers passes Llama's attention a full mask instead of is_causal: every pair is scored
    pairs = length * length if compile_reports_exporting() else length * length / 2
    attention = model.config.num_hidden_layers * 14 * heads * pairs * head_dim
    assert llama["flop"] == pytest.approx(6 * tokens * linear + attention, rel=1e-6)
    for row in rows:
        assert row["triton_bytes"] > 0 and row["library_bytes"] > 0
        floor = (row["triton_bytes"] + row["library_bytes"]) / module.H200["bytes_per_s"]  # every byte at peak
        assert row["h200_roofline_ms"] == pytest.approx(max(floor, row["flop"] / 989e12) * 1e3, rel=0.5)


@pytest.mark.slow
def test_sinkhorn_decoding_step_writes_its_cache_in_place():
    """The decoding steps generate() compiles: the Sinkhorn step that keeps its window (most steps) launches fewer
    kernels than the one that routes and writes no cache buffer back from a copy (a `scatter_` on a cache buffer
    did: 61 copies back per step at the benchmark's size, 21 here)."""
    spec = importlib.util.spec_from_file_location("count_kernels", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    (row,) = module.main(["--quick", "--decode", "40", "--models", "sinkhorn"])
    routes, keeps = row["steps"]
    assert keeps["launches"] < routes["launches"]
    assert keeps["copies_back"] == 0
    # the routing step may copy back a new routing choice ([b, h, n_top], `keep_route`) whose value inductor also
    # recomputes in a consumer: at most one per layer (2 here; the scatters gave 9)
    assert routes["copies_back"] <= 2


def test_options_that_only_apply_to_some_counts_are_refused_elsewhere(capsys):
    """--mode regional and --by-segment count training steps generated for CUDA, --by-segment the Compressive model:
    anywhere else they would be accepted and ignored."""
    spec = importlib.util.spec_from_file_location("count_kernels", SCRIPT)
    count_kernels = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(count_kernels)
    for argv in (
        ["--mode", "regional"],  # the CPU device
        ["--device", "cuda", "--by-segment", "--models", "compressive", "--decode", "64"],
        ["--device", "cuda", "--by-segment", "--models", "sinkhorn"],
    ):
        with pytest.raises(SystemExit):
            count_kernels.main(argv)
        assert "--" in capsys.readouterr().err
