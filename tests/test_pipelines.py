"""transformers' pipelines on saved folders, loaded by path with `trust_remote_code=True`, with a built-in model beside
ours as the reference behaviour (Llama; BERT for the masked model).

- text generation with a `TextIteratorStreamer`, as a chat front end serves a model: generation runs in a thread
  while the caller reads text as it comes; the streamed text must be the pipeline's own result, which must be plain
  greedy decoding without a cache (a loop of full forwards written here);
- fill-mask, the masked Sinkhorn model's door, after a few `Trainer` steps with transformers' MLM collator: a padded
  batch of inputs of different lengths; every candidate and score must be the softmax of a forward over that input
  alone;
- text and token classification, the classification heads' doors, after a few `Trainer` steps with transformers'
  padding collators (Llama's heads beside): every label and score of a padded batch must be the softmax of a
  forward over that text alone.
"""

from __future__ import annotations

import copy
import math
from threading import Thread

import pytest
import torch
from client_utils import SPECIAL, TOKENIZER, causal_models
from transformers import (
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    BertConfig,
    BertForMaskedLM,
    DataCollatorForLanguageModeling,
    DataCollatorForTokenClassification,
    DataCollatorWithPadding,
    LlamaConfig,
    TextIteratorStreamer,
    Trainer,
    TrainingArguments,
    pipeline,
)

from longrange import CompressiveConfig, SinkhornConfig, SinkhornForMaskedLM

MODELS = causal_models(max_positions=128)
PROMPT, NEW_TOKENS = "To be, or not to be: that is the question.", 30  # prompt and answer span several segments


@pytest.mark.parametrize("name", list(MODELS))
def test_pipeline_streams_the_greedy_continuation(name, tmp_path):
    torch.manual_seed(0)
    MODELS[name]().save_pretrained(tmp_path)
    TOKENIZER.save_pretrained(tmp_path)
    generator = pipeline("text-generation", model=str(tmp_path), trust_remote_code=True)
    streamer = TextIteratorStreamer(generator.tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=60)
    results = []
    kwargs = dict(streamer=streamer, max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False)
    thread = Thread(target=lambda: results.append(generator(PROMPT, **kwargs)))
    thread.start()
    pieces = list(streamer)
    thread.join()
    assert len(pieces) > 1, "the text arrives in pieces, while generating"

    ids = TOKENIZER(PROMPT, add_special_tokens=False)["input_ids"]
    model = generator.model
    with torch.no_grad():
        for _ in range(NEW_TOKENS):
            logits = model(torch.tensor([ids]), use_cache=False).logits[0, -1]
            logits[TOKENIZER.eos_token_id] = -float("inf")  # min_new_tokens: no end of text before the last token
            ids.append(int(logits.argmax()))
    expected = TOKENIZER.decode(ids[len(PROMPT) :], skip_special_tokens=True)
    assert "".join(pieces) == expected
    assert results[0][0]["generated_text"] == PROMPT + expected


SIZES = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, max_position_embeddings=128)


def masked_sinkhorn(vocab: int, **overrides):
    config = SinkhornConfig(**{**SPECIAL, "vocab_size": vocab}, **SIZES, bucket_size=8, causal=False, **overrides)
    return SinkhornForMaskedLM(config)


MASKED = {
    "bert": lambda vocab: BertForMaskedLM(
        BertConfig(vocab_size=vocab, **SIZES, intermediate_size=64, pad_token_id=TOKENIZER.pad_token_id)
    ),
    "sinkhorn": masked_sinkhorn,
    "sinkhorn, sortcut": lambda vocab: masked_sinkhorn(vocab, n_sortcut=2),
}
MASKED_TEXTS = ["Hello <mask>orld", "A longer sentence with a <mask>ask in it, to be padded in the batch, or not."]


@pytest.mark.parametrize("name", list(MASKED))
def test_masked_model_trains_with_the_mlm_collator_and_fill_mask_scores_each_input_alone(name, tmp_path):
    tok = copy.deepcopy(TOKENIZER)  # the byte tokenizer with a mask token
    tok.add_special_tokens({"mask_token": "<mask>"})
    torch.manual_seed(0)
    model = MASKED[name](len(tok))
    texts = ["the quick brown fox jumps over the lazy dog. " * 2, "pack my box with five dozen liquor jugs. "] * 4
    args = TrainingArguments(output_dir=str(tmp_path / "run"), max_steps=3, per_device_train_batch_size=4,
                             use_cpu=True, report_to=[], save_strategy="no", dataloader_num_workers=0)  # fmt: skip
    collator = DataCollatorForLanguageModeling(tok, mlm_probability=0.15)  # masks, pads, labels only the masked
    data = [{"input_ids": tok(text)["input_ids"]} for text in texts]
    assert math.isfinite(
        Trainer(model=model, args=args, train_dataset=data, data_collator=collator).train().training_loss
    )
    model.save_pretrained(tmp_path / "model")
    tok.save_pretrained(tmp_path / "model")
    fill = pipeline("fill-mask", model=str(tmp_path / "model"), trust_remote_code=True)
    results = fill(MASKED_TEXTS, top_k=3, batch_size=2)
    for text, candidates in zip(MASKED_TEXTS, results):
        ids = tok(text, return_tensors="pt")["input_ids"]
        with torch.no_grad():
            logits = fill.model(input_ids=ids).logits[0, int((ids[0] == tok.mask_token_id).nonzero())]
        scores, tokens = torch.softmax(logits.double(), -1).topk(3)
        assert [c["token"] for c in candidates] == tokens.tolist()
        assert [c["score"] for c in candidates] == pytest.approx(scores.tolist(), rel=1e-5)
        assert candidates[0]["sequence"] == text.replace("<mask>", tok.decode([int(tokens[0])]))


LABELS = {0: "O", 1: "B-WORD", 2: "I-WORD"}
CLASSIFIER_CONFIGS = {
    "llama": lambda: LlamaConfig(**SPECIAL, **SIZES, intermediate_size=64, num_key_value_heads=2),
    "compressive": lambda: CompressiveConfig(
        **SPECIAL, **{k: SIZES[k] for k in SIZES if k != "max_position_embeddings"}, intermediate_size=64,
        segment_length=8, mem_len=8, c_mem_len=4,
    ),
    "sinkhorn": lambda: SinkhornConfig(**SPECIAL, **SIZES, bucket_size=8, causal=True),
    "sinkhorn, non-causal": lambda: SinkhornConfig(**SPECIAL, **SIZES, bucket_size=8, causal=False),
}  # fmt: skip
TEXTS = ["Short.", "A longer text that runs over several segments and buckets, padded in the batch.", "Mid-sized one"]


def trained_classifier(auto, name: str, collator, data, folder):
    """A classifier of `name` built through `auto`, after 3 Trainer steps on `data`, saved with the tokenizer."""
    torch.manual_seed(0)
    config = CLASSIFIER_CONFIGS[name]()
    config.id2label, config.label2id = LABELS, {v: k for k, v in LABELS.items()}
    model = auto.from_config(config)
    args = TrainingArguments(output_dir=str(folder / "run"), max_steps=3, per_device_train_batch_size=3,
                             use_cpu=True, report_to=[], save_strategy="no", dataloader_num_workers=0)  # fmt: skip
    result = Trainer(model=model, args=args, train_dataset=data, data_collator=collator).train()
    assert math.isfinite(result.training_loss)
    model.save_pretrained(folder / "model")
    TOKENIZER.save_pretrained(folder / "model")
    return folder / "model"


@pytest.mark.parametrize("name", list(CLASSIFIER_CONFIGS))
def test_text_classification_trains_and_scores_each_text_alone(name, tmp_path):
    data = [{**TOKENIZER(text), "label": i % 3} for i, text in enumerate(TEXTS * 2)]
    folder = trained_classifier(
        AutoModelForSequenceClassification, name, DataCollatorWithPadding(TOKENIZER), data, tmp_path
    )
    classify = pipeline("text-classification", model=str(folder), trust_remote_code=True, top_k=None)
    for text, result in zip(TEXTS, classify(TEXTS, batch_size=3)):
        with torch.no_grad():
            logits = classify.model(**TOKENIZER(text, return_tensors="pt")).logits[0]
        expected = {LABELS[i]: p for i, p in enumerate(torch.softmax(logits.double(), -1).tolist())}
        assert {r["label"]: r["score"] for r in result} == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("name", list(CLASSIFIER_CONFIGS))
def test_token_classification_trains_and_labels_each_text_alone(name, tmp_path):
    def labelled(text):  # B- at a word's first letter, I- inside it, O elsewhere
        tags = [0 if not c.isalpha() else 1 if i == 0 or not text[i - 1].isalpha() else 2 for i, c in enumerate(text)]
        return {"input_ids": TOKENIZER(text, add_special_tokens=False)["input_ids"], "labels": tags}

    collator = DataCollatorForTokenClassification(TOKENIZER)
    folder = trained_classifier(AutoModelForTokenClassification, name, collator, [labelled(t) for t in TEXTS], tmp_path)
    tag = pipeline("token-classification", model=str(folder), trust_remote_code=True, ignore_labels=[])
    for text, entities in zip(TEXTS, tag(TEXTS, batch_size=3)):
        ids = TOKENIZER(text, return_tensors="pt")
        with torch.no_grad():
            probs = torch.softmax(tag.model(**ids).logits[0].double(), -1)
        real = [i for i, t in enumerate(ids["input_ids"][0].tolist()) if t not in TOKENIZER.all_special_ids]
        assert [e["index"] for e in entities] == real
        assert [e["entity"] for e in entities] == [LABELS[int(probs[i].argmax())] for i in real]
        assert [e["score"] for e in entities] == pytest.approx([float(probs[i].max()) for i in real], rel=1e-5)
