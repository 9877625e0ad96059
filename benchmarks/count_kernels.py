"""Kernels one compiled training step launches on a GPU, counted on a machine without one.

    python benchmarks/count_kernels.py                       # Sinkhorn and Llama, bf16, 1 x 2,048 tokens
    python benchmarks/count_kernels.py --models sinkhorn --length 8192 --json /tmp/kernels.json

`torch.compile` (inductor) writes a GPU step as Triton kernels plus library calls (matrix products, attention).
Here inductor generates that code for the training step of `benchmark_gpu.py` (same models, width and depth;
forward under bf16 autocast, backward; AdamW is not compiled and not counted) with a stand-in for Triton's GPU
driver: the kernels are written, never compiled or run, and the step fails where it would first launch one. The
count is of the launches in the generated code of the forward and backward graphs: Triton kernels (pointwise,
reduction, persistent reduction), matrix products (`extern_kernels.mm` / `bmm` / `addmm`) and aten fallbacks
(attention). On the CPU, inductor picks the CPU's attention kernels and the same fusion as for a GPU; the device
run of 2026-12-04 measured 692 kernels per compiled Sinkhorn step and 410 for Llama (AdamW, copies and the loss
included), against 646 and 336 counted here at that commit.

Needs the `triton` package (it is not a dependency: `pip install triton` in an environment of its own on a
machine without a GPU). Each model runs in a subprocess with an empty inductor cache, so that every graph is
generated anew.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {"sinkhorn": "ours", "compressive": "ours", "llama": "llama"}


def _stand_in_driver():
    """Triton's active driver replaced by one that reports a GPU target (code generation asks for it) and
    inductor's kernel compilation by a recorder: the generated code loads, its first launch fails."""
    import torch
    import triton
    from torch._inductor.async_compile import AsyncCompile
    from triton.backends.compiler import GPUTarget

    class Driver:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)  # an H100 / H200 class target

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

        def get_active_torch_device(self):
            return torch.device("cpu")

        def is_active(self):
            return True

        def get_benchmarker(self):
            return None

        def get_device_interface(self):
            return torch.cpu

    triton.runtime.driver.set_active(Driver())
    AsyncCompile.triton = lambda self, name, source, device_str="cuda", **kwargs: None


def count_one(model: str, precision: str, batch: int, length: int, quick: bool = False) -> dict:
    """In this process: generate the compiled step's code and count its launches."""
    import torch
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import graph as inductor_graph

    sys.path.insert(0, str(REPO / "benchmarks"))
    import benchmark_gpu

    from longrange.layers import FeedForward

    FeedForward.block_elements = 1 << 62  # one pass as on a GPU (the CPU splits long inputs into row blocks)

    inductor_config.cpu_backend = "triton"  # the GPU's code generator for the CPU device
    inductor_config.compile_threads = 1
    inductor_config.fx_graph_cache = False
    functorch_config.force_non_lazy_backward_lowering = True  # the backward graph is generated with the forward
    _stand_in_driver()
    sources: list[str] = []
    codegen = inductor_graph.GraphLowering.codegen

    def recording_codegen(self, *args, **kwargs):
        result = codegen(self, *args, **kwargs)
        code = result[0]
        sources.append(getattr(code, "value", str(code)))
        return result

    inductor_graph.GraphLowering.codegen = recording_codegen
    row = benchmark_gpu.Row(model, MODELS[model], precision, "compiled", batch, length)
    _, step = benchmark_gpu.build_step(row, benchmark_gpu.sizes(quick), torch.device("cpu"), {})
    try:
        step()
    except Exception:  # noqa: BLE001 - the first launch of a generated kernel fails by design
        pass
    if len(sources) < 2:
        raise RuntimeError(f"{model}: expected a forward and a backward graph, got {len(sources)}")
    text = "\n".join(sources)
    triton = collections.Counter(m.split("_")[1] for m in re.findall(r"\b(triton_[a-z]+_\w+?)\.run\(", text))
    extern = collections.Counter(re.findall(r"extern_kernels\.(\w+)\(", text))
    fallback = collections.Counter(re.findall(r"torch\.ops\.aten\.(\w+)\.\w+\(", text))
    return {
        "model": model,
        "precision": precision,
        "shape": [batch, length],
        "graphs": len(sources),
        "launches": sum(triton.values()) + sum(extern.values()) + sum(fallback.values()),
        "triton": dict(triton),  # poi(ntwise), red(uction), per(sistent reduction)
        "extern": dict(extern),
        "aten_fallbacks": dict(fallback),
    }


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["sinkhorn", "llama"], choices=sorted(MODELS))
    parser.add_argument("--precision", default="bf16", choices=["bf16", "tf32"])
    parser.add_argument("--batch", type=int, default=1, help="(the count does not depend on it)")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--json", type=Path, default=None, help="write the counts here")
    parser.add_argument("--quick", action="store_true", help="benchmark_gpu.py's --quick width (a smoke run)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        print(json.dumps(count_one(args.worker, args.precision, args.batch, args.length, args.quick)))
        return []
    rows = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as cache:
            path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])  # the repository first
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": path}
            command = [sys.executable, __file__, "--worker", model, "--precision", args.precision,
                       "--batch", str(args.batch), "--length", str(args.length)] + ["--quick"] * args.quick  # fmt: skip
            proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{model}: {proc.stderr[-2000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        r = rows[-1]
        print(f"{model:12s} {r['launches']:5d} launches per step: Triton {r['triton']}, products {r['extern']}, "
              f"fallbacks {r['aten_fallbacks']}", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
