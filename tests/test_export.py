"""torch.export with a dynamic sequence length: one exported program for every length up to the Dim's max, equal
to the eager model at lengths that are and are not bucket / segment multiples, as transformers' models give it."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

from longrange import (
    CompressiveConfig,
    CompressiveForCausalLM,
    SinkhornConfig,
    SinkhornForCausalLM,
    SinkhornForMaskedLM,
)

pytestmark = pytest.mark.skipif(
    not hasattr(torch.compiler, "is_exporting"), reason="a dynamic length exports from torch 2.7 on (is_exporting)"
)
VOCAB = 32
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
MAX = 16
LENGTHS = (2, 5, 8, 13, MAX)  # buckets of 4 and segments of 8: 5 and 13 are neither's multiple
MODELS = {
    "compressive": lambda: CompressiveForCausalLM(
        CompressiveConfig(**SMALL, intermediate_size=64, segment_length=8, mem_len=8, c_mem_len=4, compression_rate=2)
    ),
    "sinkhorn causal": lambda: SinkhornForCausalLM(
        SinkhornConfig(**SMALL, bucket_size=4, max_position_embeddings=64, causal=True)
    ),
    "sinkhorn masked": lambda: SinkhornForMaskedLM(
        SinkhornConfig(**SMALL, bucket_size=4, max_position_embeddings=64, causal=False, n_local_attn_heads=1)
    ),
}


def export(model, ids, mask=None, seq=None):
    kwargs = dict(input_ids=ids) if mask is None else dict(input_ids=ids, attention_mask=mask)
    if not isinstance(model, SinkhornForMaskedLM):
        kwargs["use_cache"] = False
    seq = seq if seq is not None else Dim("seq", min=2, max=MAX)
    shapes = {name: ({1: seq} if name != "use_cache" else None) for name in kwargs}
    return torch.export.export(model, args=(), kwargs=kwargs, dynamic_shapes=shapes, strict=False)


@pytest.mark.parametrize("name", MODELS)
def test_one_exported_program_equals_eager_at_every_length(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    generator = torch.Generator().manual_seed(1)
    program = export(model, torch.randint(0, VOCAB, (2, 7), generator=generator)).module()
    for length in LENGTHS:
        ids = torch.randint(0, VOCAB, (2, length), generator=generator)
        with torch.no_grad():
            eager = model(input_ids=ids).logits
            exported = program(input_ids=ids, **({} if name == "sinkhorn masked" else {"use_cache": False})).logits
        assert exported.shape == eager.shape
        torch.testing.assert_close(exported, eager, atol=2e-6, rtol=0, msg=f"length {length}")


def test_exported_program_takes_a_padding_mask():
    torch.manual_seed(0)
    model = MODELS["sinkhorn causal"]().eval()
    ids = torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    program = export(model, ids, mask).module()
    mask[0, :3] = 0  # left padding
    with torch.no_grad():
        eager = model(input_ids=ids, attention_mask=mask).logits
        exported = program(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(exported[0, 3:], eager[0, 3:], atol=2e-6, rtol=0)
    torch.testing.assert_close(exported[1], eager[1], atol=2e-6, rtol=0)


def test_a_dynamic_length_without_a_maximum_is_refused():
    model = MODELS["sinkhorn masked"]().eval()
    with pytest.raises(ValueError, match=r"give its Dim a max"):
        export(model, torch.randint(0, VOCAB, (2, 7)), seq=Dim("seq"))


def test_is_exporting_is_true_under_torch_export_only():
    """`layers.is_exporting` picks the export-only paths (the routing's k rounds that torch.onnx exports, a dynamic
    length padded to its bound): true under torch.export, false in eager and in every torch.compile, where the dynamo
    of torch 2.7-2.11 answers `torch.compiler.is_exporting()` with True (pytorch/pytorch#176347; CI's cuda-codegen
    environment runs this test on torch 2.11, through tests/test_cuda_codegen.py)."""
    from longrange.layers import is_exporting

    class Probe(torch.nn.Module):
        def forward(self, x):
            return x + 1 if is_exporting() else x

    x = torch.zeros(2)
    assert not is_exporting() and torch.equal(Probe()(x), x)
    torch._dynamo.reset()
    assert torch.equal(torch.compile(Probe(), backend="eager", fullgraph=True)(x), x)
    torch._dynamo.reset()
    assert torch.equal(torch.export.export(Probe(), (x,), strict=False).module()(x), x + 1)
