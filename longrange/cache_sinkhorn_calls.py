"""The calls the Sinkhorn model makes on its generation cache, and what the host knows of them: a prefill, one-token
decoding steps and chunks (several new tokens per row in one pass). `CacheCalls` is mixed into `SinkhornCache`
(cache_sinkhorn.py), which owns the state; `DecodingStep` and `Chunk` describe the call under way to the layers.

Only same-folder relative imports: `save_pretrained` copies this file next to the weights.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from .layers import put_along


def grow_to(t: torch.Tensor, dim: int, size: int) -> torch.Tensor:
    if t.shape[dim] >= size:
        return t
    shape = list(t.shape)
    shape[dim] = size - t.shape[dim]
    return torch.cat([t, torch.zeros(shape, dtype=t.dtype, device=t.device)], dim=dim)


def static_buffer(t: torch.Tensor) -> torch.Tensor:
    """Mark a cache tensor as living at a fixed address (it is updated in place), so that compiled decoding steps
    (CUDA graphs included) keep reading and writing it without copies, as transformers' StaticCache does."""
    if not torch.compiler.is_compiling():
        torch._dynamo.mark_static_address(t)
    return t


class DecodingStep(NamedTuple):
    """What a layer needs to know about the decoding step under way (one new token per row).

    position: [b] long, each row's real tokens so far (the new token's position and cache slot - origin);
    real: [b] bool, whether the row's new token is real (padding enters no summary and moves no position);
    host: None (a static step), or (positions, reals, epoch) in a host-following step: the same numbers as
        Python lists and the cache's epoch (working windows built before it are stale);
    origin: the key/value slot of position 0;
    routes: False when the host knows that no row's token leads a bucket, so that no head group routes and each
        keeps its last window (a static step of generate(), see `SinkhornCache.plan_real_step`); True: every
        static step computes a choice, keeps it where a token leads a bucket, and builds its window."""

    position: torch.Tensor
    real: torch.Tensor
    host: tuple | None
    origin: int
    routes: bool = True
    memo: dict | None = None  # the step's index tensors, shared by its head groups (see `RoutingState.step_index`)


class Chunk(NamedTuple):
    """Several new tokens per row on a filled cache (between `SinkhornCache.begin_chunk` and `end_chunk`).

    slot: [b, L] each token's position in its row's cache: a real token's position; padding a scratch slot after
        the row's real tokens (masked, overwritten by later tokens);
    lengths: [b] each row's real tokens after the chunk;
    length: the tokens a layer attends over, whole buckets (>= every row's length);
    first: the smallest slot of a new token (the query buckets before its bucket need no attention)."""

    slot: torch.Tensor
    lengths: torch.Tensor
    length: int
    first: int

    def real(self) -> torch.Tensor:
        """[b, length] bool: which slots a layer attends over hold real tokens (each row's first `lengths`)."""
        return torch.arange(self.length, device=self.lengths.device) < self.lengths[:, None]


class CacheCalls:
    """The model's calls on a `SinkhornCache` (mixed into it): `begin_prefill` / `end_prefill`, a one-token
    decoding step (`begin_step`, `plan_real_step`, `end_step`, `step`) or a chunk (`takes_chunk`, `begin_chunk`,
    `end_chunk`), each keeping the cache's lengths, token mask and host counters; `reserve` grows the buffers of
    eager calls."""

    # a one-token eager step costs about what a chunk's pass costs over this many tokens so far (300 to 500 measured
    # on a 2-core CPU, models of 2 x 256 and 4 x 512, 1,024 to 12,288 tokens: `benchmarks/benchmark_chunks.py`);
    # see `takes_chunk`
    chunk_ratio = 512

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
            self.token_mask = static_buffer(grow_to(self.token_mask, 1, self.capacity))
            for layer in self.layers:
                layer.resize(self.capacity, self.bucket_capacity)

    def begin_prefill(self, mask: torch.Tensor) -> None:
        b, n = mask.shape
        self.reserve(n)
        self.token_mask = static_buffer(torch.zeros(b, self.capacity, dtype=torch.bool, device=mask.device))
        self.token_mask[:, :n] = mask
        self.lengths = static_buffer(mask.sum(1))
        self.seen = static_buffer(torch.full((), n, dtype=torch.long, device=mask.device))  # (no host copy)
        self._seen_host = n
        self.prefill_length = n
        self.on_host = mask.device.type == "cpu" and not self.static_steps
        self.host_epoch += 1

    def end_prefill(self) -> None:
        self.prefilled = True

    def begin_step(self, real: torch.Tensor) -> None:
        if not torch.compiler.is_compiling() and self._seen_host is not None:
            self.reserve(self._seen_host + 1)
        self.step_real, self.step_host, self.step_memo = real, None, {}
        if self.follows_host:
            self._window_epoch = None  # host-following steps keep windows of their own
            if self._compiled_step:
                self.host_epoch, self._compiled_step = self.host_epoch + 1, False
            self.step_host = (self.lengths.tolist(), real.tolist())
        put_along(self.token_mask, 1, self.seen.view(1, 1).expand(real.shape[0], 1), real[:, None])

    def plan_real_step(self) -> None:
        """generate()'s word before a one-token step: every row's new token is real. The host then knows each row's
        position (padding read back once per change of the state) and whether a row leads a bucket of either
        offset; the other steps neither route nor rebuild windows (`DecodingStep.routes`; compiled: a graph each)."""
        seen = self.get_seq_length()
        if self._pads_host is None or self._pads_host[0] != self.host_epoch:
            self._pads_host = (self.host_epoch, [seen - n for n in self.lengths.tolist()])
        size, kept = self.bucket_size, self._window_epoch == self.host_epoch
        leads = any((seen - pad + off) % size == 0 for pad in self._pads_host[1] for off in (0, 1))
        self.step_routes, self._window_epoch = leads or not kept, self.host_epoch

    def end_step(self, real: torch.Tensor) -> None:
        self.lengths.add_(real.long())
        self.seen.add_(1)
        self.step_real = self.step_host = self.step_memo = self.step_routes = None
        if torch.compiler.is_compiling():
            self._seen_host = None
            self._compiled_step = True  # (written, never read, in the graph: no guard on it)
        elif self._seen_host is not None:
            self._seen_host += 1

    def takes_chunk(self, n: int) -> bool:
        """Whether n > 1 new tokens per row run as one chunk (`begin_chunk`: one pass over every token so far) or as
        n one-token steps: a chunk when n is at least 1/`chunk_ratio` of the tokens so far. Compiled calls step."""
        if torch.compiler.is_compiling():
            return False
        return n > 1 and self.chunk_ratio * n >= self.get_seq_length() + n

    def begin_chunk(self, mask: torch.Tensor) -> None:
        """Several new tokens per row (mask [b, L]: the real ones) on a filled cache: each layer writes them and
        attends over every token so far as a prefill would (`SinkhornLayerState.write_chunk`), then rebuilds its
        routing state (as `crop` does). Eager: reads the number of tokens so far on the host."""
        b, n = mask.shape
        seen = self.get_seq_length()
        self.reserve(seen + n)
        real = mask.long()
        count = real.sum(1, keepdim=True)
        before = self.lengths[:, None]
        slot = torch.where(mask, before + real.cumsum(1) - 1, before + count + (1 - real).cumsum(1) - 1)
        self.token_mask[:, seen : seen + n] = mask
        length = math.ceil((seen + n) / self.bucket_size) * self.bucket_size
        self.chunk = Chunk(slot, self.lengths + count[:, 0], length, int(self.lengths.min()))

    def end_chunk(self) -> None:
        n, seen = self.chunk.slot.shape[1], self.get_seq_length()
        self.lengths.copy_(self.chunk.lengths)
        self.seen.add_(n)
        self._seen_host = seen + n
        self.host_epoch += 1  # (working windows are stale)
        self.chunk = None

    @property
    def step(self) -> DecodingStep:
        """The decoding step under way (between `begin_step` and `end_step`)."""
        host, routes = None if self.step_host is None else (*self.step_host, self.host_epoch), self.step_routes
        return DecodingStep(self.lengths, self.step_real, host, self.origin, routes is not False, self.step_memo)

    @property
    def host_seq_length(self) -> int | None:
        """Tokens given so far, padding included, as the host knows them (None after compiled steps)."""
        return self._seen_host

    @property
    def follows_host(self) -> bool:
        """Whether this step reads positions on the host (see the class docstring): a CPU cache, not compiling."""
        return not torch.compiler.is_compiling() and self.on_host
