"""A forward gives the same logits whether gradients are recorded or not (fp32, bf16 and fp16 autocast).

Clients compare the two on the same weights: TRL's DPO scores a policy forward (with gradient) against a reference
forward (under `no_grad`), and at step 0 its loss must be ln 2. transformers' Llama is the reference behaviour: its
logits are bit-identical in both modes, and the test holds it to the same check.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch
from client_utils import require_client
from transformers import LlamaConfig, LlamaForCausalLM

from longrange import CompressiveConfig, CompressiveForCausalLM, SinkhornConfig, SinkhornForCausalLM

pytestmark = pytest.mark.usefixtures("single_thread")  # conftest: tiny tensors, one thread

VOCAB = 37


def compressive(**overrides):
    config = CompressiveConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        segment_length=4, mem_len=6, c_mem_len=3, compression_rate=2, **overrides,
    )  # fmt: skip
    model = CompressiveForCausalLM(config)
    with torch.no_grad():  # non-zero u / v biases, so that the position terms count
        for layer in model.model.layers:
            layer.attention.content_bias.normal_(0, 0.5)
            layer.attention.position_bias.normal_(0, 0.5)
    return model


def sinkhorn(**overrides):
    config = SinkhornConfig(
        vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, bucket_size=8, causal=True,
        max_position_embeddings=128, n_local_attn_heads=1, **overrides,
    )  # fmt: skip
    return SinkhornForCausalLM(config)


def llama():
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=128,
    )  # fmt: skip
    return LlamaForCausalLM(config)


MODELS = {
    "llama": llama,
    "compressive": compressive,
    "compressive-eager": lambda: compressive(attn_implementation="eager"),
    "compressive-post-ln": lambda: compressive(layer_norm_position="post"),
    "sinkhorn": sinkhorn,
    "sinkhorn-factorised": lambda: sinkhorn(emb_dim=16),
}
PRECISIONS = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}
GRAD_MODES = {"grad": contextlib.nullcontext, "no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


def logits(model, ids, dtype, grad_mode):
    autocast = torch.autocast("cpu", dtype) if dtype is not None else contextlib.nullcontext()
    with GRAD_MODES[grad_mode](), autocast:
        return model(ids, use_cache=False).logits.detach().float().clone()


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("name", MODELS)
def test_logits_do_not_depend_on_gradient_recording(name, precision, training):
    torch.manual_seed(0)
    model = MODELS[name]().train(training)  # dropout is 0: train mode changes no number, only the code paths
    ids = torch.randint(0, VOCAB, (2, 30))  # Compressive: 7.5 segments, memories full and compressed
    dtype = PRECISIONS[precision]
    with_grad = logits(model, ids, dtype, "grad")
    for mode in ("no_grad", "inference_mode"):
        without = logits(model, ids, dtype, mode)
        if dtype is None and name.startswith("compressive"):
            # fp32: the projections of memories are computed once per chunk without gradient and again (from the
            # same numbers) with gradient; products of a different number of rows may round their last bit apart
            torch.testing.assert_close(without, with_grad, rtol=0, atol=1e-6)
        else:
            assert torch.equal(without, with_grad), (mode, (without - with_grad).abs().max().item())


@pytest.mark.parametrize("name", ["llama", "compressive", "sinkhorn-factorised"])
def test_dpo_loss_at_step_0_is_ln_2_under_bf16_autocast(name):
    # TRL's DPO: the policy's log-probabilities (with gradient) against the reference's (the same weights, no_grad),
    # both through TRL's fused LM head; equal, so the loss -log sigmoid(beta * 0) is ln 2
    fused = require_client("trl.trainer.utils")
    torch.manual_seed(0)
    model = MODELS[name]().train()
    fused.add_fused_lm_head(model)
    chosen, rejected = torch.randint(0, VOCAB, (2, 2, 30)).unbind(0)

    def log_probs(ids, grad):
        with torch.set_grad_enabled(grad), torch.autocast("cpu", torch.bfloat16):
            return model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs.float().sum(-1)

    margin = (log_probs(chosen, True) - log_probs(chosen, False)) - (
        log_probs(rejected, True) - log_probs(rejected, False)
    )
    loss = -torch.nn.functional.logsigmoid(0.1 * margin).mean()
    assert loss.item() == pytest.approx(math.log(2), abs=1e-7)
