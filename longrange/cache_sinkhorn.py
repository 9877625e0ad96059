"""The generation cache of the causal Sinkhorn model (`SinkhornCache`) and its per-layer state: preallocated
buffers updated in place, so that a decoding step has static shapes and compiles to one graph.

Only same-folder relative imports: `save_pretrained` copies this file next to the weights.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import nn
from transformers.cache_utils import Cache

from .configuration_sinkhorn import SinkhornConfig
from .layers import put_along
from .sinkhorn_routing import bucket_sums


def _grow(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] >= size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype, device=t.device)], dim=dim)


def _at_bucket(t: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor | None:
    """Row u[i] of the bucket dim (2) of t [b, h, n, k] for every batch row i -> [b, h, k] (None stays None)."""
    if t is None:
        return None
    b, h, _, k = t.shape
    return t.gather(2, u[:, None, None, None].expand(b, h, 1, k))[:, :, 0]


def _map_state(state: dict, fn) -> dict:
    return {key: fn(val) if isinstance(val, torch.Tensor) else val for key, val in state.items()}


def _static(t: torch.Tensor) -> torch.Tensor:
    """Mark a cache tensor as living at a fixed address (it is updated in place), so that compiled decoding steps
    (CUDA graphs included) keep reading and writing it without copies, as transformers' StaticCache does."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(t)
    return t


class DecodingStep(NamedTuple):
    """What a layer needs to know about the decoding step under way (one new token per row).

    position: [b] long, each row's real tokens so far (the new token's position and cache slot - origin);
    real: [b] bool, whether the row's new token is real (padding enters no summary and moves no position);
    host: None (a static step), or (positions, reals, epoch, memo) in a host-following step: the same numbers as
        Python lists, the cache's epoch (working windows built before it are stale) and a dict in which the
        step's head groups share index tensors (see `CausalSinkhornHeads.step`);
    origin: the key/value slot of position 0."""

    position: torch.Tensor
    real: torch.Tensor
    host: tuple | None
    origin: int


class SinkhornLayerState:
    """Cache of one layer, preallocated to the cache's capacity and updated in place: keys/values of every past
    real token (all heads; each row's tokens left-aligned, padding dropped: position p at slot `origin + p`, the
    slots before it hold each causal Sinkhorn group's null buckets, so that the buckets a step attends are picked
    from one bank by index; whole buckets of slack after the last position); per causal Sinkhorn head group the
    queries (so that `crop` can rebuild the routing state), the running query sum, per-key-bucket sums and the
    chosen buckets of the current query bucket; for cross-attention the bucketed context keys/values and their
    summaries."""

    is_compileable = True
    is_sliding = False
    is_linear = False

    def __init__(self, owner: SinkhornCache):
        self.owner = owner
        self.keys = self.values = None  # [b, H, slots, d]
        self.groups: list[dict] = []
        self.heads: list[nn.Module] = []  # the head group of each entry of `groups` and its heads (for `crop`)
        self.slices: list[tuple[int, int]] = []
        self.cross_state: dict | None = None
        self.cross_heads: nn.Module | None = None
        self.context: dict | None = None

    @property
    def is_stepping(self) -> bool:
        return self.owner.prefilled

    def fill_self(self, q, k, v, records, groups, slices):
        """After the prefill pass: q, k, v [b, H, L', d] with each row's real tokens first (L' >= L, the prompt)."""
        owner = self.owner
        n, nb, origin = owner.prefill_length, owner.bucket_capacity, owner.origin
        b, _, _, d = k.shape
        self.keys = _static(k.new_zeros(b, k.shape[1], owner.slots, d))
        self.values = _static(v.new_zeros(b, v.shape[1], owner.slots, d))
        self.keys[:, :, origin : origin + n] = k[:, :, :n].detach()
        self.values[:, :, origin : origin + n] = v[:, :, :n].detach()
        self.groups, self.heads, self.slices = [], list(groups), list(slices)
        for record, group, (s, e) in zip(records, groups, slices):
            state = {}
            if record:
                group.write_null_buckets(self.keys[:, s:e], self.values[:, s:e])
                u = torch.div(
                    (owner.lengths - 1).clamp_min(0) + record["offset"], owner.bucket_size, rounding_mode="floor"
                )
                state = self._routing_state(q[:, s:e], record, u)
                state["k_sum"] = _grow(record["k_sum"].detach(), 2, nb).clone()
                state["k_count"] = _grow(record["k_count"], 1, nb).clone()
                if "k_run_sum" in record:
                    state["k_run_sum"] = record["k_run_sum"].detach().clone()
                    state["k_run_count"] = record["k_run_count"].clone()
                state = _map_state(state, _static)
            self.groups.append(state)

    def _routing_state(self, q, record, u):
        n, cap = self.owner.prefill_length, self.owner.capacity
        b, h, _, d = q.shape
        queries = q.new_zeros(b, h, cap, d)
        queries[:, :, :n] = q[:, :, :n].detach()
        state = {
            "queries": queries,
            "q_sum": record["q_sum"].detach().clone(),
            "q_count": record["q_count"].clone(),
            "route": _at_bucket(record["route"], u),
            "route_valid": _at_bucket(record["route_valid"], u),
        }
        if record["route_weight"] is not None:
            state["route_weight"] = _at_bucket(record["route_weight"], u)
        return state

    def fill_cross(self, q, k, v, context_mask, record, heads):
        b, h, lc, d = k.shape
        kv_bucket = heads.kv_bucket_size
        nk = lc // kv_bucket
        k, v = k.detach(), v.detach()
        k_sums, k_counts = bucket_sums(k, context_mask, kv_bucket)
        self.context = {
            "bk": k.reshape(b, h, nk, kv_bucket, d),
            "bv": v.reshape(b, h, nk, kv_bucket, d),
            "bm": context_mask.view(b, nk, kv_bucket),
            "sk": k_sums / k_counts.clamp_min(1)[:, None, :, None],
            "k_valid": k_counts > 0,
        }
        u = torch.div((self.owner.lengths - 1).clamp_min(0), self.owner.bucket_size, rounding_mode="floor")
        self.cross_state = _map_state(self._routing_state(q, record, u), _static)
        self.cross_heads = heads

    @property
    def step(self) -> DecodingStep:
        """The decoding step under way (positions, real tokens, the host's view of them; see `SinkhornCache`)."""
        return self.owner.step

    def update(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, DecodingStep]:
        """transformers' `Cache.update` for a decoding step: writes the new token's keys/values [b, H, 1, d] at each
        row's position, in place -> the layer's whole key and value bank [b, H, slots, d] (null buckets, then
        each row's real tokens from slot `origin` on) and the step."""
        step = self.owner.step
        slot = (step.position + step.origin)[:, None]
        put_along(self.keys, 2, slot, k)
        put_along(self.values, 2, slot, v)
        return self.keys, self.values, step

    def resize(self, capacity: int, bucket_capacity: int) -> None:
        """Grow every per-token and per-bucket buffer (eager calls only: shapes change)."""
        if self.keys is not None:
            slots = self.owner.slots
            self.keys, self.values = (_static(_grow(t, 2, slots)) for t in (self.keys, self.values))
        for state in [*self.groups, self.cross_state or {}]:
            for name, dim, size in (
                ("queries", 2, capacity),
                ("k_sum", 2, bucket_capacity),
                ("k_count", 1, bucket_capacity),
            ):
                if name in state:
                    state[name] = _static(_grow(state[name], dim, size))

    def rebuild(self, lengths: torch.Tensor) -> None:
        """The routing state after the first `lengths` [b] real tokens of every row (see `SinkhornCache.crop`)."""
        origin = self.owner.origin
        for heads, state, (s, e) in zip(self.heads, self.groups, self.slices):
            if state:
                heads.rebuild(state, lengths, keys=self.keys[:, s:e, origin : origin + self.owner.capacity])
        if self.cross_state is not None:
            self.cross_heads.rebuild(self.cross_state, lengths, sk=self.context["sk"], k_valid=self.context["k_valid"])

    def _apply(self, fn):
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)
        self.groups = [_map_state(state, fn) for state in self.groups]
        if self.cross_state is not None:
            self.cross_state = _map_state(self.cross_state, fn)
        if self.context is not None:
            self.context = _map_state(self.context, fn)


class SinkhornCache(Cache):
    """Generation cache of a causal Sinkhorn model.

    Static shapes: every buffer is preallocated to `max_cache_len` tokens (generate() passes its maximum length;
    default `max_position_embeddings`) and a decoding step updates it in place with index arithmetic, never
    reading a tensor value on the host, so the step compiles to one graph (`is_compileable`). Each row keeps its
    real tokens left-aligned (padding dropped) with its own length: buckets start at a row's first real token, so
    a row's outputs do not depend on its padding or on the other rows. Each new token costs attention over its
    own bucket, `n_top_buckets` chosen buckets (and the local window for local heads), not the sequence.

    `crop` rebuilds the routing state of a shorter prefix from the cached queries and keys (assisted and
    prompt-lookup decoding). An eager call that needs more room than `max_cache_len` grows the buffers (in whole
    buckets, up to `max_position_embeddings`).

    Host-following steps (`follows_host`): the one place where the decoding path is chosen. A cache whose
    buffers live on the CPU (decided once, when the prefill allocates them) reads each row's position on the
    host in eager steps, since there reading a tensor is no device sync: a causal Sinkhorn head group then keeps
    the keys/values of its current query buckets (chosen buckets, own bucket so far) in a working window, built
    from the cache only when some row enters a new bucket and otherwise extended by the new token, and skips
    routing on the steps where no row starts a bucket: the static step's numbers (up to float rounding: the
    window is cut after the last slot any row reached) with far fewer operators. Compiled steps, every step of a
    cache on an accelerator and, with `static_steps=True`, every step take the static path.
    """

    model_type = "sinkhorn"  # the model it belongs to (a cache handed to the other model is refused)

    def __init__(
        self,
        config: SinkhornConfig,
        max_cache_len: int | None = None,
        compileable: bool = True,
        static_steps: bool = False,
    ):
        super().__init__(layers=[])
        self.config = config
        self._compileable = compileable
        self.static_steps = static_steps  # True: eager CPU steps too take the static path (see `follows_host`)
        self.bucket_size = config.bucket_size
        self.num_layers = config.num_hidden_layers
        limit = config.max_position_embeddings
        if max_cache_len is not None and max_cache_len < 1:
            raise ValueError(f"SinkhornCache: max_cache_len must be a positive number of tokens, got {max_cache_len}")
        self._max_len = limit if max_cache_len is None else min(max_cache_len, limit)
        self.capacity = math.ceil(self._max_len / self.bucket_size) * self.bucket_size
        # key/value slot of position 0: after the null buckets (and one slot for the shifted heads' virtual token)
        self.origin = 1 + config.n_top_buckets * self.bucket_size
        self.layers = [SinkhornLayerState(self) for _ in range(self.num_layers)]
        self.prefilled = False
        self.prefill_length = 0
        self.lengths = None  # [b] real tokens per row: the cache position (and position id) of the next one
        self.token_mask = None  # [b, capacity] bool: which of the tokens given so far were real, in their order
        self.seen = None  # 0-dim tensor: tokens given so far, padding included
        self._seen_host = 0  # the same on the host, kept by eager calls (None after a compiled step)
        self.step_real = None  # [b] during a decoding step: whether the row's new token is real
        self.on_host = False  # set by begin_prefill: buffers on the CPU and not static_steps (`follows_host`)
        self.step_host = None  # during a host-following step: (positions, real) of every row, Python lists
        self.step_memo = None  # and the index tensors its layers share (see CausalSinkhornHeads.step)
        self.host_epoch = 0  # bumped whenever the state changes outside host-following steps (windows go stale)
        self._compiled_step = False  # a compiled step ran since the last eager one (windows are stale)
        # while attention maps are asked for (output_attentions): (embeddings [b, n, e], position ids [b, n],
        # context, context mask) of every token given so far, for the maps of later cached steps
        self.recorded = None

    # -- bookkeeping used by the model -------------------------------------------------------------------------

    @property
    def bucket_capacity(self) -> int:
        return self.capacity // self.bucket_size + 2

    @property
    def slots(self) -> int:
        """Key/value slots per layer, whole buckets: the null buckets (and the shifted heads' virtual token), the
        positions and slack for bucket views."""
        return self.origin - 1 + self.capacity + 3 * self.bucket_size

    def reserve(self, total: int) -> None:
        """Make room for `total` tokens (padding included): eager calls only, in whole buckets."""
        if total <= self.capacity:
            return
        limit = self.config.max_position_embeddings
        if total > limit:
            raise ValueError(f"SinkhornModel: sequence length {total} exceeds max_position_embeddings ({limit})")
        capacity = min(max(total, 2 * self.capacity), limit)
        self.capacity = math.ceil(capacity / self.bucket_size) * self.bucket_size
        self._max_len = max(self._max_len, total)
        if self.token_mask is not None:
            self.token_mask = _static(_grow(self.token_mask, 1, self.capacity))
            for layer in self.layers:
                layer.resize(self.capacity, self.bucket_capacity)

    def begin_prefill(self, mask: torch.Tensor) -> None:
        b, n = mask.shape
        self.reserve(n)
        self.token_mask = _static(torch.zeros(b, self.capacity, dtype=torch.bool, device=mask.device))
        self.token_mask[:, :n] = mask
        self.lengths = _static(mask.sum(1))
        self.seen = _static(torch.tensor(n, device=mask.device))
        self._seen_host = n
        self.prefill_length = n
        self.on_host = mask.device.type == "cpu" and not self.static_steps
        self.host_epoch += 1

    def end_prefill(self) -> None:
        self.prefilled = True

    def begin_step(self, real: torch.Tensor) -> None:
        if not torch.compiler.is_compiling() and self._seen_host is not None:
            self.reserve(self._seen_host + 1)
        self.step_real = real
        self.step_host = None
        if self.follows_host:
            if self._compiled_step:
                self.host_epoch, self._compiled_step = self.host_epoch + 1, False
            self.step_host, self.step_memo = (self.lengths.tolist(), real.tolist()), {}
        self.token_mask.scatter_(1, self.seen.view(1, 1).expand(real.shape[0], 1), real[:, None])

    def end_step(self, real: torch.Tensor) -> None:
        self.lengths.add_(real.long())
        self.seen.add_(1)
        self.step_real = self.step_host = self.step_memo = None
        if torch.compiler.is_compiling():
            self._seen_host = None
            self._compiled_step = True  # (written, never read, in the graph: no guard on it)
        elif self._seen_host is not None:
            self._seen_host += 1

    @property
    def step(self) -> DecodingStep:
        """The decoding step under way (between `begin_step` and `end_step`)."""
        host = None if self.step_host is None else (*self.step_host, self.host_epoch, self.step_memo)
        return DecodingStep(self.lengths, self.step_real, host, self.origin)

    @property
    def follows_host(self) -> bool:
        """Whether this step reads positions on the host (see the class docstring): a CPU cache, not compiling."""
        return not torch.compiler.is_compiling() and self.on_host

    # -- Cache API ----------------------------------------------------------------------------------------------

    def get_seq_length(self, layer_idx: int = 0) -> int:
        if self.seen is None:
            return 0
        if self._seen_host is None:  # after compiled steps: read it back once
            self._seen_host = int(self.seen)
        return self._seen_host

    @property
    def max_cache_len(self) -> int:
        """Tokens the buffers hold (a read-only property of transformers' Cache before 5.24, so it is one here)."""
        return self._max_len

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self._max_len

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self._max_len

    @property
    def is_compileable(self) -> bool:
        return self._compileable

    @property
    def is_initialized(self) -> bool:
        return self.prefilled

    @property
    def is_sliding(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_linear(self) -> list[bool]:
        return [False] * self.num_layers

    @property
    def is_croppable(self) -> bool:
        return True

    @property
    def batch_size(self) -> int:
        return 0 if self.lengths is None else self.lengths.shape[0]

    def _apply(self, fn) -> None:
        if self.lengths is None:
            return
        self.host_epoch += 1

        def remap(t):  # the new tensors are updated in place too
            return _static(fn(t))

        self.lengths = remap(self.lengths)
        self.token_mask = remap(self.token_mask)
        if self.recorded is not None:
            self.recorded = tuple(None if t is None else fn(t) for t in self.recorded)
        for layer in self.layers:
            layer._apply(remap)

    def record_inputs(self, embeds, positions, context=None, context_mask=None) -> None:
        """Keeps the given tokens' embeddings and positions (and, first, the context) for attention maps of
        later cached steps (`SinkhornModel._step_with_attentions`)."""
        if self.recorded is None:
            self.recorded = (embeds.detach(), positions, context, context_mask)
        else:
            old_embeds, old_positions, context, context_mask = self.recorded
            self.recorded = (torch.cat([old_embeds, embeds.detach()], 1), torch.cat([old_positions, positions], 1),
                             context, context_mask)  # fmt: skip

    def record_step_inputs(self, embeds, positions, mask):
        """Records a cached step's inputs (embeddings [b, n, e], position ids and padding mask [b, n]) -> those of
        every token given so far, for a forward without the cache that gives the step's attention maps
        (`SinkhornModel._step_with_attentions`): (embeddings, position ids, mask, context, context mask)."""
        if self.recorded is None:
            raise ValueError(
                "SinkhornModel: output_attentions on tokens fed on top of a filled cache needs the forward that "
                "filled it to ask for output_attentions too"
            )
        past = self.recorded[0].shape[1]
        full_mask = torch.cat([self.token_mask[:, :past], mask], dim=1)
        self.record_inputs(embeds, positions)
        all_embeds, all_positions, context, context_mask = self.recorded
        return all_embeds, all_positions, full_mask, context, context_mask

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices])

    def activate_past_recording(self) -> None:
        """Nothing to switch on: keys, values and queries of every token are kept, so `crop` can always restore."""

    def reset(self) -> None:
        self.__init__(self.config, self.max_cache_len, self._compileable, self.static_steps)

    def crop(self, max_length: int) -> None:
        """Keep the first `max_length` tokens given (padding included), or drop the last `-max_length` tokens when
        it is <= 0 (transformers' convention: `crop(-k)`), restoring exactly the state after those tokens."""
        total = self.get_seq_length()
        keep = max_length if max_length > 0 else total + max_length
        if not 0 <= keep <= total:
            raise ValueError(f"SinkhornCache.crop: cannot keep {keep} tokens of {total} (max_length={max_length})")
        if keep == total:
            return
        self.token_mask[:, keep:] = False
        if self.recorded is not None:
            embeds, positions, context, context_mask = self.recorded
            self.recorded = (embeds[:, :keep], positions[:, :keep], context, context_mask)
        self.lengths.copy_(self.token_mask[:, :keep].sum(1))
        self.seen.fill_(keep)
        self._seen_host = keep
        self.host_epoch += 1
        for layer in self.layers:
            layer.rebuild(self.lengths)
