"""Training speed and memory on one device: longrange vs the reference packages vs transformers' Llama (SDPA).

    python benchmarks/benchmark_gpu.py                                  # the issue's sizes, on CUDA when present
    python benchmarks/benchmark_gpu.py --quick --device cpu --out /tmp/gpu_quick.json   # tiny smoke run (CI)
    python benchmarks/benchmark_gpu.py --rows 'sinkhorn/.*/bf16'        # a subset (regular expression on row ids)

Rows (the table of issue 9; the model sizes are those of `benchmark_compressive.py` / `benchmark_sinkhorn.py`,
whose builders and training steps are reused here, so both sides get the same configurations as on the CPU):
- compressive: longrange `CompressiveForCausalLM` and compressive-transformer-pytorch 0.4.0 (its
  `AutoregressiveWrapper`, one backward per segment as in its README), and ours trained the same way
  (`by_segment`: the memories carried in the cache, one backward per segment); hidden 512, 6 layers, 8 heads, segment 512,
  memory 512, compressed memory 128, rate 4; batch 8 x 2,048 tokens.
- sinkhorn: longrange `SinkhornForCausalLM` and sinkhorn-transformer 0.11.4 `SinkhornTransformerLM` (causal, same
  option dict); hidden 512, 6 layers, 8 heads, bucket 128; batch 8 x 2,048, and in bf16 also 2 x 8,192 and
  1 x 32,768.
- llama: transformers' `LlamaForCausalLM` with `attn_implementation="sdpa"`, same width, depth and heads, SwiGLU
  feed-forward of width 8/3 x hidden (rounded to 64: the parameters and FLOPs of the others' 4 x hidden MLP), at
  every (batch, length) above.
Each in `tf32` (fp32 weights, TF32 matrix products; `fp32` on the CPU) and `bf16` (fp32 weights, forward under
`torch.autocast(bfloat16)`, backward outside it), `eager` and `compiled` (`model.compile()`, inductor by default);
ours (also `by_segment`) and Llama also `regional` (Accelerate's regional compilation, static shapes, as `longrange train --compile`:
each decoder layer compiled alone, one graph for all of them); Sinkhorn and Llama in bf16 at 8 x 2,048 also `graphs` (`model.compile(mode="reduce-overhead")`: CUDA graphs replay
each compiled step, no kernel launched from the host; on the CPU the same as compiled). In tf32, eager, both of our
models also as `explicit` (`attn_implementation="eager"`: the attention's products are matrix products, which CUDA
runs in TF32 like the references' einsums; sdpa's fused kernel for fp32 inputs on sm80+ emulates full fp32 with
three TF32 products and ignores `allow_tf32`): whether that is why the tf32 rows trail the references; the
Compressive model also `by_segment_explicit` (explicit attention, trained a segment at a time: the procedure whose
peak memory meets the reference's).

Method: all rows run in this process, one after the other (eager rows first, then compiled rows in priority
order), each with a fresh model, AdamW and `torch._dynamo.reset()`. Per row: `--warmup` steps (the first of a
compiled row includes compilation: reported as `compile_s` = warm-up time - warm-up steps x median step), then
`--steps` timed steps, each between `torch.cuda.synchronize()` calls; tokens/s = batch x length / median step time.
Peak memory on CUDA: `torch.cuda.max_memory_allocated()` over the timed steps (weights, optimizer state,
gradients and activations); on the CPU: the resident-set increase of one extra step (`benchmark_sinkhorn.PeakMeter`).
One more step runs under `torch.profiler`: kernels launched per step on CUDA (device-side events other than
memcpy / memset), ATen operators dispatched on the CPU, and `_local_scalar_dense` calls (scalar reads to the host)
outside the optimizer's step; on CUDA one more under torch's sync debug mode (`sync_sites`: every call that waits
for the device - scalar reads, tensors made from host data on the device).
A row that fails (the reference's bf16 crash, a compile error, out of memory, its time limit) records
`"error": "..."` and the run goes on. The whole run stops starting rows once `--budget` seconds are spent (the rest
are recorded as skipped), and `--out` is rewritten after every row, so an interrupted run keeps what it measured.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.util
import json
import platform
import re
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def _sibling(name: str):
    """A benchmark of this folder as a module, by path: also when this file itself was loaded by path, as the tests
    do."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).resolve().parent / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


benchmark_compressive = _sibling("benchmark_compressive")
benchmark_sinkhorn = _sibling("benchmark_sinkhorn")

# ----------------------------------------------------------------------------------------------------------
# sizes and rows


def sizes(quick: bool) -> dict:
    if quick:
        width = dict(hidden=64, layers=2, heads=4)
        return dict(
            width=width,
            compressive=dict(segment=32, mem=32, c_mem=8, rate=4, shape=(2, 64)),
            sinkhorn=dict(bucket=16, shapes={"tf32": [(2, 64)], "bf16": [(2, 64), (1, 128)]}),
        )
    width = dict(hidden=512, layers=6, heads=8)
    return dict(
        width=width,
        compressive=dict(segment=512, mem=512, c_mem=128, rate=4, shape=(8, 2048)),
        sinkhorn=dict(bucket=128, shapes={"tf32": [(8, 2048)], "bf16": [(8, 2048), (2, 8192), (1, 32768)]}),
    )


@dataclass(frozen=True)
class Row:
    family: str  # compressive | sinkhorn | llama
    # ours | reference | llama | by_segment (Compressive: ours trained one segment at a time) | explicit (ours with
    # attn_implementation="eager": the attention as matrix products, which CUDA runs in TF32 when allowed, where
    # sdpa's fused fp32 kernel emulates full fp32 precision with three TF32 products; tf32 eager rows only) |
    # by_segment_explicit (Compressive: both)
    side: str
    precision: str  # tf32 | bf16
    mode: str  # eager | compiled | regional (each decoder layer compiled alone) | graphs (mode="reduce-overhead")
    batch: int
    length: int

    @property
    def id(self) -> str:
        return f"{self.family}/{self.side}/{self.precision}/{self.mode}/{self.batch}x{self.length}"


MODES = ("eager", "compiled", "regional", "graphs")


def plan(size: dict) -> list[Row]:
    """Every row, eager ones first, then compiled ones: ours and Llama at the first shape first, references last."""
    by_mode = {}
    for mode in ("eager", "compiled"):
        rows = []
        for precision in ("bf16", "tf32"):
            b, n = size["compressive"]["shape"]
            explicit = ("explicit",) if (precision, mode) == ("tf32", "eager") else ()
            sides = ("ours", "reference", "by_segment", *explicit, *(f"by_segment_{e}" for e in explicit))
            rows += [Row("compressive", side, precision, mode, b, n) for side in sides]
            shapes = size["sinkhorn"]["shapes"][precision]
            for b, n in shapes:
                rows += [Row("sinkhorn", side, precision, mode, b, n) for side in ("ours", "reference", *explicit)]
            # Llama at every shape of the others (the Compressive and the first Sinkhorn shape coincide)
            for b, n in dict.fromkeys([size["compressive"]["shape"], *shapes]):
                rows.append(Row("llama", "llama", precision, mode, b, n))
        by_mode[mode] = rows
    first = size["sinkhorn"]["shapes"]["bf16"][0]

    def priority(row: Row) -> tuple:
        # the Compressive model trained a segment at a time and compiled by layer (the row that could meet its speed
        # and memory targets together) with ours; whole-model compilation of it (a graph per memory fill) and the
        # references last
        last = row.side == "reference" or (row.side == "by_segment" and row.mode != "regional")
        return (last, (row.batch, row.length) != first, row.precision != "bf16")

    # CUDA graphs (the compiled step replayed without launching each kernel from the host) for Sinkhorn and Llama
    # in bf16 at the first shape, right after those rows compiled: whether the compiled steps wait on the host
    graphs = [
        Row(family, side, "bf16", "graphs", *first) for family, side in (("sinkhorn", "ours"), ("llama", "llama"))
    ]
    # regional compilation (what `longrange train --compile` does) beside each whole-model compiled row of ours
    # (also the Compressive model trained a segment at a time) and Llama: its first step against the whole model's,
    # and whether its steps are as fast
    regional = [
        replace(row, mode="regional") for row in by_mode["compiled"] if row.side in ("ours", "by_segment", "llama")
    ]
    order = {"compiled": 0, "regional": 1, "graphs": 2}
    compiled = sorted(by_mode["compiled"] + regional + graphs, key=lambda row: (*priority(row), order[row.mode]))
    return by_mode["eager"] + compiled


# ----------------------------------------------------------------------------------------------------------
# building one row's model and training step


def llama_intermediate(hidden: int) -> int:
    """SwiGLU width with the parameters and FLOPs of a 4 x hidden two-matrix MLP: 8/3 x hidden, rounded to 64."""
    return max(64, round(8 * hidden / 3 / 64) * 64)


def compressive_args(size: dict, attn_implementation: str | None = None) -> argparse.Namespace:
    """`benchmark_compressive.build`'s arguments for these sizes."""
    width, c = size["width"], size["compressive"]
    return argparse.Namespace(
        hidden=width["hidden"], layers=width["layers"], heads=width["heads"], segment=c["segment"], mem=c["mem"],
        c_mem=c["c_mem"], rate=c["rate"], reference_gru=False, attn_implementation=attn_implementation,
    )  # fmt: skip


def llama(width: dict, max_positions: int):
    """transformers' Llama (SDPA) of the others' width, depth and heads, with a parameter-matched SwiGLU."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256, hidden_size=width["hidden"], num_hidden_layers=width["layers"],
        num_attention_heads=width["heads"], num_key_value_heads=width["heads"],
        intermediate_size=llama_intermediate(width["hidden"]), max_position_embeddings=max_positions,
        attn_implementation="sdpa",
    )  # fmt: skip
    return LlamaForCausalLM(config)


def build_step(row: Row, size: dict, device: torch.device, compile_kwargs: dict | None):
    """(model, step function, inputs) for one row. The step runs forward (inside autocast for bf16), backward
    (outside it), AdamW and zero_grad, like the CPU benchmarks' steps."""
    width = size["width"]
    torch.manual_seed(0)
    forward_context = contextlib.nullcontext
    if row.precision == "bf16":

        def forward_context():
            return torch.autocast(device.type, dtype=torch.bfloat16)

    ids = torch.randint(0, 256, (row.batch, row.length + 1), generator=torch.Generator().manual_seed(1)).to(device)
    attention = "eager" if row.side.endswith("explicit") else None  # (None: the models' default)
    if row.family == "compressive":
        side = "reference" if row.side == "reference" else "ours"
        ours, reference = benchmark_compressive.build(compressive_args(size, attention), sides=(side,))
        model = (reference if row.side == "reference" else ours).to(device)
        if compile_kwargs is not None:  # the reference's wrapper loops over segments in Python: compile its network
            compile_in_place(model.net if row.side == "reference" else model, row, compile_kwargs)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        inputs = ids[:, : row.length]
        if row.side in ("ours", "explicit"):

            def step():
                benchmark_compressive.train_step_ours(model, optimizer, inputs, forward_context)
        elif row.side.startswith("by_segment"):
            segment = size["compressive"]["segment"]

            def step():
                benchmark_compressive.train_step_ours_by_segment(model, optimizer, inputs, segment, forward_context)
        else:

            def step():  # the wrapper shifts internally: it takes one token more
                benchmark_compressive.train_step_reference(model, optimizer, ids, forward_context)

        return model, step
    inputs = ids[:, : row.length]
    if row.family == "sinkhorn":
        s = size["sinkhorn"]
        opts = dict(
            num_tokens=256, dim=width["hidden"], depth=width["layers"], heads=width["heads"], bucket_size=s["bucket"],
            **benchmark_sinkhorn.COMMON, causal=True, max_seq_len=row.length,
        )  # fmt: skip
        if attention is not None:
            opts["attn_implementation"] = attention
        model, forward = benchmark_sinkhorn.build("ref" if row.side == "reference" else "ours", opts)

        def loss_of():
            return benchmark_sinkhorn.lm_loss(forward(inputs), inputs, True)
    else:
        model = llama(width, row.length)
        if model.config._attn_implementation != "sdpa":
            raise RuntimeError(f"Llama built with attn_implementation={model.config._attn_implementation!r}")

        def loss_of():
            return model(input_ids=inputs, labels=inputs).loss

    model.to(device)
    if compile_kwargs is not None:  # in place: `model(...)`, and so `forward` above, runs the compiled module
        compile_in_place(model, row, compile_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step():
        if row.mode == "graphs":  # a new iteration: the graphs may overwrite the last one's outputs (done with)
            torch.compiler.cudagraph_mark_step_begin()
        with forward_context():
            loss = loss_of()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return model, step


def compile_in_place(model, row: Row, compile_kwargs: dict) -> None:
    """The row's compilation: the whole model as one graph ("compiled", "graphs"), or Accelerate's regional
    compilation ("regional", as `longrange train --compile` asks for it): each block of a list of same-class blocks
    (the decoder layers) compiled alone, so that one graph serves them all, and every other leaf module alone
    (Accelerate's in-place variant, the one it applies under DeepSpeed)."""
    if row.mode == "regional":
        from accelerate.utils.other import compile_regions_deepspeed

        compile_regions_deepspeed(model, **compile_kwargs)
    else:
        model.compile(**compile_kwargs)


# ----------------------------------------------------------------------------------------------------------
# measuring one row


class RowTimeout(Exception):
    pass


@contextlib.contextmanager
def time_limit(seconds: float):
    """Raise RowTimeout in this (main) thread after `seconds` (checked whenever Python code runs)."""

    def expire(signum, frame):
        raise RowTimeout(f"row exceeded its time limit of {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, max(seconds, 1.0))
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def profile_step(step, device: torch.device) -> dict:
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        step()
        sync(device)
    events = prof.events()
    # scalar reads of the model's forward and backward: the optimizer's own reads (AdamW reads each parameter's
    # step count, a CPU tensor unless `capturable`) are the same for every model and not a device sync
    optimizer_spans = [e.time_range for e in events if e.name.startswith("Optimizer.step#")]
    reads = [e for e in events if e.name == "aten::_local_scalar_dense"]
    out = {
        "aten_ops_per_step": sum(e.name.startswith("aten::") and e.device_type == DeviceType.CPU for e in events),
        "scalar_reads_per_step": sum(
            not any(span.start <= e.time_range.start <= span.end for span in optimizer_spans) for e in reads
        ),
        "optimizer_scalar_reads_per_step": len(reads),
    }
    if device.type == "cuda":
        out["kernels_per_step"] = sum(
            e.device_type == DeviceType.CUDA and not e.name.lower().startswith(("memcpy", "memset")) for e in events
        )
        out["sync_sites"] = sync_sites(step)  # scalar reads, and host-to-device copies that wait for the device
    out["busy_s"], out["top_work"] = top_work(events, device)
    return out


def top_work(events, device: torch.device, count: int = 15) -> tuple[float, list[dict]]:
    """Where a profiled step's time goes: (seconds of work in all, the `count` costliest kinds of work). On CUDA the
    kernels by device time (their sum against the step's time says whether the step waits on the host); on the
    CPU the aten operators by their own time."""
    return ranked_work(work_by_kind(events, device), count)


def work_by_kind(events, device: torch.device) -> dict[str, list]:
    """{kernel (CUDA) or aten operator (CPU) name: [calls, microseconds]} of profiler events."""
    from torch.autograd import DeviceType

    totals: dict[str, list] = {}
    for e in events:
        if device.type == "cuda" and e.device_type == DeviceType.CUDA:
            spent = e.time_range.elapsed_us()
        elif device.type != "cuda" and e.device_type == DeviceType.CPU and e.name.startswith("aten::"):
            spent = e.self_cpu_time_total
        else:
            continue
        entry = totals.setdefault(e.name[:120], [0, 0.0])
        entry[0], entry[1] = entry[0] + 1, entry[1] + spent
    return totals


def ranked_work(totals: dict[str, list], count: int = 15) -> tuple[float, list[dict]]:
    """(seconds in all, the `count` costliest entries of `work_by_kind` with their share of the whole)."""
    whole = sum(spent for _, spent in totals.values())
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:count]
    rows = [{"name": name, "calls": calls, "us": round(spent, 1), "share": round(spent / max(whole, 1e-9), 3)}
            for name, (calls, spent) in ranked]  # fmt: skip
    return whole / 1e6, rows


def sync_sites(step) -> list[str]:
    """Where one more step waits for the device (CUDA): torch's sync debug mode warns at every synchronising call;
    each distinct call site is given by its innermost frames in the project's code, so a row's host reads can be
    found from the JSON of a device run."""
    import traceback
    import warnings

    sites: dict[str, int] = {}

    def record(message, category, filename, lineno, file=None, line=None):
        frames = [
            f for f in traceback.extract_stack()[:-1] if "/longrange/" in f.filename or "/benchmarks/" in f.filename
        ]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[::-1][:4]) or f"{filename}:{lineno}"
        key = f"{where}: {str(message).splitlines()[0][:80]}"
        sites[key] = sites.get(key, 0) + 1

    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = record
            step()
            torch.cuda.synchronize()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return [f"{count} x {key}" for key, count in sites.items()]


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(row: Row, size: dict, device: torch.device, args, compile_kwargs: dict | None) -> dict:
    result: dict = {}
    model, step = build_step(row, size, device, compile_kwargs)
    result["parameters"] = sum(p.numel() for p in model.parameters())
    model.train()
    sync(device)
    start = time.perf_counter()
    step()
    sync(device)
    result["first_step_s"] = time.perf_counter() - start
    for _ in range(args.warmup - 1):
        step()
    sync(device)
    warmup_s = time.perf_counter() - start
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for _ in range(args.steps):
        sync(device)
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append(time.perf_counter() - t0)
    median = statistics.median(times)
    result.update(step_s=times, median_step_s=median, tokens_per_s=row.batch * row.length / median)
    if compile_kwargs is not None:
        result["compile_s"] = max(0.0, warmup_s - args.warmup * median)
    if device.type == "cuda":
        result["peak_memory_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
    else:
        with benchmark_sinkhorn.PeakMeter() as meter:
            step()
        result["peak_step_rss_mib"] = meter.peak_mib
    if args.profile:
        result.update(profile_step(step, device))
    return result


def cleanup(device: torch.device) -> None:
    torch._dynamo.reset()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def describe_error(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    first = next((line for line in text if line.strip()), "")
    return f"error: {type(exc).__name__}: {first[:500]}"


# ----------------------------------------------------------------------------------------------------------
# comparisons, table, metadata


def ratios(results: dict[str, dict]) -> dict[str, dict]:
    """For each of our rows: ours / reference and ours / Llama, per mode (same precision, batch and length), and
    the best of either mode over the best of the other's (both when measured)."""

    def rate(row_id):
        r = results.get(row_id, {})
        return r.get("tokens_per_s")

    out = {}
    for row_id, result in results.items():
        row = Row(**result["row"])
        if row.side not in ("ours", "by_segment", "explicit", "by_segment_explicit"):
            continue
        shape = f"{row.batch}x{row.length}"
        entry = {}
        for other, other_side in (("reference", row.family + "/reference"), ("llama", "llama/llama")):
            per_mode = {}
            for mode in MODES:
                a, b = (
                    rate(f"{row.family}/{row.side}/{row.precision}/{mode}/{shape}"),
                    rate(f"{other_side}/{row.precision}/{mode}/{shape}"),
                )
                per_mode[mode] = a / b if a and b else None
            ours_best = [rate(f"{row.family}/{row.side}/{row.precision}/{m}/{shape}") for m in MODES]
            other_best = [rate(f"{other_side}/{row.precision}/{m}/{shape}") for m in MODES]
            ours_best, other_best = [v for v in ours_best if v], [v for v in other_best if v]
            per_mode["best"] = max(ours_best) / max(other_best) if ours_best and other_best else None
            entry[f"speed_vs_{other}"] = per_mode
            ref = results.get(f"{other_side}/{row.precision}/{row.mode}/{shape}", {})
            mine = result.get("peak_memory_gib")
            if other == "reference" and mine and ref.get("peak_memory_gib"):
                entry["memory_vs_reference"] = mine / ref["peak_memory_gib"]
        out[row_id] = entry
    return out


def targets(compared: dict[str, dict], size: dict) -> list[dict]:
    """Issue 9's targets, each from the best of eager / compiled on both sides (None where a side is missing)."""
    c, shapes = size["compressive"]["shape"], size["sinkhorn"]["shapes"]["bf16"]
    compressive = (
        ("tf32", "speed_vs_reference", ">=", 1.3),
        ("bf16", "speed_vs_reference", ">=", 1.3),
        ("tf32", "memory_vs_reference", "<=", 1.0),
    )
    checks = [  # the Compressive ones for our model trained both ways: one backward per batch, one per segment, and
        # by segment with the attention as matrix products (tf32 rows only)
        (f"compressive/{side}", precision, c, key, relation, bound)
        for side in ("ours", "by_segment", "by_segment_explicit")
        for precision, key, relation, bound in compressive
        if precision == "tf32" or side != "by_segment_explicit"
    ]
    checks.append(("sinkhorn/ours", "tf32", size["sinkhorn"]["shapes"]["tf32"][0], "speed_vs_reference", ">=", 1.4))
    checks += [
        ("sinkhorn/ours", "bf16", shape, "speed_vs_llama", ">=", bound) for shape, bound in zip(shapes, (0.8, 1, 1.5))
    ]
    out = []
    for rows, precision, (batch, length), key, relation, bound in checks:
        entry = compared.get(f"{rows}/{precision}/eager/{batch}x{length}", {}).get(key)
        value = entry.get("best") if isinstance(entry, dict) else entry
        met = None if value is None else (value >= bound if relation == ">=" else value <= bound)
        family, side = rows.split("/")
        how = "" if side == "ours" else " " + side.replace("_", " ")
        name = f"{family}{how} {precision} {batch}x{length} {key} {relation} {bound}"
        out.append({"target": name, "value": value, "met": met})
    return out


def fmt(value, spec=",.0f", empty="") -> str:
    return empty if value is None else format(value, spec)


def table(results: dict[str, dict], compared: dict[str, dict], device: torch.device) -> str:
    memory_key, memory_label = (
        ("peak_memory_gib", "peak memory GiB") if device.type == "cuda" else ("peak_step_rss_mib", "step RSS MiB")
    )
    ops_key, ops_label = (
        ("kernels_per_step", "kernels/step") if device.type == "cuda" else ("aten_ops_per_step", "ATen ops/step")
    )
    lines = [
        f"| row | tokens/s | {memory_label} | {ops_label} | scalar reads/step | compile s | ours/reference | "
        "ours/llama | note |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for row_id, r in results.items():
        c = compared.get(row_id, {})
        mode = r["row"]["mode"]
        vs_ref = c.get("speed_vs_reference", {}).get(mode)
        vs_llama = c.get("speed_vs_llama", {}).get(mode)
        note = r.get("error") or r.get("skipped") or ""
        lines.append(
            f"| {row_id} | {fmt(r.get('tokens_per_s'))} | {fmt(r.get(memory_key), '.2f')} | {fmt(r.get(ops_key))} | "
            f"{fmt(r.get('scalar_reads_per_step'))} | {fmt(r.get('compile_s'), '.1f')} | {fmt(vs_ref, '.2f')} | "
            f"{fmt(vs_llama, '.2f')} | {note.replace('|', '/')} |"
        )
    return "\n".join(lines)


def metadata(device: torch.device) -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import transformers

    packages = {}
    for name in ("sinkhorn-transformer", "compressive-transformer-pytorch", "accelerate"):
        try:
            packages[name] = version(name)
        except PackageNotFoundError:
            packages[name] = None
    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
        "device_type": device.type,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "packages": packages,
        "longrange_commit": commit,
        "torch_threads": torch.get_num_threads(),
    }


def parse_args(argv=None) -> tuple[argparse.Namespace, torch.device]:
    """The command line, with every default that depends on --quick and the device filled in."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, 1 warm-up + 2 timed steps; compiled rows "
                        "only for ours and Llama in bf16 at the first shape (a CPU smoke run)")  # fmt: skip
    parser.add_argument("--out", type=Path, default=None, help="JSON to write (default docs/benchmarks/gpu.json; "
                        "none with --quick)")  # fmt: skip
    parser.add_argument("--rows", default=None, help="regular expression: run only the rows whose id it matches")
    parser.add_argument("--warmup", type=int, default=None, help="warm-up steps per row (default 3; quick 1)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps per row (default 10; quick 2)")
    parser.add_argument("--no-profile", dest="profile", action="store_false", help="skip the profiled step")
    parser.add_argument(
        "--compile-backend",
        default=None,
        help="torch.compile backend (default inductor; with --quick on the CPU aot_eager, which traces with "
        "dynamo and AOTAutograd as inductor does but skips its C++ code generation, minutes on a small CPU)",
    )
    parser.add_argument("--fullgraph", action="store_true", help="compile with fullgraph=True (graph breaks fail)")
    parser.add_argument("--no-compiled", dest="compiled", action="store_false", help="eager rows only")
    parser.add_argument("--budget", type=float, default=None, help="seconds after which no row starts (default "
                        "420; quick 600)")  # fmt: skip
    parser.add_argument("--row-timeout", type=float, default=None, help="seconds one row may take (default 150)")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (0: torch's default; "
                        "default 1 with --quick on the CPU, as the CPU benchmarks, else 0)")  # fmt: skip
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch.cuda.is_available() is False")
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    args.steps = args.steps if args.steps is not None else (2 if args.quick else 10)
    if args.warmup < 1 or args.steps < 1:
        raise SystemExit("--warmup and --steps must be at least 1")
    args.budget = args.budget if args.budget is not None else (600.0 if args.quick else 420.0)
    if args.out is None and not args.quick:
        args.out = REPO / "docs" / "benchmarks" / "gpu.json"
    args.row_timeout = args.row_timeout if args.row_timeout is not None else 150.0
    if args.compile_backend is None:
        args.compile_backend = "aot_eager" if args.quick and device.type == "cpu" else "inductor"
    if args.threads is None:
        args.threads = 1 if args.quick and device.type == "cpu" else 0
    return args, device


def main(argv=None) -> dict:
    args, device = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # tf32 rows; bf16 rows' fp32 products too
        torch.backends.cudnn.allow_tf32 = True
    compiled = {"backend": args.compile_backend, "fullgraph": args.fullgraph}
    graphs = {**compiled, "mode": "reduce-overhead"} if args.compile_backend == "inductor" else compiled  # (CUDA)
    # regional: static shapes, as `longrange train --compile` (longrange.commands.train_run.dynamo_plugin)
    compile_kwargs = {"compiled": compiled, "regional": {**compiled, "dynamic": False}, "graphs": graphs}

    size = sizes(args.quick)
    rows = [r for r in plan(size) if args.compiled or r.mode == "eager"]
    if args.quick and not args.rows:  # a smoke run: compile only ours and Llama, bf16, at the first shape
        first = size["compressive"]["shape"]
        rows = [r for r in rows if r.mode == "eager" or (r.side != "reference" and r.precision == "bf16" and
                                                          (r.batch, r.length) == first)]  # fmt: skip
    if args.rows:
        rows = [r for r in rows if re.search(args.rows, r.id)]
    meta = metadata(device)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    results: dict[str, dict] = {}
    started = time.perf_counter()

    def write(final: bool) -> dict:
        compared = ratios(results)
        payload = {
            **meta,
            "settings": settings,
            "sizes": size,
            "llama_intermediate_size": llama_intermediate(size["width"]["hidden"]),
            "precision_names": {
                "tf32": "fp32 weights, TF32 products on CUDA (plain fp32 on the CPU)",
                "bf16": "fp32 weights, forward under torch.autocast(bfloat16)",
            },  # fmt: skip
            "complete": final,
            "elapsed_s": time.perf_counter() - started,
            "rows": results,
            "ratios": compared,
            "targets": targets(compared, size),
        }
        if args.out:
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps(payload, indent=1) + "\n")
        return payload

    print(f"{meta['device']} | torch {meta['torch']} | transformers {meta['transformers']} | {len(rows)} rows, "
          f"budget {args.budget:.0f} s", file=sys.stderr, flush=True)  # fmt: skip
    for row in rows:
        entry: dict = {"row": asdict(row)}
        elapsed = time.perf_counter() - started
        if elapsed >= args.budget:
            entry["skipped"] = f"skipped: time budget of {args.budget:.0f} s spent"
        else:
            limit = min(args.row_timeout, args.budget - elapsed + 30)
            t0 = time.perf_counter()
            try:
                with time_limit(limit):
                    entry.update(measure(row, size, device, args, compile_kwargs.get(row.mode)))
            except Exception as exc:  # noqa: BLE001 - a row's failure is a result, recorded in the row
                entry["error"] = describe_error(exc)
            entry["row_s"] = time.perf_counter() - t0
            cleanup(device)
        results[row.id] = entry
        status = entry.get("error") or entry.get("skipped") or f"{entry['tokens_per_s']:,.0f} tokens/s"
        print(f"[{time.perf_counter() - started:5.0f} s] {row.id}: {status}", file=sys.stderr, flush=True)
        write(final=False)
    payload = write(final=True)
    print(f"\n{meta['device']}; torch {meta['torch']}, transformers {meta['transformers']}; "
          f"{args.warmup} warm-up + {args.steps} timed steps per row; compiled: backend {args.compile_backend}, "
          f"fullgraph={args.fullgraph}\n")  # fmt: skip
    print(table(results, payload["ratios"], device))
    print("\n| target (issue 9; best of eager / compiled) | value | met |\n|---|---:|---|")
    for t in payload["targets"]:
        print(f"| {t['target']} | {fmt(t['value'], '.2f', 'n/a')} | {t['met']} |")
    if args.out:
        print(f"\nwrote {args.out}")
    return payload


if __name__ == "__main__":
    main()
