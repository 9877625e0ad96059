"""Compressive training on the GPU path: one graph, no host reads, fixed launch counts, compiled = eager, bf16.

Run on the CPU: what makes a GPU step launch-bound (graph breaks, values read back to the host, Python loops that
grow with the batch) shows up in the traced graph and in the operators dispatched, whatever the device.
"""

from __future__ import annotations

import pytest
import torch

from longrange import CompressiveForCausalLM
from tests.dispatch_utils import count_dispatched_ops, kernel_ops, needs_traceable_outputs, sync_ops
from tests.test_compressive_model import VOCAB
from tests.test_compressive_model import tiny_model as compressive_tiny_model

OPTIONS = [
    dict(),
    dict(compression_function="most_used", reconstruction_loss="none"),
    dict(reconstruction_loss="autoencoding", layer_norm_position="post"),
    dict(c_mem_len=0, mem_len=3),  # Transformer-XL: evicted memories dropped one by one
]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny_model(seed: int = 0, **overrides) -> CompressiveForCausalLM:
    """The model tests' tiny model (non-trivial u / v biases), in training mode, with a short memory: 16 tokens
    evict and compress."""
    return compressive_tiny_model(seed, **{"mem_len": 4, "c_mem_len": 2, **overrides}).train()


def batch_of(size: int, length: int = 16, pad: int = 3):
    generator = torch.Generator().manual_seed(size)
    ids = torch.randint(0, VOCAB, (size, length), generator=generator)
    mask = torch.ones_like(ids)
    mask[0, :pad] = 0
    return ids, mask


def training_step(model, size: int = 2, length: int = 16):
    ids, mask = batch_of(size, length)
    return lambda: model(ids, attention_mask=mask, labels=ids).loss.backward()


@needs_traceable_outputs
@pytest.mark.parametrize("options", OPTIONS)
def test_training_forward_is_one_graph(options):
    model = tiny_model(**options)
    ids, mask = batch_of(2)
    explanation = torch._dynamo.explain(model)(ids, attention_mask=mask, labels=ids)
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    assert explanation.graph_count == 1


@pytest.mark.parametrize("implementation", ["sdpa", "eager", "blockwise"])
@pytest.mark.parametrize("options", OPTIONS)
def test_training_step_reads_nothing_back_to_the_host(implementation, options):
    counts = count_dispatched_ops(training_step(tiny_model(attn_implementation=implementation, **options)))
    assert sync_ops(counts) == {}


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_operators_per_training_step_do_not_grow_with_the_batch(implementation, monkeypatch):
    from longrange.modeling_compressive import CompressiveAttention

    # what a GPU runs: torch's sdpa with the position bias (the CPU's blockwise kernel sizes its row blocks to the
    # cache and is not part of this promise)
    fused = CompressiveAttention.kernel
    monkeypatch.setattr(
        CompressiveAttention,
        "kernel",
        lambda self, device, need_weights=False, static=False: fused(self, torch.device("cuda"), need_weights, static),
    )
    totals = []
    for size in (2, 8, 32):  # (a batch of 1 makes some tensors contiguous: fewer copies)
        counts = count_dispatched_ops(training_step(tiny_model(attn_implementation=implementation), size, 24))
        totals.append(sum(kernel_ops(counts).values()))
    assert totals[0] == totals[1] == totals[2], totals


@needs_traceable_outputs
@pytest.mark.parametrize(
    "backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)]
)  # aot_eager: the traced forward and backward graphs; inductor: also the generated kernels (minutes on 2 cores)
def test_fullgraph_compiled_training_equals_eager(backend):
    eager = tiny_model()
    compiled_model = tiny_model()
    ids, mask = batch_of(2, length=16 if backend == "aot_eager" else 8)  # 2 segments: one eviction, one compression
    compiled = torch.compile(compiled_model, fullgraph=True, backend=backend)
    for _ in range(2):  # the second step starts from updated parameters: no stale graph
        want = eager(ids, attention_mask=mask, labels=ids)
        got = compiled(ids, attention_mask=mask, labels=ids)
        torch.testing.assert_close(got.loss, want.loss, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(got.reconstruction_loss, want.reconstruction_loss, atol=1e-6, rtol=1e-5)
        want.loss.backward()
        got.loss.backward()
        for (name, p), q in zip(eager.named_parameters(), compiled_model.parameters()):
            torch.testing.assert_close(q.grad, p.grad, atol=1e-5, rtol=1e-4, msg=name)
        with torch.no_grad():
            for p, q in zip(eager.parameters(), compiled_model.parameters()):
                p -= 0.1 * p.grad
                q -= 0.1 * q.grad
                p.grad = q.grad = None


@pytest.mark.parametrize("implementation", ["sdpa", "eager", "blockwise"])
@pytest.mark.parametrize("backward_inside_autocast", [False, True])
def test_bf16_autocast_training_with_backward_inside_or_outside(implementation, backward_inside_autocast):
    reference = tiny_model(attn_implementation=implementation)
    model = tiny_model(attn_implementation=implementation)
    ids, mask = batch_of(2)
    want = reference(ids, attention_mask=mask, labels=ids).loss
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids, attention_mask=mask, labels=ids).loss
        if backward_inside_autocast:
            loss.backward()
    if not backward_inside_autocast:
        loss.backward()
    torch.testing.assert_close(loss.float(), want, atol=0.05, rtol=0.02)
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == p.dtype and torch.isfinite(p.grad).all(), name


@pytest.mark.parametrize("implementation", ["sdpa", "blockwise"])
def test_training_with_bf16_weights(implementation):
    reference = tiny_model(attn_implementation=implementation)
    model = tiny_model(attn_implementation=implementation).to(torch.bfloat16)
    ids, mask = batch_of(2)
    want = reference(ids, attention_mask=mask, labels=ids).loss
    out = model(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    assert out.logits.dtype == torch.bfloat16
    torch.testing.assert_close(out.loss.float(), want, atol=0.05, rtol=0.02)
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == torch.bfloat16 and torch.isfinite(p.grad).all(), name


@needs_traceable_outputs
def test_cached_decoding_step_is_one_graph_and_reads_nothing_back():
    """A decoding step on a cache holding compressed memory, memory and an unfinished segment (issue: decoding at
    GPU speed needs this before static shapes)."""
    model = tiny_model().eval()
    ids, mask = batch_of(2, length=21)
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).cache
        step_ids, step_mask = ids[:, -1:], torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        counts = count_dispatched_ops(lambda: model(step_ids, attention_mask=step_mask, cache=cache, use_cache=True))
        assert sync_ops(counts) == {}
        cache = model(ids, attention_mask=mask, use_cache=True).cache  # the step above advanced the first one
        explanation = torch._dynamo.explain(model)(step_ids, attention_mask=step_mask, cache=cache, use_cache=True)
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
