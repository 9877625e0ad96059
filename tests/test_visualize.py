"""scripts/visualize.py on a tiny saved Compressive model: a PNG and per-segment masses that add up to one."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch

from longrange import CompressiveConfig, CompressiveForCausalLM
from longrange.tokenization import byte_tokenizer

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "visualize.py"


def load_script():
    spec = importlib.util.spec_from_file_location("visualize", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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
