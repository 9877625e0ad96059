"""The clients the tests drive the models through (TRL, lm-evaluation-harness, onnx, onnxscript, onnxruntime) are the
`clients` extra of setup.cfg: a test that needs one skips, naming the extra, where it is not installed. Also the
tiny saved-folder models those tests give the clients, with transformers' Llama as the reference."""

from __future__ import annotations

import pytest
from transformers import LlamaConfig, LlamaForCausalLM

from longrange import CompressiveConfig, CompressiveForCausalLM, SinkhornConfig, SinkhornForCausalLM
from longrange.tokenization import byte_tokenizer

INSTALL = 'pip install -e ".[clients]"'
TOKENIZER = byte_tokenizer()
SPECIAL = dict(
    vocab_size=len(TOKENIZER), bos_token_id=TOKENIZER.bos_token_id, eos_token_id=TOKENIZER.eos_token_id,
    pad_token_id=TOKENIZER.pad_token_id,
)  # fmt: skip


def require_client(module: str):
    """Import `module` (a client or one of its modules), or skip the test, saying how to install the clients."""
    return pytest.importorskip(module, reason=f"{module.split('.')[0]} is not installed (a client): {INSTALL}")


def causal_models(max_positions: int) -> dict:
    """Constructors of Llama (the reference), the Compressive model and causal Sinkhorn: 2 layers of width 32 for the
    byte tokenizer, its special tokens in the configs; Llama's and Sinkhorn's position tables `max_positions` long."""
    common = dict(SPECIAL, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
    return {
        "llama": lambda: LlamaForCausalLM(
            LlamaConfig(**common, intermediate_size=64, num_key_value_heads=2, max_position_embeddings=max_positions)
        ),
        "compressive": lambda: CompressiveForCausalLM(
            CompressiveConfig(**common, intermediate_size=64, segment_length=8, mem_len=8, c_mem_len=4)
        ),
        "sinkhorn": lambda: SinkhornForCausalLM(
            SinkhornConfig(**common, bucket_size=8, max_position_embeddings=max_positions, causal=True)
        ),
    }
