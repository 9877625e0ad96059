"""Property tests of the Sinkhorn Transformer over drawn configurations (hypothesis).

Every option a user sets is drawn, in every combination the config accepts (SinkhornConfig.validate_sinkhorn):
bucket size (1 included), causal (SinkhornForCausalLM) or not (SinkhornForMaskedLM), n_top_buckets, SortCut
(n_sortcut, non-causal only), local heads, dim_head (needed when heads do not divide hidden_size), the simple sort
net and its scores (non-causal only), Gumbel-Sinkhorn balancing (non_permutative=False, non-causal only),
sinkhorn_iter, sort temperature, routed-value / routed-key weights (keys need values), sequential routing weights
(need non_permutative), route_own_bucket (non-causal only), the causal reference options (causal_key_summary,
causal_null_score, null_bucket_copies, shifted_heads_skip_first_bucket; causal only), reversible layers, ff_chunks,
GLU, weight tie, product-key memory (keys, top-k, heads, key width, per-half norms), axial or one-row positions,
factorised embeddings (emb_dim, with norm_after_project_out only when emb_dim != hidden_size), output-layer bias,
tied output embedding, PyTorch or N(0, r) initialisation, the attention implementation (sdpa, eager), and for the
training step every dropout, layer dropout and randomly_truncate_sequence (training-only options).

Left out: receives_context / context_* (a decoder attending an encoder's states needs `encoder_hidden_states` on
every call and an encoder-decoder wrapper to generate; tests/test_sinkhorn_attention*.py cover it).

Each property is checked against an independent computation: the loss against a cross-entropy of the returned
logits, the future against a forward of the prefix alone, cached generation against recomputing the whole prefix
without a cache, a padded batch against each row alone, a reloaded model against the saved one.

Profiles and example counts: tests/property_utils.py (LONGRANGE_HYPOTHESIS=ci|large).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from longrange import SinkhornCache, SinkhornConfig, SinkhornForCausalLM, SinkhornForMaskedLM
from tests.property_utils import (
    PROPERTY_SETTINGS,
    assert_finite_training_step,
    greedy_reference,
    pad_rows,
    random_ids,
    seeds,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: tiny tensors, one thread

MAX_TOKENS = 40  # longest sequence any test feeds (prompt + generated tokens included)


@st.composite
def sinkhorn_options(draw, causal: bool | None = None, training: bool = False) -> dict:
    """Keyword arguments of a valid tiny SinkhornConfig (plus `attn_implementation`)."""
    if causal is None:
        causal = draw(st.booleans())
    hidden = draw(st.sampled_from([16, 24, 32]))
    heads = draw(st.integers(1, 4))
    dim_head = draw(st.none() | st.integers(2, 12))
    if dim_head is None and hidden % heads:
        dim_head = draw(st.integers(2, 12))  # the config needs dim_head when heads do not divide hidden_size
    layers = draw(st.integers(1, 2))
    simple = not causal and draw(st.booleans())  # the simple sort net is refused with causal=True
    non_permutative = causal or draw(st.booleans())  # Gumbel-Sinkhorn balancing is refused with causal=True
    weight_values = draw(st.booleans())
    emb_dim = draw(st.none() | st.sampled_from([8, 12, 16, 24, 40]))
    pkm_num_keys = draw(st.integers(2, 8))
    options = dict(
        vocab_size=draw(st.integers(5, 40)),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        dim_head=dim_head,
        intermediate_size=draw(st.none() | st.sampled_from([8, 16, 48])),
        ff_glu=draw(st.booleans()),
        emb_dim=emb_dim,
        max_position_embeddings=draw(st.integers(MAX_TOKENS, MAX_TOKENS + 7)),
        axial_position_embeddings=draw(st.booleans()),
        bucket_size=draw(st.integers(1, 8)),
        causal=causal,
        n_top_buckets=draw(st.integers(1, 3)),
        # SortCut is refused with causal=True, and with Gumbel-Sinkhorn balancing (non_permutative=False)
        n_sortcut=0 if causal or not non_permutative else draw(st.integers(0, 3)),
        use_simple_sort_net=simple,
        simple_sort_net_scores=draw(st.sampled_from(["log_relu", "relu"])) if simple else "log_relu",
        sinkhorn_iter=draw(st.integers(1, 5)),
        sort_temperature=draw(st.sampled_from([0.5, 0.75, 1.0, 1.5])),
        non_permutative=non_permutative,
        weight_routed_values=weight_values,
        weight_routed_keys=weight_values and draw(st.booleans()),  # keys need weight_routed_values
        sequential_routing_weights=non_permutative and draw(st.booleans()),  # needs non_permutative
        route_own_bucket=not causal and draw(st.booleans()),  # refused with causal=True
        n_local_attn_heads=draw(st.integers(0, heads)),
        reversible=draw(st.booleans()),
        ff_chunks=draw(st.integers(1, 4)),
        weight_tie=draw(st.booleans()),
        pkm_layers=draw(st.lists(st.integers(1, layers), unique=True, max_size=layers)),
        pkm_num_keys=pkm_num_keys,
        pkm_topk=draw(st.none() | st.integers(1, pkm_num_keys)),
        pkm_heads=draw(st.integers(1, 4)),
        pkm_dim_key=draw(st.none() | st.sampled_from([4, 8, 12])),
        pkm_norm_halves=draw(st.booleans()),
        lm_head_bias=draw(st.booleans()),
        # needs factorised embeddings of another width than hidden_size
        norm_after_project_out=emb_dim not in (None, hidden) and draw(st.booleans()),
        tie_word_embeddings=draw(st.booleans()),
        initializer_range=draw(st.sampled_from([None, 0.02, 0.1])),
        attn_implementation=draw(st.sampled_from(["sdpa", "eager"])),
    )
    if causal:  # the reference options of causal self-attention (refused with causal=False)
        options.update(
            causal_key_summary=draw(st.sampled_from(["mean", "running_mean_sum"])),
            causal_null_score=draw(st.sampled_from(["learned", "zero"])),
            null_bucket_copies=draw(st.booleans()),
            shifted_heads_skip_first_bucket=draw(st.booleans()),
        )
    if training:
        for name in ("emb_dropout", "ff_dropout", "attn_dropout", "attn_layer_dropout", "layer_dropout"):
            options[name] = draw(st.sampled_from([0.0, 0.1, 0.3]))
        options["randomly_truncate_sequence"] = causal and draw(st.booleans())
    return options


def build(options: dict, seed: int) -> SinkhornForCausalLM | SinkhornForMaskedLM:
    torch.manual_seed(seed)
    model_class = SinkhornForCausalLM if options["causal"] else SinkhornForMaskedLM
    return model_class(SinkhornConfig(**options)).eval()


def logits_of(model, ids, mask=None):
    kwargs = dict(use_cache=False) if model.config.causal else {}
    return model(ids, attention_mask=mask, **kwargs).logits


# ---------------------------------------------------------------------------------------------------------------
# (1) one training step: finite loss, finite gradients, finite parameters after an optimizer step
# ---------------------------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(
    options=sinkhorn_options(training=True),
    lengths=st.lists(st.integers(2, MAX_TOKENS - 3), min_size=1, max_size=3),
    optimizer=st.sampled_from(["sgd", "adamw"]),
    seed=seeds,
)
def test_training_step_is_finite(options, lengths, optimizer, seed):
    model = build(options, seed).train()
    vocab = options["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    rows = [random_ids(generator, vocab, (n,)) for n in lengths]
    ids, mask, _ = pad_rows(rows, "left", vocab, generator)
    labels = ids.masked_fill(mask == 0, -100)
    if not options["causal"]:  # masked LM: predict a few positions of each row (at least its first real token)
        keep = torch.rand(ids.shape, generator=generator) < 0.3
        keep[torch.arange(len(rows)), mask.argmax(1)] = True
        labels = labels.masked_fill(~keep, -100)
    out = model(ids, attention_mask=mask, labels=labels)
    if options["causal"] and not options.get("randomly_truncate_sequence"):
        # the loss is the mean cross-entropy of the returned logits over the shifted real labels (random truncation
        # changes the inputs and labels inside forward, so it is checked for finiteness only)
        logits, targets = out.logits[:, :-1], labels[:, 1:]
    elif not options["causal"]:
        logits, targets = out.logits, labels
    else:
        logits = None
    if logits is not None:
        expected = F.cross_entropy(logits.reshape(-1, vocab).float(), targets.reshape(-1), ignore_index=-100)
        torch.testing.assert_close(out.loss, expected, atol=1e-5, rtol=1e-5)

    def loss_after_step():
        with torch.no_grad():
            return model(ids, attention_mask=mask, labels=labels).loss

    assert_finite_training_step(model, out.loss, optimizer, loss_after_step)


# ---------------------------------------------------------------------------------------------------------------
# (2) causal models: the future never leaks. Not a property of SinkhornForMaskedLM: non-causal attention reads
# the whole sequence by design (each query bucket routes to any key bucket, SortCut's one summary covers all
# queries, local windows look one window ahead), so its earlier logits are meant to depend on later tokens.
# ---------------------------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(
    options=sinkhorn_options(causal=True),
    length=st.integers(2, MAX_TOKENS),
    pad=st.integers(0, 5),
    data=st.data(),
    grad=st.booleans(),
    seed=seeds,
)
def test_future_tokens_never_change_earlier_logits(options, length, pad, data, grad, seed):
    """Logits at positions <= t equal those of the prefix run alone, and do not move when every token after t is
    replaced. Row 1 is left-padded by `pad` (its real tokens are compared)."""
    model = build(options, seed)
    vocab = options["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    ids = random_ids(generator, vocab, (2, length))
    mask = torch.ones_like(ids)
    mask[1, : min(pad, length - 1)] = 0
    t = data.draw(st.integers(0, length - 2), label="t")
    changed = ids.clone()
    changed[:, t + 1 :] = (ids[:, t + 1 :] + random_ids(generator, vocab - 1, (2, length - t - 1)) + 1) % vocab
    with torch.set_grad_enabled(grad):
        full = logits_of(model, ids, mask).detach()
        other = logits_of(model, changed, mask).detach()
        prefix = logits_of(model, ids[:, : t + 1], mask[:, : t + 1]).detach()
    real = mask[:, : t + 1].bool()
    torch.testing.assert_close(prefix[real], full[:, : t + 1][real], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(other[:, : t + 1][real], full[:, : t + 1][real], atol=1e-5, rtol=1e-5)
    assert not torch.equal(other[:, t + 1], full[:, t + 1])  # the changed token itself is seen


# ---------------------------------------------------------------------------------------------------------------
# (3) cached generation equals uncached recomputation (causal only: SinkhornForMaskedLM has no cache and does not
# generate)
# ---------------------------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(
    options=sinkhorn_options(causal=True),
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=3),
    new_tokens=st.integers(1, 16),
    static_steps=st.booleans(),
    seed=seeds,
)
def test_cached_greedy_generation_equals_uncached_recomputation(options, lengths, new_tokens, static_steps, seed):
    """Both decoding paths: the CPU's host-following steps, and the static steps of an accelerator or a compiled
    step (`static_steps=True`)."""
    model = build(options, seed)
    vocab = options["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    ids, mask, _ = pad_rows([random_ids(generator, vocab, (n,)) for n in lengths], "left", vocab, generator)
    assert ids.shape[1] + new_tokens <= MAX_TOKENS
    cache = SinkhornCache(model.config, max_cache_len=ids.shape[1] + new_tokens, static_steps=static_steps)
    result = model.generate(
        ids,
        cache=cache,
        attention_mask=mask,
        max_new_tokens=new_tokens,
        min_new_tokens=new_tokens,
        do_sample=False,
        pad_token_id=0,
        eos_token_id=None,
        output_logits=True,
        return_dict_in_generate=True,
    )
    greedy_reference(model, ids, mask, result, new_tokens)


@PROPERTY_SETTINGS
@given(
    options=sinkhorn_options(causal=True),
    lengths=st.lists(st.integers(1, 20), min_size=1, max_size=3),
    chunks=st.lists(st.integers(1, 6), min_size=1, max_size=3),
    seed=seeds,
)
def test_chunks_on_a_filled_cache_equal_the_uncached_forward(options, lengths, chunks, seed):
    """A left-padded prompt, then several tokens at a time on its cache (a fifth of them padding, anywhere), each
    call one chunk (`SinkhornCache.begin_chunk`): the logits at every real token equal one forward over everything
    without a cache."""
    model = build(options, seed)
    vocab = options["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    prompt, prompt_mask, _ = pad_rows([random_ids(generator, vocab, (n,)) for n in lengths], "left", vocab, generator)
    more = random_ids(generator, vocab, (len(lengths), sum(chunks)))
    more_mask = (torch.rand(more.shape, generator=generator) < 0.8).long()
    ids, mask = torch.cat([prompt, more], 1), torch.cat([prompt_mask, more_mask], 1)
    assert ids.shape[1] <= MAX_TOKENS
    cache = SinkhornCache(model.config)
    cache.chunk_ratio = MAX_TOKENS  # every call of several tokens is a chunk
    with torch.no_grad():
        logits = [model(prompt, attention_mask=prompt_mask, cache=cache, use_cache=True).logits]
        start = prompt.shape[1]
        for size in chunks:
            step_mask = mask[:, : start + size]
            out = model(ids[:, start : start + size], attention_mask=step_mask, cache=cache, use_cache=True)
            logits.append(out.logits)
            start += size
        full = model(ids, attention_mask=mask, use_cache=False).logits
    real = mask.bool()
    torch.testing.assert_close(torch.cat(logits, 1)[real], full[real], rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# (4) padding and batch mates never change a row
# ---------------------------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(
    options=sinkhorn_options(),
    lengths=st.lists(st.integers(1, MAX_TOKENS - 3), min_size=2, max_size=4),
    layout=st.sampled_from(["left", "right", "both", "scattered"]),
    grad=st.booleans(),
    seed=seeds,
)
def test_padding_and_batch_mates_never_change_a_row(options, lengths, layout, grad, seed):
    """A batch of rows of different lengths, padded with random token ids (left, right, on both sides, or in
    scattered slots: SinkhornModel documents any padding, its real tokens moved to the front): each row's logits at
    its real tokens equal those of the row run alone, unpadded, with no attention mask."""
    # float64: a row alone and the same row in a batch run matrix products of other shapes, whose float32
    # rounding can flip a near-tie of a hard choice (routing, product keys, most-used slots); the property is
    # about what the model computes, so it is checked where rounding cannot decide a choice
    model = build(options, seed).double()
    vocab = options["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    rows = [random_ids(generator, vocab, (n,)) for n in lengths]
    ids, mask, where = pad_rows(rows, layout, vocab, generator)
    with torch.set_grad_enabled(grad):
        batched = logits_of(model, ids, mask).detach()
    for i, row in enumerate(rows):
        with torch.set_grad_enabled(grad):
            alone = logits_of(model, row[None]).detach()[0]
        torch.testing.assert_close(
            batched[i, where[i]], alone, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"row {i}: {m}"
        )


# ---------------------------------------------------------------------------------------------------------------
# (5) save_pretrained / from_pretrained: exactly the same logits
# ---------------------------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(options=sinkhorn_options(), length=st.integers(1, MAX_TOKENS), seed=seeds)
def test_save_and_load_give_exactly_equal_logits(options, length, seed, tmp_path):
    model = build(options, seed)
    ids = random_ids(torch.Generator().manual_seed(seed), options["vocab_size"], (2, length))
    with torch.no_grad():
        logits = logits_of(model, ids)
    path = tmp_path / f"model-{len(list(tmp_path.iterdir()))}"  # one folder per example (tmp_path is shared)
    model.save_pretrained(path)
    implementation = options["attn_implementation"]
    reloaded = type(model).from_pretrained(path, attn_implementation=implementation).eval()
    assert reloaded.config._attn_implementation == implementation
    saved, loaded = model.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    if options["tie_word_embeddings"]:
        assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(logits_of(reloaded, ids), logits)
    # transformers does not save the attention implementation: a plain reload runs the default ("sdpa"), which
    # computes the same numbers as "eager"
    default = type(model).from_pretrained(path).eval()
    with torch.no_grad():
        torch.testing.assert_close(logits_of(default, ids), logits, atol=1e-5, rtol=1e-5)
