"""Kernels one compiled training or decoding step launches on a GPU, and the work they do, counted on a machine
without one.

    python benchmarks/count_kernels.py                       # training: Sinkhorn and Llama, bf16, 1 x 2,048 tokens
    python benchmarks/count_kernels.py --batch 8 --length 2048 --json /tmp/kernels.json
    python benchmarks/count_kernels.py --decode 1000 --models sinkhorn compressive llama   # decoding steps
    python benchmarks/count_kernels.py --device cuda --mode regional --by-segment --models compressive

`torch.compile` (inductor) writes a GPU step as Triton kernels plus library calls (matrix products, attention).
Here inductor generates that code with a stand-in for Triton's GPU driver: the kernels are written, never
compiled, and every launch does nothing (buffers come zeroed; products and attention run on the CPU). Training:
the step of `benchmark_gpu.py` (same models, width and depth; forward under bf16 autocast, backward; AdamW is not
compiled and not counted), its forward and backward graphs. Decoding (`--decode CONTEXT`): the steps generate()
compiles in `benchmark_decoding.py`'s compiled rows (batch 1, bf16 weights), one entry per graph. With
`--device cuda`, training steps can also be those of `benchmark_gpu.py`'s `regional` rows (`--mode regional`: each
decoder layer compiled alone, as `longrange train --compile`) and of the Compressive model trained a segment at a
time (`--by-segment`): several graphs, each counted as many times as the step runs it.

Counted: the launches in the generated code, Triton kernels (pointwise, reduction, persistent reduction), matrix
products (`extern_kernels.mm` / `bmm` / `addmm`) and aten fallbacks (attention), and among them the copies back
(inductor writing a mutated input back from a copy: an in-place update it could not do in place). Work: the bytes
each Triton kernel moves (inductor's own estimate), the bytes and FLOPs of the products and attention (from their
shapes), and an H200 roofline (each launch at the device's peak bandwidth or tensor throughput, whichever binds;
a lower bound: launch gaps and kernels below peak come on top). On the CPU, inductor picks the CPU's attention
kernels and the same fusion as for a GPU; the device run of 2026-12-04 measured 692 kernels per compiled
Sinkhorn training step and 410 for Llama (AdamW, copies and the loss included), against 646 and 336 counted here
at that commit.

Needs the `triton` package (it is not a dependency: `pip install triton` in an environment of its own on a
machine without a GPU). Each model runs in a subprocess with an empty inductor cache, so that every graph is
generated anew.
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MODELS = {"sinkhorn": "ours", "compressive": "ours", "llama": "llama"}


def _stand_in_driver(kernels: dict[str, str], device: str = "cpu"):
    """Triton's active driver replaced by one that reports a GPU target (code generation asks for it) and
    inductor's kernel compilation by a recorder of each kernel's source (into `kernels`): the generated code runs,
    every Triton launch doing nothing (its outputs are left unwritten; matrix products and attention run on the
    CPU)."""
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
            return torch.device(device)

        def is_active(self):
            return True

        def get_benchmarker(self):
            return None

        def get_device_interface(self):
            return torch.cuda if device == "cuda" else torch.cpu

    triton.runtime.driver.set_active(Driver())

    class Kernel:  # what the generated code launches: nothing
        def run(self, *args, **kwargs):
            return None

    def record(self, name, source, device_str="cuda", **kwargs):
        kernels[name] = source
        return Kernel()

    AsyncCompile.triton = record
    # buffers the generated code allocates come zeroed, so that indices a skipped kernel should have written are 0
    guards = torch._C._dynamo.guards
    guards._empty_strided_cpu = lambda size, stride, dtype: torch.empty_strided(size, stride, dtype=dtype).zero_()


# One H200's peaks (NVIDIA's data sheet): HBM3e bandwidth and dense tensor-core throughput
H200 = {"bytes_per_s": 4.8e12, "flop_per_s": {"bf16": 989e12, "tf32": 494e12}}
ITEMSIZE = {"bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "int64": 8, "int32": 4, "bool": 1}


def _top_level_args(call: str) -> list[str]:
    """The comma-separated arguments of `f(a, g(b, c), (1, 2), k=v)` at the outer level."""
    args, depth, start = [], 0, call.index("(") + 1
    for i in range(start, len(call)):
        ch = call[i]
        if ch in "([":
            depth += 1
        elif ch in ")]" and depth:
            depth -= 1
        elif ch in ",)" and depth == 0:
            args.append(call[start:i].strip())
            start = i + 1
            if ch == ")":
                break
    return [a for a in args if a]


def _dims(text: str) -> tuple[int, ...]:
    """A shape written in generated code, "(8, 2048, 512)" or "8, 2048, 512" (a 1-d shape "8," included)."""
    return tuple(int(d) for d in text.strip("()").split(",") if d.strip())


def _buffers(code: str) -> dict[str, tuple[tuple[int, ...], int]]:
    """name -> (shape, bytes per element) of the buffers and inputs of one generated graph."""
    buffers = {}
    for name, dims, dtype in re.findall(r"\b(\w+) = empty_strided_\w+\(\(([^)]*)\), \([^)]*\), torch\.(\w+)\)", code):
        buffers[name] = (_dims(dims), ITEMSIZE.get(dtype, 4))
    for name, dims in re.findall(r"assert_size_stride\((\w+), \(([^)]*)\)", code):
        buffers.setdefault(name, (_dims(dims), 2))
    for call in re.findall(r"assert_size_stride_grouped\(.*", code):  # torch >= 2.15: the inputs' checks in one call
        names, shapes = _top_level_args(call)[:2]
        for name, dims in zip(_top_level_args(names), _top_level_args(shapes)):
            buffers.setdefault(name, (_dims(dims), 2))
    # inputs no check names (torch 2.15 checks no empty input): the module's benchmark harness makes each one
    for name, dims, dtype in re.findall(
        r"\b(\w+) = rand_strided\(\(([^)]*)\), \([^)]*\), .*dtype=torch\.(\w+)\)", code
    ):
        buffers.setdefault(name, (_dims(dims), ITEMSIZE.get(dtype, 4)))
    for name, dims in re.findall(r"\b(\w+) = reinterpret_tensor\(\w+, \(([^)]*)\)", code):
        buffers[name] = (_dims(dims), 2)
    for name, old in re.findall(r"\b(\w+) = (\w+); del \2  # reuse", code):
        buffers.setdefault(name, buffers.get(old, ((), 2)))
    return buffers


def _shape(arg: str, buffers) -> tuple[tuple[int, ...], int]:
    """The shape (and element size) of a call argument: a buffer's name or `reinterpret_tensor(name, shape, ...)`."""
    if arg.startswith("reinterpret_tensor("):
        name, dims = _top_level_args(arg)[:2]
        return _dims(dims), buffers.get(name, ((), 2))[1]
    return buffers.get(arg, ((), 2))


def _library_call_work(op: str, args: list[str], buffers) -> tuple[float, float]:
    """(flop, bytes) of one matrix product or attention call. Attention counts every query-key pair it scores
    (halved when causal): forward 4 B H Lq Lk d, backward 10 B H Lq Lk d (scores recomputed, then four products);
    its bytes are q, k, v and the output (backward: and their gradients) and a mask read once each."""
    positional = [a for a in args if not re.match(r"\w+=", a)]
    shapes = [_shape(a, buffers) for a in positional]
    if op in ("mm", "addmm", "bmm", "baddbmm"):
        (a, size), (b, _) = shapes[-2:]
        batch = a[0] if len(a) == 3 else 1
        m, k, n = a[-2], a[-1], b[-1]
        return 2.0 * batch * m * k * n, float(size * batch * (m * k + k * n + m * n))
    backward = op.endswith("_backward")
    (q, size), (k, _) = shapes[1:3] if backward else shapes[:2]
    if len(q) != 4 or len(k) != 4:
        return 0.0, 0.0
    flag = positional[7 if backward else 4] if len(positional) > (7 if backward else 4) else "False"
    pairs = q[0] * q[1] * q[2] * k[2] * (0.5 if flag == "True" else 1.0)
    mask = [_shape(a.split("=", 1)[1], buffers) for a in args if a.startswith("attn_mask=") and a != "attn_mask=None"]
    tensors = (4 if backward else 2) * (math.prod(q) + math.prod(k)) * size
    tensors += sum(math.prod(shape) * item for shape, item in mask if shape)
    return (10.0 if backward else 4.0) * pairs * q[3], float(tensors)


def work(sources: list[str], kernels: dict[str, str], precision: str) -> dict:
    """Bytes moved and products computed by the step's launches, and the time they take at least on one H200:
    each launch at the device's peak bandwidth or peak tensor throughput, whichever binds (a roofline: real
    kernels reach a fraction of both, and launch gaps come on top). Triton kernels' bytes are inductor's own
    estimate (inputs and outputs once each); library calls' from their shapes."""
    gb = {
        name: float(m.group(1))
        for name, src in kernels.items()
        if (m := re.search(r"'kernel_num_gb': ([\d.e+-]+)", src))
    }
    bandwidth, peak = H200["bytes_per_s"], H200["flop_per_s"][precision]
    triton_bytes, library_bytes, flop, roofline, by_kernel = 0.0, 0.0, 0.0, 0.0, collections.Counter()
    for code in sources:
        buffers = _buffers(code)
        for name in re.findall(r"\b(triton_\w+)\.run\(", code):
            triton_bytes += gb.get(name, 0.0) * 1e9
            roofline += gb.get(name, 0.0) * 1e9 / bandwidth
            by_kernel[re.sub(r"_\d+$", "", name)] += gb.get(name, 0.0) * 1e9
        for call in re.findall(r"(?:extern_kernels\.\w+|torch\.ops\.aten\.\w+\.\w+)\(.*", code):
            op = re.match(r"(?:extern_kernels\.(\w+)|torch\.ops\.aten\.(\w+)\.\w+)", call)
            op = op.group(1) or op.group(2)
            if op not in ("mm", "addmm", "bmm", "baddbmm") and "scaled_dot_product" not in op:
                continue
            f, b = _library_call_work(op, _top_level_args(call), buffers)
            flop, library_bytes = flop + f, library_bytes + b
            roofline += max(f / peak, b / bandwidth)
    return {
        "triton_bytes": round(triton_bytes),
        "library_bytes": round(library_bytes),
        "flop": round(flop),
        "h200_roofline_ms": round(roofline * 1e3, 4),
        "top_triton_gb": {k: round(v / 1e9, 4) for k, v in by_kernel.most_common(8)},
    }


def _generated_code(run, device: str = "cpu", sources: list | None = None) -> tuple[list[str], dict[str, str]]:
    """Run `run()` with inductor writing Triton code for the CPU device as for a GPU (device "cuda": for the fake
    CUDA device of `fake_cuda.py`), every launch a no-op; return the wrapper code of each graph generated (kernel
    sources cut out) and each kernel's source. `sources`: the list the wrapper code is appended to while `run()`
    runs (with the kernel sources still in)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config
    from torch._inductor import graph as inductor_graph

    inductor_config.cpu_backend = "triton"  # the GPU's code generator for the CPU device
    inductor_config.compile_threads = 1
    inductor_config.fx_graph_cache = False
    inductor_config.benchmark_kernel = True  # each kernel's source states the bytes it moves (`kernel_num_gb`)
    functorch_config.force_non_lazy_backward_lowering = True  # the backward graph is generated with the forward
    kernels: dict[str, str] = {}
    _stand_in_driver(kernels, device)
    sources = [] if sources is None else sources
    codegen = inductor_graph.GraphLowering.codegen

    def recording_codegen(self, *args, **kwargs):
        result = codegen(self, *args, **kwargs)
        sources.append(getattr(result[0], "value", str(result[0])))
        return result

    inductor_graph.GraphLowering.codegen = recording_codegen
    run()
    # the wrapper code only: each kernel's own source (with benchmark_kernel, a harness that launches it) cut out
    return [re.sub(r"'''.*?'''", "''", code, flags=re.S) for code in sources], kernels


def launches(sources: list[str]) -> dict:
    """The launches written in the wrapper code of these graphs, by kind."""
    text = "\n".join(sources)
    triton = collections.Counter(m.split("_")[1] for m in re.findall(r"\b(triton_[a-z]+_\w+?)\.run\(", text))
    extern = collections.Counter(re.findall(r"extern_kernels\.(\w+)\(", text))
    fallback = collections.Counter(re.findall(r"torch\.ops\.aten\.(\w+)\.\w+\(", text))
    return {
        "launches": sum(triton.values()) + sum(extern.values()) + sum(fallback.values()),
        # inductor writing a mutated input back from a copy (an in-place update it could not do in place)
        "copies_back": len(re.findall(r"\btriton_poi_fused_copy__\d+\.run\(", text)),
        "triton": dict(triton),  # poi(ntwise), red(uction), per(sistent reduction)
        "extern": dict(extern),
        "aten_fallbacks": dict(fallback),
    }


def count_training(
    model: str, precision: str, batch: int, length: int, quick=False, device="cpu", mode="compiled", by_segment=False
) -> dict:
    """In this process: the compiled training step's launches (forward and backward graphs) and work. device
    "cuda": generated for a CUDA device (`fake_cuda.py`), else Triton code for the CPU device. mode "regional"
    and `by_segment` (cuda only): the step's graphs, each counted as many times as it ran in the step."""
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    import benchmark_gpu
    import fake_cuda

    row = benchmark_gpu.Row(model, "by_segment" if by_segment else MODELS[model], precision, mode, batch, length)
    size, cpu = benchmark_gpu.sizes(quick), torch.device("cpu")
    whole = mode == "compiled" and not by_segment  # one forward and one backward graph (else: cuda only, see main)
    if device == "cuda":  # dynamo's graphs captured on the CPU, then generated for the device
        graphs, calls, spans, generated = [], [], [], []
        kwargs = {"backend": fake_cuda.capturing(graphs, calls), **({"dynamic": False} if mode == "regional" else {})}
        _, step = benchmark_gpu.build_step(row, size, cpu, kwargs)
        step()
        autocast = torch.bfloat16 if precision == "bf16" else None

        def generate():
            for graph in graphs:  # each graph's forward (and backward): the code it runs at each call
                start = len(generated)
                fake_cuda.compile_for_cuda([graph], autocast)
                spans.append(slice(start, len(generated)))

        codes, kernels = _generated_code(generate, "cuda", generated)
        sources = [code for span, n in zip(spans, calls) for code in codes[span] * n]  # in the order of the graphs
    else:
        _, step = benchmark_gpu.build_step(row, size, cpu, {})
        codes, kernels = _generated_code(step)
        sources = codes
    if whole and len(codes) != 2:
        raise RuntimeError(f"{model}: expected a forward and a backward graph, got {len(codes)}")
    how = {} if whole else {"mode": mode, "by_segment": by_segment}
    # graphs that attend: the model's or its layers' (torch >= 2.15 also traces the leaf modules regional
    # compilation compiles alone: embedding, dropout, norm, head)
    attending = sum("scaled_dot_product" in code for code in codes)
    return {"model": model, "precision": precision, "shape": [batch, length], "device": device, **how,
            "graphs": len(codes), "attention_graphs": attending, **launches(sources),
            **work(sources, kernels, precision)}  # fmt: skip


def count_decoding(model: str, context: int, quick: bool = False, device: str = "cpu") -> dict:
    """In this process: the launches of each decoding step generate() compiles (benchmark_decoding.py's compiled
    row: bf16 weights, batch 1, a prompt of `context` tokens), one entry per graph in the order compiled. A
    Sinkhorn model compiles two steps: one that routes (the first, and where a row's token leads a bucket) and
    one that keeps its window (the others); since no kernel runs here, the cache's device counters stand still
    and the later steps all take the second graph."""
    import torch

    sys.path.insert(0, str(REPO / "benchmarks"))
    import benchmark_decoding

    row = benchmark_decoding.Row(model, MODELS[model], "compiled", context)
    size = benchmark_decoding.sizes(quick)
    net = benchmark_decoding.build(row, size).to(torch.bfloat16)
    prompt = benchmark_decoding.random_prompt(context)
    if device == "cuda":  # dynamo's graphs captured on the CPU, then generated for the device
        import fake_cuda

        graphs = []
        kwargs = benchmark_decoding.generate_kwargs(row, torch.device("cpu"), fake_cuda.capturing(graphs))
        net.generate(prompt, max_new_tokens=4, **kwargs)
        sources, kernels = _generated_code(lambda: fake_cuda.compile_for_cuda(graphs, None, inference=True), "cuda")
    else:
        kwargs = benchmark_decoding.generate_kwargs(row, torch.device("cpu"), "inductor")
        sources, kernels = _generated_code(lambda: net.generate(prompt, max_new_tokens=4, **kwargs))
    if not sources:
        raise RuntimeError(f"{model}: generate() compiled nothing")
    steps = [{**launches([code]), **work([code], kernels, "bf16")} for code in sources]
    return {
        "model": model,
        "decoding": True,
        "context": context,
        "device": device,
        "graphs": len(sources),
        "steps": steps,
    }


def _report(r: dict) -> None:
    for name, step in [("step", r)] if "steps" not in r else [(f"step {i + 1}", s) for i, s in enumerate(r["steps"])]:
        print(f"{r['model']:12s} {name}: {step['launches']:5d} launches ({step['copies_back']} copies back): Triton "
              f"{step['triton']}, products {step['extern']}, fallbacks {step['aten_fallbacks']}", flush=True)  # fmt: skip
        print(f"{'':12s} moves {step['triton_bytes'] / 1e9:.3f} GB in Triton kernels, {step['library_bytes'] / 1e9:.3f}"
              f" GB in products and attention ({step['flop'] / 1e12:.3f} TFLOP): at least "
              f"{step['h200_roofline_ms']:.3f} ms on one H200", flush=True)  # fmt: skip


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["sinkhorn", "llama"], choices=sorted(MODELS))
    parser.add_argument("--precision", default="bf16", choices=["bf16", "tf32"])
    parser.add_argument("--batch", type=int, default=1, help="(launches do not depend on it; bytes and products do)")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--decode", type=int, default=None, metavar="CONTEXT",
                        help="count the decoding steps generate() compiles after a prompt of CONTEXT tokens instead "
                        "(benchmark_decoding.py's compiled rows)")  # fmt: skip
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: the code inductor generates for an H200 (fake_cuda.py; needs a CUDA build of "
                        "torch, no GPU); cpu (default): Triton code for the CPU device")  # fmt: skip
    parser.add_argument("--mode", default="compiled", choices=["compiled", "regional"],
                        help="training: the whole model compiled (default) or each decoder layer alone (with "
                        "--device cuda)")  # fmt: skip
    parser.add_argument(
        "--by-segment",
        action="store_true",
        help="training: the Compressive model trained a segment at a time (with --device cuda)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the counts here")
    parser.add_argument("--quick", action="store_true", help="the benchmarks' --quick width (a smoke run)")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if (args.mode != "compiled" or args.by_segment) and (args.device != "cuda" or args.decode is not None):
        parser.error("--mode regional and --by-segment count training steps with --device cuda")
    if args.by_segment and ([args.worker] if args.worker else args.models) != ["compressive"]:
        parser.error("--by-segment trains the Compressive model a segment at a time: use --models compressive")
    if args.worker:
        from longrange.layers import FeedForward

        FeedForward.block_elements = 1 << 62  # one pass as on a GPU (the CPU splits long inputs into row blocks)
        if args.decode is not None:
            row = count_decoding(args.worker, args.decode, args.quick, args.device)
        else:
            row = count_training(
                args.worker, args.precision, args.batch, args.length, args.quick, args.device, args.mode,
                args.by_segment,
            )  # fmt: skip
        print(json.dumps(row))
        return []
    rows = []
    for model in args.models:
        with tempfile.TemporaryDirectory() as cache:
            path = os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])  # the repository first
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache, "PYTHONPATH": path}
            command = [
                sys.executable,
                __file__,
                "--worker",
                model,
                "--precision",
                args.precision,
                "--batch",
                str(args.batch),
                "--length",
                str(args.length),
                "--device",
                args.device,
            ]
            command += ["--quick"] * args.quick + ["--by-segment"] * args.by_segment + ["--mode", args.mode]
            command += ["--decode", str(args.decode)] if args.decode is not None else []
            proc = subprocess.run(command, env=env, capture_output=True, text=True)
        if proc.returncode != 0:
            raise SystemExit(f"{model}: {proc.stderr[-2000:]}")
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        _report(rows[-1])
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return rows


if __name__ == "__main__":
    main()
