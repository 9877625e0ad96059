"""The generation cache of the causal Sinkhorn model (`SinkhornCache`) and its per-layer state: preallocated
buffers updated in place, so that a decoding step has static shapes and compiles to one graph.

Host-following steps (`SinkhornCache.follows_host`): the one place where the decoding path is chosen. A cache
whose buffers live on the CPU (decided once, when the prefill allocates them) reads each row's position on the
host in eager steps, since there reading a tensor is no device sync: a causal Sinkhorn head group then keeps the
keys/values of its current query buckets (chosen buckets, own bucket so far) in a working window
(`RoutingState.window`), built from the cache only when some row enters a new bucket and otherwise extended by the
new token, and skips routing on the steps where no row starts a bucket: the static step's numbers (up to float
rounding: the window is cut after the last slot any row reached) with far fewer operators. Compiled steps, every
step of a cache on an accelerator and, with `static_steps=True`, every step take the static path; there generate()
tells the cache that every row's new token is real (`SinkhornCache.plan_real_step`), so the host knows whether
some row starts a bucket, and the other steps skip routing (compiled: one graph for each case).

The calls the model makes on the cache (a prefill, one-token steps, chunks of several tokens) and their bookkeeping
are `CacheCalls` (cache_sinkhorn_calls.py), mixed into `SinkhornCache`.

Only same-folder relative imports: `save_pretrained` copies this file next to the weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.cache_utils import Cache

from .cache_sinkhorn_calls import CacheCalls, Chunk, DecodingStep, grow_to, static_buffer
from .configuration_sinkhorn import SinkhornConfig
from .layers import put_along, where
from .sinkhorn_routing import (
    additive,
    batch_head_index,
    bucket_sums,
    pick_buckets,
)


def _at_bucket(t: torch.Tensor | None, u: torch.Tensor) -> torch.Tensor | None:
    """Row u[i] of the bucket dim (2) of t [b, h, n, k] for every batch row i -> [b, h, k] (None stays None)."""
    if t is None:
        return None
    b, h, _, k = t.shape
    return t.gather(2, u[:, None, None, None].expand(b, h, 1, k))[:, :, 0]


def _join_own_bucket(window, own: torch.Tensor, kv) -> None:
    """The new token (kv: k, v [b, h, 1, d]) joins the own bucket of a kept window (keys, values [b, h, K, d], additive
    mask [b, h, 1, K]) at its slot (`own` [b], see `RoutingState._step_index`), in place."""
    keys, values, bias = window
    put_along(keys, 2, own[:, None], kv[0].to(keys.dtype))
    put_along(values, 2, own[:, None], kv[1].to(values.dtype))
    put_along(bias, 3, own[:, None], bias.new_zeros(*bias.shape[:3], 1))


def _map_state(state: dict, fn) -> dict:
    return {key: fn(val) if isinstance(val, torch.Tensor) else val for key, val in state.items()}


class RoutingState:
    """One causal Sinkhorn head group's routing state in a layer's cache (self-attention, or a causal decoder's
    cross-attention), preallocated and updated in place. The head group computes (its routing choice); this state
    stores and answers: the summaries a choice is made from, the keys and values a step attends.

    tensors: "queries" [b, h, capacity, d] (every cached query, so that `crop` can rebuild the state), "q_sum"
    [b, h, d] (the running sum of the counted queries), "route" / "route_valid" / "route_weight" [b, h, n_sel] (the
    current query bucket's choice: bank indices, null buckets first); self-attention also "k_sum" [b, h, nb, d] (per
    key bucket) and, with running_key_summary, "k_run_sum" [b, h, d]. How many tokens each sum holds is not kept:
    it follows from the row's position, since the real tokens come first (`_counted`, `key_summaries`).
    window: a host-following step's working window, ((epoch, buckets), keys, values, bias), reused while no row
    enters a new bucket."""

    def __init__(self, group: nn.Module, tensors: dict):
        self.group = group  # the head group: its bucket layout and routing options, and its choice (for `crop`)
        self.tensors = tensors
        self.window_cache: tuple | None = None

    def map(self, fn) -> None:
        self.tensors = _map_state(self.tensors, fn)

    # -- a decoding step: one new token per row ---------------------------------------------------------------------

    def step_index(self, step: DecodingStep) -> dict:
        """The index tensors of a step (`_step_index`), shared by the step's groups of the same layout in every
        layer (the step's memo): computed once per step, not once per layer (in a compiled step, kernels the
        compiler would not merge)."""
        g = self.group
        if step.memo is None:
            return self._step_index(step.position, step.real)
        key = (g.bucket_size, g.offset, g.skip_first, g.n_top)
        return step.memo.get(key) or step.memo.setdefault(key, self._step_index(step.position, step.real))

    def _step_index(self, position, real) -> dict:
        """Query bucket u [b], the tokens that enter the routing summaries (bool and float [b]) and the token's slot in
        its window (own [b])."""
        size, off = self.group.bucket_size, self.group.offset
        u = torch.div(position + off, size, rounding_mode="floor")
        counted = real & (u > 0) if self.group.skip_first else real
        own = self.group.n_top * size + (position + off) % size  # the window: the chosen buckets, then the own bucket
        return dict(u=u, counted=counted, weight=counted.float(), own=own)

    def add_token(self, q, k, position, ix: dict) -> None:
        """Self-attention: the new token (q, k [b, h, 1, d] at `position` [b]) enters its key bucket's summary and,
        where it counts, the running query sum; its query is kept."""
        t, weight = self.tensors, ix["weight"]
        new_k = k[:, :, 0].float() * weight[:, None, None]  # [b, h, d]
        if self.group.running_key_summary:
            t["k_run_sum"].add_(new_k)
            run = t["k_run_sum"] / self._counted(position, ix["counted"]).clamp_min(1)[:, None, None]
            new_k = run * weight[:, None, None]
        put_along(t["k_sum"], 2, ix["u"][:, None], new_k[:, :, None], accumulate=True)
        self.add_query(q, position, ix["counted"])

    def add_query(self, q, position, real) -> None:
        """The new query [b, h, 1, d] is kept at `position` [b] and, in rows where `real` [b], summed."""
        t = self.tensors
        put_along(t["queries"], 2, position[:, None], q.to(t["queries"].dtype))
        t["q_sum"].add_(q[:, :, 0].float() * real[:, None, None])

    def add_queries(self, q, slot) -> None:
        """A chunk's queries [b, h, L, d] are kept at their slots [b, L] (the sums follow from them: `rebuild`)."""
        put_along(self.tensors["queries"], 2, slot, q.to(self.tensors["queries"].dtype))

    def _counted(self, position, counted) -> torch.Tensor:
        """How many tokens the running sums hold [b], the new token's (at `position` [b]) included where `counted`:
        the real tokens come first (the prefill orders them so) and all count but, with skip_first, those of the
        short first bucket."""
        g = self.group
        before = (position - (g.bucket_size - g.offset)).clamp_min(0) if g.skip_first else position
        return before + counted.long()

    def query_summary(self, position, counted) -> torch.Tensor:
        """The mean of the counted queries so far [b, h, d] (float32), the new token's included where `counted`."""
        return self.tensors["q_sum"] / self._counted(position, counted).clamp_min(1)[:, None, None]

    def key_summaries(self, u: torch.Tensor, seen: torch.Tensor):
        """Key-bucket summaries [b, h, nb, d] and which buckets a query bucket u [b] may choose ([b, nb]), in rows
        whose first `seen` [b] real tokens are summed. Bucket j holds the positions from j * size - offset on."""
        g, sums = self.group, self.tensors["k_sum"]
        buckets = torch.arange(sums.shape[2], device=sums.device)
        start = buckets * g.bucket_size - g.offset
        # (`where`, not start.clamp_min(0): inductor in torch 2.11 folds a clamp of index arithmetic into a sympy Max
        # that its CUDA code generation cannot compare once the null buckets are concatenated in front)
        counts = (torch.minimum(seen[:, None], start + g.bucket_size) - torch.where(start > 0, start, 0)).clamp_min(0)
        if g.skip_first:  # the short first bucket is not summed
            counts = counts * (buckets > 0)
        sk = sums if g.running_key_summary else sums / counts.clamp_min(1)[:, None, :, None]
        return sk, (buckets[None] < u[:, None]) & (counts > 0)

    def keep_route(self, rows, idx, picked_valid, weight) -> None:
        """Store a new routing choice ([b, h, n_sel] each; weight None unless weighted) in `rows` [b]."""
        t, keep = self.tensors, rows[:, None, None]
        # in place: the state keeps its addresses (CUDA graphs replay a compiled step over the same buffers)
        for name, new in (("route", idx), ("route_valid", picked_valid), ("route_weight", weight)):
            if new is not None:
                t[name].copy_(where(keep, new, t[name]))

    def any_row_leads(self, host: tuple) -> bool:
        """Host-following step: whether some row's real token leads a bucket (so routes), read from the host."""
        g, (positions, reals) = self.group, host[:2]
        off, size = g.offset, g.bucket_size
        return any(
            r and (p + off) % size == 0 and not (g.skip_first and p + off < size) for p, r in zip(positions, reals)
        )

    def window(self, bank, heads: slice, step: DecodingStep, ix: dict, kv, routed: bool, dtype):
        """Keys, values [b, h, K, d] and additive mask [b, h, 1, K] a self-attention step attends: the chosen buckets
        of the current query bucket and the own bucket up to the token, picked from the layer's bank (keys, values
        [b, H, S, d]; this group's `heads`). A host-following step keeps the window and, while no row enters a
        new bucket and no row `routed`, only writes the new token (kv: its k, v [b, h, 1, d]) into it, cut after
        the last own-bucket slot any row has reached (the keys after it are masked in every row)."""
        if step.host is None:
            return self._static_window(bank, heads, step, ix, kv, dtype)
        size, off = self.group.bucket_size, self.group.offset
        positions, _, epoch = step.host
        buckets = [(p + off) // size for p in positions]
        window = self.window_cache
        if routed or window is None or window[0] != (epoch, buckets):
            window = ((epoch, buckets), *self._window(bank, heads, step.position, ix["u"], dtype))
            self.window_cache = window
        else:  # the same buckets: the new token joins the own bucket (its last `size` slots)
            _join_own_bucket(window[1:], ix["own"], kv)
        _, keys_all, values_all, bias = window
        end = keys_all.shape[2] - size + 1 + max((p + off) % size for p in positions)
        return keys_all[:, :, :end], values_all[:, :, :end], bias[..., :end]

    def _static_window(self, bank, heads: slice, step: DecodingStep, ix: dict, kv, dtype):
        """A static step's window, kept in the state's window buffers: built anew when the step `routes`, else (no
        row enters a new bucket: generate()'s word, see `SinkhornCache.plan_real_step`) the kept one with the new
        token joining the own bucket."""
        t = self.tensors
        kept = (t["window_keys"], t["window_values"], t["window_bias"])
        if not step.routes:
            _join_own_bucket(kept, ix["own"], kv)
            return kept[0], kept[1], kept[2].to(dtype)
        window = self._window(bank, heads, step.position, ix["u"], dtype)
        for buffer, new in zip(kept, window):
            buffer.copy_(new)
        return window

    def _window(self, bank, heads: slice, position, u, dtype):
        """The static window of `window` (K = (n_sel + 1) * bucket_size)."""
        g, t = self.group, self.tensors
        size, off, n_null = g.bucket_size, g.offset, g.n_top
        b, h = t["route"].shape[:2]
        choice = t["route"]  # [b, h, n_sel]: bank indices (null buckets first)
        which = torch.cat([choice, (n_null + u)[:, None, None].expand(b, h, 1)], dim=-1)  # chosen, then own
        keys_all, values_all = pick_buckets(bank, heads, 1 - off, size, which)  # [b, h, (n_sel + 1) B, d]
        if g.weight_routed_values:
            weight = F.pad(t["route_weight"], (0, 1), value=1.0)  # the own bucket unweighted
            weight = weight[..., None].expand(b, h, -1, size).reshape(b, h, -1, 1)
            values_all = values_all * weight.to(values_all.dtype)
            if g.weight_routed_keys:
                keys_all = keys_all * weight.to(keys_all.dtype)
        slot = torch.arange(size, device=choice.device)
        pos = (which - n_null)[..., None] * size - off + slot  # [b, h, n_sel + 1, B] token positions
        null_slots = slot >= 0 if g.null_copies else slot == 0
        routed_m = where((choice < n_null)[..., None], null_slots, pos[:, :, :-1] >= 0)
        routed_m = routed_m & t["route_valid"][..., None]
        own_m = (pos[:, :, -1:] >= 0) & (pos[:, :, -1:] <= position[:, None, None, None])
        m = torch.cat([routed_m, own_m], dim=2).reshape(b, h, 1, -1)  # [b, h, 1, K]: the token always sees itself
        return keys_all, values_all, additive(m, dtype)

    def chosen_context(self, context: dict):
        """Cross-attention: the chosen context buckets' keys, values [b, h, n_sel * Bc, d] (values, and keys with
        weight_routed_keys, times the routing weight) and mask [b, h, 1, n_sel * Bc] (context: see `fill_cross`)."""
        t, g = self.tensors, self.group
        choice, choice_valid = t["route"], t["route_valid"]  # [b, h, n_sel]
        b, h, _ = choice.shape
        d = context["bk"].shape[-1]
        bi, hi = batch_head_index(b, h, 3, choice.device)
        routed_k = context["bk"][bi, hi, choice]  # [b, h, n_sel, Bc, d]
        routed_v = context["bv"][bi, hi, choice]
        if g.weight_routed_values:
            weight = t["route_weight"][..., None, None]
            routed_v = routed_v * weight.to(routed_v.dtype)
            if g.weight_routed_keys:
                routed_k = routed_k * weight.to(routed_k.dtype)
        m = (context["bm"][bi, choice] & choice_valid[..., None]).reshape(b, h, 1, -1)
        return routed_k.reshape(b, h, -1, d), routed_v.reshape(b, h, -1, d), m

    # -- crop: the state after a shorter prefix --------------------------------------------------------------------

    def rebuild(self, length, end: int, keys=None, sk=None, k_valid=None) -> None:
        """Recompute the routing state of every row from its first `length` [b] cached queries (and keys [b, h, end,
        d], in self-attention; cross-attention passes the context's summaries sk, k_valid), as a prefill of those
        tokens would leave it: used by `SinkhornCache.crop` and chunks. `end`: the slots read, whole buckets
        holding every row's tokens (not the whole capacity: a chunk's cost follows the tokens so far)."""
        g, t = self.group, self.tensors
        size, off = g.bucket_size, g.offset
        queries = t["queries"][:, :, :end].float()  # [b, h, end, d]
        b, h, _, d = queries.shape
        pos = torch.arange(end, device=queries.device)
        bucket = torch.div(pos + off, size, rounding_mode="floor")  # [end]
        counted = pos[None] < length[:, None]  # [b, end]
        if g.skip_first:
            counted = counted & (bucket > 0)
        c = counted.float()
        u = torch.div((length - 1).clamp_min(0) + off, size, rounding_mode="floor")  # the current bucket [b]
        t["q_sum"].copy_((queries * c[:, None, :, None]).sum(2))
        if not g.cross:
            self._rebuild_key_sums(keys.float(), c)
            sk, k_valid = self.key_summaries(u, length)
        # the choice of the current bucket, made at its leading token
        lead = u * size - off  # [b] (-1: the shifted heads' virtual first token)
        upto = (pos[None] <= lead[:, None]).float() * c
        sq = (queries * upto[:, None, :, None]).sum(2) / upto.sum(1).clamp_min(1)[:, None, None]
        idx, picked_valid, weight = g.choose(sq, sk, k_valid)
        if g.skip_first:  # the short first bucket attends no chosen bucket
            picked_valid = picked_valid & (u > 0)[:, None, None]
        self.keep_route(torch.ones(b, dtype=torch.bool, device=queries.device), idx, picked_valid, weight)

    def _rebuild_key_sums(self, keys, c) -> None:
        """Self-attention's key-bucket sums (and running sums) from the cached keys [b, h, end, d] of the counted
        tokens (c [b, end] float). Bucket j holds the slots from j * size - offset on: with `offset` zero slots in
        front, whole buckets of the slots summed."""
        t, g = self.tensors, self.group
        if g.running_key_summary:
            weighted = keys * c[:, None, :, None]
            t["k_run_sum"].copy_(weighted.sum(2))
            keys = weighted.cumsum(2) / c.cumsum(1).clamp_min(1)[:, None, :, None]  # each token's running mean
        size = g.bucket_size
        weighted = F.pad(keys * c[:, None, :, None], (0, 0, g.offset, size - g.offset))
        b, h, n, d = weighted.shape
        sums = weighted[:, :, : n // size * size].reshape(b, h, n // size, size, d).sum(3)
        t["k_sum"].zero_()
        t["k_sum"][:, :, : sums.shape[2]] = sums


def _write_null_buckets(keys, values, group) -> None:
    """Put a causal group's null buckets into the cache slots before its first bucket (keys, values: the group's
    heads of the layer's bank, [b, h, S, d]), so that a decoding step picks chosen buckets from one bank."""
    size, start = group.bucket_size, 1 - group.offset
    for t, table in ((keys, group.null_keys), (values, group.null_values)):
        b, h, _, d = t.shape
        bank = t[:, :, start : start + group.n_top * size].view(b, h, group.n_top, size, d)
        bank.copy_(table.detach()[None, :, :, None, :].to(t.dtype).expand_as(bank))


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
        self.groups: list[RoutingState | None] = []  # per head group of the self-attention (None: local heads)
        self.slices: list[tuple[int, int]] = []  # each group's heads
        self.cross_state: RoutingState | None = None
        self.context: dict | None = None

    @property
    def is_stepping(self) -> bool:
        return self.owner.prefilled

    def fill_self(self, q, k, v, records, groups, slices):
        """After the prefill pass: q, k, v [b, H, L', d] with each row's real tokens first (L' >= L, the prompt)."""
        owner = self.owner
        n, nb, origin = owner.prefill_length, owner.bucket_capacity, owner.origin
        b, _, _, d = k.shape
        self.keys = static_buffer(k.new_zeros(b, k.shape[1], owner.slots, d))
        self.values = static_buffer(v.new_zeros(b, v.shape[1], owner.slots, d))
        self.keys[:, :, origin : origin + n] = k[:, :, :n].detach()
        self.values[:, :, origin : origin + n] = v[:, :, :n].detach()
        self.groups, self.slices = [], list(slices)
        for record, group, (s, e) in zip(records, groups, slices):
            state = None  # (local heads: nothing to keep)
            if record:
                _write_null_buckets(self.keys[:, s:e], self.values[:, s:e], group)
                u = torch.div(
                    (owner.lengths - 1).clamp_min(0) + record["offset"], owner.bucket_size, rounding_mode="floor"
                )
                state = self._routing_state(q[:, s:e], record, u)
                state["k_sum"] = grow_to(record["k_sum"].detach(), 2, nb).clone()
                if "k_run_sum" in record:
                    state["k_run_sum"] = record["k_run_sum"].detach().clone()
                width = (group.n_top + 1) * owner.bucket_size  # a step's window: the chosen buckets, the own one
                state["window_keys"], state["window_values"] = (t.new_zeros(b, e - s, width, d) for t in (k, v))
                state["window_bias"] = q.new_zeros(b, e - s, 1, width)
                state = RoutingState(group, _map_state(state, static_buffer))
            self.groups.append(state)

    def _routing_state(self, q, record, u):
        n, cap = self.owner.prefill_length, self.owner.capacity
        b, h, _, d = q.shape
        queries = q.new_zeros(b, h, cap, d)
        queries[:, :, :n] = q[:, :, :n].detach()
        state = {
            "queries": queries,
            "q_sum": record["q_sum"].detach().clone(),
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
        self.cross_state = RoutingState(heads, _map_state(self._routing_state(q, record, u), static_buffer))

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
            self.keys, self.values = (static_buffer(grow_to(t, 2, slots)) for t in (self.keys, self.values))
        for state in self._routing_states():
            for name, dim, size in (("queries", 2, capacity), ("k_sum", 2, bucket_capacity)):
                if name in state.tensors:
                    state.tensors[name] = static_buffer(grow_to(state.tensors[name], dim, size))

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of this layer's state by name (keys, values, each routing state's and the context's)."""
        named = {"keys": self.keys, "values": self.values}
        for j, state in enumerate([*self.groups, self.cross_state]):  # (the cross-attention's last)
            if state is not None:
                named.update({f"routing.{j}.{name}": t for name, t in state.tensors.items()})
        named.update({f"context.{name}": t for name, t in (self.context or {}).items()})
        return {name: t for name, t in named.items() if isinstance(t, torch.Tensor)}

    def _routing_states(self) -> list[RoutingState]:
        return [state for state in [*self.groups, self.cross_state] if state is not None]

    def rebuild(self, lengths: torch.Tensor, end: int, cross: bool | None = None) -> None:
        """The routing state after the first `lengths` [b] real tokens of every row, all within the first `end` slots
        (whole buckets; see `SinkhornCache.crop`): of the self-attention (cross False), the cross-attention (True)
        or both (None)."""
        origin = self.owner.origin
        for state, (s, e) in zip(self.groups, self.slices):
            if state is not None and cross is not True:
                state.rebuild(lengths, end, keys=self.keys[:, s:e, origin : origin + end])
        if self.cross_state is not None and cross is not False:
            self.cross_state.rebuild(lengths, end, sk=self.context["sk"], k_valid=self.context["k_valid"])

    @property
    def chunk(self) -> Chunk | None:
        """The chunk under way (several new tokens per row), or None (a prefill or a one-token step)."""
        return self.owner.chunk

    def write_chunk(self, q, k, v):
        """Self-attention of a chunk: writes the new tokens' keys, values [b, H, L, d] and (each routing group's)
        queries at their slots -> the queries, keys and values [b, H, T, d] of every token so far, each row's real
        tokens first in order (as a prefill lays them out), and their mask [b, T]. The local heads keep no queries:
        theirs before the chunk are zeros (a local head's output at a token depends on its own query only)."""
        chunk, origin = self.owner.chunk, self.owner.origin
        put_along(self.keys, 2, origin + chunk.slot, k.to(self.keys.dtype))
        put_along(self.values, 2, origin + chunk.slot, v.to(self.values.dtype))
        end = chunk.length
        queries = []
        for state, (s, e) in zip(self.groups, self.slices):
            if state is None:
                queries.append(q.new_zeros(q.shape[0], e - s, end, q.shape[3]))
            else:
                state.add_queries(q[:, s:e], chunk.slot)
                queries.append(state.tensors["queries"][:, :, :end].to(q.dtype))
        q_all = torch.cat(queries, dim=1)
        put_along(q_all, 2, chunk.slot, q)
        return q_all, self.keys[:, :, origin : origin + end], self.values[:, :, origin : origin + end], chunk.real()

    def chunk_context(self, q):
        """Cross-attention of a chunk: writes the new tokens' queries [b, h, L, d] -> the queries [b, h, T, d] of
        every token so far (see `write_chunk`), their mask [b, T], and the context's keys, values [b, h, Lc, d] and
        mask [b, Lc] as the prefill kept them."""
        chunk, state, context = self.owner.chunk, self.cross_state, self.context
        state.add_queries(q, chunk.slot)
        q_all = state.tensors["queries"][:, :, : chunk.length].to(q.dtype)
        b, h, nk, size, d = context["bk"].shape
        keys, values = (context[name].reshape(b, h, nk * size, d) for name in ("bk", "bv"))
        return q_all, chunk.real(), keys, values, context["bm"].reshape(b, nk * size)

    def _apply(self, fn):
        if self.keys is not None:
            self.keys, self.values = fn(self.keys), fn(self.values)
        for state in self._routing_states():
            state.map(fn)
        if self.context is not None:
            self.context = _map_state(self.context, fn)


class SinkhornCache(CacheCalls, Cache):
    """Generation cache of a causal Sinkhorn model.

    Static shapes: every buffer is preallocated to `max_cache_len` tokens (generate() passes its maximum length;
    default `max_position_embeddings`) and a decoding step updates it in place with index arithmetic, never
    reading a tensor value on the host, so the step compiles to one graph (`is_compileable`). Each row keeps its
    real tokens left-aligned (padding dropped) with its own length: buckets start at a row's first real token, so
    a row's outputs do not depend on its padding or on the other rows. Each new token costs attention over its
    own bucket, `n_top_buckets` chosen buckets (and the local window for local heads), not the sequence.

    Several new tokens per row run as one chunk (`begin_chunk`: the layers attend over every token so far, which
    the cache holds, then rebuild their routing state) or, a few on a long cache, one at a time (`takes_chunk`).
    `crop` rebuilds the routing state of a shorter prefix from the cached queries and keys (assisted and
    prompt-lookup decoding). An eager call that needs more room than `max_cache_len` grows the buffers (in whole
    buckets, up to `max_position_embeddings`). Steps of a CPU cache follow the host (`follows_host`, see the
    module docstring).
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
        self.bucket_size, self.num_layers = config.bucket_size, config.num_hidden_layers
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
        self.step_memo = None  # during a decoding step: the index tensors its layers share (RoutingState.step_index)
        self.host_epoch = 0  # bumped whenever the state changes outside host-following steps (windows go stale)
        self.step_routes = None  # for the next step only: whether some row's token leads a bucket (plan_real_step)
        self._pads_host = None  # (host_epoch, each row's padding tokens so far), read back by plan_real_step
        self._window_epoch = None  # the host_epoch of the static steps' kept windows (None: not kept)
        self._compiled_step = False  # a compiled step ran since the last eager one (windows are stale)
        # while attention maps are asked for (output_attentions): (embeddings [b, n, e], position ids [b, n],
        # context, context mask) of every token given so far, for the maps of later cached steps
        self.recorded = None
        self.chunk: Chunk | None = None  # during a call with several new tokens per row (begin_chunk)

    # -- bookkeeping used by the model -------------------------------------------------------------------------

    @property
    def bucket_capacity(self) -> int:
        return self.capacity // self.bucket_size + 2

    @property
    def slots(self) -> int:
        """Key/value slots per layer, whole buckets: the null buckets (and the shifted heads' virtual token), the
        positions and slack for bucket views."""
        return self.origin - 1 + self.capacity + 3 * self.bucket_size

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
            return static_buffer(fn(t))

        self.lengths = remap(self.lengths)
        self.token_mask = remap(self.token_mask)
        if self.recorded is not None:
            self.recorded = tuple(None if t is None else fn(t) for t in self.recorded)
        for layer in self.layers:
            layer._apply(remap)

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """Every tensor of the decoding state by name, which a step reads and updates in place (after a prefill)."""
        named = {"lengths": self.lengths, "token_mask": self.token_mask, "seen": self.seen}
        for i, layer in enumerate(self.layers):
            named.update({f"layers.{i}.{name}": t for name, t in layer.state_tensors().items()})
        return named

    def record_inputs(self, embeds, positions, context=None, context_mask=None) -> None:
        """Keeps the given tokens' embeddings and positions (and, first, the context) for attention maps of
        later cached steps (`sinkhorn_steps.step_with_attentions`)."""
        embeds = embeds.detach()
        if self.recorded is not None:  # (the context is recorded once, first)
            old_embeds, old_positions, context, context_mask = self.recorded
            embeds, positions = torch.cat([old_embeds, embeds], 1), torch.cat([old_positions, positions], 1)
        self.recorded = (embeds, positions, context, context_mask)

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply(lambda t: t.index_select(0, beam_idx.to(t.device)))

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply(lambda t: t.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply(lambda t: t[indices])

    def activate_past_recording(self, **kwargs) -> None:
        """Nothing to switch on (nor recurrent states to keep): every token's keys and values are kept for `crop`."""

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
        end = max(math.ceil(keep / self.bucket_size), 1) * self.bucket_size
        for layer in self.layers:
            layer.rebuild(self.lengths, end)
