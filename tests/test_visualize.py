"""longrange visualize on tiny saved models: Compressive (a PNG and per-segment masses that add up to one) and
Sinkhorn (a PNG of the routing, one panel per layer and head, and matrices that respect the routing rules)."""

from __future__ import annotations

import json

import torch

from longrange import (
    CompressiveConfig,
    CompressiveForCausalLM,
    SinkhornConfig,
    SinkhornForCausalLM,
    SinkhornForMaskedLM,
)
from longrange.tokenization import byte_tokenizer


def load_script():
    from longrange.commands import visualize

    return visualize


def test_visualize_writes_a_png_of_attention_mass_per_region(tmp_path):
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    config = CompressiveConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
        segment_length=8, mem_len=8, c_mem_len=4, compression_rate=2,
    )  # fmt: skip
    CompressiveForCausalLM(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    text = "a line of text that the model reads through its memories\n" * 3
    out = tmp_path / "attention.png"
    figures = load_script().main([str(tmp_path / "model"), "--text", text, "--out", str(out), "--max_tokens", "64"])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len(figures) == 8 and all(len(segment) == 2 for segment in figures)
    for segment in figures:
        for compressed, memory, current in segment:
            assert abs(compressed + memory + current - 1) < 1e-5
    first, later = figures[0][0], figures[-1][0]
    assert first[0] == first[1] == 0  # nothing in memory yet
    assert later[0] > 0 and later[1] > 0  # by the last segment both memories are held and attended


def test_visualize_draws_the_sinkhorn_routing_of_a_causal_model(tmp_path, capsys):
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    config = SinkhornConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=4, bucket_size=8,
        causal=True, max_position_embeddings=64,
    )  # fmt: skip
    SinkhornForCausalLM(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out, numbers = tmp_path / "routing.png", tmp_path / "routing.json"
    text = "def read(path):\n    return open(path).read()\n" * 4
    argv = [str(tmp_path / "model"), "--text", text, "--out", str(out), "--json", str(numbers), "--max_tokens", "1000"]
    matrices = load_script().main(argv)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 10_000
    assert "2 layers x 4 heads = 8 panels" in capsys.readouterr().out
    # 64 tokens (max_position_embeddings) = 8 buckets; the shifted heads have one bucket more; null column first
    assert len(matrices) == 2 and all(len(layer) == 4 for layer in matrices)
    assert json.loads(numbers.read_text())["routing"] == matrices
    for layer in matrices:
        for matrix in layer:
            assert len(matrix) == 9 and all(len(row) == 10 for row in matrix)
            for u, row in enumerate(matrix):
                assert all(w == 0 for w in row[1 + u :])  # a query bucket chooses only earlier key buckets
                assert row[0] + sum(row[1:]) <= 1 + 1e-6  # routing weights: a softmax over its candidates
    assert any(matrix[0][0] > 0 for layer in matrices for matrix in layer)  # bucket 0 can only choose null


def test_visualize_draws_the_sinkhorn_routing_of_a_masked_model_with_local_heads(tmp_path):
    tokenizer = byte_tokenizer()
    torch.manual_seed(0)
    config = SinkhornConfig(
        vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=1, num_attention_heads=4, bucket_size=8,
        causal=False, n_local_attn_heads=1, n_top_buckets=1, max_position_embeddings=40,
    )  # fmt: skip
    SinkhornForMaskedLM(config).save_pretrained(tmp_path / "model")
    tokenizer.save_pretrained(tmp_path / "model")
    out = tmp_path / "routing.png"
    script = load_script()
    matrices = script.main([str(tmp_path / "model"), "--text", "x = 1\n" * 10, "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    (layer,) = matrices
    local, *sinkhorn = layer
    assert all(w == 0 for row in local for w in row)  # the local head has no routing
    for matrix in sinkhorn:  # 40 tokens = 5 buckets, no null column; each bucket picks one other bucket
        assert len(matrix) == 5 and all(len(row) == 5 for row in matrix)
        assert all(sum(w > 0 for w in row) == 1 and row[u] == 0 for u, row in enumerate(matrix))
    panels = script.plot_routing(matrices, [["local", "sinkhorn", "sinkhorn", "sinkhorn"]], out, "t", False)
    assert panels == 4
