"""The static (decoding) form of `CompressiveMemoryCache`: fixed-size slot buffers and per-row counters, updated in
place, so that a one-token decoding step has fixed shapes, reads nothing back to the host and compiles to one graph.

`StaticLayout` gives the sizes; `to_static` / `to_compact` convert a cache between its two forms; `rewind` is
`crop`'s work on the counters; `DecodeStep` is one decoding step's plan (the new token's slot, what each slot's relative distance is, which rows evict what)
that the model's layers use while they attend, and that writes the step's memory update into the cache. The
layers' compression functions reach this module only as the `compressor` argument (a decoder layer:
`compress_memory`, `project_memory`, and its `compress` module).

Only same-folder relative imports: `save_pretrained` copies this file next to the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .compression import DilatedConvCompression
from .layers import put_along, where


@dataclass(frozen=True)
class StaticLayout:
    """Sizes of the static (decoding) form of the cache, from the config.

    Per row and layer, the attended buffers hold `c_ring` compressed slots then `ring` token slots. Tokens are
    numbered per row, counting only tokens the row really has (padding never enters): token a lives in slot
    c_ring + a % ring, compressed entry e (the e-th produced) in slot e % c_ring. A row's counters say which are
    held: tokens [start, seen) (memory, then the `pending` tokens of its unfinished segment) and compressed
    entries [compressed - c_mem_len, compressed). The relative distance of a query token q to token a is q - a, to
    compressed entry e (q - start) + (compressed - e): exactly its distance in the compact layout
    [c_mem, mem, pending].
    Evictions take whole groups of `rate` tokens (start is a multiple of the rate; the rate is 1 when c_mem_len is
    0: Transformer-XL, nothing compressed, no compressed slots). Compressed entry e is always made from group e
    (tokens [rate e, rate (e + 1))), since start = rate * compressed. With a compression that maps each group to one
    entry on its own (`grouped`: all but "most_used"), branch-free steps compress and project each group while its
    tokens arrive, straight into the compressed slot it will hold once evicted (the compressed ring has room for
    every held group beside the compressed memory, unseen until evicted): an eviction copies nothing (the dilated
    convolution: one entry, its block's first group compressed alone, from the `leading` group buffers).
    A cache that can be cropped by up to `margin` tokens keeps `margin` more token and group slots, and compressed
    slots for the entries of the completions a crop may undo, with the counters before its last `history`
    completions: a crop then only rewinds the counters.
    """

    c_mem_len: int
    mem_len: int
    segment_length: int
    rate: int
    grouped: bool
    margin: int = 0

    @classmethod
    def for_config(cls, config, margin: int = 0) -> StaticLayout:
        """The layout of a model's config, for a cache croppable by up to `margin` tokens."""
        compresses = config.c_mem_len > 0
        return cls(
            config.c_mem_len,
            config.mem_len,
            config.segment_length,
            config.compression_rate if compresses else 1,
            grouped=compresses and config.compression_function != "most_used",
            margin=margin,
        )

    @property
    def capacity(self) -> int:
        # most key slots any compact chunk can see (the relative table's length)
        return self.c_mem_len + self.mem_len + self.segment_length

    @property
    def history(self) -> int:
        return -(-self.margin // self.segment_length) + 1 if self.margin else 0

    @property
    def max_new_entries(self) -> int:
        # an eviction takes at most ceil(segment_length / rate) * rate tokens (the memory never exceeds mem_len);
        # with c_mem_len = 0 (Transformer-XL) nothing is compressed and there are no compressed slots at all
        return -(-self.segment_length // self.rate) if self.c_mem_len else 0

    @property
    def ring(self) -> int:
        # a full memory, an unfinished segment and the new token, plus the tokens a crop may take back
        return self.mem_len + self.segment_length + self.margin

    @property
    def c_ring(self) -> int:
        # one eviction's entries land in distinct slots; those of the completions a crop undoes stay; grouped: the
        # groups of the held tokens too (compressed ahead of their eviction, into the slots they will hold)
        undone = self.history - 1 if self.margin else 0
        ahead = self.groups if self.grouped else 0
        return max(self.c_mem_len, self.max_new_entries) + undone * self.max_new_entries + ahead

    @property
    def slots(self) -> int:
        return self.c_ring + self.ring

    @property
    def groups(self) -> int:
        return -(-self.ring // self.rate) + 2  # every group from `start` to the newest token, with room to spare


def slot_dim(buffer: torch.Tensor) -> int:
    # static buffers: [batch, slots], [batch, slots, hidden] or [batch, heads, slots, d_head]
    return 2 if buffer.dim() == 4 else 1


def slot_index(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    # index [batch, n] over the slots of `buffer`, expanded to gather/scatter whole slots
    if buffer.dim() == 4:
        return index[:, None, :, None].expand(-1, buffer.shape[1], -1, buffer.shape[3])
    if buffer.dim() == 3:
        return index[..., None].expand(-1, -1, buffer.shape[2])
    return index


def gather_slots(buffer: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    return buffer.gather(slot_dim(buffer), slot_index(buffer, index))


def write_slots(buffer: torch.Tensor, index: torch.Tensor, take: torch.Tensor, values: torch.Tensor) -> None:
    """buffer's slots `index` [batch, n] (distinct per row) <- values where take [batch, n], unchanged elsewhere."""
    dim = slot_dim(buffer)
    take = take.view(*take.shape[:1], *([1] * (dim - 1)), take.shape[1], *([1] * (buffer.dim() - dim - 1)))
    put_along(buffer, dim, index, where(take, values, gather_slots(buffer, index)))


# ----------------------------------------------------------------------------------------------------------------
# Conversions between the compact and the static form
# ----------------------------------------------------------------------------------------------------------------


@torch.no_grad()
def to_static(cache, layout: StaticLayout) -> None:
    """Compact form (every row at the same fill, projections stored) -> static form, numbering the held tokens
    from rate * c_len (distances only depend on differences; start = rate * compressed always) and the compressed
    entries from 0."""
    cache._layout = layout
    c_len, m_len, p_len = cache.layers[0].lengths()
    held = m_len + p_len
    batch, device = cache.layers[0].mem.shape[0], cache.layers[0].mem.device

    def counter(value):
        return torch.full((batch,), value, dtype=torch.long, device=device)

    first = layout.rate * c_len
    cache.seen_counter = torch.full((), cache.seen_tokens, dtype=torch.long, device=device)  # (no host copy)
    cache.rows_seen, cache.rows_start = counter(first + held), counter(first)
    cache.rows_pending, cache.rows_compressed = counter(p_len), counter(c_len)
    cache._host_rows = [[first + held, first, p_len, c_len] for _ in range(batch)]
    cache._step_geometry = None
    # (start, compressed) before each of the last `history` segment completions; -1: not recorded
    cache.rows_history = torch.full((batch, layout.history, 2), -1, dtype=torch.long, device=device)
    tokens = layout.c_ring + (first + torch.arange(held, device=device)) % layout.ring  # [held] token slots
    for state in cache.layers:
        _layer_to_static(state, layout, c_len, tokens)
    cache._groups_ready = False  # the groups compressed ahead: see materialize_groups


def _layer_to_static(state, layout: StaticLayout, c_len: int, tokens: torch.Tensor) -> None:
    keys, values = state.projected()  # [batch, heads, c + m + p, d_head]
    batch, device = state.mem.shape[0], state.mem.device
    memory = torch.cat([state.mem, state.pending], dim=1)
    memory_valid = torch.cat([state.mem_valid, state.pending_valid], dim=1)
    state.ring = state.mem.new_zeros(batch, layout.slots, state.mem.shape[-1])
    state.ring[:, :c_len], state.ring[:, tokens] = state.c_mem, memory
    state.ring_real = torch.zeros(batch, layout.slots, dtype=torch.bool, device=device)
    state.ring_real[:, :c_len], state.ring_real[:, tokens] = state.c_mem_valid, memory_valid
    state.ring_keys = keys.new_zeros(batch, keys.shape[1], layout.slots, keys.shape[3])
    state.ring_values = torch.zeros_like(state.ring_keys)
    for buffer, projected in ((state.ring_keys, keys), (state.ring_values, values)):
        buffer[:, :, :c_len], buffer[:, :, tokens] = projected[:, :, :c_len], projected[:, :, c_len:]
    if state.mem_usage is not None:
        state.ring_usage = torch.zeros(batch, layout.slots, dtype=torch.float32, device=device)
        state.ring_usage[:, tokens] = torch.cat([state.mem_usage, state.pending_usage], dim=1)
    state.clear_compact()


@torch.no_grad()
def to_compact(cache) -> None:
    """Static form whose rows are all at the same fill -> compact form (reads the fills back to the host)."""
    layout = cache._layout
    c_len, m_len, p_len = cache.row_lengths()[0]
    device = cache.rows_seen.device
    c_index = (cache.rows_compressed[:, None] - c_len + torch.arange(c_len, device=device)) % layout.c_ring
    held = torch.arange(m_len + p_len, device=device)
    token_index = layout.c_ring + (cache.rows_start[:, None] + held) % layout.ring
    index = torch.cat([c_index, token_index], dim=1)  # [batch, c + m + p], in compact order
    for state in cache.layers:
        context = state.ring.gather(1, index[..., None].expand(-1, -1, state.ring.shape[-1]))
        state.c_mem, state.mem, state.pending = context.split([c_len, m_len, p_len], dim=1)
        real = state.ring_real.gather(1, index)
        state.c_mem_valid, state.mem_valid, state.pending_valid = real.split([c_len, m_len, p_len], dim=1)
        kv_index = index[:, None, :, None].expand(-1, state.ring_keys.shape[1], -1, state.ring_keys.shape[3])
        keys, values = state.ring_keys.gather(2, kv_index), state.ring_values.gather(2, kv_index)
        state.store_projected(keys, values, layout.capacity)
        if state.ring_usage is not None:
            usage = state.ring_usage.gather(1, token_index)
            state.mem_usage, state.pending_usage = usage.split([m_len, p_len], dim=1)
        state.clear_static()
    for name in cache._ROWS:
        setattr(cache, name, None)
    cache._host_rows = cache._step_geometry = None
    cache._seen_host, cache.seen_counter = cache.seen_tokens, None


def materialize_groups(cache, compressors) -> None:
    """Compresses (and projects) every group of every row's held tokens into the compressed slot it will hold
    once evicted, which branch-free decoding steps then keep current (eager steps that follow the fills on the host
    compress at eviction instead and leave these slots stale; they are unseen until evicted). Groups are aligned on
    `start` (a multiple of the rate): the first one is compressed as the first of a block (the oldest group is
    always evicted first). The dilated convolution also keeps each group compressed alone (`leading*`)."""
    layout = cache._layout
    rate, count = layout.rate, layout.groups - 2  # ceil(ring / rate): every held group
    start = cache.rows_start
    tokens = start[:, None] + torch.arange(count * rate, device=start.device)  # [batch, count * rate]
    slots = layout.c_ring + tokens % layout.ring
    in_ring = tokens < cache.rows_seen[:, None]
    groups = (start // rate)[:, None] + torch.arange(count, device=start.device)
    dilated = [state for c, state in zip(compressors, cache.layers) if isinstance(c.compress, DilatedConvCompression)]
    if any(state.leading is None for state in dilated):  # a static form from an older release's state_dict
        allocate_groups(cache, compressors)
    for compressor, state in zip(compressors, cache.layers):
        batch, hidden = state.ring.shape[0], state.ring.shape[-1]
        block = gather_slots(state.ring, slots)
        block_valid = gather_slots(state.ring_real, slots) & in_ring
        variants = [(_attended(state), groups % layout.c_ring, compressor.compress_memory(block, block_valid))]
        if isinstance(compressor.compress, DilatedConvCompression):  # each group also compressed alone
            alone = compressor.compress_memory(
                block.reshape(batch * count, rate, hidden), block_valid.reshape(-1, rate)
            )
            alone = alone[0].view(batch, count, hidden), alone[1].view(batch, count)
            variants.append((_leading(state), groups % layout.groups, alone))
        for buffers, slot, (compressed, compressed_valid) in variants:
            for buffer, value in zip(buffers, (compressed, *compressor.project_memory(compressed), compressed_valid)):
                put_along(buffer, slot_dim(buffer), slot, value)
    cache._groups_ready = True


@torch.no_grad()
def compress_groups_ahead(cache, compressors) -> None:
    """Static form, before branch-free decoding steps (compiled or exported): every held group compressed ahead
    (`materialize_groups`) unless it is already. The first such step would do it otherwise: a step of its own, which
    compiles to a second, larger graph, and which a traced step would repeat at every call."""
    if cache._layout.grouped and not cache._groups_ready:
        materialize_groups(cache, compressors)


def allocate_groups(cache, compressors) -> None:
    """The dilated convolution's `leading*` group buffers of every layer, zeroed, for `materialize_groups` to fill
    in place (a compiled step must not allocate what later steps write)."""
    groups = cache._layout.groups
    for compressor, state in zip(compressors, cache.layers):
        if isinstance(compressor.compress, DilatedConvCompression):
            batch, hidden = state.ring.shape[0], state.ring.shape[-1]
            heads, head_dim = state.ring_keys.shape[1], state.ring_keys.shape[3]
            state.leading = state.ring.new_zeros(batch, groups, hidden)
            state.leading_keys = state.ring_keys.new_zeros(batch, heads, groups, head_dim)
            state.leading_values = state.ring_keys.new_zeros(batch, heads, groups, head_dim)
            state.leading_valid = state.ring_real.new_zeros(batch, groups)


@torch.no_grad()
def widen_compressed_ring(cache) -> None:
    """A static form saved before the compressed ring held the groups compressed ahead (an older release's
    `state_dict`, its ring narrower than the layout's): every compressed entry moves to its slot in the wider ring
    (entry e in slot e % c_ring), the token slots follow it, and the next branch-free step compresses the held
    groups anew (`materialize_groups`)."""
    layout = cache._layout
    old = cache.layers[0].ring.shape[1] - layout.ring  # the saved compressed ring's size
    if old == layout.c_ring:
        return
    device = cache.rows_compressed.device
    slots = torch.arange(old, device=device)
    compressed = cache.rows_compressed[:, None]
    entry = slots + old * torch.div(compressed - 1 - slots, old, rounding_mode="floor")  # newest entry in each slot
    moved = entry % layout.c_ring  # [batch, old]: distinct (old < c_ring consecutive entries)
    for state in cache.layers:
        for name in ("ring", "ring_keys", "ring_values", "ring_real"):
            buffer = getattr(state, name)
            dim = slot_dim(buffer)
            wide = list(buffer.shape)
            wide[dim] = layout.slots
            widened = buffer.new_zeros(wide)
            widened.narrow(dim, layout.c_ring, layout.ring).copy_(buffer.narrow(dim, old, layout.ring))
            widened.scatter_(dim, slot_index(widened, moved), buffer.narrow(dim, 0, old))
            setattr(state, name, widened)
    cache._groups_ready = False


def static_tensors(cache) -> dict[str, torch.Tensor]:
    """Every tensor of the static form by name: the counters and each layer's slot buffers, which decoding steps
    update in place, and its relative table, which they read."""
    tensors = {"seen_counter": cache.seen_counter, **{name: getattr(cache, name) for name in cache._ROWS}}
    for i, state in enumerate(cache.layers):
        tensors.update({f"layers.{i}.{name}": getattr(state, name) for name in cache._SAVED_STATIC})
    return {name: tensor for name, tensor in tensors.items() if tensor is not None}


def mark_static_addresses(cache) -> None:
    """Marks every tensor of the static form as living at a fixed address (decoding steps update them in place),
    so that a compiled decoding step reads and writes them where they are: CUDA graphs skip a graph that mutates
    any other input (as transformers' StaticCache marks its keys and values). Inside a compiled call (a static
    form built there) it does nothing: dynamo cannot trace the marking."""
    if torch.compiler.is_compiling():
        return
    for tensor in static_tensors(cache).values():
        torch._dynamo.mark_static_address(tensor)


def select_row(cache, row: int):
    """Static form: a new cache of the same class holding row `row` alone (copies)."""
    sub = type(cache)(len(cache.layers), crop_margin=cache.crop_margin)
    sub._layout = cache._layout
    for layer, sub_layer in zip(cache.layers, sub.layers):
        for name in layer._STATIC:
            value = getattr(layer, name)
            setattr(sub_layer, name, None if value is None else value[row : row + 1].clone())
        sub_layer.rel_table = layer.rel_table
    for name in cache._ROWS:
        setattr(sub, name, getattr(cache, name)[row : row + 1].clone())
    sub._host_rows = None if cache._host_rows is None else [list(cache._host_rows[row])]
    sub._groups_ready = cache._groups_ready
    return sub


def put_row(cache, row: int, sub) -> None:
    """Static form: writes the one-row static cache `sub` (see `select_row`) back into row `row` of `cache`."""
    for layer, sub_layer in zip(cache.layers, sub.layers):
        for name in layer._STATIC:
            value, sub_value = getattr(layer, name), getattr(sub_layer, name)
            if value is not None and sub_value is not None:  # (group buffers may be stale: _groups_ready)
                value[row : row + 1] = sub_value
    for name in cache._ROWS:
        getattr(cache, name)[row : row + 1] = getattr(sub, name)
    cache._groups_ready = cache._groups_ready and sub._groups_ready
    cache._step_geometry = None
    if cache._host_rows is not None:
        if sub._host_rows is None:
            cache._host_rows = None
        else:
            cache._host_rows[row] = list(sub._host_rows[0])


def rewind(cache, count: int) -> None:
    """`crop`'s work on the static form: the counters go back by `count` tokens of every row, to their values
    before the segment completions undone (recorded in `rows_history`); the buffers still hold what they point to."""
    layout = cache._layout
    seen, pending, history = cache.rows_seen, cache.rows_pending, cache.rows_history
    undone = torch.where(count > pending, (count - pending - 1) // layout.segment_length + 1, 0)  # completions
    slot = (layout.history - undone).clamp(0, layout.history - 1)
    restored = history.gather(1, slot[:, None, None].expand(-1, 1, 2))[:, 0]  # [batch, 2]
    rewound = undone > 0
    if bool((rewound & (restored[:, 0] < 0)).any()):
        raise ValueError(f"cannot crop {count} tokens: the segment completions to undo were not recorded")
    cache.rows_start.copy_(torch.where(rewound, restored[:, 0], cache.rows_start))
    cache.rows_compressed.copy_(torch.where(rewound, restored[:, 1], cache.rows_compressed))
    cache.rows_pending.copy_(pending - count + undone * layout.segment_length)
    cache.rows_seen.sub_(count)
    # the undone completions leave the history: entries move back by `undone`
    positions = torch.arange(layout.history, device=seen.device)[None] - undone[:, None]  # [batch, history]
    kept = history.gather(1, positions.clamp_min(0)[..., None].expand(-1, -1, 2))
    cache.rows_history.copy_(torch.where((positions >= 0)[..., None], kept, -1))
    cache.seen_tokens -= count
    cache._step_geometry = None
    cache._host_rows = torch.stack(
        [cache.rows_seen, cache.rows_start, cache.rows_pending, cache.rows_compressed], dim=1
    ).tolist()


# ----------------------------------------------------------------------------------------------------------------
# One decoding step
# ----------------------------------------------------------------------------------------------------------------


class DecodeStep:
    """One token per row through the static form. The token goes to its row's own slot (`write` [batch]); every
    slot's column in the relative table (`columns` [batch, slots]) and whether it is held (`in_window`) are shared
    by the layers; a row whose segment this token completes evicts (`evicted` [batch] tokens) and writes
    `new_entries` compressed entries. Every update is an in-place, fixed-shape write selected per row (no branch on
    values, no host read). With `tokens_real` (the caller knows every token is real: no attention mask) eager steps
    follow the rows' fills on the host (`cache._host_rows`) and skip the group compression and the eviction copies
    on the steps where no row needs them.

    Per layer the model calls `write_token` (returns the attention mask), runs the layer on the slot buffers, then
    `compress_evicted`; after the last layer, `finish` moves the counters on."""

    def __init__(self, cache, token_valid: torch.Tensor, tokens_real: bool, compressors):
        layout = self.layout = cache._layout
        self.cache, self.token_valid = cache, token_valid
        self.write = layout.c_ring + cache.rows_seen % layout.ring  # [batch]: the new token's slot
        self.host = cache._host_rows if tokens_real and not torch.compiler.is_compiling() else None
        host = self.host
        self.segments_complete = host is None or any(row[2] + 1 == layout.segment_length for row in host)
        if host is not None:
            cache._groups_ready = False  # eager steps compress at eviction and leave the group buffers stale
        # Between two segment completions, eager steps that follow the fills on the host only move the geometry on
        # by one token.
        if host is not None and cache._step_geometry is not None:
            columns, in_window = cache._step_geometry
            columns.sub_(1).clamp_min_(0).scatter_(1, self.write[:, None], layout.capacity - 1)
            in_window.scatter_(1, self.write[:, None], True)
        else:
            columns, in_window = self._geometry()
        self.columns, self.in_window = columns, in_window
        cache._step_geometry = (columns, in_window) if host is not None and not self.segments_complete else None
        if self.segments_complete:
            self._plan_eviction()
        if layout.grouped and host is None:
            self._plan_group_compression(compressors)

    def _geometry(self) -> tuple[torch.Tensor, torch.Tensor]:
        """[batch, slots] column of each slot in the relative table (capacity-1 minus the distance from the new
        token, at slot `write`, to what the slot holds) and whether the slot is held (compressed memory, memory,
        the unfinished segment, the token itself); padding slots are masked apart (`ring_real`)."""
        cache, layout = self.cache, self.layout
        seen, start, compressed = cache.rows_seen, cache.rows_start, cache.rows_compressed
        device = seen.device
        token_slots = torch.arange(layout.ring, device=device)
        held = token_slots + layout.ring * torch.div(seen[:, None] - token_slots, layout.ring, rounding_mode="floor")
        c_slots = torch.arange(layout.c_ring, device=device)
        entry = c_slots + layout.c_ring * torch.div(
            compressed[:, None] - 1 - c_slots, layout.c_ring, rounding_mode="floor"
        )  # newest compressed entry in each slot
        entry_visible = (entry >= 0) & (entry >= compressed[:, None] - layout.c_mem_len)
        token_visible = held >= start[:, None]  # held <= seen by construction
        distance = torch.cat([(seen - start + compressed)[:, None] - entry, seen[:, None] - held], dim=1)
        columns = (layout.capacity - 1 - distance).clamp(0, layout.capacity - 1)
        return columns, torch.cat([entry_visible, token_visible], dim=1)

    def _plan_eviction(self) -> None:
        """The memory update of rows whose segment this token completes: how many tokens each evicts, and the
        compressed slots [batch, max_new_entries] its new entries go to (`takes`: which of them are written)."""
        cache, layout, rate = self.cache, self.layout, self.layout.rate
        seen, start, pending, compressed = cache.rows_seen, cache.rows_start, cache.rows_pending, cache.rows_compressed
        self.completes = self.token_valid & (pending + 1 == layout.segment_length)
        memory_len = seen + 1 - start - layout.segment_length  # before the update, for completing rows
        overflow = (memory_len + layout.segment_length - layout.mem_len).clamp_min(0)
        self.evicted = torch.where(self.completes, -(-overflow // rate) * rate, 0)
        self.new_entries = self.evicted // rate if layout.c_mem_len else torch.zeros_like(self.evicted)
        self.entry_index = torch.arange(layout.max_new_entries, device=seen.device)
        self.targets = (compressed[:, None] + self.entry_index) % layout.c_ring  # [batch, max_new_entries]
        self.takes = self.entry_index < self.new_entries[:, None]

    def _plan_group_compression(self, compressors) -> None:
        """Branch-free steps: the new token's group is compressed now (a partial group is rewritten when it
        completes; evictions only take complete groups), with the group before it for the dilated convolution."""
        cache, layout, rate = self.cache, self.layout, self.layout.rate
        if not cache._groups_ready:
            materialize_groups(cache, compressors)
        device = self.write.device
        self.group = cache.rows_seen // rate
        span = 2 * rate if cache.layers[0].leading is not None else rate
        self.group_tokens = self.group[:, None] * rate + torch.arange(rate - span, rate, device=device)
        self.group_slots = layout.c_ring + self.group_tokens % layout.ring

    def write_token(self, state, hidden_states: torch.Tensor) -> torch.Tensor:
        """Stores the token [batch, 1, hidden] in its slot; returns the attention mask [batch, 1, 1, slots] (the
        held slots that hold real tokens, the new token included)."""
        put_along(state.ring, 1, self.write[:, None], hidden_states)
        put_along(state.ring_real, 1, self.write[:, None], self.token_valid[:, None])
        return (self.in_window & state.ring_real)[:, None, None, :]

    def compress_evicted(self, state, compressor, weights: torch.Tensor | None) -> None:
        """After the layer attended (`weights` [batch, heads, 1, slots] for "most_used"): the compressed entries of
        the rows that evict, written into their compressed slots."""
        layout = self.layout
        if layout.grouped and self.host is not None:
            if self.segments_complete:  # the evicted blocks compressed at once, as the compact form does
                self._compress_evicted_blocks(state, compressor)
        elif layout.grouped:
            self._compress_group(state, compressor)
            if state.leading is not None:  # the first evicted group as the convolution sees it there: alone
                first = (self.cache.rows_start // layout.rate % layout.groups)[:, None]
                for buffer, lead in zip(_attended(state), _leading(state)):
                    write_slots(buffer, self.targets[:, :1], self.takes[:, :1], gather_slots(lead, first))
        elif state.ring_usage is not None:  # most used: the chosen tokens are copied into the compressed slots
            received = weights.float().sum(dim=(1, 2)) * self.token_valid[:, None]  # [batch, slots]
            state.ring_usage.scatter_(1, self.write[:, None], 0.0).add_(received)
            if self.segments_complete:
                chosen = self._select_most_used(state, compressor)
                buffers = _attended(state)
                for buffer, values in zip(buffers, [gather_slots(buffer, chosen) for buffer in buffers]):
                    write_slots(buffer, self.targets, self.takes, values)

    def _evicted_window(self, state) -> tuple[torch.Tensor, torch.Tensor]:
        # the slots [batch, max_new_entries * rate] of each row's eviction block and which of them it evicts
        window = torch.arange(self.layout.max_new_entries * self.layout.rate, device=self.write.device)
        window_slots = self.layout.c_ring + (self.cache.rows_start[:, None] + window) % self.layout.ring
        return window_slots, gather_slots(state.ring_real, window_slots) & (window < self.evicted[:, None])

    def _compress_evicted_blocks(self, state, compressor) -> None:
        window_slots, window_valid = self._evicted_window(state)
        compressed, compressed_valid = compressor.compress_memory(gather_slots(state.ring, window_slots), window_valid)
        entries = (compressed, *compressor.project_memory(compressed), compressed_valid)
        for buffer, values in zip(_attended(state), entries):
            write_slots(buffer, self.targets, self.takes, values)

    def _compress_group(self, state, compressor) -> None:
        """Compresses the group of the newest token (with the group before it for the dilated convolution),
        projected, into the compressed slot it will hold once evicted (and alone into its `leading` group slot)."""
        hidden, rate = state.ring.shape[-1], self.layout.rate
        members = state.ring.gather(1, self.group_slots[..., None].expand(-1, -1, hidden))  # [batch, span, hidden]
        real = state.ring_real.gather(1, self.group_slots) & (self.group_tokens >= 0)
        compressed, compressed_valid = (t[:, -1:] for t in compressor.compress_memory(members, real))
        targets = [(_attended(state), (self.group % self.layout.c_ring)[:, None])]
        results = [(compressed, *compressor.project_memory(compressed), compressed_valid)]  # [batch, 1, ...] each
        if state.leading is not None:
            compressed, compressed_valid = compressor.compress_memory(members[:, -rate:], real[:, -rate:])
            targets.append((_leading(state), (self.group % self.layout.groups)[:, None]))
            results.append((compressed, *compressor.project_memory(compressed), compressed_valid))
        for (buffers, slot), values in zip(targets, results):
            for buffer, value in zip(buffers, values):
                put_along(buffer, slot_dim(buffer), slot, value)

    def _select_most_used(self, state, compressor) -> torch.Tensor:
        """Most-used compression: the slots [batch, max_new_entries] of the tokens each row keeps from its evicted
        block (the first new_entries[b] count), in temporal order."""
        window_slots, valid = self._evicted_window(state)
        chosen, _ = compressor.compress.select(valid, state.ring_usage.gather(1, window_slots), self.new_entries)
        return window_slots.gather(1, chosen)

    def slot_layout(self, weights: torch.Tensor) -> torch.Tensor:
        """The step's probabilities [batch, heads, 1, slots] over the static form's slots (compressed ring, then
        token ring) -> the fixed slot layout of the compact form ([c_mem_len, mem_len, segment_length] columns),
        from each slot's entry / token index: compressed entry e at c_mem_len - (compressed - e), token t at
        c_mem_len + mem_len + t - (first token of the segment)."""
        cache, layout = self.cache, self.layout
        seen, start, compressed = cache.rows_seen[:, None], cache.rows_start[:, None], cache.rows_compressed[:, None]
        device = seen.device
        c_slots = torch.arange(layout.c_ring, device=device)
        entry = c_slots + layout.c_ring * torch.div(compressed - 1 - c_slots, layout.c_ring, rounding_mode="floor")
        token_slots = torch.arange(layout.ring, device=device)
        held = token_slots + layout.ring * torch.div(seen - token_slots, layout.ring, rounding_mode="floor")
        memory_end, size = layout.c_mem_len + layout.mem_len, layout.capacity
        entry_column = layout.c_mem_len - (compressed - entry)
        token_column = memory_end + held - (seen - cache.rows_pending[:, None])
        shown = torch.cat([(entry >= 0) & (entry_column >= 0), held >= start], dim=1)
        columns = torch.where(shown, torch.cat([entry_column, token_column], dim=1), size)  # size: not held
        out = weights.new_zeros(*weights.shape[:-1], size + 1)
        return out.scatter_add_(-1, columns[:, None, None, :].expand_as(weights), weights)[..., :size]

    def finish(self) -> None:
        """Moves every row's counters on by its token (and its eviction)."""
        cache, layout, token_valid = self.cache, self.layout, self.token_valid
        if not self.segments_complete:  # (followed on the host: every token real, no completion)
            cache.rows_pending.add_(1)
            cache.rows_seen.add_(1)
        else:
            if layout.history:
                before = torch.stack([cache.rows_start, cache.rows_compressed], dim=1)[:, None]
                shifted = torch.cat([cache.rows_history[:, 1:], before], dim=1)
                cache.rows_history.copy_(torch.where(self.completes[:, None, None], shifted, cache.rows_history))
            cache.rows_start.add_(self.evicted)
            cache.rows_compressed.add_(self.new_entries)
            cache.rows_pending.copy_(torch.where(self.completes, 0, cache.rows_pending + token_valid))
            cache.rows_seen.add_(token_valid.long())
        cache._host_rows = None if self.host is None else [self._host_step(row) for row in self.host]

    def _host_step(self, row: list[int]) -> list[int]:
        """(seen, start, pending, compressed) of a row after one real token: the schedule, on the host."""
        seen, start, pending, compressed = row
        layout = self.layout
        if pending + 1 < layout.segment_length:
            return [seen + 1, start, pending + 1, compressed]
        overflow = max(0, seen + 1 - start - layout.mem_len)  # memory + segment beyond mem_len
        evicted = -(-overflow // layout.rate) * layout.rate
        return [seen + 1, start + evicted, 0, compressed + evicted // layout.rate if layout.c_mem_len else 0]


def _attended(state) -> tuple[torch.Tensor, ...]:
    # the buffers a layer attends: slot contents, their keys and values, and whether each holds a real token
    return state.ring, state.ring_keys, state.ring_values, state.ring_real


def _leading(state) -> tuple[torch.Tensor, ...]:
    # the dilated convolution's group buffers: each group compressed alone, its keys and values, its validity
    return state.leading, state.leading_keys, state.leading_values, state.leading_valid
