"""Sinkhorn `output_attentions=True`: the returned maps and routing checked against computations written here.

Each layer's self-attention input and output are captured with forward hooks; from the returned map the test
recomputes every head's output as map @ values (+ the null buckets' share, from the learned null values), projects
it and compares it with the captured output. The map must also be zero on future tokens (causal) and outside the
buckets the routing says were attended, each chosen bucket must receive weight, and without routed-value weights
the rows (with the null mass) sum to one.
"""

from __future__ import annotations

import pytest
import torch

from longrange import SinkhornConfig, SinkhornForCausalLM, SinkhornForMaskedLM
from longrange.sinkhorn_attention import SinkhornSelfAttention

VOCAB, HIDDEN, HEADS, BUCKET = 37, 32, 4, 4

CASES = {
    # causal: ordinary and shifted heads in one pass (equal counts), routed values weighted, left padding
    "causal": dict(causal=True),
    # causal: a local head, then one ordinary and two shifted heads run one group at a time; plain routing
    "causal_local_unweighted": dict(causal=True, n_local_attn_heads=1, weight_routed_values=False),
    # causal, reversible stack (output_attentions runs it as the plain two-stream loop), keys weighted too
    "causal_reversible": dict(causal=True, reversible=True, weight_routed_keys=True),
    # non-causal with local heads and attention dropout in training mode (the map includes the dropout)
    "bidirectional_local_dropout": dict(causal=False, n_local_attn_heads=2, attn_dropout=0.2),
    # non-causal SortCut, plain routing
    "sortcut": dict(causal=False, n_sortcut=2, weight_routed_values=False),
    # non-causal, Sinkhorn balancing, a bucket may route to itself (its tokens are then keys twice)
    "sinkhorn_own_bucket": dict(causal=False, non_permutative=False, route_own_bucket=True),
}


def build(case: str, implementation: str):
    options = CASES[case]
    config = SinkhornConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=HEADS, bucket_size=BUCKET,
        n_top_buckets=2, max_position_embeddings=64, attn_implementation=implementation, **options,
    )  # fmt: skip
    torch.manual_seed(0)
    cls = SinkhornForCausalLM if options["causal"] else SinkhornForMaskedLM
    model = cls(config).double()
    return model.train() if options.get("attn_dropout") else model.eval()


def inputs(causal: bool):
    torch.manual_seed(1)
    ids = torch.randint(1, VOCAB, (2, 23))
    mask = torch.ones_like(ids)
    if causal:
        mask[1, :5] = 0  # left padding
    else:
        mask[1, 18:] = 0  # right padding
    return ids, mask


def null_values(attention: SinkhornSelfAttention) -> torch.Tensor:
    """[heads, n_null, d]: each head's learned null values (zeros for heads without null buckets)."""
    parts = []
    for group in attention.groups:
        if hasattr(group, "null_values"):
            parts.append(group.null_values.detach())
        else:
            parts.append(torch.zeros(group.num_heads, attention.groups[-1].n_top, attention.head_dim).double())
    return torch.cat(parts)


def layer_order(mask: torch.Tensor) -> torch.Tensor:
    """[b, L]: the token order the layers see (each row's real tokens first, in order: buckets start at a row's
    first real token); the returned maps are in the order of the given tokens."""
    return torch.sort((~mask.bool()).to(torch.uint8), dim=1, stable=True).indices


def reorder_queries(t: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """t [b, h, L, K] with its query tokens in `order` [b, L]."""
    return t.gather(2, order[:, None, :, None].expand(-1, t.shape[1], -1, t.shape[3]))


def allowed_keys(config, routing, batch: int, length: int) -> torch.Tensor:
    """[heads, length, length] bool: the keys each query may attend given the returned routing, by definition:
    local heads their windows; Sinkhorn heads their own bucket (causal: up to themselves) and the chosen buckets."""
    size = config.bucket_size
    allowed = torch.zeros(config.num_attention_heads, length, length, dtype=torch.bool)
    for head in range(config.num_attention_heads):
        off = int(routing.offsets[head])
        for i in range(length):
            if head < config.n_local_attn_heads:
                u = i // size
                last = u + 1 if config.causal else u + 2
                lo, hi = max(u - 1, 0) * size, min(last * size, length)
                allowed[head, i, lo:hi] = True
            else:
                u = (i + off) // size
                start = u * size - off
                allowed[head, i, max(start, 0) : min(start + size, length)] = True
                for j in routing.key_buckets[batch, head, u].tolist():
                    if j >= 0:
                        allowed[head, i, max(j * size - off, 0) : min(j * size - off + size, length)] = True
            if config.causal:
                allowed[head, i, i + 1 :] = False
    return allowed


@pytest.mark.parametrize("implementation", ["eager", "sdpa"])
@pytest.mark.parametrize("case", list(CASES))
def test_attention_maps_reproduce_the_attention_output_and_follow_the_routing(case, implementation):
    model = build(case, implementation)
    config = model.config
    ids, mask = inputs(config.causal)
    length = ids.shape[1]
    captured = []
    hooks = [
        layer.attention.attention.register_forward_hook(lambda m, args, out: captured.append((args[0], out)))
        for layer in model.model.layers
    ]
    torch.manual_seed(2)
    out = model(ids, attention_mask=mask, output_attentions=True)
    for hook in hooks:
        hook.remove()
    assert len(out.attentions) == len(out.routing) == config.num_hidden_layers == len(captured)
    if not model.training:  # the weights' slow path gives the numbers of the ordinary forward
        torch.testing.assert_close(out.logits, model(ids, attention_mask=mask).logits, rtol=1e-9, atol=1e-9)
    # checked in the order the layers see the tokens (the hooks capture that order; the routing is in it)
    order = layer_order(mask)
    real = mask.bool().gather(1, order)
    for layer, (weights, routing, (x, y)) in enumerate(zip(out.attentions, out.routing, captured)):
        weights = reorder_queries(weights, order).gather(3, order[:, None, None, :].expand(-1, HEADS, length, -1))
        null = None if routing.null_attention is None else reorder_queries(routing.null_attention, order)
        attention = model.model.layers[layer].attention.attention
        assert weights.shape == (2, HEADS, length, length)
        # output = map @ V (+ null mass @ null values), per head, then the output projection
        v = attention.to_kv(x).chunk(2, dim=-1)[1][:, :length]
        v = v.view(2, length, HEADS, -1).transpose(1, 2)  # [b, H, L, d]
        heads_out = weights @ v
        if config.causal:
            assert null.shape == (2, HEADS, length, config.n_top_buckets)
            heads_out = heads_out + torch.einsum("bhln,hnd->bhld", null, null_values(attention))
        else:
            assert null is None
        expected = attention.to_out(heads_out.transpose(1, 2).reshape(2, length, -1))
        torch.testing.assert_close(expected[real], y[:, :length][real], rtol=1e-9, atol=1e-9)

        assert (weights >= 0).all()
        if config.causal:
            assert weights.triu(1).abs().max() == 0  # no weight on future tokens
        if not config.weight_routed_values:  # rows sum to one over the real keys and the null keys
            total = weights.sum(-1) + (null.sum(-1) if config.causal else 0)
            torch.testing.assert_close(total.transpose(1, 2)[real], torch.ones(int(real.sum()), HEADS).double())
        for row in range(2):
            allowed = allowed_keys(config, routing, row, length) & real[row][None, None, :]
            outside = weights[row].masked_fill(allowed, 0)[:, real[row]]  # (padded queries are not checked)
            assert outside.abs().max() == 0  # nothing outside the attended buckets
            # every bucket the routing reports chosen (with a weight) receives weight from its query bucket's queries
            for head in range(config.n_local_attn_heads, HEADS):
                off = int(routing.offsets[head])
                for u, picks in enumerate(routing.key_buckets[row, head].tolist()):
                    queries = [i for i in range(length) if (i + off) // BUCKET == u and real[row, i]]
                    for pick, w in zip(picks, routing.weights[row, head, u].tolist()):
                        if pick < 0 or not queries or w == 0:
                            continue
                        if config.causal:
                            assert pick < u  # strictly earlier buckets only
                        keys = [t for t in range(pick * BUCKET - off, pick * BUCKET - off + BUCKET) if 0 <= t < length]
                        assert weights[row, head][queries][:, keys].sum() > 0


def test_routing_matrix_counts_each_chosen_bucket():
    model = build("causal", "sdpa")
    ids, mask = inputs(True)
    routing = model(ids, attention_mask=mask, output_attentions=True).routing[1]
    matrix = routing.matrix()
    b, h, rows, picks = routing.key_buckets.shape
    assert matrix.shape == (b, h, rows, rows)
    expected = torch.zeros(b, h, rows, rows, dtype=routing.weights.dtype)
    for i in range(b):
        for j in range(h):
            for u in range(rows):
                for p in range(picks):
                    key = int(routing.key_buckets[i, j, u, p])
                    if key >= 0:
                        expected[i, j, u, key] += routing.weights[i, j, u, p]
    torch.testing.assert_close(matrix, expected)
    assert (routing.key_buckets >= 0).any()  # some real bucket was chosen
    assert routing.offsets.tolist() == [0, 0, 1, 1]  # ordinary heads, then the shifted ones


def test_cache_filling_forward_returns_the_weights_and_cached_steps_return_their_rows():
    model = build("causal", "sdpa")
    ids, mask = inputs(True)
    plain = model(ids, attention_mask=mask, output_attentions=True, use_cache=False)
    filled = model(ids, attention_mask=mask, output_attentions=True, use_cache=True)
    for a, b in zip(plain.attentions, filled.attentions):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    # a cached step's maps: its own row over every token so far, as a forward over the whole sequence gives it
    step = torch.tensor([[3], [4]])
    stepped = model(step, cache=filled.cache, output_attentions=True)
    whole = model(
        torch.cat([ids, step], 1), attention_mask=torch.cat([mask, torch.ones_like(step)], 1).bool(),
        output_attentions=True, use_cache=False,
    )  # fmt: skip
    for a, b in zip(stepped.attentions, whole.attentions):
        assert a.shape == (2, HEADS, 1, ids.shape[1] + 1)
        torch.testing.assert_close(a, b[:, :, -1:], rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_cross_attentions_reproduce_the_cross_attention_output(causal):
    config = SinkhornConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=HEADS, bucket_size=BUCKET,
        n_top_buckets=2, max_position_embeddings=64, causal=causal, receives_context=True, context_bucket_size=3,
    )  # fmt: skip
    torch.manual_seed(0)
    model = (SinkhornForCausalLM if causal else SinkhornForMaskedLM)(config).double().eval()
    ids, mask = inputs(causal)
    context = torch.randn(2, 10, HIDDEN, dtype=torch.float64)
    context_mask = torch.ones(2, 10, dtype=torch.long)
    context_mask[0, 7:] = 0
    captured = []
    cross = model.model.layers[0].cross_attention.attention
    hook = cross.register_forward_hook(lambda m, args, out: captured.append((args[2], out)))
    out = model(
        ids, attention_mask=mask, encoder_hidden_states=context, encoder_attention_mask=context_mask,
        output_attentions=True,
    )  # fmt: skip
    hook.remove()
    weights = out.cross_attentions[0]
    assert weights.shape == (2, HEADS, ids.shape[1], 10)
    padded_context, y = captured[0]
    v = cross.to_kv(padded_context).chunk(2, dim=-1)[1][:, :10].view(2, 10, HEADS, -1).transpose(1, 2)
    order = layer_order(mask)  # the hook sees each row's real tokens first
    expected = cross.to_out((reorder_queries(weights, order) @ v).transpose(1, 2).reshape(2, ids.shape[1], -1))
    real = mask.bool().gather(1, order)
    torch.testing.assert_close(expected[real], y[:, : ids.shape[1]][real], rtol=1e-9, atol=1e-9)
    assert weights[0, :, :, 7:].abs().max() == 0  # no weight on padded context
