"""Reversible residual layers (RevNet / Reformer) for a stack of (f, g) blocks.

Each block maps a pair of streams (x1, x2) to

    y1 = x1 + f(x2)
    y2 = x2 + g(y1)

which can be inverted exactly: x2 = y2 - g(y1), x1 = y1 - f(x2). So the backward pass does not need the
activations of the forward pass: it starts from the stack's outputs, and block by block (last to first)
recomputes f and g on reconstructed inputs, differentiates the recomputed graph, and reconstructs the block's
inputs. Memory for activations is then that of ONE block instead of all of them.

Details that make the recomputation exact and the gradients ordinary:
- Dropout inside f and g must draw the same mask twice: the RNG state (CPU, and CUDA when the stream lives on a
  CUDA device) is recorded before every f and g call of the forward pass and restored around the recomputation;
  the caller's RNG stream is left untouched by the backward pass.
- Autocast is recorded at forward time and re-entered for the recomputation.
- Gradients of parameters, and of tensors passed in `f_kwargs` / `g_kwargs` that require grad (for instance the
  encoder states a decoder cross-attends to), are RETURNED through the custom autograd Function's outputs: every
  trainable parameter of the blocks and every such kwargs tensor is an explicit input of the Function. The
  autograd engine therefore accumulates them into `.grad` itself, exactly once per backward, which keeps
  DDP / Accelerate gradient hooks, `no_sync` gradient accumulation and gradient scaling working as for any
  other module (no `.grad` is written behind the engine's back). Blocks shared by several positions (weight
  tying) appear once as inputs; their gradients from every position are summed inside the backward.
- The backward is `once_differentiable`: double backward through a reversible stack is not supported.

When gradients are disabled (evaluation, generation) the stack is a plain loop with no custom Function.

This module imports only torch: it is copied next to saved models and must load without `longrange` installed.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.autograd.function import once_differentiable


class _RngState:
    """The RNG state that a call of f or g will consume, recorded so the call can be replayed identically."""

    def __init__(self, device: torch.device):
        self.cpu_state = torch.get_rng_state()
        # CUDA dropout draws from the device's generator; record it only when the stream is on CUDA
        self.cuda_device = device if device.type == "cuda" else None
        self.cuda_state = torch.cuda.get_rng_state(device) if self.cuda_device is not None else None

    @contextmanager
    def replayed(self):
        """Within the block the RNG is in the recorded state; the caller's RNG state is restored afterwards."""
        devices = [self.cuda_device] if self.cuda_device is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(self.cpu_state)
            if self.cuda_device is not None:
                torch.cuda.set_rng_state(self.cuda_state, self.cuda_device)
            yield


def _map_tensors(obj: Any, fn: Callable[[torch.Tensor], Any]) -> Any:
    """Apply `fn` to every tensor inside nested dicts / lists / tuples; other objects pass through unchanged."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        return {key: _map_tensors(value, fn) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(_map_tensors(value, fn) for value in obj)
    return obj


def _grad_tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors inside `obj` (nested dicts / lists / tuples) that require grad, in traversal order."""
    found: list[torch.Tensor] = []
    _map_tensors(obj, lambda t: found.append(t) if t.requires_grad else None)
    return found


class _Plan:
    """Everything the Function needs besides tensors, built once per forward call."""

    def __init__(self, blocks, f_kwargs, g_kwargs, skip, params, f_param_ids, g_param_ids, kwarg_ids):
        self.blocks = blocks  # list[(f, g)]
        self.f_kwargs = f_kwargs
        self.g_kwargs = g_kwargs
        self.skip = skip  # list[bool]
        self.params = params  # unique trainable parameters of all blocks, Function inputs in this order
        self.f_param_ids = f_param_ids  # per block: indices into `params` used by f
        self.g_param_ids = g_param_ids
        self.kwarg_ids = kwarg_ids  # id(tensor) -> index into the kwargs-tensor inputs
        self.rng: list[tuple[_RngState, _RngState] | None] = []
        self.autocast: tuple[str, bool, torch.dtype] | None = None


def _run_block(f, g, x1, x2, f_kwargs, g_kwargs, rng=None):
    """One reversible block; records the RNG state before f and g when `rng` (a list) is given."""
    if rng is not None:
        f_rng = _RngState(x2.device)
    y1 = x1 + f(x2, **f_kwargs)
    if rng is not None:
        g_rng = _RngState(y1.device)
        rng.append((f_rng, g_rng))
    y2 = x2 + g(y1, **g_kwargs)
    return y1, y2


class _ReversibleFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x1, x2, plan: _Plan, *tensors):
        # tensors = (*plan.params, *kwargs tensors that require grad); they are inputs only so that autograd
        # routes their gradients through this Function; the blocks read them from the modules / kwargs.
        device_type = x1.device.type
        plan.autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))
        for (f, g), skip in zip(plan.blocks, plan.skip):
            if skip:
                plan.rng.append(None)
                continue
            x1, x2 = _run_block(f, g, x1, x2, plan.f_kwargs, plan.g_kwargs, rng=plan.rng)
        kwarg_tensors = tensors[len(plan.params) :]
        # only the stack's outputs are kept (plus kwargs tensors, which exist anyway): the per-block
        # activations are rebuilt in backward
        ctx.save_for_backward(x1, x2, *kwarg_tensors)
        ctx.plan = plan
        return x1, x2

    @staticmethod
    @once_differentiable
    def backward(ctx, dy1, dy2):
        plan: _Plan = ctx.plan
        y1, y2, *kwarg_tensors = ctx.saved_tensors
        grads = _Gradients(plan, kwarg_tensors)
        y1, y2 = y1.detach(), y2.detach()
        for i in reversed(range(len(plan.blocks))):
            if plan.skip[i]:
                continue
            f, g = plan.blocks[i]
            f_rng, g_rng = plan.rng[i]
            # g: y2 = x2 + g(y1)  ->  x2 = y2 - g(y1); dL/dy1 gains the gradient through g
            g_out, dx = grads.through(g, "g", i, y1, g_rng, dy2)
            with torch.no_grad():
                x2 = y2 - g_out
                dy1 = dy1 + dx if dx is not None else dy1
            del g_out
            # f: y1 = x1 + f(x2)  ->  x1 = y1 - f(x2); dL/dx2 = dL/dy2 + gradient through f
            f_out, dx = grads.through(f, "f", i, x2, f_rng, dy1)
            with torch.no_grad():
                x1 = y1 - f_out
                dy2 = dy2 + dx if dx is not None else dy2
            del f_out
            # the block's inputs become the previous block's outputs; dy1 is already dL/dx1
            y1, y2 = x1.detach(), x2.detach()
        return dy1, dy2, None, *grads.params, *grads.kwargs


class _Gradients:
    """The backward pass's bookkeeping: leaves standing in for the kwargs tensors that require grad (so that their
    gradients can be collected), f's and g's kwargs with those leaves substituted, and the gradients of every
    parameter and kwargs tensor, summed over the blocks (and positions of a shared block) as the recomputation
    walks back through the stack."""

    def __init__(self, plan: _Plan, kwarg_tensors: list[torch.Tensor]):
        self.plan = plan
        self.leaves = [t.detach().requires_grad_(True) for t in kwarg_tensors]

        def substitute(t: torch.Tensor) -> torch.Tensor:
            index = plan.kwarg_ids.get(id(t))
            return t if index is None else self.leaves[index]

        given = {"f": plan.f_kwargs, "g": plan.g_kwargs}
        self.kwargs_of = {name: _map_tensors(kwargs, substitute) for name, kwargs in given.items()}
        # indices (each once, even if a tensor appears twice in the kwargs) of the leaves f and g depend on
        self.leaf_ids_of = {
            name: list(dict.fromkeys(plan.kwarg_ids[id(t)] for t in _grad_tensors(kwargs)))
            for name, kwargs in given.items()
        }
        self.param_ids_of = {"f": plan.f_param_ids, "g": plan.g_param_ids}
        self.params: list[torch.Tensor | None] = [None] * len(plan.params)
        self.kwargs: list[torch.Tensor | None] = [None] * len(self.leaves)

    def through(self, fn, which: str, block: int, x: torch.Tensor, rng: _RngState, grad_out: torch.Tensor):
        """Recompute `fn(x)` (f or g, `which`, of block `block`) as the forward pass ran it (its RNG state, its
        autocast setting), differentiate it against `grad_out`, add the gradients of its parameters and kwargs
        tensors to the totals -> (fn's output, the gradient with respect to x or None)."""
        param_ids, leaf_ids = self.param_ids_of[which][block], self.leaf_ids_of[which]
        params = [self.plan.params[j] for j in param_ids]
        leaves = [self.leaves[k] for k in leaf_ids]
        x_leaf = x.detach().requires_grad_(True)
        device_type, autocast_enabled, autocast_dtype = self.plan.autocast
        # the recomputation runs under the autocast setting of the forward pass
        with (
            torch.enable_grad(),
            torch.autocast(device_type, autocast_dtype, enabled=autocast_enabled),
            rng.replayed(),
        ):
            out = fn(x_leaf, **self.kwargs_of[which])
        grads = torch.autograd.grad(out, [x_leaf, *params, *leaves], grad_out, allow_unused=True)
        _accumulate(self.params, param_ids, grads[1 : 1 + len(params)])
        _accumulate(self.kwargs, leaf_ids, grads[1 + len(params) :])
        return out, grads[0]


def _accumulate(store: list, indices: list[int], grads) -> None:
    for index, grad in zip(indices, grads):
        if grad is not None:
            store[index] = grad if store[index] is None else store[index] + grad


def _refuse_sharded_parameters(blocks: list[tuple[nn.Module, nn.Module]]) -> None:
    """FSDP (`fully_shard`) gathers a wrapped module's parameters only around that module's own forward and backward;
    the stack calls the blocks directly and recomputes them in its backward, so inside a per-layer FSDP unit it would
    see parameter shards. Refuse clearly instead of failing deep inside an operator."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch build without torch.distributed has no sharded parameters
        return
    for f, g in blocks:
        for name, param in [*f.named_parameters(), *g.named_parameters()]:
            if isinstance(param, DTensor):
                raise RuntimeError(
                    f"reversible layers cannot run on sharded parameters ({name} is a DTensor shard): FSDP units "
                    "around the layers (auto-wrapping by `_no_split_modules`) gather parameters only inside the "
                    "layer's own forward, which the reversible stack bypasses. Train with reversible=False "
                    "(gradient checkpointing also saves activation memory) or shard only the root module "
                    "(Accelerate: fsdp_auto_wrap_policy NO_WRAP)"
                )


class ReversibleSequence(nn.Module):
    """A stack of reversible blocks y1 = x1 + f(x2), y2 = x2 + g(y1), trained without storing activations.

    blocks: (f, g) pairs, applied in order. The same pair may appear several times (weight tying across
        layers); gradients from every position are summed.
    forward(x1, x2, f_kwargs, g_kwargs, skip): `f_kwargs` / `g_kwargs` are passed to every f / g call
        (masks, encoder states, ...); tensors among them that require grad receive their gradients.
        `skip[i] = True` makes block i the identity (layer dropout, decided by the caller once per forward).
    Returns the pair (y1, y2) of the last block.
    """

    def __init__(self, blocks: list[tuple[nn.Module, nn.Module]]):
        super().__init__()
        self.blocks = nn.ModuleList(nn.ModuleList([f, g]) for f, g in blocks)

    def forward(
        self,
        x1: torch.Tensor,
        x2: torch.Tensor,
        f_kwargs: dict | None = None,
        g_kwargs: dict | None = None,
        skip: list[bool] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        f_kwargs = {} if f_kwargs is None else f_kwargs
        g_kwargs = {} if g_kwargs is None else g_kwargs
        skip = [False] * len(self.blocks) if skip is None else [bool(s) for s in skip]
        if len(skip) != len(self.blocks):
            raise ValueError(f"skip has {len(skip)} entries, expected one per block ({len(self.blocks)})")
        blocks = [(pair[0], pair[1]) for pair in self.blocks]
        _refuse_sharded_parameters(blocks)

        if not torch.is_grad_enabled():
            for (f, g), skipped in zip(blocks, skip):
                if not skipped:
                    x1, x2 = _run_block(f, g, x1, x2, f_kwargs, g_kwargs)
            return x1, x2

        # trainable parameters, each once even when blocks are shared, and per block the ones f and g use
        params: list[nn.Parameter] = []
        param_index: dict[int, int] = {}

        def indices(module: nn.Module) -> list[int]:
            out = []
            for p in module.parameters():
                if not p.requires_grad:
                    continue
                if id(p) not in param_index:
                    param_index[id(p)] = len(params)
                    params.append(p)
                out.append(param_index[id(p)])
            return out

        f_param_ids, g_param_ids = [], []
        for f, g in blocks:
            f_param_ids.append(indices(f))
            g_param_ids.append(indices(g))

        kwarg_tensors: list[torch.Tensor] = []
        kwarg_ids: dict[int, int] = {}
        for t in _grad_tensors(f_kwargs) + _grad_tensors(g_kwargs):
            if id(t) not in kwarg_ids:
                kwarg_ids[id(t)] = len(kwarg_tensors)
                kwarg_tensors.append(t)

        plan = _Plan(blocks, f_kwargs, g_kwargs, skip, params, f_param_ids, g_param_ids, kwarg_ids)
        return _ReversibleFunction.apply(x1, x2, plan, *params, *kwarg_tensors)

    def run(self, x: torch.Tensor, f_kwargs: dict, skip: list[bool], block_kwargs: list[dict] | None = None):
        """A model's layer stack: both streams start at x [b, L, e]; returns their mean after the last block.

        Without `block_kwargs` through `forward` (the memory-saving backward). `block_kwargs` (one dict per block,
        added to f's kwargs: a generation cache to fill, dicts that receive attention maps) makes it a plain loop
        over the same blocks, with the same numbers: blocks that write state must run exactly once, which the
        recomputing backward would not respect."""
        if block_kwargs is None:
            y1, y2 = self(x, x, f_kwargs=f_kwargs, skip=skip)
            return (y1 + y2) / 2
        x1 = x2 = x
        for (f, g), extra, skipped in zip(self.blocks, block_kwargs, skip):
            if not skipped:
                x1 = x1 + f(x2, **f_kwargs, **extra)
                x2 = x2 + g(x1)
        return (x1 + x2) / 2
