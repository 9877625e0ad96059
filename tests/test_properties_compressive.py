"""Property tests of the Compressive Transformer over drawn configurations (hypothesis).

Every option a user sets is drawn, in every combination the config accepts: the compression function with each
reconstruction loss it allows (parameter-free functions only with "none", which the config enforces), the loss
weight, pre/post layer norm, product-key memory layers (keys, heads, top-k), tied embeddings, the attention
implementation (sdpa, eager, blockwise; with gradient enabled on the CPU "sdpa" runs the blockwise kernel, so both
gradient modes are drawn), segment / memory / compressed-memory lengths, the compression rate, dropout (training
only). Sizes are tiny (hidden 16-32, 1-2 layers) and sequences span several segments, so memories fill, overflow
and compress.

Each property is checked against an independent computation: the loss against a cross-entropy of the returned
logits, the future against a forward of the prefix alone, cached generation against recomputing the whole prefix
without a cache, a padded batch against each row alone, a reloaded model against the saved one.

Profiles and example counts: tests/property_utils.py (LONGRANGE_HYPOTHESIS=ci|large).
"""

from __future__ import annotations

import itertools

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given
from hypothesis import strategies as st

from longrange import CompressiveConfig, CompressiveForCausalLM
from longrange.configuration_compressive import (
    COMPRESSION_FUNCTIONS,
    RECONSTRUCTION_LOSSES,
    TRAINABLE_COMPRESSION_FUNCTIONS,
)
from tests.property_utils import (
    PROPERTY_SETTINGS,
    assert_finite_training_step,
    greedy_reference,
    pad_rows,
    random_ids,
    seeds,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: tiny tensors, one thread

# every (compression function, reconstruction loss) pair the config accepts: parameter-free functions (max_pool,
# mean_pool, most_used) have nothing to train, and the config refuses them with a reconstruction loss other than
# "none" (left out here for that reason)
COMPRESSION_PAIRS = [
    (function, loss)
    for function, loss in itertools.product(COMPRESSION_FUNCTIONS, RECONSTRUCTION_LOSSES)
    if loss == "none" or function in TRAINABLE_COMPRESSION_FUNCTIONS
]
ATTENTION = ["sdpa", "eager", "blockwise"]


@st.composite
def compressive_options(draw, training: bool = False) -> dict:
    """Keyword arguments of a valid tiny CompressiveConfig (plus `attn_implementation`)."""
    hidden = draw(st.sampled_from([16, 24, 32]))
    heads = draw(st.sampled_from([h for h in (1, 2, 4, 8) if hidden % h == 0]))
    layers = draw(st.integers(1, 2))
    rate = draw(st.integers(1, 3))
    function, reconstruction = draw(st.sampled_from(COMPRESSION_PAIRS))
    pkm_num_keys = draw(st.integers(2, 8))
    options = dict(
        vocab_size=draw(st.integers(5, 40)),
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=draw(st.sampled_from([16, 32, 64])),
        segment_length=draw(st.integers(1, 6)),
        mem_len=draw(st.integers(rate, 8)),  # the config needs mem_len >= compression_rate
        c_mem_len=draw(st.integers(1, 4)),
        compression_rate=rate,
        compression_function=function,
        reconstruction_loss=reconstruction,
        reconstruction_loss_weight=draw(st.sampled_from([0.0, 0.5, 1.0, 2.0])),
        layer_norm_position=draw(st.sampled_from(["pre", "post"])),
        pkm_layers=draw(st.lists(st.integers(1, layers), unique=True, max_size=layers)),
        pkm_num_keys=pkm_num_keys,
        pkm_heads=draw(st.integers(1, 4)),
        pkm_topk=draw(st.none() | st.integers(1, pkm_num_keys)),
        tie_word_embeddings=draw(st.booleans()),
        # larger weights than the 0.02 default too: tiny logits would hide small differences
        initializer_range=draw(st.sampled_from([0.02, 0.1, 0.3])),
        attn_implementation=draw(st.sampled_from(ATTENTION)),
    )
    if training:
        options.update(
            hidden_dropout=draw(st.sampled_from([0.0, 0.1, 0.3])),
            attention_dropout=draw(st.sampled_from([0.0, 0.1, 0.3])),
        )
    return options


def build(options: dict, seed: int) -> CompressiveForCausalLM:
    torch.manual_seed(seed)
    return CompressiveForCausalLM(CompressiveConfig(**options)).eval()


# ---------------------------------------------------------------------------------------------------------------
# (1) one training step: finite loss, finite gradients, finite parameters after an optimizer step
# ---------------------------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(
    options=compressive_options(training=True),
    lengths=st.lists(st.integers(2, 24), min_size=1, max_size=3),
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
    out = model(ids, attention_mask=mask, labels=labels)
    # the language-model loss is the mean cross-entropy of the returned logits over the shifted real labels
    expected = F.cross_entropy(
        out.logits[:, :-1].reshape(-1, vocab).float(), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    torch.testing.assert_close(out.lm_loss, expected, atol=1e-5, rtol=1e-5)
    if out.reconstruction_loss is not None:
        assert torch.isfinite(out.reconstruction_loss)
        weight = options["reconstruction_loss_weight"]
        torch.testing.assert_close(out.loss, out.lm_loss + weight * out.reconstruction_loss)

    def loss_after_step():
        with torch.no_grad():
            return model(ids, attention_mask=mask, labels=labels).loss

    assert_finite_training_step(model, out.loss, optimizer, loss_after_step)


# ---------------------------------------------------------------------------------------------------------------
# (2) the future never leaks
# ---------------------------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(
    options=compressive_options(),
    length=st.integers(2, 30),
    data=st.data(),
    grad=st.booleans(),
    seed=seeds,
)
def test_future_tokens_never_change_earlier_logits(options, length, data, grad, seed):
    """Logits at positions <= t equal those of the prefix ids[:, :t + 1] run alone, and do not move when every token
    after t is replaced."""
    model = build(options, seed)
    vocab = options["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    ids = random_ids(generator, vocab, (2, length))
    t = data.draw(st.integers(0, length - 2), label="t")
    changed = ids.clone()
    changed[:, t + 1 :] = (ids[:, t + 1 :] + random_ids(generator, vocab - 1, (2, length - t - 1)) + 1) % vocab
    with torch.set_grad_enabled(grad):
        full = model(ids, use_cache=False).logits.detach()
        other = model(changed, use_cache=False).logits.detach()
        prefix = model(ids[:, : t + 1], use_cache=False).logits.detach()
    torch.testing.assert_close(prefix, full[:, : t + 1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(other[:, : t + 1], full[:, : t + 1], atol=1e-5, rtol=1e-5)
    assert not torch.equal(other[:, t + 1], full[:, t + 1])  # the changed token itself is seen


# ---------------------------------------------------------------------------------------------------------------
# (3) cached generation equals uncached recomputation
# ---------------------------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(
    options=compressive_options(),
    lengths=st.lists(st.integers(1, 12), min_size=1, max_size=3),
    new_tokens=st.integers(1, 14),
    seed=seeds,
)
def test_cached_greedy_generation_equals_uncached_recomputation(options, lengths, new_tokens, seed):
    model = build(options, seed)
    vocab = options["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    ids, mask, _ = pad_rows([random_ids(generator, vocab, (n,)) for n in lengths], "left", vocab, generator)
    result = model.generate(
        ids,
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


# ---------------------------------------------------------------------------------------------------------------
# (4) padding and batch mates never change a row
# ---------------------------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(
    options=compressive_options(),
    lengths=st.lists(st.integers(1, 24), min_size=2, max_size=4),
    layout=st.sampled_from(["left", "right"]),
    grad=st.booleans(),
    seed=seeds,
)
def test_padding_and_batch_mates_never_change_a_row(options, lengths, layout, grad, seed):
    """A batch of rows of different lengths, padded with random token ids: each row's logits at its real tokens
    equal those of the row run alone, unpadded, with no attention mask."""
    # float64: a row alone and the same row in a batch run matrix products of other shapes, whose float32
    # rounding can flip a near-tie of a hard choice (routing, product keys, most-used slots); the property is
    # about what the model computes, so it is checked where rounding cannot decide a choice
    model = build(options, seed).double()
    vocab = options["vocab_size"]
    generator = torch.Generator().manual_seed(seed)
    rows = [random_ids(generator, vocab, (n,)) for n in lengths]
    ids, mask, where = pad_rows(rows, layout, vocab, generator)
    with torch.set_grad_enabled(grad):
        batched = model(ids, attention_mask=mask, use_cache=False).logits.detach()
    for i, row in enumerate(rows):
        with torch.set_grad_enabled(grad):
            alone = model(row[None], use_cache=False).logits.detach()[0]
        torch.testing.assert_close(
            batched[i, where[i]], alone, atol=1e-5, rtol=1e-5, msg=lambda m, i=i: f"row {i}: {m}"
        )


# ---------------------------------------------------------------------------------------------------------------
# (5) save_pretrained / from_pretrained: exactly the same logits
# ---------------------------------------------------------------------------------------------------------------


@PROPERTY_SETTINGS
@given(options=compressive_options(), length=st.integers(1, 20), seed=seeds)
def test_save_and_load_give_exactly_equal_logits(options, length, seed, tmp_path):
    model = build(options, seed)
    ids = random_ids(torch.Generator().manual_seed(seed), options["vocab_size"], (2, length))
    with torch.no_grad():
        logits = model(ids, use_cache=False).logits
    path = tmp_path / f"model-{len(list(tmp_path.iterdir()))}"  # one folder per example (tmp_path is shared)
    model.save_pretrained(path)
    reloaded = CompressiveForCausalLM.from_pretrained(path, attn_implementation=options["attn_implementation"]).eval()
    assert reloaded.config._attn_implementation == options["attn_implementation"]
    saved, loaded = model.state_dict(), reloaded.state_dict()
    assert saved.keys() == loaded.keys()
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    if options["tie_word_embeddings"]:
        assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    with torch.no_grad():
        assert torch.equal(reloaded(ids, use_cache=False).logits, logits)
    # transformers does not save the attention implementation: a plain reload runs the default ("sdpa"), which
    # computes the same numbers as the others
    default = CompressiveForCausalLM.from_pretrained(path).eval()
    with torch.no_grad():
        torch.testing.assert_close(default(ids, use_cache=False).logits, logits, atol=1e-5, rtol=1e-5)
