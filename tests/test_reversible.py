"""ReversibleSequence against a plain residual loop differentiated by ordinary autograd (float64)."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from longrange.reversible import ReversibleSequence

DIM = 6


class Block(nn.Module):
    """A small block with dropout and the kinds of keyword arguments a transformer layer receives."""

    def __init__(self, dropout: float = 0.0):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)
        self.context_proj = nn.Linear(DIM, DIM)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x, context=None, mask=None, scale=1.0, extra=()):
        h = torch.tanh(self.proj(x))  # [batch, seq, dim]
        if context is not None:
            h = h + self.context_proj(context).mean(dim=1, keepdim=True)
        for t in extra:  # tensors nested in a tuple
            h = h * t
        h = self.dropout(h) * scale
        if mask is not None:
            h = h * mask[..., None]
        return h


def naive(pairs, x1, x2, f_kwargs=None, g_kwargs=None, skip=None):
    """The reversible recurrence written as a plain loop; autograd stores every activation."""
    f_kwargs, g_kwargs = f_kwargs or {}, g_kwargs or {}
    for i, (f, g) in enumerate(pairs):
        if skip is not None and skip[i]:
            continue
        x1 = x1 + f(x2, **f_kwargs)
        x2 = x2 + g(x1, **g_kwargs)
    return x1, x2


def make_pairs(n, dropout=0.0):
    torch.manual_seed(1)
    return [(Block(dropout).double(), Block(dropout).double()) for _ in range(n)]


def make_inputs(seed=2):
    gen = torch.Generator().manual_seed(seed)
    x1 = torch.randn(2, 5, DIM, dtype=torch.float64, generator=gen, requires_grad=True)
    x2 = torch.randn(2, 5, DIM, dtype=torch.float64, generator=gen, requires_grad=True)
    context = torch.randn(2, 3, DIM, dtype=torch.float64, generator=gen, requires_grad=True)
    gate = torch.randn(DIM, dtype=torch.float64, generator=gen, requires_grad=True)
    mask = (torch.rand(2, 5, generator=gen) > 0.3).double()
    return x1, x2, context, gate, mask


def loss_of(y1, y2):
    # weights so that both outputs and every position matter differently
    w = torch.linspace(-1, 2, y1.numel(), dtype=y1.dtype).view_as(y1)
    return (y1 * w).sum() + (y2 * y2).sum()


def grads_of(loss, tensors):
    return torch.autograd.grad(loss, tensors, allow_unused=True)


def assert_close_all(actual, expected):
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        if e is None:
            assert a is None
        else:
            torch.testing.assert_close(a, e, rtol=1e-9, atol=1e-10)


def params_of(pairs):
    seen, out = set(), []
    for f, g in pairs:
        for p in list(f.parameters()) + list(g.parameters()):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def test_outputs_and_gradients_equal_plain_loop_with_kwargs():
    pairs = make_pairs(3)
    x1, x2, context, gate, mask = make_inputs()
    # f cross-attends (context requires grad), g gets a mask (no grad), a float and a tuple with a grad tensor
    f_kwargs = {"context": context, "scale": 0.7}
    g_kwargs = {"mask": mask, "extra": (gate,)}
    wrt = [x1, x2, context, gate, *params_of(pairs)]

    ref = naive(pairs, x1, x2, f_kwargs, g_kwargs)
    ref_grads = grads_of(loss_of(*ref), wrt)
    out = ReversibleSequence(pairs)(x1, x2, f_kwargs=f_kwargs, g_kwargs=g_kwargs)
    assert out[0].grad_fn is not None
    out_grads = grads_of(loss_of(*out), wrt)

    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1], ref[1], rtol=0, atol=0)
    assert all(g is not None for g in ref_grads[:4])  # inputs and both kwargs tensors that require grad
    assert_close_all(out_grads, ref_grads)


def test_dropout_is_replayed_in_backward():
    pairs = make_pairs(3, dropout=0.5)
    x1, x2, context, _, _ = make_inputs()
    f_kwargs = {"context": context}
    wrt = [x1, x2, context, *params_of(pairs)]

    torch.manual_seed(123)
    ref = naive(pairs, x1, x2, f_kwargs)
    ref_grads = grads_of(loss_of(*ref), wrt)
    after_ref = torch.rand(3)

    torch.manual_seed(123)
    out = ReversibleSequence(pairs)(x1, x2, f_kwargs=f_kwargs)
    out_grads = grads_of(loss_of(*out), wrt)
    # the backward's replay must leave the caller's RNG stream where the forward left it
    after_out = torch.rand(3)

    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1], ref[1], rtol=0, atol=0)
    assert_close_all(out_grads, ref_grads)
    torch.testing.assert_close(after_out, after_ref, rtol=0, atol=0)

    # sanity: with a different mask in the "backward" the gradients would differ, so the replay is what matters
    torch.manual_seed(124)
    other_grads = grads_of(loss_of(*naive(pairs, x1, x2, f_kwargs)), wrt)
    assert not torch.allclose(other_grads[0], ref_grads[0])


def test_skipped_blocks_are_identity():
    pairs = make_pairs(4)
    x1, x2, *_ = make_inputs()
    skip = [False, True, False, True]
    wrt = [x1, x2, *params_of(pairs)]

    ref = naive(pairs, x1, x2, skip=skip)
    ref_grads = grads_of(loss_of(*ref), wrt)
    out = ReversibleSequence(pairs)(x1, x2, skip=skip)
    out_grads = grads_of(loss_of(*out), wrt)

    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=0)
    assert_close_all(out_grads, ref_grads)
    # parameters of skipped blocks get no gradient at all, as with ordinary autograd
    skipped_weight = pairs[1][0].proj.weight
    assert out_grads[next(i for i, t in enumerate(wrt) if t is skipped_weight)] is None

    with pytest.raises(ValueError, match="skip"):
        ReversibleSequence(pairs)(x1, x2, skip=[False])


def test_tied_blocks_accumulate_gradients():
    shared = make_pairs(1)[0]
    other = make_pairs(2)[1]
    pairs = [shared, other, shared, shared]
    x1, x2, context, _, _ = make_inputs()
    f_kwargs = {"context": context}
    wrt = [x1, x2, context, *params_of(pairs)]

    ref_grads = grads_of(loss_of(*naive(pairs, x1, x2, f_kwargs)), wrt)
    stack = ReversibleSequence(pairs)
    assert len(list(stack.parameters())) == len(params_of(pairs))
    out_grads = grads_of(loss_of(*stack(x1, x2, f_kwargs=f_kwargs)), wrt)
    assert_close_all(out_grads, ref_grads)


def test_backward_into_grad_fields_accumulates_and_respects_frozen_parameters():
    pairs = make_pairs(2)
    pairs[0][1].proj.weight.requires_grad_(False)
    x1, x2, *_ = make_inputs()
    params = params_of(pairs)

    loss_of(*naive(pairs, x1, x2)).backward()
    expected = [None if p.grad is None else p.grad.clone() for p in params]
    expected_x1 = x1.grad.clone()
    for p in params:
        p.grad = None
    x1.grad = None

    stack = ReversibleSequence(pairs)
    for _ in range(2):  # gradient accumulation over two micro-batches
        loss_of(*stack(x1, x2)).backward()
    assert pairs[0][1].proj.weight.grad is None
    for p, e in zip(params, expected):
        if e is None:
            assert p.grad is None
        else:
            torch.testing.assert_close(p.grad, 2 * e, rtol=1e-9, atol=1e-10)
    torch.testing.assert_close(x1.grad, 2 * expected_x1, rtol=1e-9, atol=1e-10)


def test_no_grad_path_is_a_plain_loop():
    pairs = make_pairs(3)
    x1, x2, context, _, _ = make_inputs()
    with torch.no_grad():
        ref = naive(pairs, x1, x2, {"context": context})
        out = ReversibleSequence(pairs)(x1, x2, f_kwargs={"context": context})
    assert out[0].grad_fn is None and out[1].grad_fn is None
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=0)
    torch.testing.assert_close(out[1], ref[1], rtol=0, atol=0)


def count_saved(fn):
    """Number of tensors autograd saves for backward while running `fn`, and their total elements."""
    count, numel = 0, 0

    def pack(t):
        nonlocal count, numel
        count += 1
        numel += t.numel()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return count, numel


def test_activations_are_not_stored_per_layer():
    x1, x2, *_ = make_inputs()
    saved = {}
    for depth in (2, 8):
        pairs = make_pairs(depth)
        saved["naive", depth] = count_saved(lambda pairs=pairs: naive(pairs, x1, x2))
        saved["rev", depth] = count_saved(lambda pairs=pairs: ReversibleSequence(pairs)(x1, x2))
    # the plain loop saves activations for every layer; the counting sees them
    assert saved["naive", 8][0] > 3 * saved["naive", 2][0]
    # the reversible stack saves the same, constant, set whatever the depth: its two outputs
    assert saved["rev", 8] == saved["rev", 2]
    assert saved["rev", 8][0] == 2
    assert saved["rev", 8][1] == x1.numel() + x2.numel()


def test_gradients_flow_through_distributed_data_parallel(tmp_path):
    """DDP's gradient hooks see every parameter gradient (they are returned through autograd, not written aside)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed not available")
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rendezvous", rank=0, world_size=1)
    try:
        pairs = make_pairs(2)
        x1, x2, context, _, _ = make_inputs()
        kwargs = {"context": context}  # every parameter is used, so DDP's reducer expects every gradient
        ref_grads = grads_of(loss_of(*naive(pairs, x1, x2, kwargs, kwargs)), params_of(pairs))

        class Wrapper(nn.Module):
            def __init__(self):
                super().__init__()
                self.stack = ReversibleSequence(pairs)

            def forward(self, a, b):
                return self.stack(a, b, f_kwargs=kwargs, g_kwargs=kwargs)

        model = nn.parallel.DistributedDataParallel(Wrapper())
        loss_of(*model(x1, x2)).backward()
        assert_close_all([p.grad for p in params_of(pairs)], ref_grads)
    finally:
        dist.destroy_process_group()
