"""Checkpoint conversion from sinkhorn-transformer 0.11.4: converted reference models give the reference's logits
(eval mode, unpadded inputs), every reference option we reproduce is needed for that, and the reference's known
defects show up exactly where expected.

The reference models are trained for a few Adam steps at a high learning rate before conversion, so that every
parameter has moved from its initial value: freshly initialised models hide mappings that only matter for trained
weights (e.g. all LayerNorms equal, so a shared norm passes for per-layer ones).
"""

import json

import pytest
import torch

sinkhorn_transformer = pytest.importorskip("sinkhorn_transformer")

from longrange.configuration_sinkhorn import SinkhornConfig  # noqa: E402
from longrange.convert_sinkhorn import config_from_reference, convert, convert_state_dict  # noqa: E402
from longrange.modeling_sinkhorn import SinkhornForCausalLM  # noqa: E402

BASE = dict(num_tokens=50, dim=32, depth=2, heads=4, bucket_size=8, max_seq_len=64)
ATOL = 1e-5


def train_a_little(model, steps=3, lr=0.05, seed=0):
    """A few Adam steps (next-token loss on random ids) at a learning rate high enough to move every parameter."""
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(steps):
        ids = torch.randint(0, BASE["num_tokens"], (2, BASE["max_seq_len"]), generator=generator)
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return model.eval()


def reference(seed=0, keys_as_values=False, train=True, **overrides):
    torch.manual_seed(seed)
    kwargs = {**BASE, **overrides}
    model = sinkhorn_transformer.SinkhornTransformerLM(**kwargs).eval()
    if train:
        train_a_little(model, seed=seed)
    if keys_as_values:
        # value projection := key projection, so the reference's keys-for-values gather (its defect 1) is invisible
        with torch.no_grad():
            for module in model.modules():
                if getattr(module, "to_kv", None) is not None:
                    w = module.to_kv.weight
                    w[w.shape[0] // 2 :] = w[: w.shape[0] // 2]
    return model, kwargs


def max_diff(ref, ours, length=64, seed=1):
    ids = torch.randint(0, BASE["num_tokens"], (2, length), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return (ref(ids) - ours(ids).logits).abs().max().item()


EXACT = {
    "causal": dict(causal=True),
    "causal, top 1, dim_head": dict(causal=True, n_top_buckets=1, dim_head=12),
    "causal, top 3, 1 local head": dict(causal=True, n_top_buckets=3, n_local_attn_heads=1),
    "causal, 1 Sinkhorn head": dict(causal=True, n_local_attn_heads=3),
    "causal, reversible, GLU, ff_chunks": dict(causal=True, reversible=True, ff_glu=True, ff_chunks=4),
    "causal, weight_tie, emb_dim, PKM": dict(
        causal=True, weight_tie=True, emb_dim=16, pkm_layers=(2,), pkm_num_keys=32, depth=3
    ),
    "SortCut, local heads, PKM": dict(n_sortcut=1, n_local_attn_heads=2, pkm_layers=(1,), pkm_num_keys=32),
    "SortCut, reversible, weight_tie, emb_dim": dict(n_sortcut=2, reversible=True, weight_tie=True, emb_dim=16),
    "causal, weight_tie, PKM in layer 1": dict(causal=True, weight_tie=True, pkm_layers=(1,), pkm_num_keys=32, depth=3),
    "non-causal, all local": dict(n_local_attn_heads=4),
    "non-causal top 2 (keys = values)": dict(keys_as_values=True),
    "simple sort net, top 1 (keys = values)": dict(keys_as_values=True, use_simple_sort_net=True, n_top_buckets=1),
}


@pytest.mark.parametrize("name", list(EXACT))
def test_converted_reference_gives_the_same_logits(name):
    ref, kwargs = reference(**EXACT[name])
    with torch.no_grad():  # the reference is deterministic in eval mode with non_permutative=True
        ids = torch.randint(0, 50, (1, 64))
        assert torch.equal(ref(ids), ref(ids))
    assert max_diff(ref, convert(ref.state_dict(), kwargs)) < ATOL


def test_reference_defect_keys_in_place_of_values_is_the_only_non_causal_difference():
    # the same weights but distinct key and value projections: the reference attends routed keys as values
    ref, kwargs = reference()
    assert max_diff(ref, convert(ref.state_dict(), kwargs)) > 1e-3
    # SortCut gathers values correctly in the reference: there the same weights convert exactly
    ref, kwargs = reference(n_sortcut=2)
    assert max_diff(ref, convert(ref.state_dict(), kwargs)) < ATOL


def test_reference_gumbel_sinkhorn_is_random_in_eval_mode_and_refused():
    ref, kwargs = reference(non_permutative=False, n_sortcut=0)
    ids = torch.randint(0, 50, (1, 64))
    with torch.no_grad():
        assert (ref(ids) - ref(ids)).abs().max() > 1e-4  # Gumbel noise in eval mode (the reference's defect 3)
    with pytest.raises(ValueError, match="non_permutative=False"):
        convert(ref.state_dict(), kwargs)


def _without(model, **defaults):
    """The converted model with some options set back (same weights)."""
    config = SinkhornConfig.from_dict({**model.config.to_dict(), **defaults})
    other = type(model)(config).eval()
    other.load_state_dict(model.state_dict())
    return other


CAUSAL_OPTIONS = dict(
    weight_routed_keys=False,
    sequential_routing_weights=False,
    causal_key_summary="mean",
    causal_null_score="learned",
    null_bucket_copies=False,
    shifted_heads_skip_first_bucket=False,
)
NON_CAUSAL_OPTIONS = dict(
    weight_routed_keys=False, sequential_routing_weights=False, route_own_bucket=False, sort_temperature=0.75
)


@pytest.fixture(scope="module")
def converted():
    """One converted reference per case, shared by the option tests."""
    pairs = {}
    for case, overrides in (("causal", dict(causal=True)), ("non-causal", dict(keys_as_values=True, n_top_buckets=3))):
        ref, kwargs = reference(**overrides)
        pairs[case] = ref, convert(ref.state_dict(), kwargs)
    return pairs


@pytest.mark.parametrize(
    "case, option",
    [("causal", opt) for opt in CAUSAL_OPTIONS] + [("non-causal", opt) for opt in NON_CAUSAL_OPTIONS],
)
def test_every_reference_option_is_needed(converted, case, option):
    ref, model = converted[case]
    defaults = CAUSAL_OPTIONS if case == "causal" else NON_CAUSAL_OPTIONS
    assert max_diff(ref, model) < ATOL
    assert max_diff(ref, _without(model, **{option: defaults[option]})) > 1e-4


def test_axial_positions_are_a_reparametrisation_of_learned_positions():
    ref, kwargs = reference(causal=True)
    model = convert(ref.state_dict(), kwargs)
    axial = model.model.embed_positions
    table = axial(torch.arange(model.config.max_position_embeddings))
    config = SinkhornConfig.from_dict({**model.config.to_dict(), "axial_position_embeddings": False})
    flat = SinkhornForCausalLM(config).eval()
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("model.embed_positions.")}
    flat.load_state_dict({**state, "model.embed_positions.weight": table.detach()})
    assert max_diff(ref, flat) < ATOL
    # the table: per-bucket row plus in-bucket row, computed here from the reference's parameters
    w0, w1 = (p.detach() for p in ref.axial_pos_emb.weights)
    for p in (0, 7, 8, 21, 63):
        torch.testing.assert_close(table[p], w0[0, p // 8, 0] + w1[0, 0, p % 8], rtol=0, atol=0)


def test_cached_decoding_stays_exact_with_the_reference_options():
    ref, kwargs = reference(causal=True, n_local_attn_heads=1)
    model = convert(ref.state_dict(), kwargs)
    ids = torch.randint(
        0, 50, (2, 20)
    )  # steps cross the bucket starts of the ordinary (8, 16) and shifted (7, 15) heads
    with torch.no_grad():
        full = model(ids, use_cache=False).logits
        out = model(ids[:, :5], use_cache=True)
        steps, cache = [out.logits], out.cache
        for t in range(5, 20):
            out = model(ids[:, t : t + 1], cache=cache, use_cache=True)
            steps.append(out.logits)
            cache = out.cache
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "overrides, option",
    [
        (dict(receives_context=True), "receives_context"),
        (dict(use_rezero=True), "use_rezero"),
        (dict(kv_bucket_size=16), "kv_bucket_size"),
        (dict(return_embeddings=True), "return_embeddings"),
        (dict(causal=True, use_simple_sort_net=True), "use_simple_sort_net"),
        (dict(not_an_option=1), "not_an_option"),
    ],
)
def test_unmappable_options_are_refused_by_name(overrides, option):
    with pytest.raises(ValueError, match=option):
        config_from_reference({**BASE, **overrides})


def _norm_key(layer: int, branch: int, reversible: bool) -> str:
    stack = "sinkhorn_transformer.layers."
    if reversible:
        return f"{stack}blocks.{layer}.{'fg'[branch]}.net.norm.weight"
    return f"{stack}layers.{layer}.{branch}.norm.weight"


@pytest.mark.parametrize("reversible", [False, True], ids=["residual", "reversible"])
def test_weight_tie_with_trained_per_layer_layer_norms_converts_exactly(reversible):
    # the reference's weight_tie shares attention and feed-forward, not the pre-norms: training moves them apart
    ref, kwargs = reference(causal=True, weight_tie=True, reversible=reversible, depth=3)
    state = ref.state_dict()
    for branch in (0, 1):
        first = state[_norm_key(0, branch, reversible)]
        assert all(not torch.equal(first, state[_norm_key(i, branch, reversible)]) for i in (1, 2))
    model = convert(state, kwargs)
    assert max_diff(ref, model) < ATOL
    layers = model.model.layers
    assert layers[2].attention.attention is layers[0].attention.attention
    assert layers[2].feed_forward.net is layers[0].feed_forward.net
    assert torch.equal(layers[2].attention.norm.weight, state[_norm_key(2, 0, reversible)])
    # one name per shared weight: the saved state dict holds the attention weights once
    assert not any(k.startswith("model.layers.1.attention.attention.") for k in model.state_dict())


def test_weight_tie_checkpoint_with_untied_weights_is_refused():
    ref, kwargs = reference(causal=True, weight_tie=True)
    state = dict(ref.state_dict())
    key = "sinkhorn_transformer.layers.layers.1.0.fn.to_q.weight"
    state[key] = state[key] + 0.5  # a layer whose attention is not layer 0's: not what weight_tie=True builds
    with pytest.raises(ValueError, match="weight_tie=True but .*layers.1.0.fn.to_q.weight"):
        convert_state_dict(state, kwargs)


def test_reference_models_are_trained_so_every_parameter_moved():
    fresh, _ = reference(train=False, causal=True, weight_tie=True, pkm_layers=(2,), pkm_num_keys=32, depth=3)
    trained, _ = reference(causal=True, weight_tie=True, pkm_layers=(2,), pkm_num_keys=32, depth=3)
    before, after = fresh.state_dict(), trained.state_dict()
    assert [k for k in before if torch.equal(before[k], after[k])] == []


def test_cli_writes_a_folder_that_auto_loads_with_the_reference_logits(tmp_path, capsys):
    from transformers import AutoModelForCausalLM

    import longrange  # noqa: F401  registers the Auto classes

    ref, kwargs = reference(causal=True, n_local_attn_heads=1, emb_dim=16)
    torch.save({"model_state_dict": ref.state_dict(), "step": 3}, tmp_path / "ckpt.pt")
    (tmp_path / "kwargs.json").write_text(json.dumps(kwargs))
    from longrange.commands import convert as script

    script.main([str(tmp_path / "ckpt.pt"), str(tmp_path / "kwargs.json"), str(tmp_path / "out"), "--check"])
    printed = capsys.readouterr().out
    assert "max |logit difference|" in printed
    assert float(printed.rsplit(":", 1)[1]) < ATOL
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert max_diff(ref, loaded) < ATOL


def test_config_mapping_names():
    config = config_from_reference({**BASE, "causal": True, "temperature": 0.5, "emb_dim": 16})
    assert (config.vocab_size, config.hidden_size, config.num_hidden_layers) == (50, 32, 2)
    assert (config.emb_dim, config.sort_temperature, config.max_position_embeddings) == (16, 0.5, 64)
    # non-causal attention sort net: the reference takes its top-k at temperature 1 whatever `temperature` is
    assert config_from_reference({**BASE, "temperature": 0.5}).sort_temperature == 1.0


def test_short_causal_inputs_differ_only_below_n_top_buckets_buckets():
    # the reference uses min(n_top_buckets, buckets) null buckets; here always n_top_buckets
    ref, kwargs = reference(causal=True, n_top_buckets=3)
    model = convert(ref.state_dict(), kwargs)
    assert max_diff(ref, model, length=16) > 1e-3  # 2 buckets < 3
    assert max_diff(ref, model, length=24) < ATOL  # 3 buckets
