"""Sinkhorn generation cache: static shapes and compiled decoding, batch invariance with padding, crop (assisted and
prompt-lookup decoding). Every check compares against an independent computation: the uncached forward of the
unpadded prompt, or each prompt generated alone."""

from functools import partial

import pytest
import torch
from transformers import CompileConfig, pipeline

from longrange.cache_sinkhorn import SinkhornCache
from longrange.compat import CACHE_NAME
from longrange.configuration_sinkhorn import SinkhornConfig
from longrange.modeling_sinkhorn import SinkhornForCausalLM
from longrange.tokenization import byte_tokenizer
from tests.dispatch_utils import (
    count_dispatched_ops,
    kernel_ops,
    moved_tensors,
    needs_current_assisted_decoding,
    needs_traceable_outputs,
    number_inputs,
    record_cache_addresses,
    recording_backend,
    sync_ops,
)

TINY = dict(vocab_size=40, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, bucket_size=4)
# local heads, ordinary and shifted causal Sinkhorn heads; the causal defaults otherwise (no SortCut)
VARIANTS = {
    "local+shifted": dict(n_local_attn_heads=1, n_top_buckets=2),
    "paired": dict(n_top_buckets=1),
    "running-keys": dict(n_local_attn_heads=2, n_top_buckets=2, causal_key_summary="running_mean_sum"),
}


def causal_lm(seed=0, **overrides):
    torch.manual_seed(seed)
    config = SinkhornConfig(**{**TINY, "causal": True, "max_position_embeddings": 128, **overrides})
    return SinkhornForCausalLM(config).eval()


def left_pad(prompts, pad_id=0):
    """Left-padded batch of prompts of different lengths (padding ids random-looking: they must not matter)."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = p
        ids[i, : width - len(p)] = (torch.arange(width - len(p)) * 7 + i) % 40
        mask[i, width - len(p) :] = 1
    return ids, mask


def prompts_of(lengths, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 40, (n,), generator=g) for n in lengths]


# ------------------------------------------------------------------------------------------------------------------
# batch invariance
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_left_padded_forward_equals_unpadded_forward_on_real_tokens(variant):
    model = causal_lm(seed=2, **VARIANTS[variant])
    prompts = prompts_of([23, 9, 14, 2])  # several buckets of 4, padding of every length mod 4
    ids, mask = left_pad(prompts)
    with torch.no_grad():
        batched = model(ids, attention_mask=mask, use_cache=False).logits
        for i, p in enumerate(prompts):
            alone = model(p[None], use_cache=False).logits[0]
            torch.testing.assert_close(batched[i, ids.shape[1] - len(p) :], alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_batched_left_padded_greedy_and_beam_generate_equal_per_prompt_generation(variant):
    model = causal_lm(seed=3, **VARIANTS[variant])
    prompts = prompts_of([11, 2, 6], seed=4)  # padded by 0, 9 and 5 (buckets of 4)
    ids, mask = left_pad(prompts)
    for extra in (dict(), dict(num_beams=2)):
        kwargs = dict(max_new_tokens=14, do_sample=False, pad_token_id=0, eos_token_id=None, **extra)
        kwargs.update(output_scores=True, return_dict_in_generate=True)
        batched = model.generate(ids, attention_mask=mask, **kwargs)
        for i, p in enumerate(prompts):
            alone = model.generate(p[None], **kwargs)
            assert torch.equal(batched.sequences[i, ids.shape[1] :], alone.sequences[0, len(p) :]), (extra, i)
            if not extra:  # greedy: the next-token scores of every step too
                for got, want in zip(batched.scores, alone.scores):
                    torch.testing.assert_close(got[i], want[0], rtol=1e-5, atol=1e-5)


def test_pipeline_batch_size_1_and_8_give_the_same_texts():
    tok = byte_tokenizer()
    tok.padding_side = "left"
    special = dict(pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = causal_lm(seed=5, **{**VARIANTS["local+shifted"], "vocab_size": len(tok), **special})
    generator = pipeline("text-generation", model=model, tokenizer=tok)
    texts = ["To be", "or not to be, that is", "the question", "Whether 'tis nobler in the mind to suffer", "a"]
    kwargs = dict(max_new_tokens=10, do_sample=False)
    one = [out[0]["generated_text"] for out in generator(texts, batch_size=1, **kwargs)]
    eight = [out[0]["generated_text"] for out in generator(texts, batch_size=8, **kwargs)]
    assert one == eight


# ------------------------------------------------------------------------------------------------------------------
# static cache and compiled decoding
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("lengths", [[9, 4], [5]])
def test_static_generate_steps_route_only_when_a_row_starts_a_bucket(lengths, monkeypatch):
    """The static steps of generate() (an accelerator's, compiled or not) skip routing, and keep their windows, on
    the steps where the host knows no row's token leads a bucket of either offset (the first step after the prompt
    builds the windows), and give the tokens of routing at every step."""
    from longrange.sinkhorn_heads import CausalSinkhornHeads

    model = causal_lm(seed=7, **{**VARIANTS["local+shifted"], "bucket_size": 8})
    ids, mask = left_pad(prompts_of(lengths, seed=8))
    new, route = 12, CausalSinkhornHeads._route

    def generate(plan: bool):
        calls = []
        monkeypatch.setattr(CausalSinkhornHeads, "_route", lambda self, *a: calls.append(1) or route(self, *a))
        if not plan:  # as before: every static step computes a routing choice
            monkeypatch.setattr(SinkhornCache, "plan_real_step", lambda self: None)
        cache = SinkhornCache(model.config, max_cache_len=32, static_steps=True)
        kwargs = {CACHE_NAME: cache, "max_new_tokens": new, "do_sample": False, "pad_token_id": 0}
        out = model.generate(ids, attention_mask=mask, eos_token_id=None, **kwargs)
        monkeypatch.undo()
        return out, len(calls)

    planned, routed = generate(plan=True)
    every, routed_every = generate(plan=False)
    assert torch.equal(planned, every)
    per_step = routed_every // (new - 1)  # decoding steps after the prompt's forward
    positions = [[n + step for n in lengths] for step in range(new - 1)]  # each row's new token's position
    leading = sum(
        step == 0 or any((p + off) % 8 == 0 for p in row for off in (0, 1)) for step, row in enumerate(positions)
    )
    assert 0 < leading < new - 1 and routed == leading * per_step


def test_a_static_step_that_does_not_route_launches_a_fraction_of_the_kernels():
    """What skipping routing and keeping the windows buys an accelerator's decoding step (a kernel each operator
    there), without any host read: the step after the one that rebuilt the windows."""
    model = causal_lm(seed=7, **{**VARIANTS["local+shifted"], "bucket_size": 8})
    cache = SinkhornCache(model.config, max_cache_len=64, static_steps=True)
    token = torch.tensor([[5]])
    with torch.no_grad():
        model(torch.randint(1, 40, (1, 10)), cache=cache, use_cache=True)

        def step():  # positions 10 then 11: neither leads a bucket of offset 0 or 1
            cache.plan_real_step()
            return model(token, cache=cache, use_cache=True)

        rebuilding, keeping = count_dispatched_ops(step), count_dispatched_ops(step)
    assert sync_ops(rebuilding) == sync_ops(keeping) == {}
    assert sum(kernel_ops(keeping).values()) < 0.5 * sum(kernel_ops(rebuilding).values())


def test_generate_sizes_a_static_compileable_cache():
    model = causal_lm(**VARIANTS["local+shifted"])
    out = model.generate(
        torch.randint(1, 40, (1, 6)),
        max_new_tokens=5,
        do_sample=False,
        pad_token_id=0,
        return_dict_in_generate=True,
    )
    cache = getattr(out, CACHE_NAME)
    assert isinstance(cache, SinkhornCache) and cache.is_compileable
    assert cache.max_cache_len == 10 and cache.capacity == 12  # generate's max_length - 1, in whole buckets
    assert cache.layers[0].keys.shape[2] == cache.slots and cache.get_seq_length() == 10


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_host_following_cpu_steps_equal_static_steps_and_skip_routing_between_bucket_starts(variant):
    """Eager CPU steps read positions on the host and reuse their working windows between bucket starts: the logits
    of the static steps (which compiled decoding runs) at every step, to float rounding (the window is cut after
    the last slot reached), through bucket starts of both head offsets and a padding step; a step that starts no
    bucket runs no routing (sort / top-k) and fewer operators."""
    model = causal_lm(seed=6, **VARIANTS[variant])
    ids, mask = left_pad(prompts_of([9, 5], seed=15))
    tokens = torch.randint(1, 40, (2, 11), generator=torch.Generator().manual_seed(16))
    step_masks = torch.ones(2, 11, dtype=torch.long)
    step_masks[1, 3] = 0  # a padding step in one row, at a bucket start (position 8)
    logits, counts = {}, {}
    with torch.no_grad():
        for static in (False, True):
            cache = SinkhornCache(model.config, max_cache_len=32, static_steps=static)
            model(ids, attention_mask=mask, cache=cache, use_cache=True)
            m, logits[static], counts[static] = mask, [], []
            for t in range(tokens.shape[1]):
                m = torch.cat([m, step_masks[:, t : t + 1]], dim=1)
                run = partial(model, tokens[:, t : t + 1], attention_mask=m, cache=cache, use_cache=True)
                counts[static].append(
                    count_dispatched_ops(lambda run=run, out=logits[static]: out.append(run().logits))
                )
    for t, (host, static) in enumerate(zip(logits[False], logits[True])):
        torch.testing.assert_close(host, static, rtol=1e-6, atol=1e-6, msg=f"step {t}")
    # step 1: rows at positions 10 and 6, no bucket start of either offset (bucket 4); the window of step 0 is kept
    host_ops, static_ops = counts[False][1], counts[True][1]
    routing = ("aten.sort", "aten.topk", "aten.argmax")  # (top_indices: a sort; argmax rounds when exporting)
    assert sum(host_ops[name] for name in routing) == 0 < sum(static_ops[name] for name in routing)
    assert host_ops["aten.index_select"] < static_ops["aten.index_select"]
    assert sum(host_ops.values()) < sum(static_ops.values())


@needs_traceable_outputs
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cached_decoding_step_is_one_graph_without_host_reads(variant):
    model = causal_lm(seed=6, **VARIANTS[variant])
    ids, mask = left_pad(prompts_of([10, 5]))
    with torch.no_grad():
        cache = SinkhornCache(model.config, max_cache_len=32, static_steps=True)  # as compiled steps run
        first = model(ids, attention_mask=mask, cache=cache, use_cache=True)
        token = first.logits[:, -1:].argmax(-1)
        step = dict(attention_mask=torch.ones(2, 1, dtype=torch.long), cache=cache, use_cache=True)
        assert sync_ops(count_dispatched_ops(lambda: model(token, **step))) == {}
        explained = torch._dynamo.explain(model)(token, **step)
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons


def _compiled_generate_equals_eager_and_uncached(backend, monkeypatch):
    model = causal_lm(seed=7, **VARIANTS["local+shifted"])
    ids, mask = left_pad(prompts_of([9, 4], seed=8))
    kwargs = dict(attention_mask=mask, max_new_tokens=12, do_sample=False, pad_token_id=0, eos_token_id=None)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    eager = model.generate(ids, **kwargs)
    graphs = []
    config = CompileConfig(fullgraph=True, backend=recording_backend(graphs, backend))
    config._compile_all_devices = True  # compile on the CPU too (generate() compiles by itself on accelerators)
    model.generation_config.compile_config = config
    torch._dynamo.reset()
    records, processors = record_cache_addresses(model, monkeypatch)
    compiled = model.generate(ids, logits_processor=processors, **kwargs)
    assert torch.equal(eager, uncached) and torch.equal(compiled, eager)
    # two graphs for all 12 steps (steps where some row starts a bucket route, the others skip routing), taking
    # no Python number
    assert len(graphs) == 2 and number_inputs(graphs) == []
    # what CUDA graphs need: the steps update the cache where the prompt's forward allocated it
    assert len(records) == 12 and moved_tensors(records) == []
    return model


@needs_traceable_outputs
def test_generate_compiles_decoding_steps_and_gives_the_eager_tokens(monkeypatch):
    from torch._dynamo.utils import counters

    counters.clear()
    _compiled_generate_equals_eager_and_uncached("eager", monkeypatch)  # dynamo's full-graph trace, no code generation
    assert counters["stats"]["unique_graphs"] == 2  # routing steps and the others: no recompilation per step


@pytest.mark.slow
@needs_traceable_outputs
def test_inductor_compiled_generate_gives_the_eager_tokens(monkeypatch):
    _compiled_generate_equals_eager_and_uncached("inductor", monkeypatch)


# ------------------------------------------------------------------------------------------------------------------
# crop: assisted and prompt-lookup decoding
# ------------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_crop_restores_the_state_of_a_cache_built_from_the_first_tokens(variant):
    model = causal_lm(seed=9, **VARIANTS[variant])
    ids, mask = left_pad(prompts_of([13, 6], seed=10))
    ids = torch.cat([ids, torch.randint(1, 40, (2, 11))], dim=1)  # 11 more tokens, fed one by one
    mask = torch.cat([mask, torch.ones(2, 11, dtype=torch.long)], dim=1)
    nxt = torch.randint(1, 40, (2, 1))
    with torch.no_grad():
        cache = model(ids[:, :13], attention_mask=mask[:, :13], use_cache=True).cache
        for t in range(13, ids.shape[1]):
            model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache, use_cache=True)
        for keep in (22, 19, 16, 14):  # across bucket boundaries of both head offsets
            cache.crop(keep - cache.get_seq_length())  # transformers' convention: crop(-tokens to remove)
            assert cache.get_seq_length() == keep
            step_mask = torch.cat([mask[:, :keep], torch.ones(2, 1, dtype=torch.long)], dim=1)
            after_crop = model(nxt, attention_mask=step_mask, cache=cache, use_cache=True).logits
            cache.crop(keep)  # a positive argument: the number of tokens to keep
            fresh = model(ids[:, :keep], attention_mask=mask[:, :keep], use_cache=True).cache
            expected = model(nxt, attention_mask=step_mask, cache=fresh, use_cache=True).logits
            torch.testing.assert_close(after_crop, expected, rtol=1e-5, atol=1e-5)
            # and the independent reference: the uncached forward of the whole sequence
            full = model(torch.cat([ids[:, :keep], nxt], 1), attention_mask=step_mask, use_cache=False).logits
            torch.testing.assert_close(after_crop[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)


def cross_attending(seed):
    """A causal model with cross-attention and a batch of 2 contexts (the first padded) -> model, forward kwargs."""
    model = causal_lm(seed=seed, receives_context=True, context_bucket_size=3, n_top_buckets=2)
    context = torch.randn(2, 10, TINY["hidden_size"])
    context_mask = torch.ones(2, 10, dtype=torch.long)
    context_mask[0, 7:] = 0
    return model, dict(encoder_hidden_states=context, encoder_attention_mask=context_mask)


def test_crop_restores_cross_attention_routing():
    model, ctx = cross_attending(seed=13)
    ids, mask = left_pad(prompts_of([12, 5], seed=14))
    nxt = torch.randint(1, 40, (2, 1))
    with torch.no_grad():
        cache = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True, **ctx).cache
        for t in range(6, 12):
            model(ids[:, t : t + 1], attention_mask=mask[:, : t + 1], cache=cache, use_cache=True)
        cache.crop(7)
        step_mask = torch.cat([mask[:, :7], torch.ones(2, 1, dtype=torch.long)], dim=1)
        after_crop = model(nxt, attention_mask=step_mask, cache=cache, use_cache=True).logits[:, -1]
        full = model(torch.cat([ids[:, :7], nxt], 1), attention_mask=step_mask, use_cache=False, **ctx).logits
    torch.testing.assert_close(after_crop, full[:, -1], rtol=1e-5, atol=1e-5)


@needs_current_assisted_decoding
def test_assisted_and_prompt_lookup_generate_equal_greedy_decoding():
    model = causal_lm(seed=11, **{**VARIANTS["local+shifted"], "hidden_size": 32, "num_hidden_layers": 3})
    assistant = causal_lm(seed=12, **VARIANTS["paired"])
    prompt = torch.tensor([[5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7]])  # repeats: prompt lookup finds candidates
    kwargs = dict(max_new_tokens=20, do_sample=False, pad_token_id=0, eos_token_id=None)
    greedy = model.generate(prompt, **kwargs)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assisted = model.generate(prompt, assistant_model=assistant, **kwargs)
    lookup = model.generate(prompt, prompt_lookup_num_tokens=3, **kwargs)
    assert torch.equal(greedy, uncached)
    assert torch.equal(assisted, greedy)
    assert torch.equal(lookup, greedy)


def test_crop_rejects_impossible_lengths():
    model = causal_lm()
    with torch.no_grad():
        cache = model(torch.randint(1, 40, (1, 6)), use_cache=True).cache
    with pytest.raises(ValueError, match="cannot keep"):
        cache.crop(-7)
    with pytest.raises(ValueError, match="cannot keep"):
        cache.crop(9)


# ------------------------------------------------------------------------------------------------------------------
# chunks: several new tokens on a filled cache (a chunked prompt, a chat's next turn, assisted decoding's candidates)
# ------------------------------------------------------------------------------------------------------------------

CHUNK_VARIANTS = {**VARIANTS, "weighted-keys": dict(n_top_buckets=2, weight_routed_keys=True)}


def fed_in_chunks(model, ids, mask, sizes, **kwargs):
    """Logits and last-layer hidden states of `ids` fed as a prefill then chunks of `sizes` on its cache, joined."""
    logits, hidden, cache, start = [], [], None, 0
    with torch.no_grad():
        for size in sizes:
            end = start + size
            out = model(
                ids[:, start:end], attention_mask=mask[:, :end], cache=cache, use_cache=True,
                output_hidden_states=True, **(kwargs if cache is None else {}),
            )  # fmt: skip
            logits.append(out.logits)
            hidden.append(out.hidden_states[-1])
            cache, start = out.cache, end
    return torch.cat(logits, 1), torch.cat(hidden, 1), cache


@pytest.mark.parametrize("path", ["chunk", "steps"])
@pytest.mark.parametrize("variant", sorted(CHUNK_VARIANTS))
def test_chunks_on_a_filled_cache_equal_the_uncached_forward(variant, path, monkeypatch):
    monkeypatch.setattr(SinkhornCache, "chunk_ratio", 10**6 if path == "chunk" else 0)  # 0: one token at a time
    model = causal_lm(seed=21, **CHUNK_VARIANTS[variant])
    ids, mask = left_pad(prompts_of([7, 3], seed=22))
    more = torch.randint(1, 40, (2, 30))
    more_mask = torch.ones(2, 30, dtype=torch.long)
    more_mask[1, 8:10] = 0  # padding inside a chunk of row 1 (dropped, as a forward drops it)
    more_mask[0, 20] = 0
    ids, mask = torch.cat([ids, more], 1), torch.cat([mask, more_mask], 1)
    sizes = [5, 4, 1, 9, 2, 7, 1, 1, 1, 6]  # chunks that start and end inside and across buckets of 4
    chunked, hidden, cache = fed_in_chunks(model, ids, mask, sizes)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False, output_hidden_states=True)
    real = mask.bool()
    torch.testing.assert_close(chunked[real], full.logits[real], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(hidden[real], full.hidden_states[-1][real], rtol=1e-5, atol=1e-5)
    assert cache.get_seq_length() == ids.shape[1]
    assert cache.lengths.tolist() == mask.sum(1).tolist()


def test_a_chunk_runs_each_layer_once_and_a_few_tokens_on_a_long_cache_step():
    model = causal_lm(seed=23, max_position_embeddings=512, **VARIANTS["local+shifted"])
    calls = []
    for layer in model.model.layers:
        layer.register_forward_hook(lambda *args: calls.append(1))
    ids = torch.randint(1, 40, (1, 330))
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        cache = model(ids[:, :10], use_cache=True).cache
        calls.clear()
        model(ids[:, 10:300], cache=cache, use_cache=True)  # 290 tokens on 10: one chunk
        assert len(calls) == layers
        calls.clear()
        cache.chunk_ratio = 128  # (the default, 512, would take 2 tokens on 300 as a chunk)
        model(ids[:, 300:302], cache=cache, use_cache=True)  # 2 tokens on 300: 2 * 128 < 302, two steps
        assert len(calls) == 2 * layers
        calls.clear()
        model(ids[:, 302:305], cache=cache, use_cache=True)  # 3 tokens on 302: 3 * 128 >= 305, one chunk
        assert len(calls) == layers
        after = model(ids[:, 305:306], cache=cache, use_cache=True).logits  # a step on the rebuilt state
        full = model(ids[:, :306], use_cache=False).logits
    assert cache.get_seq_length() == 306
    torch.testing.assert_close(after[:, -1], full[:, -1], rtol=1e-5, atol=1e-5)


def test_chunks_with_cross_attention_equal_the_uncached_forward():
    model, ctx = cross_attending(seed=24)
    ids, mask = left_pad(prompts_of([25, 14], seed=25))
    chunked, _, _ = fed_in_chunks(model, ids, mask, [6, 9, 1, 9], **ctx)
    with torch.no_grad():
        full = model(ids, attention_mask=mask, use_cache=False, **ctx).logits
    real = mask.bool()
    torch.testing.assert_close(chunked[real], full[real], rtol=1e-5, atol=1e-5)


def test_a_chat_continues_from_the_cache_of_its_last_turn():
    """generate() handed the cache of the previous turn feeds the new turn's tokens as one chunk: the same tokens as
    generating from the whole conversation without a cache."""
    model = causal_lm(seed=26, **VARIANTS["local+shifted"])
    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, return_dict_in_generate=True)
    first = model.generate(torch.randint(1, 40, (1, 9)), max_new_tokens=7, **kwargs)
    turn = torch.cat([first.sequences, torch.randint(1, 40, (1, 13))], 1)
    cache = getattr(first, CACHE_NAME)
    cached = model.generate(turn, max_new_tokens=9, **kwargs, **{CACHE_NAME: cache})
    uncached = model.generate(turn, max_new_tokens=9, use_cache=False, **kwargs)
    assert torch.equal(cached.sequences, uncached.sequences)
