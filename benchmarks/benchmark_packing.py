#!/usr/bin/env python
"""Packed training batches (`DataCollatorWithFlattening`, TRL's `SFTTrainer(packing=True)`): documents run in groups
of similar length (one forward per group) against all in one group (every document padded to the longest), with
transformers' Llama on the same batch beside them.

    python benchmarks/benchmark_packing.py --json docs/benchmarks/packing.json   # hidden 512, 4 layers (~10 min)
    python benchmarks/benchmark_packing.py --quick                              # tiny sizes (CI smoke run)

Documents get lengths from a log-normal law (median `median` tokens, sigma 1, cut to 8 .. `row` tokens: a few
long documents among many short ones, as in instruction data) and random tokens, drawn until `rows` x `row` tokens
are filled, collated by `DataCollatorWithFlattening` (one row, position_ids restarting at each document, as TRL's
padding-free packing also gives). Each cell is one training step (forward,
loss, backward; median of `--repeats`) of a model in train mode:
- grouped: the documents in groups of similar length (`longrange.packing.GROUP_COST`, the default);
- one group: every document in one group of rows padded to the longest (what every packed call did before groups);
- llama: transformers' `LlamaForCausalLM` (SDPA) of the same width, depth and heads on the same batch (it reads the
  documents from position_ids): full attention's cost for the same job.
`padded` is the token positions the model's rows hold over the batch's tokens (rows rounded up to the bucket or
segment); `max_diff` the largest difference between the two layouts' logits (both exact: rounding only).

`--text FILE` (no timing) adds the padding of real documents: the file's blank-line-separated passages as
byte-level documents (cut to `row` bytes), batches filled in order up to `rows` x `row` bytes, positions per token of
each layout (median over the batches).

The call cost (`--calibrate`): one training step of one row of one bucket (or segment) over the per-token time of a
step of `rows` full rows, in tokens: what one more group's call costs, the figure GROUP_COST stands for.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longrange import (  # noqa: E402
    CompressiveConfig,
    CompressiveForCausalLM,
    SinkhornConfig,
    SinkhornForCausalLM,
    packing,
)

FULL = dict(hidden=512, layers=4, heads=8, unit=64, row=2048, rows=4, median=150)
QUICK = dict(hidden=32, layers=2, heads=2, unit=8, row=128, rows=2, median=12)
VOCAB = 256


def models(size: dict, device: str) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    shared = dict(vocab_size=VOCAB, hidden_size=size["hidden"], num_hidden_layers=size["layers"],
                  num_attention_heads=size["heads"])  # fmt: skip
    torch.manual_seed(0)
    built = {
        "sinkhorn": SinkhornForCausalLM(
            SinkhornConfig(**shared, bucket_size=size["unit"], max_position_embeddings=size["row"], causal=True)
        ),
        "compressive": CompressiveForCausalLM(
            CompressiveConfig(
                **shared,
                segment_length=2 * size["unit"],
                mem_len=2 * size["unit"],
                c_mem_len=size["unit"],
                compression_rate=2,
                hidden_dropout=0.0,
            )
        ),
        "llama": LlamaForCausalLM(
            LlamaConfig(
                **shared,
                intermediate_size=4 * size["hidden"],
                max_position_embeddings=size["row"],
                attn_implementation="sdpa",
            )
        ),
    }
    return {name: model.to(device) for name, model in built.items()}


def packed_batch(size: dict, seed: int = 0) -> tuple[dict, list[int]]:
    """A collated batch of documents drawn until `rows` x `row` tokens are filled, and their lengths."""
    from transformers import DataCollatorWithFlattening

    generator = torch.Generator().manual_seed(seed)
    budget, docs = size["rows"] * size["row"], []
    while True:
        n = int(torch.empty(1).log_normal_(0.0, 1.0, generator=generator).mul(size["median"]).clamp(8, size["row"]))
        if sum(map(len, docs)) + n > budget:
            break
        docs.append(torch.randint(0, VOCAB, (n,), generator=generator).tolist())
    return DataCollatorWithFlattening()([{"input_ids": d} for d in docs]), [len(d) for d in docs]


def step(model, batch: dict, repeats: int, cost: int | None = None):
    """Median seconds of one training step on `batch` (with `GROUP_COST` = cost), and the last step's logits."""
    kept = packing.GROUP_COST
    if cost is not None:
        packing.GROUP_COST = cost
    times = []
    synchronize = torch.cuda.synchronize if model.device.type == "cuda" else lambda: None
    try:
        for _ in range(repeats):
            model.zero_grad(set_to_none=True)
            synchronize()
            start = time.perf_counter()
            out = model(**batch, use_cache=False)
            out.loss.backward()
            synchronize()
            times.append(time.perf_counter() - start)
    finally:
        packing.GROUP_COST = kept
    return statistics.median(times), out.logits.detach()


def padded_positions(lengths: list[int], unit: int, cost: int) -> int:
    """Token positions the rows of the documents' groups hold."""
    ordered = sorted(lengths, reverse=True)
    total, start = 0, 0
    for size in packing.group_sizes(ordered, unit, cost):
        total += size * -(-ordered[start] // unit) * unit
        start += size
    return total


def measure(size: dict, repeats: int, device: str) -> list[dict]:
    built = models(size, device)
    batch, lengths = packed_batch(size)
    batch = {name: t.to(device) for name, t in batch.items()}
    tokens = sum(lengths)
    llama_s, _ = step(built["llama"].train(), batch, repeats)
    rows = []
    for name in ("sinkhorn", "compressive"):
        model = built[name].train()
        unit = size["unit"] * (2 if name == "compressive" else 1)
        step(model, batch, 1)  # warm-up
        grouped_s, grouped = step(model, batch, repeats)
        one_s, one = step(model, batch, repeats, cost=10**12)
        row = dict(
            model=name, documents=len(lengths), tokens=tokens, longest=max(lengths),
            groups=len(packing.group_sizes(sorted(lengths, reverse=True), unit, packing.GROUP_COST)),
            padded_grouped=padded_positions(lengths, unit, packing.GROUP_COST) / tokens,
            padded_one_group=padded_positions(lengths, unit, 10**12) / tokens,
            grouped_s=grouped_s, one_group_s=one_s, llama_s=llama_s,
            max_diff=(grouped - one).abs().max().item(),
        )  # fmt: skip
        rows.append(row)
        print(
            f"{name}: {row['documents']} documents, {row['groups']} groups: grouped {grouped_s:.3f} s, one group "
            f"{one_s:.3f} s, llama {llama_s:.3f} s",
            file=sys.stderr, flush=True,
        )  # fmt: skip
    return rows


def calibrate(size: dict, repeats: int, device: str) -> dict:
    """A call's cost in tokens, per model: the step time of one row of one unit over the per-token step time of
    `rows` full rows (both without packing)."""
    built, costs = models(size, device), {}
    for name in ("sinkhorn", "compressive"):
        model = built[name].train()
        unit = size["unit"] * (2 if name == "compressive" else 1)
        small = {"input_ids": torch.randint(0, VOCAB, (1, unit), device=device)}
        large = {"input_ids": torch.randint(0, VOCAB, (size["rows"], size["row"]), device=device)}
        for batch in (small, large):
            batch["labels"] = batch["input_ids"]
        step(model, small, 1)
        small_s, _ = step(model, small, repeats)
        large_s, _ = step(model, large, repeats)
        costs[name] = small_s / (large_s / (size["rows"] * size["row"]))
        print(f"{name}: a call costs {costs[name]:.0f} tokens", file=sys.stderr, flush=True)
    return costs


def text_padding(path: Path, size: dict) -> dict:
    """Positions per token of both layouts on the passages of a text file (see the module), median over batches."""
    passages = [min(len(p), size["row"]) for p in path.read_bytes().split(b"\n\n") if p.strip()]
    budget, batches, batch = size["rows"] * size["row"], [], []
    for n in passages:
        if sum(batch) + n > budget:
            batches.append(batch)
            batch = []
        batch.append(n)
    record = {"file": path.name, "passages": len(passages), "batches": len(batches)}
    for name, unit in (("sinkhorn", size["unit"]), ("compressive", 2 * size["unit"])):
        for layout, cost in (("grouped", packing.GROUP_COST), ("one_group", 10**12)):
            ratios = [padded_positions(b, unit, cost) / sum(b) for b in batches]
            record[f"{name}_{layout}"] = statistics.median(ratios)
    print(f"{path.name}: {record}", file=sys.stderr, flush=True)
    return record


def table(rows: list[dict]) -> str:
    lines = [
        "| model | documents | tokens | groups | positions / token: grouped | one group | grouped s | one group s "
        "| one group / grouped | Llama s |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['documents']} | {r['tokens']:,} | {r['groups']} | {r['padded_grouped']:.2f} | "
            f"{r['padded_one_group']:.2f} | {r['grouped_s']:.3f} | {r['one_group_s']:.3f} | "
            f"{r['one_group_s'] / r['grouped_s']:.2f}x | {r['llama_s']:.3f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3, help="timed steps per cell (median)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--calibrate", action="store_true", help="also measure a call's cost in tokens")
    parser.add_argument(
        "--group_cost", type=int, default=None, help="GROUP_COST for the grouped steps (default: its value)"
    )
    parser.add_argument("--text", type=Path, default=None, help="also the padding of this file's passages")
    parser.add_argument("--json", type=Path, default=None, help="write the settings and rows here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = QUICK if args.quick else FULL
    kept = packing.GROUP_COST
    packing.GROUP_COST = kept if args.group_cost is None else args.group_cost
    try:
        record = {
            "settings": {**size, "repeats": args.repeats, "threads": torch.get_num_threads(),
                         "group_cost": packing.GROUP_COST, "torch": torch.__version__, "device": args.device},
            "rows": measure(size, args.repeats, args.device),
        }  # fmt: skip
        if args.text:
            record["text"] = text_padding(args.text, size)
    finally:
        packing.GROUP_COST = kept
    if args.calibrate:
        record["call_cost_tokens"] = calibrate(size, args.repeats, args.device)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(table(record["rows"]))
    return record


if __name__ == "__main__":
    main()
