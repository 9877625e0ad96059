"""routing_exploration: in training, each causal query bucket also attends random earlier key buckets it did not
choose. Checked against the definition: the draw (distinct, earlier, non-empty, never a null bucket, uniform), the
attention over chosen + explored buckets re-derived token by token in float64, and no effect in eval mode."""

import math

import pytest
import torch

from longrange import SinkhornConfig, SinkhornForCausalLM
from longrange.sinkhorn_heads import CausalSinkhornHeads
from longrange.sinkhorn_routing import select_buckets


def test_explored_candidates_are_new_allowed_distinct_and_uniform():
    torch.manual_seed(0)
    scores = torch.randn(4000, 9)
    valid = torch.ones(9, dtype=torch.bool)
    valid[7] = False
    explorable = valid.clone()
    explorable[:2] = False  # e.g. the null buckets
    plain, _, _ = select_buckets(scores, valid, 2, 0.75)
    idx, picked_valid, _ = select_buckets(scores, valid, 2, 0.75, explore=3, explorable=explorable)
    assert torch.equal(idx[:, :2], plain)  # the sort net's choice comes first, unchanged
    extra = idx[:, 2:]
    assert picked_valid.all()  # at least 3 explorable buckets are left in every row
    assert explorable[extra].all()
    for row in range(len(idx)):
        assert len(set(idx[row].tolist())) == 5
    # each explorable candidate not chosen is equally likely: 4 or 5 of them (6 explorable minus those chosen)
    counts = torch.zeros(9)
    left = torch.zeros(9)
    for row in range(len(idx)):
        allowed = [c for c in range(9) if explorable[c] and c not in plain[row].tolist()]
        for c in allowed:
            left[c] += 3 / len(allowed)
        counts[extra[row]] += 1
    rate = counts[explorable] / left[explorable]
    assert (rate - 1).abs().max() < 0.06, rate


def test_explored_draw_beyond_the_candidates_left_is_invalid():
    scores = torch.zeros(1, 1, 6)
    valid = torch.tensor([True, True, True, True, False, False])
    idx, picked_valid, _ = select_buckets(scores, valid, 1, 0.75, explore=4)
    assert picked_valid[0, 0].tolist() == [True, True, True, True, False]
    assert sorted(idx[0, 0, :4].tolist()) == [0, 1, 2, 3]


def naive_causal_routes(heads, q, k, v, mask, route, weighted):
    """The causal rule token by token in float64 with the chosen buckets given: `route` [h, n, picks] as
    output_attentions returns it (key bucket indices; -1 = the null bucket among the sort net's pick, which with
    n_top = 1 is the only one, or nothing among the explored ones). Each pick's values are
    scaled by its routing weight (the softmax at the sort temperature over the null buckets and the earlier
    non-empty key buckets) when `weighted`, then softmax(q . keys / sqrt(d)) over the picks and the own bucket up to the token."""
    h, length, d = q.shape
    size, off, n_top, temperature = heads.bucket_size, heads.offset, heads.n_top, heads.temperature
    out = torch.zeros_like(q)
    for p in range(length):
        if not mask[p]:
            continue
        u = (p + off) // size
        lead = u * size - off
        for head in range(h):
            before = [t for t in range(0, lead + 1) if mask[t]]
            sq = q[head, before].mean(0) if before else torch.zeros(d, dtype=q.dtype)
            bank = {}  # bank index -> (score, keys, values)
            for i in range(n_top):
                nk, nv = (t.detach()[head, i].to(q.dtype) for t in (heads.null_keys, heads.null_values))
                bank[-1 - i] = (float(sq @ nk) / math.sqrt(d), nk[None], nv[None])
            for j in range(u):
                pos = [t for t in range(j * size - off, (j + 1) * size - off) if 0 <= t < length and mask[t]]
                if pos:
                    bank[j] = (float(sq @ k[head, pos].mean(0)) / math.sqrt(d), k[head, pos], v[head, pos])
            names = list(bank)
            weights = torch.tensor([bank[c][0] for c in names], dtype=torch.float64).div(temperature).softmax(0)
            weight = dict(zip(names, weights))
            picks = route[head, u, :n_top].tolist() + [c for c in route[head, u, n_top:].tolist() if c >= 0]
            assert all(c in bank for c in picks)
            own = [t for t in range(max(lead, 0), p + 1) if mask[t]]
            keys = torch.cat([bank[c][1] for c in picks] + [k[head, own]])
            values = torch.cat([(weight[c] if weighted else 1.0) * bank[c][2] for c in picks] + [v[head, own]])
            out[head, p] = (keys @ q[head, p] / math.sqrt(d)).softmax(-1) @ values
    return out


@pytest.mark.parametrize("offset,weighted", [(0, True), (1, True), (0, False)])
def test_training_attends_chosen_and_explored_buckets(offset, weighted):
    torch.manual_seed(6 + offset)
    b, h, d, size, n, n_top, explore = 2, 2, 6, 4, 6, 1, 2
    length = size * n
    q, k, v = (torch.randn(b, h, length, d, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(b, length, dtype=torch.bool)
    mask[1, :5] = False  # left padding: bucket 0 (and part of 1) empty, never explored
    heads = (
        CausalSinkhornHeads(
            h, d, size, n_top, offset, 0.75, 0.0, "sdpa", weight_routed_values=weighted, exploration=explore
        )
        .double()
        .train()
    )
    torch.nn.init.normal_(heads.null_keys)
    torch.nn.init.normal_(heads.null_values)
    seen = {}
    with torch.no_grad():
        out = heads(q, k, v, mask, attn_weights=seen)
    route = seen["route"]  # [b, h, n(+1 shifted), n_top + explore]
    assert route.shape[-1] == n_top + explore
    for i in range(b):
        real = mask[i]
        ref = naive_causal_routes(heads, q[i], k[i], v[i], mask[i], route[i], weighted)
        torch.testing.assert_close(out[i][:, real], ref[:, real], rtol=1e-6, atol=1e-6)
    explored = route[..., n_top:]
    # early buckets have fewer earlier buckets to draw from (-1: nothing); a null bucket is never explored, so each
    # explored bucket is an earlier one, non-empty (the reference asserts both) and not the chosen one
    assert (explored >= 0).any() and (explored < 0).any()
    chosen = route[..., :n_top]
    assert not ((explored[..., :, None] == chosen[..., None, :]) & (explored[..., :, None] >= 0)).any()
    assert not ((explored[..., 0] == explored[..., 1]) & (explored[..., 0] >= 0)).any()
    with torch.no_grad():
        heads.eval()
        seen = {}
        heads(q, k, v, mask, attn_weights=seen)
    assert seen["route"].shape[-1] == n_top  # eval mode: the sort net's choice only


def test_model_eval_and_generation_ignore_exploration_and_training_uses_it():
    torch.manual_seed(1)
    tiny = dict(vocab_size=40, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, bucket_size=4)
    config = SinkhornConfig(**tiny, causal=True, n_top_buckets=1, routing_exploration=2)
    model = SinkhornForCausalLM(config)
    plain = SinkhornForCausalLM(SinkhornConfig(**tiny, causal=True, n_top_buckets=1))
    plain.load_state_dict(model.state_dict())
    ids = torch.randint(0, 40, (2, 24))
    model.eval(), plain.eval()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits, rtol=0, atol=0)
        prompt = ids[:, :9]
        assert torch.equal(
            model.generate(prompt, max_new_tokens=8, do_sample=False),
            plain.generate(prompt, max_new_tokens=8, do_sample=False),
        )
    model.train(), plain.train()
    loss = model(ids, labels=ids).loss
    assert (loss - plain(ids, labels=ids).loss).abs() > 1e-4  # more buckets attended in training
    loss.backward()
    assert torch.isfinite(loss)


def test_exploration_needs_causal():
    with pytest.raises(ValueError, match="routing_exploration > 0 needs causal=True"):
        SinkhornConfig(routing_exploration=1)
    with pytest.raises(ValueError, match="routing_exploration"):
        SinkhornConfig(causal=True, routing_exploration=-1)
