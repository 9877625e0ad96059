"""Side-by-side speed of longrange's Compressive Transformer and compressive-transformer-pytorch 0.4.0.

Same width, depth, heads, segment/memory/compressed-memory lengths and compression rate for both; repetitions of
the two models are interleaved so that both see the same (shared) CPU load. Prints a markdown table with the
ratios and writes the figures as JSON.

    python scripts/benchmark_compressive.py            # the issue's size: hidden 512, 6 layers, 8 heads,
                                                       # segment 512, memory 512, compressed memory 128, rate 4
    python scripts/benchmark_compressive.py --quick    # a CI-sized smoke run

Training: tokens/s of forward + backward + AdamW step over windows of `--segments` segments (ours: one forward
that segments internally; reference: its AutoregressiveWrapper, one backward per segment as in its README).
Generation: decoding tokens/s, measured as (N - 1) / (time(generate N) - time(generate 1)) so the prompt's
prefill cancels out. The prompt is 1.5 segments long, so the N decoded tokens sit in the middle of a segment,
the average position of a decoding step in the reference (which re-runs the unfinished segment every token).
Both wall-clock and process-CPU rates are reported; on a shared machine the CPU-time ratio is the steadier one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

try:
    import longrange  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def import_reference():
    """compressive-transformer-pytorch 0.4.0 imports `mogrifier` at module level, which is not installed here and
    only used when `mogrify_gru=True`. A stub module lets the package import; the stub raises if ever used."""
    if "mogrifier" not in sys.modules:
        try:
            import mogrifier  # noqa: F401
        except ImportError:
            stub = types.ModuleType("mogrifier")

            class Mogrifier:  # pragma: no cover - only reached with mogrify_gru=True, which we never set
                def __init__(self, *args, **kwargs):
                    raise RuntimeError("mogrifier is not installed")

            stub.Mogrifier = Mogrifier
            sys.modules["mogrifier"] = stub
    from compressive_transformer_pytorch import CompressiveTransformer
    from compressive_transformer_pytorch.autoregressive_wrapper import AutoregressiveWrapper

    return CompressiveTransformer, AutoregressiveWrapper


def build(args):
    from longrange import CompressiveConfig, CompressiveForCausalLM

    CompressiveTransformer, AutoregressiveWrapper = import_reference()
    config = CompressiveConfig(
        vocab_size=256,
        hidden_size=args.hidden,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        intermediate_size=4 * args.hidden,
        segment_length=args.segment,
        mem_len=args.mem,
        c_mem_len=args.c_mem,
        compression_rate=args.rate,
    )
    ours = CompressiveForCausalLM(config)
    reference = AutoregressiveWrapper(
        CompressiveTransformer(
            num_tokens=256,
            dim=args.hidden,
            seq_len=args.segment,
            depth=args.layers,
            heads=args.heads,
            mem_len=args.mem,
            cmem_len=args.c_mem,
            cmem_ratio=args.rate,
            gru_gated_residual=args.reference_gru,
        )
    )
    return ours, reference


def train_step_ours(model, optimizer, batch):
    out = model(batch, labels=batch)
    out.loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def train_step_reference(wrapper, optimizer, batch):
    # the wrapper shifts internally (input x[:, :-1], target x[:, 1:]): give it one more token
    for loss, aux_loss, _ in wrapper(batch, return_loss=True):
        (loss + aux_loss).backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def timed(fn) -> tuple[float, float]:
    """(wall seconds, process CPU seconds): on a shared machine the CPU time is the steadier of the two."""
    wall, cpu = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - wall, time.process_time() - cpu


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny sizes for CI")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--layers", type=int, default=6)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--segment", type=int, default=512)
    parser.add_argument("--mem", type=int, default=512)
    parser.add_argument("--c-mem", dest="c_mem", type=int, default=128)
    parser.add_argument("--rate", type=int, default=4)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--segments", type=int, default=2, help="segments per training window")
    parser.add_argument("--new-tokens", type=int, default=16, help="decoded tokens per generation measurement")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--reference-gru", action="store_true", help="keep the reference's GRU-gated residuals")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch intra-op threads for both models (default 1: on a shared, oversubscribed CPU, OpenMP threads "
        "spin-wait on each other and dominate the timings; 0 = torch's default)",
    )
    parser.add_argument("--json", default="benchmark_compressive.json")
    args = parser.parse_args(argv)
    if args.quick:
        args.hidden, args.layers, args.heads = 64, 2, 4
        args.segment, args.mem, args.c_mem, args.rate = 32, 32, 8, 4
        args.batch, args.segments, args.new_tokens, args.repeats = 2, 2, 8, 1

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    ours, reference = build(args)
    window = args.segment * args.segments
    batch = torch.randint(0, 256, (args.batch, window + 1))
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-4)

    # training: one warm-up step each, then interleaved timed repetitions
    ours.train()
    reference.train()
    train_step_ours(ours, opt_ours, batch[:, :window])
    train_step_reference(reference, opt_ref, batch)
    train_times = {"ours": [], "reference": []}
    for _ in range(args.repeats):
        train_times["ours"].append(timed(lambda: train_step_ours(ours, opt_ours, batch[:, :window])))
        train_times["reference"].append(timed(lambda: train_step_reference(reference, opt_ref, batch)))

    # generation: batch 1, prompt 1.5 segments
    ours.eval()
    reference.eval()
    prompt = torch.randint(0, 256, (1, args.segment + args.segment // 2))
    n = args.new_tokens

    def gen_ours(count):
        with torch.no_grad():
            ours.generate(prompt, max_new_tokens=count, min_new_tokens=count, do_sample=False)

    def gen_reference(count):
        with torch.no_grad():
            reference.generate(prompt, count)

    gen_ours(2)  # warm-up
    gen_times = {"ours": [], "reference": []}
    for _ in range(args.repeats):
        for name, fn in (("ours", gen_ours), ("reference", gen_reference)):
            t_one = timed(lambda fn=fn: fn(1))
            t_n = timed(lambda fn=fn: fn(n))
            gen_times[name].append(tuple(max(b - a, 1e-9) for a, b in zip(t_one, t_n)))

    def rates(times, tokens, clock):  # clock 0: wall, 1: CPU
        return {k: tokens / statistics.median(t[clock] for t in v) for k, v in times.items()}

    train_tps, train_cpu = rates(train_times, args.batch * window, 0), rates(train_times, args.batch * window, 1)
    gen_tps, gen_cpu = rates(gen_times, n - 1, 0), rates(gen_times, n - 1, 1)
    results = {
        "settings": vars(args),
        "torch_threads": torch.get_num_threads(),
        "train_seconds_wall_cpu": train_times,
        "generate_seconds_wall_cpu": gen_times,
        "train_tokens_per_s": train_tps,
        "generate_tokens_per_s": gen_tps,
        "train_tokens_per_cpu_s": train_cpu,
        "generate_tokens_per_cpu_s": gen_cpu,
        "train_ratio": train_tps["ours"] / train_tps["reference"],
        "generate_ratio": gen_tps["ours"] / gen_tps["reference"],
        "train_ratio_cpu": train_cpu["ours"] / train_cpu["reference"],
        "generate_ratio_cpu": gen_cpu["ours"] / gen_cpu["reference"],
    }
    size = (
        f"hidden {args.hidden}, {args.layers} layers, {args.heads} heads, segment {args.segment}, "
        f"mem {args.mem}, c_mem {args.c_mem}, rate {args.rate}"
    )
    print(
        f"\n{size}; training batch {args.batch} x {window} tokens; decoding {n} tokens after a "
        f"{prompt.shape[1]}-token prompt; {torch.get_num_threads()} threads\n"
    )
    print("| measure | longrange | compressive-transformer-pytorch 0.4.0 | ratio |")
    print("|---|---|---|---|")
    for label, ours_rate, ref_rate in (
        ("training tokens/s (wall)", train_tps["ours"], train_tps["reference"]),
        ("training tokens per CPU-second", train_cpu["ours"], train_cpu["reference"]),
        ("generation tokens/s (wall)", gen_tps["ours"], gen_tps["reference"]),
        ("generation tokens per CPU-second", gen_cpu["ours"], gen_cpu["reference"]),
    ):
        print(f"| {label} | {ours_rate:.2f} | {ref_rate:.2f} | {ours_rate / ref_rate:.2f}x |")
    with open(args.json, "w") as f:
        json.dump(results, f, indent=2)
    print(f"\nwrote {args.json}")
    return results


if __name__ == "__main__":
    main()
