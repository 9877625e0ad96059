#!/usr/bin/env python
"""Several new tokens on a filled Sinkhorn cache (a chat's next turn, a chunked prompt, assisted decoding's
candidates): one chunk against one token at a time, and the rule that chooses between them.

    python benchmarks/benchmark_chunks.py --json docs/benchmarks/chunks.json    # hidden 512, 4 layers (~4 min)
    python benchmarks/benchmark_chunks.py --quick                               # tiny sizes (CI smoke run)

A causal `SinkhornForCausalLM` (random weights, eval, fp32) is prefilled with `context` random tokens; then `new`
tokens go onto a copy of that cache in one forward call, timed (median of `--repeats`; the copy is not timed):
- chunk: one pass over every token so far (`SinkhornCache.begin_chunk`), forced;
- steps: the tokens one at a time, forced (what every call did before chunks);
- auto: the model's own choice (`SinkhornCache.takes_chunk`: a chunk when new >= (context + new) / chunk_ratio);
- llama: transformers' `LlamaForCausalLM` (SDPA) of the same width, depth and heads, its DynamicCache prefilled
  alike, the same new tokens in one call: full attention's cost for the same job.
`max_diff` is the largest difference between the chunk's and the steps' logits (both exact: rounding only).
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from longrange import SinkhornConfig, SinkhornForCausalLM  # noqa: E402
from longrange.cache_sinkhorn import SinkhornCache  # noqa: E402

FULL = dict(hidden=512, layers=4, heads=8, bucket=64, contexts=[512, 4096, 12288], new=[2, 8, 32, 128, 512])
QUICK = dict(hidden=64, layers=2, heads=4, bucket=8, contexts=[64, 256], new=[2, 16, 64])


def models(size: dict):
    from transformers import LlamaConfig, LlamaForCausalLM

    longest = max(size["contexts"]) + max(size["new"])
    torch.manual_seed(0)
    ours = SinkhornForCausalLM(
        SinkhornConfig(
            vocab_size=256, hidden_size=size["hidden"], num_hidden_layers=size["layers"],
            num_attention_heads=size["heads"], bucket_size=size["bucket"], max_position_embeddings=longest,
            causal=True,
        )
    ).eval()  # fmt: skip
    llama = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=256, hidden_size=size["hidden"], intermediate_size=4 * size["hidden"],
            num_hidden_layers=size["layers"], num_attention_heads=size["heads"],
            max_position_embeddings=longest, attn_implementation="sdpa",
        )
    ).eval()  # fmt: skip
    return ours, llama


def timed(model, ids, cache, repeats: int, ratio: int | None = None):
    """Median seconds of one forward of `ids` onto copies of `cache`, and the last call's logits."""
    kept = SinkhornCache.chunk_ratio
    if ratio is not None:
        SinkhornCache.chunk_ratio = ratio
    times = []
    try:
        for _ in range(repeats):
            fresh = copy.deepcopy(cache)
            start = time.perf_counter()
            logits = model(ids, past_key_values=fresh, use_cache=True).logits
            times.append(time.perf_counter() - start)
    finally:
        SinkhornCache.chunk_ratio = kept
    return statistics.median(times), logits


def measure(size: dict, repeats: int) -> list[dict]:
    ours, llama = models(size)
    rows = []
    for context in size["contexts"]:
        ids = torch.randint(0, 256, (1, context + max(size["new"])))
        with torch.no_grad():
            cache = ours(ids[:, :context], use_cache=True).past_key_values
            llama_cache = llama(ids[:, :context], use_cache=True).past_key_values
            for new in size["new"]:
                more = ids[:, context : context + new]
                chunk_s, chunk = timed(ours, more, cache, repeats, ratio=10**9)
                steps_s, steps = timed(ours, more, cache, repeats, ratio=0)
                auto_s, _ = timed(ours, more, cache, repeats)
                llama_s, _ = timed(llama, more, llama_cache, repeats)
                row = dict(
                    context=context, new=new, chunk_s=chunk_s, steps_s=steps_s, auto_s=auto_s, llama_s=llama_s,
                    auto_path="chunk" if copy.deepcopy(cache).takes_chunk(new) else "steps",
                    max_diff=(chunk - steps).abs().max().item(),
                )  # fmt: skip
                rows.append(row)
                print(
                    f"context {context:>6} new {new:>4}: chunk {chunk_s * 1e3:8.1f} ms, steps {steps_s * 1e3:8.1f} ms, "
                    f"auto ({row['auto_path']}) {auto_s * 1e3:8.1f} ms, llama {llama_s * 1e3:8.1f} ms",
                    file=sys.stderr, flush=True,
                )  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    lines = [
        "| context | new tokens | chunk ms | one at a time ms | steps / chunk | auto (path) ms | auto / best | Llama ms |",
        "| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        best = min(r["chunk_s"], r["steps_s"])
        lines.append(
            f"| {r['context']:,} | {r['new']} | {r['chunk_s'] * 1e3:.1f} | {r['steps_s'] * 1e3:.1f} | "
            f"{r['steps_s'] / r['chunk_s']:.2f}x | {r['auto_s'] * 1e3:.1f} ({r['auto_path']}) | "
            f"{r['auto_s'] / best:.2f}x | {r['llama_s'] * 1e3:.1f} |"
        )
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--repeats", type=int, default=3, help="timed calls per cell (median)")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--json", type=Path, default=None, help="write the settings and rows here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    size = QUICK if args.quick else FULL
    rows = measure(size, args.repeats)
    record = {
        "settings": {**size, "repeats": args.repeats, "threads": torch.get_num_threads(),
                     "chunk_ratio": SinkhornCache.chunk_ratio, "torch": torch.__version__},
        "rows": rows,
    }  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=1) + "\n")
    print(table(rows))
    return record


if __name__ == "__main__":
    main()
