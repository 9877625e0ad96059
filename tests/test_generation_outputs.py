"""generate() as transformers users call it, for both causal models: continuing from `inputs_embeds` or token ids
with an earlier call's cache, assisted decoding with and without `output_attentions`, `cache_implementation`, and
the dict outputs users collect (scores, attentions, hidden states) checked row by row against one forward over the
whole generated sequence without a cache."""

from __future__ import annotations

import pytest
import torch

from longrange import (
    CompressiveConfig,
    CompressiveForCausalLM,
    CompressiveMemoryCache,
    SinkhornConfig,
    SinkhornForCausalLM,
)
from longrange.compat import CACHE_NAME
from tests.dispatch_utils import needs_current_assisted_decoding

VOCAB, PROMPT, NEW = 40, 7, 6


def compressive(seed=0):
    torch.manual_seed(seed)
    config = CompressiveConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        segment_length=4, mem_len=4, c_mem_len=3, compression_rate=2, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return CompressiveForCausalLM(config).eval()


def sinkhorn(seed=0):
    torch.manual_seed(seed)
    config = SinkhornConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, bucket_size=4, causal=True,
        max_position_embeddings=64, n_local_attn_heads=1, pad_token_id=0, eos_token_id=None,
    )  # fmt: skip
    return SinkhornForCausalLM(config).eval()


MODELS = {"compressive": compressive, "sinkhorn": sinkhorn}
GREEDY = dict(do_sample=False, max_new_tokens=NEW)


def prompt(batch=2):
    return torch.randint(1, VOCAB, (batch, PROMPT), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("embeds", [False, True], ids=["ids", "inputs_embeds"])
def test_generation_continues_from_an_earlier_calls_cache(name, embeds):
    model, ids = MODELS[name](), prompt()
    whole = model.generate(ids, **GREEDY)[:, PROMPT:]
    embed = model.get_input_embeddings()
    inputs = dict(inputs_embeds=embed(ids)) if embeds else dict(input_ids=ids)
    first = model.generate(**inputs, do_sample=False, max_new_tokens=3, return_dict_in_generate=True)
    new = first.sequences[:, -3:]  # (generate returns only the new tokens when given embeddings)
    more = (
        dict(inputs_embeds=torch.cat([inputs["inputs_embeds"], embed(new)], 1))
        if embeds
        else dict(input_ids=torch.cat([ids, new], 1))
    )
    second = model.generate(**more, **{CACHE_NAME: getattr(first, CACHE_NAME)}, do_sample=False, max_new_tokens=3)
    assert torch.equal(torch.cat([new, second[:, -3:]], 1), whole)


@needs_current_assisted_decoding
@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("outputs", ["", "attentions", "hidden_states", "attentions+hidden_states"])
def test_assisted_decoding_gives_the_greedy_tokens(name, outputs):
    # a draft model with other weights: most of its tokens are rejected, so the cache is cropped again and again;
    # the target model scores several candidate tokens per forward, on top of its filled cache
    model, draft, ids = MODELS[name](0), MODELS[name](1), prompt(batch=1)
    asked = dict(output_attentions="attentions" in outputs, output_hidden_states="hidden_states" in outputs)
    settings = dict(return_dict_in_generate=True, **asked, **{**GREEDY, "max_new_tokens": 12})
    plain = model.generate(ids, **settings)
    out = model.generate(ids, assistant_model=draft, **settings)
    assert torch.equal(out.sequences, plain.sequences)
    assert (out.attentions is not None) == asked["output_attentions"]
    assert (out.hidden_states is not None) == asked["output_hidden_states"]
    if asked["output_hidden_states"]:  # one entry per new token, each layer's states of the tokens it scored
        assert len(out.hidden_states) == len(plain.hidden_states) == 12
        for got, expected in zip(out.hidden_states, plain.hidden_states):
            for layer_got, layer_expected in zip(got, expected, strict=True):
                torch.testing.assert_close(layer_got, layer_expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", MODELS)
def test_several_tokens_on_a_filled_cache_return_every_tokens_hidden_states(name):
    # what assisted decoding asks: several new tokens in one forward on top of a filled cache
    model, ids = MODELS[name](), prompt()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding in the prefill
    with torch.no_grad():
        full = model(ids, attention_mask=mask, output_hidden_states=True, use_cache=False)
        cache = getattr(model(ids[:, :3], attention_mask=mask[:, :3], use_cache=True), CACHE_NAME)
        cached = model(ids[:, 3:], attention_mask=mask, **{CACHE_NAME: cache}, output_hidden_states=True)
    assert cached.hidden_states is not None
    assert len(cached.hidden_states) == len(full.hidden_states) == model.config.num_hidden_layers + 1
    real = mask[:, 3:, None].bool()
    for got, expected in zip(cached.hidden_states, full.hidden_states):
        torch.testing.assert_close(got * real, expected[:, 3:] * real, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(cached.logits, full.logits[:, 3:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("implementation", ["static", "dynamic", "offloaded"])
def test_cache_implementation_is_answered_with_the_models_own_cache(name, implementation, caplog):
    model, ids = MODELS[name](), prompt()
    plain = model.generate(ids, **GREEDY)
    with caplog.at_level("WARNING"):
        out = model.generate(ids, cache_implementation=implementation, **GREEDY)
    assert torch.equal(out, plain)
    assert model.generation_config.cache_implementation is None  # the user's config is left as it was


@pytest.mark.parametrize("name", MODELS)
def test_dict_outputs_match_one_forward_over_the_generated_sequence(name):
    model, ids = MODELS[name](), prompt()
    mask = torch.ones_like(ids)
    mask[1, :2] = 0  # left padding
    out = model.generate(
        ids, attention_mask=mask, output_scores=True, output_logits=True, output_attentions=True,
        output_hidden_states=True, return_dict_in_generate=True, **GREEDY,
    )  # fmt: skip
    sequence = out.sequences[:, :-1]  # every token fed to the model
    full_mask = torch.cat([mask, torch.ones(2, NEW - 1, dtype=mask.dtype)], 1)
    with torch.no_grad():
        full = model(sequence, attention_mask=full_mask, output_attentions=True, output_hidden_states=True)
    real = full_mask.bool()
    assert len(out.scores) == len(out.attentions) == len(out.hidden_states) == NEW
    for step in range(NEW):
        rows = slice(0, PROMPT) if step == 0 else slice(PROMPT + step - 1, PROMPT + step)
        torch.testing.assert_close(out.logits[step], full.logits[:, rows][:, -1], atol=1e-5, rtol=1e-5)
        for layer, (got, expected) in enumerate(zip(out.attentions[step], full.attentions)):
            expected = expected[:, :, rows]
            if name == "sinkhorn":  # [batch, heads, new tokens, tokens so far]
                expected = expected[..., : rows.stop]
            assert got.shape == expected.shape, (step, layer)
            keep = real[:, rows][:, None, :, None]  # (padding queries attend to nothing meaningful)
            torch.testing.assert_close(got * keep, expected * keep, atol=1e-5, rtol=1e-5)
        for got, expected in zip(out.hidden_states[step], full.hidden_states):
            keep = real[:, rows][..., None]
            torch.testing.assert_close(got * keep, expected[:, rows] * keep, atol=1e-5, rtol=1e-5)


def test_sinkhorn_step_attentions_need_the_prefill_to_ask_for_them():
    model, ids = sinkhorn(), prompt()
    with torch.no_grad():
        cache = model(ids, use_cache=True).cache
        with pytest.raises(ValueError, match="needs the forward that filled it to ask for output_attentions too"):
            model(ids[:, :1], cache=cache, output_attentions=True)


# ---- padding positions: transformers' GenerationTesterMixin pads at random (a mask may end with padding) -------


def llama(seed=0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=64, pad_token_id=0,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


def padded_prompt():
    """Two rows with padding at the start, in the middle and at the end (the last prompt token is padding, so
    generation's first token is read at a padding position)."""
    mask = torch.ones(2, PROMPT, dtype=torch.long)
    mask[0, 2:4] = 0
    mask[1, 0] = 0
    mask[:, -1] = 0
    return prompt(), mask


@pytest.mark.parametrize("name", ["llama", "compressive"])
def test_outputs_at_padding_positions_do_not_depend_on_later_tokens_or_the_cache(name):
    # Llama is the reference: a padding position's logits follow from the tokens before it only
    model = llama() if name == "llama" else compressive()
    ids, mask = padded_prompt()
    later = torch.randint(1, VOCAB, (2, 3), generator=torch.Generator().manual_seed(2))
    longer, longer_mask = torch.cat([ids, later], 1), torch.cat([mask, torch.ones_like(later)], 1)
    with torch.no_grad():
        alone = model(ids, attention_mask=mask, use_cache=False).logits
        calls = [model(longer, attention_mask=longer_mask, use_cache=False).logits[:, :PROMPT]]
        if name == "compressive":  # the cached forms: kept cache; a croppable one (its last tokens run as steps)
            calls.append(model(longer, attention_mask=longer_mask, use_cache=True).logits[:, :PROMPT])
            croppable = CompressiveMemoryCache(model.config.num_hidden_layers, crop_margin=4)
            calls.append(model(longer, attention_mask=longer_mask, cache=croppable).logits[:, :PROMPT])
    for logits in calls:
        torch.testing.assert_close(logits, alone, atol=1e-5, rtol=1e-5)


@needs_current_assisted_decoding
def test_compressive_assisted_decoding_equals_greedy_when_the_prompt_ends_with_padding():
    # transformers' test_assisted_decoding_matches_greedy_search with a random assistant: eager attention, norms
    # with eps 1.0, a random mask, repetition penalty and bad words, every output asked for
    model, draft = compressive(0), compressive(1)
    for module in [*model.modules(), *draft.modules()]:
        if isinstance(module, torch.nn.LayerNorm):
            module.eps = 1.0
    for m in (model, draft):
        m.set_attn_implementation("eager")
    draft.generation_config.num_assistant_tokens = 2
    draft.generation_config.num_assistant_tokens_schedule = "constant"
    ids, mask = padded_prompt()
    settings = dict(
        attention_mask=mask[:1], eos_token_id=-1, max_new_tokens=4, do_sample=False, return_dict_in_generate=True,
        output_scores=True, output_logits=True, output_hidden_states=True, output_attentions=True,
        repetition_penalty=1.2, bad_words_ids=[[1, 0]], remove_invalid_values=True,
    )  # fmt: skip
    greedy = model.generate(ids[:1], **settings)
    assisted = model.generate(ids[:1], assistant_model=draft, **settings)
    assert torch.equal(assisted.sequences, greedy.sequences)
    for got, expected in zip(assisted.scores, greedy.scores, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.parametrize("batch", [1, 2])
def test_every_decoding_step_gets_tensors_of_the_same_shapes_and_strides(name, batch, monkeypatch):
    """What a compiled decoding step is specialised on: a view of generate()'s growing sequence (a [batch, 1]
    slice, contiguous by PyTorch's rule when batch is 1) has strides that change at every step, and dynamo then
    recompiles and CUDA graphs record anew at every step (as measured on an H200: 59 tokens/s instead of 717)."""
    model, layouts = MODELS[name](), []
    forward = model.forward

    def spy(*args, **kwargs):
        layouts.append({k: (v.shape, v.stride()) for k, v in kwargs.items() if isinstance(v, torch.Tensor)})
        return forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", spy)
    ids = prompt(batch)
    model.generate(ids, attention_mask=torch.ones_like(ids), **GREEDY)
    steps = layouts[1:]  # after the prompt's forward
    assert len(steps) == NEW - 1 and "input_ids" in steps[0]
    assert all(step == steps[0] for step in steps), steps
