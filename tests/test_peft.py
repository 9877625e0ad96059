"""LoRA through PEFT with no `target_modules`: trains, saves, reloads and merges for both models."""

from __future__ import annotations

import pytest
import torch

from longrange import CompressiveConfig, CompressiveForCausalLM, SinkhornConfig, SinkhornForCausalLM

peft = pytest.importorskip("peft")  # in the `test` extra: CI installs it

VOCAB = 48
MODELS = {
    "compressive": lambda: CompressiveForCausalLM(
        CompressiveConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
            segment_length=8, mem_len=8, c_mem_len=4, compression_rate=2,
        )
    ),
    "sinkhorn": lambda: SinkhornForCausalLM(
        SinkhornConfig(
            vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, bucket_size=8, causal=True,
        )
    ),
}  # fmt: skip


def base_model(kind: str):
    torch.manual_seed(0)
    return MODELS[kind]()


def train(model, batch: dict, steps: int) -> None:
    """AdamW steps on the trainable parameters over one batch; the loss must fall."""
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.train()
    losses = []
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1, losses


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_lora_with_default_targets_trains_saves_reloads_and_merges(kind, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    model = get_peft_model(base_model(kind), LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, lora_dropout=0.0))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in name for name in trainable)
    expected_targets = {"compressive": {"q_proj", "kv_proj", "o_proj"}, "sinkhorn": {"to_q", "to_kv", "to_out"}}[kind]
    assert {name.split(".lora_")[0].rsplit(".", 1)[-1] for name in trainable} == expected_targets

    ids = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(1))
    train(model, dict(input_ids=ids, labels=ids), steps=8)
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        assert not torch.allclose(adapted, base_model(kind).eval()(ids).logits, atol=1e-3)

    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(base_model(kind), tmp_path / "adapter").eval()
    merged = reloaded.merge_and_unload().eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, adapted, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(merged(ids).logits, adapted, atol=1e-4, rtol=1e-4)
    assert type(merged) is type(base_model(kind))
    prompt = ids[:1, :10]
    tokens = model.generate(input_ids=prompt, max_new_tokens=12, do_sample=False)
    assert torch.equal(tokens, merged.generate(prompt, max_new_tokens=12, do_sample=False))


@pytest.mark.parametrize("kind", sorted(MODELS))
def test_lora_sequence_classification_trains_the_adapters_and_the_new_head(kind, tmp_path):
    """`task_type="SEQ_CLS"`: LoRA on the default targets, and the freshly initialised head (`score`, the name
    transformers' heads use, which PEFT trains and saves in full) - the usual way to fine-tune a language model's
    body for classification."""
    from peft import LoraConfig, PeftModel, get_peft_model

    from longrange import CompressiveForSequenceClassification, SinkhornForSequenceClassification

    classes = {"compressive": CompressiveForSequenceClassification, "sinkhorn": SinkhornForSequenceClassification}
    base_model(kind).save_pretrained(tmp_path / "lm")

    def classifier():
        torch.manual_seed(0)
        return classes[kind].from_pretrained(tmp_path / "lm", num_labels=2, pad_token_id=0)

    model = get_peft_model(classifier(), LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8, lora_dropout=0.0))
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert {n for n in trainable if "lora_" not in n} == {"base_model.model.score.modules_to_save.default.weight"}
    ids = torch.randint(1, VOCAB, (4, 24), generator=torch.Generator().manual_seed(1))
    train(model, dict(input_ids=ids, labels=torch.tensor([0, 1, 1, 0])), steps=10)
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
    model.save_pretrained(tmp_path / "adapter")
    reloaded = PeftModel.from_pretrained(classifier(), tmp_path / "adapter").eval()
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=ids).logits, adapted, atol=1e-5, rtol=1e-5)
