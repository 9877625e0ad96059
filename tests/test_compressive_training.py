"""Compressive Transformer training: where each loss sends its gradient, streaming memories, checkpointing, bf16."""

from __future__ import annotations

import pytest
import torch
from test_compressive_model import VOCAB, tiny_model  # noqa: F401

from longrange import CompressiveConfig, CompressiveForCausalLM

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: tiny tensors, one thread


def grads_of(loss, model):
    params = dict(model.named_parameters())
    grads = torch.autograd.grad(loss, list(params.values()), retain_graph=True, allow_unused=True)
    return {name: g for name, g in zip(params, grads)}


def nonzero(grad) -> bool:
    return grad is not None and grad.abs().max() > 0


@pytest.mark.parametrize(
    "options,trained",
    [
        (dict(compression_function="conv1d", reconstruction_loss="attention"), ("compress.",)),
        (dict(compression_function="dilated_conv", reconstruction_loss="attention"), ("compress.",)),
        (dict(compression_function="conv1d", reconstruction_loss="autoencoding"), ("compress.", "decompress.")),
    ],
)
def test_reconstruction_loss_trains_only_compression_and_lm_loss_trains_key_value_projections(options, trained):
    model = tiny_model(**options).train()
    ids = torch.randint(0, VOCAB, (2, 16))  # compression starts after the second segment
    out = model(ids, labels=ids)
    assert out.reconstruction_loss is not None and out.reconstruction_loss > 0
    torch.testing.assert_close(
        out.loss, out.lm_loss + model.config.reconstruction_loss_weight * out.reconstruction_loss
    )

    recon = grads_of(out.reconstruction_loss, model)
    for name, grad in recon.items():
        if name.split("layers.")[-1].split(".", 1)[-1].startswith(trained):
            assert nonzero(grad), name
        else:
            assert not nonzero(grad), f"reconstruction loss reached {name}"

    lm = grads_of(out.lm_loss, model)
    for layer in range(model.config.num_hidden_layers):
        # the key/value projection keeps training after compression has started (reference defect 6)
        assert nonzero(lm[f"model.layers.{layer}.attention.kv_proj.weight"])
        assert nonzero(lm[f"model.layers.{layer}.attention.q_proj.weight"])
        # the language-model loss never reaches f_c (compressed memories are detached)
        for name, grad in lm.items():
            if f"layers.{layer}.compress." in name or f"layers.{layer}.decompress." in name:
                assert not nonzero(grad), name
    # nothing was frozen to get there
    assert all(p.requires_grad for p in model.parameters())


def hand_attention(layer, queries_from, memories):
    """Attention without positions from `queries_from` to `memories`, written out with plain tensor operations."""
    import torch.nn.functional as F

    attn, norm = layer.attention, layer.attn_input_norm
    heads, d_head = attn.num_heads, attn.head_dim

    def normed(x):
        return F.layer_norm(x, norm.normalized_shape, norm.weight, norm.bias, norm.eps)

    q = (normed(queries_from) @ attn.q_proj.weight.T).view(-1, heads, d_head)
    k, v = (normed(memories) @ attn.kv_proj.weight.T).chunk(2, dim=-1)
    k, v = k.view(-1, heads, d_head), v.view(-1, heads, d_head)
    probs = torch.einsum("qhd,khd->hqk", q, k).mul(d_head**-0.5).softmax(-1)
    return torch.einsum("hqk,khd->qhd", probs, v)


def test_reconstruction_target_is_the_evicted_memories_only():
    """One memory update evicts exactly the oldest 2 of 8 slots; the loss must equal an attention-reconstruction
    loss computed by hand over those 2 memories, with the segment's normalised inputs as queries."""
    model = tiny_model(reconstruction_loss="attention").train()
    ids = torch.randint(0, VOCAB, (1, 8))
    out = model(ids, labels=ids, output_hidden_states=True)
    losses = []
    for index, layer in enumerate(model.model.layers):
        inputs = out.hidden_states[index][0].detach()  # layer inputs for the 8 tokens
        segment, evicted = inputs[4:8], inputs[0:2]  # mem = 0..7 after segment 2, 8 > 6: evict the oldest 2
        compressed = layer.compress.conv(evicted.T[None])[0].T  # [1, hidden]
        difference = hand_attention(layer, segment, compressed) - hand_attention(layer, segment, evicted)
        losses.append((difference**2).mean())
    torch.testing.assert_close(out.reconstruction_loss, torch.stack(losses).mean())


def test_streaming_training_carries_detached_memories():
    model = tiny_model().train()
    ids = torch.randint(0, VOCAB, (2, 16))
    first = model(ids[:, :8], labels=ids[:, :8], use_cache=True)
    cache = first.cache
    assert cache is not None and cache.get_seq_length() == 8
    assert all(not t.requires_grad for layer in cache.layers for t in (layer.mem, layer.c_mem))
    first.loss.backward()  # the next step does not need this graph
    second = model(ids[:, 8:], labels=ids[:, 8:], cache=cache, use_cache=True)
    second.loss.backward()
    assert second.cache.get_seq_length() == 16
    # with the carried memories the second window sees what a single forward over both windows sees
    model.eval()
    with torch.no_grad():
        full = model(ids).logits[:, 8:]
        carried = model(ids[:, 8:], cache=model(ids[:, :8], use_cache=True).cache).logits
    torch.testing.assert_close(carried, full, atol=1e-5, rtol=1e-5)
    # training mode returns no cache unless asked
    assert model.train()(ids[:, :4]).cache is None


def test_gradient_checkpointing_gives_the_same_gradients():
    ids = torch.randint(0, VOCAB, (2, 14))
    grads = []
    for checkpointing in (False, True):
        model = tiny_model(seed=3).train()
        if checkpointing:
            # transformers 5.23 renamed gradient_checkpointing_enable (kept, deprecated) to activation_checkpointing_enable
            enable = getattr(model, "activation_checkpointing_enable", None) or model.gradient_checkpointing_enable
            enable()
            assert all(layer.gradient_checkpointing for layer in model.model.layers)
        out = model(ids, labels=ids)
        out.loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        torch.testing.assert_close(grads[1][name], grads[0][name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("options", [dict(), dict(compression_function="most_used", reconstruction_loss="none")])
def test_bf16_autocast_forward_and_backward_stay_finite(options):
    model = tiny_model(**options).train()
    ids = torch.randint(0, VOCAB, (2, 18))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, attention_mask=mask, labels=ids)
    assert torch.isfinite(out.loss) and torch.isfinite(
        out.reconstruction_loss if out.reconstruction_loss is not None else out.loss
    )
    assert torch.isfinite(out.logits.float()).all()
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_bf16_autocast_hands_the_attention_kernel_bf16_queries_and_position_bias(gpu_kernels, monkeypatch):
    """Under bf16 autocast, along a GPU's path (sdpa, with the position term as its additive mask), the content and
    position biases u and v (float32 parameters) join the bf16 queries in bf16. Added as float32 they promoted the
    queries and, after them, the [batch, heads, q, K] position bias to float32, which autocast then cast back for
    the kernel (three extra passes over the layer's largest tensor each way), and the float32 value of masked
    entries became -inf in bf16. The loss stays within bf16 rounding of the float32 model's."""
    import longrange.layers as layers

    calls, sdpa = [], layers.F.scaled_dot_product_attention

    def recording(query, key, value, attn_mask=None, **kwargs):
        calls.append((query.dtype, key.dtype, value.dtype, attn_mask))
        return sdpa(query, key, value, attn_mask=attn_mask, **kwargs)

    monkeypatch.setattr(layers.F, "scaled_dot_product_attention", recording)
    model = tiny_model().train()
    ids = torch.randint(0, VOCAB, (2, 18), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :5] = 0
    full_precision = model(ids, attention_mask=mask, labels=ids)
    calls.clear()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(ids, attention_mask=mask, labels=ids)
    assert len(calls) > model.config.num_hidden_layers  # the layers' attention and the reconstruction loss's
    for query, key, value, attn_mask in calls:
        assert query == key == value == torch.bfloat16
        assert attn_mask.dtype == torch.bfloat16 and torch.isfinite(attn_mask).all()
    torch.testing.assert_close(out.lm_loss.float(), full_precision.lm_loss, atol=2e-2, rtol=0)
    out.loss.backward()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)


def test_every_parameter_takes_part_in_the_loss_even_before_the_first_eviction():
    """Data-parallel training needs the same parameters used on every step: a window too short to evict anything
    still returns a (zero) reconstruction loss connected to f_c."""
    model = tiny_model().train()
    ids = torch.randint(0, VOCAB, (2, 4))  # one segment: nothing is evicted
    out = model(ids, labels=ids)
    assert out.reconstruction_loss == 0
    out.loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_reconstruction_loss_is_the_same_when_a_segment_spans_two_calls():
    """Queries and evicted keys come from the layer's own projections when a call holds the whole segment, and are
    projected again (with detached weights) when the segment started in an earlier call: same loss either way."""
    model = tiny_model().train()
    ids = torch.randint(0, VOCAB, (2, 8))
    whole = model(ids, labels=ids).reconstruction_loss
    first = model(ids[:, :5], labels=ids[:, :5], use_cache=True)
    assert first.reconstruction_loss == 0  # nothing evicted yet
    split = model(ids[:, 5:], labels=ids[:, 5:], cache=first.cache, use_cache=True).reconstruction_loss
    torch.testing.assert_close(split, whole)


@pytest.mark.parametrize("trainer_class", ["transformers.Trainer", "LongrangeTrainer"])
def test_trainer_accumulation_weights_the_reconstruction_loss_as_the_lm_loss(tmp_path, trainer_class):
    """Trainer divides the LM loss by the accumulated batch's predicted tokens (`num_items_in_batch`) and adds the
    micro-steps' losses up; the model weights its reconstruction loss (a per-call mean) by the call's share of those
    tokens. One SGD step (an update proportional to the gradient, which a doubled reconstruction term would double
    for f_c) of 2 accumulation steps of 2 rows against 1 step of 4 rows: every parameter of ours, f_c (trained by
    the reconstruction loss alone) included, moves by the factor transformers' Llama moves by under the same Trainer
    (1 on current releases; 0.5 on the floor's transformers 5.5 and accelerate 1.7, which scale an accumulated loss
    down once more, for Llama alike)."""
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from longrange.trainer import LongrangeTrainer

    generator = torch.Generator().manual_seed(0)
    rows = [{"input_ids": r, "labels": r} for r in torch.randint(0, 32, (4, 32), generator=generator)]
    small = dict(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    models = {
        "llama": lambda: LlamaForCausalLM(LlamaConfig(**small, num_key_value_heads=2)),
        "ours": lambda: CompressiveForCausalLM(
            CompressiveConfig(**small, segment_length=8, mem_len=8, c_mem_len=4, compression_rate=2)
        ),
    }

    def update(name: str, batch: int, accumulation: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = models[name]()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = TrainingArguments(
            output_dir=str(tmp_path / f"{name}-{batch}x{accumulation}"), max_steps=1, per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation, learning_rate=0.5, lr_scheduler_type="constant", optim="sgd",
            max_grad_norm=0.0, weight_decay=0.0, use_cpu=True, report_to="none", save_strategy="no", seed=0,
            disable_tqdm=True,
        )  # fmt: skip
        trainer = (Trainer if trainer_class == "transformers.Trainer" else LongrangeTrainer)(
            model=model, args=args, train_dataset=rows
        )
        trainer.train()
        return {n: p.detach() - before[n] for n, p in model.named_parameters()}

    big, accumulated = update("llama", 4, 1)["lm_head.weight"], update("llama", 2, 2)["lm_head.weight"]
    factor = float(accumulated.flatten() @ big.flatten() / (big.flatten() @ big.flatten()))
    torch.testing.assert_close(accumulated, factor * big, rtol=0, atol=1e-6)  # Trainer's own factor, one for all
    big, accumulated = update("ours", 4, 1), update("ours", 2, 2)
    compression = [name for name in big if ".compress." in name]  # f_c: trained by the reconstruction loss alone
    assert compression and all(big[name].abs().max() > 1e-4 for name in compression)
    for name in big:
        torch.testing.assert_close(accumulated[name], factor * big[name], rtol=0, atol=1e-5, msg=name)
