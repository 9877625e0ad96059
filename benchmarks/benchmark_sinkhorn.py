"""Side-by-side benchmark: longrange's Sinkhorn Transformer against sinkhorn-transformer 0.11.4.

Comparisons (issue 3, "Performance"):

1. Training step (causal LM): tokens/s and peak training memory of `longrange.SinkhornForCausalLM` and the
   reference `SinkhornTransformerLM`, built from the SAME option dict (seed option names, which our
   `SinkhornConfig` accepts as aliases; every option the reference defaults differently from ours, such as
   `n_top_buckets=2` and `non_permutative=True` of `SinkhornTransformerLM`, is spelled out). Full size: hidden
   512, 6 layers, 8 heads, bucket 128, length 2,048, batch 2, AdamW. Both sides compute the loss the same way in
   this script (cross-entropy of the logits at t against the token at t + 1).
2. Generation at a 1,024-token context (batch 1, same ~19M-parameter model): ours with its cache through
   `generate()` against the reference `AutoregressiveWrapper.generate`, which re-runs the whole 1,024-token window
   for each new token. Ours is timed per token with a streamer (a timestamp per emitted token); "decode tokens/s"
   is 1 / median per-token time after the first token, "end-to-end tokens/s" also counts the prompt's forward
   pass. Then our median per-token time at a 4,096-token context against a 512-token context (one model whose
   positions cover both).
3. Non-causal with SortCut (`n_sortcut=2`, batch 1): peak training-step memory at 16,384 tokens against 2,048
   tokens, ours and the reference (which is given for context).
4. Memory savers (ours only, case `savers`): the training step of 1. with `reversible=True`, and with
   `reversible=True, ff_chunks=8`: tokens/s and peak memory against the plain residual stack.

Method.
- Every measurement runs in a FRESH subprocess (this script re-invoked with `--worker`), so one case's memory
  cannot leak into another's, and the repetitions of ours and the reference are INTERLEAVED (ours, ref, ours,
  ref, ...) because the CPU is shared with other jobs: drifting load then hits both sides alike. The tables
  report medians over all timed steps of all repetitions, and the ratio ours / reference.
- Peak memory (CPU): after model, optimizer and inputs exist and one warm-up step has run (which allocates the
  optimizer state), the worker frees the gradients, runs `gc.collect()` and glibc's `malloc_trim(0)` (so memory
  cached by the allocator is returned and a later reuse shows up as resident again), reads the resident set
  size (VmRSS) as the baseline, resets the kernel's peak-RSS counter (writing "5" to /proc/self/clear_refs) and
  runs one more full training step; peak memory = VmHWM (peak RSS since the reset) - baseline. It therefore
  counts activations, gradients and temporaries of one step, not weights, optimizer state or inputs. Where
  /proc/self/clear_refs cannot be written, a thread samples VmRSS every millisecond instead (the JSON says
  which method was used).
- Timing: wall-clock `time.perf_counter()` around forward + loss + backward + optimizer step (training) and per
  generated token (generation). The CPU time the process received (`time.process_time()`) is reported beside it
  ("tokens per CPU-second"): with one thread it is the work done, much less sensitive to other jobs' load.
- Threads: both sides run with the same torch thread count, `--threads` (default 1). On a 2-core machine shared
  with other jobs, two OpenMP threads per process make every parallel op wait for a descheduled partner: we
  measured one of our cached generation steps at 187 ms with 2 threads against 40 ms with 1, and our
  1,024-token prefill at 11.1 s against 1.8 s. `--threads 0` keeps torch's default (use it on an idle machine).

Usage:
    python benchmarks/benchmark_sinkhorn.py --quick            # tiny sizes, about a minute: smoke test / CI
    python benchmarks/benchmark_sinkhorn.py --out bench.json   # full sizes of the issue (long: tens of minutes)
    python benchmarks/benchmark_sinkhorn.py --cases train,generate --reps 3 --memory-reps 1
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# ----------------------------------------------------------------------------------------------------------
# sizes


def sizes(quick: bool) -> dict:
    if quick:
        model = dict(num_tokens=256, dim=64, depth=2, heads=4, bucket_size=16)
        return dict(
            train=dict(model=model, length=128, batch=2, steps=2),
            generate=dict(model=model, context=64, new_tokens=8, ref_new_tokens=4, short=32, long=128),
            sortcut=dict(model=model, short=128, long=1024, batch=1, n_sortcut=2),
        )
    model = dict(num_tokens=256, dim=512, depth=6, heads=8, bucket_size=128)
    return dict(
        train=dict(model=model, length=2048, batch=2, steps=2),
        generate=dict(model=model, context=1024, new_tokens=32, ref_new_tokens=4, short=512, long=4096),
        sortcut=dict(model=model, short=2048, long=16384, batch=1, n_sortcut=2),
    )


# options in which SinkhornTransformerLM's defaults could differ from ours: always passed explicitly, to both
COMMON = dict(
    n_top_buckets=2,
    non_permutative=True,
    sinkhorn_iter=5,
    temperature=0.75,
    ff_chunks=1,
    ff_glu=False,
    reversible=False,
    weight_tie=False,
    n_local_attn_heads=0,
    emb_dropout=0.0,
    ff_dropout=0.0,
    attn_dropout=0.0,
    attn_layer_dropout=0.0,
    layer_dropout=0.0,
)

# ----------------------------------------------------------------------------------------------------------
# worker side: build one model, measure one case, print one JSON line


def build(impl: str, opts: dict, for_mlm: bool = False):
    import torch

    torch.manual_seed(0)
    if impl == "ref":
        from sinkhorn_transformer import SinkhornTransformerLM

        model = SinkhornTransformerLM(**opts)
        forward = model  # ids -> logits
    else:
        sys.path.insert(0, str(REPO))
        from longrange import SinkhornConfig, SinkhornForCausalLM, SinkhornForMaskedLM

        config = SinkhornConfig(**opts)
        cls = SinkhornForMaskedLM if for_mlm else SinkhornForCausalLM
        model = cls(config)
        # training: no generation cache (the reference has none; a causal model would otherwise fill one)
        extra = {} if for_mlm else {"use_cache": False}

        def forward(ids):
            return model(input_ids=ids, **extra).logits

    return model, forward


def lm_loss(logits, ids, causal: bool):
    """The loss both sides are trained on: next-token (causal) or same-token cross-entropy of [batch, seq, vocab]."""
    import torch.nn.functional as F

    if causal:
        return F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten())
    return F.cross_entropy(logits.flatten(0, 1), ids.flatten())


def rss_kib(field: str = "VmRSS") -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


class PeakMeter:
    """Peak resident memory increase over a baseline; see the module docstring."""

    def __enter__(self):
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except OSError:
            pass
        self.baseline = rss_kib()
        try:
            with open("/proc/self/clear_refs", "w") as refs:
                refs.write("5")
            self.method = "VmHWM after clear_refs"
            self.thread = None
        except OSError:
            self.method = "VmRSS sampled every 1 ms"
            self.sampled, self.stop = self.baseline, False
            self.thread = threading.Thread(target=self._sample, daemon=True)
            self.thread.start()
        return self

    def _sample(self):
        while not self.stop:
            self.sampled = max(self.sampled, rss_kib())
            time.sleep(0.001)

    def __exit__(self, *exc):
        if self.thread is None:
            peak = rss_kib("VmHWM")
        else:
            self.stop = True
            self.thread.join()
            peak = max(self.sampled, rss_kib())
        self.peak_mib = (peak - self.baseline) / 1024
        return False


def worker_train(spec: dict) -> dict:
    import torch

    causal = spec["opts"]["causal"]
    model, forward = build(spec["impl"], spec["opts"], for_mlm=not causal)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, spec["opts"]["num_tokens"], (spec["batch"], spec["length"]), generator=gen)

    def step():
        loss = lm_loss(forward(ids), ids, causal)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    step()  # warm-up: allocates the optimizer state, first-call overheads
    times, cpu_times = [], []
    for _ in range(spec["steps"]):
        start, cpu_start = time.perf_counter(), time.process_time()
        step()
        times.append(time.perf_counter() - start)
        cpu_times.append(time.process_time() - cpu_start)
    with PeakMeter() as meter:
        step()
    return dict(
        step_s=times,
        tokens_per_s=[spec["batch"] * spec["length"] / t for t in times],
        cpu_tokens_per_s=[spec["batch"] * spec["length"] / t for t in cpu_times],
        peak_mib=meter.peak_mib,
        memory_method=meter.method,
        params=sum(p.numel() for p in model.parameters()),
    )


def worker_generate_ref(spec: dict) -> dict:
    import torch
    from sinkhorn_transformer.autoregressive_wrapper import AutoregressiveWrapper

    model, _ = build("ref", spec["opts"])
    wrapper = AutoregressiveWrapper(model).eval()
    prompt = torch.randint(  # from 1, as ours: 0 is the pad id our generate() is given
        1, spec["opts"]["num_tokens"], (1, spec["context"]), generator=torch.Generator().manual_seed(1)
    )
    wrapper.generate(prompt, 1)  # warm-up
    start, cpu_start = time.perf_counter(), time.process_time()
    wrapper.generate(prompt, spec["new_tokens"])
    elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
    return dict(
        total_s=elapsed,
        tokens_per_s=spec["new_tokens"] / elapsed,
        cpu_tokens_per_s=spec["new_tokens"] / cpu,
        params=sum(p.numel() for p in model.parameters()),
    )


def worker_generate_ours(spec: dict) -> dict:
    import torch
    from transformers.generation.streamers import BaseStreamer

    class Stamps(BaseStreamer):
        """Records the wall and CPU time of every put(): first the prompt, then each generated token."""

        def __init__(self):
            self.stamps, self.cpu_stamps = [], []

        def put(self, value):
            self.stamps.append(time.perf_counter())
            self.cpu_stamps.append(time.process_time())

        def end(self):
            pass

    model, _ = build("ours", spec["opts"])
    model.eval()
    out = {"params": sum(p.numel() for p in model.parameters())}
    for context in spec["contexts"]:
        # from 1: generate() reads a 0 (pad_token_id below) in the prompt as padding
        prompt = torch.randint(1, spec["opts"]["num_tokens"], (1, context), generator=torch.Generator().manual_seed(1))
        kwargs = dict(do_sample=False, use_cache=True, pad_token_id=0, eos_token_id=None)
        model.generate(prompt, max_new_tokens=2, min_new_tokens=2, **kwargs)  # warm-up
        stamps = Stamps()
        start, cpu_start = time.perf_counter(), time.process_time()
        generated = model.generate(
            prompt, max_new_tokens=spec["new_tokens"], min_new_tokens=spec["new_tokens"], streamer=stamps, **kwargs
        )
        total, cpu_total = time.perf_counter() - start, time.process_time() - cpu_start
        assert generated.shape[1] == context + spec["new_tokens"], generated.shape
        # stamps[0]: prompt handed over; stamps[1]: first token (prompt forward); then one stamp per cached step
        per_token = [b - a for a, b in zip(stamps.stamps[1:], stamps.stamps[2:])]
        per_token_cpu = [b - a for a, b in zip(stamps.cpu_stamps[1:], stamps.cpu_stamps[2:])]
        out[str(context)] = dict(
            per_token_cpu_s=per_token_cpu,
            decode_cpu_tokens_per_s=1 / statistics.median(per_token_cpu),
            end_to_end_cpu_tokens_per_s=spec["new_tokens"] / cpu_total,
            total_s=total,
            prefill_s=stamps.stamps[1] - start,
            per_token_s=per_token,
            decode_tokens_per_s=1 / statistics.median(per_token),
            end_to_end_tokens_per_s=spec["new_tokens"] / total,
        )
    return out


def worker(spec: dict) -> dict:
    import torch

    if spec.get("threads", 0) > 0:
        torch.set_num_threads(spec["threads"])
    result = {"threads": torch.get_num_threads()}
    if spec["case"] == "train":
        result.update(worker_train(spec))
    elif spec["case"] == "generate" and spec["impl"] == "ref":
        result.update(worker_generate_ref(spec))
    elif spec["case"] == "generate":
        result.update(worker_generate_ours(spec))
    else:
        raise ValueError(f"unknown case {spec['case']!r}")
    return result


# ----------------------------------------------------------------------------------------------------------
# driver side: jobs, interleaving, tables


def run_job(spec: dict, timeout: float) -> dict:
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    if spec.get("threads", 0) > 0:
        env["OMP_NUM_THREADS"] = str(spec["threads"])
    proc = subprocess.run(
        [sys.executable, __file__, "--worker", json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        tail = (proc.stderr or proc.stdout)[-3000:]
        return {"error": f"worker failed (rc={proc.returncode}): {tail}"}
    return json.loads(lines[-1][len("RESULT ") :])


def jobs_for(cases: list[str], size: dict) -> list[tuple[str, dict]]:
    """(label, worker spec) for one repetition; ours and the reference alternate."""
    jobs = []
    if "train" in cases:
        s = size["train"]
        length = s["length"]
        opts = dict(size["train"]["model"], **COMMON, causal=True, max_seq_len=length)
        for impl in ("ours", "ref"):
            jobs.append(
                (
                    f"train/{impl}",
                    dict(case="train", impl=impl, opts=opts, length=length, batch=s["batch"], steps=s["steps"]),
                )
            )
    if "savers" in cases:
        # ours only, same training step with the memory savers on: what they buy and what they cost
        s = size["train"]
        length = s["length"]
        for name, extra in (
            ("reversible", dict(reversible=True)),
            ("reversible+ff_chunks", dict(reversible=True, ff_chunks=8)),
        ):
            opts = dict(size["train"]["model"], **dict(COMMON, **extra), causal=True, max_seq_len=length)
            spec = dict(case="train", impl="ours", opts=opts, length=length, batch=s["batch"], steps=1)
            jobs.append((f"savers/{name}", spec))
    if "generate" in cases:
        s = size["generate"]
        bucket = s["model"]["bucket_size"]
        ref_opts = dict(s["model"], **COMMON, causal=True, max_seq_len=s["context"])
        # ours: one model whose positions cover the longest context plus the generated tokens
        longest = max(s["context"], s["long"]) + s["new_tokens"]
        ours_opts = dict(s["model"], **COMMON, causal=True, max_seq_len=-(-longest // bucket) * bucket)
        contexts = sorted({s["context"], s["short"], s["long"]})
        jobs.append(
            (
                "generate/ours",
                dict(case="generate", impl="ours", opts=ours_opts, contexts=contexts, new_tokens=s["new_tokens"]),
            )
        )
        jobs.append(
            (
                "generate/ref",
                dict(case="generate", impl="ref", opts=ref_opts, context=s["context"], new_tokens=s["ref_new_tokens"]),
            )
        )
    if "sortcut" in cases:
        s = size["sortcut"]
        for length in (s["short"], s["long"]):
            opts = dict(s["model"], **COMMON, causal=False, n_sortcut=s["n_sortcut"], max_seq_len=length)
            for impl in ("ours", "ref"):
                spec = dict(case="train", impl=impl, opts=opts, length=length, batch=s["batch"], steps=0)
                jobs.append((f"sortcut{length}/{impl}", spec))
    return jobs


def median_of(results: list[dict], key: str) -> float | None:
    values = []
    for r in results:
        if "error" in r:
            continue
        value = r[key]
        values.extend(value if isinstance(value, list) else [value])
    return statistics.median(values) if values else None


def fmt(value, digits=1):
    if value is None:
        return "n/a"
    return f"{value:,.{digits}f}"


def fmt_x(value, digits=2):
    return "n/a" if value is None else f"{value:,.{digits}f}x"


def ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def tables(results: dict[str, list[dict]], size: dict) -> tuple[str, dict]:
    lines, summary = [], {}
    if "train/ours" in results:
        s = size["train"]
        m = s["model"]
        ours_tps, ref_tps = (
            median_of(results["train/ours"], "tokens_per_s"),
            median_of(results["train/ref"], "tokens_per_s"),
        )
        ours_mem, ref_mem = median_of(results["train/ours"], "peak_mib"), median_of(results["train/ref"], "peak_mib")
        ours_cpu, ref_cpu = (
            median_of(results["train/ours"], "cpu_tokens_per_s"),
            median_of(results["train/ref"], "cpu_tokens_per_s"),
        )
        summary["train"] = dict(
            ours_tokens_per_s=ours_tps,
            ref_tokens_per_s=ref_tps,
            speed_ratio=ratio(ours_tps, ref_tps),
            ours_tokens_per_cpu_s=ours_cpu,
            ref_tokens_per_cpu_s=ref_cpu,
            cpu_speed_ratio=ratio(ours_cpu, ref_cpu),
            ours_peak_mib=ours_mem,
            ref_peak_mib=ref_mem,
            memory_ratio=ratio(ours_mem, ref_mem),
        )
        lines += [
            f"### Training step (causal; hidden {m['dim']}, {m['depth']} layers, {m['heads']} heads, bucket "
            f"{m['bucket_size']}, length {s['length']}, batch {s['batch']}, AdamW)",
            "",
            "| | longrange | sinkhorn-transformer 0.11.4 | ours / reference | target |",
            "|---|---:|---:|---:|---|",
            f"| tokens/s (median) | {fmt(ours_tps)} | {fmt(ref_tps)} | {fmt_x(ratio(ours_tps, ref_tps), 2)} | >= 1.4x |",
            f"| tokens per CPU-second (median) | {fmt(ours_cpu)} | {fmt(ref_cpu)} | {fmt_x(ratio(ours_cpu, ref_cpu), 2)} | |",
            f"| peak step memory, MiB (median) | {fmt(ours_mem)} | {fmt(ref_mem)} | {fmt_x(ratio(ours_mem, ref_mem), 2)} | <= 1.0x |",
            f"| parameters | {fmt(median_of(results['train/ours'], 'params'), 0)} | "
            f"{fmt(median_of(results['train/ref'], 'params'), 0)} | | |",
            "",
        ]
    saver_keys = [k for k in results if k.startswith("savers/")]
    if saver_keys and "train/ours" in results:
        base_tps, base_mem = (
            median_of(results["train/ours"], "tokens_per_s"),
            median_of(results["train/ours"], "peak_mib"),
        )
        summary["savers"] = {}
        lines += [
            "### Memory savers (longrange, same training step)",
            "",
            "| | tokens/s | peak step memory, MiB | memory vs plain |",
            "|---|---:|---:|---:|",
            f"| plain residual stack | {fmt(base_tps)} | {fmt(base_mem)} | 1.00x |",
        ]
        for key in saver_keys:
            tps, mem = median_of(results[key], "tokens_per_s"), median_of(results[key], "peak_mib")
            summary["savers"][key.split("/", 1)[1]] = dict(tokens_per_s=tps, peak_mib=mem)
            lines.append(f"| {key.split('/', 1)[1]} | {fmt(tps)} | {fmt(mem)} | {fmt_x(ratio(mem, base_mem))} |")
        lines.append("")
    if "generate/ours" in results:
        s = size["generate"]
        ours = [r for r in results["generate/ours"] if "error" not in r]
        c, short, long = str(s["context"]), str(s["short"]), str(s["long"])

        def per_context(context, key):
            values = []
            for r in ours:
                entry = r[context][key]
                values.extend(entry if isinstance(entry, list) else [entry])
            return statistics.median(values) if values else None

        decode = per_context(c, "decode_tokens_per_s") if ours else None
        e2e = per_context(c, "end_to_end_tokens_per_s") if ours else None
        ref_tps = median_of(results["generate/ref"], "tokens_per_s")
        decode_cpu = per_context(c, "decode_cpu_tokens_per_s") if ours else None
        ref_cpu = median_of(results["generate/ref"], "cpu_tokens_per_s")
        t_short = per_context(short, "per_token_s") if ours else None
        t_long = per_context(long, "per_token_s") if ours else None
        summary["generate"] = dict(
            ours_decode_tokens_per_s=decode,
            ours_end_to_end_tokens_per_s=e2e,
            ref_tokens_per_s=ref_tps,
            decode_speedup=ratio(decode, ref_tps),
            end_to_end_speedup=ratio(e2e, ref_tps),
            ours_decode_tokens_per_cpu_s=decode_cpu,
            ref_tokens_per_cpu_s=ref_cpu,
            decode_cpu_speedup=ratio(decode_cpu, ref_cpu),
            per_token_s_short=t_short,
            per_token_s_long=t_long,
            long_over_short=ratio(t_long, t_short),
        )
        lines += [
            f"### Generation, batch 1, {s['context']}-token context ({fmt(median_of(results['generate/ref'], 'params'), 0)}"
            f"-parameter reference; ours {s['new_tokens']} new tokens with cache, reference {s['ref_new_tokens']} with "
            "`AutoregressiveWrapper.generate`)",
            "",
            "| | tokens/s | ours / reference | target |",
            "|---|---:|---:|---|",
            f"| longrange, cached decode (1 / median per-token time) | {fmt(decode, 2)} | {fmt_x(ratio(decode, ref_tps), 1)} | >= 50x |",
            f"| longrange, end to end incl. the prompt's forward | {fmt(e2e, 2)} | {fmt_x(ratio(e2e, ref_tps), 1)} | |",
            f"| sinkhorn-transformer 0.11.4 | {fmt(ref_tps, 2)} | 1x | |",
            f"| longrange, cached decode, tokens per CPU-second | {fmt(decode_cpu, 2)} | {fmt_x(ratio(decode_cpu, ref_cpu), 1)} | |",
            f"| sinkhorn-transformer 0.11.4, tokens per CPU-second | {fmt(ref_cpu, 2)} | 1x | |",
            "",
            "| longrange per-token time | ms (median) |",
            "|---|---:|",
            f"| context {s['short']} | {fmt(None if t_short is None else 1000 * t_short, 2)} |",
            f"| context {s['long']} | {fmt(None if t_long is None else 1000 * t_long, 2)} |",
            f"| ratio {s['long']} / {s['short']} (target <= 1.5) | {fmt(ratio(t_long, t_short), 2)} |",
            "",
        ]
    sortcut_keys = [k for k in results if k.startswith("sortcut")]
    if sortcut_keys:
        s = size["sortcut"]
        m = s["model"]
        mem = {k: median_of(results[k], "peak_mib") for k in sortcut_keys}
        short, long = s["short"], s["long"]
        row = {}
        for impl in ("ours", "ref"):
            a, b = mem.get(f"sortcut{short}/{impl}"), mem.get(f"sortcut{long}/{impl}")
            row[impl] = (a, b, ratio(b, a))
        summary["sortcut"] = {
            impl: dict(short_peak_mib=a, long_peak_mib=b, growth=g) for impl, (a, b, g) in row.items()
        }
        lines += [
            f"### Non-causal with SortCut (n_sortcut {s['n_sortcut']}; hidden {m['dim']}, {m['depth']} layers, bucket "
            f"{m['bucket_size']}, batch {s['batch']}): peak training-step memory",
            "",
            f"| | {short} tokens, MiB | {long} tokens, MiB | growth ({long // short}x tokens; target <= 9x) |",
            "|---|---:|---:|---:|",
            f"| longrange | {fmt(row['ours'][0])} | {fmt(row['ours'][1])} | {fmt_x(row['ours'][2], 2)} |",
            f"| sinkhorn-transformer 0.11.4 | {fmt(row['ref'][0])} | {fmt(row['ref'][1])} | {fmt_x(row['ref'][2], 2)} |",
            "",
        ]
    errors = {k: r["error"] for k, rs in results.items() for r in rs if "error" in r}
    if errors:
        lines += ["### Errors", ""] + [
            f"- {k}: {e.strip().splitlines()[-1] if e.strip() else e}" for k, e in errors.items()
        ]
    return "\n".join(lines), summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--reps", type=int, default=None, help="interleaved repetitions (default: 1 quick, 2 full)")
    parser.add_argument(
        "--cases", default="train,savers,generate,sortcut", help="comma-separated: train,savers,generate,sortcut"
    )
    parser.add_argument("--out", type=Path, default=None, help="write all raw results and the summary as JSON")
    parser.add_argument(
        "--memory-reps", type=int, default=1, help="repetitions of the memory-oriented cases (savers, sortcut)"
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads for both sides (0: torch default)")
    parser.add_argument("--timeout", type=float, default=1800, help="seconds allowed for one worker")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker is not None:
        print("RESULT " + json.dumps(worker(json.loads(args.worker))), flush=True)
        return

    size = sizes(args.quick)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    reps = args.reps if args.reps is not None else (1 if args.quick else 2)
    results: dict[str, list[dict]] = {}
    started = time.time()
    for rep in range(reps):
        # the memory-oriented cases are not compared for speed: they need fewer repetitions
        rep_cases = [c for c in cases if c not in ("savers", "sortcut") or rep < args.memory_reps]
        for label, spec in jobs_for(rep_cases, size):
            spec["threads"] = args.threads
            t0 = time.time()
            result = run_job(spec, args.timeout)
            results.setdefault(label, []).append(result)
            status = "error" if "error" in result else "ok"
            print(f"[rep {rep + 1}/{reps}] {label}: {status} ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
    table, summary = tables(results, size)
    print(table)
    print(
        f"\n(total {time.time() - started:.0f} s, {reps} interleaved repetition(s), quick={args.quick}, "
        f"threads={args.threads or 'torch default'})"
    )
    if args.out is not None:
        payload = dict(
            quick=args.quick,
            reps=reps,
            threads=args.threads,
            sizes=size,
            common_options=COMMON,
            summary=summary,
            raw=results,
        )
        args.out.write_text(json.dumps(payload, indent=1))


if __name__ == "__main__":
    main()
