"""Sinkhorn model behaviour: causality, cached generation, padding, determinism, odd lengths, training, errors."""

import pytest
import torch

from longrange.cache_sinkhorn import SinkhornCache
from longrange.configuration_sinkhorn import SinkhornConfig
from longrange.modeling_sinkhorn import SinkhornForCausalLM, SinkhornForMaskedLM, SinkhornModel

TINY = dict(vocab_size=40, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, bucket_size=8)


def causal_lm(seed=0, **overrides):
    torch.manual_seed(seed)
    config = SinkhornConfig(**{**TINY, "causal": True, "max_position_embeddings": 256, **overrides})
    return SinkhornForCausalLM(config).eval()


ALL_ON = dict(n_local_attn_heads=1, pkm_layers=[2], pkm_num_keys=8, pkm_topk=4, pkm_heads=2, ff_chunks=3)


@pytest.mark.parametrize("n_top", [1, 2, 3])
def test_future_tokens_never_change_past_logits(n_top):
    # 4 heads: 1 local, 1 ordinary Sinkhorn, 2 shifted ("rotated"); PKM, chunked FF and reversible layers on
    model = causal_lm(n_top_buckets=n_top, reversible=True, **ALL_ON)
    ids = torch.randint(0, 40, (1, 42))
    with torch.no_grad():
        base = model(ids, use_cache=False).logits
        for p in (0, 7, 8, 15, 22, 33, 41):
            changed = ids.clone()
            changed[0, p] = (ids[0, p] + 1) % 40
            out = model(changed, use_cache=False).logits
            torch.testing.assert_close(out[:, :p], base[:, :p], rtol=0, atol=1e-6)
            assert (out[:, p] - base[:, p]).abs().max() > 1e-4  # the changed token itself matters


def stepwise_logits(model, ids, mask=None, prefill=3):
    with torch.no_grad():
        out = model(ids[:, :prefill], attention_mask=None if mask is None else mask[:, :prefill], use_cache=True)
        assert isinstance(out.cache, SinkhornCache)
        logits, cache = [out.logits], out.cache
        for t in range(prefill, ids.shape[1]):
            step_mask = None if mask is None else mask[:, : t + 1]  # generate() passes the whole mask so far
            out = model(ids[:, t : t + 1], attention_mask=step_mask, cache=cache, use_cache=True)
            logits.append(out.logits)
            cache = out.cache
    return torch.cat(logits, dim=1)


@pytest.mark.parametrize("n_top", [1, 3])
def test_cached_steps_equal_full_recompute_across_bucket_boundaries(n_top):
    model = causal_lm(seed=1, n_top_buckets=n_top, **ALL_ON)
    ids = torch.randint(0, 40, (2, 37))  # 4+ bucket boundaries (bucket 8), plus the shifted heads' boundaries
    mask = torch.ones(2, 37, dtype=torch.long)
    mask[1, :5] = 0  # left padding in row 1
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False).logits
    stepped = stepwise_logits(model, ids, mask)
    real = mask.bool()
    torch.testing.assert_close(stepped[real], full[real], rtol=1e-5, atol=1e-5)


def test_cached_multi_token_chunk_reversible_cache_and_buffer_growth():
    model = causal_lm(seed=2, reversible=True, weight_tie=True, **{**ALL_ON, "pkm_layers": [1]})
    ids = torch.randint(0, 40, (1, 60))
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        small = SinkhornCache(model.config, max_cache_len=12)  # eager calls past max_cache_len grow the buffers
        first = model(ids[:, :11], cache=small, use_cache=True)
        capacity = first.cache.capacity
        rest = model(ids[:, 11:], cache=first.cache, use_cache=True)  # several tokens on a filled cache
    torch.testing.assert_close(torch.cat([first.logits, rest.logits], 1), full, rtol=1e-5, atol=1e-5)
    assert rest.cache.get_seq_length() == 60
    assert rest.cache.capacity > capacity  # the key/value buffers grew on the way


def test_greedy_generate_same_tokens_with_and_without_cache_and_beam_search_runs():
    model = causal_lm(seed=3, n_top_buckets=2, **ALL_ON)
    prompt = torch.randint(0, 40, (2, 5))
    mask = torch.ones_like(prompt)
    mask[0, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    with_cache = model.generate(prompt, use_cache=True, **kwargs)
    without = model.generate(prompt, use_cache=False, **kwargs)
    assert with_cache.shape == (2, 25)  # crosses bucket boundaries at 8, 16, 24
    assert torch.equal(with_cache, without)
    beams = model.generate(prompt, attention_mask=mask, max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0)
    beams_nc = model.generate(
        prompt, attention_mask=mask, max_new_tokens=6, num_beams=2, do_sample=False, pad_token_id=0, use_cache=False
    )
    assert torch.equal(beams, beams_nc)
    sampled = model.generate(prompt, max_new_tokens=5, do_sample=True, num_return_sequences=2, pad_token_id=0)
    assert sampled.shape == (4, 10)


@pytest.mark.parametrize("causal", [True, False])
def test_padding_invariance_left_and_right(causal):
    torch.manual_seed(4)
    config = SinkhornConfig(**{**TINY, "causal": causal, "n_top_buckets": 2, "n_local_attn_heads": 1})
    model = SinkhornModel(config).eval()
    ids = torch.randint(1, 40, (1, 19))
    with torch.no_grad():
        alone = model(ids).last_hidden_state
        # right padding across a bucket boundary: real outputs unchanged
        right = torch.cat([ids, torch.randint(1, 40, (1, 10))], 1)
        right_mask = torch.cat([torch.ones(1, 19), torch.zeros(1, 10)], 1)
        out = model(right, attention_mask=right_mask).last_hidden_state[:, :19]
        torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)
        # left padding by a whole bucket: positions count real tokens, so the outputs equal the unpadded ones
        left = torch.cat([torch.randint(1, 40, (1, 8)), ids], 1)
        left_mask = torch.cat([torch.zeros(1, 8), torch.ones(1, 19)], 1)
        out = model(left, attention_mask=left_mask).last_hidden_state[:, 8:]
        torch.testing.assert_close(out, alone, rtol=1e-5, atol=1e-5)
        # any left padding: changing the padded tokens changes nothing real
        left5 = torch.cat([torch.randint(1, 40, (1, 5)), ids], 1)
        mask5 = torch.cat([torch.zeros(1, 5), torch.ones(1, 19)], 1)
        a = model(left5, attention_mask=mask5).last_hidden_state[:, 5:]
        left5[:, :5] = torch.randint(1, 40, (1, 5))
        b = model(left5, attention_mask=mask5).last_hidden_state[:, 5:]
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_eval_is_deterministic_with_gumbel_sinkhorn_sort_net():
    torch.manual_seed(5)
    config = SinkhornConfig(**TINY, use_simple_sort_net=True, non_permutative=False, sinkhorn_iter=4, n_top_buckets=1)
    model = SinkhornModel(config).eval()
    ids = torch.randint(0, 40, (2, 32))
    with torch.no_grad():
        first = model(ids).last_hidden_state
        second = model(ids).last_hidden_state
    assert torch.equal(first, second)


def test_odd_lengths_forward_and_generate():
    torch.manual_seed(6)
    config = SinkhornConfig(
        vocab_size=30,
        hidden_size=8,
        num_hidden_layers=1,
        num_attention_heads=2,
        bucket_size=128,
        causal=True,
        max_position_embeddings=1200,
        intermediate_size=8,
    )
    model = SinkhornForCausalLM(config).eval()
    with torch.no_grad():
        for length in (1, 117, 1117):
            ids = torch.randint(0, 30, (1, length))
            assert model(ids).logits.shape == (1, length, 30)
        out = model.generate(torch.randint(0, 30, (1, 1117)), max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 1120)
        out = model.generate(torch.randint(0, 30, (1, 1)), max_new_tokens=3, do_sample=False, pad_token_id=0)
        assert out.shape == (1, 4)


def test_masked_lm_trains():
    torch.manual_seed(7)
    config = SinkhornConfig(**TINY, n_sortcut=2, reversible=True, ff_chunks=2)
    model = SinkhornForMaskedLM(config).train()
    ids = torch.randint(1, 40, (4, 32))
    inputs = ids.clone()
    inputs[:, ::4] = 0  # "mask" token
    labels = torch.full_like(ids, -100)
    labels[:, ::4] = ids[:, ::4]
    optimizer = torch.optim.Adam(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(12):
        loss = model(inputs, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.3


def test_causal_lm_loss_is_shifted_and_ignores_minus_100():
    model = causal_lm(seed=8)
    ids = torch.randint(0, 40, (2, 20))
    labels = ids.clone()
    labels[:, 10:] = -100
    out = model(ids, labels=labels, num_items_in_batch=18)
    logits = out.logits[:, :-1].reshape(-1, 40)
    target = labels[:, 1:].reshape(-1)
    expected = torch.nn.functional.cross_entropy(logits, target, ignore_index=-100, reduction="sum") / 18
    torch.testing.assert_close(out.loss, expected)


def test_randomly_truncate_sequence_applies_in_training_only():
    model = causal_lm(seed=9, randomly_truncate_sequence=True)
    ids = torch.randint(1, 40, (3, 24))
    with torch.no_grad():
        eval_a = model(ids, labels=ids).loss
        eval_b = model(ids, labels=ids).loss
        assert torch.equal(eval_a, eval_b)
        model.train()
        torch.manual_seed(0)
        train_loss = model(ids, labels=ids).loss
    assert not torch.allclose(train_loss, eval_a)


def test_bad_configs_raise_naming_the_fields():
    cases = [
        (dict(causal=True, n_sortcut=2), "n_sortcut"),
        (dict(causal=True, use_simple_sort_net=True), "use_simple_sort_net"),
        (dict(causal=True, non_permutative=False), "non_permutative"),
        (dict(hidden_size=30, num_attention_heads=4), "num_attention_heads"),
        (dict(num_attention_heads=4, n_local_attn_heads=5), "n_local_attn_heads"),
        (dict(bucket_size=0), "bucket_size"),
        (dict(pkm_layers=[7], num_hidden_layers=2), "pkm_layers"),
        (dict(layer_dropout=1.5), "layer_dropout"),
        (dict(bucket_sise=8), "bucket_sise"),
    ]
    for kwargs, field in cases:
        with pytest.raises(ValueError, match=field):
            SinkhornConfig(**kwargs)
    with pytest.raises(ValueError, match="causal"):
        SinkhornForCausalLM(SinkhornConfig(**TINY))
    with pytest.raises(ValueError, match="causal"):
        SinkhornForMaskedLM(SinkhornConfig(**TINY, causal=True))


def test_seed_names_are_aliases():
    config = SinkhornConfig(num_tokens=11, dim=16, depth=3, heads=2, max_seq_len=64, temperature=0.5)
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (11, 16, 3)
    assert (config.num_attention_heads, config.max_position_embeddings, config.sort_temperature) == (2, 64, 0.5)
    assert config.dim == 16 and config.depth == 3


def test_bad_inputs_raise_clear_errors():
    model = causal_lm(seed=10, max_position_embeddings=32)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model(torch.randint(0, 40, (1, 33)))
    with pytest.raises(ValueError, match="input_ids must lie in .0, vocab_size="):
        model(torch.tensor([[1, 2, 40]]))
    with pytest.raises(ValueError, match="input_ids must lie in .0, vocab_size="):
        model(torch.tensor([[1, -2, 3]]))
    with pytest.raises(ValueError, match="attention_mask"):
        model(torch.randint(0, 40, (2, 10)), attention_mask=torch.ones(2, 9))
    with pytest.raises(ValueError, match="max_position_embeddings"):
        out = model(torch.randint(0, 40, (1, 30)), use_cache=True)
        model(torch.randint(0, 40, (1, 3)), cache=out.cache, use_cache=True)


def test_memory_saver_options_shape_the_model_as_documented():
    from longrange.product_key_memory import ProductKeyMemory, pkm_parameter_groups
    from longrange.sinkhorn_heads import CausalSinkhornHeads, LocalHeads

    def count(model):
        return sum(p.numel() for p in model.parameters())

    plain = SinkhornModel(SinkhornConfig(**{**TINY, "num_hidden_layers": 3}))
    tied = SinkhornModel(SinkhornConfig(**{**TINY, "num_hidden_layers": 3}, weight_tie=True))
    # weight_tie: shared attention and feed-forward weights, every layer its own LayerNorms (as the reference)
    assert len(tied.layers) == 3 and count(tied) < count(plain)
    assert tied.layers[2].attention.attention is tied.layers[0].attention.attention
    assert tied.layers[2].feed_forward.net is tied.layers[0].feed_forward.net
    assert tied.layers[2].attention.norm is not tied.layers[0].attention.norm
    factorised = SinkhornModel(SinkhornConfig(**TINY, emb_dim=8))
    assert factorised.embed_tokens.weight.shape == (40, 8) and factorised.project_in.in_features == 8
    wide_heads = SinkhornModel(SinkhornConfig(**TINY, dim_head=10))
    assert wide_heads.layers[0].attention.attention.to_q.out_features == 40
    glu = SinkhornModel(SinkhornConfig(**TINY, ff_glu=True, intermediate_size=16))
    assert glu.layers[0].feed_forward.net.up.out_features == 32
    model = causal_lm(n_local_attn_heads=2, pkm_layers=[2], pkm_num_keys=8, pkm_topk=4)
    groups = model.model.layers[0].attention.attention.groups
    assert [type(g) for g in groups] == [LocalHeads, CausalSinkhornHeads, CausalSinkhornHeads]
    assert [g.offset for g in groups[1:]] == [0, 1]  # one ordinary, one shifted ("rotated") head
    assert isinstance(model.model.layers[1].feed_forward.net, ProductKeyMemory)
    param_groups = pkm_parameter_groups(model, lr=1e-3, pkm_value_lr=1e-2)
    assert param_groups[-1]["lr"] == 1e-2
    assert param_groups[-1]["params"][0] is model.model.layers[1].feed_forward.net.values.weight


def test_layer_dropout_only_in_training():
    model = causal_lm(seed=11, layer_dropout=0.5, num_hidden_layers=4)
    ids = torch.randint(0, 40, (1, 16))
    with torch.no_grad():
        assert torch.equal(model(ids).logits, model(ids).logits)
        model.train()
        outs = [model(ids).logits for _ in range(6)]
    assert any(not torch.equal(outs[0], o) for o in outs[1:])  # different layers skipped


@pytest.mark.parametrize("non_permutative", [True, False])
def test_sort_net_receives_gradient_through_the_straight_through_routing_weight(non_permutative):
    torch.manual_seed(12)
    config = SinkhornConfig(
        **{**TINY, "num_hidden_layers": 1},
        use_simple_sort_net=True,
        non_permutative=non_permutative,
        max_position_embeddings=64,
    )
    model = SinkhornForMaskedLM(config).train()
    ids = torch.randint(0, 40, (2, 40))
    model(ids, labels=ids).loss.backward()
    sort_net = model.model.layers[0].attention.attention.groups[0].sort_net
    assert sort_net.grad is not None and sort_net.grad.abs().sum() > 0


@pytest.mark.parametrize("bucket, simple", [(1, False), (4, False), (4, True)])
def test_gumbel_sinkhorn_balancing_ignores_query_buckets_of_padding(bucket, simple):
    # found by the property tests: the column step of the balancing normalised over fully padded query buckets too
    torch.manual_seed(0)
    config = SinkhornConfig(
        vocab_size=5, hidden_size=16, num_hidden_layers=1, num_attention_heads=1, bucket_size=bucket, causal=False,
        n_top_buckets=1, non_permutative=False, sinkhorn_iter=1, sort_temperature=0.5, weight_routed_values=False,
        axial_position_embeddings=False, max_position_embeddings=40, use_simple_sort_net=simple,
    )  # fmt: skip
    model = SinkhornForMaskedLM(config).eval()
    short, long = torch.randint(0, 5, (1, 3 * bucket)), torch.randint(0, 5, (1, 5 * bucket + 1))
    ids = torch.cat([torch.zeros(1, long.shape[1] - short.shape[1], dtype=torch.long), short], 1)
    mask = torch.cat([torch.zeros(1, long.shape[1] - short.shape[1]), torch.ones(1, short.shape[1])], 1).long()
    with torch.no_grad():
        batched = model(torch.cat([ids, long]), attention_mask=torch.cat([mask, torch.ones_like(long)])).logits
        alone = model(short).logits
    torch.testing.assert_close(batched[0, -short.shape[1] :], alone[0], atol=1e-5, rtol=1e-5)


def test_sortcut_with_sinkhorn_balancing_is_refused():
    # balancing SortCut's single summary row gives every key bucket weight 1: the sort net would choose nothing
    with pytest.raises(ValueError, match="n_sortcut > 0 needs non_permutative=True"):
        SinkhornConfig(**TINY, causal=False, n_sortcut=2, non_permutative=False)


def test_routing_gradient_attention_is_refused_where_it_means_nothing():
    for kwargs, found in [
        (dict(causal=True), "weight_routed_values=False"),  # weighted values: the weight is no straight-through one
        (dict(causal=False, weight_routed_values=False), "causal=True"),
        (dict(causal=True, weight_routed_values=False, routing_gradient="keys"), "routing_gradient"),
    ]:
        with pytest.raises(ValueError, match=found):
            SinkhornConfig(**TINY, **{"routing_gradient": "attention", **kwargs})


def _shifted_pick_loss(model, ids, eps, at):
    """The training loss with the straight-through routing scale of one pick (layer 0's first Sinkhorn group, batch
    row 0, head 0, query bucket `at`, first pick) multiplied by exp(eps): what `routing_gradient` makes of it."""
    from longrange.sinkhorn_heads import CausalSinkhornHeads

    original = CausalSinkhornHeads._select
    group = model.model.layers[0].attention.attention.groups[0]

    def select(self, scores, valid, n_sel):
        idx, picked_valid, scale = original(self, scores, valid, n_sel)
        if self is group:
            where = (torch.tensor(0), torch.tensor(0), torch.tensor(at), torch.tensor(0))
            scale = torch.ones(idx.shape, dtype=eps.dtype) if scale is None else scale.double()  # (None: no grad)
            scale = scale * torch.zeros_like(scale).index_put(where, eps).exp()
        return idx, picked_valid, scale

    CausalSinkhornHeads._select = select
    try:
        logits = model(ids).logits[:, :-1]
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())
    finally:
        CausalSinkhornHeads._select = original


def test_routing_gradient_is_the_derivative_of_its_scaling_and_leaves_the_forward_alone():
    """`routing_gradient` changes the backward pass only: the same weights give the same logits and cached tokens;
    the gradient reaching a pick's straight-through log-scale is the finite-difference derivative of the loss when
    that scale really multiplies the values ("values") or the attention probabilities ("attention") of the chosen
    bucket, and the two differ. One layer: a later layer's straight-through weights would add gradient (by design)
    that the forward pass does not have."""
    one = dict(weight_routed_values=False, n_top_buckets=2, max_position_embeddings=64, num_hidden_layers=1)
    models = {g: causal_lm(seed=5, **one, routing_gradient=g) for g in ("values", "attention")}
    ids = torch.randint(0, 40, (2, 48))
    with torch.no_grad():
        torch.testing.assert_close(models["attention"](ids).logits, models["values"](ids).logits, rtol=0, atol=0)
    prompt = ids[:1, :20]
    tokens = [m.generate(prompt, max_new_tokens=12, do_sample=False) for m in models.values()]
    assert torch.equal(*tokens)
    grads = {}
    for name, model in models.items():
        model.train().double()
        eps = torch.zeros((), dtype=torch.float64, requires_grad=True)
        (grads[name],) = torch.autograd.grad(_shifted_pick_loss(model, ids, eps, at=5), eps)
        h = 1e-4
        with torch.no_grad():
            up, down = (_shifted_pick_loss(model, ids, torch.tensor(s, dtype=torch.float64), at=5) for s in (h, -h))
        torch.testing.assert_close(grads[name], (up - down) / (2 * h), rtol=1e-5, atol=1e-9)
    assert abs(grads["attention"] - grads["values"]) > 0.1 * abs(grads["values"]) > 0
