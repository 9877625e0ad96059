"""Sinkhorn attention against naive references written here: dense masked attention, and a per-token loop that
re-derives the causal routing from its definition."""

import math

import torch

from longrange.configuration_sinkhorn import SinkhornConfig
from longrange.sinkhorn_attention import SinkhornSelfAttention
from longrange.sinkhorn_heads import CausalSinkhornHeads, SinkhornHeads


def dense_attention(q, k, v, allowed):
    """q, k, v: [h, L, d]; allowed: [h, Lq, Lk] bool. Rows with nothing allowed give zeros."""
    scores = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(~allowed, float("-inf"))
    probs = torch.nan_to_num(scores.softmax(-1), nan=0.0)
    return probs @ v


def test_non_causal_covering_all_buckets_equals_dense_masked_attention():
    torch.manual_seed(0)
    b, h, d, size, n = 2, 3, 8, 4, 5
    length = size * n
    heads = SinkhornHeads(h, d, size, size, n - 1, 0, True, False, n, True, 5, 0.75, 0.0, "sdpa").eval()
    q, k, v = (torch.randn(b, h, length, d, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(b, length, dtype=torch.bool)
    mask[1, 13:] = False  # padding: row 1 has 13 real tokens
    out = heads(q, k, v, mask, mask)
    for i in range(b):
        allowed = mask[i][None, None, :].expand(h, length, length)
        ref = dense_attention(q[i], k[i], v[i], allowed)
        real = mask[i]
        torch.testing.assert_close(out[i][:, real], ref[:, real], rtol=1e-10, atol=1e-10)


def test_sortcut_covering_all_buckets_equals_dense_attention():
    torch.manual_seed(1)
    b, h, d, size, n = 1, 2, 8, 4, 4
    heads = SinkhornHeads(h, d, size, size, 1, n, True, False, n, True, 5, 0.75, 0.0, "sdpa").eval()
    q, k, v = (torch.randn(b, h, size * n, d, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(b, size * n, dtype=torch.bool)
    out = heads(q, k, v, mask, mask)
    ref = dense_attention(q[0], k[0], v[0], torch.ones(h, size * n, size * n, dtype=torch.bool))
    torch.testing.assert_close(out[0], ref, rtol=1e-10, atol=1e-10)


def naive_causal(heads: CausalSinkhornHeads, q, k, v, mask):
    """The causal routing rule re-derived token by token. q, k, v: [h, L, d] (one batch row); mask: [L]."""
    h, length, d = q.shape
    size, off, n_top = heads.bucket_size, heads.offset, heads.n_top
    out = torch.zeros_like(q)
    for p in range(length):
        if not mask[p]:
            continue
        u = (p + off) // size
        lead = u * size - off  # may be -1 (virtual leading token of the shifted heads' first bucket)
        for head in range(h):
            before = [t for t in range(0, lead + 1) if mask[t]]
            sq = q[head, before].mean(0) if before else torch.zeros(d, dtype=q.dtype)
            candidates = []  # (score, keys, values)
            for i in range(n_top):
                nk = heads.null_keys[head, i].to(q.dtype)
                candidates.append(
                    (float(sq @ nk) / math.sqrt(d), nk[None], heads.null_values[head, i].to(q.dtype)[None])
                )
            for j in range(u):
                pos = [t for t in range(j * size - off, (j + 1) * size - off) if 0 <= t < length and mask[t]]
                if pos:
                    sk = k[head, pos].mean(0)
                    candidates.append((float(sq @ sk) / math.sqrt(d), k[head, pos], v[head, pos]))
            candidates.sort(key=lambda c: -c[0])
            chosen = candidates[:n_top]
            own = [t for t in range(max(lead, 0), p + 1) if mask[t]]
            keys = torch.cat([c[1] for c in chosen] + [k[head, own]])
            values = torch.cat([c[2] for c in chosen] + [v[head, own]])
            probs = (keys @ q[head, p] / math.sqrt(d)).softmax(-1)
            out[head, p] = probs @ values
    return out


def test_causal_routing_matches_naive_token_loop_both_offsets():
    torch.manual_seed(2)
    b, h, d, size, n = 2, 2, 6, 4, 5
    length = size * n
    q, k, v = (torch.randn(b, h, length, d, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(b, length, dtype=torch.bool)
    mask[1, :6] = False  # left padding
    mask[0, 17:] = False  # right padding
    for offset in (0, 1):
        for n_top in (1, 3):
            heads = CausalSinkhornHeads(h, d, size, n_top, offset, 0.75, 0.0, "sdpa").double().eval()
            torch.nn.init.normal_(heads.null_keys)
            torch.nn.init.normal_(heads.null_values)
            with torch.no_grad():
                out = heads(q, k, v, mask)
            for i in range(b):
                with torch.no_grad():
                    ref = naive_causal(heads, q[i], k[i], v[i], mask[i])
                real = mask[i]
                torch.testing.assert_close(out[i][:, real], ref[:, real], rtol=1e-9, atol=1e-9)


def test_all_zero_values_give_all_zero_attention_output():
    """Reference defect 1: sorted buckets must contribute values, not keys."""
    torch.manual_seed(3)
    config = SinkhornConfig(hidden_size=16, num_attention_heads=2, bucket_size=4, n_top_buckets=2, causal=False)
    attention = SinkhornSelfAttention(config).eval()
    with torch.no_grad():
        attention.to_kv.weight[16:].zero_()  # the value half of the key/value projection
    x = torch.randn(2, 16, 16)
    out = attention(x, torch.ones(2, 16, dtype=torch.bool))
    # to_out of an all-zero attention output is its bias
    torch.testing.assert_close(out, attention.to_out.bias.expand_as(out), rtol=0, atol=0)
