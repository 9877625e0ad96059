"""weight_routed_values (default True): the chosen buckets' values are scaled by their routing weight, in every
code path; False gives plain attention over the chosen buckets."""

import math

import pytest
import torch

from longrange import SinkhornConfig, SinkhornForCausalLM, SinkhornForMaskedLM
from longrange.sinkhorn_heads import CausalContextHeads, CausalSinkhornHeads, SinkhornHeads

TINY = dict(vocab_size=40, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, bucket_size=4)


def test_weighted_routing_changes_outputs_and_generation_cache_matches_recompute():
    torch.manual_seed(3)
    config = SinkhornConfig(
        **TINY,
        causal=True,
        receives_context=True,
        context_bucket_size=4,
        n_local_attn_heads=1,
        n_top_buckets=1,
        weight_routed_values=False,
    )
    plain = SinkhornForCausalLM(config).eval()
    config_w = SinkhornConfig(**{**config.to_dict(), "weight_routed_values": True})
    model = SinkhornForCausalLM(config_w).eval()
    model.load_state_dict(plain.state_dict())
    ids, context = torch.randint(0, 40, (2, 27)), torch.randn(2, 14, 24)
    kw = dict(encoder_hidden_states=context)
    with torch.no_grad():
        full = model(ids, use_cache=False, **kw).logits
        # a routing weight below 1 on the chosen buckets (one candidate among several) changes the result
        assert (full - plain(ids, use_cache=False, **kw).logits).abs().max() > 1e-4
        out = model(ids[:, :6], use_cache=True, **kw)  # prefill: weights recorded by the full pass
        logits = [out.logits]
        for t in range(6, 27):  # then token by token: weights from the cached routing state
            out = model(ids[:, t : t + 1], cache=out.cache, use_cache=True, **kw)
            logits.append(out.logits)
    torch.testing.assert_close(torch.cat(logits, 1), full, rtol=1e-5, atol=1e-5)


def test_weighted_routing_non_causal_paths():
    torch.manual_seed(4)
    ids = torch.randint(0, 40, (2, 16))
    for extra in (dict(), dict(non_permutative=False), dict(n_sortcut=1)):
        plain = SinkhornForMaskedLM(SinkhornConfig(**TINY, n_top_buckets=1, weight_routed_values=False, **extra))
        plain.eval()
        model = SinkhornForMaskedLM(SinkhornConfig(**TINY, weight_routed_values=True, n_top_buckets=1, **extra))
        model.load_state_dict(plain.state_dict())
        with torch.no_grad():
            difference = (model.eval()(ids).logits - plain(ids).logits).abs().max()
        assert difference > 1e-4, extra
        model.train()
        loss = model(ids, labels=ids).loss
        loss.backward()
        assert torch.isfinite(loss), extra


# --- the weighted path against naive references written here --------------------------------------------------
# The routing weights are re-derived from their definition (bucket means, softmax at the sort temperature or
# Sinkhorn balancing) in float64 and applied in a plain per-bucket / per-token loop:
#     softmax(q . [k_routed, k_own]^T / sqrt(d) + masks) @ [w * v_routed, v_own]
# The layer routes in float32, hence tolerances of 1e-6 rather than 1e-10.


def naive_non_causal_weighted(q, k, v, mask, size, n_top, temperature, sinkhorn_iter=None, weighted=True):
    """q, k, v: [h, L, d] (one batch row); mask: [L]. Returns [h, L, d] (padded query rows left zero)."""
    h, length, d = q.shape
    n = length // size
    out = torch.zeros_like(q)
    buckets = [[t for t in range(u * size, (u + 1) * size) if mask[t]] for u in range(n)]
    for head in range(h):
        sq = torch.stack([q[head, p].mean(0) if p else torch.zeros(d, dtype=q.dtype) for p in buckets])
        sk = torch.stack([k[head, p].mean(0) if p else torch.zeros(d, dtype=q.dtype) for p in buckets])
        scores = sq @ sk.T / math.sqrt(d)  # [n, n]
        # a query bucket of padding alone takes no part in the balancing (its row stays zero)
        allowed = torch.tensor([[j != u and bool(buckets[j]) and bool(buckets[u]) for j in range(n)] for u in range(n)])
        weights = torch.exp(scores / temperature) * allowed
        if sinkhorn_iter is None:
            weights = weights / weights.sum(1, keepdim=True)
        else:
            for _ in range(sinkhorn_iter):
                rows = weights.sum(1, keepdim=True)
                weights = weights / torch.where(rows > 0, rows, torch.ones_like(rows))
                columns = weights.sum(0, keepdim=True)
                weights = weights / torch.where(columns > 0, columns, torch.ones_like(columns))
        for u in range(n):
            chosen = sorted(range(n), key=lambda j: -float(weights[u, j]))[:n_top]
            keys = torch.cat(
                [k[head, j * size : (j + 1) * size] for j in chosen] + [k[head, u * size : (u + 1) * size]]
            )
            values = torch.cat(
                [(weights[u, j] if weighted else 1.0) * v[head, j * size : (j + 1) * size] for j in chosen]
                + [v[head, u * size : (u + 1) * size]]
            )
            key_real = torch.cat([mask[j * size : (j + 1) * size] for j in chosen] + [mask[u * size : (u + 1) * size]])
            for p in buckets[u]:
                logits = (keys @ q[head, p] / math.sqrt(d)).masked_fill(~key_real, float("-inf"))
                out[head, p] = logits.softmax(-1) @ values
    return out


SIZE, BUCKETS, TEMPERATURE = 4, 5, 0.75


def run_non_causal_heads(seed, n_top=1, n_sortcut=0, sinkhorn_iter=None):
    """Weighted non-causal heads (2 rows, 2 heads, 5 buckets of 4) over float64 inputs with right padding (bucket 2
    half real, buckets 3 and 4 empty, never chosen) and a hole in bucket 1. Returns q, k, v, mask and the output."""
    torch.manual_seed(seed)
    b, h, d, length = 2, 2, 6, SIZE * BUCKETS
    heads = SinkhornHeads(
        h, d, SIZE, SIZE, n_top, n_sortcut, True, False, BUCKETS, sinkhorn_iter is None, sinkhorn_iter or 1,
        TEMPERATURE, 0.0, "sdpa", weight_routed_values=True,
    ).eval()  # fmt: skip
    q, k, v = (torch.randn(b, h, length, d, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(b, length, dtype=torch.bool)
    mask[1, 10:] = False
    mask[0, 5] = False
    with torch.no_grad():
        return q, k, v, mask, heads(q, k, v, mask)


@pytest.mark.parametrize("n_top,sinkhorn_iter", [(1, None), (2, None), (2, 3)])
def test_non_causal_weighted_routing_matches_naive_bucket_loop(n_top, sinkhorn_iter):
    q, k, v, mask, out = run_non_causal_heads(5, n_top=n_top, sinkhorn_iter=sinkhorn_iter)
    for i in range(len(mask)):
        real = mask[i]
        args = (q[i], k[i], v[i], mask[i], SIZE, n_top, TEMPERATURE, sinkhorn_iter)
        torch.testing.assert_close(out[i][:, real], naive_non_causal_weighted(*args)[:, real], rtol=1e-6, atol=1e-6)
        # the weights matter: unweighted routing is far from the output (so this test can fail)
        plain = naive_non_causal_weighted(*args, weighted=False)
        assert (out[i][:, real] - plain[:, real]).abs().max() > 1e-2


def naive_causal_weighted(heads, q, k, v, mask, weighted=True):
    """The causal routing rule re-derived token by token, chosen values scaled by their routing weight (the
    softmax at the sort temperature over the null buckets and the earlier non-empty key buckets).
    q, k, v: [h, L, d] (one batch row); mask: [L]."""
    h, length, d = q.shape
    size, off, n_top, temperature = heads.bucket_size, heads.offset, heads.n_top, heads.temperature
    out = torch.zeros_like(q)
    for p in range(length):
        if not mask[p]:
            continue
        u = (p + off) // size
        lead = u * size - off  # -1: the virtual leading token of the shifted heads' first bucket
        for head in range(h):
            before = [t for t in range(0, lead + 1) if mask[t]]
            sq = q[head, before].mean(0) if before else torch.zeros(d, dtype=q.dtype)
            candidates = []  # (score, keys, values)
            for i in range(n_top):
                nk, nv = heads.null_keys[head, i].to(q.dtype), heads.null_values[head, i].to(q.dtype)
                candidates.append((float(sq @ nk) / math.sqrt(d), nk[None], nv[None]))
            for j in range(u):
                pos = [t for t in range(j * size - off, (j + 1) * size - off) if 0 <= t < length and mask[t]]
                if pos:
                    candidates.append((float(sq @ k[head, pos].mean(0)) / math.sqrt(d), k[head, pos], v[head, pos]))
            weights = torch.tensor([c[0] for c in candidates], dtype=torch.float64).div(temperature).softmax(0)
            order = sorted(range(len(candidates)), key=lambda c: -candidates[c][0])[:n_top]
            own = [t for t in range(max(lead, 0), p + 1) if mask[t]]
            keys = torch.cat([candidates[c][1] for c in order] + [k[head, own]])
            values = torch.cat([(weights[c] if weighted else 1.0) * candidates[c][2] for c in order] + [v[head, own]])
            out[head, p] = (keys @ q[head, p] / math.sqrt(d)).softmax(-1) @ values
    return out


def test_causal_weighted_routing_matches_naive_token_loop_both_offsets():
    torch.manual_seed(6)
    b, h, d, size, n = 2, 2, 6, 4, 4
    length = size * n
    q, k, v = (torch.randn(b, h, length, d, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(b, length, dtype=torch.bool)
    mask[1, :5] = False  # left padding
    mask[0, 14:] = False  # right padding
    for offset in (0, 1):
        for n_top in (1, 2):
            heads = CausalSinkhornHeads(h, d, size, n_top, offset, 0.75, 0.0, "sdpa", weight_routed_values=True)
            heads = heads.double().eval()
            torch.nn.init.normal_(heads.null_keys)
            torch.nn.init.normal_(heads.null_values)
            with torch.no_grad():
                out = heads(q, k, v, mask)
                for i in range(b):
                    real = mask[i]
                    ref = naive_causal_weighted(heads, q[i], k[i], v[i], mask[i])
                    torch.testing.assert_close(out[i][:, real], ref[:, real], rtol=1e-6, atol=1e-6)
                    plain = naive_causal_weighted(heads, q[i], k[i], v[i], mask[i], weighted=False)
                    assert (out[i][:, real] - plain[:, real]).abs().max() > 1e-2


def naive_sortcut_weighted(q, k, v, mask, size, n_sortcut, temperature, weighted=True):
    """SortCut re-derived: the mean of all real queries scores each non-empty key bucket by the dot product with
    its mean / sqrt(d); the top `n_sortcut` buckets are shared by every query bucket, which also attends its own
    bucket (a chosen bucket equal to the own one is not attended twice). With `weighted`, a chosen bucket's values
    are scaled by its routing weight, the softmax at the sort temperature over the non-empty buckets.
    q, k, v: [h, L, d] (one batch row); mask: [L]."""
    h, length, d = q.shape
    n = length // size
    out = torch.zeros_like(q)
    buckets = [[t for t in range(u * size, (u + 1) * size) if mask[t]] for u in range(n)]
    real = [t for t in range(length) if mask[t]]
    for head in range(h):
        summary = q[head, real].mean(0)
        scores = {j: float(summary @ k[head, p].mean(0)) / math.sqrt(d) for j, p in enumerate(buckets) if p}
        weights = torch.tensor(list(scores.values()), dtype=torch.float64).div(temperature).softmax(0)
        weight = dict(zip(scores, weights.tolist()))
        chosen = sorted(scores, key=lambda j: -scores[j])[:n_sortcut]
        for u in range(n):
            routed = [j for j in chosen if j != u]
            keys = torch.cat([k[head, buckets[j]] for j in routed] + [k[head, buckets[u]]])
            values = torch.cat(
                [(weight[j] if weighted else 1.0) * v[head, buckets[j]] for j in routed] + [v[head, buckets[u]]]
            )
            for p in buckets[u]:
                out[head, p] = (keys @ q[head, p] / math.sqrt(d)).softmax(-1) @ values
    return out


@pytest.mark.parametrize("n_sortcut", [1, 2])
def test_sortcut_weighted_routing_matches_naive_loop(n_sortcut):
    q, k, v, mask, out = run_non_causal_heads(7, n_sortcut=n_sortcut)
    for i in range(len(mask)):
        real = mask[i]
        args = (q[i], k[i], v[i], mask[i], SIZE, n_sortcut, TEMPERATURE)
        torch.testing.assert_close(out[i][:, real], naive_sortcut_weighted(*args)[:, real], rtol=1e-6, atol=1e-6)
        plain = naive_sortcut_weighted(*args, weighted=False)
        assert (out[i][:, real] - plain[:, real]).abs().max() > 1e-2  # the weights matter: this test can fail


def naive_causal_cross_weighted(q, ck, cv, mask, context_mask, size, context_size, n_top, temperature, weighted=True):
    """A causal decoder's cross-attention re-derived token by token: the token's query bucket u scores each
    non-empty context bucket by mean(real queries up to u's leading token) . mean(its context keys) / sqrt(d),
    attends the top `n_top` only (no own bucket), their values scaled by the routing weight (the softmax at the
    sort temperature over the non-empty context buckets). q: [h, L, d]; ck, cv: [h, C, d]; masks: [L], [C]."""
    h, length, d = q.shape
    n_ctx = ck.shape[1] // context_size
    out = torch.zeros_like(q)
    ctx = [[t for t in range(j * context_size, (j + 1) * context_size) if context_mask[t]] for j in range(n_ctx)]
    for p in range(length):
        if not mask[p]:
            continue
        lead = (p // size) * size
        before = [t for t in range(0, lead + 1) if mask[t]]
        for head in range(h):
            sq = q[head, before].mean(0) if before else torch.zeros(d, dtype=q.dtype)
            scores = {j: float(sq @ ck[head, c].mean(0)) / math.sqrt(d) for j, c in enumerate(ctx) if c}
            weights = dict(zip(scores, torch.tensor(list(scores.values())).div(temperature).softmax(0).tolist()))
            chosen = sorted(scores, key=lambda j: -scores[j])[:n_top]
            keys = torch.cat([ck[head, ctx[j]] for j in chosen])
            values = torch.cat([(weights[j] if weighted else 1.0) * cv[head, ctx[j]] for j in chosen])
            out[head, p] = (keys @ q[head, p] / math.sqrt(d)).softmax(-1) @ values
    return out


@pytest.mark.parametrize("n_top", [1, 2])
def test_causal_cross_attention_weighted_routing_matches_naive_token_loop(n_top):
    torch.manual_seed(8)
    b, h, d, size, context_size, temperature = 2, 2, 6, 4, 3, 0.75
    length, context_length = 4 * size, 5 * context_size
    heads = CausalContextHeads(
        h, d, size, context_size, n_top, temperature, 0.0, "sdpa", weight_routed_values=True
    ).double().eval()  # fmt: skip
    q = torch.randn(b, h, length, d, dtype=torch.float64)
    ck, cv = (torch.randn(b, h, context_length, d, dtype=torch.float64) for _ in range(2))
    mask = torch.ones(b, length, dtype=torch.bool)
    # left padding of a whole bucket (a partly padded first bucket has a padded leading token, hence an all-zero
    # summary, equal scores for every context bucket and a tie that any choice resolves correctly)
    mask[1, :4] = False
    mask[0, 6] = False  # a hole inside a query bucket
    context_mask = torch.ones(b, context_length, dtype=torch.bool)
    context_mask[0, 9:] = False  # context buckets 3 and 4 empty: never chosen
    context_mask[1, 4] = False  # a hole inside context bucket 1
    with torch.no_grad():
        out = heads(q, ck, cv, mask, k_mask=context_mask)
    for i in range(b):
        real = mask[i]
        args = (q[i], ck[i], cv[i], mask[i], context_mask[i], size, context_size, n_top, 0.75)
        torch.testing.assert_close(out[i][:, real], naive_causal_cross_weighted(*args)[:, real], rtol=1e-6, atol=1e-6)
        plain = naive_causal_cross_weighted(*args, weighted=False)
        assert (out[i][:, real] - plain[:, real]).abs().max() > 1e-2  # the weights matter: this test can fail
