"""Decoding speed, batch 1: longrange (eager and compiled) vs the reference packages vs transformers' Llama.

    python benchmarks/benchmark_decoding.py                                # the issue's sizes, on CUDA when present
    python benchmarks/benchmark_decoding.py --quick --device cpu --out /tmp/decoding.json   # tiny smoke run (CI)
    python benchmarks/benchmark_decoding.py --rows 'sinkhorn/ours'         # a subset (regular expression on row ids)

Rows (issue 10): hidden 512, 6 layers, 8 heads (the sizes of `benchmark_gpu.py`), a random prompt of 512, 1,024
and 4,096 tokens, then `--new-tokens` greedy tokens:
- compressive / sinkhorn `ours`: `generate()` with our cache, `eager` (`disable_compile=True`) and `compiled`
  (on CUDA what `generate()` does by itself when the cache is compileable: transformers compiles the decoding
  step, mode "reduce-overhead", i.e. CUDA graphs; elsewhere the same asked for through
  `generation_config.compile_config`). A compiled row whose generate() did not compile anything records an error
  instead of passing an eager figure off as compiled.
- `reference`: compressive-transformer-pytorch 0.4.0 and sinkhorn-transformer 0.11.4, through their own
  `generate` (neither has a cache: the Sinkhorn wrapper re-runs its whole window per token); `--ref-new-tokens`.
- llama: transformers' `LlamaForCausalLM` (SDPA), `eager` with its dynamic cache, `compiled` with
  `cache_implementation="static"` (transformers' fastest documented path).
Precision: bf16 weights on CUDA (`model.to(torch.bfloat16)`), fp32 on the CPU.
Per-token time: a streamer stamps every emitted token; a row's rate is 1 / the median gap between consecutive
tokens after the first (the prompt's forward), measured on the second generate() call of the row (the first
warms up and, for compiled rows, compiles: reported as `warmup_s`). One model serves the rows of a (family, side,
mode) at every context, so a compiled step whose shapes do not change with the context compiles once (our
Sinkhorn rows size the cache for the longest context every time; Llama's static cache follows each row's length). `--out` gets the rows under the key
"decoding" (other keys of an existing file, such as `benchmark_gpu.py`'s training rows, are kept).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import re
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _sibling(name: str):
    """A benchmark of this folder as a module (loaded once), by path: also when this file itself was loaded by path,
    as the tests do."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@dataclass(frozen=True)
class Row:
    family: str  # compressive | sinkhorn | llama
    side: str  # ours | reference | llama
    mode: str  # eager | compiled
    context: int

    @property
    def id(self) -> str:
        return f"{self.family}/{self.side}/{self.mode}/{self.context}"


def sizes(quick: bool) -> dict:
    if quick:
        return dict(
            width=dict(hidden=64, layers=2, heads=4),
            compressive=dict(segment=32, mem=32, c_mem=8, rate=4),
            sinkhorn=dict(bucket=16),
            contexts=[32, 64],
            new_tokens=6,
            ref_new_tokens=2,
        )
    return dict(
        width=dict(hidden=512, layers=6, heads=8),
        compressive=dict(segment=512, mem=512, c_mem=128, rate=4),
        sinkhorn=dict(bucket=128),
        contexts=[512, 1024, 4096],
        new_tokens=64,
        ref_new_tokens=4,
    )


def plan(size: dict) -> list[Row]:
    """Ours first (compiled then eager), then Llama, then the references (slowest, least informative) last; within
    each, the context of the issue's target (1,024 tokens, else the middle one) first."""
    contexts = sorted(size["contexts"], key=lambda n: n != sorted(size["contexts"])[len(size["contexts"]) // 2])
    rows = []
    for family, side in (("compressive", "ours"), ("sinkhorn", "ours"), ("llama", "llama")):
        rows += [Row(family, side, mode, n) for mode in ("compiled", "eager") for n in contexts]
    rows += [Row(family, "reference", "eager", n) for family in ("compressive", "sinkhorn") for n in size["contexts"]]
    return rows


# ----------------------------------------------------------------------------------------------------------
# models


def build(row: Row, size: dict):
    """The row's model (eval mode, on the CPU, fp32) and the longest sequence it will see."""
    width, longest = size["width"], max(size["contexts"]) + size["new_tokens"] + 1
    torch.manual_seed(0)
    gpu = _sibling("benchmark_gpu")
    if row.family == "compressive":
        ours, reference = _sibling("benchmark_compressive").build(gpu.compressive_args(size), sides=(row.side,))
        return (ours or reference).eval()
    if row.family == "sinkhorn":
        opts = dict(
            num_tokens=256, dim=width["hidden"], depth=width["layers"], heads=width["heads"],
            bucket_size=size["sinkhorn"]["bucket"], causal=True, **_sibling("benchmark_sinkhorn").COMMON,
        )  # fmt: skip
        bucket = opts["bucket_size"]
        if row.side == "reference":
            from sinkhorn_transformer import SinkhornTransformerLM
            from sinkhorn_transformer.autoregressive_wrapper import AutoregressiveWrapper

            # its window: the prompt plus the new tokens, rounded up to whole buckets (its Autopadder pads)
            window = -(-(row.context + size["ref_new_tokens"]) // bucket) * bucket
            return AutoregressiveWrapper(SinkhornTransformerLM(max_seq_len=window, **opts)).eval()
        from longrange import SinkhornConfig, SinkhornForCausalLM

        model = SinkhornForCausalLM(SinkhornConfig(max_seq_len=-(-longest // bucket) * bucket, **opts)).eval()
        # one cache size for every context (as a server would size it), so that the compiled step is compiled for
        # the first context only; a larger cache than a row needs (the longest context's) costs that row, if anything
        model.generation_config.max_cache_len = longest
        return model
    return gpu.llama(width, longest).eval()


# ----------------------------------------------------------------------------------------------------------
# measuring


class Stamps:
    """A generate() streamer recording the time of every put(): first the prompt, then each new token."""

    def __init__(self):
        self.stamps: list[float] = []

    def put(self, value):
        self.stamps.append(time.perf_counter())

    def end(self):
        pass


def random_prompt(length: int, vocab: int = 256, seed: int = 1) -> torch.Tensor:
    """[1, length] token ids, none of them 0: generate() is given pad_token_id=0 (below) and reads every 0 of a
    prompt passed without an attention mask as padding, which would put padding in the middle of the rows."""
    return torch.randint(1, vocab, (1, length), generator=torch.Generator().manual_seed(seed))


def generate_kwargs(row: Row, device: torch.device, backend: str) -> dict:
    from transformers import CompileConfig

    kwargs = dict(do_sample=False, pad_token_id=0, eos_token_id=None, use_cache=True)
    if row.mode == "eager":
        return {**kwargs, "disable_compile": True}
    if row.side == "llama":
        kwargs["cache_implementation"] = "static"
    if device.type != "cuda" or backend != "inductor":
        # what generate() does by itself on CUDA, asked for explicitly (other devices, other backends)
        config = CompileConfig(backend=backend, mode="reduce-overhead" if backend == "inductor" else None)
        config._compile_all_devices = True
        kwargs["compile_config"] = config
    return kwargs


def compiled_graphs() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["stats"].values()) if "stats" in counters else 0


def model_for(row: Row, size: dict, device: torch.device, models: dict):
    """The row's model on `device` (bf16 on CUDA), and whether it was built now: one model serves every context of
    a (family, side, mode), so that a compiled decoding step whose shapes do not depend on the context (both our
    bounded caches) is compiled once, not once per row."""
    key = (row.family, row.side, row.mode)
    if key in models:
        return models[key], False
    models.clear()  # one model held at a time
    torch._dynamo.reset()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    models[key] = build(row, size).to(device=device, dtype=dtype)
    return models[key], True


def measure(row: Row, size: dict, device: torch.device, backend: str, models: dict) -> dict:
    model, fresh = model_for(row, size, device, models)
    dtype = next(model.parameters()).dtype
    result = {"parameters": sum(p.numel() for p in model.parameters()), "dtype": str(dtype).replace("torch.", "")}
    prompt = random_prompt(row.context).to(device)
    if row.side == "reference":
        count = size["ref_new_tokens"]
        with torch.no_grad():
            model.generate(prompt, 1)  # warm-up
            sync(device)
            start = time.perf_counter()
            model.generate(prompt, count)
            sync(device)
        elapsed = time.perf_counter() - start
        return {**result, "new_tokens": count, "total_s": elapsed, "tokens_per_s": count / elapsed}
    count = size["new_tokens"]
    kwargs = generate_kwargs(row, device, backend)
    before = compiled_graphs()
    start = time.perf_counter()
    model.generate(prompt, max_new_tokens=count, min_new_tokens=count, **kwargs)
    sync(device)
    result["warmup_s"] = time.perf_counter() - start
    compiled = compiled_graphs() > before if fresh else hasattr(model, "_compiled_call")
    if row.mode == "compiled" and not compiled:
        raise RuntimeError("generate() compiled nothing: the model's cache is not compileable")
    result["recompiled"] = compiled_graphs() > before
    stamps = Stamps()
    start = time.perf_counter()
    out = model.generate(prompt, max_new_tokens=count, min_new_tokens=count, streamer=stamps, **kwargs)
    sync(device)
    total = time.perf_counter() - start
    if out.shape[1] != row.context + count:
        raise RuntimeError(f"generated {out.shape[1] - row.context} tokens, asked for {count}")
    result["tokens"] = out[0, row.context :].tolist()
    gaps = [b - a for a, b in zip(stamps.stamps[1:], stamps.stamps[2:])]
    median = statistics.median(gaps)
    if row.side == "ours" and row.context == sorted(size["contexts"])[len(size["contexts"]) // 2]:
        result["decoding_work"] = decoding_work(model, prompt, kwargs, device)
    return {
        **result,
        "new_tokens": count,
        "prefill_s": stamps.stamps[1] - start,
        "per_token_s": gaps,
        "median_token_s": median,
        "tokens_per_s": 1 / median,
        "end_to_end_tokens_per_s": count / total,
    }


def decoding_work(model, prompt, kwargs: dict, device: torch.device, steps: int = 8) -> dict:
    """The work of one decoding step: two profiled generate() calls, one new token (the prompt's forward alone) and
    1 + `steps`, and their difference per step: on CUDA the kernels' device time per token (against the per-token
    time: how much of it the device is busy; kernels replayed inside a CUDA graph may not be reported, then the
    sum is near 0) and the costliest kernels; on the CPU the aten operators. Eager rows on CUDA also list the
    sites where a generate() call of 1 + `steps` tokens waits for the device (`benchmark_gpu.sync_sites`)."""
    from torch.profiler import ProfilerActivity, profile

    gpu = _sibling("benchmark_gpu")
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    totals = []
    for count in (1, 1 + steps):
        with profile(activities=activities) as prof:
            model.generate(prompt, max_new_tokens=count, min_new_tokens=count, **kwargs)
            sync(device)
        totals.append(gpu.work_by_kind(prof.events(), device))
    per_step = {}
    for name, (calls, spent) in totals[1].items():
        before = totals[0].get(name, [0, 0.0])
        if calls > before[0] and spent > before[1]:  # (same calls in both: the prompt's work, timing noise)
            per_step[name] = [(calls - before[0]) / steps, (spent - before[1]) / steps]
    busy, top = gpu.ranked_work(per_step)
    work = {"steps": steps, "busy_s_per_token": busy, "top_work_per_token": top}
    if device.type == "cuda" and kwargs.get("disable_compile"):
        # eager: where the host waits for the device (generate()'s own read of each new token included)
        work["sync_sites"] = gpu.sync_sites(
            lambda: model.generate(prompt, max_new_tokens=1 + steps, min_new_tokens=1 + steps, **kwargs)
        )
    return work


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def summarise(results: dict[str, dict], size: dict) -> dict:
    """Ours / Llama-compiled and ours / reference at each context, and per-token time at the longest context over
    the shortest (issue 10: within 1.2x), from each of our rows; for every compiled row (Llama's too, the
    reference behaviour) the share of its greedy tokens equal to the eager row's."""
    rate = {key: r.get("tokens_per_s") for key, r in results.items()}
    out = {}
    short, long = min(size["contexts"]), max(size["contexts"])
    for key, r in results.items():
        row = Row(**r["row"])
        if row.side == "reference":
            continue
        entry = {}
        eager = results.get(f"{row.family}/{row.side}/eager/{row.context}", {}).get("tokens")
        if row.mode == "compiled" and eager and r.get("tokens"):  # the same greedy tokens as eager decoding
            entry["tokens_equal_eager"] = sum(a == b for a, b in zip(r["tokens"], eager)) / len(eager)
        if row.side == "ours":
            mine = rate.get(key)
            llama = rate.get(f"llama/llama/compiled/{row.context}")
            reference = rate.get(f"{row.family}/reference/eager/{row.context}")
            entry["vs_llama_static_compiled"] = mine / llama if mine and llama else None
            entry["vs_reference"] = mine / reference if mine and reference else None
            if row.context == long:
                first = rate.get(f"{row.family}/ours/{row.mode}/{short}")
                entry[f"time_per_token_{long}_over_{short}"] = first / mine if mine and first else None
        out[key] = entry
    return out


def table(results: dict[str, dict], compared: dict[str, dict]) -> str:
    lines = [
        "| row | tokens/s | warm-up s | ours / Llama static compiled | ours / reference | tokens = eager | note |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]

    def fmt(value, spec):
        return "" if value is None else format(value, spec)

    for key, r in results.items():
        c = compared.get(key, {})
        note = (r.get("error") or "").replace("|", "/")
        lines.append(
            f"| {key} | {fmt(r.get('tokens_per_s'), ',.1f')} | {fmt(r.get('warmup_s'), '.1f')} | "
            f"{fmt(c.get('vs_llama_static_compiled'), '.2f')} | {fmt(c.get('vs_reference'), '.2f')} | "
            f"{fmt(c.get('tokens_equal_eager'), '.2f')} | {note} |"
        )
    return "\n".join(lines)


def plot(section: dict, path: Path) -> None:
    """Tokens/s against the context for each measured (family, side, mode), log scale: what the table says, drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    series: dict[str, list] = {}
    for r in section["rows"].values():
        if r.get("tokens_per_s"):
            row = Row(**r["row"])
            name = f"{row.family}{' reference' if row.side == 'reference' else ''} {row.mode}"
            series.setdefault(name, []).append((row.context, r["tokens_per_s"]))
    fig, ax = plt.subplots(figsize=(7, 4.2))
    for name, points in sorted(series.items()):
        x, y = zip(*sorted(points))
        ax.plot(x, y, marker="o", linestyle="-" if len(x) > 1 else "none", label=name)
    ax.axhline(1000, color="black", linestyle=":", linewidth=1, label="target (1,000 at 1,024)")
    ax.set(xscale="log", yscale="log", xlabel="tokens of context (prompt)", ylabel="new tokens / s (batch 1)")
    ax.minorticks_off()
    ax.set_xticks(section["sizes"]["contexts"], [f"{n:,}" for n in section["sizes"]["contexts"]])
    ax.set_title(f"Decoding on {section['device']} (torch {section['torch']})", fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="center left", bbox_to_anchor=(1, 0.5))
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, contexts 32 and 64 (a CPU smoke run)")
    parser.add_argument("--out", type=Path, default=None, help="JSON to write or update under the key 'decoding' "
                        "(default docs/benchmarks/gpu.json; none with --quick)")  # fmt: skip
    parser.add_argument("--rows", default=None, help="regular expression: run only the rows whose id it matches")
    parser.add_argument("--new-tokens", type=int, default=None, help="greedy tokens per generate() (default 64)")
    parser.add_argument("--compile-backend", default=None, help="torch.compile backend for the compiled rows "
                        "(default inductor; with --quick on the CPU aot_eager, which skips C++ code generation)")  # fmt: skip
    parser.add_argument("--budget", type=float, default=240.0, help="seconds after which no row starts")
    parser.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    parser.add_argument("--plot", type=Path, default=None, help="draw tokens/s against the context to this image")
    parser.add_argument("--plot-only", type=Path, default=None, metavar="JSON",
                        help="redraw --plot from a record's 'decoding' section and reprint its table; measure nothing")  # fmt: skip
    args = parser.parse_args(argv)
    if args.plot_only:
        section = json.loads(args.plot_only.read_text())["decoding"]
        if args.plot:
            plot(section, args.plot)
        print(table(section["rows"], section["ratios"]))
        return section
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    if args.threads:
        torch.set_num_threads(args.threads)
    backend = args.compile_backend or ("aot_eager" if args.quick and device.type == "cpu" else "inductor")
    size = sizes(args.quick)
    if args.new_tokens:
        size["new_tokens"] = args.new_tokens
    out = args.out if args.out is not None or args.quick else REPO / "docs" / "benchmarks" / "gpu.json"
    rows = [r for r in plan(size) if not args.rows or re.search(args.rows, r.id)]

    results: dict[str, dict] = {}
    models: dict = {}
    started = time.perf_counter()

    def write(final: bool) -> dict:
        compared = summarise(results, size)
        section = {
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "torch": torch.__version__,
            "settings": {"quick": args.quick, "backend": backend, "budget": args.budget, "threads": args.threads},
            "sizes": size,
            "complete": final,
            "elapsed_s": time.perf_counter() - started,
            "rows": results,
            "ratios": compared,
        }
        if out:
            payload = json.loads(out.read_text()) if out.exists() else {}
            payload["decoding"] = section
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(payload, indent=1) + "\n")
        return section

    print(f"{device} | {len(rows)} rows, budget {args.budget:.0f} s", file=sys.stderr, flush=True)
    for row in rows:
        entry: dict = {"row": asdict(row)}
        if time.perf_counter() - started >= args.budget:
            entry["error"] = f"skipped: time budget of {args.budget:.0f} s spent"
        else:
            t0 = time.perf_counter()
            try:
                entry.update(measure(row, size, device, backend, models))
            except Exception as exc:  # noqa: BLE001 - a row's failure is a result, recorded in the row
                first = next((line for line in str(exc).splitlines() if line.strip()), "")
                entry["error"] = f"error: {type(exc).__name__}: {first[:300]}"
                models.clear()  # a failed model is not reused
            entry["row_s"] = time.perf_counter() - t0
        results[row.id] = entry
        status = entry.get("error") or f"{entry['tokens_per_s']:,.1f} tokens/s"
        print(f"[{time.perf_counter() - started:5.0f} s] {row.id}: {status}", file=sys.stderr, flush=True)
        write(final=False)
    section = write(final=True)
    print(table(results, section["ratios"]))
    if args.plot:
        plot(section, args.plot)
    return section


if __name__ == "__main__":
    main()
