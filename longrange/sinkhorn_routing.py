"""Routing and bucket helpers of the Sinkhorn model, below both the head groups (`sinkhorn_heads.py`) and the
generation cache (`cache_sinkhorn.py`): what the groups derive from the padding mask (`BucketMask`, computed once
per forward for every layer: `CausalTerms`, `SortTerms`), bucket summaries and the routing choice (float32
whatever autocast says), picking whole buckets out of a cache bank, attention inside buckets and the dense maps of
output_attentions.

Only same-folder relative imports: `save_pretrained` copies this file next to the weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .layers import attend, is_exporting

NEG = -1e30  # routing score of a candidate that may not be chosen (float32 routing math)
CAN_TELL_EXPORT = hasattr(torch.compiler, "is_exporting")  # torch >= 2.7


class BucketMask:
    """A padding mask [b, L] (bool, True = a real token; L whole buckets) and what the head groups derive from it
    alone: bucket counts, which candidates may be chosen, additive masks, index tensors. The model hands the same
    BucketMask to every layer, so each such term is computed once per forward, not once per layer (in eager steps
    on a GPU, every operator is a launch from the host). A group asks `terms(key, compute)`; the key names what
    `compute(mask)` depends on besides the mask. A graph compiled from the whole model keeps them too (the compiler
    does not merge the layers' copies of a term: each would be a kernel per layer). A layer compiled alone, with the
    BucketMask made outside its graph, keeps nothing: the compiler folds the terms into the layer's kernels, and a
    kept term would make the first layer's inputs differ from the others' (two graphs)."""

    def __init__(self, mask: torch.Tensor):
        self.mask = mask
        self._in_graph = torch.compiler.is_compiling()  # made inside the graph being compiled
        self._terms: dict = {}
        self._copies: dict = {}

    def terms(self, key: tuple, compute):
        if torch.compiler.is_compiling() and not self._in_graph:
            return compute(self.mask)
        if key not in self._terms:
            self._terms[key] = compute(self.mask)
        return self._terms[key]

    def to(self, device, non_blocking: bool = False) -> BucketMask:
        """The mask on `device`: itself when it is there already, else one copy per device, which keeps the terms of
        the layers on that device (Accelerate's hooks move every layer's inputs to the layer's device when a model
        is split over devices with `device_map`)."""
        device = torch.device(device)
        if self.mask.device == device:
            return self
        if device not in self._copies:
            self._copies[device] = BucketMask(self.mask.to(device, non_blocking=non_blocking))
        return self._copies[device]


def bucket_mask(mask) -> BucketMask:
    """A head group's mask argument as a BucketMask: the model's (shared by its layers) or, for a plain [b, L]
    tensor, one of its own."""
    return mask if isinstance(mask, BucketMask) else BucketMask(mask)


class CausalTerms(NamedTuple):
    """What a causal head group derives from its padding mask [b, L] alone, the same in every layer: the tokens that
    enter the routing summaries (counted [b, L]; skip_first: not the short first bucket of shifted heads), as
    float32 weights [b, n, B] and counts [b, n]; each bucket's leading token (float [b, n]) and how many tokens its
    query summary holds (at least 1); the matrix of `earlier_sums`; the batch and head index tensors of advanced
    indexing. Self-attention also: which bank candidates each query bucket may choose (valid [b, 1, n, n_null +
    n]), the bank's key mask [b, n_null + n, B], the own buckets' bank indices [n], the own bucket's additive causal
    mask [b, 1, n, B, B] and, with running_key_summary, each token's count of keys so far (at least 1) [b, 1, L,
    1] and the in-bucket matrix of `running_sums`."""

    counted: torch.Tensor
    weights: torch.Tensor
    counts: torch.Tensor
    lead_real: torch.Tensor
    lead_count: torch.Tensor
    before: torch.Tensor
    index: tuple[torch.Tensor, torch.Tensor]
    valid: torch.Tensor | None = None
    bank_mask: torch.Tensor | None = None
    own: torch.Tensor | None = None
    own_bias: torch.Tensor | None = None
    running_counts: torch.Tensor | None = None
    within: torch.Tensor | None = None

    @classmethod
    def of(cls, group, mask, dtype: torch.dtype) -> CausalTerms:
        """The terms of a causal group (its bucket layout and options) for its already shifted mask (a BucketMask,
        which keeps them for the other layers, or a [b, L] tensor) and attention in `dtype`."""
        g = group
        key = ("causal", g.cross, g.bucket_size, g.n_top, g.num_heads, g.skip_first, g.null_copies, dtype)
        return bucket_mask(mask).terms(key + (g.running_key_summary,), lambda m: cls._build(g, m, dtype))

    @classmethod
    def _build(cls, g, mask: torch.Tensor, dtype: torch.dtype) -> CausalTerms:
        size, n_null = g.bucket_size, g.n_top
        b, n = mask.shape[0], mask.shape[1] // size
        counted = torch.nn.functional.pad(mask[:, size:], (size, 0), value=False) if g.skip_first else mask
        weights = counted.view(b, n, size).to(torch.float32)
        counts, lead_real = weights.sum(2), weights[..., 0]  # [b, n]
        before = earlier_matrix(n, mask.device)
        lead_count = (earlier_sums(counts[..., None], before)[..., 0] + lead_real).clamp_min(1)
        common = (counted, weights, counts, lead_real, lead_count, before)
        index = batch_head_index(b, g.num_heads, 4, mask.device)
        if g.cross:  # the candidates come from the context (CausalContextHeads._bank)
            return cls(*common, index)
        real_valid = before.bool()[None, None] & (counts > 0)[:, None, None, :]  # key bucket j < query bucket u
        valid = torch.cat([real_valid.new_ones(b, 1, n, n_null), real_valid], dim=-1)
        bucket = torch.arange(n, device=mask.device)
        if g.skip_first:  # the short first bucket attends no chosen bucket
            valid = valid & (bucket > 0)[None, None, :, None]
        slot = torch.arange(size, device=mask.device)
        null_m = (slot < (size if g.null_copies else 1)).expand(b, n_null, size)  # null buckets: slot 0 (or all)
        own_m = mask.view(b, 1, n, 1, size) & (slot[None, :] <= slot[:, None])  # causal inside the own bucket
        running = within = None
        if g.running_key_summary:
            within = torch.ones(size, size, device=mask.device).tril()
            running = running_sums(weights.view(b, 1, -1, 1), size, within, before).clamp_min(1)
        bank_mask = torch.cat([null_m, mask.view(b, n, size)], dim=1)
        own_bias = additive(own_m, dtype)
        return cls(*common, index, valid, bank_mask, n_null + bucket, own_bias, running, within)

    def from_bucket(self, first: int) -> CausalTerms:
        """The terms that `CausalSinkhornHeads._gather_chosen` and `_attend` read per query bucket, for the query
        buckets from `first` on (a chunk attends those only)."""
        own = None if self.own is None else self.own[first:]
        return self._replace(own=own, own_bias=None if self.own_bias is None else self.own_bias[:, :, first:])


class SortTerms(NamedTuple):
    """What a non-causal head group derives from its padding masks alone: the float32 weights [b, n, B] and counts
    [b, n] of the query and key buckets, the key mask [b, nk, Bk], which key buckets may be chosen (valid,
    broadcastable to the scores), each query bucket's index [nq], each key slot's token [nk, Bk] and the batch and
    head index tensors of advanced indexing."""

    q_weights: torch.Tensor
    q_counts: torch.Tensor
    k_weights: torch.Tensor
    k_counts: torch.Tensor
    k_mask: torch.Tensor
    valid: torch.Tensor
    own: torch.Tensor
    k_pos: torch.Tensor
    index: tuple[torch.Tensor, torch.Tensor]

    @classmethod
    def of(cls, group, q_mask, k_mask, heads: int) -> SortTerms:
        """The terms of a non-causal group (its bucket layout and routing options) with `heads` heads, for the query
        mask (a BucketMask or a [b, Lq] tensor) and the key mask [b, Lk] (None: self-attention, whose terms the
        BucketMask keeps for the other layers)."""
        g, masks = group, bucket_mask(q_mask)
        if k_mask is not None:
            return cls._build(g, masks.mask, k_mask, heads)
        key = ("sinkhorn", g.bucket_size, heads, g.n_sortcut > 0, g.sinkhorn_iter is not None, g.excludes_own())
        return masks.terms(key, lambda m: cls._build(g, m, m, heads))

    @classmethod
    def _build(cls, g, q_mask: torch.Tensor, k_mask: torch.Tensor, heads: int) -> SortTerms:
        b, device = q_mask.shape[0], q_mask.device
        nq, nk = q_mask.shape[1] // g.bucket_size, k_mask.shape[1] // g.kv_bucket_size
        q_weights = q_mask.view(b, nq, g.bucket_size).to(torch.float32)
        k_weights = q_weights if k_mask is q_mask else k_mask.view(b, nk, g.kv_bucket_size).to(torch.float32)
        q_counts = q_weights.sum(2)
        k_counts = q_counts if k_mask is q_mask else k_weights.sum(2)
        valid = (k_counts > 0)[:, None, None, :]  # [b, 1, 1, nk]
        own = torch.arange(nq, device=device)
        if g.n_sortcut == 0 and g.sinkhorn_iter is not None:  # balancing: padding-only query buckets stay out
            valid = valid & (q_counts > 0)[:, None, :, None]
        if g.n_sortcut == 0 and g.excludes_own():
            valid = valid & (own[:, None] != torch.arange(nk, device=device))[None, None]
        k_pos = torch.arange(nk * g.kv_bucket_size, device=device).view(nk, g.kv_bucket_size)
        bkm = k_mask.view(b, nk, g.kv_bucket_size)
        return cls(
            q_weights, q_counts, k_weights, k_counts, bkm, valid, own, k_pos, batch_head_index(b, heads, 4, device)
        )


def routing_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """`a @ b` in float32 whatever autocast says, for the routing summaries and scores: under bf16 autocast a
    product would be rounded to bf16, enough to flip routing choices between a bf16 and a float32 step (the
    Gumbel-Sinkhorn balancing most). Outside autocast exactly `a @ b` on float32 tensors."""
    with torch.autocast(a.device.type, enabled=False):
        return a.float() @ b.float()


def routing_einsum(equation: str, *operands: torch.Tensor) -> torch.Tensor:
    """`torch.einsum` in float32 whatever autocast says (see routing_matmul)."""
    with torch.autocast(operands[0].device.type, enabled=False):
        return torch.einsum(equation, *(t.float() for t in operands))


def earlier_sums(x: torch.Tensor, before: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., n, d] -> [..., n, d] in float32: row i holds the sum of the rows before it. A product with a strictly
    lower triangular matrix (`before`, [n, n] float32: `earlier_matrix(n)`, made here when not given), not a
    cumulative sum: over few, long rows inductor writes a cumulative sum as a split scan, into which torch 2.11 (not
    2.13) cannot fuse index arithmetic for a GPU (compiling Sinkhorn training at 1 x 32,768 tokens failed with "list
    indices must be integers or slices, not NoneType"). The rows are buckets: the routing scores hold n x n numbers
    per head already."""
    return routing_matmul(earlier_matrix(x.shape[-2], x.device) if before is None else before, x)


def earlier_matrix(n: int, device) -> torch.Tensor:
    """[n, n] float32, 1 where column < row: `earlier_sums`' product."""
    return torch.ones(n, n, device=device).tril(-1)


def running_sums(x: torch.Tensor, bucket: int, within=None, before=None) -> torch.Tensor:
    """Inclusive prefix sums of x [..., L, d] along L (a multiple of bucket) in float32, without a cumulative sum
    (see earlier_sums): inside each bucket a product with a lower triangular matrix (`within`, [bucket, bucket]
    float32, made here when not given), plus the earlier buckets' (`before`: see earlier_sums)."""
    *lead, length, d = x.shape
    blocks = x.reshape(*lead, length // bucket, bucket, d).float()
    within = torch.ones(bucket, bucket, device=x.device).tril() if within is None else within
    inside = routing_matmul(within, blocks)
    return (inside + earlier_sums(blocks.sum(-2), before)[..., None, :]).reshape(*lead, length, d)


def bucket_sums(x: torch.Tensor, mask: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked per-bucket sums in float32. x: [b, h, L, d], mask: [b, L] -> sums [b, h, n, d], counts [b, n]."""
    weights = mask.view(mask.shape[0], -1, bucket).to(torch.float32)
    return weighted_sums(x, weights), weights.sum(2)


def weighted_sums(x: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Per-bucket sums of x [b, h, L, d] weighted by weights [b, n, B] (float32; L = n * B) -> [b, h, n, d] float32."""
    b, n, bucket = weights.shape
    # a product (bf16 inputs promote to float32) and a float32 sum: one fused reduction when compiled (a matmul or
    # einsum would copy x first)
    blocks = x.view(b, x.shape[1], n, bucket, x.shape[-1])
    return (blocks * weights[:, None, :, :, None]).sum(3, dtype=torch.float32)


def top_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """[..., c] scores -> [..., k] indices of the k largest, best first, ties to the lowest index: the first k of a
    stable descending sort (one kernel). torch.onnx exports no stable sort: while exporting, `_top_rounds`."""
    if _exporting():
        return _top_rounds(scores, k)
    return torch.sort(scores, dim=-1, descending=True, stable=True).indices[..., :k]


def _exporting() -> bool:
    """Whether torch.export or the ONNX exporter is tracing; always on torch < 2.7, which cannot tell
    (`layers.is_exporting`). The legacy ONNX exporter never runs under torch.compile, whose graphs need not ask."""
    if not CAN_TELL_EXPORT or is_exporting():
        return True
    return not torch.compiler.is_compiling() and torch.onnx.is_in_onnx_export()


def _top_rounds(scores: torch.Tensor, k: int) -> torch.Tensor:
    """`top_indices` with operators that torch.onnx exports: k rounds, each taking the lowest index holding the
    largest score not taken yet (also when that is -inf)."""
    taken = torch.zeros_like(scores, dtype=torch.bool)
    picks = []
    for _ in range(k):
        left = scores.masked_fill(taken, float("-inf"))
        best = (left == left.amax(dim=-1, keepdim=True)) & ~taken  # [..., c]: the largest left, maybe tied
        pick = best.to(torch.int32).argmax(dim=-1, keepdim=True)  # the first of them
        picks.append(pick)
        taken = taken.scatter(-1, pick, True)
    return torch.cat(picks, dim=-1)


def select_buckets(
    scores: torch.Tensor,
    valid: torch.Tensor,
    n_select: int,
    temperature: float,
    sinkhorn_iter: int | None = None,
    gumbel: bool = False,
    weighted: bool = False,
    sequential: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Choose `n_select` candidates per row.

    scores: float32 [b, h, q, c]; valid: bool broadcastable to it (candidates that may be chosen).
    sinkhorn_iter: None = independent top-k per row (non-permutative); an int = Gumbel-Sinkhorn balancing of the
    score matrix first (noise only when `gumbel`, i.e. in training).
    Returns indices [b, h, q, n_select], picked_valid (bool, same shape) and the straight-through scale (same
    shape): exactly 1.0 in the forward pass, carrying d(log routing weight) in the backward pass (None when
    gradients are off). `weighted`: the scale is the routing weight itself (forward and backward; never None).
    `sequential` (top-k only): the i-th pick's weight is the softmax over the candidates not picked before it.
    """
    valid = valid.expand(scores.shape)
    logits = scores.masked_fill(~valid, NEG)
    if sinkhorn_iter is None:
        # ties (e.g. null buckets scored alike) go to the lowest index, the same in the full and the cached pass
        idx = top_indices(logits, n_select)
        log_weights = (logits / temperature).log_softmax(dim=-1)
    else:
        if gumbel:
            uniform = torch.rand_like(logits).clamp(1e-6, 1 - 1e-6)
            logits = logits - torch.log(-torch.log(uniform))
        log_weights = (logits / temperature).masked_fill(~valid, NEG)
        for _ in range(sinkhorn_iter):
            log_weights = (log_weights - log_weights.logsumexp(-1, keepdim=True)).masked_fill(~valid, NEG)
            log_weights = (log_weights - log_weights.logsumexp(-2, keepdim=True)).masked_fill(~valid, NEG)
        # (ties to the lowest index, as above: balancing can tie candidates exactly, e.g. two of equal column mass)
        idx = top_indices(log_weights, n_select)
    picked_valid = valid.gather(-1, idx)
    if sequential:
        picked = _sequential_log_weights(logits / temperature, idx)
    else:
        picked = log_weights.gather(-1, idx)
    if weighted:
        return idx, picked_valid, picked.masked_fill(~picked_valid, 0.0).exp()
    if not torch.is_grad_enabled():
        return idx, picked_valid, None  # the scale is exactly 1: only its gradient matters
    picked = picked.masked_fill(~picked_valid, 0.0)
    scale = torch.exp(picked - picked.detach())
    return idx, picked_valid, scale


def _sequential_log_weights(scaled: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Log-weight of each pick as a softmax over the candidates left after the earlier picks (sinkhorn-transformer's
    iterative top-k). scaled: [..., c] scores / temperature; idx: [..., k] picks in order -> [..., k]."""
    left = scaled
    parts = []
    for i in range(idx.shape[-1]):
        pick = idx[..., i : i + 1]
        parts.append(scaled.gather(-1, pick) - left.logsumexp(-1, keepdim=True))
        left = left.scatter(-1, pick, float("-inf"))
    return torch.cat(parts, dim=-1)


def batch_head_index(b: int, h: int, ndim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Index tensors [b, 1, ...] and [1, h, ...] (ndim dims) for advanced indexing of [b, h, ...] tensors."""
    shape_b = [b] + [1] * (ndim - 1)
    shape_h = [1, h] + [1] * (ndim - 2)
    return torch.arange(b, device=device).view(shape_b), torch.arange(h, device=device).view(shape_h)


def pick_buckets(tensors, heads: slice, start: int, size: int, which: torch.Tensor) -> list[torch.Tensor]:
    """Whole buckets of cache slots: bucket j of a head is slots start + j * size ... start + (j + 1) * size - 1.

    tensors: a layer's keys and values, each [b, H, S, d] (S a multiple of size); heads: the group's heads;
    which: [b, h or 1, k] bucket indices (clamped into range; callers mask what falls outside) -> each [b, h,
    k * size, d]. Every (row, head, bucket) is one row of a view of the cache as blocks of `size` slots (from slot
    `start % size` of the flattened tensor), so the pick is one `index_select` of contiguous blocks (several times
    faster on the CPU than advanced indexing or `gather`). The view is a slice and a reshape, not `as_strided`,
    which torch.onnx writes as a Gather of every element of the view (the cost of the whole cache each step)."""
    b, n_heads, slots, d = tensors[0].shape
    per_head = slots // size
    skip, shift = divmod(start, size)  # whole buckets, then slots
    h = heads.stop - heads.start
    head = torch.arange(b, device=which.device)[:, None] * n_heads + heads.start + torch.arange(h, device=which.device)
    flat = (head[..., None] * per_head + (which + skip).clamp(0, per_head - 2)).reshape(-1)  # [b * h * k]
    blocks = (b * n_heads * per_head - 1) * size  # (the last block would run past the end when shift > 0)
    return [
        t.view(-1, d).narrow(0, shift, blocks).view(-1, size, d).index_select(0, flat).view(b, h, -1, d)
        for t in tensors
    ]


def prev_bucket(t: torch.Tensor, dim: int, shift: int, fill) -> torch.Tensor:
    """t shifted along the bucket dim: entry u holds entry u - shift (u + |shift| when negative), `fill` outside."""
    n = t.shape[dim]
    pad_shape = list(t.shape)
    pad_shape[dim] = abs(shift)
    pad = torch.full(pad_shape, fill, dtype=t.dtype, device=t.device)
    if shift > 0:
        return torch.cat([pad, t.narrow(dim, 0, n - shift)], dim=dim)
    return torch.cat([t.narrow(dim, -shift, n + shift), pad], dim=dim)


def additive(mask: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Bool mask (True = may attend) -> additive float mask (0 or the dtype's most negative value)."""
    zero = mask.new_zeros((), dtype=dtype)  # (a 0-dim tensor sets the result's dtype; on the mask's device)
    return torch.where(mask, zero, torch.finfo(dtype).min)


def attend_buckets(q, k, v, mask, dropout: float, implementation: str, bias=None, return_weights=False):
    """Attention inside buckets. q: [b, h, n, Lq, d]; k, v: [b, h, n, K, d]; mask (bool) or bias (additive
    float): broadcastable to [b, h, n, Lq or 1, K]. Heads and buckets are merged into one dimension because the
    fused sdpa kernels take 4-D inputs (5-D inputs fall back to a path about 3x slower on CPU).

    `bias` is for callers whose every real query row sees at least one key: it skips `attend`'s bool-to-float
    conversion and its zeroing of fully masked rows (only padded query rows can be fully masked there, and
    their outputs are never used). `return_weights` (output_attentions): the explicit softmax, whatever the
    implementation, and also its probabilities (after dropout) [b, h, n, Lq, K]."""
    b, h, n, lq, d = q.shape
    keys = k.shape[3]
    given = mask if bias is None else bias
    rows = given.shape[3]
    flat = given.expand(b, h, n, rows, keys).reshape(b, h * n, rows, keys)
    out = attend(
        q.reshape(b, h * n, lq, d),
        k.reshape(b, h * n, keys, d),
        v.reshape(b, h * n, keys, d),
        flat if bias is None else None,
        bias=flat if bias is not None else None,
        dropout=dropout,
        implementation=implementation,
        return_weights=return_weights,
    )
    if return_weights:
        out, probs = out
        return out.view(b, h, n, lq, d), probs.view(b, h, n, lq, keys)
    return out.view(b, h, n, lq, d)


def token_weights(probs, key_pos, factor, width: int) -> torch.Tensor:
    """Bucketed attention probabilities placed at the keys' token positions (output_attentions).

    probs: [b, h, n, Lq, K]; key_pos: long, broadcastable to [b, h, n, K], the column of each key in the dense
    map (-1: no token, its probability is zero); factor: the weight that multiplies each key's value (routed
    buckets' routing weights), broadcastable to [b, h, n, K], or None. Returns [b, h, n * Lq, width] with
    output = map @ values; a token that is a key twice in a bucket (own bucket also routed) adds up."""
    b, h, n, lq, keys = probs.shape
    if factor is not None:
        probs = probs * factor.to(probs.dtype)[..., None, :]
    index = key_pos.masked_fill(key_pos < 0, width)[..., None, :].expand(b, h, n, lq, keys)
    dense = probs.new_zeros(b, h, n, lq, width + 1).scatter_add_(-1, index, probs)
    return dense[..., :width].reshape(b, h, n * lq, width)
