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
        # leaves standing in for the kwargs tensors that require grad, so their gradients can be collected
        kwarg_leaves = [t.detach().requires_grad_(True) for t in kwarg_tensors]

        def substitute(t: torch.Tensor) -> torch.Tensor:
            index = plan.kwarg_ids.get(id(t))
            return t if index is None else kwarg_leaves[index]

        f_kwargs = _map_tensors(plan.f_kwargs, substitute)
        g_kwargs = _map_tensors(plan.g_kwargs, substitute)
        # indices (each once, even if a tensor appears twice in the kwargs) of the leaves f and g depend on
        f_leaf_ids = list(dict.fromkeys(plan.kwarg_ids[id(t)] for t in _grad_tensors(plan.f_kwargs)))
        g_leaf_ids = list(dict.fromkeys(plan.kwarg_ids[id(t)] for t in _grad_tensors(plan.g_kwargs)))
        f_leaves = [kwarg_leaves[k] for k in f_leaf_ids]
        g_leaves = [kwarg_leaves[k] for k in g_leaf_ids]

        param_grads: list[torch.Tensor | None] = [None] * len(plan.params)
        kwarg_grads: list[torch.Tensor | None] = [None] * len(kwarg_leaves)

        def accumulate(store, index, grad):
            if grad is not None:
                store[index] = grad if store[index] is None else store[index] + grad

        device_type, autocast_enabled, autocast_dtype = plan.autocast

        def autocast():
            # the recomputation runs under the autocast setting of the forward pass
            return torch.autocast(device_type, autocast_dtype, enabled=autocast_enabled)

        y1, y2 = y1.detach(), y2.detach()
        for i in reversed(range(len(plan.blocks))):
            if plan.skip[i]:
                continue
            f, g = plan.blocks[i]
            f_rng, g_rng = plan.rng[i]
            f_params = [plan.params[j] for j in plan.f_param_ids[i]]
            g_params = [plan.params[j] for j in plan.g_param_ids[i]]

            # g: y2 = x2 + g(y1)  ->  x2 = y2 - g(y1); dL/dy1 gains the gradient through g
            y1_leaf = y1.requires_grad_(True)
            with torch.enable_grad(), autocast(), g_rng.replayed():
                g_out = g(y1_leaf, **g_kwargs)
            grads = torch.autograd.grad(g_out, [y1_leaf, *g_params, *g_leaves], dy2, allow_unused=True)
            with torch.no_grad():
                x2 = y2 - g_out
                dy1 = dy1 + grads[0] if grads[0] is not None else dy1
            for j, grad in zip(plan.g_param_ids[i], grads[1 : 1 + len(g_params)]):
                accumulate(param_grads, j, grad)
            for k, grad in zip(g_leaf_ids, grads[1 + len(g_params) :]):
                accumulate(kwarg_grads, k, grad)
            del g_out, grads

            # f: y1 = x1 + f(x2)  ->  x1 = y1 - f(x2); dL/dx2 = dL/dy2 + gradient through f
            x2_leaf = x2.detach().requires_grad_(True)
            with torch.enable_grad(), autocast(), f_rng.replayed():
                f_out = f(x2_leaf, **f_kwargs)
            grads = torch.autograd.grad(f_out, [x2_leaf, *f_params, *f_leaves], dy1, allow_unused=True)
            with torch.no_grad():
                x1 = y1.detach() - f_out
                dy2 = dy2 + grads[0] if grads[0] is not None else dy2
            for j, grad in zip(plan.f_param_ids[i], grads[1 : 1 + len(f_params)]):
                accumulate(param_grads, j, grad)
            for k, grad in zip(f_leaf_ids, grads[1 + len(f_params) :]):
                accumulate(kwarg_grads, k, grad)
            del f_out, grads

            # the block's inputs become the previous block's outputs; dy1 is already dL/dx1
            y1, y2 = x1.detach(), x2.detach()
        return dy1, dy2, None, *param_grads, *kwarg_grads


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
