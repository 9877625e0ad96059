"""Inductor's code for a CUDA device, generated on a machine without one (used by `count_kernels.py --device cuda`).

A compiled step is traced by dynamo on the CPU (a backend that keeps the graphs), its attention calls replaced by
the kernels CUDA picks for them, and forward and backward traced by aot_autograd on CPU fake tensors (the autograd
engine needs a real GPU for CUDA tensors). Each partitioned graph is then moved to fake CUDA tensors of an H200
and handed to inductor, which writes the Triton kernels and wrapper code a GPU would run: CUDA's attention
kernels, its stride constraints and its reduction and scan splitting, which CPU-targeted Triton code does not
exercise. Nothing runs: the Triton driver is a stand-in (see `count_kernels._stand_in_driver`).

Needs a CUDA build of torch (no GPU): `pip install torch==2.11.0` in a virtual environment, with the package
installed there; code generation failures that the device run of 2026-12-04 hit reproduce here."""

from __future__ import annotations

import contextlib
import sys
import types

import torch

# what inductor asks of the device: an H200 (compute capability 9.0, 132 multiprocessors)
H200 = types.SimpleNamespace(
    name="NVIDIA H200", major=9, minor=0, multi_processor_count=132, total_memory=141 << 30, warp_size=32,
    max_threads_per_multi_processor=2048, max_threads_per_block=1024, regs_per_multiprocessor=65536,
    shared_memory_per_block_optin=232448, shared_memory_per_multiprocessor=233472, L2_cache_size=60 << 20,
    gcnArchName="", uuid="stand-in", is_integrated=False, clock_rate=1980000, memory_clock_rate=3201000,
    memory_bus_width=6144,
)  # fmt: skip


class _NoDevice(contextlib.nullcontext):
    def __init__(self, *args, **kwargs):
        super().__init__()


def pretend_h200() -> None:
    """torch and inductor told that one H200 is present (for code generation only: nothing can run on it)."""
    import torch._subclasses.fake_tensor as fake_tensor
    import torch.cuda.random as cuda_random
    import torch.utils._triton as utils_triton
    from torch._dynamo.device_interface import CudaInterface

    if not torch.backends.cuda.is_built():
        raise SystemExit("--device cuda needs a CUDA build of torch (no GPU): e.g. pip install torch==2.11.0")
    answers = dict(
        is_available=lambda: True, is_initialized=lambda: True, device_count=lambda: 1, current_device=lambda: 0,
        get_device_properties=lambda *a, **k: H200, get_device_capability=lambda *a, **k: (9, 0),
        get_device_name=lambda *a, **k: H200.name, is_bf16_supported=lambda *a, **k: True, _lazy_init=lambda: None,
        set_device=lambda *a: None, synchronize=lambda *a: None, device=_NoDevice, _DeviceGuard=_NoDevice,
        get_rng_state=lambda *a, **k: torch.zeros(16, dtype=torch.uint8), set_rng_state=lambda *a, **k: None,
        get_rng_state_all=lambda *a, **k: [torch.zeros(16, dtype=torch.uint8)], set_rng_state_all=lambda *a, **k: None,
    )  # fmt: skip
    for name, answer in answers.items():
        setattr(torch.cuda, name, answer)
        if hasattr(cuda_random, name):
            setattr(cuda_random, name, answer)
    for name in ("current_device", "set_device", "device_count", "synchronize", "get_device_properties"):
        setattr(CudaInterface, name, staticmethod(answers[name]))
    CudaInterface.is_available = staticmethod(lambda: True)
    CudaInterface.is_bf16_supported = staticmethod(lambda *a, **k: True)
    CudaInterface.get_compute_capability = staticmethod(lambda device=None: 90)
    CudaInterface.device = _NoDevice
    CudaInterface.exchange_device = CudaInterface.maybe_exchange_device = staticmethod(lambda device: 0)
    CudaInterface.get_raw_stream = staticmethod(lambda device: 0)
    CudaInterface.Worker.get_device_properties = staticmethod(lambda device=None: H200)
    fake_tensor.init_gpu_context = lambda device: None
    utils_triton.has_triton = lambda *args, **kwargs: True
    for module in list(sys.modules.values()):  # modules that imported has_triton by name
        if getattr(module, "__name__", "").startswith("torch") and hasattr(module, "has_triton"):
            module.has_triton = utils_triton.has_triton


def capturing(graphs: list, calls: list | None = None) -> callable:
    """A torch.compile backend that keeps each graph dynamo traces (with its example inputs) and runs it eagerly;
    `calls` (when given) receives how many times each graph ran, in the same order."""

    def backend(gm, example_inputs):
        graphs.append((gm, list(example_inputs)))
        if calls is None:
            return gm.forward
        index = len(calls)
        calls.append(0)

        def counted(*args):
            calls[index] += 1
            return gm.forward(*args)

        return counted

    return backend


def _cuda_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """scaled_dot_product_attention as CUDA dispatches it on an H200: flash attention for bf16 / fp16 without a
    mask, memory-efficient attention otherwise (flash takes no mask)."""
    if enable_gqa and k.shape[1] != q.shape[1]:
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if attn_mask is None and q.dtype in (torch.bfloat16, torch.float16):
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, dropout_p, is_causal, scale=scale)[0]
    if attn_mask is not None and attn_mask.dtype == torch.bool:
        attn_mask = torch.zeros_like(attn_mask, dtype=q.dtype).masked_fill(~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        q, k, v, attn_mask, True, dropout_p, is_causal, scale=scale
    )[0]


def _to_cuda(value):
    if isinstance(value, torch.device) and value.type == "cpu":
        return torch.device("cuda", 0)
    if isinstance(value, str) and value == "cpu":
        return "cuda"
    if isinstance(value, (list, tuple)):
        return type(value)(_to_cuda(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cuda(v) for k, v in value.items()}
    return value


def _inner_compile_on_cuda(gm, example_inputs, **kwargs):
    """inductor's compilation of one partitioned graph, moved to fake CUDA tensors: every value the trace recorded
    (`meta["val"]`) becomes a CUDA fake tensor of the same shape, strides and offset, so that inductor keeps the
    layouts aot_autograd chose."""
    from torch._inductor.compile_fx import compile_fx_inner
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)

    def on_cuda(value):
        if isinstance(value, torch.Tensor):
            extent = value.storage_offset() + sum((n - 1) * s for n, s in zip(value.shape, value.stride())) + 1
            with mode:
                base = torch.empty(extent if value.numel() else 0, dtype=value.dtype, device="cuda")
                return base.as_strided(value.shape, value.stride(), value.storage_offset() if value.numel() else 0)
        if isinstance(value, (list, tuple)):
            return type(value)(on_cuda(v) for v in value)
        return value

    for node in gm.graph.nodes:
        node.args, node.kwargs = _to_cuda(node.args), _to_cuda(dict(node.kwargs))
        if "val" in node.meta:
            node.meta["val"] = on_cuda(node.meta["val"])
    gm.recompile()
    with mode:
        return compile_fx_inner(gm, [on_cuda(x) for x in example_inputs], **kwargs)


def compile_for_cuda(graphs: list, autocast_dtype: torch.dtype | None, inference: bool = False) -> None:
    """inductor's CUDA code for each captured graph (forward and backward): see the module. autocast_dtype: the
    autocast the step ran its forward under (None: none); inference: the graphs ran without gradients (generate())."""
    from torch._inductor.compile_fx import compile_fx

    pretend_h200()
    for gm, inputs in graphs:
        for node in gm.graph.nodes:
            if node.op == "call_function" and node.target in (
                torch._C._nn.scaled_dot_product_attention,
                torch.nn.functional.scaled_dot_product_attention,
            ):
                node.target = _cuda_attention
        gm.recompile()
        autocast = torch.autocast("cpu", dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        with autocast, torch.no_grad() if inference else contextlib.nullcontext():
            compile_fx(gm, inputs, inner_compile=_inner_compile_on_cuda)
