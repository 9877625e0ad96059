"""The shared attention kernels (`attend`, the blockwise kernel) against a naive softmax(QK^T + bias) V written
here, in float64."""

import pytest
import torch

from longrange.layers import attend, blockwise_attention


def naive_attention(query, key, value, mask, scale, position_query=None, relative=None, keep=None, dropout=0.0):
    """Dense attention, one relative distance looked up per (query, key) pair; rows that see nothing give zeros."""
    q_len, k_len = query.shape[2], key.shape[2]
    scores = query @ key.transpose(-1, -2)
    if relative is not None:
        # distance of (i, j) is (k_len - q_len + i) - j; relative[..., c] encodes distance k_len - 1 - c
        rows = torch.arange(q_len)[:, None]
        cols = torch.arange(k_len)[None, :]
        distance = (k_len - q_len + rows - cols).clamp_min(0)
        by_distance = position_query @ relative  # [B, H, q, K] over columns c
        scores = scores + by_distance.gather(-1, (k_len - 1 - distance).expand_as(by_distance))
    scores = (scores * scale).masked_fill(~mask, float("-inf"))
    weights = scores.softmax(-1).nan_to_num(0.0)
    if keep is not None:
        weights = weights * keep / (1 - dropout)
    return weights @ value


def inputs(causal, seed=0, batch=2, heads=3, q_len=7, k_len=12, d_head=5):
    generator = torch.Generator().manual_seed(seed)
    tensors = [
        torch.randn(batch, heads, length, d_head, generator=generator, dtype=torch.float64, requires_grad=True)
        for length in (q_len, k_len, k_len, q_len)
    ]
    relative = torch.randn(heads, d_head, k_len, generator=generator, dtype=torch.float64, requires_grad=True)
    valid = torch.rand(batch, k_len, generator=generator) > 0.2
    valid[1] = False
    valid[1, -2] = True  # batch row 1: its first query rows see no key at all
    allowed = torch.ones(q_len, k_len, dtype=torch.bool)
    mask = valid[:, None, None, :] & (allowed.tril(k_len - q_len) if causal else allowed)
    return tensors, relative, mask


@pytest.mark.parametrize("block_elements", [1 << 20, 300, 1])  # one block, a few, one row per block
@pytest.mark.parametrize("causal, with_relative", [(True, True), (True, False), (False, False)])
def test_blockwise_attention_matches_naive_values_and_gradients(block_elements, causal, with_relative):
    (query, key, value, position_query), relative, mask = inputs(causal)
    extra = dict(position_query=position_query, relative=relative) if with_relative else {}
    out = blockwise_attention(query, key, value, mask, 0.3, causal=causal, block_elements=block_elements, **extra)
    expected = naive_attention(query, key, value, mask, 0.3, **extra)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    if causal:
        assert out[1, :, 0].abs().max() == 0  # a row that sees no key outputs zeros, not NaN
    upstream = torch.randn_like(out)
    leaves = [query, key, value] + ([position_query, relative] if with_relative else [])
    grads = torch.autograd.grad((out * upstream).sum(), leaves)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), leaves)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("bias_shape", ["full", "broadcast", "none"])  # full: eager adds it inside the product
def test_attend_matches_naive_values_and_gradients(implementation, bias_shape):
    (query, key, value, _), _, mask = inputs(causal=True)
    generator = torch.Generator().manual_seed(1)
    shape = {"full": (2, 3, 7, 12), "broadcast": (2, 1, 1, 12), "none": None}[bias_shape]
    bias = None if shape is None else torch.randn(shape, generator=generator, dtype=torch.float64, requires_grad=True)
    out = attend(query, key, value, mask=mask, bias=bias, implementation=implementation, scale=0.3)
    scores = (query @ key.transpose(-1, -2)) * 0.3 + (0.0 if bias is None else bias)
    weights = scores.masked_fill(~mask, float("-inf")).softmax(-1).nan_to_num(0.0)
    expected = weights @ value
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    assert out[1, :, 0].abs().max() == 0  # a row that sees no key outputs zeros
    upstream = torch.randn_like(out)
    leaves = [query, key, value] + ([bias] if bias is not None else [])
    grads = torch.autograd.grad((out * upstream).sum(), leaves)
    for got, want in zip(grads, torch.autograd.grad((expected * upstream).sum(), leaves)):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_blockwise_attention_dropout_uses_one_mask_for_values_and_gradients():
    (query, key, value, position_query), relative, mask = inputs(True)
    extra = dict(position_query=position_query, relative=relative)
    torch.manual_seed(3)
    out = blockwise_attention(query, key, value, mask, 0.3, dropout=0.25, causal=True, **extra)
    torch.manual_seed(3)  # one block: the kernel draws one [batch * heads, q, K] uniform tensor
    keep = (torch.rand(2 * 3, 7, 12, dtype=torch.float64) >= 0.25).view(2, 3, 7, 12)
    expected = naive_attention(query, key, value, mask, 0.3, keep=keep, dropout=0.25, **extra)
    torch.testing.assert_close(out, expected, atol=1e-12, rtol=0)
    upstream = torch.randn_like(out)
    leaves = [query, key, value, position_query, relative]
    for got, want in zip(
        torch.autograd.grad((out * upstream).sum(), leaves), torch.autograd.grad((expected * upstream).sum(), leaves)
    ):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_blockwise_attention_in_bfloat16_autocast_stays_close_and_finite():
    (query, key, value, position_query), relative, mask = inputs(True)
    leaves = [t.detach().float().requires_grad_() for t in (query, key, value, position_query, relative)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = blockwise_attention(*leaves[:3], mask, 0.3, causal=True, position_query=leaves[3], relative=leaves[4])
    out.float().sum().backward()
    expected = naive_attention(*(t.detach() for t in leaves[:3]), mask, 0.3, leaves[3].detach(), leaves[4].detach())
    assert torch.isfinite(out).all() and all(torch.isfinite(t.grad).all() for t in leaves)
    torch.testing.assert_close(out.float(), expected, atol=0.1, rtol=0.05)


def test_relative_term_requires_causal():
    (query, key, value, position_query), relative, mask = inputs(False)
    with pytest.raises(ValueError, match="causal=True"):
        blockwise_attention(query, key, value, mask, 0.3, position_query=position_query, relative=relative)


@pytest.mark.parametrize("glu", [False, True])
def test_feed_forward_over_row_blocks_equals_one_pass(glu):
    from longrange.layers import FeedForward

    torch.manual_seed(0)
    ff = FeedForward(8, 16, glu=glu).double()
    x = torch.randn(3, 7, 8, dtype=torch.float64, requires_grad=True)
    whole = ff(x)
    ff.block_elements = 5 * ff.up.out_features  # 5 rows per block: 21 rows -> 5 blocks, the last one short
    calls = []
    rows = ff._rows
    ff._rows = lambda part: calls.append(part.shape[0]) or rows(part)
    blocked = ff(x)
    assert calls == [5, 5, 5, 5, 1]
    torch.testing.assert_close(blocked, whole, atol=1e-12, rtol=0)
    upstream = torch.randn_like(whole)
    leaves = [x, *ff.parameters()]
    for got, want in zip(
        torch.autograd.grad((blocked * upstream).sum(), leaves), torch.autograd.grad((whole * upstream).sum(), leaves)
    ):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_real_tokens_first_keeps_each_rows_real_tokens_in_order_then_its_padding():
    from longrange.layers import real_tokens_first

    valid = torch.tensor([[0, 0, 1, 1, 0, 1], [1, 1, 1, 1, 1, 1], [0, 1, 0, 1, 0, 0]], dtype=torch.bool)
    expected = [[i for i, v in enumerate(row) if v] + [i for i, v in enumerate(row) if not v] for row in valid.tolist()]
    assert real_tokens_first(valid).tolist() == expected


@pytest.mark.parametrize(
    "shape, dim", [((3, 9), 1), ((3, 9, 4), 1), ((3, 2, 9, 4), 2), ((3, 2, 9), 2), ((3, 2, 1, 9), 3)]
)
@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("accumulate", [False, True])
def test_put_along_writes_each_rows_slots_and_nothing_else(shape, dim, compiled, accumulate):
    from longrange.layers import put_along

    generator = torch.Generator().manual_seed(0)
    buffer = torch.randn(shape, generator=generator)
    index = torch.tensor([[4, 0], [8, 2], [1, 7]])  # [batch, n]: distinct slots per row
    values = torch.randn(*shape[:dim], 2, *shape[dim + 1 :], generator=generator)
    expected = buffer.clone()
    for row in range(shape[0]):  # the writes one by one
        for j, slot in enumerate(index[row].tolist()):
            target = (row,) + (slice(None),) * (dim - 1) + (slot,)
            source = (row,) + (slice(None),) * (dim - 1) + (j,)
            expected[target] = expected[target] + values[source] if accumulate else values[source]
    torch._dynamo.reset()  # (each case compiles anew: no recompile limit across the cases)
    write = torch.compile(put_along, fullgraph=True, backend="aot_eager") if compiled else put_along
    write(buffer, dim, index, values, accumulate=accumulate)
    assert torch.equal(buffer, expected)
    with pytest.raises(ValueError, match="dim must be between 1 and"):
        put_along(buffer, len(shape), index, values)
