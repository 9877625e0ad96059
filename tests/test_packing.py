"""Packed sequences through the user's door: transformers' `DataCollatorWithFlattening` (and TRL's
`SFTTrainer(packing=True)`) put several documents in one row and restart `position_ids` at each. Every document's
logits must then equal those of the document run alone (the model on that document by itself), as transformers'
Llama gives them beside ours through the same collator, whether the documents run in one group of rows or in
several; the loss is the token-weighted mean over the documents; what cannot be combined with packed documents is
refused, naming the argument."""

from __future__ import annotations

import itertools

import pytest
import torch
from client_utils import require_client
from transformers import DataCollatorWithFlattening, LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

from longrange import (
    CompressiveConfig,
    CompressiveForCausalLM,
    CompressiveModel,
    SinkhornConfig,
    SinkhornForCausalLM,
    SinkhornForMaskedLM,
    packing,
)

VOCAB = 32
LENGTHS = (11, 5, 19, 3, 8)  # none a multiple of the bucket or segment length (4), one shorter than both
SMALL = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2)
COLLATORS = {
    "position_ids": {},
    "flash kwargs and seq_idx": dict(return_flash_attn_kwargs=True, return_seq_idx=True),
    "flash kwargs alone": dict(return_flash_attn_kwargs=True, return_position_ids=False),
}


def compressive(**overrides):
    config = dict(SMALL, intermediate_size=64, segment_length=4, mem_len=4, c_mem_len=4, compression_rate=2)
    return CompressiveForCausalLM(CompressiveConfig(**{**config, "hidden_dropout": 0.0, **overrides}))


def sinkhorn(causal: bool, **overrides):
    config = SinkhornConfig(**SMALL, bucket_size=4, max_position_embeddings=64, causal=causal, **overrides)
    return (SinkhornForCausalLM if causal else SinkhornForMaskedLM)(config)


MODELS = {
    "llama (reference)": lambda: LlamaForCausalLM(
        LlamaConfig(**SMALL, intermediate_size=64, num_key_value_heads=2, max_position_embeddings=64)
    ),
    "compressive": compressive,
    "sinkhorn causal": lambda: sinkhorn(True),
    "sinkhorn causal, local heads, reversible": lambda: sinkhorn(
        True, n_local_attn_heads=1, reversible=True, axial_position_embeddings=False
    ),
    "sinkhorn masked": lambda: sinkhorn(False),
    "sinkhorn masked, sortcut": lambda: sinkhorn(False, n_sortcut=1, n_top_buckets=1),
}
CAUSAL = ("llama (reference)", "compressive", "sinkhorn causal")


def make(name: str):
    torch.manual_seed(0)
    return MODELS[name]().eval()


def documents(lengths=LENGTHS, seed: int = 1) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (n,), generator=generator).tolist() for n in lengths]


def packed(docs, **collator) -> dict:
    return DataCollatorWithFlattening(**collator)([{"input_ids": d} for d in docs])


def per_document(logits: torch.Tensor, docs) -> list[torch.Tensor]:
    return list(logits[0].split([len(d) for d in docs]))


@pytest.fixture(params=["one group", "a group per length"])
def groups(request, monkeypatch):
    """The documents' grouping: all in one group of rows (a call costs more than any padding) or each rounded
    length in a group of its own (a call costs nothing)."""
    monkeypatch.setattr(packing, "GROUP_COST", 10**9 if request.param == "one group" else 0)
    return request.param


@pytest.mark.parametrize("collator", COLLATORS)
@pytest.mark.parametrize("name", MODELS)
def test_each_packed_document_gets_the_logits_it_gets_alone(name, collator, groups):
    model, docs = make(name), documents()
    batch = packed(docs, **COLLATORS[collator])
    if name.startswith("llama") and "position_ids" not in batch:
        pytest.skip("Llama reads the documents from position_ids only (flash kwargs need a flash kernel)")
    with torch.no_grad():
        together = per_document(model(**batch, use_cache=False).logits, docs)
        for doc, logits in zip(docs, together):
            alone = model(torch.tensor([doc])).logits[0]
            torch.testing.assert_close(logits, alone, atol=2e-6, rtol=0)


@pytest.mark.parametrize("name", CAUSAL)
def test_the_packed_loss_is_the_token_weighted_mean_of_the_documents_losses(name):
    model, docs = make(name), documents()
    with torch.no_grad():
        loss = model(**packed(docs), use_cache=False).loss
        alone = [model(torch.tensor([d]), labels=torch.tensor([d])).loss for d in docs]
    predicted = [len(d) - 1 for d in docs]  # the collator's labels are -100 at each document's first token
    expected = sum(a * n for a, n in zip(alone, predicted)) / sum(predicted)
    torch.testing.assert_close(loss, expected, atol=1e-6, rtol=0)


@pytest.mark.parametrize("name", ["compressive", "sinkhorn causal"])
def test_the_packed_loss_trains_as_the_documents_losses_do(name, groups):
    """Gradients of the packed loss equal those of the token-weighted mean of the documents' own losses."""
    model = (compressive(reconstruction_loss="none") if name == "compressive" else make(name)).train()
    docs = documents((6, 11, 4))
    model(**packed(docs)).loss.backward()
    together = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    predicted = [len(d) - 1 for d in docs]
    sum(model(torch.tensor([d]), labels=torch.tensor([d])).loss * n for d, n in zip(docs, predicted)).div(
        sum(predicted)
    ).backward()
    alone = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert together.keys() == alone.keys() and len(alone) > 10
    for n in alone:
        torch.testing.assert_close(together[n], alone[n], atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.parametrize("reconstruction", ["attention", "autoencoding"])
@pytest.mark.parametrize("lengths", [(24, 6), (10, 24)])
def test_each_document_trains_the_compression_as_alone(reconstruction, lengths, groups):
    """Only the 24-token document compresses when alone (segment 4, memory 8); in one group the shorter
    document's row also completes segments with its padding, which compresses but trains nothing; in a group of
    its own it evicts nothing: either way the packed reconstruction loss is the long document's."""
    torch.manual_seed(0)
    model = compressive(mem_len=8, reconstruction_loss=reconstruction).train()
    docs = documents(lengths)
    out = model(**packed(docs))
    alone = [model(torch.tensor([d])).reconstruction_loss for d in docs]
    long = lengths.index(24)
    assert alone[1 - long] == 0 and alone[long] > 0
    torch.testing.assert_close(out.reconstruction_loss, alone[long], atol=1e-7, rtol=1e-6)


def test_compressive_base_model_takes_packed_documents_too():
    torch.manual_seed(0)
    model = CompressiveModel(compressive().config).eval()
    docs = documents((6, 9))
    with torch.no_grad():
        together = model(**packed(docs, return_flash_attn_kwargs=True), return_dict=False)[0]
        alone = torch.cat([model(torch.tensor([d])).last_hidden_state for d in docs], dim=1)
    torch.testing.assert_close(together, alone, atol=2e-6, rtol=0)


@pytest.mark.parametrize("name", ["compressive", "sinkhorn causal"])
def test_trainer_trains_on_packed_batches(name, tmp_path):
    model = make(name).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, per_device_train_batch_size=3, learning_rate=1e-2,
        report_to=[], use_cpu=True, save_strategy="no", logging_steps=1, dataloader_num_workers=0,
    )  # fmt: skip
    data = [{"input_ids": d} for d in documents((7, 12, 5, 9, 3, 10))]
    trainer = Trainer(model=model, args=args, train_dataset=data, data_collator=DataCollatorWithFlattening())
    result = trainer.train()
    assert torch.isfinite(torch.tensor(result.training_loss))
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
    assert "lm_head.weight" in changed and any(n.startswith("model.layers.0.") for n in changed)


def test_sft_trainer_with_packing_trains_both_models(tmp_path):
    trl = require_client("trl")
    from datasets import Dataset
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(VOCAB - 2)} | {"<pad>": VOCAB - 2, "<eos>": VOCAB - 1}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>")
    data = Dataset.from_dict({"input_ids": documents((7, 12, 5, 9, 3, 10, 6, 4))})
    for name in ("compressive", "sinkhorn causal"):
        model = make(name).train()
        args = trl.SFTConfig(
            output_dir=str(tmp_path / name), max_steps=2, per_device_train_batch_size=4, packing=True,
            max_length=24, report_to=[], use_cpu=True, save_strategy="no", logging_steps=1,
            dataloader_num_workers=0,
        )  # fmt: skip
        trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tokenizer)
        batch = next(iter(trainer.get_train_dataloader()))
        starts = (batch["position_ids"] == 0).sum().item()
        assert starts > batch["input_ids"].shape[0], "the SFT batch packs several documents in a row"
        with torch.no_grad():
            model.eval()
            logits = model(**{k: v for k, v in batch.items() if k != "labels"}, use_cache=False).logits
            first = int((batch["position_ids"][0, 1:] == 0).nonzero()[0]) + 1  # the row's first document
            alone = model(batch["input_ids"][:1, :first]).logits
            torch.testing.assert_close(logits[:1, :first], alone, atol=2e-6, rtol=0)
            model.train()
        assert torch.isfinite(torch.tensor(trainer.train().training_loss))


@pytest.mark.parametrize("name", ["compressive", "sinkhorn causal", "sinkhorn masked"])
def test_what_packed_documents_cannot_be_combined_with_is_refused(name):
    model, docs = make(name), documents((6, 9))
    batch = packed(docs)
    ids, positions = batch["input_ids"], batch["position_ids"]
    padded = torch.ones_like(ids)
    padded[0, -2:] = 0
    with pytest.raises(ValueError, match="attention_mask"):
        model(ids, position_ids=positions, attention_mask=padded)
    if name != "sinkhorn masked":
        with pytest.raises(ValueError, match="use_cache"):
            model(ids, position_ids=positions, use_cache=True)
        cache = model(torch.tensor([docs[0]]), use_cache=True).cache
        with pytest.raises(ValueError, match="cache"):
            model(ids, position_ids=positions, cache=cache)
    with pytest.raises(ValueError, match="output_attentions"):
        model(ids, position_ids=positions, output_attentions=True)
    bounds = packed(documents((5, 10)), return_flash_attn_kwargs=True)
    with pytest.raises(ValueError, match="position_ids and cu_seq_lens_q mark different documents"):
        model(ids, position_ids=positions, cu_seq_lens_q=bounds["cu_seq_lens_q"])
    with pytest.raises(ValueError, match="position_ids must restart at 0"):
        model(ids, position_ids=positions + 1, seq_idx=torch.zeros_like(ids))
    with pytest.raises(ValueError, match="cu_seq_lens_q must rise from 0"):
        model(ids, cu_seq_lens_q=torch.tensor([0, 9, 6, 15], dtype=torch.int32))
    with pytest.raises(ValueError, match="position_ids must be"):
        model(ids, position_ids=positions[:, :-1])


def test_positions_that_are_not_packed_restarts_keep_their_meaning():
    """Sinkhorn embeds the given positions (a continuation: 3, 4, ...); the Compressive model refuses them; one
    document per row from 0 (what generate() and a one-example collated batch pass) is a plain call."""
    ids = torch.tensor([documents((8,))[0]])
    shifted = torch.arange(3, 11)[None]
    model = make("sinkhorn causal")
    with torch.no_grad():
        plain, moved = model(ids).logits, model(ids, position_ids=shifted).logits
        assert (plain - moved).abs().max() > 1e-3
        torch.testing.assert_close(model(ids, position_ids=torch.arange(8)[None]).logits, plain, atol=0, rtol=0)
    model = make("compressive")
    with pytest.raises(ValueError, match="position_ids other than packed documents'"):
        model(ids, position_ids=shifted)
    with torch.no_grad():
        torch.testing.assert_close(model(ids, position_ids=torch.arange(8)[None]).logits, model(ids).logits)


def least_cost_by_enumeration(lengths, unit, cost):
    """The cheapest split of `lengths` (longest first) into consecutive groups, by trying every split."""
    rounded = [-(-n // unit) * unit for n in lengths]
    best = None
    for cuts in itertools.product([False, True], repeat=len(lengths) - 1):
        bounds = [0] + [k + 1 for k, cut in enumerate(cuts) if cut] + [len(lengths)]
        total = sum((b - a) * rounded[a] + cost for a, b in itertools.pairwise(bounds))
        best = total if best is None else min(best, total)
    return best


@pytest.mark.parametrize("seed", range(30))
def test_groups_are_the_cheapest_split(seed):
    generator = torch.Generator().manual_seed(seed)
    count = int(torch.randint(1, 10, (1,), generator=generator))
    lengths = sorted(torch.randint(1, 300, (count,), generator=generator).tolist(), reverse=True)
    unit, cost = [1, 4, 64][seed % 3], [0, 16, 512][seed // 3 % 3]
    sizes = packing.group_sizes(lengths, unit, cost)
    assert sum(sizes) == count and min(sizes) > 0
    starts = itertools.accumulate([0, *sizes[:-1]])
    rounded = [-(-n // unit) * unit for n in lengths]
    assert sum(size * rounded[a] + cost for a, size in zip(starts, sizes)) == least_cost_by_enumeration(
        lengths, unit, cost
    )


def test_documents_of_similar_length_run_together(monkeypatch):
    """With a call worth 64 padded tokens, documents of 40, 38, 9, 7 and 5 tokens (buckets of 4) run as two groups,
    2 x 40 and 3 x 12 (the rows padded to the bucket), one forward of the layers each, and give the logits and
    hidden states they give alone."""
    monkeypatch.setattr(packing, "GROUP_COST", 64)
    model, docs = make("sinkhorn causal"), documents((9, 40, 5, 38, 7))
    shapes = []
    model.model.layers[0].register_forward_pre_hook(lambda module, args: shapes.append(tuple(args[0].shape[:2])))
    with torch.no_grad():
        out = model(**packed(docs), use_cache=False, output_hidden_states=True)
        assert shapes == [(2, 40), (3, 12)]
        layers = [per_document(h, docs) for h in out.hidden_states]
        for k, (doc, logits) in enumerate(zip(docs, per_document(out.logits, docs))):
            alone = model(torch.tensor([doc]), output_hidden_states=True)
            torch.testing.assert_close(logits, alone.logits[0], atol=2e-6, rtol=0)
            for together, by_itself in zip(layers, alone.hidden_states, strict=True):
                torch.testing.assert_close(together[k], by_itself[0], atol=2e-6, rtol=0)


def test_groups_give_the_mean_of_every_eviction_s_reconstruction_loss(monkeypatch):
    """Documents of 24 and 40 tokens in groups of their own (segment 4, memory 8) both compress: the packed
    reconstruction loss is the mean over every eviction of both calls, as one call's is over its evictions (each
    document's loss alone weighted by how many evictions trained the compression in it)."""
    monkeypatch.setattr(packing, "GROUP_COST", 0)
    calls = []
    layer_class = CompressiveModel(compressive().config).layers[0].__class__
    counted = layer_class.attention_reconstruction_loss
    monkeypatch.setattr(
        layer_class, "attention_reconstruction_loss", lambda *a, **k: calls.append(1) or counted(*a, **k)
    )
    torch.manual_seed(0)
    model = compressive(mem_len=8).train()
    docs = documents((24, 40))
    losses, evictions = [], []
    for doc in docs:
        calls.clear()
        losses.append(model(torch.tensor([doc])).reconstruction_loss)
        evictions.append(len(calls))
    assert min(evictions) > 0 and evictions[0] != evictions[1]
    expected = sum(loss * n for loss, n in zip(losses, evictions)) / sum(evictions)
    torch.testing.assert_close(model(**packed(docs)).reconstruction_loss, expected, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("causal", [True, False])
def test_each_document_keeps_its_packed_row_s_context(causal, groups):
    """Two packed rows, each with its own encoder context (Sinkhorn with cross-attention): every document, whichever
    group it runs in, attends to its own row's context, as alone with that context."""
    model = sinkhorn(causal, receives_context=True, context_bucket_size=3).eval()
    rows = [documents((9, 3, 6), seed=2), documents((5, 13), seed=3)]
    collated = [packed(docs) for docs in rows]
    ids = torch.cat([c["input_ids"] for c in collated])
    positions = torch.cat([c["position_ids"] for c in collated])
    context = torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(4))
    context_mask = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    with torch.no_grad():
        out = model(ids, position_ids=positions, encoder_hidden_states=context, encoder_attention_mask=context_mask)
        for row, docs in enumerate(rows):
            for doc, logits in zip(docs, per_document(out.logits[row : row + 1], docs)):
                alone = model(
                    torch.tensor([doc]), encoder_hidden_states=context[row : row + 1],
                    encoder_attention_mask=context_mask[row : row + 1],
                ).logits[0]  # fmt: skip
                torch.testing.assert_close(logits, alone, atol=2e-6, rtol=0)
