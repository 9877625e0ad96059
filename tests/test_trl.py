"""TRL's `DPOTrainer` and `GRPOTrainer` on saved folders, in float32 and in bf16 (TRL's default on a GPU), beside
transformers' Llama. (`SFTTrainer` with packing: tests/test_packing.py.)

Each trainer loads the folder by its path and scores the policy (with gradient) against a reference model of the
same weights (without) through the fused LM head it installs. At step 0 they agree, so DPO's loss must be ln 2 with
every reward margin 0, and GRPO's KL to the reference 0: a model whose logits depend on whether gradients are
recorded (the Compressive model under bf16 autocast did) starts elsewhere. The log-probabilities DPO computes for
its own padded batch are checked against plain forwards of each sequence alone; GRPO samples its completions with
the model's `generate()` and cache.
"""

from __future__ import annotations

import math

import datasets
import pytest
import torch
from client_utils import SPECIAL, TOKENIZER, require_client
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from longrange import CompressiveConfig, CompressiveForCausalLM, SinkhornConfig, SinkhornForCausalLM

trl = require_client("trl")
peft = pytest.importorskip("peft")  # in the test extra

COMMON = dict(SPECIAL, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)


def compressive():
    config = CompressiveConfig(**COMMON, intermediate_size=64, segment_length=8, mem_len=8, c_mem_len=4)
    model = CompressiveForCausalLM(config)
    with torch.no_grad():  # non-zero content and position biases (u, v), as after training: they carry the bf16 case
        for layer in model.model.layers:
            layer.attention.content_bias.normal_(0, 0.5)
            layer.attention.position_bias.normal_(0, 0.5)
    return model


MODELS = {
    "llama": lambda: LlamaForCausalLM(
        LlamaConfig(**COMMON, intermediate_size=64, num_key_value_heads=4, max_position_embeddings=128)
    ),
    "compressive": compressive,
    "sinkhorn-factorised": lambda: SinkhornForCausalLM(
        SinkhornConfig(**COMMON, bucket_size=8, max_position_embeddings=128, causal=True, emb_dim=16)
    ),
}
ROWS = {
    "prompt": ["Which fruit is red? ", "Say hi: ", "Two plus two is "],
    "chosen": ["An apple.", "hi", "four"],
    "rejected": ["A banana split, with cream.", "bye", "five, or so"],
}


def dpo_trainer(folder, output, bf16: bool, steps: int, **kwargs):
    args = trl.DPOConfig(
        output_dir=str(output), max_steps=steps, per_device_train_batch_size=3, bf16=bf16, learning_rate=1e-2,
        use_cpu=True, report_to=[], save_strategy="no", logging_steps=1, dataloader_num_workers=0,
    )  # fmt: skip
    data = datasets.Dataset.from_dict(ROWS)
    return trl.DPOTrainer(model=str(folder), args=args, train_dataset=data, processing_class=TOKENIZER, **kwargs)


@pytest.fixture(scope="module", params=list(MODELS))
def folder(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    torch.manual_seed(0)
    MODELS[request.param]().save_pretrained(path)
    TOKENIZER.save_pretrained(path)
    return path


@pytest.mark.parametrize("bf16, lora", [(False, False), (True, False), (True, True)], ids=["fp32", "bf16", "bf16-lora"])
def test_dpo_starts_at_ln_2_with_zero_margins_and_trains(folder, tmp_path, bf16, lora):
    # with LoRA (no target_modules: importing longrange registers ours with PEFT) the reference is the base model
    # with the adapters switched off
    adapters = dict(peft_config=peft.LoraConfig(task_type="CAUSAL_LM", r=4)) if lora else {}
    dpo = dpo_trainer(folder, tmp_path, bf16, steps=3, **adapters)
    assert isinstance(dpo.model, peft.PeftModel) == lora
    start = {n: p.detach().clone() for n, p in dpo.model.named_parameters()}
    dpo.train()
    first, *_, last = [entry for entry in dpo.state.log_history if "loss" in entry]
    assert first["loss"] == pytest.approx(math.log(2), abs=1e-6)
    # rounding apart at most (float32 Compressive: memory projections computed with and without gradient)
    assert first["rewards/margins"] == pytest.approx(0, abs=1e-5) and first["rewards/chosen"] == pytest.approx(
        0, abs=1e-5
    )
    assert last["loss"] < first["loss"] and last["rewards/margins"] > 0  # the policy learns the preference
    assert any(not torch.equal(p, start[n]) for n, p in dpo.model.named_parameters())


def test_dpo_log_probabilities_of_its_padded_batch_equal_each_sequence_alone(folder, tmp_path):
    dpo = dpo_trainer(folder, tmp_path, bf16=False, steps=1)
    batch = next(iter(dpo.get_train_dataloader()))
    ids, mask, completion = batch["input_ids"], batch["attention_mask"], batch["completion_mask"]
    assert (mask == 0).any(), "rows of different lengths: the batch is padded"
    model = dpo.model.eval()
    with torch.no_grad():  # the trainer's own call: labels where the completion is, through TRL's fused head
        log_probs = model(input_ids=ids, attention_mask=mask, labels=ids.masked_fill(completion == 0, -100),
                          fused_lm_head=True).log_probs  # fmt: skip
    sums = (log_probs.double() * completion[:, 1:]).sum(-1)
    plain = AutoModelForCausalLM.from_pretrained(folder).eval()
    for row, total in zip(range(ids.shape[0]), sums):
        real = ids[row, mask[row].bool()]
        start = int(completion[row].nonzero()[0])
        with torch.no_grad():
            logits = plain(real[None, :-1]).logits[0].double()
        expected = torch.log_softmax(logits, -1)[range(start - 1, len(real) - 1), real[start:]].sum()
        assert total.item() == pytest.approx(expected.item(), abs=1e-4)


def punctuation(completions, **_):  # GRPO's reward: characters before "a" in code order (spaces, digits, capitals, ...)
    return [float(sum(character < "a" for character in text)) for text in completions]


@pytest.mark.parametrize("bf16", [False, True], ids=["fp32", "bf16"])
def test_grpo_samples_with_the_cache_starts_at_zero_kl_and_trains(folder, tmp_path, bf16):
    args = trl.GRPOConfig(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, num_generations=4,
        max_completion_length=12, beta=0.04, bf16=bf16, learning_rate=1e-2, use_cpu=True, report_to=[],
        save_strategy="no", logging_steps=1, dataloader_num_workers=0,
    )  # fmt: skip
    data = datasets.Dataset.from_dict({"prompt": ROWS["prompt"] + ["Name a colour: "]})
    grpo = trl.GRPOTrainer(model=str(folder), reward_funcs=punctuation, args=args, train_dataset=data,
                           processing_class=TOKENIZER)  # fmt: skip
    start = {n: p.detach().clone() for n, p in grpo.model.named_parameters()}
    grpo.train()
    first = grpo.state.log_history[0]
    assert first["kl"] == pytest.approx(0, abs=1e-6)  # the policy with gradient, the reference without
    assert first["reward_std"] > 0  # completions differ, so the advantages (and gradients) are not all zero
    assert 0 < first["completions/mean_length"] <= 12
    assert any(not torch.equal(p, start[n]) for n, p in grpo.model.named_parameters())
