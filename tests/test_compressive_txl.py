"""`CompressiveConfig(c_mem_len=0)`: the Compressive model's own Transformer-XL setting (issue 22).

Evicted memories are dropped one at a time (the memory keeps exactly the newest `mem_len` layer inputs), nothing
is compressed, and there is no reconstruction loss. Every expectation is an independent computation: a naive
Transformer-XL written here with the model's own weights, properties of which tokens can reach a logit, the same
weights with compressed memory before anything was evicted, and greedy decoding by full recomputation.
"""

from __future__ import annotations

import pytest
import torch
from test_compressive_model import VOCAB, tiny_model  # noqa: F401

from longrange import CompressiveConfig, CompressiveForCausalLM, CompressiveMemoryCache
from longrange.layers import sinusoidal_embedding
from longrange.trainer import memory_from_state, memory_state

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: tiny tensors, one thread

# tiny_model: segment 4, compression rate 2. mem_len 5 is no multiple of the rate: a grouped eviction would keep 4
TXL = dict(c_mem_len=0, mem_len=5)
OPTIONS = [
    dict(TXL),
    dict(TXL, compression_function="most_used", reconstruction_loss="none"),
    dict(TXL, compression_function="dilated_conv", reconstruction_loss="autoencoding"),
    dict(TXL, layer_norm_position="post"),
]


def ids_of(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(1, VOCAB, (batch, length), generator=torch.Generator().manual_seed(seed))


def naive_attention(layer, queries_in: torch.Tensor, keys_in: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Transformer-XL relative attention of one row written out: queries_in [q, hidden] (the segment's normalised
    inputs), keys_in [k, hidden] (normalised [memory, segment]), positions [k] absolute token positions (the queries
    are the last q). score(i, j) = ((q_i + u) . k_j + (q_i + v) . r_{pos_i - pos_j}) / sqrt(d), causal."""
    attention = layer.attention
    heads, d_head = attention.num_heads, attention.head_dim
    q_len = queries_in.shape[0]
    query = attention.q_proj(queries_in).view(q_len, heads, d_head)
    keys, values = (t.view(-1, heads, d_head) for t in attention.kv_proj(keys_in).chunk(2, dim=-1))
    out = torch.zeros(q_len, heads, d_head)
    for i in range(q_len):
        pos_i = positions[-q_len + i]
        visible = positions <= pos_i
        distance = (pos_i - positions[visible]).float()
        r = attention.r_proj(sinusoidal_embedding(distance, queries_in.shape[-1])).view(-1, heads, d_head)
        content = torch.einsum("hd,khd->hk", query[i] + attention.content_bias, keys[visible])
        position = torch.einsum("hd,khd->hk", query[i] + attention.position_bias, r)
        weights = ((content + position) * d_head**-0.5).softmax(dim=-1)  # [heads, k]
        out[i] = torch.einsum("hk,khd->hd", weights, values[visible])
    return attention.o_proj(out.reshape(q_len, -1))


def naive_transformer_xl(model: CompressiveForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits [batch, seq, vocab], row by row."""
    return torch.stack([naive_transformer_xl_row(model, row) for row in ids])


def naive_transformer_xl_row(model: CompressiveForCausalLM, ids: torch.Tensor) -> torch.Tensor:
    """Logits [seq, vocab] of one row [seq]: segment by segment, each layer attends to its own inputs of the last
    mem_len tokens before the segment and causally to the segment (every layer's inputs over the whole row are
    kept, a plain tensor per layer)."""
    config, base = model.config, model.model
    seq = ids.shape[0]
    inputs = [base.embed_tokens(ids)] + [torch.zeros(seq, config.hidden_size) for _ in base.layers]
    for start in range(0, seq, config.segment_length):
        end = min(start + config.segment_length, seq)
        memory_start = max(0, start - config.mem_len)
        positions = torch.arange(memory_start, end)
        for index, layer in enumerate(base.layers):
            normed = layer.attn_input_norm(inputs[index][memory_start:end])  # [memory + segment, hidden]
            h = inputs[index][start:end] + naive_attention(layer, normed[start - memory_start :], normed, positions)
            h = layer.attn_output_norm(h)
            inputs[index + 1][start:end] = layer.ff_output_norm(h + layer.feed_forward(layer.ff_input_norm(h)))
    return model.lm_head(base.norm(inputs[-1]))


@pytest.mark.parametrize("options", OPTIONS)
def test_forward_equals_a_naive_transformer_xl(options):
    """Seven segments: the memory overflows at every segment after the second; mem_len 5 (not a multiple of the
    rate 2) tells a one-by-one eviction from a grouped one."""
    model = tiny_model(num_hidden_layers=2, **options)
    ids = ids_of(2, 27)
    with torch.no_grad():
        got = model(ids).logits
        want = naive_transformer_xl(model, ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_training_forward_equals_the_naive_transformer_xl_and_reports_a_zero_reconstruction_loss():
    model = tiny_model(**TXL).train()
    ids = ids_of(2, 27)
    out = model(ids, labels=ids)
    with torch.no_grad():
        want = naive_transformer_xl(model, ids)
    torch.testing.assert_close(out.logits.detach(), want, atol=1e-4, rtol=0)
    # nothing is compressed: the loss of a step that evicted nothing into f_c, an exact zero, as a tensor
    assert isinstance(out.reconstruction_loss, torch.Tensor) and out.reconstruction_loss.item() == 0.0
    torch.testing.assert_close(out.loss, out.lm_loss)
    out.loss.backward()
    compress_grads = [p.grad for layer in model.model.layers for p in layer.compress.parameters()]
    assert all(g is None or not g.any() for g in compress_grads)  # f_c exists but is never used


def test_tokens_older_than_memory_and_segment_never_change_a_logit():
    """One layer: a query sees its segment and the mem_len tokens before it, nothing older. With c_mem_len=0
    changing the first tokens leaves every logit from position mem_len + segment_length on unchanged; with
    compressed memory they reach later logits."""
    ids = ids_of(1, 30)
    changed = ids.clone()
    changed[0, :3] = (ids[0, :3] + 1) % VOCAB
    for c_mem_len, reaches in ((0, False), (3, True)):
        model = tiny_model(num_hidden_layers=1, mem_len=5, c_mem_len=c_mem_len)
        with torch.no_grad():
            before, after = model(ids).logits, model(changed).logits
        # token 2 is in memory until segment [8, 12) starts (8 - 5 = 3 > 2): logits from 8 on are out of its reach
        far = slice(8, None)
        assert torch.equal(before[:, far], after[:, far]) != reaches
        assert not torch.allclose(before[:, :8], after[:, :8])


def test_logits_equal_those_with_compressed_memory_until_something_is_evicted():
    """The same weights with c_mem_len=3: segment 4, mem_len 8: the memory first overflows after segment 3
    (tokens 8..11), so tokens 0..11 agree, and the later ones (which then see the compressed memory) do not."""
    txl = tiny_model(mem_len=8, c_mem_len=0)
    compressive = CompressiveForCausalLM(CompressiveConfig(**{**txl.config.to_dict(), "c_mem_len": 3})).eval()
    compressive.load_state_dict(txl.state_dict())  # the weights' shapes do not depend on c_mem_len
    ids = ids_of(2, 20)
    with torch.no_grad():
        a, b = txl(ids).logits, compressive(ids).logits
    torch.testing.assert_close(a[:, :12], b[:, :12], atol=1e-6, rtol=0)
    assert not torch.allclose(a[:, 12:], b[:, 12:], atol=1e-4)


@pytest.mark.parametrize("options", OPTIONS)
def test_generate_equals_the_argmax_of_one_forward(options):
    """Greedy generate() (compact prompt, then static decoding steps) picks each token as the argmax of the plain
    forward over the whole generated sequence, for a padded batch too."""
    model = tiny_model(**options)
    prompts = ids_of(2, 7, seed=1)
    mask = torch.ones_like(prompts)
    mask[1, :3] = 0
    tokens = model.generate(prompts, attention_mask=mask, max_new_tokens=18, min_new_tokens=18, do_sample=False,
                            pad_token_id=0)  # fmt: skip
    for row in range(2):
        real = tokens[row, int((mask[row] == 0).sum()) :]
        with torch.no_grad():
            logits = model(real[None]).logits[0]
        prompt_len = 7 - int((mask[row] == 0).sum())
        assert torch.equal(logits[prompt_len - 1 : -1].argmax(-1), real[prompt_len:])


@pytest.mark.parametrize("options", OPTIONS)
def test_static_decoding_equals_the_compact_forward(options):
    """Token-by-token decoding through the static cache (with and without a mask, rows at different fills) gives
    the logits and the attention maps of one compact forward; the attention layout has 0 compressed columns."""
    model = tiny_model(**options)
    ids = ids_of(2, 22, seed=2)
    with torch.no_grad():
        full = model(ids, output_attentions=True)
        cache = CompressiveMemoryCache(2)
        model(ids[:, :3], cache=cache, use_cache=True)
        steps, maps = [], []
        for t in range(3, 22):
            mask = torch.ones(2, t + 1, dtype=torch.long) if t % 3 == 0 else None
            out = model(ids[:, t : t + 1], attention_mask=mask, cache=cache, use_cache=True, output_attentions=True)
            steps.append(out.logits)
            maps.append(out.attentions[0])
        assert cache.is_static
    width = model.config.mem_len + model.config.segment_length
    assert full.attentions[0].shape[-1] == width
    torch.testing.assert_close(torch.cat(steps, dim=1), full.logits[:, 3:], atol=1e-5, rtol=0)
    torch.testing.assert_close(torch.cat(maps, dim=2), full.attentions[0][:, :, 3:], atol=1e-5, rtol=0)
    assert cache.memory_slots() <= model.config.mem_len + model.config.segment_length


def test_crop_restores_the_cache_of_the_first_tokens():
    model = tiny_model(**TXL)
    ids = ids_of(2, 30, seed=3)
    with torch.no_grad():
        for kept, removed in ((6, 3), (13, 7), (18, 12)):
            want = model(ids[:, : kept + 1]).logits[:, -1:]
            cache = CompressiveMemoryCache(2, crop_margin=16)
            model(ids[:, : kept + removed], cache=cache, use_cache=True)
            cache.crop(-removed)
            got = model(ids[:, kept : kept + 1], cache=cache, use_cache=True).logits
            torch.testing.assert_close(got, want, atol=1e-5, rtol=0)


def test_most_used_without_compressed_memory_can_be_cropped():
    """Nothing is compressed, so no attention statistics are kept: the cache can be cropped (assisted decoding)."""
    model = tiny_model(**OPTIONS[1])
    ids = ids_of(1, 14, seed=4)
    with torch.no_grad():
        cache = CompressiveMemoryCache(2, crop_margin=8)
        model(ids, cache=cache, use_cache=True)
        cache.crop(-5)
        torch.testing.assert_close(
            model(ids[:, 9:10], cache=cache, use_cache=True).logits, model(ids[:, :10]).logits[:, -1:]
        )


def test_save_load_and_memory_state_round_trip(tmp_path):
    model = tiny_model(**TXL)
    model.save_pretrained(tmp_path)
    loaded = CompressiveForCausalLM.from_pretrained(tmp_path).eval()
    assert loaded.config.c_mem_len == 0
    other = tiny_model(mem_len=5, c_mem_len=3)
    assert {k: v.shape for k, v in model.state_dict().items()} == {k: v.shape for k, v in other.state_dict().items()}
    ids = ids_of(2, 17, seed=5)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits, atol=0, rtol=0)
        for seen in (12, 13):  # compact form (a multi-token forward) and static form (after a decoding step)
            cache = model(ids[:, :12], use_cache=True).cache
            if seen == 13:
                model(ids[:, 12:13], cache=cache, use_cache=True)
            assert cache.is_static == (seen == 13)
            restored = memory_from_state(memory_state(cache))
            got = model(ids[:, seen:], cache=restored, use_cache=True).logits
            torch.testing.assert_close(got, model(ids).logits[:, seen:], atol=1e-5, rtol=0)


def test_config_rules():
    assert CompressiveConfig(c_mem_len=0, mem_len=1, compression_rate=4).c_mem_len == 0  # no groups compressed
    with pytest.raises(ValueError, match="c_mem_len must be an integer >= 0"):
        CompressiveConfig(c_mem_len=-1)
    with pytest.raises(ValueError, match="c_mem_len must be an integer >= 0"):
        CompressiveConfig(c_mem_len=1.5)
    with pytest.raises(ValueError, match="mem_len .* must be >= compression_rate"):
        CompressiveConfig(c_mem_len=2, mem_len=1, compression_rate=4)
    with pytest.raises(ValueError, match="mem_len must be an integer >= 1"):
        CompressiveConfig(c_mem_len=0, mem_len=0)


def test_training_over_many_segments_with_a_mask_backpropagates():
    model = tiny_model(**TXL).train()
    ids = ids_of(3, 40, seed=6)
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    out = model(ids, attention_mask=mask, labels=ids)
    out.loss.backward()
    assert torch.isfinite(out.loss)
    assert model.model.layers[0].attention.r_proj.weight.grad.abs().sum() > 0
