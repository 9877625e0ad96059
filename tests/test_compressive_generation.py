"""Compressive Transformer generate(): the cache gives exactly what re-running the full model gives, and stays
bounded however many tokens are generated."""

from __future__ import annotations

import pytest
import torch
from test_compressive_model import COMPRESSIONS, VOCAB, tiny_model  # noqa: F401

from longrange import CompressiveMemoryCache
from longrange.compat import CACHE_NAME

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: tiny tensors, one thread


def greedy_by_full_recomputation(model, ids, mask, new_tokens):
    """The reference: every step re-runs the whole model over the whole sequence (no cache at all), which
    segments it the same way (segment boundaries counted from the first token)."""
    for _ in range(new_tokens):
        with torch.no_grad():
            logits = model(ids, attention_mask=mask, use_cache=False).logits[:, -1]
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
    return ids


@pytest.mark.parametrize("options", COMPRESSIONS + [dict(layer_norm_position="post"), dict(pkm_layers=[1])])
def test_cached_greedy_generate_equals_full_recomputation(options):
    model = tiny_model(**options)
    # prompt of 6 tokens, 16 new: decoding crosses 5 segment boundaries and several compressions;
    # row 1 is left-padded by 3
    ids = torch.randint(1, VOCAB, (2, 6))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    out = model.generate(ids, attention_mask=mask, max_new_tokens=16, min_new_tokens=16, do_sample=False)
    expected = greedy_by_full_recomputation(model, ids, mask, 16)
    assert torch.equal(out, expected)


def test_cached_decoding_logits_follow_the_full_forward_at_every_step():
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, 23))
    with torch.no_grad():
        full = model(ids).logits
        out = model(ids[:, :5], use_cache=True)
        steps = [out.logits]
        for t in range(5, 23):
            out = model(ids[:, t : t + 1], cache=out.cache, use_cache=True)
            steps.append(out.logits)
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_beam_search_with_cache_equals_beam_search_without():
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, 5))
    settings = dict(max_new_tokens=10, min_new_tokens=10, num_beams=3, num_return_sequences=2, do_sample=False)
    cached = model.generate(ids, use_cache=True, **settings)
    uncached = model.generate(ids, use_cache=False, **settings)
    assert cached.shape == (4, 15)
    assert torch.equal(cached, uncached)


def test_sampling_with_cache_equals_sampling_without_and_num_return_sequences():
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, 5))
    settings = dict(max_new_tokens=9, min_new_tokens=9, do_sample=True, top_k=10, num_return_sequences=3)
    torch.manual_seed(1)
    cached = model.generate(ids, use_cache=True, **settings)
    torch.manual_seed(1)
    uncached = model.generate(ids, use_cache=False, **settings)
    assert cached.shape == (6, 14)
    assert torch.equal(cached, uncached)
    assert torch.equal(cached[:3, :5], ids[:1].expand(3, -1))


def test_generate_continues_from_a_returned_cache():
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (1, 7))
    result = model.generate(ids, max_new_tokens=6, do_sample=False, return_dict_in_generate=True)
    cache = getattr(result, CACHE_NAME)  # generate()'s own output: `past_key_values` before transformers 5.24
    assert isinstance(cache, CompressiveMemoryCache)
    # the cache has seen all but the last generated token (that one was never fed back)
    assert cache.get_seq_length() == result.sequences.shape[1] - 1
    continued = model.generate(result.sequences, cache=cache, max_new_tokens=5, do_sample=False)
    expected = greedy_by_full_recomputation(model, result.sequences, torch.ones_like(result.sequences), 5)
    assert torch.equal(continued, expected)


def test_cache_size_stays_constant_while_generating():
    options = dict(segment_length=4, mem_len=6, c_mem_len=3, compression_rate=2)
    model = tiny_model(**options)
    bound = options["mem_len"] + options["c_mem_len"] * options["compression_rate"]  # 12
    new_tokens = 4 * bound
    ids = torch.randint(0, VOCAB, (1, 3))
    with torch.no_grad():
        out = model(ids, use_cache=True)
        sizes = []
        for _ in range(new_tokens):
            out = model(out.logits[:, -1:].argmax(-1), cache=out.cache, use_cache=True)
            # decoding keeps the static form: fixed-size buffers written in place (3 slots for the compressed memory
            # and 7 for the groups of held tokens compressed ahead: ceil(10 / 2) + 2; 10 for a memory and a segment)
            # and per-row counters
            assert out.cache.is_static
            buffers = {(layer.ring.shape, layer.ring_keys.shape) for layer in out.cache.layers}
            assert buffers == {((1, 20, 32), (1, 4, 20, 8))}
            sizes.append(out.cache.row_lengths()[0])  # (compressed, memory, unfinished segment)
    assert out.cache.get_seq_length() == 3 + new_tokens
    # once full (after a few segments), compressed memory and memory keep the same size for good;
    # the unfinished segment never reaches a full segment (it moves into memory when complete)
    assert {s[:2] for s in sizes[bound:]} == {(3, 6)}
    assert max(s[2] for s in sizes) < options["segment_length"]
    assert max(sum(s) for s in sizes) <= 3 + 6 + 3

    # the same through generate(): the returned cache holds the same bounded number of slots
    result = model.generate(ids, max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True)
    cache = getattr(result, CACHE_NAME)
    assert cache.row_lengths()[0][:2] == (3, 6)
    assert cache.memory_slots() <= 3 + 6 + 4
