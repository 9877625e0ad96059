"""benchmarks/count_eager.py: operators and bytes of an eager training step along a GPU's path, counted on the CPU."""

from __future__ import annotations

import json

import torch
import torch.nn.functional as F
from script_utils import load_script

from longrange.modeling_compressive import CompressiveAttention


def test_the_counter_sees_sdpa_as_one_operator_and_counts_what_the_others_write():
    count_eager = load_script("count_eager")
    counter = count_eager.Counter()
    query, key, value = (torch.randn(2, 3, 8, 4, requires_grad=True) for _ in range(3))
    with count_eager.cuda_paths(counter), counter:
        scaled = query * 2.0  # one operator writing 2 x 3 x 8 x 4 floats
        out = F.scaled_dot_product_attention(scaled, key, value.transpose(-1, -2).transpose(-1, -2))  # views
        out.sum().backward()
    ops = {name for name, _ in counter.ops}
    assert "mul" in ops and counter.bytes[("mul", next(s for n, s in counter.ops if n == "mul"))] >= 2 * 3 * 8 * 4 * 4
    assert not ops & {"bmm", "_softmax", "_safe_softmax", "_softmax_backward_data"}  # sdpa's inside is unseen
    assert counter.views >= 2
    assert F.scaled_dot_product_attention is count_eager._real_sdpa  # every stand-in undone on exit
    assert CompressiveAttention.kernel.__name__ == "kernel" and torch.optim.AdamW.__name__ == "AdamW"


def test_quick_rows_are_counted_and_written(tmp_path):
    count_eager = load_script("count_eager")
    out = tmp_path / "eager.json"
    threads = torch.get_num_threads()
    try:
        results = count_eager.main(
            ["--quick", "--rows", "^(compressive/ours|llama/llama)/bf16/eager/2x64$", "--json", str(out)]
        )
    finally:
        torch.set_num_threads(threads)
    assert {r["row"] for r in results} == {"compressive/ours/bf16/eager/2x64", "llama/llama/bf16/eager/2x64"}
    for result in results:
        assert result["operators"] > 100 and result["views"] > 100 and result["bytes_written"] > 0
        assert 0 < result["saved_for_backward"] < result["bytes_written"]
        assert result["top_writers"] and result["top_writers"][0]["bytes"] >= result["top_writers"][-1]["bytes"]
    assert json.loads(out.read_text())["rows"] == results


def test_saved_for_backward_counts_each_storage_once_and_keeps_the_largest_backward():
    count_eager = load_script("count_eager")
    weight = torch.nn.Parameter(torch.randn(1000))
    saved = count_eager.SavedForBackward([weight])
    backward = torch.autograd.backward
    with saved.watching():
        x = torch.randn(1000, requires_grad=True)
        z = (x * weight).exp()  # keeps x (4,000 bytes; the parameter is left out) and its output z (4,000)
        (z + z.exp()).sum().backward()  # z again (counted once) and exp's output: 12,000 bytes held
        small = torch.randn(10, requires_grad=True)
        (small * weight[:10]).sum().backward()  # 40 bytes (a view of the parameter is the parameter)
    assert saved.peak == 12_000 and torch.autograd.backward is backward
