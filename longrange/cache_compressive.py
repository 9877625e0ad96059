"""The Compressive model's memory cache, `CompressiveMemoryCache`: per layer the compressed memory, the memory and
the unfinished segment ("pending"), in a compact form (multi-token forwards, training) or a static form
(`StaticLayout`: fixed-size buffers and per-row counters updated in place, for decoding steps that compile to one
graph). `modeling_compressive.py` applies the memory schedule to it.

Only same-folder relative imports: `save_pretrained` copies this file next to the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache

from .layers import put_along


class CompressiveMemoryLayer:
    """One layer's memories, in one of two forms. Every tensor is detached; batch is always dimension 0.

    Compact form (multi-token forwards, training): c_mem [batch, c_len, hidden], mem [batch, m_len, hidden],
    pending [batch, p_len, hidden]: compressed memory, memory and the layer inputs of the current unfinished
    segment, all un-normalised layer inputs, the same lengths for every row. `*_valid` [batch, len] bool marks
    slots that hold a real (non-padding) token. `mem_usage` / `pending_usage` [batch, len] accumulate the attention
    each slot received (only for the "most_used" compression).
    `keys` / `values` [batch, heads, capacity, d_head] are buffers whose first `projected_len` entries hold the
    projected keys/values of [c_mem, mem, pending] (capacity = c_mem_len + mem_len + segment_length, so a chunk
    writes its keys in place instead of copying the whole memory), kept only by inference (no-grad) forwards.

    Static form (one-token decoding; see StaticLayout): fixed-size buffers, each row at its own fill. `ring`
    [batch, slots, hidden] holds the compressed-memory ring then the token ring, `ring_keys` / `ring_values`
    [batch, heads, slots, d_head] their projections, `ring_real` [batch, slots] whether a slot holds a real token
    (or a compressed slot with a real source), `ring_usage` [batch, slots] the attention received ("most_used").
    `grouped*` [batch, groups, ...]: each group of `compression_rate` tokens compressed (and projected) as soon as
    it is complete (grouped compressions), so an eviction only copies entries; `leading*` (dilated convolution
    only) the same groups compressed as the first of an eviction block (the convolution reads the group before
    otherwise).

    `rel_table` [heads, d_head, capacity]: the projected relative encodings of distances capacity-1 ... 0, kept by
    inference forwards in both forms.
    """

    is_compileable = True
    is_sliding = False
    is_croppable = False
    supports_early_init = False

    _BATCHED = (
        "c_mem",
        "c_mem_valid",
        "mem",
        "mem_valid",
        "mem_usage",
        "pending",
        "pending_valid",
        "pending_usage",
        "keys",
        "values",
    )
    _STATIC = (
        "ring",
        "ring_keys",
        "ring_values",
        "ring_real",
        "ring_usage",
        "grouped",
        "grouped_keys",
        "grouped_values",
        "grouped_valid",
        "leading",
        "leading_keys",
        "leading_values",
        "leading_valid",
    )

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        for name in self._BATCHED + self._STATIC:
            setattr(self, name, None)
        self.rel_table = None
        self.projected_len = 0

    def clear_compact(self) -> None:
        for name in self._BATCHED:
            setattr(self, name, None)
        self.projected_len = 0

    def clear_static(self) -> None:
        for name in self._STATIC:
            setattr(self, name, None)

    def drop_projections(self) -> None:
        self.keys = self.values = self.rel_table = None
        self.projected_len = 0

    def projected(self) -> tuple[torch.Tensor, torch.Tensor]:
        # views [batch, heads, c_len + m_len + p_len, d_head] into the buffers
        return self.keys[:, :, : self.projected_len], self.values[:, :, : self.projected_len]

    def store_projected(self, keys: torch.Tensor, values: torch.Tensor, capacity: int) -> None:
        batch, heads, length, d_head = keys.shape
        self.keys = keys.new_empty(batch, heads, capacity, d_head)
        self.values = values.new_empty(batch, heads, capacity, d_head)
        self.keys[:, :, :length] = keys
        self.values[:, :, :length] = values
        self.projected_len = length

    @property
    def is_empty(self) -> bool:
        return self.mem is None and self.ring is None

    @property
    def batch_size(self) -> int:
        held = self.mem if self.mem is not None else self.ring
        return -1 if held is None else held.shape[0]

    def lengths(self) -> tuple[int, int, int]:
        """(c_len, m_len, p_len) of the compact form."""
        return self.c_mem.shape[1], self.mem.shape[1], self.pending.shape[1]

    def context(self) -> torch.Tensor:
        # [batch, c_len + m_len + p_len, hidden]: what the current segment attends besides itself
        return torch.cat([self.c_mem, self.mem, self.pending], dim=1)

    def context_valid(self) -> torch.Tensor:
        return torch.cat([self.c_mem_valid, self.mem_valid, self.pending_valid], dim=1)

    def init_empty(self, reference: torch.Tensor, track_usage: bool) -> None:
        batch, hidden = reference.shape[0], reference.shape[-1]
        empty = reference.new_zeros(batch, 0, hidden)
        no_slots = torch.zeros(batch, 0, dtype=torch.bool, device=reference.device)
        self.c_mem, self.mem, self.pending = empty, empty, empty
        self.c_mem_valid, self.mem_valid, self.pending_valid = no_slots, no_slots, no_slots
        if track_usage:
            self.mem_usage = reference.new_zeros(batch, 0, dtype=torch.float32)
            self.pending_usage = self.mem_usage

    def apply_to_batch(self, fn) -> None:
        for name in self._BATCHED + self._STATIC:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))


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
    Evictions take whole groups of `rate` tokens (start is a multiple of the rate). With a compression that maps
    each group to one entry on its own (`grouped`: all but "most_used"), each group (token a in group a // rate)
    is compressed and projected as soon as it is complete, into group slot (a // rate) % groups of separate
    buffers; an eviction copies its groups' entries into the compressed slots.
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
        # one eviction's entries land in distinct slots; those of the completions a crop undoes stay
        undone = self.history - 1 if self.margin else 0
        return max(self.c_mem_len, self.max_new_entries) + undone * self.max_new_entries

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
    put_along(buffer, dim, index, torch.where(take, values, gather_slots(buffer, index)))


class CompressiveMemoryCache(Cache):
    """Memories and compressed memories of every layer, plus the number of tokens seen.

    Its size is bounded by `mem_len + c_mem_len + segment_length` slots per layer (plus fixed-size ring slack in
    the static form), however long the sequence. Returned in the model output's `cache` field; pass it back as
    `cache=` (or `past_key_values=`) to continue.

    Multi-token forwards keep it in the compact form (every row at the same fill); one-token decoding steps in the
    static form, whose shapes never change and whose per-row counters `rows_seen`, `rows_start`, `rows_pending`,
    `rows_compressed` [batch] (long tensors; see StaticLayout) are updated in place, so a decoding step compiles
    to one graph that reads nothing back to the host. The model converts between the forms as needed.
    """

    model_type = "compressive"  # the model it belongs to (a cache handed to the other model is refused)
    _ROWS = ("rows_seen", "rows_start", "rows_pending", "rows_compressed", "rows_history")

    def __init__(self, num_hidden_layers: int, crop_margin: int = 0):
        super().__init__(layers=[CompressiveMemoryLayer() for _ in range(num_hidden_layers)])
        if not isinstance(crop_margin, int) or crop_margin < 0:
            raise ValueError(f"crop_margin must be an int >= 0 (most tokens one crop removes), got {crop_margin!r}")
        self.crop_margin = crop_margin
        self.seen_tokens = 0
        self._layout = None  # StaticLayout, set by the model when it first builds the static form
        self._host_rows = None  # static form: each row's (seen, start, pending, compressed) when known on the host
        self._groups_ready = False  # static form: whether the group buffers hold every held group
        self._step_geometry = None  # the last eager step's slot geometry, while it can be moved on by one token
        for name in self._ROWS:
            setattr(self, name, None)

    @property
    def is_compileable(self) -> bool:
        return True

    @property
    def is_croppable(self) -> bool:
        """Whether `crop` can take back up to `crop_margin` tokens (a cache built with crop_margin > 0)."""
        return self.crop_margin > 0

    @property
    def is_static(self) -> bool:
        return self.rows_seen is not None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """Tokens seen so far, padding included (not the number of slots held, which stays bounded)."""
        return self.seen_tokens

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return -1

    def row_lengths(self) -> list[tuple[int, int, int]]:
        """Static form: (c_len, m_len, p_len) of every row, read back to the host."""
        c_len = self.rows_compressed.clamp_max(self._layout.c_mem_len)
        m_len = self.rows_seen - self.rows_start - self.rows_pending
        return [tuple(row) for row in torch.stack([c_len, m_len, self.rows_pending], dim=1).tolist()]

    def memory_slots(self) -> int:
        """Slots held by one layer (compressed + memory + pending, the fullest row); bounded whatever the number of
        tokens seen."""
        layer = self.layers[0]
        if layer.is_empty:
            return 0
        if self.is_static:
            return max(sum(row) for row in self.row_lengths())
        return sum(layer.lengths())

    def reset(self) -> None:
        for layer in self.layers:
            layer.reset()
        for name in self._ROWS:
            setattr(self, name, None)
        self._host_rows = None
        self._step_geometry = None
        self.seen_tokens = 0

    def _apply_to_batch(self, fn) -> None:
        self._step_geometry = None
        for layer in self.layers:
            layer.apply_to_batch(fn)
        for name in self._ROWS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        self._apply_to_batch(lambda t: t.index_select(0, beam_idx.to(t.device)))
        if self._host_rows is not None and any(row != self._host_rows[0] for row in self._host_rows):
            self._host_rows = None  # rows at different fills, reordered on the device

    def batch_repeat_interleave(self, repeats: int) -> None:
        self._apply_to_batch(lambda t: t.repeat_interleave(repeats, dim=0))
        if self._host_rows is not None:
            self._host_rows = [list(row) for row in self._host_rows for _ in range(repeats)]

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        self._apply_to_batch(lambda t: t[indices])
        self._host_rows = None

    def select_row(self, row: int) -> CompressiveMemoryCache:
        """Static form: a new cache holding row `row` alone (copies)."""
        sub = CompressiveMemoryCache(len(self.layers), crop_margin=self.crop_margin)
        sub._layout = self._layout
        for layer, sub_layer in zip(self.layers, sub.layers):
            for name in CompressiveMemoryLayer._STATIC:
                value = getattr(layer, name)
                setattr(sub_layer, name, None if value is None else value[row : row + 1].clone())
            sub_layer.rel_table = layer.rel_table
        for name in self._ROWS:
            setattr(sub, name, getattr(self, name)[row : row + 1].clone())
        sub._host_rows = None if self._host_rows is None else [list(self._host_rows[row])]
        sub._groups_ready = self._groups_ready
        return sub

    def put_row(self, row: int, sub: CompressiveMemoryCache) -> None:
        """Static form: writes the one-row static cache `sub` back into row `row`."""
        for layer, sub_layer in zip(self.layers, sub.layers):
            for name in CompressiveMemoryLayer._STATIC:
                value, sub_value = getattr(layer, name), getattr(sub_layer, name)
                if value is not None and sub_value is not None:  # (group buffers may be stale: _groups_ready)
                    value[row : row + 1] = sub_value
        for name in self._ROWS:
            getattr(self, name)[row : row + 1] = getattr(sub, name)
        self._groups_ready = self._groups_ready and sub._groups_ready
        self._step_geometry = None
        if self._host_rows is not None:
            if sub._host_rows is None:
                self._host_rows = None
            else:
                self._host_rows[row] = list(sub._host_rows[0])

    def crop(self, tokens_to_remove: int) -> None:
        """Removes the last -tokens_to_remove tokens of every row (transformers' convention: a number <= 0; a
        positive number, as older transformers releases pass, is the length to keep),
        restoring the memories exactly as they were before those tokens: the counters are rewound (to their
        values before the segment completions undone); the static buffers still hold what they pointed to.
        The removed tokens must be real tokens of every row (as generate() appends them)."""
        if tokens_to_remove > 0:  # older transformers releases pass the length to keep
            if tokens_to_remove > self.seen_tokens:
                raise ValueError(f"cannot crop to {tokens_to_remove} tokens: the cache has seen {self.seen_tokens}")
            tokens_to_remove -= self.seen_tokens
        count = -tokens_to_remove
        if count == 0 or self.layers[0].is_empty:
            return
        if count > self.crop_margin:
            raise ValueError(
                f"cannot crop {count} tokens: this CompressiveMemoryCache can be cropped by at most "
                f"crop_margin={self.crop_margin} tokens (create it with a larger crop_margin; with "
                "compression_function='most_used' none can be cropped)"
            )
        if not self.is_static:
            raise ValueError("crop needs the cache's inference form: only caches of no-grad forwards can be cropped")
        layout = self._layout
        seen, pending, history = self.rows_seen, self.rows_pending, self.rows_history
        undone = torch.where(count > pending, (count - pending - 1) // layout.segment_length + 1, 0)  # completions
        slot = (layout.history - undone).clamp(0, layout.history - 1)
        restored = history.gather(1, slot[:, None, None].expand(-1, 1, 2))[:, 0]  # [batch, 2]
        rewind = undone > 0
        if bool((rewind & (restored[:, 0] < 0)).any()):
            raise ValueError(f"cannot crop {count} tokens: the segment completions to undo were not recorded")
        self.rows_start.copy_(torch.where(rewind, restored[:, 0], self.rows_start))
        self.rows_compressed.copy_(torch.where(rewind, restored[:, 1], self.rows_compressed))
        self.rows_pending.copy_(pending - count + undone * layout.segment_length)
        self.rows_seen.sub_(count)
        # the undone completions leave the history: entries move back by `undone`
        positions = torch.arange(layout.history, device=seen.device)[None] - undone[:, None]  # [batch, history]
        kept = history.gather(1, positions.clamp_min(0)[..., None].expand(-1, -1, 2))
        self.rows_history.copy_(torch.where((positions >= 0)[..., None], kept, -1))
        self.seen_tokens -= count
        self._step_geometry = None
        self._host_rows = torch.stack(
            [self.rows_seen, self.rows_start, self.rows_pending, self.rows_compressed], dim=1
        ).tolist()
