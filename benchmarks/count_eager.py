"""What one eager training step of `benchmark_gpu.py` would ask of a GPU, counted on a machine without one.

    python benchmarks/count_eager.py                                   # every eager row, 1 x 2,048 tokens
    python benchmarks/count_eager.py --rows '^compressive/ours/bf16' --batch 8 --top 10
    python benchmarks/count_eager.py --quick --json /tmp/eager.json    # tiny sizes (CI)
    python benchmarks/count_eager.py --rows "^compressive/.*/tf32"       # ours beside the reference

Eager GPU steps are bound by the host (operators dispatched) or by the device's memory traffic (bytes the
operators write), not by the CPU's arithmetic: both can be counted here. The row's step (forward under autocast
for bf16, backward, AdamW) runs on the CPU along the path a CUDA device takes: the Compressive attention kernel
chosen as on CUDA (sdpa, not the CPU's blockwise kernel), and `scaled_dot_product_attention` as one operator each
way, as on CUDA, where the CPU would decompose it (its inputs cast as autocast does on CUDA; its own work is not
counted). A dispatch mode counts every operator of the step: views (no kernel on any device), the others (about
one launch each) and the bytes those write, with the operators and call sites that write most. AdamW runs as on
CUDA (`foreach`). Reads are not counted; for a pointwise operator they are about its writes again.

The activations a step keeps for its backward, what drives its peak memory beyond the weights, gradients and
optimizer state, are counted too (`saved_for_backward`): the storages autograd holds for a backward (each once;
parameters left out, since they are alive anyway), the most held at the start of any backward of the step (a row
trained a segment at a time runs one backward per segment). sdpa keeps its output beside its inputs, as CUDA's
fused kernels do.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import re
import sys
import traceback
from dataclasses import replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

try:
    import longrange  # noqa: F401
except ImportError:  # running from a checkout without `pip install -e .`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import benchmark_gpu  # noqa: E402

from longrange.modeling_compressive import CompressiveAttention  # noqa: E402

VIEWS = frozenset(
    "view _unsafe_view _reshape_alias reshape transpose t permute expand slice select unsqueeze squeeze split "
    "split_with_sizes chunk unbind narrow diagonal unfold alias detach as_strided lift_fresh".split()
)
SITES = ("/longrange/", "/transformers/", "compressive_transformer_pytorch", "sinkhorn_transformer")


class _Sdpa(torch.autograd.Function):
    """sdpa as one operator each way (its inside runs unseen by the counter)."""

    @staticmethod
    def forward(ctx, query, key, value, mask, scale, causal, counter):
        ctx.scale, ctx.causal, ctx.counter = scale, causal, counter
        with counter.unseen(), torch.no_grad():
            out = _real_sdpa(query, key, value, attn_mask=mask, scale=scale, is_causal=causal)
        ctx.save_for_backward(query, key, value, mask, out)  # (the output as CUDA's kernels keep it)
        return out

    @staticmethod
    def backward(ctx, grad):
        inputs = [t if t is None else t.detach().requires_grad_(t.requires_grad) for t in ctx.saved_tensors[:4]]
        with ctx.counter.unseen(), torch.enable_grad():
            out = _real_sdpa(*inputs[:3], attn_mask=inputs[3], scale=ctx.scale, is_causal=ctx.causal)
            wanted = [t for t in inputs if t is not None and t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad))
        return (*[next(grads) if t is not None and t.requires_grad else None for t in inputs], None, None, None)


_real_sdpa = F.scaled_dot_product_attention


class Counter(TorchDispatchMode):
    """Operators and the bytes they write, by operator and call site."""

    def __init__(self):
        super().__init__()
        self.views, self.ops, self.bytes = 0, collections.Counter(), collections.Counter()
        self._hidden = 0

    @contextlib.contextmanager
    def unseen(self):
        self._hidden += 1
        try:
            yield
        finally:
            self._hidden -= 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if self._hidden:
            return out
        if name in VIEWS:
            self.views += 1
            return out
        outputs = out if isinstance(out, (tuple, list)) else (out,)
        frames = [f for f in traceback.extract_stack() if any(s in f.filename for s in SITES)]
        site = f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "backward / optimizer"
        self.ops[(name, site)] += 1
        self.bytes[(name, site)] += sum(o.numel() * o.element_size() for o in outputs if isinstance(o, torch.Tensor))
        return out


class SavedForBackward:
    """Bytes of the storages autograd keeps for a backward (parameters left out), the most held when a backward
    starts."""

    def __init__(self, parameters):
        self.parameters = {p.untyped_storage().data_ptr() for p in parameters}
        self.held, self.peak = {}, 0

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in self.parameters:  # (held until the next backward: no address is reused)
            self.held[storage.data_ptr()] = storage
        return tensor

    @contextlib.contextmanager
    def watching(self):
        backward = torch.autograd.backward  # (Tensor.backward calls it)

        def watched(*args, **kwargs):
            self.peak = max(self.peak, sum(storage.nbytes() for storage in self.held.values()))
            self.held.clear()
            return backward(*args, **kwargs)

        torch.autograd.backward = watched
        try:
            with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
                yield self
        finally:
            torch.autograd.backward = backward


@contextlib.contextmanager
def cuda_paths(counter: Counter):
    """The Compressive attention kernel as chosen on CUDA, sdpa as one operator, AdamW with foreach."""
    kernel, adamw = CompressiveAttention.kernel, torch.optim.AdamW

    def as_on_cuda(self, device, need_weights=False, static=False):
        return kernel(self, torch.device("cuda"), need_weights, static)

    def sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        if torch.is_autocast_enabled("cpu"):  # autocast casts sdpa's inputs on CUDA: the casts are counted
            dtype = torch.get_autocast_dtype("cpu")
            query, key, value = (t.to(dtype) for t in (query, key, value))
            if attn_mask is not None and attn_mask.is_floating_point():
                attn_mask = attn_mask.to(dtype)
        with torch.autocast("cpu", enabled=False):
            return _Sdpa.apply(query, key, value, attn_mask, scale, is_causal, counter)

    CompressiveAttention.kernel = as_on_cuda
    F.scaled_dot_product_attention = sdpa
    torch.optim.AdamW = lambda params, **kw: adamw(params, foreach=True, **kw)
    try:
        yield
    finally:
        CompressiveAttention.kernel, F.scaled_dot_product_attention, torch.optim.AdamW = kernel, _real_sdpa, adamw


def count_row(row: benchmark_gpu.Row, size: dict, top: int) -> dict:
    counter = Counter()
    with cuda_paths(counter):
        model, step = benchmark_gpu.build_step(row, size, torch.device("cpu"), None)
        step()  # warm-up: optimizer state, caches
        with counter:
            step()
        with SavedForBackward(model.parameters()).watching() as saved:  # (apart: saving calls views of its own)
            step()
    writers = sorted(counter.bytes.items(), key=lambda item: -item[1])[:top]
    return dict(
        row=row.id,
        operators=sum(counter.ops.values()),
        views=counter.views,
        bytes_written=sum(counter.bytes.values()),
        saved_for_backward=saved.peak,
        top_writers=[dict(op=op, site=site, calls=counter.ops[(op, site)], bytes=n) for (op, site), n in writers],
    )


def eager_rows(size: dict, pattern: str, batch: int | None, length: int | None) -> list[benchmark_gpu.Row]:
    rows = []
    for row in benchmark_gpu.plan(size):
        if row.mode == "eager" and re.search(pattern, row.id):
            resized = (batch or row.batch, length or row.length)
            rows.append(replace(row, batch=resized[0], length=resized[1]))
    return list(dict.fromkeys(rows))


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default=".", help="regular expression on benchmark_gpu row ids (eager rows only)")
    parser.add_argument("--batch", type=int, default=None, help="default: 1 (--quick: the rows' own)")
    parser.add_argument("--length", type=int, default=None, help="default: 2,048 (--quick: the rows' own)")
    parser.add_argument("--top", type=int, default=8, help="writers listed per row")
    parser.add_argument("--quick", action="store_true", help="benchmark_gpu's quick sizes")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    size = benchmark_gpu.sizes(args.quick)
    batch, length = (args.batch, args.length) if args.quick else (args.batch or 1, args.length or 2048)
    results = []
    for row in eager_rows(size, args.rows, batch, length):
        result = count_row(row, size, args.top)
        results.append(result)
        print(f"{result['row']}: {result['operators']:,} operators (not views), {result['views']:,} views, "
              f"{result['bytes_written'] / 2**30:.2f} GiB written, "
              f"{result['saved_for_backward'] / 2**30:.2f} GiB saved for a backward", flush=True)  # fmt: skip
        for w in result["top_writers"]:
            print(f"    {w['bytes'] / 2**30:8.3f} GiB  {w['calls']:5d} x {w['op']:<28s} {w['site']}")
    if args.json:
        args.json.write_text(json.dumps(dict(torch=torch.__version__, rows=results), indent=1) + "\n")
    return results


if __name__ == "__main__":
    main()
