"""Where a training step's time goes, for longrange's models and the reference packages, at the issue sizes.

    python benchmarks/profile_training_step.py sinkhorn          # ours and sinkhorn-transformer 0.11.4
    python benchmarks/profile_training_step.py compressive       # ours and compressive-transformer-pytorch 0.4.0
    python benchmarks/profile_training_step.py sinkhorn --quick  # tiny sizes (smoke test)

One warm-up step, then one step under torch.profiler for each side. Prints, per side, the step's CPU time, the
time inside matrix products (mm / addmm / bmm / baddbmm and the fused attention kernels) and the rest. The
matrix products of the projections and feed-forwards are the same on both sides (same shapes), so
`reference step / our matrix-product time` bounds the speed-up any implementation of the same model can reach
on this CPU even if everything else cost nothing.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_compressive  # noqa: E402
import benchmark_sinkhorn  # noqa: E402

MATRIX_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::baddbmm", "aten::addmm_", "aten::baddbmm_")


def is_matrix_op(name: str) -> bool:
    return name in MATRIX_OPS or name.startswith("aten::_scaled_dot_product")


def sinkhorn_steps(quick: bool):
    size = benchmark_sinkhorn.sizes(quick)["train"]
    opts = dict(size["model"], **benchmark_sinkhorn.COMMON, causal=True, max_seq_len=size["length"])
    ids = torch.randint(0, opts["num_tokens"], (size["batch"], size["length"]))
    for impl in ("ours", "ref"):
        model, forward = benchmark_sinkhorn.build(impl, opts)
        model.train()
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

        def step(forward=forward, optimizer=optimizer):
            logits = forward(ids)
            F.cross_entropy(logits[:, :-1].flatten(0, 1), ids[:, 1:].flatten()).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

        yield ("longrange" if impl == "ours" else "sinkhorn-transformer 0.11.4"), step


def compressive_steps(quick: bool):
    if quick:
        sizes = dict(hidden=64, layers=2, heads=4, segment=32, mem=32, c_mem=8, rate=4)
    else:
        sizes = dict(hidden=512, layers=6, heads=8, segment=512, mem=512, c_mem=128, rate=4)
    ours, reference = benchmark_compressive.build(argparse.Namespace(reference_gru=False, **sizes))
    batch = torch.randint(0, 256, (2, 2 * sizes["segment"] + 1))
    opt_ours = torch.optim.AdamW(ours.parameters(), lr=1e-4)
    opt_ref = torch.optim.AdamW(reference.parameters(), lr=1e-4)
    ours.train()
    reference.train()
    yield "longrange", lambda: benchmark_compressive.train_step_ours(ours, opt_ours, batch[:, :-1])
    yield (
        "compressive-transformer-pytorch 0.4.0",
        lambda: benchmark_compressive.train_step_reference(reference, opt_ref, batch),
    )


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", choices=("sinkhorn", "compressive"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (default 1, as in the benchmarks)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    steps = sinkhorn_steps(args.quick) if args.model == "sinkhorn" else compressive_steps(args.quick)
    rows = {}
    for name, step in steps:
        step()  # warm-up
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            step()
        events = prof.key_averages()
        total = sum(e.self_cpu_time_total for e in events) / 1e6
        matrix = sum(e.self_cpu_time_total for e in events if is_matrix_op(e.key)) / 1e6
        rows[name] = (total, matrix)
    print("| side | step (s, profiled) | matrix products (s) | everything else (s) |")
    print("|---|---|---|---|")
    for name, (total, matrix) in rows.items():
        print(f"| {name} | {total:.2f} | {matrix:.2f} | {total - matrix:.2f} |")
    (ours_total, ours_matrix), (ref_total, _) = rows["longrange"], [v for k, v in rows.items() if k != "longrange"][0]
    print(
        f"\nreference step / our matrix products = {ref_total / ours_matrix:.2f}x: the most any implementation "
        f"doing our products could gain if nothing else cost anything; now {ref_total / ours_total:.2f}x"
    )
    return rows


if __name__ == "__main__":
    main()
