"""The model boundary: every bad input to either model's forward ends in a ValueError / TypeError that names the
argument (never a deep RuntimeError / IndexError, never a silent answer), and the label options do what they say.

The expected losses are computed here with a plain cross-entropy over hand-shifted targets."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from longrange import (
    CompressiveConfig,
    CompressiveForCausalLM,
    SinkhornConfig,
    SinkhornForCausalLM,
    SinkhornForMaskedLM,
)

VOCAB, HIDDEN = 40, 16


def compressive(**overrides):
    config = CompressiveConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
        segment_length=4, mem_len=4, c_mem_len=2, compression_rate=2, **overrides,
    )  # fmt: skip
    return CompressiveForCausalLM(config).eval()


def sinkhorn(causal=True, **overrides):
    config = SinkhornConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=2, bucket_size=4,
        max_position_embeddings=64, causal=causal, **overrides,
    )  # fmt: skip
    return (SinkhornForCausalLM if causal else SinkhornForMaskedLM)(config).eval()


MODELS = {
    "compressive": compressive,
    "sinkhorn": sinkhorn,
    "sinkhorn-mlm": lambda: sinkhorn(causal=False),
    "sinkhorn-factorised": lambda: sinkhorn(emb_dim=8),
}
IDS = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(0))


def width(model) -> int:
    return model.get_input_embeddings().weight.shape[1]


BAD_INPUTS = {  # name -> (kwargs for the model, error type, words the message must hold)
    "float input_ids": (lambda m: dict(input_ids=IDS.float()), TypeError, "input_ids"),
    "bool input_ids": (lambda m: dict(input_ids=IDS > 3), TypeError, "input_ids"),
    "input_ids as a list": (lambda m: dict(input_ids=IDS.tolist()), TypeError, "input_ids"),
    "3-D input_ids": (lambda m: dict(input_ids=IDS[None]), ValueError, "input_ids must be [batch, seq]"),
    "1-D input_ids": (lambda m: dict(input_ids=IDS[0]), ValueError, "input_ids must be [batch, seq]"),
    "zero-length sequence": (lambda m: dict(input_ids=IDS[:, :0]), ValueError, "input_ids is empty"),
    "empty batch": (lambda m: dict(input_ids=IDS[:0]), ValueError, "input_ids is empty"),
    "ids over the vocabulary": (lambda m: dict(input_ids=IDS + VOCAB), ValueError, "vocab_size=40"),
    "negative ids": (lambda m: dict(input_ids=IDS - VOCAB), ValueError, "vocab_size=40"),
    "both ids and embeddings": (
        lambda m: dict(input_ids=IDS, inputs_embeds=torch.zeros(2, 8, width(m))),
        ValueError,
        "exactly one of input_ids and inputs_embeds",
    ),
    "neither ids nor embeddings": (lambda m: dict(), ValueError, "exactly one of input_ids and inputs_embeds"),
    "embeddings of the wrong width": (
        lambda m: dict(inputs_embeds=torch.zeros(2, 8, width(m) + 1)),
        ValueError,
        "inputs_embeds must be [batch, seq,",
    ),
    "integer embeddings": (
        lambda m: dict(inputs_embeds=torch.zeros(2, 8, width(m), dtype=torch.long)),
        TypeError,
        "inputs_embeds",
    ),  # fmt: skip
    "empty embeddings": (lambda m: dict(inputs_embeds=torch.zeros(2, 0, width(m))), ValueError, "inputs_embeds"),
    "mask holding 0.5": (
        lambda m: dict(input_ids=IDS, attention_mask=torch.full((2, 8), 0.5)),
        ValueError,
        "attention_mask must hold only 0 and 1",
    ),
    "additive float mask": (
        lambda m: dict(input_ids=IDS, attention_mask=torch.zeros(2, 8).masked_fill(IDS > 20, float("-inf"))),
        ValueError,
        "attention_mask must hold only 0 and 1",
    ),
    "mask holding 2": (
        lambda m: dict(input_ids=IDS, attention_mask=torch.full((2, 8), 2)),
        ValueError,
        "attention_mask must hold only 0 and 1",
    ),
    "mask of the wrong length": (
        lambda m: dict(input_ids=IDS, attention_mask=torch.ones(2, 5)),
        ValueError,
        "attention_mask must be [batch=2, 8]",
    ),  # fmt: skip
    "mask of the wrong batch": (
        lambda m: dict(input_ids=IDS, attention_mask=torch.ones(3, 8)),
        ValueError,
        "attention_mask must be [batch=2,",
    ),  # fmt: skip
    "4-D mask": (
        lambda m: dict(input_ids=IDS, attention_mask=torch.ones(2, 1, 8, 8)),
        ValueError,
        "attention_mask must be [batch=2,",
    ),  # fmt: skip
    "complex mask": (
        lambda m: dict(input_ids=IDS, attention_mask=torch.ones(2, 8, dtype=torch.complex64)),
        TypeError,
        "attention_mask",
    ),  # fmt: skip
    "mask as a list": (lambda m: dict(input_ids=IDS, attention_mask=[[1] * 8] * 2), TypeError, "attention_mask"),
    "labels over the vocabulary": (
        lambda m: dict(input_ids=IDS, labels=IDS + VOCAB + 37),
        ValueError,
        "labels must lie in [0, vocab_size=40) or be -100",
    ),  # fmt: skip
    "labels of -1": (
        lambda m: dict(input_ids=IDS, labels=torch.full_like(IDS, -1)),
        ValueError,
        "labels must lie in",
    ),  # fmt: skip
    "labels of the wrong shape": (
        lambda m: dict(input_ids=IDS, labels=IDS[:, :5]),
        ValueError,
        "labels must have shape (2, 8)",
    ),  # fmt: skip
    "float labels": (lambda m: dict(input_ids=IDS, labels=IDS.float()), TypeError, "labels"),
}
CAUSAL_ONLY = {
    "shift_labels over the vocabulary": (
        lambda m: dict(input_ids=IDS, shift_labels=IDS + VOCAB),
        ValueError,
        "shift_labels must lie in",
    ),  # fmt: skip
    "shift_labels of the wrong shape": (
        lambda m: dict(input_ids=IDS, shift_labels=IDS[:1]),
        ValueError,
        "shift_labels must have shape (2, 8)",
    ),  # fmt: skip
}


def cases():
    for model in MODELS:
        extra = CAUSAL_ONLY if model != "sinkhorn-mlm" else {}
        for name in {**BAD_INPUTS, **extra}:
            yield pytest.param(model, name, id=f"{model}: {name}")


@pytest.mark.parametrize("model_name, case", list(cases()))
def test_a_bad_input_gets_an_error_naming_the_argument(model_name, case):
    make, error, words = {**BAD_INPUTS, **CAUSAL_ONLY}[case]
    torch.manual_seed(0)
    model = MODELS[model_name]()
    with pytest.raises(error) as raised:
        model(**make(model))
    assert words in str(raised.value)


@pytest.mark.parametrize("model_name", ["compressive", "sinkhorn"])
def test_a_cache_of_the_other_model_or_of_another_batch_size_is_refused(model_name):
    torch.manual_seed(0)
    model, other = (compressive(), sinkhorn()) if model_name == "compressive" else (sinkhorn(), compressive())
    foreign = other(IDS, use_cache=True).cache
    with pytest.raises(TypeError, match="cache is a .* model; this .* model needs its own"):
        model(IDS, cache=foreign)
    own = model(IDS, use_cache=True).cache
    with pytest.raises(ValueError, match="cache holds batch size 2, inputs have batch size 1"):
        model(IDS[:1, :1], cache=own)


def test_sinkhorn_context_of_the_wrong_shape_is_refused():
    torch.manual_seed(0)
    model = sinkhorn(causal=False, receives_context=True)
    context = torch.randn(2, 6, HIDDEN)
    with pytest.raises(ValueError, match=r"encoder_attention_mask must be \[batch=2, 6\]"):
        model(IDS, encoder_hidden_states=context, encoder_attention_mask=torch.ones(2, 5))
    with pytest.raises(ValueError, match="encoder_attention_mask must hold only 0 and 1"):
        model(IDS, encoder_hidden_states=context, encoder_attention_mask=torch.full((2, 6), 0.5))


@pytest.mark.parametrize("dtype", [torch.bool, torch.long, torch.int32, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("model_name", ["compressive", "sinkhorn"])
def test_every_mask_dtype_holding_0_and_1_gives_the_same_logits(model_name, dtype):
    torch.manual_seed(0)
    model = MODELS[model_name]()
    mask = torch.ones(2, 8, dtype=torch.long)
    mask[1, :3] = 0  # left padding
    with torch.no_grad():
        expected = model(IDS, attention_mask=mask.bool()).logits
        got = model(IDS, attention_mask=mask.to(dtype)).logits
    assert torch.equal(got, expected)


def reference_loss(logits, targets):
    """Plain cross-entropy of logits[:, t] against targets[:, t] (targets already shifted), -100 ignored."""
    keep = targets != -100
    return F.cross_entropy(logits[keep].double(), targets[keep]).float()


@pytest.mark.parametrize("model_name", ["compressive", "sinkhorn"])
def test_labels_are_shifted_and_shift_labels_are_used_as_given(model_name):
    torch.manual_seed(0)
    model = MODELS[model_name]()
    labels = IDS.clone()
    labels[0, 2] = -100
    with torch.no_grad():
        out = model(IDS, labels=labels)
        shifted = torch.cat([labels[:, 1:], torch.full((2, 1), -100)], dim=1)
        torch.testing.assert_close(out.loss, reference_loss(out.logits, shifted))
        # shift_labels: taken as they are (position t predicts shift_labels[t]), e.g. the input itself
        own = model(IDS, shift_labels=IDS)
        torch.testing.assert_close(own.loss, reference_loss(own.logits, IDS))
        assert not torch.allclose(own.loss, out.loss)


def test_sinkhorn_shift_labels_with_random_truncation_is_refused():
    model = sinkhorn(randomly_truncate_sequence=True).train()
    with pytest.raises(ValueError, match="shift_labels cannot be used with randomly_truncate_sequence"):
        model(IDS, shift_labels=IDS)
