"""Compressive Transformer: causality, memory schedule, segment equivalence, padding, relative attention.

Every expected number comes from an independent computation written here (a hand-computed schedule, a direct
loop over relative distances, a plain re-run of the full model), not from the code under test.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from longrange import CompressiveConfig, CompressiveForCausalLM
from longrange.layers import sinusoidal_embedding
from longrange.modeling_compressive import CompressiveAttention, relative_scores

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: tiny tensors, one thread

VOCAB = 37


def tiny_config(**overrides) -> CompressiveConfig:
    settings = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        segment_length=4,
        mem_len=6,
        c_mem_len=3,
        compression_rate=2,
    )
    settings.update(overrides)
    return CompressiveConfig(**settings)


def tiny_model(seed: int = 0, **overrides) -> CompressiveForCausalLM:
    torch.manual_seed(seed)
    model = CompressiveForCausalLM(tiny_config(**overrides))
    # zero-initialised u/v biases would hide mistakes in the position terms: make them non-trivial
    with torch.no_grad():
        for layer in model.model.layers:
            layer.attention.content_bias.normal_(0, 0.5)
            layer.attention.position_bias.normal_(0, 0.5)
    return model.eval()


COMPRESSIONS = [
    dict(compression_function="conv1d"),
    dict(compression_function="dilated_conv", reconstruction_loss="autoencoding"),
    dict(compression_function="max_pool", reconstruction_loss="none"),
    dict(compression_function="mean_pool", reconstruction_loss="none"),
    dict(compression_function="most_used", reconstruction_loss="none"),
]


# ---------------------------------------------------------------------------------------------------------------
# 1. causality
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", COMPRESSIONS + [dict(layer_norm_position="post"), dict(pkm_layers=[2])])
def test_changing_a_token_never_changes_earlier_logits(options):
    model = tiny_model(**options)
    ids = torch.randint(0, VOCAB, (2, 22))  # 5.5 segments: memory full, compression under way
    with torch.no_grad():
        base = model(ids).logits
        # p inside a segment, on a segment boundary, and after the first compression (segment 3 on)
        for p in (1, 4, 9, 13, 18, 21):
            changed = ids.clone()
            changed[:, p] = (changed[:, p] + 1) % VOCAB
            logits = model(changed).logits
            torch.testing.assert_close(logits[:, :p], base[:, :p], atol=1e-5, rtol=0)
            assert (logits[:, p:] - base[:, p:]).abs().max() > 1e-4  # the change is seen from p on


# ---------------------------------------------------------------------------------------------------------------
# 2. memory schedule, hand-computed
# ---------------------------------------------------------------------------------------------------------------

# segment 4, compression rate 2, c_mem_len 3. Entries are token positions; a tuple is the mean of its positions.
SCHEDULE_MEM_LEN_6 = [
    # (tokens seen, compressed memory, memory)
    (4, [], [0, 1, 2, 3]),
    (8, [(0, 1)], [2, 3, 4, 5, 6, 7]),  # 8 > 6: evict ceil(2/2)*2 = 2
    (12, [(0, 1), (2, 3), (4, 5)], [6, 7, 8, 9, 10, 11]),  # 10 > 6: evict 4
    (16, [(4, 5), (6, 7), (8, 9)], [10, 11, 12, 13, 14, 15]),  # c_mem keeps its newest 3
    (20, [(8, 9), (10, 11), (12, 13)], [14, 15, 16, 17, 18, 19]),
]
SCHEDULE_MEM_LEN_5 = [
    (4, [], [0, 1, 2, 3]),
    (8, [(0, 1), (2, 3)], [4, 5, 6, 7]),  # 8 > 5: evict ceil(3/2)*2 = 4, memory drops to 4
    (12, [(2, 3), (4, 5), (6, 7)], [8, 9, 10, 11]),
]


@pytest.mark.parametrize("mem_len,schedule", [(6, SCHEDULE_MEM_LEN_6), (5, SCHEDULE_MEM_LEN_5)])
def test_memory_schedule_matches_hand_computation(mem_len, schedule):
    model = tiny_model(mem_len=mem_len, compression_function="mean_pool", reconstruction_loss="none")
    ids = torch.randint(0, VOCAB, (1, schedule[-1][0]))
    embeddings = model.model.embed_tokens(ids)[0].detach()  # layer 0's inputs (no dropout)

    def expected(entries):
        rows = [embeddings[list(e)].mean(0) if isinstance(e, tuple) else embeddings[e] for e in entries]
        return torch.stack(rows) if rows else embeddings[:0]

    cache = None
    with torch.no_grad():
        for seen, c_mem, mem in schedule:
            start = 0 if cache is None else cache.get_seq_length()
            cache = model(ids[:, start:seen], cache=cache, use_cache=True).cache
            state = cache.layers[0]
            assert cache.get_seq_length() == seen
            assert state.pending.shape[1] == 0
            torch.testing.assert_close(state.c_mem[0], expected(c_mem))
            torch.testing.assert_close(state.mem[0], expected(mem))
            # the layer attends over [compressed memory, memory] in that order
            torch.testing.assert_close(state.context()[0], torch.cat([expected(c_mem), expected(mem)]))
            # deeper layers follow the same lengths
            for deeper in cache.layers[1:]:
                assert deeper.c_mem.shape[1] == len(c_mem) and deeper.mem.shape[1] == len(mem)


# ---------------------------------------------------------------------------------------------------------------
# 3. one long forward == segment-wise forwards with the cache
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", COMPRESSIONS)
@pytest.mark.parametrize("grad", [False, True])
def test_one_forward_equals_forwards_passing_the_cache(options, grad):
    model = tiny_model(**options)
    ids = torch.randint(0, VOCAB, (2, 16))  # 4 segments
    with torch.set_grad_enabled(grad):
        full = model(ids).logits
        for step in (4, 3):  # segment by segment, and in calls that straddle segment boundaries
            cache, parts = None, []
            for start in range(0, 16, step):
                out = model(ids[:, start : start + step], cache=cache, use_cache=True)
                cache, parts = out.cache, parts + [out.logits]
            torch.testing.assert_close(torch.cat(parts, dim=1), full, atol=1e-5, rtol=1e-5)


def _plain_memory_projection(memory, norm_weight, norm_bias, eps, weight, known_tail):
    """What `_MemoryProjection` computes, by autograd and without reusing `known_tail`."""
    if norm_weight is not None:
        memory = torch.nn.functional.layer_norm(memory, memory.shape[-1:], norm_weight, norm_bias, eps)
    return torch.nn.functional.linear(memory, weight)


@pytest.mark.parametrize("layer_norm_position", ["pre", "post"])
def test_gradients_of_one_forward_match_plain_autograd_and_segment_wise_calls(layer_norm_position, monkeypatch):
    """float64. (a) One forward over 4 segments, which reuses each segment's key/value projection for the next
    segment's memories and projects memories with a hand-written backward, against the same forward with that
    projection done by plain autograd. (b) Memories are constants, so the same gradient is the sum of the
    gradients of one call per segment passing the cache along."""
    from longrange import memory_compressive

    model = tiny_model(layer_norm_position=layer_norm_position).double()
    with torch.no_grad():  # non-trivial norm parameters, so that every term of the memory projection's backward counts
        for module in model.modules():
            if isinstance(module, torch.nn.LayerNorm):
                module.weight.normal_(1.0, 0.3)
                module.bias.normal_(0.0, 0.3)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    ids = torch.randint(0, VOCAB, (2, 16))
    weights = torch.randn(2, 16, VOCAB, dtype=torch.float64)

    def grads(calls_of):
        cache, total = None, 0.0
        for start in range(0, 16, calls_of):
            out = model(ids[:, start : start + calls_of], cache=cache, use_cache=True)
            cache, total = out.cache, total + (out.logits * weights[:, start : start + calls_of]).sum()
        return torch.autograd.grad(total, params, allow_unused=True)

    full = grads(16)
    split = grads(4)
    monkeypatch.setattr(memory_compressive._MemoryProjection, "apply", _plain_memory_projection)
    plain = grads(16)
    assert any(g is not None and g.abs().sum() > 0 for g in full)
    for (name, _), a, b, c in zip(named, full, split, plain):
        assert (a is None) == (b is None) == (c is None), name
        if a is not None:
            torch.testing.assert_close(a, c, atol=1e-10, rtol=1e-8, msg=f"{name} vs plain autograd")
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8, msg=f"{name} vs segment-wise calls")


def test_labels_are_shifted_over_the_whole_sequence_across_segments():
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, 11))
    labels = ids.clone()
    labels[0, 5] = -100
    out = model(ids, labels=labels)
    logits = out.logits
    terms = [
        F.cross_entropy(logits[b, t], labels[b, t + 1], reduction="sum")
        for b in range(2)
        for t in range(10)
        if labels[b, t + 1] != -100
    ]
    torch.testing.assert_close(out.lm_loss, torch.stack(terms).mean())
    torch.testing.assert_close(out.loss, out.lm_loss)  # eval: no reconstruction loss
    with_items = model(ids, labels=labels, num_items_in_batch=7)
    torch.testing.assert_close(with_items.lm_loss, torch.stack(terms).sum() / 7)


# ---------------------------------------------------------------------------------------------------------------
# padding
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", COMPRESSIONS)
def test_padded_positions_are_never_attended_nor_pollute_memory(options):
    model = tiny_model(**options)
    ids = torch.randint(1, VOCAB, (2, 19))
    mask = torch.ones_like(ids)
    mask[0, :7] = 0  # row 0 left-padded over almost two segments: pads reach memory and compressed memory
    with torch.no_grad():
        base = model(ids, attention_mask=mask)
        other = ids.clone()
        other[0, :7] = torch.randint(1, VOCAB, (7,))  # different padding content
        changed = model(other, attention_mask=mask)
    torch.testing.assert_close(changed.logits[0, 7:], base.logits[0, 7:], atol=1e-5, rtol=0)
    torch.testing.assert_close(changed.logits[1], base.logits[1], atol=1e-5, rtol=0)
    # padding never enters the memories: row 0 holds what its 12 real tokens give (3 segments: compressed 3,
    # memory 6), row 1 its 19 tokens (4 segments and 3 pending), by the schedule of test_memory_schedule_matches_hand_computation
    cache = model(ids, attention_mask=mask, use_cache=True).cache
    assert cache.row_lengths() == [(3, 6, 0), (3, 6, 3)]


def test_attention_mask_may_cover_the_whole_history_or_only_new_tokens():
    model = tiny_model()
    ids = torch.randint(0, VOCAB, (2, 9))
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    with torch.no_grad():
        first = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True)
        cache_a = first.cache
        a = model(ids[:, 6:], attention_mask=mask, cache=cache_a).logits  # generate() style: full history
        cache_b = model(ids[:, :6], attention_mask=mask[:, :6], use_cache=True).cache
        b = model(ids[:, 6:], attention_mask=mask[:, 6:], cache=cache_b).logits
    torch.testing.assert_close(a, b)


# ---------------------------------------------------------------------------------------------------------------
# relative attention: the shift against a direct loop over distances
# ---------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("compiled", [False, True])  # eager pads the table, compiled graphs the scores
def test_relative_scores_match_direct_dot_products(compiled):
    q_len, k_len, d = 5, 9, 4
    query = torch.randn(2, 3, q_len, d, dtype=torch.float64)
    relative = torch.randn(3, d, k_len, dtype=torch.float64)  # column c encodes distance k_len - 1 - c
    scores = (torch.compile(relative_scores, backend="eager") if compiled else relative_scores)(query, relative)
    assert scores.shape == (2, 3, q_len, k_len)
    for i in range(q_len):
        for j in range(k_len - q_len + i + 1):  # visible keys only
            distance = (k_len - q_len + i) - j
            direct = (query[..., i, :] * relative[:, :, k_len - 1 - distance]).sum(-1)
            torch.testing.assert_close(scores[..., i, j], direct, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    "implementation, training",
    [
        ("sdpa", False),
        ("eager", False),
        ("sdpa", True),
        ("eager", True),
        ("blockwise", True),
        ("fused sdpa", True),
    ],
)
def test_relative_attention_matches_a_loop_over_query_key_pairs(implementation, training, monkeypatch):
    """training=True also compares every parameter's gradient with autograd through the loop: "sdpa" trains with
    the blockwise kernel on the CPU; "fused sdpa" forces what GPUs and compiled graphs run (torch's sdpa with the
    position term as an additive bias receiving its gradient)."""
    config = tiny_config()
    config._attn_implementation = implementation.split()[-1]
    if implementation == "fused sdpa":
        monkeypatch.setattr(
            CompressiveAttention, "kernel", lambda self, device, need_weights=False, static=False: "sdpa"
        )
    torch.manual_seed(0)
    attention = CompressiveAttention(config).eval()
    with torch.no_grad():
        attention.content_bias.normal_()
        attention.position_bias.normal_()
    batch, q_len, k_len, hidden = 2, 4, 10, config.hidden_size
    heads, d_head = config.num_attention_heads, hidden // config.num_attention_heads
    query_input = torch.randn(batch, q_len, hidden)
    context = torch.randn(batch, k_len - q_len, hidden)
    keys, values = attention.project_kv(torch.cat([context, query_input], dim=1))
    key_valid = torch.ones(batch, k_len, dtype=torch.bool)
    key_valid[1, :2] = False
    causal = torch.ones(q_len, k_len, dtype=torch.bool).tril(k_len - q_len)
    mask = key_valid[:, None, None, :] & causal
    relative = attention.project_relative(sinusoidal_embedding(torch.arange(k_len - 1, -1, -1), hidden))
    with torch.set_grad_enabled(training):
        out, _, _ = attention(query_input, keys, values, relative, mask)

        # direct computation, one (batch, head, query, key) at a time
        q = attention.q_proj(query_input).view(batch, q_len, heads, d_head)
        w_r = attention.r_proj.weight
        expected = torch.zeros(batch, q_len, heads, d_head)
        for b in range(batch):
            for h in range(heads):
                for i in range(q_len):
                    scores, visible = [], []
                    for j in range(k_len):
                        distance = (k_len - q_len + i) - j
                        if distance < 0 or not key_valid[b, j]:
                            continue
                        r = (w_r @ sinusoidal_embedding(torch.tensor([distance]), hidden)[0]).view(heads, d_head)[h]
                        content = (q[b, i, h] + attention.content_bias[h]) @ keys[b, h, j]
                        position = (q[b, i, h] + attention.position_bias[h]) @ r
                        scores.append((content + position) / math.sqrt(d_head))
                        visible.append(j)
                    probs = torch.softmax(torch.stack(scores), dim=0)
                    expected[b, i, h] = sum(p * values[b, h, j] for p, j in zip(probs, visible))
        expected = attention.o_proj(expected.reshape(batch, q_len, hidden))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-4)
    if training:
        upstream = torch.randn_like(out)
        params = [attention.q_proj.weight, attention.kv_proj.weight, attention.r_proj.weight]
        params += [attention.content_bias, attention.position_bias, attention.o_proj.weight]
        got = torch.autograd.grad((out * upstream).sum(), params, retain_graph=True)
        want = torch.autograd.grad((expected * upstream).sum(), params)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, atol=1e-5, rtol=1e-4)


# ---------------------------------------------------------------------------------------------------------------
# compression functions, against direct computations
# ---------------------------------------------------------------------------------------------------------------


def test_compression_functions_against_direct_computation():
    from longrange.modeling_compressive import COMPRESSION_CLASSES

    torch.manual_seed(0)
    hidden, rate = 3, 2
    memories = torch.randn(1, 6, hidden)
    valid = torch.tensor([[False, False, False, True, True, True]])
    usage = torch.tensor([[9.0, 9.0, 1.0, 5.0, 2.0, 3.0]])

    out, out_valid = COMPRESSION_CLASSES["max_pool"](hidden, rate)(memories, valid, usage)
    torch.testing.assert_close(out[0], torch.stack([torch.zeros(hidden), memories[0, 3], memories[0, 4:6].amax(0)]))
    assert out_valid.tolist() == [[False, True, True]]

    out, out_valid = COMPRESSION_CLASSES["mean_pool"](hidden, rate)(memories, valid, usage)
    torch.testing.assert_close(out[0], torch.stack([torch.zeros(hidden), memories[0, 3], memories[0, 4:6].mean(0)]))

    # most used: the 3 valid slots with most attention, in temporal order (invalid slots never win over valid)
    out, out_valid = COMPRESSION_CLASSES["most_used"](hidden, rate)(memories, valid, usage)
    torch.testing.assert_close(out[0], memories[0, [3, 4, 5]])
    assert out_valid.all()

    conv = COMPRESSION_CLASSES["conv1d"](hidden, rate)
    out, out_valid = conv(memories, valid, usage)
    w, b = conv.conv.weight, conv.conv.bias  # [out, in, k]
    masked = memories[0] * valid[0, :, None]
    direct = torch.stack([w[:, :, 0] @ masked[2 * g] + w[:, :, 1] @ masked[2 * g + 1] + b for g in range(3)])
    torch.testing.assert_close(out[0], direct)

    dilated = COMPRESSION_CLASSES["dilated_conv"](hidden, rate)
    out, out_valid = dilated(memories, valid, usage)
    w, b = dilated.conv.weight, dilated.conv.bias
    # slot g ends at the end of its group and reads every second memory: positions 2g - 1 and 2g + 1
    padded = torch.cat([torch.zeros(1, hidden), masked])  # index shift by rate - 1 = 1
    direct = torch.stack([w[:, :, 0] @ padded[2 * g] + w[:, :, 1] @ padded[2 * g + 2] + b for g in range(3)])
    torch.testing.assert_close(out[0], direct)
    # sources of slot 0: position 1 (invalid) and padding -> invalid; slot 1: positions 1, 3 -> valid
    assert out_valid.tolist() == [[False, True, True]]


def test_most_used_keeps_the_memories_that_received_most_attention():
    """One layer, segment 4, mem_len 4, rate 2: after segment 2 the memories of tokens 0-3 are evicted and the
    2 that received the most attention (from segment 1's and segment 2's queries, all heads) are kept, in order.
    The attention probabilities are recomputed here with a direct loop over (head, query, key)."""
    model = tiny_model(
        num_hidden_layers=1, mem_len=4, c_mem_len=2, compression_function="most_used", reconstruction_loss="none"
    )
    layer = model.model.layers[0]
    attention = layer.attention
    heads, d_head, hidden = attention.num_heads, attention.head_dim, model.config.hidden_size
    # keys = scaled queries: a token attends sharply to copies of itself. Token 5 sits at positions 1 and 3 of the
    # evicted block and fills segment 2, so the most used memories are 1 and 3: neither the oldest nor the newest.
    with torch.no_grad():
        attention.q_proj.weight.mul_(20)
        attention.kv_proj.weight[:hidden] = attention.q_proj.weight
    ids = torch.tensor([[7, 5, 9, 5, 5, 5, 5, 5]])
    with torch.no_grad():
        inputs = model.model.embed_tokens(ids)[0]  # layer-0 inputs [8, hidden]
        normed = layer.attn_input_norm(inputs)
        q = attention.q_proj(normed).view(8, heads, d_head)
        k, v = attention.kv_proj(normed).chunk(2, dim=-1)
        k = k.view(8, heads, d_head)
        received = torch.zeros(8)
        # segment 1: queries 0-3 over keys 0-3; segment 2: queries 4-7 over keys 0-7 (memory 0-3 + segment)
        for queries, keys in ((range(0, 4), list(range(0, 4))), (range(4, 8), list(range(0, 8)))):
            k_len = len(keys)
            for h in range(heads):
                for n, i in enumerate(queries):
                    scores, visible = [], []
                    for j_pos, j in enumerate(keys):
                        distance = (k_len - len(queries) + n) - j_pos
                        if distance < 0:
                            continue
                        r = attention.r_proj.weight @ sinusoidal_embedding(torch.tensor([distance]), hidden)[0]
                        r = r.view(heads, d_head)[h]
                        score = (q[i, h] + attention.content_bias[h]) @ k[j, h]
                        score = score + (q[i, h] + attention.position_bias[h]) @ r
                        scores.append(score / math.sqrt(d_head))
                        visible.append(j)
                    for p, j in zip(torch.softmax(torch.stack(scores), 0), visible):
                        received[j] += p
        kept = sorted(received[:4].topk(2).indices.tolist())
        assert kept == [1, 3]  # the hand computation agrees with the construction above
        cache = model(ids, use_cache=True).cache
    torch.testing.assert_close(cache.layers[0].c_mem[0], inputs[kept])
    torch.testing.assert_close(cache.layers[0].mem[0], inputs[4:8])


# ---------------------------------------------------------------------------------------------------------------
# output_attentions, against softmax over relative scores computed here
# ---------------------------------------------------------------------------------------------------------------


def test_output_attentions_are_the_relative_attention_probabilities_in_slot_layout():
    """One layer, two segments, memory large enough to hold the first: token t attends every token j <= t with
    distance t - j. The weights come back over [compressed slots, memory slots (newest last), segment positions]."""
    segment, mem_len, c_mem_len = 4, 8, 2
    model = tiny_model(num_hidden_layers=1, segment_length=segment, mem_len=mem_len, c_mem_len=c_mem_len)
    attention, norm = model.model.layers[0].attention, model.model.layers[0].attn_input_norm
    ids = torch.randint(0, VOCAB, (2, 2 * segment), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(ids, output_attentions=True)
        (weights,) = out.attentions
        heads, d_head = attention.num_heads, attention.head_dim
        assert weights.shape == (2, heads, 2 * segment, c_mem_len + mem_len + segment)

        normed = norm(model.model.embed_tokens(ids))  # [batch, seq, hidden]
        q = attention.q_proj(normed).view(2, -1, heads, d_head)
        k = attention.kv_proj(normed)[..., : attention.num_heads * d_head].view(2, -1, heads, d_head)
        hidden = model.config.hidden_size
        expected = torch.zeros_like(weights)
        for t in range(2 * segment):
            scores = []
            for j in range(t + 1):
                r = attention.r_proj(sinusoidal_embedding(torch.tensor([t - j]), hidden))[0].view(heads, d_head)
                content = ((q[:, t] + attention.content_bias) * k[:, j]).sum(-1)  # [batch, heads]
                position = ((q[:, t] + attention.position_bias) * r).sum(-1)
                scores.append((content + position) / math.sqrt(d_head))
            probs = torch.softmax(torch.stack(scores, dim=-1), dim=-1)  # [batch, heads, t + 1]
            seg_start = t // segment * segment
            for j in range(t + 1):
                slot = c_mem_len + mem_len + (j - seg_start) if j >= seg_start else c_mem_len + mem_len - segment + j
                expected[:, :, t, slot] = probs[..., j]
    torch.testing.assert_close(weights, expected, atol=1e-5, rtol=1e-4)


def test_output_attentions_while_generating_and_with_compression():
    model = tiny_model()
    prompt = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(4))
    config = model.config
    width = config.c_mem_len + config.mem_len + config.segment_length
    result = model.generate(
        prompt, max_new_tokens=12, do_sample=False, output_attentions=True, return_dict_in_generate=True
    )
    assert len(result.attentions) == 12
    assert result.attentions[0][0].shape == (2, config.num_attention_heads, 9, width)
    assert result.attentions[-1][-1].shape == (2, config.num_attention_heads, 1, width)
    last = result.attentions[-1][-1]
    torch.testing.assert_close(last.sum(-1), torch.ones_like(last.sum(-1)))
    assert last[..., : config.c_mem_len].sum() > 0  # 21 tokens seen: compressed memory is held and attended
    assert torch.equal(result.sequences, model.generate(prompt, max_new_tokens=12, do_sample=False))
