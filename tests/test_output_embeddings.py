"""The base model's last hidden state is what the output embedding reads, as in every transformers LM.

Clients score tokens from `model.get_output_embeddings()(base(ids).last_hidden_state)` without the LM's forward:
TRL's fused log-probabilities (DPO, GRPO), liger's fused cross-entropy. OPT's factorised embeddings show the
convention: `project_out` sits inside the decoder. Here the same holds for every configuration of both models,
factorised Sinkhorn embeddings included, and folders saved when the LM head held the projection back still load
with the same logits (the state dict of such a folder is made here by renaming the weights back).
"""

from __future__ import annotations

import pytest
import torch
from client_utils import require_client
from transformers import OPTConfig, OPTForCausalLM

from longrange import (
    CompressiveConfig,
    CompressiveForCausalLM,
    SinkhornConfig,
    SinkhornForCausalLM,
    SinkhornForMaskedLM,
)

VOCAB = 40
SINKHORN = dict(vocab_size=VOCAB, hidden_size=24, num_hidden_layers=2, num_attention_heads=4, bucket_size=8)
FACTORISED = [dict(), dict(emb_dim=16), dict(emb_dim=16, norm_after_project_out=True)]
OLD_NAMES = {"model.project_out.": "project_out.", "model.norm_out.": "norm_out."}  # the layout before


def opt():
    config = OPTConfig(
        vocab_size=VOCAB, hidden_size=24, word_embed_proj_dim=16, num_hidden_layers=2, num_attention_heads=4,
        ffn_dim=32, max_position_embeddings=64,
    )  # fmt: skip
    return OPTForCausalLM(config)


def sinkhorn(masked: bool, **overrides):
    config = SinkhornConfig(**SINKHORN, causal=not masked, max_position_embeddings=64, **overrides)
    return (SinkhornForMaskedLM if masked else SinkhornForCausalLM)(config)


def compressive(**overrides):
    config = CompressiveConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        segment_length=4, mem_len=6, c_mem_len=3, compression_rate=2, **overrides,
    )  # fmt: skip
    return CompressiveForCausalLM(config)


MODELS = {
    "opt": opt,
    "compressive": compressive,
    "compressive-post-ln": lambda: compressive(layer_norm_position="post"),
    **{f"sinkhorn-causal-{i}": (lambda o=o: sinkhorn(False, **o)) for i, o in enumerate(FACTORISED)},
    **{f"sinkhorn-masked-{i}": (lambda o=o: sinkhorn(True, **o)) for i, o in enumerate(FACTORISED)},
    "sinkhorn-reversible-factorised": lambda: sinkhorn(False, emb_dim=16, reversible=True),
    "sinkhorn-tied-factorised": lambda: sinkhorn(False, emb_dim=16, tie_word_embeddings=True),
}


@pytest.mark.parametrize("name", MODELS)
def test_output_embedding_of_the_base_models_last_hidden_state_gives_the_logits(name):
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    ids = torch.randint(0, VOCAB, (2, 21))
    with torch.no_grad():
        logits = model(ids).logits
        hidden = model.base_model(ids).last_hidden_state
        assert hidden.shape[-1] == model.get_output_embeddings().in_features
        assert torch.equal(model.get_output_embeddings()(hidden), logits)


@pytest.mark.parametrize("options", FACTORISED[1:], ids=["norm-before", "norm-after"])
def test_hidden_states_are_the_layers_outputs_and_the_last_hidden_state_their_projection(options):
    torch.manual_seed(1)
    model = sinkhorn(False, **options).eval()
    ids = torch.randint(0, VOCAB, (2, 19))
    base = model.model
    with torch.no_grad():
        out = base(ids, output_hidden_states=True)
        assert len(out.hidden_states) == 1 + model.config.num_hidden_layers
        assert all(h.shape == (2, 19, model.config.hidden_size) for h in out.hidden_states)
        # written out here: final norm (or none), projection back to emb_dim, norm after it (or none)
        last = out.hidden_states[-1]
        if options.get("norm_after_project_out"):
            expected = base.norm_out(base.project_out(last))
        else:
            expected = base.project_out(base.norm(last))
        assert torch.equal(out.last_hidden_state, expected)
        assert torch.equal(model(ids, output_hidden_states=True).hidden_states[-1], last)


def old_layout(state_dict: dict) -> dict:
    """The state dict as folders saved before the base model held the projection back name it."""
    renamed = {}
    for key, value in state_dict.items():
        for new, old in OLD_NAMES.items():
            key = old + key[len(new) :] if key.startswith(new) else key
        renamed[key] = value
    return renamed


@pytest.mark.parametrize("masked", [False, True], ids=["causal", "masked"])
@pytest.mark.parametrize("options", FACTORISED[1:], ids=["norm-before", "norm-after"])
def test_folders_and_state_dicts_of_the_old_layout_load_with_the_same_logits(options, masked, tmp_path):
    from safetensors.torch import save_file

    torch.manual_seed(2)
    model = sinkhorn(masked, **options).eval()
    ids = torch.randint(0, VOCAB, (2, 17))
    with torch.no_grad():
        expected = model(ids).logits
    old = old_layout(model.state_dict())
    assert any(key.startswith("project_out.") for key in old)

    model.save_pretrained(tmp_path)  # config.json as saved; the weights file replaced by the old layout's
    save_file({k: v.contiguous() for k, v in old.items()}, tmp_path / "model.safetensors", metadata={"format": "pt"})
    loaded, info = type(model).from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    fresh = type(model)(model.config)
    fresh.load_state_dict(old)  # strict: every old name found its place
    with torch.no_grad():
        assert torch.equal(loaded.eval()(ids).logits, expected)
        assert torch.equal(fresh.eval()(ids).logits, expected)


@pytest.mark.parametrize("name", ["opt", "sinkhorn-causal-2", "compressive"])
def test_trl_fused_log_probabilities_equal_the_log_softmax_of_the_logits(name):
    # TRL's DPO scores tokens through its fused LM head: the base model's last hidden state, then the output layer
    fused = require_client("trl.trainer.utils")
    torch.manual_seed(3)
    model = MODELS[name]().eval()
    ids = torch.randint(0, VOCAB, (2, 21))
    with torch.no_grad():
        logits = model(ids).logits
        fused.add_fused_lm_head(model)
        log_probs = model(input_ids=ids, labels=ids, fused_lm_head=True).log_probs
    expected = logits[:, :-1].log_softmax(-1).gather(-1, ids[:, 1:, None])[..., 0]  # each next token's
    torch.testing.assert_close(log_probs, expected, atol=1e-5, rtol=1e-5)
