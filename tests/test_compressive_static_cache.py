"""Compressive cache, static form: rows at their own fills, padding that never enters the memories, compiled
decoding (issues 10 and 12).

Every expectation is an independent computation: the plain uncached forward of each prompt alone, unpadded, or
per-prompt generation checked against greedy decoding by full recomputation.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
from test_compressive_model import COMPRESSIONS, VOCAB, tiny_model  # noqa: F401
from transformers import CompileConfig, pipeline

from longrange import CompressiveForCausalLM, CompressiveMemoryCache
from longrange.compat import CACHE_NAME
from longrange.tokenization import byte_tokenizer
from tests.dispatch_utils import (
    count_dispatched_ops,
    moved_tensors,
    needs_current_assisted_decoding,
    needs_traceable_outputs,
    number_inputs,
    record_cache_addresses,
    recording_backend,
    sync_ops,
)

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: tiny tensors, one thread

# tiny_model: segment 4, memory 6, compressed memory 3, rate 2: 19 tokens fill both memories (4 segments)
OPTIONS = COMPRESSIONS + [dict(layer_norm_position="post"), dict(c_mem_len=0, mem_len=5)]  # the last: Transformer-XL


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def left_padded(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = prompt
        mask[row, width - len(prompt) :] = 1
    return ids, mask


def prompts_of(lengths, seed=0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(1, VOCAB, (n,), generator=generator) for n in lengths]


def greedy_by_full_recomputation(model, prompt: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """One prompt, no padding, no cache: every step re-runs the model over the whole sequence."""
    ids = prompt[None]
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = model(ids, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
    return ids[0]


@pytest.mark.parametrize("grad", [False, True])
@pytest.mark.parametrize("options", OPTIONS)
def test_left_padded_forward_and_its_cache_equal_each_row_alone(options, grad):
    """Rows of 19, 12 and 7 real tokens left-padded to 19: the real tokens' logits equal the unpadded forward of
    each row alone (segments, full memories and compressed memory included), and, without gradient, decoding on
    from the batched cache equals the unpadded forward of each row's continued sequence."""
    model = tiny_model(**options)
    prompts = prompts_of([19, 12, 7])
    ids, mask = left_padded(prompts)
    with torch.set_grad_enabled(grad):
        batched = model(ids, attention_mask=mask, use_cache=not grad)
    for row, prompt in enumerate(prompts):
        with torch.no_grad():
            alone = model(prompt[None]).logits[0]
        torch.testing.assert_close(batched.logits[row, -len(prompt) :], alone, atol=1e-5, rtol=0)
    if grad:
        return
    continuation = torch.randint(1, VOCAB, (3, 9), generator=torch.Generator().manual_seed(1))
    cache, steps = batched.cache, []
    with torch.no_grad():
        for t in range(continuation.shape[1]):
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(continuation[:, t : t + 1], attention_mask=mask, cache=cache, use_cache=True)
            cache = out.cache
            steps.append(out.logits)
        assert cache.is_static  # decoding steps keep the static form, rows at different fills
        steps = torch.cat(steps, dim=1)
        for row, prompt in enumerate(prompts):
            alone = model(torch.cat([prompt, continuation[row]])[None]).logits[0, len(prompt) :]
            torch.testing.assert_close(steps[row], alone, atol=1e-5, rtol=0)
        # a multi-token call on rows at different fills runs them one at a time, exactly
        more = torch.randint(1, VOCAB, (3, 6), generator=torch.Generator().manual_seed(2))
        mask = torch.cat([mask, torch.ones_like(more)], dim=1)
        logits = model(more, attention_mask=mask, cache=cache, use_cache=True).logits
        for row, prompt in enumerate(prompts):
            sequence = torch.cat([prompt, continuation[row], more[row]])
            alone = model(sequence[None]).logits[0, -more.shape[1] :]
            torch.testing.assert_close(logits[row], alone, atol=1e-5, rtol=0)


@pytest.mark.parametrize("options", COMPRESSIONS)
def test_batched_left_padded_greedy_and_beam_generate_equal_per_prompt_generation(options):
    model = tiny_model(**options)
    prompts = prompts_of([7, 2, 5], seed=3)
    ids, mask = left_padded(prompts)
    settings = dict(max_new_tokens=14, min_new_tokens=14, pad_token_id=0)
    greedy = model.generate(ids, attention_mask=mask, do_sample=False, **settings)
    beam = model.generate(ids, attention_mask=mask, do_sample=False, num_beams=3, **settings)
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt[None], do_sample=False, **settings)[0]
        assert torch.equal(alone, greedy_by_full_recomputation(model, prompt, 14))
        assert torch.equal(greedy[row, ids.shape[1] :], alone[len(prompt) :])
        alone_beam = model.generate(prompt[None], do_sample=False, num_beams=3, **settings)[0]
        assert torch.equal(beam[row, ids.shape[1] :], alone_beam[len(prompt) :])


def test_pipeline_gives_the_same_texts_with_batch_size_1_and_8():
    tokenizer = byte_tokenizer()
    tokenizer.padding_side = "left"
    model = tiny_model(vocab_size=len(tokenizer))
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    texts = ["a", "hello world", "memories", "the quick brown fox", "xy", "compressed memory", "segment", "zz top"]
    settings = dict(max_new_tokens=12, do_sample=False, return_full_text=False)
    one = [r[0]["generated_text"] for r in generator(texts, batch_size=1, **settings)]
    eight = [r[0]["generated_text"] for r in generator(texts, batch_size=8, **settings)]
    assert one == eight
    assert len(set(one)) > 1  # the texts depend on the prompts


@needs_traceable_outputs
@pytest.mark.parametrize(
    "options",  # conv1d; the dilated convolution (leading groups) and most-used (copies) paths compile more (slow)
    [
        dict(),
        pytest.param(COMPRESSIONS[1], marks=pytest.mark.slow),
        pytest.param(COMPRESSIONS[-1], marks=pytest.mark.slow),
    ],
)
def test_static_decoding_step_is_one_graph_reads_nothing_back_and_compiles_fullgraph(options):
    model = tiny_model(**options)
    ids, mask = left_padded(prompts_of([13, 6]))
    with torch.no_grad():
        cache = model(ids, attention_mask=mask, use_cache=True).cache
        step = torch.randint(1, VOCAB, (2, 1))
        mask = torch.cat([mask, torch.ones_like(step)], dim=1)
        cache = model(step, attention_mask=mask, cache=cache, use_cache=True).cache  # now in the static form
        assert cache.is_static and cache.is_compileable
        mask = torch.cat([mask, torch.ones_like(step)], dim=1)
        probe = copy.deepcopy(cache)
        counts = count_dispatched_ops(lambda: model(step, attention_mask=mask, cache=probe, use_cache=True))
        assert sync_ops(counts) == {}
        explanation = torch._dynamo.explain(model)(
            step, attention_mask=mask, cache=copy.deepcopy(cache), use_cache=True
        )
        assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
        assert explanation.graph_count == 1

        # 12 compiled steps (segment boundaries, evictions, compressions at different steps per row) == eager
        compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
        eager_cache, compiled_cache = cache, copy.deepcopy(cache)
        eager_token = compiled_token = step
        for _ in range(12):
            want = model(eager_token, attention_mask=mask, cache=eager_cache, use_cache=True).logits
            got = compiled(compiled_token, attention_mask=mask, cache=compiled_cache, use_cache=True).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
            eager_token, compiled_token = want[:, -1:].argmax(-1), got[:, -1:].argmax(-1)
            assert torch.equal(eager_token, compiled_token)
            mask = torch.cat([mask, torch.ones_like(step)], dim=1)


@needs_traceable_outputs
@pytest.mark.parametrize("backend", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_generate_compiles_decoding_on_the_cpu_when_asked_and_equals_eager_and_uncached(backend, monkeypatch):
    model = tiny_model()
    prompts = prompts_of([6, 3], seed=4)
    ids, mask = left_padded(prompts)
    settings = dict(attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=0)
    eager = model.generate(ids, **settings)
    graphs = []
    config = CompileConfig(backend=recording_backend(graphs, backend), fullgraph=True)
    config._compile_all_devices = True  # transformers' switch for compiling on devices other than CUDA/XPU
    model.generation_config.compile_config = config
    torch._dynamo.reset()
    records, processors = record_cache_addresses(model, monkeypatch)
    compiled = model.generate(ids, logits_processor=processors, **settings)
    # the decoding steps compiled once (16 steps, no recompilation as the count of tokens grows: the prompt's forward
    # compressed the groups ahead, which the first step would have done in a graph of its own), into a graph that
    # takes no Python number (CUDA graphs re-record)
    assert len(graphs) == 1 and number_inputs(graphs) == []
    assert torch.equal(compiled, eager)
    # what CUDA graphs need: the prompt's forward allocates the static form, the steps only write into it
    assert len(records) == 16 and moved_tensors(records) == []
    for row, prompt in enumerate(prompts):
        assert torch.equal(
            compiled[row, ids.shape[1] :], greedy_by_full_recomputation(model, prompt, 16)[len(prompt) :]
        )


def test_only_a_generate_that_compiles_compresses_the_groups_ahead_at_the_prompt():
    """Eager steps compress at eviction: an eager generate() pays nothing for the groups compressed ahead."""
    model = tiny_model()
    ids = torch.randint(1, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    settings = dict(max_new_tokens=1, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    eager = model.generate(ids, disable_compile=True, **settings)
    config = CompileConfig(backend="eager")
    config._compile_all_devices = True
    compiled = model.generate(ids, compile_config=config, **settings)  # (one token: no step is compiled)
    caches = [getattr(out, CACHE_NAME) for out in (eager, compiled)]
    assert model.model.layers[0].compress is not None and caches[0]._layout.grouped
    assert [(c.steps_compiled, c._groups_ready) for c in caches] == [(False, False), (True, True)]


@pytest.mark.parametrize(
    "options", COMPRESSIONS[:-1] + [dict(layer_norm_position="post"), dict(c_mem_len=0, mem_len=5)]
)  # all but most_used
def test_crop_restores_the_cache_of_the_first_tokens(options):
    """After crop(-k) the next logits equal those of a cache built from the kept tokens alone, whether the removed
    tokens came in one call or one at a time, and across segment completions (evictions, compressions)."""
    model = tiny_model(**options)
    ids = torch.randint(1, VOCAB, (2, 40), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        for kept in (5, 13, 22):
            want = model(ids[:, : kept + 1]).logits[:, -1:]
            for removed in (1, 3, 7, 12):  # 12: three segment completions undone
                one_call = CompressiveMemoryCache(2, crop_margin=16)
                model(ids[:, : kept + removed], cache=one_call, use_cache=True)
                stepwise = CompressiveMemoryCache(2, crop_margin=16)
                model(ids[:, :3], cache=stepwise, use_cache=True)
                for t in range(3, kept + removed):
                    # without a mask the fills are followed on the host (eager: groups compressed at eviction);
                    # with one, the branch-free step (groups compressed as they complete): alternate both
                    mask = torch.ones(2, t + 1, dtype=torch.long) if t % 5 < 2 else None
                    model(ids[:, t : t + 1], attention_mask=mask, cache=stepwise, use_cache=True)
                for cache in (one_call, stepwise):
                    cache.crop(-removed)
                    assert cache.get_seq_length() == kept
                    got = model(ids[:, kept : kept + 1], cache=cache, use_cache=True).logits
                    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
        cache = CompressiveMemoryCache(2, crop_margin=4)
        model(ids[:, :10], cache=cache, use_cache=True)
        with pytest.raises(ValueError, match="crop_margin=4"):
            cache.crop(-5)
        with pytest.raises(ValueError, match="cache has seen 10"):
            cache.crop(11)  # a positive number is the length to keep (older transformers' convention)
        cache.crop(8)
        assert cache.get_seq_length() == 8


@needs_current_assisted_decoding
def test_assisted_and_prompt_lookup_decoding_equal_greedy_decoding(monkeypatch):
    model = tiny_model()
    assistant = tiny_model(seed=1, hidden_size=16, num_hidden_layers=1, intermediate_size=32)  # same vocabulary
    removed = []
    crop = CompressiveMemoryCache.crop
    monkeypatch.setattr(CompressiveMemoryCache, "crop", lambda self, n: (removed.append(-n), crop(self, n))[1])
    prompt = torch.randint(1, VOCAB, (1, 9), generator=torch.Generator().manual_seed(6))
    settings = dict(max_new_tokens=24, min_new_tokens=24, do_sample=False)
    greedy = model.generate(prompt, **settings)
    assert torch.equal(greedy[0], greedy_by_full_recomputation(model, prompt[0], 24))
    assert torch.equal(model.generate(prompt, assistant_model=assistant, **settings), greedy)
    assert max(removed) > 0  # draft tokens were rejected and cropped away
    repeated = prompt.repeat(1, 3)  # n-grams to look up
    greedy = model.generate(repeated, **settings)
    assert torch.equal(model.generate(repeated, prompt_lookup_num_tokens=4, **settings), greedy)


@needs_current_assisted_decoding
def test_most_used_compression_refuses_assisted_decoding_clearly():
    model = tiny_model(compression_function="most_used", reconstruction_loss="none")
    prompt = torch.randint(1, VOCAB, (1, 6))
    with pytest.raises(ValueError, match="cropped"):
        model.generate(prompt, prompt_lookup_num_tokens=2, max_new_tokens=4, do_sample=False)
    with pytest.raises(ValueError, match="most_used"):
        model(prompt, cache=CompressiveMemoryCache(2, crop_margin=4), use_cache=True)


FIXTURE = Path(__file__).resolve().parent / "fixtures"


@pytest.mark.parametrize("name", ["compressive_conv1d_pre", "compressive_dilated_conv_post"])
def test_a_static_cache_saved_by_an_earlier_release_decodes_as_it_did(name):
    """`tests/fixtures/static_cache/` (tools/make_static_cache_fixture.py, at the commit in its made_with.json):
    a static cache saved mid-decoding, rows at different fills, before the compressed ring held the groups compressed
    ahead, and the logits of the next 12 steps (an eviction among them) as that code gave them. Loaded now, the
    cache is widened and decodes the same; saved and loaded again in today's layout, it still does."""
    model = CompressiveForCausalLM.from_pretrained(FIXTURE / "compat" / name).eval()
    state = torch.load(FIXTURE / "static_cache" / f"{name}.pt", weights_only=True)
    expected = torch.load(FIXTURE / "static_cache" / f"{name}.expected.pt", weights_only=True)
    cache = CompressiveMemoryCache.from_state_dict(state)
    assert cache.layers[0].ring.shape[1] > state["static"]["layers"][0]["ring"].shape[1]  # the layout did change
    steps = expected["tokens"].shape[1]
    mask = expected["mask"][:, : expected["mask"].shape[1] - steps]
    logits = []
    with torch.no_grad():
        for i in range(steps):
            if i == steps // 2:  # today's layout round-trips
                cache = CompressiveMemoryCache.from_state_dict(copy.deepcopy(cache.state_dict()))
            mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
            out = model(expected["tokens"][:, i : i + 1], attention_mask=mask, cache=cache, use_cache=True)
            cache = out.cache
            logits.append(out.logits[:, -1])
    torch.testing.assert_close(torch.stack(logits, 1), expected["logits"], rtol=0, atol=1e-5)
