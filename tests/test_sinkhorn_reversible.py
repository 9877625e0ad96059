"""Sinkhorn memory savers are exact: reversible layers and chunked feed-forward (float64).

Reversible layers compute the two-stream recurrence y1 = x1 + f(x2), y2 = x2 + g(y1) (f = attention, g =
feed-forward), which is a different function from the one-stream residual stack x = x + f(x); x = x + g(x). So
"the same loss and gradients" means: the model with `reversible=True` (activations recomputed in a custom
backward) gives the loss and gradients that ordinary autograd gives for the same recurrence with every
activation stored. The ordinary-autograd side is written here, in the test: the reversible stack's forward is
replaced by a plain loop over its (f, g) blocks, in a second model that received the first one's weights through
its state_dict.
"""

from __future__ import annotations

import pytest
import torch

from longrange import SinkhornConfig, SinkhornForCausalLM, SinkhornForMaskedLM, SinkhornModel
from longrange.reversible import ReversibleSequence

VOCAB = 50


def config(causal: bool, **overrides) -> SinkhornConfig:
    options = dict(
        num_tokens=VOCAB,
        dim=16,
        depth=3,
        heads=4,
        bucket_size=4,
        max_seq_len=64,
        causal=causal,
        n_top_buckets=2,
        n_local_attn_heads=1,
        pkm_layers=[2],
        pkm_num_keys=8,
        pkm_topk=4,
        pkm_heads=2,
    )
    if not causal:
        options["n_sortcut"] = 2
    options.update(overrides)
    return SinkhornConfig(**options)


def model_for(cfg: SinkhornConfig):
    torch.manual_seed(0)
    cls = SinkhornForCausalLM if cfg.causal else SinkhornForMaskedLM
    return cls(cfg).double().train()


def copy_of(model, cfg: SinkhornConfig):
    """A second model of `cfg` holding `model`'s weights (state_dict transfer, strict)."""
    torch.manual_seed(99)  # different initialisation, overwritten by the state dict
    other = type(model)(cfg).double().train()
    other.load_state_dict(model.state_dict(), strict=True)
    return other


def naive_forward(self, x1, x2, f_kwargs=None, g_kwargs=None, skip=None):
    """ReversibleSequence.forward as a plain loop: ordinary autograd stores every activation."""
    f_kwargs, g_kwargs = f_kwargs or {}, g_kwargs or {}
    for i, (f, g) in enumerate(self.blocks):
        if skip is not None and skip[i]:
            continue
        x1 = x1 + f(x2, **f_kwargs)
        x2 = x2 + g(x1, **g_kwargs)
    return x1, x2


def inputs(length=19, left_pad=False):
    gen = torch.Generator().manual_seed(3)
    ids = torch.randint(0, VOCAB, (2, length), generator=gen)
    mask = torch.ones(2, length, dtype=torch.long)
    if left_pad:
        mask[1, :5] = 0
    else:
        mask[1, -4:] = 0
    weights = torch.randn(2, length, VOCAB, dtype=torch.float64, generator=gen)
    return ids, mask, weights


def loss_and_grads(model, ids, mask, weights, **kwargs):
    """A loss that weighs every logit differently (independent of the model's own loss code), and its gradients."""
    if isinstance(model, SinkhornForCausalLM):
        kwargs.setdefault("use_cache", False)
    logits = model(input_ids=ids, attention_mask=mask, **kwargs).logits  # [batch, seq, vocab]
    real = mask.bool()[..., None]
    loss = (logits.log_softmax(-1) * weights).masked_fill(~real, 0).sum()
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, logits


def graph_has(tensor: torch.Tensor, name: str) -> bool:
    seen, stack = set(), [tensor.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if name in type(node).__name__:
            return True
        stack.extend(parent for parent, _ in node.next_functions)
    return False


def assert_same(loss_a, grads_a, loss_b, grads_b):
    torch.testing.assert_close(loss_a, loss_b, rtol=1e-10, atol=1e-10)
    assert grads_a.keys() == grads_b.keys()
    assert len(grads_a) > 10
    for name in grads_a:
        torch.testing.assert_close(grads_a[name], grads_b[name], rtol=1e-7, atol=1e-9, msg=name)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "non-causal"])
def test_reversible_equals_ordinary_autograd_of_the_same_recurrence(causal, monkeypatch):
    cfg = config(causal, reversible=True)
    model = model_for(cfg)
    reference = copy_of(model, cfg)
    ids, mask, weights = inputs(left_pad=not causal)

    loss, grads, logits = loss_and_grads(model, ids, mask, weights)
    assert graph_has(logits, "ReversibleFunction")  # the memory-saving backward really ran
    with monkeypatch.context() as patch:
        patch.setattr(ReversibleSequence, "forward", naive_forward)
        ref_loss, ref_grads, ref_logits = loss_and_grads(reference, ids, mask, weights)
    assert not graph_has(ref_logits, "ReversibleFunction")
    assert_same(loss, grads, ref_loss, ref_grads)


def test_reversible_replays_dropout_and_layer_dropout(monkeypatch):
    cfg = config(True, reversible=True, attn_dropout=0.2, ff_dropout=0.3, attn_layer_dropout=0.1, layer_dropout=0.3)
    model = model_for(cfg)
    reference = copy_of(model, cfg)
    ids, mask, weights = inputs()

    torch.manual_seed(11)  # with this seed layer dropout skips the first layer, the product-key layer runs
    loss, grads, _ = loss_and_grads(model, ids, mask, weights)
    with monkeypatch.context() as patch:
        patch.setattr(ReversibleSequence, "forward", naive_forward)
        torch.manual_seed(11)
        ref_loss, ref_grads, _ = loss_and_grads(reference, ids, mask, weights)
    assert_same(loss, grads, ref_loss, ref_grads)


def test_reversible_passes_gradients_to_the_encoder_states(monkeypatch):
    cfg = config(True, reversible=True, receives_context=True, context_bucket_size=4, pkm_layers=[])
    torch.manual_seed(0)
    model = SinkhornModel(cfg).double().train()
    reference = copy_of(model, cfg)
    ids, mask, _ = inputs()
    gen = torch.Generator().manual_seed(4)
    context = torch.randn(2, 7, 16, dtype=torch.float64, generator=gen)
    context_mask = torch.ones(2, 7, dtype=torch.long)
    context_mask[0, -2:] = 0
    target = torch.randn(2, 19, 16, dtype=torch.float64, generator=gen)

    def run(m):
        encoder_states = context.clone().requires_grad_(True)
        hidden = m(
            input_ids=ids,
            attention_mask=mask,
            encoder_hidden_states=encoder_states,
            encoder_attention_mask=context_mask,
            use_cache=False,
        ).last_hidden_state
        loss = (hidden * target).sum()
        loss.backward()
        grads = {name: p.grad.clone() for name, p in m.named_parameters() if p.grad is not None}
        return loss.detach(), grads, encoder_states.grad

    loss, grads, context_grad = run(model)
    with monkeypatch.context() as patch:
        patch.setattr(ReversibleSequence, "forward", naive_forward)
        ref_loss, ref_grads, ref_context_grad = run(reference)
    assert_same(loss, grads, ref_loss, ref_grads)
    assert ref_context_grad.abs().sum() > 0
    torch.testing.assert_close(context_grad, ref_context_grad, rtol=1e-7, atol=1e-9)


def test_reversible_weights_load_into_the_residual_stack():
    # same parameter names with and without `reversible`: a checkpoint moves between the two layouts
    model = model_for(config(True, reversible=True))
    plain = model_for(config(True, reversible=False))
    plain.load_state_dict(model.state_dict(), strict=True)


@pytest.mark.parametrize(
    "causal, reversible",
    [(True, False), (True, True), (False, False)],
    ids=["causal", "causal-reversible", "non-causal"],
)
def test_chunked_feed_forward_equals_unchunked(causal, reversible):
    unchunked = model_for(config(causal, reversible=reversible, ff_chunks=1))
    chunked = copy_of(unchunked, config(causal, reversible=reversible, ff_chunks=3))
    ids, mask, weights = inputs()

    loss, grads, logits = loss_and_grads(unchunked, ids, mask, weights)
    chunk_loss, chunk_grads, chunk_logits = loss_and_grads(chunked, ids, mask, weights)
    torch.testing.assert_close(chunk_logits, logits, rtol=1e-10, atol=1e-10)
    assert_same(chunk_loss, chunk_grads, loss, grads)
