"""The sequence- and token-classification heads (longrange/classification.py) of both models, with transformers'
Llama heads beside them as the reference behaviour.

Every expected number is computed here from the base model alone (`model.model`) and the head's `score` weight:
a padded batch's logits must equal each sequence run alone, summarised by hand (its last token, or the mean of its
tokens), and every loss must equal torch's own function of those logits.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from transformers import (
    AutoModelForQuestionAnswering,
    AutoModelForSequenceClassification,
    AutoModelForTokenClassification,
    LlamaConfig,
    LlamaForQuestionAnswering,
    LlamaForSequenceClassification,
    LlamaForTokenClassification,
)

from longrange import (
    CompressiveConfig,
    CompressiveForCausalLM,
    CompressiveForQuestionAnswering,
    CompressiveForSequenceClassification,
    CompressiveForTokenClassification,
    SinkhornConfig,
    SinkhornForCausalLM,
    SinkhornForQuestionAnswering,
    SinkhornForSequenceClassification,
    SinkhornForTokenClassification,
)

VOCAB, PAD, LABELS = 40, 0, 3
COMMON = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, pad_token_id=PAD)


def config_of(name: str, **overrides):
    """Tiny configs: the Compressive model runs 4-token segments (a 14-token input fills, evicts and compresses
    memories), Sinkhorn 4-token buckets; factorised embeddings for non-causal Sinkhorn (its head reads emb_dim)."""
    kwargs = {**COMMON, "num_labels": LABELS, **overrides}
    if name == "llama":
        return LlamaConfig(**kwargs, intermediate_size=64, num_key_value_heads=2, max_position_embeddings=64)
    if name == "compressive":
        return CompressiveConfig(**kwargs, intermediate_size=64, segment_length=4, mem_len=4, c_mem_len=2)
    causal = name == "sinkhorn"
    extra = {} if causal else dict(emb_dim=16)
    return SinkhornConfig(**kwargs, bucket_size=4, max_position_embeddings=64, causal=causal, **extra)


SEQUENCE = {
    "llama": LlamaForSequenceClassification,
    "compressive": CompressiveForSequenceClassification,
    "sinkhorn": SinkhornForSequenceClassification,
    "sinkhorn-noncausal": SinkhornForSequenceClassification,
}
TOKEN = {
    "llama": LlamaForTokenClassification,
    "compressive": CompressiveForTokenClassification,
    "sinkhorn": SinkhornForTokenClassification,
    "sinkhorn-noncausal": SinkhornForTokenClassification,
}

ANSWER = {
    "llama": LlamaForQuestionAnswering,
    "compressive": CompressiveForQuestionAnswering,
    "sinkhorn": SinkhornForQuestionAnswering,
    "sinkhorn-noncausal": SinkhornForQuestionAnswering,
}


def model_of(table: dict, name: str, **overrides):
    torch.manual_seed(0)
    return table[name](config_of(name, **overrides)).eval()


def padded_batch(lengths, side: str):
    """Rows of the given lengths, padded on `side` to the longest, and the rows alone."""
    g = torch.Generator().manual_seed(1)
    rows = [torch.randint(1, VOCAB, (n,), generator=g) for n in lengths]
    longest = max(lengths)
    ids = torch.full((len(rows), longest), PAD)
    mask = torch.zeros(len(rows), longest, dtype=torch.long)
    for i, row in enumerate(rows):
        span = slice(longest - len(row), longest) if side == "left" else slice(0, len(row))
        ids[i, span], mask[i, span] = row, 1
    return ids, mask, rows


def summary(model, row: torch.Tensor, pooling: str) -> torch.Tensor:
    """The base model's states of one unpadded row, summarised by hand."""
    hidden = model.base_model(row[None]).last_hidden_state[0]
    return hidden[-1] if pooling == "last" else hidden.mean(0)


POOLINGS = [("llama", "last"), ("compressive", "last"), ("compressive", "mean"), ("sinkhorn", "last")]
POOLINGS += [("sinkhorn", "mean"), ("sinkhorn-noncausal", "mean"), ("sinkhorn-noncausal", "last")]


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("name,pooling", POOLINGS)
def test_padded_batch_logits_equal_each_sequence_alone(name, pooling, side):
    overrides = {} if name == "llama" else dict(classifier_pooling=pooling)
    model = model_of(SEQUENCE, name, **overrides)
    ids, mask, rows = padded_batch([14, 9, 5], side)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
        expected = torch.stack([summary(model, row, pooling) @ model.score.weight.T for row in rows])
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-4)
    if name != "llama":  # without a mask the padding is found from pad_token_id, as in transformers' heads
        with torch.no_grad():
            unmasked = model(input_ids=ids).logits
        if side == "right" and name != "sinkhorn-noncausal":  # causal: trailing padding changes no real token
            torch.testing.assert_close(unmasked, expected, atol=1e-5, rtol=1e-4)


def test_default_pooling_follows_causality():
    causal = model_of(SEQUENCE, "sinkhorn")
    noncausal = model_of(SEQUENCE, "sinkhorn-noncausal")
    ids, mask, rows = padded_batch([12, 7], "right")
    with torch.no_grad():
        for model, pooling in ((causal, "last"), (noncausal, "mean")):
            expected = torch.stack([summary(model, row, pooling) @ model.score.weight.T for row in rows])
            torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", list(SEQUENCE))
def test_sequence_losses_follow_problem_type(name):
    ids, mask, _ = padded_batch([14, 9, 5], "right")
    model = model_of(SEQUENCE, name)
    labels = torch.tensor([2, 0, 1])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits, labels))

    model = model_of(SEQUENCE, name, num_labels=1)
    targets = torch.tensor([0.5, -1.0, 2.0])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=targets)
    torch.testing.assert_close(out.loss, F.mse_loss(out.logits.squeeze(-1), targets))

    model = model_of(SEQUENCE, name, problem_type="multi_label_classification")
    targets = torch.tensor([[1.0, 0.0, 1.0], [0.0, 0.0, 1.0], [1.0, 1.0, 0.0]])
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=targets)
    torch.testing.assert_close(out.loss, F.binary_cross_entropy_with_logits(out.logits, targets))


@pytest.mark.parametrize("name", list(TOKEN))
def test_token_logits_and_loss(name):
    model = model_of(TOKEN, name)
    ids, mask, rows = padded_batch([14, 9], "right")
    labels = torch.randint(0, LABELS, ids.shape, generator=torch.Generator().manual_seed(2))
    labels[mask == 0] = -100
    labels[0, :3] = -100
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
    score = model.score
    for i, row in enumerate(rows):  # real tokens: the row alone
        if name != "sinkhorn-noncausal" or len(row) == ids.shape[1]:
            with torch.no_grad():
                alone = score(model.base_model(row[None]).last_hidden_state[0])
            torch.testing.assert_close(out.logits[i, : len(row)], alone, atol=1e-5, rtol=1e-4)
    kept = labels != -100
    torch.testing.assert_close(out.loss, F.cross_entropy(out.logits[kept], labels[kept]))


@pytest.mark.parametrize("name", list(ANSWER))
def test_answer_span_logits_and_loss(name):
    """Start and end logits of every real token equal the row alone; the loss is the mean of the start and end
    cross-entropies, a position beyond the input ignored (transformers' rule for answers truncated away)."""
    model = model_of(ANSWER, name)
    ids, mask, rows = padded_batch([14, 9, 11], "right")
    starts, ends = torch.tensor([2, 0, 14]), torch.tensor([5, 3, 20])  # the last row's answer was truncated away
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask, start_positions=starts, end_positions=ends)
    for i, row in enumerate(rows):
        if name != "sinkhorn-noncausal" or len(row) == ids.shape[1]:
            with torch.no_grad():
                alone = model.qa_outputs(model.base_model(row[None]).last_hidden_state[0])
            torch.testing.assert_close(out.start_logits[i, : len(row)], alone[:, 0], atol=1e-5, rtol=1e-4)
            torch.testing.assert_close(out.end_logits[i, : len(row)], alone[:, 1], atol=1e-5, rtol=1e-4)
    seq = ids.shape[1]
    start = F.cross_entropy(out.start_logits, starts.clamp(0, seq), ignore_index=seq)
    end = F.cross_entropy(out.end_logits, ends.clamp(0, seq), ignore_index=seq)
    torch.testing.assert_close(out.loss, (start + end) / 2)


def test_token_dropout_follows_transformers_rule():
    assert model_of(TOKEN, "compressive").dropout.p == 0.0  # hidden_dropout
    assert model_of(TOKEN, "compressive", hidden_dropout=0.2).dropout.p == 0.2
    assert model_of(TOKEN, "sinkhorn").dropout.p == 0.1  # no hidden_dropout: 0.1, as Llama's head
    assert model_of(TOKEN, "llama").dropout.p == 0.1
    assert model_of(TOKEN, "sinkhorn", classifier_dropout=0.3).dropout.p == 0.3


@pytest.mark.parametrize("table", [SEQUENCE, TOKEN, ANSWER], ids=["sequence", "token", "answer"])
def test_compressive_loss_adds_reconstruction_and_trains_the_compressor(table):
    model = model_of(table, "compressive", reconstruction_loss_weight=0.5).train()
    ids, mask, _ = padded_batch([14, 14], "right")
    if table is ANSWER:
        starts, ends = torch.tensor([1, 4]), torch.tensor([3, 9])
        out = model(input_ids=ids, attention_mask=mask, start_positions=starts, end_positions=ends)
        classification = (F.cross_entropy(out.start_logits, starts) + F.cross_entropy(out.end_logits, ends)) / 2
    else:
        labels = torch.tensor([1, 2]) if table is SEQUENCE else torch.randint(0, LABELS, ids.shape)
        out = model(input_ids=ids, attention_mask=mask, labels=labels)
        logits = out.logits.flatten(0, -2) if table is TOKEN else out.logits
        classification = F.cross_entropy(logits, labels.flatten())
    assert out.reconstruction_loss is not None and out.reconstruction_loss.item() > 0
    torch.testing.assert_close(out.loss, classification + 0.5 * out.reconstruction_loss)
    out.loss.backward()
    compressors = [p for n, p in model.named_parameters() if ".compress." in n]
    assert compressors and all(p.grad is not None and p.grad.abs().sum() > 0 for p in compressors)


@pytest.mark.parametrize("name", ["compressive", "sinkhorn"])
def test_cache_classifies_a_document_in_chunks(name):
    """A document fed in two calls, the cache carried, ends with the logits of one call over all of it."""
    model = model_of(SEQUENCE, name)
    ids, _, _ = padded_batch([16, 16], "right")
    with torch.no_grad():
        whole = model(input_ids=ids).logits
        first = model(input_ids=ids[:, :10], use_cache=True)
        assert first.cache is not None
        second = model(input_ids=ids[:, 10:], cache=first.cache, use_cache=True)
    torch.testing.assert_close(second.logits, whole, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["compressive", "sinkhorn", "sinkhorn-noncausal"])
def test_bad_pooling_is_refused_naming_the_field(name):
    with pytest.raises(ValueError, match="classifier_pooling"):
        config_of(name, classifier_pooling="max")
    with pytest.raises(ValueError, match="classifier_dropout"):
        config_of(name, classifier_dropout=1.5)


@pytest.mark.parametrize("name", ["compressive", "sinkhorn"])
def test_classifier_from_a_language_model_folder(name, tmp_path):
    """Fine-tuning starts from a language model's folder: the body loads, the head starts afresh."""
    torch.manual_seed(0)
    config = config_of(name)
    lm = (CompressiveForCausalLM if name == "compressive" else SinkhornForCausalLM)(config).eval()
    lm.save_pretrained(tmp_path)
    for auto in (AutoModelForSequenceClassification, AutoModelForTokenClassification, AutoModelForQuestionAnswering):
        model = auto.from_pretrained(tmp_path, num_labels=5).eval()
        assert (model.qa_outputs if auto is AutoModelForQuestionAnswering else model.score).out_features in (2, 5)
        ids = torch.randint(1, VOCAB, (1, 12))
        with torch.no_grad():
            torch.testing.assert_close(model.model(ids).last_hidden_state, lm.model(ids).last_hidden_state)


@pytest.mark.parametrize("name", ["compressive", "sinkhorn"])
def test_classifier_from_a_language_model_folder_without_longrange(name, tmp_path):
    """The same where longrange is not installed: the folder's own code (`trust_remote_code=True`), as a Llama
    folder loads as a classifier."""
    torch.manual_seed(0)
    lm = (CompressiveForCausalLM if name == "compressive" else SinkhornForCausalLM)(config_of(name)).eval()
    lm.save_pretrained(tmp_path / "model")
    ids = torch.randint(1, VOCAB, (2, 12))
    torch.save(ids, tmp_path / "ids.pt")
    script = textwrap.dedent(
        f"""
        import sys
        sys.modules["longrange"] = None  # `import longrange` now fails
        import torch
        import transformers
        ids = torch.load({str(tmp_path / "ids.pt")!r})
        hidden = {{}}
        for head in ("SequenceClassification", "TokenClassification", "QuestionAnswering"):
            auto = getattr(transformers, "AutoModelFor" + head)
            model = auto.from_pretrained({str(tmp_path / "model")!r}, num_labels=4, trust_remote_code=True).eval()
            assert "longrange" not in type(model).__module__, type(model).__module__
            with torch.no_grad():
                out = model(ids, output_hidden_states=True)
            logits = out.start_logits[..., None] if head == "QuestionAnswering" else out.logits
            assert logits.shape[-1] == (1 if head == "QuestionAnswering" else 4), logits.shape
            hidden[auto.__name__] = out.hidden_states[-1]
        torch.save(hidden, {str(tmp_path / "hidden.pt")!r})
        """
    )
    env = dict(os.environ, HF_MODULES_CACHE=str(tmp_path / "modules"), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    with torch.no_grad():
        expected = lm.model(ids, output_hidden_states=True).hidden_states[-1]
    hidden_states = torch.load(tmp_path / "hidden.pt")
    assert len(hidden_states) == 3
    for hidden in hidden_states.values():
        torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-4)  # the subprocess runs one thread


@pytest.mark.parametrize("table", [SEQUENCE, TOKEN], ids=["sequence", "token"])
def test_trainer_accumulation_moves_every_parameter_as_llama(tmp_path, table):
    """One SGD step of 2 accumulation steps of 2 rows against 1 step of 4 rows, under plain `Trainer`: every
    parameter of our heads (the Compressive compressor, trained by the reconstruction loss alone, included) moves by
    the factor Llama's head moves by (a classification loss is a mean per call, as transformers' heads'); the loss
    is a mean over equal rows, so the accumulated update is the big batch's."""
    from transformers import Trainer, TrainingArguments

    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(1, VOCAB, (4, 16), generator=generator)
    labels = torch.randint(0, LABELS, (4,) if table is SEQUENCE else (4, 16), generator=generator)
    rows = [{"input_ids": i, "labels": label} for i, label in zip(ids, labels)]

    def update(name: str, batch: int, accumulation: int) -> dict[str, torch.Tensor]:
        model = model_of(table, name, classifier_dropout=0.0).train()
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        args = TrainingArguments(
            output_dir=str(tmp_path / f"{name}-{batch}x{accumulation}"), max_steps=1, per_device_train_batch_size=batch,
            gradient_accumulation_steps=accumulation, learning_rate=0.5, lr_scheduler_type="constant", optim="sgd",
            max_grad_norm=0.0, weight_decay=0.0, use_cpu=True, report_to="none", save_strategy="no", seed=0,
            disable_tqdm=True,
        )  # fmt: skip
        Trainer(model=model, args=args, train_dataset=rows).train()
        return {n: p.detach() - before[n] for n, p in model.named_parameters()}

    big, accumulated = update("llama", 4, 1)["score.weight"], update("llama", 2, 2)["score.weight"]
    factor = float(accumulated.flatten() @ big.flatten() / (big.flatten() @ big.flatten()))
    torch.testing.assert_close(accumulated, factor * big, rtol=0, atol=1e-6)  # Trainer's own factor
    for name in ("compressive", "sinkhorn"):
        big, accumulated = update(name, 4, 1), update(name, 2, 2)
        if name == "compressive":
            compression = [n for n in big if ".compress." in n]
            assert compression and all(big[n].abs().max() > 1e-5 for n in compression)
        for key in big:
            torch.testing.assert_close(accumulated[key], factor * big[key], rtol=0, atol=1e-5, msg=key)


@pytest.mark.parametrize("table", [SEQUENCE, TOKEN, ANSWER], ids=["sequence", "token", "answer"])
def test_longrange_trainer_logs_the_reconstruction_loss_and_predicts(tmp_path, table):
    """`LongrangeTrainer` (the Trainer that logs the Compressive loss parts) with each head: the reconstruction loss
    in the training log, and predictions that are the heads' logits (start and end logits for an answer head)."""
    from transformers import TrainingArguments

    from longrange.trainer import LongrangeTrainer

    ids = torch.randint(1, VOCAB, (8, 16), generator=torch.Generator().manual_seed(0))
    if table is ANSWER:
        rows = [{"input_ids": i, "start_positions": torch.tensor(2), "end_positions": torch.tensor(5)} for i in ids]
    else:
        rows = [{"input_ids": i, "labels": torch.tensor(1) if table is SEQUENCE else i % LABELS} for i in ids]
    model = model_of(table, "compressive").train()
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=4, logging_steps=1, use_cpu=True,
        report_to="none", save_strategy="no", disable_tqdm=True,
    )  # fmt: skip
    trainer = LongrangeTrainer(model=model, args=args, train_dataset=rows, eval_dataset=rows)
    trainer.train()
    logged = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logged) == 2 and all(entry["reconstruction_loss"] > 0 for entry in logged)
    predictions = trainer.predict(rows).predictions
    with torch.no_grad():
        out = model.eval()(input_ids=ids)
    if table is ANSWER:
        start, end = predictions
        torch.testing.assert_close(torch.as_tensor(start), out.start_logits, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(torch.as_tensor(end), out.end_logits, atol=1e-5, rtol=1e-4)
    else:
        torch.testing.assert_close(torch.as_tensor(predictions), out.logits, atol=1e-5, rtol=1e-4)
