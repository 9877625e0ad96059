#!/usr/bin/env python
"""Long-range recall: can a model use what lies far back? Synthetic tasks, accuracy against the distance to the fact.

    python benchmarks/benchmark_recall.py --family compressive --seeds 0 1          # the Compressive family, passkey
    python benchmarks/benchmark_recall.py --family sinkhorn --task mqar --length 512
    python benchmarks/benchmark_recall.py --family compressive --models ablation  # compression functions and losses
    python benchmarks/benchmark_recall.py --family masked                          # SinkhornForMaskedLM, SortCut
    python benchmarks/benchmark_recall.py --quick --json /tmp/r.json --plot /tmp/r.png   # smoke run (CI)
    python benchmarks/benchmark_recall.py --plot-only                              # redraw and reprint the record
    python benchmarks/benchmark_recall.py --hidden 256 --layers 4 --length 4096 --device cuda   # at scale

Tasks (generated on the fly from a seed; vocabulary of 64 ids: digits 0-9, KEY, QUERY, MASK, 24 MQAR keys, filler):
  passkey  (Mohtashami & Jaggi 2023) random filler tokens; somewhere `KEY d1 d2 d3 d4`; at the end
           `QUERY d1 d2 d3 d4`. Only the 4 answer digits are scored (chance 0.1 per digit).
  mqar     multi-query associative recall (Arora et al. 2023, "Zoology"): `--pairs` key-value pairs (key: one of 24
           key ids, distinct in a sequence; value: a digit) at random places in filler; at the end `QUERY` and
           the keys again in random order, each followed by its value, which is scored (chance 0.1).
  A fact's position is its digit's (passkey: each key digit; mqar: the value); the prediction is made at the token
  before the answer. Causal models are trained on the shifted next-token loss of the answer tokens only; masked
  models (`--family masked`) see MASK in place of each answer and predict it in place.

Accuracy is reported per answer token against where its fact lies, in regions the family's geometry defines:
  compressive family (segment S, mem M, compressed C at rate r): own segment (the fact is in the segment of the
  predicting token), memory (within the M tokens before it), compressed (within the C r before those), beyond;
  sinkhorn and masked families (bucket B): own bucket, previous bucket (what local attention also sees), routed
  (only a routed bucket or full attention reaches it). Every model of a family is scored in the same regions, and
  in `--distance-bins` equal bins of distance for the plot.

Models (same width, depth, heads, data, optimiser and steps within a family; `--models` picks, `ablation` / `all`
expand):
  compressive family: compressive (mem M + compressed C, conv1d, attention reconstruction), txl (Transformer-XL:
    c_mem_len 0, the same M memories), txl_reach (Transformer-XL with M + C r memories: the compressive model's
    reach), alone (each segment alone: the model sees only the query's segment), llama (transformers' Llama, full
    attention: the baseline users would pick and the upper bound), reference (compressive-transformer-pytorch
    0.4.0, the same sizes, fed segment by segment with its memories); the ablation: conv1d_autoencoding,
    conv1d_none, dilated_conv_attention, dilated_conv_autoencoding, max_pool, mean_pool, most_used, and the same
    slots and reach at another rate: compressive_rate3 (with the defaults: 16 memories + 48 compressed at rate 3),
    compressive_rate5 (40 + 24 at rate 5).
  sinkhorn family (causal): top1, top2 (`n_top_buckets`), top4, local (every head local attention: what routing
    adds), llama, gpt2 (transformers' GPT-2: full attention with learned absolute positions, as Sinkhorn's;
    Llama's are rotary), reference (sinkhorn-transformer 0.11.4, same options); routing variants of top2:
    top2_unweighted (`weight_routed_values=False`: routed values at full strength), top4_unweighted, and
    top2_unweighted_local2 (half the heads local attention); a diagnostic, top2_oracle (top2_unweighted whose sort
    net is told the buckets holding the passkey, in training and evaluation: recall with perfect routing), and two
    one-change variants of it: top2_oracle_rowpos (one learned position row per position, not axial) and
    top2_oracle_local2 (half the heads local attention); top2_unweighted_rowpos (learned routing, one position row
    per position); top2_unweighted_rowpos_attngrad (the same forward, `routing_gradient="attention"`: the sort net
    learns from the derivative of attending a chosen bucket more, not of scaling its values);
    top2_unweighted_attngrad (the same two routing options with the default axial positions);
    top2_unweighted_local2_oracle1000 (top2_unweighted_local2 with the oracle in its first 1,000 training steps only,
    evaluated with its own routing); top2_unweighted_rowpos_frozen2500 (a diagnostic: from step 2,500 on a frozen
    copy of the model routes, in training and evaluation, while the attention trains on).
  masked family (bidirectional, SinkhornForMaskedLM): masked (n_top_buckets 2), sortcut (`n_sortcut` 2), bert
    (transformers' BERT, full attention); masked_unweighted, sortcut_unweighted (`weight_routed_values=False`).

Also measured: `generate()` with the model's own cache (passkey, causal models of ours and Llama): the prompt ends at
QUERY, 4 greedy tokens are scored (`gen_*` columns; `gen_agree`: the first generated digit equals the forward's
argmax; `gen_agree_all`: every generated digit equals the argmax of one uncached forward over the prompt and the
digits generated before it: both must be 1.0 when the bounded cache carries what the forward saw; generated digits
after a wrong one are conditioned on it, so `gen_*` accuracy can be below the teacher-forced forward's); the
Sinkhorn sort net's choice (`pick_rate`: over rows whose fact is routed-only, layers and Sinkhorn heads, how often
the query's bucket picks the fact's bucket; `pick_chance`: n_top_buckets over the earlier buckets), at every
`--eval-every` steps too; and the accuracy of routed-only answers when some Sinkhorn head of some layer picked the
fact's bucket (`acc_picked`) and when none did (`acc_missed`), with the share of answers picked (`any_picked`);
along training only, for causal Sinkhorn models, which way the training loss's routing gradient moves the fact's
bucket: `push_picked` / `push_missed`, the share of (answer, layer, head) where a gradient step raises its routing
score against the other candidates, when the head picked it / when it did not (see `routing_push`).

Writes `--json` (merged with what is there: each run keyed by family, task, length, model and seed, so runs made
in several processes or sessions accumulate; the file is locked while written) and `--plot` (accuracy against
distance, one line per model, mean of the seeds with their spread; one panel per family, task and length).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import json
import math
import platform
import shlex
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
try:
    import longrange  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(REPO))

KEY, QUERY, MASK = 10, 11, 12
MQAR_KEYS = range(13, 37)
FILLER = range(37, 64)
PASSKEY_FILLER = range(13, 64)
VOCAB = 64
STEPS = 2000  # the default training budget
LR = 1e-3  # the default peak learning rate
DIGITS = 4


# ------------------------------------------------------------------------------------------------------------------
# tasks


@dataclass
class Batch:
    """ids [b, L] the true sequence; answers [b, n] positions of the scored tokens; facts [b, n] where each
    answer's fact lies."""

    ids: torch.Tensor
    answers: torch.Tensor
    facts: torch.Tensor


def passkey(gen: torch.Generator, batch: int, length: int, pairs: int = 0, max_back: int | None = None) -> Batch:
    """`max_back`: the KEY marker lies at most this many tokens before QUERY (the curriculum); None: anywhere."""
    ids = torch.randint(PASSKEY_FILLER.start, PASSKEY_FILLER.stop, (batch, length), generator=gen)
    digits = torch.randint(0, 10, (batch, DIGITS), generator=gen)
    query = length - DIGITS - 1
    first = 0 if max_back is None else max(0, query - max_back)
    start = torch.randint(first, query - DIGITS - 1, (batch,), generator=gen)  # the KEY marker
    rows = torch.arange(batch)[:, None]
    offsets = torch.arange(DIGITS)
    facts = start[:, None] + 1 + offsets
    ids[rows, start[:, None]] = KEY
    ids[rows, facts] = digits
    ids[:, query] = QUERY
    answers = (query + 1 + offsets).expand(batch, DIGITS)
    ids[:, query + 1 :] = digits
    return Batch(ids, answers.clone(), facts)


def mqar(gen: torch.Generator, batch: int, length: int, pairs: int = 4, max_back: int | None = None) -> Batch:
    """`max_back`: the pairs lie in the last this many tokens before QUERY (at least room for every pair)."""
    if pairs > len(MQAR_KEYS):
        raise ValueError(f"--pairs must be at most {len(MQAR_KEYS)}, got {pairs}")
    ids = torch.randint(FILLER.start, FILLER.stop, (batch, length), generator=gen)
    tail = 1 + 2 * pairs
    slots = (length - tail) // 2  # pairs sit on even offsets of the prefix, so they never overlap
    if slots < pairs:
        raise ValueError(f"--length {length} is too short for {pairs} MQAR pairs")
    keys = torch.stack([torch.randperm(len(MQAR_KEYS), generator=gen)[:pairs] for _ in range(batch)]) + MQAR_KEYS.start
    values = torch.randint(0, 10, (batch, pairs), generator=gen)
    lowest = 0 if max_back is None else max(0, min(slots - pairs, slots - max_back // 2))
    places = torch.stack([torch.randperm(slots - lowest, generator=gen)[:pairs] for _ in range(batch)]) + lowest
    places = places * 2
    rows = torch.arange(batch)[:, None]
    ids[rows, places] = keys
    ids[rows, places + 1] = values
    order = torch.stack([torch.randperm(pairs, generator=gen) for _ in range(batch)])
    query = length - tail
    ids[:, query] = QUERY
    answers = (query + 2 + 2 * torch.arange(pairs)).expand(batch, pairs).clone()
    ids[rows, answers - 1] = keys.gather(1, order)
    ids[rows, answers] = values.gather(1, order)
    return Batch(ids, answers, (places + 1).gather(1, order))


TASKS = {"passkey": passkey, "mqar": mqar}


def regions_of(family: str, args) -> tuple[list[str], callable]:
    """Region names and a function (predicting position t, fact position f) -> region index, as tensors."""
    if family == "compressive":
        edges = (args.mem, args.mem + args.c_mem * args.rate)

        def region(t, f):
            start = t - t % args.segment
            back = start - f  # > 0: the fact is before the segment, this many tokens before its first token
            return (back > 0).long() + (back > edges[0]).long() + (back > edges[1]).long()

        return ["own segment", "memory", "compressed", "beyond"], region
    bucket = args.bucket

    def region(t, f):
        back = t - t % bucket - f
        return (back > 0).long() + (back > bucket).long()

    return ["own bucket", "previous bucket", "routed"], region


# ------------------------------------------------------------------------------------------------------------------
# models: each kind knows how to build itself, its loss, its logits at the answers, and (optionally) generation


@dataclass
class Spec:
    name: str
    kind: str  # compressive / llama / ref_compressive / sinkhorn / ref_sinkhorn / masked / bert
    options: dict = field(default_factory=dict)
    window: int | None = None  # the model sees only the last `window` tokens (each segment alone)
    oracle: bool = False  # a diagnostic: the sort net is told the fact's buckets (see `oracle_routing`)
    oracle_steps: int | None = None  # ... only in the first this many training steps (evaluation: learned routing)
    freeze_routing_at: int | None = None  # a diagnostic: from this step on a frozen copy routes (`frozen_routing`)
    frozen_gradient: bool = True  # ... and the straight-through gradient still reaches the model's routing scores


def family_specs(family: str, args) -> dict[str, Spec]:
    build_specs = {"compressive": compressive_specs, "sinkhorn": sinkhorn_specs, "masked": masked_specs}[family]
    return {spec.name: spec for spec in build_specs(args)}


def compressive_specs(args) -> list[Spec]:
    mem, cmem, rate = args.mem, args.c_mem, args.rate
    base = dict(mem_len=mem, c_mem_len=cmem, compression_rate=rate)
    no_compression = dict(c_mem_len=0, compression_function="mean_pool", reconstruction_loss="none")
    specs = [
        Spec("compressive", "compressive", base),
        Spec("txl", "compressive", dict(no_compression, mem_len=mem)),
        Spec("txl_reach", "compressive", dict(no_compression, mem_len=mem + cmem * rate)),
        Spec("alone", "compressive", base, window=args.segment),
        Spec("llama", "llama"),
        Spec("reference", "ref_compressive"),
    ]
    ablation = {
        "conv1d_autoencoding": ("conv1d", "autoencoding"),
        "conv1d_none": ("conv1d", "none"),
        "dilated_conv_attention": ("dilated_conv", "attention"),
        "dilated_conv_autoencoding": ("dilated_conv", "autoencoding"),
        "max_pool": ("max_pool", "none"),
        "mean_pool": ("mean_pool", "none"),
        "most_used": ("most_used", "none"),
    }
    for name, (fn, loss) in ablation.items():
        specs.append(Spec(name, "compressive", dict(base, compression_function=fn, reconstruction_loss=loss)))
    # the same slots (mem + cmem) and reach (mem + cmem * rate) at a gentler or a harsher compression rate
    for r in (rate - 1, rate + 1):
        c, rest = divmod(cmem * (rate - 1), r - 1) if r > 1 else (0, 1)
        if not rest and 0 < c < mem + cmem and mem + cmem - c >= r:
            geometry = dict(mem_len=mem + cmem - c, c_mem_len=c, compression_rate=r)
            specs.append(Spec(f"compressive_rate{r}", "compressive", geometry))
    return specs


def sinkhorn_specs(args) -> list[Spec]:
    # routed values at full strength (a straight-through routing weight) instead of times the routing weight
    unweighted = dict(n_top_buckets=2, weight_routed_values=False)
    local2 = dict(unweighted, n_local_attn_heads=args.heads // 2)  # half the heads local: the previous bucket too
    rowpos = dict(unweighted, axial_position_embeddings=False)  # one learned row per position, not axial rows
    return [
        *(Spec(f"top{n}", "sinkhorn", dict(n_top_buckets=n)) for n in (1, 2, 4)),
        Spec("top2_unweighted", "sinkhorn", unweighted),
        Spec("top4_unweighted", "sinkhorn", dict(unweighted, n_top_buckets=4)),
        Spec("top2_unweighted_local2", "sinkhorn", local2),
        Spec("top2_unweighted_rowpos", "sinkhorn", rowpos),
        # the axial default positions kept: only the two routing options a default change would need
        Spec("top2_unweighted_attngrad", "sinkhorn", dict(unweighted, routing_gradient="attention")),
        # the same forward; the routing's straight-through gradient through the attention logits, not the values
        Spec("top2_unweighted_rowpos_attngrad", "sinkhorn", dict(rowpos, routing_gradient="attention")),
        Spec("local", "sinkhorn", dict(n_local_attn_heads=args.heads)),
        # perfect routing: what the attention inside the chosen buckets can do when the choice is right
        Spec("top2_oracle", "sinkhorn", unweighted, oracle=True),
        Spec("top2_oracle_rowpos", "sinkhorn", rowpos, oracle=True),
        Spec("top2_oracle_local2", "sinkhorn", local2, oracle=True),
        # learned routing, the oracle only in the first 1,000 training steps
        Spec("top2_unweighted_local2_oracle1000", "sinkhorn", local2, oracle=True, oracle_steps=1000),
        # learned routing frozen from step 2,500 on (a copy of the model then routes), the attention trains on
        Spec("top2_unweighted_rowpos_frozen2500", "sinkhorn", rowpos, freeze_routing_at=2500),
        # ... and no routing gradient from then on: the straight-through gradient's own share in the collapse
        Spec(
            "top2_unweighted_rowpos_frozen2500_detached",
            "sinkhorn",
            rowpos,
            freeze_routing_at=2500,
            frozen_gradient=False,
        ),  # fmt: skip
        Spec("llama", "llama"),
        # full attention with learned absolute positions, as Sinkhorn's (Llama: rotary, relative)
        Spec("gpt2", "gpt2"),
        Spec("reference", "ref_sinkhorn", dict(n_top_buckets=2)),
    ]


def masked_specs(args) -> list[Spec]:
    return [
        Spec("masked", "masked", dict(n_top_buckets=2)),
        Spec("sortcut", "masked", dict(n_top_buckets=2, n_sortcut=2)),
        Spec("masked_unweighted", "masked", dict(n_top_buckets=2, weight_routed_values=False)),
        Spec("sortcut_unweighted", "masked", dict(n_top_buckets=2, n_sortcut=2, weight_routed_values=False)),
        Spec("bert", "bert"),
    ]


DEFAULT_MODELS = {
    "compressive": ["compressive", "txl", "txl_reach", "alone", "llama", "reference"],
    "sinkhorn": ["top1", "top2", "local", "llama", "reference"],
    "masked": ["masked", "sortcut", "bert"],
}
ABLATION = ["compressive", "conv1d_autoencoding", "conv1d_none", "dilated_conv_attention",
            "dilated_conv_autoencoding", "max_pool", "mean_pool", "most_used", "compressive_rate3",
            "compressive_rate5"]  # fmt: skip


def build(spec: Spec, args) -> torch.nn.Module:
    width = dict(hidden_size=args.hidden, num_hidden_layers=args.layers, num_attention_heads=args.heads,
                 intermediate_size=4 * args.hidden)  # fmt: skip
    if spec.kind == "compressive":
        from longrange import CompressiveConfig, CompressiveForCausalLM

        config = CompressiveConfig(vocab_size=VOCAB, segment_length=args.segment, **width, **spec.options)
        return CompressiveForCausalLM(config)
    if spec.kind in ("sinkhorn", "masked"):
        from longrange import SinkhornConfig, SinkhornForCausalLM, SinkhornForMaskedLM

        causal = spec.kind == "sinkhorn"
        config = SinkhornConfig(vocab_size=VOCAB, bucket_size=args.bucket, max_position_embeddings=args.length,
                                causal=causal, **width, **spec.options)  # fmt: skip
        return (SinkhornForCausalLM if causal else SinkhornForMaskedLM)(config)
    if spec.kind == "llama":
        from transformers import LlamaConfig, LlamaForCausalLM

        config = LlamaConfig(vocab_size=VOCAB, max_position_embeddings=args.length, **width)
        return LlamaForCausalLM(config)
    if spec.kind == "gpt2":
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=VOCAB, n_positions=args.length, n_embd=args.hidden, n_layer=args.layers,
                            n_head=args.heads, n_inner=4 * args.hidden)  # fmt: skip
        return GPT2LMHeadModel(config)
    if spec.kind == "bert":
        from transformers import BertConfig, BertForMaskedLM

        config = BertConfig(vocab_size=VOCAB, max_position_embeddings=args.length, **width)
        return BertForMaskedLM(config)
    if spec.kind == "ref_compressive":
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from benchmark_compressive import import_reference

        CompressiveTransformer, _ = import_reference()
        return CompressiveTransformer(num_tokens=VOCAB, dim=args.hidden, seq_len=args.segment, depth=args.layers,
                                      heads=args.heads, mem_len=args.mem, cmem_len=args.c_mem, cmem_ratio=args.rate)  # fmt: skip
    from sinkhorn_transformer import SinkhornTransformerLM

    return SinkhornTransformerLM(num_tokens=VOCAB, dim=args.hidden, max_seq_len=args.length, depth=args.layers,
                                 heads=args.heads, bucket_size=args.bucket, causal=True, non_permutative=True,
                                 **spec.options)  # fmt: skip


def model_inputs(spec: Spec, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(input ids, positions in the input whose logits predict the answers, answer tokens) for this spec."""
    ids, answers = batch.ids, batch.answers
    targets = ids.gather(1, answers)
    if spec.kind in ("masked", "bert"):
        return ids.scatter(1, answers, MASK), answers, targets
    start = 0 if spec.window is None else ids.shape[1] - spec.window
    return ids[:, start:], answers - 1 - start, targets


def answer_logits(spec: Spec, model, ids: torch.Tensor, at: torch.Tensor, **kwargs) -> torch.Tensor:
    """[b, n, vocab]: the logits at positions `at` [b, n]."""
    if spec.kind == "ref_compressive":
        logits, _ = reference_compressive_forward(model, ids)
    elif spec.kind == "ref_sinkhorn":
        logits = model(ids)
    else:
        extra = {} if spec.kind in ("masked", "bert", "llama", "gpt2") else {"use_cache": False}
        out = model(input_ids=ids, **extra, **kwargs)
        logits = out.logits
        if kwargs:
            return logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1])), out
    return logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1]))


def reference_compressive_forward(model, ids: torch.Tensor):
    """compressive-transformer-pytorch takes one segment per call and hands back its memories; its auxiliary
    (reconstruction) loss is summed over the segments, as its own training wrapper does."""
    memories, logits, aux = None, [], 0.0
    for segment in ids.split(model.seq_len, dim=1):
        out, memories, aux_loss = model(segment, memories=memories)
        logits.append(out)
        aux = aux + aux_loss
    return torch.cat(logits, 1), aux


def oracle_on(spec: Spec, step: int | None = None) -> bool:
    """Whether the oracle routing applies: at a training step, or in evaluation (step None)."""
    if not spec.oracle:
        return False
    return spec.oracle_steps is None or (step is not None and step < spec.oracle_steps)


@contextlib.contextmanager
def oracle_routing(model, facts: torch.Tensor, active: bool):
    """A diagnostic for `Spec.oracle` models (a no-op unless `active`): while inside, every causal Sinkhorn group's
    routing scores get +1e4 on the candidate columns of the buckets that hold the facts, so every query bucket
    after them picks them (top-k keeps them first) and their routing weights carry no gradient. Passkey facts span
    at most 2 buckets, so with n_top_buckets >= 2 the routing is perfect: the accuracy then measures what the
    attention inside the chosen buckets learns when the choice is always right."""
    if not active:
        yield
        return
    from longrange.sinkhorn_heads import CausalSinkhornHeads

    original, size = CausalSinkhornHeads._select, model.config.bucket_size

    def select(self, scores, valid, n_sel):
        b = facts.shape[0]
        # one group alone, or `causal_pair`'s doubled batch: ordinary rows (offset 0), then shifted rows (offset 1)
        offsets = [self.offset] if scores.shape[0] == b else [0, 1]
        bonus = torch.zeros_like(scores)
        for i, offset in enumerate(offsets):
            columns = self.n_top + (facts + offset) // size  # the null buckets come first among the candidates
            index = columns[:, None, None, :].expand(-1, scores.shape[1], scores.shape[2], -1)
            bonus[i * b : (i + 1) * b].scatter_(-1, index, 1e4)
        return original(self, scores + bonus, valid, n_sel)

    CausalSinkhornHeads._select = select
    try:
        yield
    finally:
        CausalSinkhornHeads._select = original


@contextlib.contextmanager
def frozen_routing(model, ids: torch.Tensor, gradient: bool = True):
    """A diagnostic for `Spec.freeze_routing_at` models (a no-op before the copy is taken): while inside, every
    causal Sinkhorn group of `model` attends the buckets its frozen copy (the model at step `freeze_routing_at`,
    `model.__dict__["frozen_router"]`) chooses on the same input, so the attention keeps training while the
    routing stays as it was; the straight-through gradient still reaches the model's scores at those buckets
    unless not `gradient` (then the chosen buckets carry no routing gradient at all). The
    routing scores are the attention's own mean queries and keys: whether their drift under the attention's
    training is what turns the routing away is what this separates."""
    frozen = model.__dict__.get("frozen_router")
    if frozen is None:
        yield
        return
    from longrange.sinkhorn_heads import CausalSinkhornHeads
    from longrange.sinkhorn_routing import NEG

    original, chosen = CausalSinkhornHeads._select, []

    def record(self, scores, valid, n_sel):
        picked = original(self, scores, valid, n_sel)
        chosen.append(picked[0])
        return picked

    CausalSinkhornHeads._select = record
    try:
        with torch.no_grad():
            frozen(input_ids=ids, use_cache=False)
    finally:
        CausalSinkhornHeads._select = original
    calls = iter(chosen)  # the same groups are called in the same order

    def select(self, scores, valid, n_sel):
        idx = next(calls)
        valid = valid.expand(scores.shape)
        log_weights = (scores.masked_fill(~valid, NEG) / self.temperature).log_softmax(-1).gather(-1, idx)
        picked_valid = valid.gather(-1, idx)
        log_weights = log_weights.masked_fill(~picked_valid, 0.0)
        scale = torch.exp(log_weights - log_weights.detach()) if gradient and torch.is_grad_enabled() else None
        return idx, picked_valid, scale

    CausalSinkhornHeads._select = select
    try:
        yield
    finally:
        CausalSinkhornHeads._select = original


def training_loss(spec: Spec, model, batch: Batch, step: int = 0) -> torch.Tensor:
    frozen = frozen_routing(model, batch.ids, spec.frozen_gradient)
    with oracle_routing(model, batch.facts, oracle_on(spec, step)), frozen:
        return _training_loss(spec, model, batch)


def _training_loss(spec: Spec, model, batch: Batch) -> torch.Tensor:
    ids, at, targets = model_inputs(spec, batch)
    if spec.kind == "ref_compressive":
        logits, aux = reference_compressive_forward(model, ids)
        picked = logits.gather(1, at[..., None].expand(-1, -1, logits.shape[-1]))
        return F.cross_entropy(picked.flatten(0, 1), targets.flatten()) + aux
    if spec.kind == "compressive":  # its own loss: the shifted LM loss plus the reconstruction loss
        labels = torch.full_like(ids, -100).scatter(1, at + 1, targets)
        return model(input_ids=ids, labels=labels, use_cache=False).loss
    picked = answer_logits(spec, model, ids, at)
    return F.cross_entropy(picked.flatten(0, 1), targets.flatten())


# ------------------------------------------------------------------------------------------------------------------
# evaluation


def evaluate(spec: Spec, model, batch: Batch, args, family: str) -> dict:
    """Per region and distance bin: correct and total answer tokens (forward, and generate() where it applies);
    the Sinkhorn sort net's picks of the fact's bucket."""
    names, region = regions_of(family, args)
    model.eval()
    out = {"regions": {n: [0, 0] for n in names}, "bins": [[0, 0] for _ in range(args.distance_bins)]}
    with torch.no_grad():
        for chunk in split(batch, args.eval_batch):
            ids, at, targets = model_inputs(spec, chunk)
            probe = spec.kind in ("sinkhorn", "masked")
            with oracle_routing(model, chunk.facts, oracle_on(spec)), frozen_routing(model, ids):
                result = answer_logits(spec, model, ids, at, **({"output_attentions": True} if probe else {}))
            logits, full = result if probe else (result, None)
            correct = logits.argmax(-1) == targets
            predicting = chunk.answers if spec.kind in ("masked", "bert") else chunk.answers - 1
            tally(out, correct, region(predicting, chunk.facts), chunk.answers - chunk.facts, names, args)
            if probe:
                count_picks(out, full.routing, model.config, predicting, chunk.facts, region, correct)
            if (
                args.task == "passkey"
                and spec.kind in ("compressive", "sinkhorn", "llama", "gpt2")
                and not oracle_on(spec)
                and spec.freeze_routing_at is None  # the cache routes with the model's own scores
            ):
                generated_accuracy(out, spec, model, chunk, logits, region, names, args)
    model.train()
    return finish(out)


def routing_push(spec: Spec, model, batch: Batch, args, family: str, step: int) -> dict:
    """What the routing gradient of the training loss does to the fact's bucket, for causal Sinkhorn models: over
    routed-only answers, layers and Sinkhorn heads, the share where a gradient step raises the routing score of the
    fact's bucket at the answer's query bucket (the routing's log-softmax makes a row's gradient sum to zero, so
    raising a score means raising it against the other candidates), when that head picked it (`push_picked`) and
    when it did not (`push_missed`). 0.5 is no preference; below it the gradient pushes the fact's bucket away."""
    from longrange.sinkhorn_heads import CausalSinkhornHeads

    size, captured = model.config.bucket_size, []
    frozen = frozen_routing(model, batch.ids, spec.frozen_gradient)
    with frozen, oracle_routing(model, batch.facts, oracle_on(spec, step)):
        original = CausalSinkhornHeads._select  # (the diagnostics' choice, where one applies)

        def select(self, scores, valid, n_sel):
            chosen = original(self, scores, valid, n_sel)
            captured.append((self, scores, chosen[0]))
            return chosen

        CausalSinkhornHeads._select = select
        try:
            with torch.enable_grad():
                loss = _training_loss(spec, model, batch)
                grads = torch.autograd.grad(loss, [scores for _, scores, _ in captured], allow_unused=True)
        finally:
            CausalSinkhornHeads._select = original
    _, region = regions_of(family, args)
    predicting = batch.answers - 1
    routed = region(predicting, batch.facts) == 2  # [b, n]
    counts = {"picked": [0, 0], "missed": [0, 0], "hits": [0, 0]}
    b = batch.ids.shape[0]
    for (group, scores, idx), grad in zip(captured, grads):
        if grad is None:
            continue
        # one group alone, or `causal_pair`'s doubled batch: ordinary rows (offset 0), then shifted rows (offset 1)
        offsets = [group.offset] if scores.shape[0] == b else [0, 1]
        for i, offset in enumerate(offsets):
            rows = slice(i * b, (i + 1) * b)
            query = ((predicting + offset) // size)[:, None, :, None].expand(-1, grad.shape[1], -1, -1)  # [b,h,n,1]
            column = (group.n_top + (batch.facts + offset) // size)[:, None, :, None].expand_as(query)
            g = grad[rows].gather(2, query.expand(-1, -1, -1, grad.shape[3])).gather(3, column)[..., 0]  # [b,h,n]
            chosen = idx[rows].gather(2, query.expand(-1, -1, -1, idx.shape[3]))  # [b, h, n, n_sel]
            hit = (chosen == column).any(-1)
            for name, sel in (("picked", hit), ("missed", ~hit)):
                sel = sel & routed[:, None, :]
                counts[name][0] += int((g[sel] < 0).sum())  # descent raises the score
                counts[name][1] += int(sel.sum())
            counts["hits"][0] += int((hit & routed[:, None, :]).sum())
            counts["hits"][1] += int(routed.sum()) * hit.shape[1]
    rates = {name: round(c[0] / c[1], 4) if c[1] else None for name, c in counts.items()}
    return {"push_picked": rates["picked"], "push_missed": rates["missed"], "pick_rate": rates["hits"]}


def split(batch: Batch, size: int):
    for i in range(0, batch.ids.shape[0], size):
        yield Batch(batch.ids[i : i + size], batch.answers[i : i + size], batch.facts[i : i + size])


def tally(out: dict, correct, regions, distance, names, args, prefix=""):
    for i, name in enumerate(names):
        sel = regions == i
        cell = out.setdefault(prefix + "regions", {n: [0, 0] for n in names})[name]
        cell[0] += int(correct[sel].sum())
        cell[1] += int(sel.sum())
    if not prefix:
        width = args.length / args.distance_bins
        index = (distance.float() / width).long().clamp(max=args.distance_bins - 1)
        for b in range(args.distance_bins):
            sel = index == b
            out["bins"][b][0] += int(correct[sel].sum())
            out["bins"][b][1] += int(sel.sum())


def generated_accuracy(out, spec, model, chunk: Batch, forward_logits, region, names, args):
    """generate() from the prompt that ends at QUERY, with the model's own cache; greedy, 4 tokens."""
    ids, _, targets = model_inputs(spec, chunk)
    prompt_len = ids.shape[1] - DIGITS
    generated = model.generate(
        input_ids=ids[:, :prompt_len], attention_mask=torch.ones_like(ids[:, :prompt_len]), max_new_tokens=DIGITS,
        min_new_tokens=DIGITS, do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True,
    )[:, prompt_len:]  # fmt: skip
    predicting = chunk.answers - 1
    tally(out, generated == targets, region(predicting, chunk.facts), None, names, args, prefix="gen_")
    agree = out.setdefault("gen_agree", [0, 0])
    agree[0] += int((generated[:, 0] == forward_logits[:, 0].argmax(-1)).sum())
    agree[1] += generated.shape[0]
    # every generated digit against one uncached forward over the prompt and the digits generated before it
    continued = torch.cat([ids[:, :prompt_len], generated], 1)
    at = torch.arange(prompt_len - 1, continued.shape[1] - 1).expand(len(continued), -1)
    again = answer_logits(spec, model, continued, at).argmax(-1)
    every = out.setdefault("gen_agree_all", [0, 0])
    every[0] += int((again == generated).sum())
    every[1] += generated.numel()


def count_picks(out: dict, routing, config, predicting, facts, region, correct):
    """How often the query's bucket picks the fact's bucket, over answers whose fact only routing reaches, and
    their accuracy when some Sinkhorn head of some layer picked it and when none did."""
    routed = region(predicting, facts) == 2  # [b, n]
    hits = total = 0
    any_hit = torch.zeros_like(routed)
    for layer in routing:
        for head, offset in enumerate(layer.offsets.tolist()):
            if head < config.n_local_attn_heads:
                continue
            query_bucket = (predicting + offset) // config.bucket_size
            fact_bucket = (facts + offset) // config.bucket_size
            picks = layer.key_buckets[:, head]  # [b, query buckets, n_top]
            chosen = picks.gather(1, query_bucket[..., None].expand(-1, -1, picks.shape[-1]))
            hit = (chosen == fact_bucket[..., None]).any(-1)
            any_hit |= hit
            hits += int(hit[routed].sum())
            total += int(routed.sum())
    if config.causal:  # the candidates: the earlier buckets
        candidates = (predicting // config.bucket_size).float()[routed]
    else:  # every other bucket (SortCut: every bucket, one choice for all)
        candidates = torch.full((int(routed.sum()),), config.max_buckets - (0 if config.n_sortcut else 1)).float()
    picks = config.n_sortcut or config.n_top_buckets
    chance = float((picks / candidates.clamp(min=1)).clamp(max=1).mean()) if routed.any() else None
    cell = out.setdefault("picks", [0, 0, []])
    cell[0] += hits
    cell[1] += total
    if chance is not None:
        cell[2].append(chance)
    for name, sel in (("picked", routed & any_hit), ("missed", routed & ~any_hit)):
        pair = out.setdefault(f"acc_{name}", [0, 0])
        pair[0] += int(correct[sel].sum())
        pair[1] += int(sel.sum())


def finish(out: dict) -> dict:
    def rate(cell):
        return round(cell[0] / cell[1], 4) if cell[1] else None

    result = {"accuracy": {k: rate(v) for k, v in out["regions"].items()},
              "count": {k: v[1] for k, v in out["regions"].items()},
              "bins": [rate(cell) for cell in out["bins"]]}  # fmt: skip
    if "gen_regions" in out:
        result["gen_accuracy"] = {k: rate(v) for k, v in out["gen_regions"].items()}
        result["gen_agree"] = rate(out["gen_agree"])
        result["gen_agree_all"] = rate(out["gen_agree_all"])
    if "picks" in out:
        result["pick_rate"] = rate(out["picks"])
        chances = out["picks"][2]
        result["pick_chance"] = round(sum(chances) / len(chances), 4) if chances else None
        # routed-only answers: accuracy when a Sinkhorn head picked the fact's bucket / when none did, and how often
        result["acc_picked"], result["acc_missed"] = rate(out["acc_picked"]), rate(out["acc_missed"])
        seen = out["acc_picked"][1] + out["acc_missed"][1]
        result["any_picked"] = round(out["acc_picked"][1] / seen, 4) if seen else None
    return result


# ------------------------------------------------------------------------------------------------------------------
# training


def slots_and_reach(spec: Spec, args) -> tuple[int | None, int | None]:
    """Memory slots per layer beside the segment, and how far back a token can attend."""
    if spec.kind == "compressive":
        if spec.window is not None:
            return 0, args.segment
        mem, cmem = spec.options["mem_len"], spec.options["c_mem_len"]
        return mem + cmem, args.segment + mem + cmem * spec.options.get("compression_rate", args.rate)
    if spec.kind == "ref_compressive":
        return args.mem + args.c_mem, args.segment + args.mem + args.c_mem * args.rate
    return None, args.length


def train_one(spec: Spec, args, seed: int, family: str, eval_batch: Batch) -> dict:
    from tqdm.auto import tqdm

    torch.manual_seed(seed)
    model = build(spec, args).to(args.device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.98), weight_decay=0.0)
    warmup = max(1, args.steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / warmup) * (
        0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    task = TASKS[args.task]
    curve, losses, start = [], [], time.perf_counter()
    probe = to_device(
        Batch(*(t[: args.eval_batch] for t in (eval_batch.ids, eval_batch.answers, eval_batch.facts))), args.device
    )
    bar = tqdm(range(args.steps), desc=f"{family}/{args.task}/{spec.name} seed {seed}", disable=args.no_progress)
    for step in bar:
        batch = to_device(task(gen, args.batch, args.length, args.pairs, curriculum_reach(step, args)), args.device)
        if step == spec.freeze_routing_at:
            model.__dict__["frozen_router"] = copy.deepcopy(model).eval().requires_grad_(False)  # not a submodule
        loss = training_loss(spec, model, batch, step)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
        if (step + 1) % args.eval_every == 0 or step + 1 == args.steps:
            point = {
                "step": step + 1,
                "loss": round(sum(losses[-args.eval_every :]) / len(losses[-args.eval_every :]), 4),
            }
            probed = evaluate(spec, model, probe, args, family)
            point.update({k: v for k, v in probed.items() if k in ("accuracy", "pick_rate", "any_picked")})
            if spec.kind == "sinkhorn" and not oracle_on(spec, step) and model.config.causal:
                pushed = routing_push(spec, model, probe, args, family, step)
                point.update(push_picked=pushed["push_picked"], push_missed=pushed["push_missed"])
            curve.append(point)
            bar.set_postfix(loss=point["loss"], **{k[:6]: v for k, v in point["accuracy"].items()})
    train_seconds = time.perf_counter() - start
    result = evaluate(spec, model, to_device(eval_batch, args.device), args, family)
    slots, reach = slots_and_reach(spec, args)
    return dict(result, curve=curve, final_loss=curve[-1]["loss"], train_seconds=round(train_seconds, 1),
                slots=slots, reach=reach, parameters=sum(p.numel() for p in model.parameters()),
                options=spec.options, window=spec.window)  # fmt: skip


def curriculum_reach(step: int, args) -> int | None:
    """`--curriculum N`: the farthest a fact may lie grows linearly over the first N steps, from one segment or
    bucket (what any model sees locally) to the whole sequence; None (anywhere) after them, or without it."""
    if not args.curriculum or step >= args.curriculum:
        return None
    unit = args.segment if args.family == "compressive" else args.bucket
    return int(unit + (args.length - unit) * step / args.curriculum)


def to_device(batch: Batch, device: str) -> Batch:
    return Batch(batch.ids.to(device), batch.answers.to(device), batch.facts.to(device))


# ------------------------------------------------------------------------------------------------------------------
# the record and the picture


def record_name(model: str, args) -> str:
    """The model's name in the record: with `+curriculum<N>` and, for a budget or peak learning rate other than the
    defaults, `+steps<N>` and `+lr<X>`."""
    name = f"{model}+curriculum{args.curriculum}" if args.curriculum else model
    if args.quick:
        return name
    name = name if args.steps == STEPS else f"{name}+steps{args.steps}"
    return name if args.lr == LR else f"{name}+lr{args.lr:g}"


def run_key(family: str, args, model: str, seed: int) -> str:
    return f"{family}|{args.task}|{args.length}|{model}|{seed}"


@contextlib.contextmanager
def locked_record(path: Path):
    """The record, read and rewritten under an exclusive lock, so that runs in several processes accumulate."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        record = json.loads(path.read_text()) if path.exists() else {"runs": {}}
        yield record
        path.write_text(json.dumps(record, indent=1) + "\n")


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for name in ("torch", "transformers", "compressive-transformer-pytorch", "sinkhorn-transformer"):
        with contextlib.suppress(PackageNotFoundError):
            out[name] = version(name)
    return out


FAMILIES = ("compressive", "sinkhorn", "masked")


def panels(record: dict) -> dict[tuple, dict[str, list]]:
    """The record's runs by (family, task, length), then model: families and tasks in their order, lengths up."""
    groups: dict[tuple, dict[str, list]] = {}
    for run in record["runs"].values():
        groups.setdefault((run["family"], run["task"], run["length"]), {}).setdefault(run["model"], []).append(run)
    order = sorted(groups, key=lambda key: (FAMILIES.index(key[0]), list(TASKS).index(key[1]), key[2]))
    return {key: groups[key] for key in order}


def summarise(record: dict) -> str:
    """Markdown: one table per family, task and length; each model's mean accuracy over seeds per region (and the
    seeds' range), then the sort net's pick rate along training where it was measured."""
    lines = []
    for (family, task, length), models in panels(record).items():
        models = {name: models[name] for name in sorted(models, key=lambda name: model_order(family, name))}
        regions = list(next(iter(models.values()))[0]["accuracy"])
        far = [k for k in regions if any(r["count"][k] for runs in models.values() for r in runs)][-1]
        gen = any("gen_accuracy" in r for runs in models.values() for r in runs)
        head = ["model", "seeds", "slots"] + regions + ([f"generate: {far}", "gen agree"] if gen else [])
        split_picks = any(r.get("acc_picked") is not None for runs in models.values() for r in runs)
        head += ["pick rate (chance)"] + (["acc. picked / missed (share picked)"] if split_picks else [])
        head += ["loss", "train s"]
        lines += [f"\n{family} family, {task}, {length} tokens\n", "| " + " | ".join(head) + " |",
                  "|" + "---|" * len(head)]  # fmt: skip
        for name, runs in models.items():
            row = [name, str(len(runs)), str(runs[0]["slots"] if runs[0]["slots"] is not None else "-")]
            row += [mean_spread([r["accuracy"][k] for r in runs]) for k in regions]
            if gen:
                row += [mean_spread([r.get("gen_accuracy", {}).get(far) for r in runs]),
                        mean_spread([r.get("gen_agree_all", r.get("gen_agree")) for r in runs])]  # fmt: skip
            pick = mean_spread([r.get("pick_rate") for r in runs])
            chance = mean_spread([r.get("pick_chance") for r in runs])
            row += [f"{pick} ({chance})" if pick != "-" else "-"]
            if split_picks:
                parts = [mean_spread([r.get(k) for r in runs]) for k in ("acc_picked", "acc_missed", "any_picked")]
                row += ["{} / {} ({})".format(*parts) if parts[0] != "-" else "-"]
            row += [mean_spread([r["final_loss"] for r in runs]),
                    f"{sum(r['train_seconds'] for r in runs) / len(runs):.0f}"]  # fmt: skip
            lines.append("| " + " | ".join(row) + " |")
        lines += pick_curves(models)
    return "\n".join(lines)


def model_order(family: str, name: str) -> tuple:
    """The family's main models in their order, then the ablation, then others; a variant after its base."""
    known = DEFAULT_MODELS[family] + [m for m in ABLATION if m not in DEFAULT_MODELS[family]]
    base = name.split("+")[0]
    return (known.index(base) if base in known else len(known), name)


def pick_curves(models: dict[str, list]) -> list[str]:
    """Markdown rows: the pick rate (with the share of answers some head picked, where recorded) and the accuracy in
    the farthest region at every evaluation along training; then, where recorded, the routing gradient's push."""
    title = "pick rate (share of answers some head picked) / accuracy in the farthest region, along training"
    lines = curve_table(models, title, "pick_rate", lambda p, run: pick_cell(p, list(run["accuracy"])[-1]))
    title = ("share of the fact's bucket's routing scores a gradient step raises, when the head picked it / when "
             "it did not (0.5: no preference), along training")  # fmt: skip
    return lines + curve_table(models, title, "push_picked", push_cell)


def curve_table(models: dict[str, list], title: str, key: str, cell) -> list[str]:
    """Markdown rows, one per run with `key` recorded along training: `cell(point, run)` at every evaluation step."""
    runs = [(name, r) for name, rs in models.items() for r in rs if any(p.get(key) is not None for p in r["curve"])]
    if not runs:
        return []
    steps = sorted({point["step"] for _, run in runs for point in run["curve"]})  # budgets may differ
    lines = [f"\n{title}\n", "| model, seed | " + " | ".join(f"step {s}" for s in steps) + " |",
             "|---|" + "---|" * len(steps)]  # fmt: skip
    for name, run in runs:
        at = {p["step"]: cell(p, run) for p in run["curve"]}
        lines.append(f"| {name}, {run['seed']} | " + " | ".join(at.get(step, "") for step in steps) + " |")
    return lines


def push_cell(point: dict, run: dict) -> str:
    return " / ".join("-" if point.get(k) is None else f"{point[k]:.2f}" for k in ("push_picked", "push_missed"))


def pick_cell(point: dict, far: str) -> str:
    share = "" if point.get("any_picked") is None else f" ({point['any_picked']:.2f})"
    return f"{point.get('pick_rate') or 0:.2f}{share} / {point['accuracy'][far] or 0:.2f}"


def mean_spread(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mean = sum(values) / len(values)
    return f"{mean:.2f}" if len(values) == 1 else f"{mean:.2f} ({min(values):.2f}-{max(values):.2f})"


PANEL_KINDS = ("main set", "compression ablation", "variants", "perfect routing (diagnostic)", "longer training")
BASELINES = {"compressive": ("compressive", "llama"), "sinkhorn": ("top2", "llama"), "masked": ("masked", "bert")}


def panel_kind(family: str, name: str) -> str:
    """Which panel of its (family, task, length) a model's line goes to, so that no panel is crowded."""
    if name in DEFAULT_MODELS[family]:
        return "main set"
    if "oracle" in name:
        return "perfect routing (diagnostic)"
    if "+steps" in name or "+lr" in name:
        return "longer training"
    return "compression ablation" if name in ABLATION else "variants"


def plot_panels(record: dict) -> list[tuple[tuple, str, list[str]]]:
    """(family, task, length), panel kind, model names: a panel per kind that ran, in family, task and kind order;
    a panel of variants also draws the family's default, its full-attention baseline and a longer run's base."""
    out = []
    for key, models in panels(record).items():
        names = sorted(models, key=lambda name: model_order(key[0], name))
        for kind in PANEL_KINDS:
            chosen = [n for n in names if panel_kind(key[0], n) == kind]
            if chosen and kind != "main set":  # for reference: the baselines and a longer run's own base
                bases = [*BASELINES[key[0]], *(n.split("+")[0] for n in chosen)]
                chosen = list(dict.fromkeys(n for n in bases if n in models and n not in chosen)) + chosen
            if chosen:
                out.append((key, kind, chosen))
    return out


def variants_path(path: Path) -> Path:
    return path.with_name(f"{path.stem}_variants{path.suffix}")


def plot(record: dict, path: Path) -> list[Path]:
    """The main sets' panels to `path`, every other kind's to `variants_path(path)` (when any ran)."""
    every = plot_panels(record)
    main = [panel for panel in every if panel[1] == "main set"]
    written = [(path, main), (variants_path(path), [panel for panel in every if panel[1] != "main set"])]
    written = [(where, chosen) for where, chosen in written if chosen]
    for where, chosen in written:
        draw(record, chosen, where)
    return [where for where, _ in written]


def draw(record: dict, wanted: list, path: Path, columns: int = 3) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = panels(record)
    columns = min(columns, len(wanted))
    rows = -(-len(wanted) // columns)
    fig, axes = plt.subplots(rows, columns, figsize=(6.0 * columns, 7.0 * rows), squeeze=False, layout="constrained")
    for ax in axes.flat[len(wanted) :]:
        ax.set_axis_off()
    colors = plt.get_cmap("tab20").colors
    named = {}  # family -> its models in order: a model keeps its colour in every panel
    for (family, _, _), models in groups.items():
        named[family] = sorted(set(named.get(family, [])) | set(models), key=lambda name: model_order(family, name))
    for ax, (key, kind, names) in zip(axes.flat, wanted):
        # the family's main models solid, variants and the ablation dashed; one colour per model
        for name in names:
            i = named[key[0]].index(name)
            main = name in DEFAULT_MODELS[key[0]]
            runs = groups[key][name]
            bins = len(runs[0]["bins"])
            width = key[2] / bins
            xs, means, lows, highs = [], [], [], []
            for b in range(bins):
                values = [r["bins"][b] for r in runs if r["bins"][b] is not None]
                if values:
                    xs.append((b + 0.5) * width)
                    means.append(sum(values) / len(values))
                    lows.append(min(values))
                    highs.append(max(values))
            (line,) = ax.plot(
                xs, means, marker="o", ms=3 if main else 2, lw=1.8 if main else 1.0, ls="-" if main else "--",
                color=colors[(2 * i) % 20 + (2 * i) // 20 % 2], label=f"{name} ({len(runs)} seed{'s' if len(runs) > 1 else ''})",
            )  # fmt: skip
            ax.fill_between(xs, lows, highs, color=line.get_color(), alpha=0.15)
        ax.axhline(0.1, color="grey", lw=0.8, ls=":", label="chance")
        ax.set(title=f"{key[0]} family: {key[1]}, {key[2]} tokens\n{kind}", xlabel="distance from fact to answer (tokens)",
               ylabel="accuracy per answer token", ylim=(0, 1.02))  # fmt: skip
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)


# ------------------------------------------------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--family", choices=FAMILIES, default="compressive")
    p.add_argument("--task", choices=tuple(TASKS), default="passkey")
    p.add_argument("--models", nargs="+", help="names, or `ablation` / `all` (default: the family's main set)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument(
        "--steps", type=int, default=STEPS, help="training steps (another budget is recorded as <model>+steps<N>)"
    )
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--length", type=int, help="tokens per sequence (default 160; sinkhorn and masked 256)")
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--lr", type=float, default=LR, help="peak learning rate (another is recorded as <model>+lr<X>)")
    p.add_argument("--segment", type=int, default=32, help="compressive family: segment length")
    p.add_argument("--mem", type=int, default=32, help="compressive family: raw memories")
    p.add_argument("--c-mem", dest="c_mem", type=int, default=32, help="compressive family: compressed memories")
    p.add_argument("--rate", type=int, default=4, help="compressive family: compression rate")
    p.add_argument("--bucket", type=int, default=16, help="sinkhorn families: bucket size")
    p.add_argument("--pairs", type=int, default=4, help="mqar: key-value pairs per sequence")
    p.add_argument(
        "--curriculum",
        type=int,
        default=0,
        help="a diagnostic: over the first N steps the facts' distance grows from one segment / bucket to "
        "the whole sequence (recorded as <model>+curriculum<N>)",
    )
    p.add_argument("--eval-sequences", type=int, default=1024)
    p.add_argument("--eval-batch", type=int, default=128)
    p.add_argument("--eval-every", type=int, default=250, help="steps between the training curve's evaluations")
    p.add_argument("--distance-bins", type=int, default=10)
    p.add_argument("--threads", type=int, default=1, help="torch threads (0: torch's default)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, 2 models, 1 seed")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", type=Path, default=REPO / "docs/benchmarks/recall.json")
    p.add_argument(
        "--plot", type=Path, default=REPO / "docs/images/recall.png", help="the main sets; the rest to <stem>_variants"
    )
    p.add_argument("--plot-only", action="store_true", help="redraw the plot and reprint the tables from --json")
    args = p.parse_args(argv)
    if args.length is None:
        args.length = 160 if args.family == "compressive" else 256
    if args.quick:
        args.steps, args.batch, args.eval_sequences, args.eval_every = 6, 4, 16, 3
        args.seeds = args.seeds[:1]
        args.models = args.models or DEFAULT_MODELS[args.family][:1] + ["llama" if args.family != "masked" else "bert"]
    names = family_specs(args.family, args)
    chosen = args.models or DEFAULT_MODELS[args.family]
    chosen = [m for item in chosen for m in ({"ablation": ABLATION, "all": list(names)}.get(item, [item]))]
    unknown = [m for m in chosen if m not in names]
    if unknown:
        p.error(f"--models: unknown for the {args.family} family: {unknown}; known: {sorted(names)}")
    args.models = list(dict.fromkeys(chosen))
    if args.task != "passkey" and any(names[m].oracle for m in args.models):
        p.error("--models: the oracle routing needs --task passkey (its facts span at most 2 buckets)")
    geometry = args.segment if args.family == "compressive" else args.bucket
    if args.length % geometry:
        p.error(
            f"--length ({args.length}) must be a multiple of the {'segment' if args.family == 'compressive' else 'bucket'} ({geometry})"
        )
    return args


def main(argv=None) -> None:
    args = parse_args(argv)
    if not args.plot_only:
        if args.threads:
            torch.set_num_threads(args.threads)
        eval_batch = TASKS[args.task](
            torch.Generator().manual_seed(12345), args.eval_sequences, args.length, args.pairs
        )
        specs = family_specs(args.family, args)
        for seed in args.seeds:
            for name in args.models:
                result = train_one(specs[name], args, seed, args.family, eval_batch)
                sizes = {k: getattr(args, k) for k in ("hidden", "layers", "heads", "batch", "lr", "steps", "pairs")}
                run = dict(
                    family=args.family,
                    task=args.task,
                    length=args.length,
                    model=record_name(name, args),
                    seed=seed,
                    sizes=sizes,
                    **result,
                )
                with locked_record(args.json) as record:
                    record["runs"][run_key(args.family, args, record_name(name, args), seed)] = run
                    record.setdefault("commands", [])
                    command = "python " + shlex.join([str(Path(sys.argv[0]))] + (argv or sys.argv[1:]))
                    if command not in record["commands"]:
                        record["commands"].append(command)
                    record["versions"] = versions()
                    record["updated"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
                print(f"{name} seed {seed}: {result['accuracy']} ({result['train_seconds']} s)", flush=True)
    record = json.loads(args.json.read_text())
    print(summarise(record))
    images = " and ".join(map(str, plot(record, args.plot)))
    print(f"\nwrote {images}" if args.plot_only else f"\nwrote {args.json}, {images}")


if __name__ == "__main__":
    main()
