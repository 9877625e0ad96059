"""The Compressive model's memory cache, `CompressiveMemoryCache`: per layer the compressed memory, the memory and
the unfinished segment ("pending"), in a compact form (multi-token forwards, training) or a static form
(`StaticLayout`: fixed-size buffers and per-row counters updated in place, for decoding steps that compile to one
graph). The decoder layers apply the memory schedule to it (`CompressiveDecoderLayer.update_memory`, in
`memory_compressive.py`), driven by the segment runner (`segments_compressive.py`).

Only same-folder relative imports: `save_pretrained` copies this file next to the weights.
"""

from __future__ import annotations

import dataclasses

import torch
from transformers.cache_utils import Cache

from .cache_compressive_static import (
    DecodeStep,
    StaticLayout,
    allocate_groups,
    mark_static_addresses,
    put_row,
    rewind,
    select_row,
    static_tensors,
    to_compact,
    to_static,
    widen_compressed_ring,
)


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
    Grouped compressions (all but "most_used"): the compressed ring also holds the groups of the held tokens,
    compressed ahead of their eviction; `leading*` [batch, groups, ...] (dilated convolution only) each group
    compressed as the first of an eviction block (the convolution reads the group before otherwise).

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

    def prepare_projections(self, layer, capacity: int, like: torch.Tensor) -> None:
        """Inference: makes sure this layer holds its relative table [heads, d_head, capacity] (dtype and device of
        `like`) and the projected keys/values of [c_mem, mem, pending], which only the decoder `layer` computes."""
        if self.rel_table is None:
            self.rel_table = layer.position_table(capacity, like)
        if self.keys is None:
            self.store_projected(*layer.project_memory(self.context()), capacity)

    def chunk_mask(self, valid: torch.Tensor) -> torch.Tensor:
        """[batch, 1, q, K] which keys [c_mem, mem, pending, chunk] each of a chunk's q queries (validity
        [batch, q]) may attend: held memories and earlier segment tokens where real, the chunk causally."""
        key_valid = torch.cat([self.context_valid(), valid], dim=1)  # [batch, K]
        q_len, k_len = valid.shape[1], key_valid.shape[1]
        # query i sits at key position k_len - q_len + i: memories and earlier segment tokens visible, future not
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=valid.device).tril(k_len - q_len)
        return key_valid[:, None, None, :] & causal

    def apply_to_batch(self, fn) -> None:
        for name in self._BATCHED + self._STATIC:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))

    # ------------------------------------------------------------------------------------------------------------
    # The compact form's memory schedule: a chunk joins the unfinished segment; a complete segment joins the
    # memory, whose oldest entries it pushes out; the layer compresses them and hands the entries back.
    # ------------------------------------------------------------------------------------------------------------

    def append_chunk(self, inputs: torch.Tensor, valid: torch.Tensor, weights: torch.Tensor | None = None) -> None:
        """Appends a chunk's layer inputs [batch, q, hidden] (and validity [batch, q]) to the unfinished segment
        (the layer already wrote their keys/values into the buffers when it reuses projections). `weights`
        [batch, heads, q, K] ("most_used"): accumulates the attention each held slot received from real tokens."""
        if weights is not None:
            received = (weights.detach().float() * valid[:, None, :, None]).sum(dim=(1, 2))  # [batch, K]
            c_len, m_len, p_len = self.lengths()
            self.mem_usage = self.mem_usage + received[:, c_len : c_len + m_len]
            pending_usage = self.pending_usage + received[:, c_len + m_len : c_len + m_len + p_len]
            self.pending_usage = torch.cat([pending_usage, received[:, c_len + m_len + p_len :]], dim=1)
        self.pending = torch.cat([self.pending, inputs], dim=1)
        self.pending_valid = torch.cat([self.pending_valid, valid], dim=1)
        if self.keys is not None:
            self.projected_len += inputs.shape[1]

    def complete_segment(self, mem_len: int, unit: int) -> Eviction | None:
        """mem = cat(mem, segment); when that holds more than mem_len, the oldest ceil(overflow / unit) * unit
        entries leave it and are returned (then `store_compressed` must follow); None when nothing overflows."""
        segment, segment_valid = self.pending, self.pending_valid
        memory = torch.cat([self.mem, segment], dim=1)  # [batch, m_len + segment, hidden]
        memory_valid = torch.cat([self.mem_valid, segment_valid], dim=1)
        usage = None if self.mem_usage is None else torch.cat([self.mem_usage, self.pending_usage], dim=1)
        overflow = memory.shape[1] - mem_len
        count = -(-overflow // unit) * unit if overflow > 0 else 0
        eviction = None
        if count:
            evicted_usage = None if usage is None else usage[:, :count]
            eviction = Eviction(memory[:, :count], memory_valid[:, :count], evicted_usage, segment, segment_valid,
                                self.c_mem.shape[1])  # fmt: skip
            memory, memory_valid = memory[:, count:], memory_valid[:, count:]
            usage = None if usage is None else usage[:, count:]
        # without an eviction the key/value buffers already read [c_mem, mem + segment]: nothing to move
        self.mem, self.mem_valid = memory, memory_valid
        self.pending, self.pending_valid = segment[:, :0], segment_valid[:, :0]
        if usage is not None:
            self.mem_usage, self.pending_usage = usage, usage[:, :0]
        return eviction

    def store_compressed(self, eviction: Eviction, compressed=None, compressed_valid=None, c_mem_len=0, project=None):
        """After `complete_segment`: the compressed entries [batch, n, hidden] (detached) of the evicted block join
        the compressed memory, which keeps its newest c_mem_len. `compressed` None: the block is dropped
        (Transformer-XL). `project` (the layer's key/value projection) is called only when this layer keeps its
        projections (inference)."""
        if compressed is not None:
            self.c_mem = torch.cat([self.c_mem, compressed], dim=1)[:, -c_mem_len:]
            self.c_mem_valid = torch.cat([self.c_mem_valid, compressed_valid], dim=1)[:, -c_mem_len:]
        if self.keys is None:
            return
        capacity, c_len, count = self.keys.shape[2], eviction.c_len, eviction.memories.shape[1]
        all_keys, all_values = self.projected()  # [batch, heads, c_len + m_len + segment, d_head]
        keys, values = all_keys[:, :, c_len + count :], all_values[:, :, c_len + count :]
        if compressed is not None:
            c_keys, c_values = project(compressed)
            c_keys = torch.cat([all_keys[:, :, :c_len], c_keys], dim=2)[:, :, -c_mem_len:]
            c_values = torch.cat([all_values[:, :, :c_len], c_values], dim=2)[:, :, -c_mem_len:]
            keys, values = torch.cat([c_keys, keys], dim=2), torch.cat([c_values, values], dim=2)
        self.store_projected(keys, values, capacity)

    def slot_layout(self, weights: torch.Tensor, c_mem_len: int, mem_len: int, segment_length: int) -> torch.Tensor:
        """[batch, heads, q, c_len + m_len + p_len + q] probabilities -> [batch, heads, q, c_mem_len + mem_len +
        segment_length]: the compressed-memory slots (newest last), the memory slots (newest last), then the
        positions of the current segment; slots not held yet are zero. Every chunk of a call lands in the same
        layout, so the layers' attentions concatenate over the whole input."""
        c_len, m_len, _ = self.lengths()
        compressed, memory, segment = weights.split([c_len, m_len, weights.shape[-1] - c_len - m_len], dim=-1)
        layout = weights.new_zeros(*weights.shape[:-1], c_mem_len + mem_len + segment_length)
        layout[..., c_mem_len - c_len : c_mem_len] = compressed
        memory_end = c_mem_len + mem_len
        layout[..., memory_end - m_len : memory_end] = memory
        layout[..., memory_end : memory_end + segment.shape[-1]] = segment
        return layout


@dataclasses.dataclass
class Eviction:
    """What a complete segment pushed out of a layer's memory: memories [batch, n, hidden] (n a multiple of the
    eviction unit), their validity [batch, n] and ("most_used") the attention they received, with the segment
    [batch, segment, hidden] that pushed them (the attention reconstruction loss attends from it) and the length
    of the compressed memory before (`c_len`: the evicted block's keys follow it in the layer's key order)."""

    memories: torch.Tensor
    valid: torch.Tensor
    usage: torch.Tensor | None
    segment: torch.Tensor
    segment_valid: torch.Tensor
    c_len: int


class CompressiveMemoryCache(Cache):
    """Memories and compressed memories of every layer, plus the number of tokens seen.

    Its size is bounded by `mem_len + c_mem_len + segment_length` slots per layer (plus fixed-size ring slack in
    the static form), however long the sequence. Returned in the model output's `cache` field; pass it back as
    `cache=` (or `past_key_values=`) to continue.

    Multi-token forwards keep it in the compact form (every row at the same fill); one-token decoding steps in the
    static form, whose shapes never change and whose per-row counters `rows_seen`, `rows_start`, `rows_pending`,
    `rows_compressed` [batch] (long tensors; see StaticLayout) are updated in place, so a decoding step compiles
    to one graph that reads nothing back to the host. The model converts between the forms as needed; a cache that
    generate() made or was given (`prefill_to_static`) leaves no-grad forwards in the static form, so that the
    decoding steps that follow, compiled ones too, find every buffer allocated and only write into it.
    """

    model_type = "compressive"  # the model it belongs to (a cache handed to the other model is refused)
    _ROWS = ("rows_seen", "rows_start", "rows_pending", "rows_compressed", "rows_history")

    def __init__(self, num_hidden_layers: int, crop_margin: int = 0):
        super().__init__(layers=[CompressiveMemoryLayer() for _ in range(num_hidden_layers)])
        if not isinstance(crop_margin, int) or crop_margin < 0:
            raise ValueError(f"crop_margin must be an int >= 0 (most tokens one crop removes), got {crop_margin!r}")
        self.crop_margin = crop_margin
        # set by generate(): no-grad multi-token calls leave the cache in the static form, so that the decoding steps
        # that follow (compiled ones too) find its buffers allocated (a CUDA graph must not allocate what it mutates)
        self.prefill_to_static = False
        # set by generate(): it compiles the decoding steps (the prompt's forward compresses the groups ahead for them)
        self.steps_compiled = False
        self._seen_host = 0  # tokens seen, padding included, on the host (None after compiled steps: see count)
        self.seen_counter = None  # static form: the same as a 0-dim long tensor, updated in place
        self._layout = None  # StaticLayout, set by the model when it first builds the static form
        self._host_rows = None  # static form: each row's (seen, start, pending, compressed) when known on the host
        self._groups_ready = False  # static form: whether every held group is compressed ahead (materialize_groups)
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

    def state_tensors(self) -> dict[str, torch.Tensor]:
        """The static form's tensors by name, which decoding steps read and update in place (`static_tensors`)."""
        return static_tensors(self)

    @property
    def seen_tokens(self) -> int:
        """Tokens seen so far, padding included (after compiled steps read back from the device once)."""
        if self._seen_host is None:
            self._seen_host = int(self.seen_counter)
        return self._seen_host

    @seen_tokens.setter
    def seen_tokens(self, value: int) -> None:
        self._seen_host = int(value)
        if self.seen_counter is not None:
            self.seen_counter.fill_(self._seen_host)

    def count(self, tokens: int) -> None:
        """Forward's bookkeeping of `tokens` more seen. A compiled step of the static form counts on the device
        only: a Python number that changed from one compiled step to the next would make dynamo recompile, and a
        CUDA graph record anew, at every step."""
        if self.seen_counter is not None:
            self.seen_counter.add_(tokens)
            if torch.compiler.is_compiling():
                self._seen_host = None
                return
        if self._seen_host is not None:
            self._seen_host += tokens

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
        self._seen_host, self.seen_counter = 0, None

    def _apply_to_batch(self, fn) -> None:
        self._step_geometry = None
        for layer in self.layers:
            layer.apply_to_batch(fn)
        for name in self._ROWS:
            value = getattr(self, name)
            if value is not None:
                setattr(self, name, fn(value))

    def detach(self) -> CompressiveMemoryCache:
        """Makes sure no autograd graph outlives the step (the model stores detached layer inputs already)."""
        for layer in self.layers:
            layer.apply_to_batch(lambda t: t.detach())
        return self

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

    def fills_differ(self) -> bool:
        """Static form: whether the rows hold different numbers of slots (reads the fills back to the host)."""
        lengths = self.row_lengths()
        return any(row != lengths[0] for row in lengths)

    def run_rows(self, valid: torch.Tensor, run, layers) -> list:
        """Static form: each row's real tokens (valid [batch, seq]) run on that row alone, from its own fill.
        `run(row_cache, row, index)` runs the tokens `index` [n] of `row` against `row_cache`, the row alone in
        the compact form; the row then goes back into the static form (`layers`: see `to_static`). Returns
        [(row, index, what run returned)] for the rows with real tokens."""
        results = []
        for row in range(valid.shape[0]):
            index = valid[row].nonzero()[:, 0]
            if index.numel() == 0:
                continue
            sub = select_row(self, row)
            sub.to_compact()
            results.append((row, index, run(sub, row, index)))
            sub.to_static(self._layout, layers)
            put_row(self, row, sub)
        return results

    # the memories proper (the projected keys/values are a derived buffer that inference rebuilds), and the static
    # form, whose rows may be at different fills: every buffer as it is, with the per-row counters
    _SAVED = tuple(name for name in CompressiveMemoryLayer._BATCHED if name not in ("keys", "values"))
    _SAVED_STATIC = (*CompressiveMemoryLayer._STATIC, "rel_table")

    def state_dict(self) -> dict:
        """The cache as a dict of tensors and plain values (for `torch.save`; loads with weights_only=True), in
        either form: the compact one (training) or the static one (no-grad decoding steps, or a forward over padded
        rows of different lengths), which is kept whole, so that rows at different fills come back exactly."""
        layers = [{name: getattr(layer, name) for name in self._SAVED if getattr(layer, name) is not None}
                  for layer in self.layers]  # fmt: skip
        state = {"seen_tokens": int(self.seen_tokens), "layers": layers}
        if self.is_static:
            state["static"] = {
                "layout": dataclasses.asdict(self._layout),
                "crop_margin": self.crop_margin,
                "groups_ready": bool(self._groups_ready),
                "rows": {name: getattr(self, name) for name in self._ROWS},
                "layers": [
                    {name: getattr(layer, name) for name in self._SAVED_STATIC if getattr(layer, name) is not None}
                    for layer in self.layers
                ],
            }
        return state

    @classmethod
    def from_state_dict(cls, state: dict, device=None) -> CompressiveMemoryCache:
        """The inverse of `state_dict`, on `device`."""
        static = state.get("static")
        cache = cls(len(state["layers"]), crop_margin=static["crop_margin"] if static else 0)
        cache.seen_tokens = int(state["seen_tokens"])
        _restore_fields(cache.layers, state["layers"], cls._SAVED, device)
        if static:
            cache._layout = StaticLayout(**static["layout"])
            cache._groups_ready = bool(static["groups_ready"])
            for name in cls._ROWS:
                setattr(cache, name, _place(static["rows"][name], device))
            # a static form saved by an earlier release: separate group buffers (now the compressed ring's own)
            saved = [{k: v for k, v in fields.items() if not k.startswith("grouped")} for fields in static["layers"]]
            _restore_fields(cache.layers, saved, cls._SAVED_STATIC, device)
            widen_compressed_ring(cache)
            cache.seen_counter = torch.full((), cache.seen_tokens, dtype=torch.long, device=cache.rows_seen.device)
            mark_static_addresses(cache)
        return cache

    @torch.no_grad()
    def to_static(self, layout: StaticLayout, layers) -> None:
        """Compact form (every row at the same fill) -> the static form of `layout`. The model's decoder `layers`
        compute what only they can: each layer's relative table and its memories' projections, when not held."""
        for layer, state in zip(layers, self.layers):
            state.prepare_projections(layer, layout.capacity, state.mem)
        to_static(self, layout)
        if layout.grouped:  # the leading group buffers exist before any (compiled) step writes them in place
            allocate_groups(self, layers)
        mark_static_addresses(self)

    def to_compact(self) -> None:
        """Static form whose rows are all at the same fill -> compact form (reads the fills back to the host)."""
        to_compact(self)

    def decode_step(self, token_valid: torch.Tensor, tokens_real: bool, compressors) -> DecodeStep:
        """Static form: the plan of one decoding step (token_valid [batch]), which the layers (`compressors`,
        whose f_c compress what is evicted) run through (see `DecodeStep`)."""
        return DecodeStep(self, token_valid, tokens_real, compressors)

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
        rewind(self, count)


def cache_of_rows(rows: list[tuple[CompressiveMemoryCache, int]], device=None) -> CompressiveMemoryCache:
    """A cache (on `device`) of the given rows of other caches, in order ((cache, row) pairs, all in the compact form
    and at the same fill, as the caches of one training step are): how a resumed run regroups the memories it
    carries when its processes or accumulation steps hold other rows than the run that saved them."""
    states = [cache.state_dict() for cache, _ in rows]
    if any("static" in state for state in states) or len({state["seen_tokens"] for state in states}) > 1:
        raise ValueError("cache_of_rows takes caches in the compact form that have seen the same number of tokens")
    layers = [
        {name: torch.cat([state["layers"][depth][name][row : row + 1] for state, (_, row) in zip(states, rows)])
         for name in fields}
        for depth, fields in enumerate(states[0]["layers"])
    ]  # fmt: skip
    return CompressiveMemoryCache.from_state_dict({"seen_tokens": states[0]["seen_tokens"], "layers": layers}, device)


def _place(tensor: torch.Tensor, device) -> torch.Tensor:
    return tensor.to(device) if device is not None else tensor


def _restore_fields(layers: list[CompressiveMemoryLayer], saved: list[dict], allowed: tuple[str, ...], device):
    for layer, fields in zip(layers, saved):
        unknown = set(fields) - set(allowed)
        if unknown:
            raise ValueError(f"saved memory has unknown fields {sorted(unknown)}; expected some of {allowed}")
        for name, tensor in fields.items():
            setattr(layer, name, _place(tensor, device))
