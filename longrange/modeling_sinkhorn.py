"""Sinkhorn Transformer (Tay et al. 2020, "Sparse Sinkhorn Attention") as a transformers model.

Reading order: routing helpers -> head groups (local, Sinkhorn, causal Sinkhorn) -> self / cross attention ->
blocks and layer -> generation cache -> PreTrainedModel -> SinkhornModel -> SinkhornForCausalLM / ForMaskedLM.

The sequence is cut into buckets of `bucket_size`. A sort net scores every (query bucket, key bucket) pair from
bucket summaries; each query bucket attends its own bucket plus the `n_top_buckets` best key buckets in ONE
softmax. The sort net chooses the bucket indices; by default (`weight_routed_values`) the values of each chosen
bucket are multiplied by its routing weight, as the seed's reordering matrix does, which trains the sort net and
lets a query bucket turn down a weak choice. With `weight_routed_values=False` a straight-through weight (exactly
1 in the forward pass) carries the routing softmax's gradient instead, and outputs are plain attention over the
chosen keys and values.

Causal variant: a query bucket may choose strictly earlier key buckets or learned null buckets (so bucket 0 has
something to choose), and attends causally inside its own bucket. The choice for a bucket is made from the
cumulative mean of the queries up to the bucket's *leading* (first) token and the means of earlier key buckets:
it only depends on tokens that exist when the leading token is processed, which is what makes the generation
cache exact. Half of the Sinkhorn heads use buckets shifted by `bucket_size - 1` (the reference "rotates" them by
that amount), so that the last token of every ordinary bucket leads a shifted bucket and gets a say in routing;
the first `bucket_size - 1` tokens form a short leading bucket that can only choose null buckets (the reference's
masked wrap-around).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import ModelOutput
from transformers.utils.generic import can_return_tuple

from .compat import cache_output, check_assisted_decoding
from .configuration_sinkhorn import SinkhornConfig
from .layers import ATTENTION_IMPLEMENTATIONS, FeedForward, attend, check_token_ids, real_tokens_first
from .product_key_memory import ProductKeyMemory
from .reversible import ReversibleSequence

_NEG = -1e30  # routing score of a candidate that may not be chosen (float32 routing math)


# ----------------------------------------------------------------------------------------------------------------
# routing helpers
# ----------------------------------------------------------------------------------------------------------------


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


def bucket_sums(x: torch.Tensor, mask: torch.Tensor, bucket: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Masked per-bucket sums in float32. x: [b, h, L, d], mask: [b, L] -> sums [b, h, n, d], counts [b, n]."""
    b, h, length, d = x.shape
    n = length // bucket
    m = mask.view(b, n, bucket).to(torch.float32)
    sums = routing_einsum("bhnsd,bns->bhnd", x.view(b, h, n, bucket, d), m)  # a batched matmul, no temporary
    return sums, m.sum(2)


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
    logits = scores.masked_fill(~valid, _NEG)
    if sinkhorn_iter is None:
        # ties (e.g. null buckets scored alike) go to the lowest index, the same in the full and the cached pass
        idx = logits.sort(dim=-1, descending=True, stable=True).indices[..., :n_select]
        log_weights = (logits / temperature).log_softmax(dim=-1)
    else:
        if gumbel:
            uniform = torch.rand_like(logits).clamp(1e-6, 1 - 1e-6)
            logits = logits - torch.log(-torch.log(uniform))
        log_weights = (logits / temperature).masked_fill(~valid, _NEG)
        for _ in range(sinkhorn_iter):
            log_weights = (log_weights - log_weights.logsumexp(-1, keepdim=True)).masked_fill(~valid, _NEG)
            log_weights = (log_weights - log_weights.logsumexp(-2, keepdim=True)).masked_fill(~valid, _NEG)
        idx = log_weights.topk(n_select, dim=-1).indices
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


def _batch_head_index(b: int, h: int, ndim: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Index tensors [b, 1, ...] and [1, h, ...] (ndim dims) for advanced indexing of [b, h, ...] tensors."""
    shape_b = [b] + [1] * (ndim - 1)
    shape_h = [1, h] + [1] * (ndim - 2)
    return torch.arange(b, device=device).view(shape_b), torch.arange(h, device=device).view(shape_h)


def _pick_buckets(tensors, heads: slice, start: int, size: int, which: torch.Tensor) -> list[torch.Tensor]:
    """Whole buckets of cache slots: bucket j of a head is slots start + j * size ... start + (j + 1) * size - 1.

    tensors: a layer's keys and values, each [b, H, S, d] (S a multiple of size); heads: the group's heads;
    which: [b, h or 1, k] bucket indices (clamped into range; callers mask what falls outside) -> each [b, h,
    k * size, d]. Every (row, head, bucket) is one row of a strided view of the cache, so the pick is one
    `index_select` of contiguous blocks (several times faster on the CPU than advanced indexing or `gather`)."""
    b, n_heads, slots, d = tensors[0].shape
    per_head = slots // size
    skip, shift = divmod(start, size)  # whole buckets, then slots
    h = heads.stop - heads.start
    head = torch.arange(b, device=which.device)[:, None] * n_heads + heads.start + torch.arange(h, device=which.device)
    flat = (head[..., None] * per_head + (which + skip).clamp(0, per_head - 2)).reshape(-1)  # [b * h * k]
    # (each tensor is a cache tensor of its own: contiguous, at the start of its storage)
    shape, strides = (b * n_heads * per_head - 1, size, d), (size * d, d, 1)
    return [t.as_strided(shape, strides, shift * d).index_select(0, flat).view(b, h, -1, d) for t in tensors]


def _prev_bucket(t: torch.Tensor, dim: int, shift: int, fill) -> torch.Tensor:
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
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, torch.finfo(dtype).min)


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


# ----------------------------------------------------------------------------------------------------------------
# head groups: each handles a contiguous slice of the heads
# ----------------------------------------------------------------------------------------------------------------


class LocalHeads(nn.Module):
    """Local windowed attention: a query in window u attends windows u-1 and u (and u+1 when non-causal)."""

    def __init__(self, num_heads: int, bucket_size: int, causal: bool, dropout: float, implementation: str):
        super().__init__()
        self.num_heads, self.bucket_size, self.causal = num_heads, bucket_size, causal
        self.dropout, self.implementation = dropout, implementation

    def forward(self, q, k, v, mask, record=None, attn_weights=None):
        """q, k, v: [b, h, L, d]; mask: [b, L] real tokens. Nothing to record for the cache: a step reads the
        window straight from the cached keys/values. `attn_weights`: a dict that receives the dense attention
        map (output_attentions; see `SinkhornSelfAttention.forward`)."""
        b, h, length, d = q.shape
        size = self.bucket_size
        n = length // size
        bq, bk, bv = (t.reshape(b, h, n, size, d) for t in (q, k, v))  # [b, h, n, B, d]
        bm = mask.view(b, 1, n, size)
        shifts = (1, 0) if self.causal else (1, 0, -1)
        keys = torch.cat([_prev_bucket(bk, 2, s, 0.0) if s else bk for s in shifts], dim=3)  # [b, h, n, kB, d]
        values = torch.cat([_prev_bucket(bv, 2, s, 0.0) if s else bv for s in shifts], dim=3)
        key_mask = torch.cat([_prev_bucket(bm, 2, s, False) if s else bm for s in shifts], dim=3)  # [b,1,n,kB]
        attn_mask = key_mask[:, :, :, None, :]  # [b, 1, n, 1, kB]
        if self.causal:
            own = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
            pattern = torch.cat([torch.ones(size, size, dtype=torch.bool, device=q.device), own], dim=1)
            attn_mask = attn_mask & pattern  # [b, 1, n, B, 2B]
        # every query sees itself (its own window is the second of `shifts`), padded queries too: no row is fully
        # masked, so an additive mask is enough and the gradient of a padded query's output (which a shifted
        # language-model label can read) is that of an ordinary softmax in every attention implementation
        itself = F.pad(torch.eye(size, dtype=torch.bool, device=q.device), (size, size * (len(shifts) - 2)))
        bias = additive(attn_mask | itself, q.dtype)  # [b, 1, n, B, kB]
        if attn_weights is not None:
            out, probs = attend_buckets(bq, keys, values, None, self._p(), self.implementation, bias, True)
            pos = torch.arange(length, device=q.device).view(1, 1, n, size)
            key_pos = torch.cat([_prev_bucket(pos, 2, s, -1) if s else pos for s in shifts], dim=3)
            attn_weights["map"] = token_weights(probs, key_pos, None, length)
            return out.reshape(b, h, length, d)
        out = attend_buckets(bq, keys, values, None, self._p(), self.implementation, bias=bias)
        return out.reshape(b, h, length, d)

    def _p(self) -> float:
        return self.dropout if self.training else 0.0

    def step(self, q, keys, values, heads, position, origin):
        """One new token per row at `position` [b] (keys/values: the layer's cache [b, H, S, d], already holding it
        at slot origin + position for this group's `heads`; a row's cached tokens are its real tokens,
        left-aligned). q: [b, h, 1, d]. The window: the previous bucket and the own bucket up to the token."""
        size = self.bucket_size
        u = torch.div(position, size, rounding_mode="floor")  # [b]
        which = torch.stack([u - 1, u], dim=-1)[:, None]  # [b, 1, 2]
        k, v = _pick_buckets((keys, values), heads, origin, size, which)
        pos = ((u - 1) * size)[:, None] + torch.arange(2 * size, device=q.device)  # [b, 2B]
        m = (pos >= 0) & (pos <= position[:, None])  # the token always sees itself
        return attend(q, k, v, bias=additive(m[:, None, None, :], q.dtype), implementation=self.implementation)


class SinkhornHeads(nn.Module):
    """Non-causal Sinkhorn attention (also used for a non-causal model's cross-attention, `include_own=False`).

    Attention sort net: query bucket u scores key bucket j by mean(q_u) . mean(k_j) / sqrt(d). Simple sort net
    (the paper's): relu(W_h [sum(q_u); sum(k_u)]) scores the key-bucket positions j directly. Both see the padding
    mask (masked means; empty key buckets cannot be chosen). SortCut: one summary of all queries chooses
    `n_sortcut` key buckets that every query bucket attends (plus its own bucket, never duplicated).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        bucket_size: int,
        kv_bucket_size: int,
        n_top: int,
        n_sortcut: int,
        include_own: bool,
        use_simple_sort_net: bool,
        max_buckets: int,
        non_permutative: bool,
        sinkhorn_iter: int,
        temperature: float,
        dropout: float,
        implementation: str,
        weight_routed_values: bool = False,
        weight_routed_keys: bool = False,
        sequential_weights: bool = False,
        route_own_bucket: bool = False,
        simple_scores: str = "log_relu",
    ):
        super().__init__()
        self.weight_routed_values = weight_routed_values
        self.weight_routed_keys, self.sequential_weights = weight_routed_keys, sequential_weights
        self.route_own_bucket = route_own_bucket
        self.simple_scores = simple_scores
        self.num_heads, self.head_dim = num_heads, head_dim
        self.bucket_size, self.kv_bucket_size = bucket_size, kv_bucket_size
        self.n_top, self.n_sortcut, self.include_own = n_top, n_sortcut, include_own
        self.sinkhorn_iter = None if non_permutative else sinkhorn_iter
        self.temperature, self.dropout, self.implementation = temperature, dropout, implementation
        self.sort_net = nn.Parameter(torch.empty(num_heads, 2 * head_dim, max_buckets)) if use_simple_sort_net else None

    def forward(self, q, k, v, q_mask, k_mask=None, record=None, attn_weights=None):
        """q: [b, h, Lq, d]; k, v: [b, h, Lk, d]; q_mask / k_mask: [b, L] real tokens (k_mask defaults to q_mask,
        self-attention). `record` is unused: non-causal models have no generation cache. `attn_weights`: a dict
        that receives the dense attention map and the routing (output_attentions)."""
        k_mask = q_mask if k_mask is None else k_mask
        b, h, lq, d = q.shape
        nq, nk = lq // self.bucket_size, k.shape[2] // self.kv_bucket_size
        bq = q.reshape(b, h, nq, self.bucket_size, d)
        bk = k.reshape(b, h, nk, self.kv_bucket_size, d)
        bv = v.reshape(b, h, nk, self.kv_bucket_size, d)
        bkm = k_mask.view(b, nk, self.kv_bucket_size)
        q_sums, q_counts = bucket_sums(q, q_mask, self.bucket_size)  # [b, h, nq, d], [b, nq]
        k_sums, k_counts = bucket_sums(k, k_mask, self.kv_bucket_size)
        k_valid = (k_counts > 0)[:, None, None, :]  # [b, 1, 1, nk]
        own = torch.arange(nq, device=q.device)

        if self.n_sortcut > 0:
            summary = q_sums.sum(2, keepdim=True) / q_counts.sum(1).clamp_min(1)[:, None, None, None]
            scores = routing_matmul(summary, (k_sums / k_counts.clamp_min(1)[:, None, :, None]).transpose(-1, -2))
            scores = scores * d**-0.5
            n_sel = min(self.n_sortcut, nk)
            valid = k_valid
        else:
            if self.sort_net is not None:
                feats = torch.cat([q_sums, k_sums], dim=-1)  # [b, h, n, 2d] (self-attention: nq == nk)
                scores = F.relu(routing_einsum("bhne,hem->bhnm", feats, self.sort_net))[..., :nk]
                if self.simple_scores == "log_relu":
                    scores = torch.log(scores + 1e-6)
            else:
                sq = q_sums / q_counts.clamp_min(1)[:, None, :, None]
                sk = k_sums / k_counts.clamp_min(1)[:, None, :, None]
                scores = routing_matmul(sq, sk.transpose(-1, -2)) * d**-0.5  # [b, h, nq, nk]
            valid = k_valid
            exclude_own = self.include_own and not self.route_own_bucket
            if exclude_own:
                valid = valid & (own[:, None] != torch.arange(nk, device=q.device))[None, None]
            n_sel = min(self.n_top, nk - 1 if exclude_own else nk)

        keys_parts, value_parts, mask_parts, pos_parts, factor_parts = [], [], [], [], []
        k_pos = torch.arange(nk * self.kv_bucket_size, device=q.device).view(nk, self.kv_bucket_size)
        if n_sel > 0:
            idx, picked_valid, scale = select_buckets(
                scores,
                valid,
                n_sel,
                self.temperature,
                self.sinkhorn_iter,
                self.training,
                self.weight_routed_values,
                self.sequential_weights,
            )  # [b, h, 1 or nq, n_sel]
            bi, hi = _batch_head_index(b, h, 4, q.device)
            routed_k = bk[bi, hi, idx]  # [b, h, 1 or nq, n_sel, Bk, d]
            routed_v = bv[bi, hi, idx]
            if scale is not None:
                routed_v = routed_v * scale[..., None, None].to(v.dtype)
                if self.weight_routed_keys:
                    routed_k = routed_k * scale[..., None, None].to(k.dtype)
            routed_m = bkm[bi, idx] & picked_valid[..., None]  # [b, h, 1 or nq, n_sel, Bk]
            if self.n_sortcut > 0 and self.include_own and not self.route_own_bucket:
                # a query bucket already attends its own bucket: drop it from the shared choice
                routed_m = routed_m & (idx[..., None] != own[None, None, :, None, None])
            rows = idx.shape[2]  # 1 with SortCut (shared by every query bucket), else nq
            keys_parts.append(routed_k.reshape(b, h, rows, -1, d).expand(b, h, nq, -1, d))
            value_parts.append(routed_v.reshape(b, h, rows, -1, d).expand(b, h, nq, -1, d))
            mask_parts.append(routed_m.reshape(b, h, routed_m.shape[2], -1).expand(b, h, nq, -1))
            if attn_weights is not None:
                pos_parts.append(k_pos[idx].reshape(b, h, rows, -1).expand(b, h, nq, -1))
                weight = torch.ones_like(idx, dtype=torch.float32) if scale is None else scale.float()
                factor_parts.append(
                    weight[..., None]
                    .expand(*idx.shape, self.kv_bucket_size)
                    .reshape(b, h, rows, -1)
                    .expand(b, h, nq, -1)
                )
                # the routing: each query bucket's chosen key buckets (-1 where a pick is masked out) and weights
                shown = routed_m.any(-1).expand(b, h, nq, n_sel)
                attn_weights["route"] = idx.expand(b, h, nq, n_sel).masked_fill(~shown, -1)
                attn_weights["route_weight"] = weight.expand(b, h, nq, n_sel).masked_fill(~shown, 0.0)
        if self.include_own:
            keys_parts.append(bk)
            value_parts.append(bv)
            mask_parts.append(bkm[:, None].expand(b, h, nq, -1))
            if attn_weights is not None:
                pos_parts.append(k_pos.expand(b, h, nq, -1))
                factor_parts.append(torch.ones(b, h, nq, self.kv_bucket_size, device=q.device))
        keys = torch.cat(keys_parts, dim=3)  # [b, h, nq, K, d]
        values = torch.cat(value_parts, dim=3)
        attn_mask = torch.cat(mask_parts, dim=3)[:, :, :, None, :]  # [b, h, nq, 1, K]
        p = self.dropout if self.training else 0.0
        want = attn_weights is not None
        if self.include_own:  # a real query always sees itself: an additive mask is enough
            bias = additive(attn_mask, q.dtype)
            out = attend_buckets(bq, keys, values, None, p, self.implementation, bias=bias, return_weights=want)
        else:  # cross-attention: a row may see no context at all and must then give zeros
            out = attend_buckets(bq, keys, values, attn_mask, p, self.implementation, return_weights=want)
        if want:
            out, probs = out
            key_pos, factor = torch.cat(pos_parts, dim=3), torch.cat(factor_parts, dim=3)
            attn_weights["map"] = token_weights(probs, key_pos, factor, k.shape[2])
        return out.reshape(b, h, lq, d)


class CausalSinkhornHeads(nn.Module):
    """Causal Sinkhorn attention for a slice of heads whose buckets start at `offset` tokens before the usual ones
    (offset 0: ordinary buckets; offset 1: buckets shifted by bucket_size - 1, the reference's rotated heads).

    Query bucket u chooses `n_top` candidates among `n_top` learned null buckets and the strictly earlier,
    non-empty key buckets, from the cumulative mean of the queries up to its leading token. A null bucket is one
    learned key/value per head. Used for self-attention (`null buckets`, own bucket causal) and for a causal
    decoder's cross-attention (`cross=True`: context buckets, no own bucket, no null buckets, no causality
    constraint on which context bucket may be chosen).
    """

    def __init__(
        self,
        num_heads: int,
        head_dim: int,
        bucket_size: int,
        n_top: int,
        offset: int,
        temperature: float,
        dropout: float,
        implementation: str,
        cross: bool = False,
        kv_bucket_size: int | None = None,
        weight_routed_values: bool = False,
        weight_routed_keys: bool = False,
        sequential_weights: bool = False,
        key_summary: str = "mean",
        null_score: str = "learned",
        null_copies: bool = False,
        skip_first_bucket: bool = False,
    ):
        super().__init__()
        self.weight_routed_values = weight_routed_values
        self.weight_routed_keys, self.sequential_weights = weight_routed_keys, sequential_weights
        # self-attention routing variants (see SinkhornConfig: causal_key_summary, causal_null_score,
        # null_bucket_copies, shifted_heads_skip_first_bucket)
        self.running_key_summary, self.zero_null_score = key_summary == "running_mean_sum", null_score == "zero"
        self.null_copies, self.skip_first = null_copies, skip_first_bucket and offset > 0
        self.num_heads, self.head_dim, self.bucket_size = num_heads, head_dim, bucket_size
        self.kv_bucket_size = kv_bucket_size or bucket_size
        self.n_top, self.offset, self.cross = n_top, offset, cross
        self.temperature, self.dropout, self.implementation = temperature, dropout, implementation
        if not cross:
            self.null_keys = nn.Parameter(torch.empty(num_heads, n_top, head_dim))
            self.null_values = nn.Parameter(torch.empty(num_heads, n_top, head_dim))

    # -- full sequence -----------------------------------------------------------------------------------------

    def forward(self, q, k, v, mask, k_mask=None, record=None, attn_weights=None):
        """q, k, v: [b, h, L, d] (L a multiple of bucket_size); mask: [b, L] real query tokens;
        k_mask: context mask for cross-attention (self-attention uses `mask`). `record`: a dict that receives
        what the generation cache needs; `attn_weights`: one that receives the attention map and the routing."""
        size, off = self.bucket_size, self.offset
        length = q.shape[2]
        if off:
            # shift by one: the first bucket holds a virtual token plus tokens 0 .. size-2
            q, k, v = (F.pad(t, (0, 0, off, size - off)) for t in (q, k, v))
            mask = F.pad(mask, (off, size - off), value=False)
        null = None if self.cross else (self.null_keys[None], self.null_values[None])
        out = self.bucketed(q, k, v, mask, k_mask, record, null, attn_weights)
        if record is not None:
            record["offset"] = off
        if attn_weights is not None:
            _trim_weights(attn_weights, off, length, None if self.cross else self.n_top)
        return out[:, :, off : off + length]

    def bucketed(self, q, k, v, mask, k_mask, record, null, attn_weights=None):
        """The attention over buckets of already shifted inputs (length a multiple of bucket_size), output not
        trimmed. null: (null keys, null values) [b or 1, h, n_null, d] for self-attention, None for cross.
        attn_weights: receives the map [b, h, L, L + n_null] (self-attention: the null buckets' keys in the last
        columns) or [b, h, L, Lk] (cross), and the routing (bucket indices into the bank: null buckets first)."""
        size = self.bucket_size
        b, h, lq, d = q.shape
        n = lq // size
        bq = q.reshape(b, h, n, size, d)
        # tokens that enter the routing summaries (skip_first: not the short first bucket of shifted heads)
        counted = F.pad(mask[:, size:], (size, 0), value=False) if self.skip_first else mask
        q_sums, q_counts = bucket_sums(q, counted, size)  # [b, h, n, d], [b, n]
        lead_real = counted.view(b, n, size)[..., 0]  # [b, n]
        lead_q = bq[:, :, :, 0].float() * lead_real[:, None, :, None]  # leading tokens [b, h, n, d]
        lead_sum = q_sums.cumsum(2) - q_sums + lead_q  # queries summed up to each leading token (inclusive)
        lead_count = q_counts.cumsum(-1) - q_counts + lead_real
        sq = lead_sum / lead_count.clamp_min(1)[:, None, :, None]  # [b, h, n, d]

        if self.cross:
            key_mask = k_mask
            nk = k.shape[2] // self.kv_bucket_size
            bk = k.reshape(b, h, nk, self.kv_bucket_size, d)
            bv = v.reshape(b, h, nk, self.kv_bucket_size, d)
            k_sums, k_counts = bucket_sums(k, key_mask, self.kv_bucket_size)
            sk = k_sums / k_counts.clamp_min(1)[:, None, :, None]
            scores = routing_matmul(sq, sk.transpose(-1, -2)) * d**-0.5  # [b, h, n, nk]
            valid = (k_counts > 0)[:, None, None, :]
            n_sel = min(self.n_top, nk)
            bank_k, bank_v, bank_m = bk, bv, key_mask.view(b, nk, self.kv_bucket_size)
        else:
            key_mask = mask
            bk, bv = k.reshape(b, h, n, size, d), v.reshape(b, h, n, size, d)
            k_sums, k_counts = bucket_sums(k, counted, size)
            if self.running_key_summary:
                # each key bucket: the sum over its tokens of the running mean of all keys so far
                c = counted.to(torch.float32)[:, None, :, None]  # [b, 1, L, 1]
                running = (k.float() * c).cumsum(2) / c.cumsum(2).clamp_min(1)
                k_sums = (running * c).view(b, h, n, size, d).sum(3)  # [b, h, n, d]
                sk = k_sums
            else:
                sk = k_sums / k_counts.clamp_min(1)[:, None, :, None]
            n_null = self.n_top
            null_keys, null_values = null
            if self.zero_null_score:
                null_scores = sq.new_zeros(b, h, n, n_null)
            else:
                null_scores = routing_matmul(sq, null_keys.transpose(-1, -2))  # [b, h, n, n_null]
            scores = torch.cat([null_scores, routing_matmul(sq, sk.transpose(-1, -2))], dim=-1) * d**-0.5
            earlier = torch.ones(n, n, dtype=torch.bool, device=q.device).tril(-1)  # key bucket j < query bucket u
            real_valid = earlier[None, None] & (k_counts > 0)[:, None, None, :]
            valid = torch.cat([torch.ones(b, 1, n, n_null, dtype=torch.bool, device=q.device), real_valid], dim=-1)
            if self.skip_first:  # the short first bucket attends no chosen bucket
                valid = valid & (torch.arange(n, device=q.device) > 0)[None, None, :, None]
            n_sel = n_null
            # candidate bank: null buckets (the learned key in every slot, all but slot 0 masked unless null_copies)
            # then the real buckets
            null_k = null_keys[:, :, :, None].expand(-1, -1, -1, size, -1).to(k.dtype).expand(b, -1, -1, -1, -1)
            null_v = null_values[:, :, :, None].expand(-1, -1, -1, size, -1).to(v.dtype).expand(b, -1, -1, -1, -1)
            bank_k = torch.cat([null_k, bk], dim=2)  # [b, h, n_null + n, B, d]
            bank_v = torch.cat([null_v, bv], dim=2)
            null_m = torch.zeros(b, n_null, size, dtype=torch.bool, device=q.device)
            null_m[:, :, 0 if not self.null_copies else slice(None)] = True
            bank_m = torch.cat([null_m, key_mask.view(b, n, size)], dim=1)  # [b, n_null + n, B]

        idx, picked_valid, scale = select_buckets(
            scores,
            valid,
            n_sel,
            self.temperature,
            weighted=self.weight_routed_values,
            sequential=self.sequential_weights,
        )  # [b, h, n, n_sel]
        bi, hi = _batch_head_index(b, h, 4, q.device)
        routed_k = bank_k[bi, hi, idx]  # [b, h, n, n_sel, B, d]
        routed_v = bank_v[bi, hi, idx]
        if scale is not None:
            routed_v = routed_v * scale[..., None, None].to(v.dtype)
            if self.weight_routed_keys:
                routed_k = routed_k * scale[..., None, None].to(k.dtype)
        routed_k = routed_k.reshape(b, h, n, -1, d)  # [b, h, n, n_sel * B, d]
        routed_v = routed_v.reshape(b, h, n, -1, d)
        routed_m = (bank_m[bi, idx] & picked_valid[..., None]).reshape(b, h, n, -1)  # [b, h, n, n_sel * B]
        p = self.dropout if self.training else 0.0
        want = attn_weights is not None
        if want:
            # each slot's column in the map: bank bucket j's slot s is token j * B + s (self-attention: the null
            # buckets, first in the bank, are the columns after the tokens)
            slot = torch.arange(bank_k.shape[3], device=q.device)
            if self.cross:
                bank_pos = torch.arange(bank_k.shape[2], device=q.device)[:, None] * bank_k.shape[3] + slot
            else:
                bank_pos = torch.cat(
                    [
                        (lq + torch.arange(n_sel, device=q.device))[:, None].expand(-1, size),
                        torch.arange(lq, device=q.device).view(n, size),
                    ]
                )  # [n_null + n, B]
            routed_pos = bank_pos[idx].reshape(b, h, n, -1)  # [b, h, n, n_sel * B]
            weight = torch.ones_like(idx, dtype=torch.float32) if scale is None else scale.float()
            routed_factor = weight[..., None].expand(*idx.shape, bank_k.shape[3]).reshape(b, h, n, -1)
            attn_weights["route"] = idx.masked_fill(~picked_valid, -1)
            attn_weights["route_weight"] = weight.masked_fill(~picked_valid, 0.0)
        if self.cross:
            # a row may see no context at all (fully padded context): bool mask, zeros for such rows
            out = attend_buckets(
                bq, routed_k, routed_v, routed_m[:, :, :, None, :], p, self.implementation, return_weights=want
            )
            if want:
                out, probs = out
                attn_weights["map"] = token_weights(probs, routed_pos, routed_factor, k.shape[2])
        else:
            keys = torch.cat([routed_k, bk], dim=3)  # [b, h, n, (n_sel + 1) B, d]
            values = torch.cat([routed_v, bv], dim=3)
            causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
            own_m = key_mask.view(b, 1, n, 1, size) & causal  # [b, 1, n, B, B]
            # every row sees at least one key (each pick is a valid null or non-empty bucket), so the mask is
            # built additive from its two small pieces: one pass over the full [b, h, n, B, K] tensor
            bias = torch.cat(
                [
                    additive(routed_m, q.dtype)[:, :, :, None, :].expand(b, h, n, size, -1),
                    additive(own_m, q.dtype).expand(b, h, n, size, size),
                ],
                dim=-1,
            )
            out = attend_buckets(bq, keys, values, None, p, self.implementation, bias=bias, return_weights=want)
            if want:
                out, probs = out
                own_pos = torch.arange(lq, device=q.device).view(1, 1, n, size).expand(b, h, n, size)
                key_pos = torch.cat([routed_pos, own_pos], dim=3)
                factor = torch.cat([routed_factor, routed_factor.new_ones(b, h, n, size)], dim=3)
                attn_weights["map"] = token_weights(probs, key_pos, factor, lq + n_sel)
        out = out.reshape(b, h, lq, d)

        if record is not None:
            record["q_sum"] = q_sums.sum(2)  # [b, h, d]
            record["q_count"] = counted.sum(1).float()  # [b]
            record["route"] = idx  # [b, h, n, n_sel]: the cache keeps the row of the current bucket
            record["route_valid"] = picked_valid
            record["route_weight"] = scale.detach() if self.weight_routed_values else None  # [b, h, n, n_sel]
            if not self.cross:
                record["k_sum"] = k_sums  # [b, h, n, d] (running_key_summary: the summaries themselves)
                record["k_count"] = k_counts  # [b, n]
                if self.running_key_summary:
                    record["k_run_sum"] = (k.float() * counted[:, None, :, None]).sum(2)  # [b, h, d]
                    record["k_run_count"] = counted.sum(1).float()  # [b]
        return out

    # -- one token with a cache --------------------------------------------------------------------------------
    # Static shapes and no host reads: every step computes a routing choice and keeps it only in the rows whose
    # token leads a bucket (torch.where); positions are per-row tensors.

    def _choose(self, sq, sk, valid_real):
        """Routing of one query bucket per row from the query summary sq [b, h, d] over the key-bucket summaries
        sk [b, h, n, d] (valid_real: [b, n] candidates that may be chosen). -> idx, picked_valid, weight (None
        unless weight_routed_values), each [b, h, n_sel]."""
        b, h, d = sq.shape
        column = sq[..., None] * d**-0.5  # [b, h, d, 1]
        if self.cross:
            scores = routing_matmul(sk, column).transpose(-1, -2)  # [b, h, 1, n]
            valid = valid_real[:, None, None, :]
            n_sel = min(self.n_top, sk.shape[2])
        else:
            if self.zero_null_score:
                null_scores = sq.new_zeros(b, h, self.n_top, 1)
            else:
                null_scores = routing_matmul(self.null_keys, column)  # [b, h, n_null, 1]
            scores = torch.cat([null_scores, routing_matmul(sk, column)], dim=2).transpose(
                -1, -2
            )  # [b, h, 1, n_null + n]
            nulls = torch.ones(b, self.n_top, dtype=torch.bool, device=sq.device)
            valid = torch.cat([nulls, valid_real], dim=-1)[:, None, None, :]
            n_sel = self.n_top
        idx, picked_valid, weight = select_buckets(
            scores,
            valid,
            n_sel,
            self.temperature,
            weighted=self.weight_routed_values,
            sequential=self.sequential_weights,
        )
        return idx[:, :, 0], picked_valid[:, :, 0], weight[:, :, 0] if self.weight_routed_values else None

    def _key_summaries(self, state, u):
        """Key-bucket summaries [b, h, nb, d] and which buckets a query bucket u [b] may choose ([b, nb])."""
        counts = state["k_count"]
        sk = state["k_sum"] if self.running_key_summary else state["k_sum"] / counts.clamp_min(1)[:, None, :, None]
        earlier = torch.arange(counts.shape[1], device=counts.device)[None] < u[:, None]
        return sk, earlier & (counts > 0)

    def route_step(self, q, position, real, state, sk=None, k_valid=None, u=None, choose=True):
        """Add the token at `position` [b] (real: [b] bool, whether it enters the summaries) to the running query
        sum; rows whose token leads a bucket choose that bucket's key buckets (choose=False: the caller knows
        that no row does). Self-attention reads the key summaries from `state`; cross-attention passes the
        context's (sk, k_valid)."""
        size, off = self.bucket_size, self.offset
        if u is None:
            u = torch.div(position + off, size, rounding_mode="floor")
        state["q_sum"].add_(q[:, :, 0].float() * real[:, None, None])
        state["q_count"].add_(real.float())
        if not choose:
            return
        sq = state["q_sum"] / state["q_count"].clamp_min(1)[:, None, None]  # [b, h, d]
        if not self.cross:
            sk, k_valid = self._key_summaries(state, u)
        lead = real & ((position + off) % size == 0)
        self._keep_route(state, lead, *self._choose(sq, sk, k_valid))

    @staticmethod
    def _keep_route(state, rows, idx, picked_valid, weight):
        """Store the new routing choice in `rows` [b]."""
        keep = rows[:, None, None]
        state["route"] = torch.where(keep, idx, state["route"])
        state["route_valid"] = torch.where(keep, picked_valid, state["route_valid"])
        if weight is not None:
            state["route_weight"] = torch.where(keep, weight, state["route_weight"])

    def step(self, q, k, v, keys, values, heads, position, real, state, host=None):
        """Causal self-attention of one new token per row at `position` [b] (already written to keys/values). q, k,
        v: [b, h, 1, d]; real: [b] bool. keys/values: the layer's cache [b, H, S, d]; for this group's `heads` it
        holds, as whole buckets from slot `1 - offset` on, the null buckets then the row's real tokens (see
        `SinkhornLayerState`): the bucket bank of `bucketed`, so the chosen buckets and the own bucket are picked
        by index, one block copy each.

        Attention over the chosen buckets of the current query bucket and the own bucket up to the token: at most
        (n_top + 1) * bucket_size keys. host: None (static step), or (positions, real, epoch, memo) for a
        host-following step (see `SinkhornCache`), which reuses the window of the last step when no row entered
        a new bucket, and the index tensors of the step's other groups of the same shape (memo)."""
        size, off = self.bucket_size, self.offset
        b, h, _, d = q.shape
        if host is None:
            ix = self._step_index(position, real, b, h, d)
        else:
            key = (size, off, self.skip_first, self.n_top, b, h, d)
            ix = host[3].get(key) or host[3].setdefault(key, self._step_index(position, real, b, h, d))
        u, counted = ix["u"], ix["counted"]
        new_k = k[:, :, 0].float() * ix["weight"][:, None, None]  # [b, h, d]
        if self.running_key_summary:
            state["k_run_sum"].add_(new_k)
            state["k_run_count"].add_(ix["weight"])
            run = state["k_run_sum"] / state["k_run_count"].clamp_min(1)[:, None, None]
            new_k = run * ix["weight"][:, None, None]
        state["k_sum"].scatter_add_(2, ix["bucket"], new_k[:, :, None])
        state["k_count"].scatter_add_(1, u[:, None], ix["weight"][:, None])
        state["queries"].scatter_(2, ix["token"], q.to(state["queries"].dtype))
        if host is None:
            self.route_step(q, position, counted, state, u=u)
            keys_all, values_all, bias = self._window(keys, values, heads, position, u, state, q.dtype)
        else:
            positions, reals, epoch, _ = host
            buckets = [(p + off) // size for p in positions]
            lead = any(
                r and (p + off) % size == 0 and not (self.skip_first and p + off < size)
                for p, r in zip(positions, reals)
            )
            self.route_step(q, position, counted, state, u=u, choose=lead)
            window = state.get("window")
            if lead or window is None or window[0] != (epoch, buckets):
                window = ((epoch, buckets), *self._window(keys, values, heads, position, u, state, q.dtype))
                state["window"] = window
            else:  # the same buckets: the new token joins the own bucket (its last `size` slots)
                _, keys_all, values_all, bias = window
                slot = ix["own"]  # [b, h, 1, d]
                keys_all.scatter_(2, slot, k.to(keys_all.dtype))
                values_all.scatter_(2, slot, v.to(values_all.dtype))
                bias.scatter_(3, slot[..., :1], 0.0)
            _, keys_all, values_all, bias = window
            # up to the last own-bucket slot any row has reached (the keys after it are masked in every row)
            end = keys_all.shape[2] - size + 1 + max((p + off) % size for p in positions)
            keys_all, values_all, bias = keys_all[:, :, :end], values_all[:, :, :end], bias[..., :end]
        return attend(q, keys_all, values_all, bias=bias, implementation=self.implementation)

    def _step_index(self, position, real, b, h, d):
        """The index tensors of a step: query bucket u [b], the tokens that enter the routing summaries (bool and
        float [b]), and for [b, h, ., d] buffers the slots of u, of the token and of its own-bucket window slot."""
        size, off = self.bucket_size, self.offset
        u = torch.div(position + off, size, rounding_mode="floor")
        counted = real & (u > 0) if self.skip_first else real
        own = self.n_top * size + (position + off) % size  # the window: the chosen buckets, then the own bucket
        return dict(
            u=u,
            counted=counted,
            weight=counted.float(),
            bucket=u[:, None, None, None].expand(b, h, 1, d),
            token=position[:, None, None, None].expand(b, h, 1, d),
            own=own[:, None, None, None].expand(b, h, 1, d),
        )

    def _window(self, keys, values, heads, position, u, state, dtype):
        """Keys, values [b, h, K, d] and additive mask [b, h, 1, K] of the chosen buckets of the current query bucket
        `u` [b] and the own bucket up to the token at `position` [b] (K = (n_sel + 1) * bucket_size)."""
        size, off, n_null = self.bucket_size, self.offset, self.n_top
        b, h = state["route"].shape[:2]
        choice = state["route"]  # [b, h, n_sel]: bank indices (null buckets first)
        which = torch.cat([choice, (n_null + u)[:, None, None].expand(b, h, 1)], dim=-1)  # chosen, then own
        keys_all, values_all = _pick_buckets((keys, values), heads, 1 - off, size, which)  # [b, h, (n_sel + 1) B, d]
        if self.weight_routed_values:
            weight = F.pad(state["route_weight"], (0, 1), value=1.0)  # the own bucket unweighted
            weight = weight[..., None].expand(b, h, -1, size).reshape(b, h, -1, 1)
            values_all = values_all * weight.to(values_all.dtype)
            if self.weight_routed_keys:
                keys_all = keys_all * weight.to(keys_all.dtype)
        slot = torch.arange(size, device=choice.device)
        pos = (which - n_null)[..., None] * size - off + slot  # [b, h, n_sel + 1, B] token positions
        null_slots = slot >= 0 if self.null_copies else slot == 0
        routed_m = torch.where((choice < n_null)[..., None], null_slots, pos[:, :, :-1] >= 0)
        routed_m = routed_m & state["route_valid"][..., None]
        own_m = (pos[:, :, -1:] >= 0) & (pos[:, :, -1:] <= position[:, None, None, None])
        m = torch.cat([routed_m, own_m], dim=2).reshape(b, h, 1, -1)  # [b, h, 1, K]: the token always sees itself
        return keys_all, values_all, additive(m, dtype)

    def write_null_buckets(self, keys, values) -> None:
        """Put this group's null buckets into the cache slots before its first bucket (keys, values: the group's
        heads of the cache, [b, h, S, d]), so that a decoding step picks chosen buckets from one bank."""
        size, start = self.bucket_size, 1 - self.offset
        for t, table in ((keys, self.null_keys), (values, self.null_values)):
            b, h, _, d = t.shape
            bank = t[:, :, start : start + self.n_top * size].view(b, h, self.n_top, size, d)
            bank.copy_(table.detach()[None, :, :, None, :].to(t.dtype).expand_as(bank))

    def cross_step(self, q, position, real, state, ctx):
        """Causal decoder cross-attention of one new token per row. ctx: the cached context (bucketed keys, values,
        mask and summaries)."""
        b, h, _, d = q.shape
        state["queries"].scatter_(2, position[:, None, None, None].expand(b, h, 1, d), q.to(state["queries"].dtype))
        self.route_step(q, position, real, state, ctx["sk"], ctx["k_valid"])
        choice, choice_valid = state["route"], state["route_valid"]  # [b, h, n_sel]
        bi, hi = _batch_head_index(b, h, 3, q.device)
        routed_k = ctx["bk"][bi, hi, choice]  # [b, h, n_sel, Bc, d]
        routed_v = ctx["bv"][bi, hi, choice]
        if self.weight_routed_values:
            weight = state["route_weight"][..., None, None]
            routed_v = routed_v * weight.to(routed_v.dtype)
            if self.weight_routed_keys:
                routed_k = routed_k * weight.to(routed_k.dtype)
        m = (ctx["bm"][bi, choice] & choice_valid[..., None]).reshape(b, h, 1, -1)
        return attend(
            q, routed_k.reshape(b, h, -1, d), routed_v.reshape(b, h, -1, d), m, implementation=self.implementation
        )

    def rebuild(self, state, length, keys=None, sk=None, k_valid=None):
        """Recompute the routing state of every row from its first `length` [b] cached queries (and keys, in
        self-attention), as a prefill of those tokens would leave it: used by `SinkhornCache.crop`."""
        size, off = self.bucket_size, self.offset
        queries = state["queries"].float()  # [b, h, C, d]
        b, h, cap, d = queries.shape
        pos = torch.arange(cap, device=queries.device)
        bucket = torch.div(pos + off, size, rounding_mode="floor")  # [C]
        counted = pos[None] < length[:, None]  # [b, C]
        if self.skip_first:
            counted = counted & (bucket > 0)
        c = counted.float()
        u = torch.div((length - 1).clamp_min(0) + off, size, rounding_mode="floor")  # the current bucket [b]
        state["q_sum"].copy_((queries * c[:, None, :, None]).sum(2))
        state["q_count"].copy_(c.sum(1))
        if not self.cross:
            keys = keys.float()
            nb = state["k_count"].shape[1]
            per_bucket = F.one_hot(bucket, nb).float()  # [C, nb]
            if self.running_key_summary:
                weighted = keys * c[:, None, :, None]
                run = weighted.cumsum(2) / c.cumsum(1).clamp_min(1)[:, None, :, None]
                state["k_run_sum"].copy_(weighted.sum(2))
                state["k_run_count"].copy_(c.sum(1))
                keys = run
            state["k_sum"].copy_(routing_einsum("bhcd,bc,cn->bhnd", keys, c, per_bucket))
            state["k_count"].copy_(routing_matmul(c, per_bucket))
            sk, k_valid = self._key_summaries(state, u)
        # the choice of the current bucket, made at its leading token
        lead = u * size - off  # [b] (-1: the shifted heads' virtual first token)
        upto = (pos[None] <= lead[:, None]).float() * c
        sq = (queries * upto[:, None, :, None]).sum(2) / upto.sum(1).clamp_min(1)[:, None, None]
        idx, picked_valid, weight = self._choose(sq, sk, k_valid)
        if self.skip_first:  # the short first bucket attends no chosen bucket
            picked_valid = picked_valid & (u > 0)[:, None, None]
        self._keep_route(state, torch.ones(b, dtype=torch.bool, device=queries.device), idx, picked_valid, weight)


# ----------------------------------------------------------------------------------------------------------------
# attention layers
# ----------------------------------------------------------------------------------------------------------------


def _implementation(config: SinkhornConfig) -> str:
    """The attention implementation of every head group, read from `config._attn_implementation` when the model is
    built (transformers resolves it, from `attn_implementation=` or the config, before the modules exist; unset =
    "sdpa" on every device).

    "sdpa": `torch.nn.functional.scaled_dot_product_attention`, fused kernels on CUDA and on the CPU (where it is
    at least as fast as "eager" on the benchmark's 128 x 384 bucket blocks, forward and backward); "eager": the
    explicit softmax(q k^T / sqrt(d) + mask) v, the same numbers."""
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(_unsupported_attention(impl))
    return impl


def _unsupported_attention(impl) -> str:
    return (
        f"Sinkhorn: attn_implementation={impl!r} is not supported; allowed values: "
        f"{', '.join(repr(name) for name in ATTENTION_IMPLEMENTATIONS)} (bucketed attention runs through "
        "scaled_dot_product_attention or the explicit softmax; flash and flex attention are not available)"
    )


def _trim_weights(attn_weights: dict, off: int, length: int, n_null: int | None, rows=slice(None)) -> None:
    """`bucketed`'s map and routing (of batch rows `rows`) -> token coordinates: the map of the `length` real
    positions ([b, h, length, length], self-attention's null-bucket columns moved to "null" [b, h, length,
    n_null]) and the routing's bank indices -> key bucket indices in the heads' own bucket grid, -1 for a null
    bucket or a masked pick."""
    full = attn_weights["map"][rows]
    lq = full.shape[2]
    attn_weights["map"] = full[:, :, off : off + length, off : off + length] if n_null else full[:, :, :length]
    route = attn_weights["route"][rows]
    if n_null:
        attn_weights["null"] = full[:, :, off : off + length, lq:]
        route = torch.where(route >= n_null, route - n_null, -1)
    attn_weights["route"], attn_weights["route_weight"] = route, attn_weights["route_weight"][rows]
    attn_weights["offset"] = off


def causal_pair(
    plain: CausalSinkhornHeads, shifted: CausalSinkhornHeads, q, k, v, mask, records=None, attn_weights=None
):
    """The ordinary and the shifted causal Sinkhorn heads of a layer in ONE pass, with the numbers of two
    `forward` calls and half their kernel launches. The batch is doubled: its first half holds the ordinary heads'
    rows with one empty bucket appended (a later bucket, so never a candidate, and its queries are dropped), its
    second half the shifted heads' rows, padded as in `forward`. Needs equal head counts.

    q, k, v: [b, 2h, L, d] (ordinary heads first); mask: [b, L]; records, attn_weights: None or one dict per
    group."""
    size, h, off = plain.bucket_size, plain.num_heads, shifted.offset
    b, _, length, _ = q.shape
    pads = ((0, size), (off, size - off))

    def stack(t):  # [b, 2h, L, d] -> [2b, h, L + size, d]
        return torch.cat([F.pad(part, (0, 0, *pad)) for part, pad in zip(t.split(h, dim=1), pads)])

    masks = torch.cat([F.pad(mask, pad, value=False) for pad in pads])  # [2b, L + size]
    null = tuple(
        torch.stack([getattr(plain, name), getattr(shifted, name)])[:, None]
        .expand(-1, b, -1, -1, -1)
        .reshape(2 * b, h, plain.n_top, -1)
        for name in ("null_keys", "null_values")
    )  # each group's null buckets for its rows
    record = {} if records is not None else None
    both = {} if attn_weights is not None else None
    out = plain.bucketed(stack(q), stack(k), stack(v), masks, None, record, null, both)  # [2b, h, L + size, d]
    if attn_weights is not None:
        for half, group, target in ((slice(0, b), plain, attn_weights[0]), (slice(b, 2 * b), shifted, attn_weights[1])):
            target.update(both)
            _trim_weights(target, group.offset, length, group.n_top, half)
        n = length // size  # the ordinary heads' appended empty bucket has no routing
        attn_weights[0]["route"] = attn_weights[0]["route"][:, :, :n]
        attn_weights[0]["route_weight"] = attn_weights[0]["route_weight"][:, :, :n]
    if records is not None:
        for half, group, target in ((slice(0, b), plain, records[0]), (slice(b, 2 * b), shifted, records[1])):
            target.update({key: val if val is None else val[half] for key, val in record.items()})
            target["offset"] = group.offset
    return torch.cat([out[:b, :, :length], out[b:, :, off : off + length]], dim=1)


def _routing_options(config: SinkhornConfig) -> dict:
    return dict(
        weight_routed_values=config.weight_routed_values,
        weight_routed_keys=config.weight_routed_keys,
        sequential_weights=config.sequential_routing_weights,
    )


class SinkhornSelfAttention(nn.Module):
    """Projections plus the head groups: [local heads | Sinkhorn heads] (causal: [local | ordinary | shifted])."""

    def __init__(self, config: SinkhornConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        inner = self.num_heads * self.head_dim
        self.to_q = nn.Linear(config.hidden_size, inner, bias=False)
        self.to_kv = nn.Linear(config.hidden_size, 2 * inner, bias=False)
        self.to_out = nn.Linear(inner, config.hidden_size)
        impl, size = _implementation(config), config.bucket_size
        n_local = config.n_local_attn_heads
        n_sink = self.num_heads - n_local
        groups, slices, start = [], [], 0

        def add(module, count):
            nonlocal start
            if count > 0:
                groups.append(module)
                slices.append((start, start + count))
                start += count

        add(LocalHeads(n_local, size, config.causal, config.attn_dropout, impl), n_local)
        if config.causal:
            n_plain = n_sink // 2
            for count, offset in ((n_plain, 0), (n_sink - n_plain, 1)):
                add(
                    CausalSinkhornHeads(
                        count,
                        self.head_dim,
                        size,
                        config.n_top_buckets,
                        offset,
                        config.sort_temperature,
                        config.attn_dropout,
                        impl,
                        key_summary=config.causal_key_summary,
                        null_score=config.causal_null_score,
                        null_copies=config.null_bucket_copies,
                        skip_first_bucket=config.shifted_heads_skip_first_bucket,
                        **_routing_options(config),
                    ),
                    count,
                )
        else:
            add(
                SinkhornHeads(
                    n_sink,
                    self.head_dim,
                    size,
                    size,
                    config.n_top_buckets,
                    config.n_sortcut,
                    True,
                    config.use_simple_sort_net,
                    config.max_buckets,
                    config.non_permutative,
                    config.sinkhorn_iter,
                    config.sort_temperature,
                    config.attn_dropout,
                    impl,
                    route_own_bucket=config.route_own_bucket,
                    simple_scores=config.simple_sort_net_scores,
                    **_routing_options(config),
                ),
                n_sink,
            )
        self.groups = nn.ModuleList(groups)
        self.slices = slices
        # runs of groups computed together: the two causal Sinkhorn groups in one `causal_pair` pass when their
        # head counts are equal (an odd number of Sinkhorn heads runs them one after the other)
        self.runs = [[i] for i in range(len(groups))]
        causal_groups = [i for i, g in enumerate(groups) if isinstance(g, CausalSinkhornHeads)]
        # (and when the shifted heads route like the ordinary ones: not with shifted_heads_skip_first_bucket)
        if (
            len(causal_groups) == 2
            and len({groups[i].num_heads for i in causal_groups}) == 1
            and not groups[causal_groups[1]].skip_first
        ):
            self.runs = [run for run in self.runs if run[0] not in causal_groups] + [causal_groups]

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        return x.view(b, length, -1, self.head_dim).transpose(1, 2)  # [b, H, L, d]

    def forward(self, hidden_states, attention_mask, layer_cache=None, attn_weights=None):
        """attn_weights (output_attentions): a dict that receives, over all heads, "map" [b, H, L, L] (each
        query's attention weights at its keys' positions, routed values' weights included), "null" [b, H, L,
        n_top] (causal: the weight on each null bucket's key; None for non-causal models), "route" / "route_weight"
        [b, H, query buckets, n_chosen] (chosen key buckets in each head's bucket grid, -1 for none or a null
        bucket; 0-weight where nothing is chosen) and "offset" [H] (head h's bucket u starts at token
        u * bucket_size - offset[h])."""
        b, length, _ = hidden_states.shape
        q = self._heads(self.to_q(hidden_states))
        k, v = (self._heads(t) for t in self.to_kv(hidden_states).chunk(2, dim=-1))
        if layer_cache is not None and layer_cache.is_stepping:
            out = self._step(q, k, v, layer_cache)
        else:
            records = [None] * len(self.groups)
            if layer_cache is not None:
                records = [{} for _ in self.groups]
            looks = [None] * len(self.groups) if attn_weights is None else [{} for _ in self.groups]
            outs = []
            for run in self.runs:
                s, e = self.slices[run[0]][0], self.slices[run[-1]][1]
                if len(run) == 2:
                    pair_records = None if layer_cache is None else [records[i] for i in run]
                    pair_looks = None if attn_weights is None else [looks[i] for i in run]
                    plain, shifted = (self.groups[i] for i in run)
                    qs, ks, vs = q[:, s:e], k[:, s:e], v[:, s:e]
                    outs.append(causal_pair(plain, shifted, qs, ks, vs, attention_mask, pair_records, pair_looks))
                else:
                    group = self.groups[run[0]]
                    outs.append(
                        group(
                            q[:, s:e],
                            k[:, s:e],
                            v[:, s:e],
                            attention_mask,
                            record=records[run[0]],
                            attn_weights=looks[run[0]],
                        )
                    )
            out = torch.cat(outs, dim=1)
            if layer_cache is not None:
                layer_cache.fill_self(q, k, v, records, self.groups, self.slices)
            if attn_weights is not None:
                attn_weights.update(self._gather_weights(looks, length))
        out = out.transpose(1, 2).reshape(b, length, -1)
        return self.to_out(out)

    def _gather_weights(self, looks: list[dict], length: int) -> dict:
        """The head groups' maps and routing (see `forward`) over all heads; routing padded to a common shape."""
        maps = torch.cat([look["map"] for look in looks], dim=1)
        b, device = maps.shape[0], maps.device
        size = self.groups[0].bucket_size
        n_null = max((look["null"].shape[-1] for look in looks if "null" in look), default=0)
        rows = max([look["route"].shape[2] for look in looks if "route" in look] + [length // size])
        picks = max((look["route"].shape[3] for look in looks if "route" in look), default=0)
        nulls, routes, weights, offsets = [], [], [], []
        for look, group in zip(looks, self.groups):
            h = group.num_heads
            route = look.get("route", torch.full((b, h, 0, 0), -1, dtype=torch.long, device=device))
            weight = look.get("route_weight", torch.zeros(route.shape, device=device))
            pad = (0, picks - route.shape[3], 0, rows - route.shape[2])
            routes.append(F.pad(route, pad, value=-1))
            weights.append(F.pad(weight.float(), pad, value=0.0))
            nulls.append(look.get("null", maps.new_zeros(b, h, length, n_null)))
            offsets += [look.get("offset", 0)] * h
        return {
            "map": maps,
            "null": torch.cat(nulls, dim=1) if n_null else None,
            "route": torch.cat(routes, dim=1),
            "route_weight": torch.cat(weights, dim=1),
            "offset": torch.tensor(offsets, device=device),
        }

    def _step(self, q, k, v, layer_cache):
        owner = layer_cache.owner
        position, real = owner.lengths, owner.step_real  # [b] each
        host = None if owner.step_host is None else (*owner.step_host, owner.host_epoch, owner.step_memo)
        keys, values = layer_cache.append_kv(k, v, position)  # [b, H, slots, d]
        outs = []
        for i, (group, (s, e)) in enumerate(zip(self.groups, self.slices)):
            heads = slice(s, e)
            if isinstance(group, LocalHeads):
                outs.append(group.step(q[:, s:e], keys, values, heads, position, layer_cache.owner.origin))
            else:
                state = layer_cache.groups[i]
                outs.append(
                    group.step(q[:, s:e], k[:, s:e], v[:, s:e], keys, values, heads, position, real, state, host)
                )
        return torch.cat(outs, dim=1)


class SinkhornCrossAttention(nn.Module):
    """Attention from the decoder to `encoder_hidden_states` (the seed's `context`), bucketed with
    `context_bucket_size`. Causal decoders route per query bucket from its leading token; non-causal models use
    SortCut (`context_n_sortcut`) or per-bucket routing over the context buckets."""

    def __init__(self, config: SinkhornConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        inner = self.num_heads * self.head_dim
        self.to_q = nn.Linear(config.hidden_size, inner, bias=False)
        self.to_kv = nn.Linear(config.hidden_size, 2 * inner, bias=False)
        self.to_out = nn.Linear(inner, config.hidden_size)
        self.causal = config.causal
        impl = _implementation(config)
        if config.causal:
            self.heads = CausalSinkhornHeads(
                self.num_heads,
                self.head_dim,
                config.bucket_size,
                config.context_top,
                0,
                config.sort_temperature,
                config.attn_dropout,
                impl,
                cross=True,
                kv_bucket_size=config.context_bucket,
                **_routing_options(config),
            )
        else:
            self.heads = SinkhornHeads(
                self.num_heads,
                self.head_dim,
                config.bucket_size,
                config.context_bucket,
                config.n_top_buckets,
                config.context_n_sortcut,
                False,
                False,
                1,
                config.non_permutative,
                config.sinkhorn_iter,
                config.sort_temperature,
                config.attn_dropout,
                impl,
                **_routing_options(config),
            )

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        return x.view(b, length, -1, self.head_dim).transpose(1, 2)

    def forward(self, hidden_states, attention_mask, context, context_mask, layer_cache=None, attn_weights=None):
        """attn_weights (output_attentions): a dict that receives "map" [b, H, L, context length]."""
        b, length, _ = hidden_states.shape
        q = self._heads(self.to_q(hidden_states))
        if layer_cache is not None and layer_cache.is_stepping:
            owner = layer_cache.owner
            out = self.heads.cross_step(q, owner.lengths, owner.step_real, layer_cache.cross_state, layer_cache.context)
        else:
            k, v = (self._heads(t) for t in self.to_kv(context).chunk(2, dim=-1))
            if self.causal:
                record = {} if layer_cache is not None else None
                out = self.heads(q, k, v, attention_mask, k_mask=context_mask, record=record, attn_weights=attn_weights)
                if layer_cache is not None:
                    layer_cache.fill_cross(q, k, v, context_mask, record, self.heads)
            else:
                out = self.heads(q, k, v, attention_mask, context_mask, attn_weights=attn_weights)
        out = out.transpose(1, 2).reshape(b, length, -1)
        return self.to_out(out)


# ----------------------------------------------------------------------------------------------------------------
# blocks and layer
# ----------------------------------------------------------------------------------------------------------------


class AttentionBlock(nn.Module):
    """Pre-norm self-attention branch f(x) (the residual is added by the caller or the reversible stack)."""

    def __init__(self, config: SinkhornConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = SinkhornSelfAttention(config)
        self.dropout = nn.Dropout(config.attn_layer_dropout)

    def forward(self, hidden_states, attention_mask=None, layer_cache=None, attn_weights=None, **unused):
        return self.dropout(self.attention(self.norm(hidden_states), attention_mask, layer_cache, attn_weights))


class CrossAttentionBlock(nn.Module):
    def __init__(self, config: SinkhornConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = SinkhornCrossAttention(config)
        self.dropout = nn.Dropout(config.attn_layer_dropout)

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        context=None,
        context_mask=None,
        layer_cache=None,
        attn_weights=None,
        **unused,
    ):
        """attn_weights: the layer's dict; the cross-attention's weights go to its "cross" entry."""
        cross = None
        if attn_weights is not None:
            cross = attn_weights["cross"] = {}
        out = self.attention(self.norm(hidden_states), attention_mask, context, context_mask, layer_cache, cross)
        return self.dropout(out)


class FeedForwardBlock(nn.Module):
    """Pre-norm feed-forward (or product-key memory) branch g(x), optionally over `ff_chunks` chunks of the
    sequence (chunks may be unequal, so any length works)."""

    def __init__(self, config: SinkhornConfig, use_pkm: bool = False):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        if use_pkm:
            self.net = ProductKeyMemory(
                config.hidden_size,
                num_keys=config.pkm_num_keys,
                heads=config.pkm_heads,
                topk=config.pkm_topk,
                dim_key=config.pkm_dim_key,
                norm_halves=config.pkm_norm_halves,
            )
        else:
            self.net = FeedForward(config.hidden_size, config.ff_size, config.ff_dropout, config.ff_glu)
        self.chunks = config.ff_chunks

    def forward(self, hidden_states, **unused):
        x = self.norm(hidden_states)
        if self.chunks > 1 and x.shape[1] > 1:
            return torch.cat([self.net(c) for c in x.chunk(self.chunks, dim=1)], dim=1)
        return self.net(x)


class SinkhornLayer(GradientCheckpointingLayer):
    """attention -> feed-forward (-> cross-attention -> cross feed-forward), each a pre-norm residual branch.
    The reversible stack sees the same (f, g) pairs: (attention, feed_forward) and, with `receives_context`,
    (cross_attention, cross_feed_forward), as in the reference."""

    def __init__(self, config: SinkhornConfig, use_pkm: bool):
        super().__init__()
        self.attention = AttentionBlock(config)
        self.feed_forward = FeedForwardBlock(config, use_pkm)
        if config.receives_context:
            self.cross_attention = CrossAttentionBlock(config)
            self.cross_feed_forward = FeedForwardBlock(config)

    def blocks(self, feed_forward: nn.Module | None = None) -> list[tuple[nn.Module, nn.Module]]:
        pairs = [(self.attention, feed_forward if feed_forward is not None else self.feed_forward)]
        if hasattr(self, "cross_attention"):
            pairs.append((self.cross_attention, self.cross_feed_forward))
        return pairs

    def forward(
        self,
        hidden_states,
        attention_mask=None,
        context=None,
        context_mask=None,
        layer_cache=None,
        feed_forward=None,
        attn_weights=None,
    ):
        """attn_weights (output_attentions): a dict that receives the attention weights (see AttentionBlock)."""
        kwargs = dict(
            attention_mask=attention_mask,
            context=context,
            context_mask=context_mask,
            layer_cache=layer_cache,
            attn_weights=attn_weights,
        )
        for f, g in self.blocks(feed_forward):
            hidden_states = hidden_states + f(hidden_states, **kwargs)
            hidden_states = hidden_states + g(hidden_states)
        return hidden_states


# ----------------------------------------------------------------------------------------------------------------
# generation cache
# ----------------------------------------------------------------------------------------------------------------


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

    def append_kv(self, k, v, position):
        """Write the new token's keys/values [b, H, 1, d] at each row's `position` [b], in place."""
        b, h, _, d = k.shape
        index = (position + self.owner.origin)[:, None, None, None].expand(b, h, 1, d)
        self.keys.scatter_(2, index, k)
        self.values.scatter_(2, index, v)
        return self.keys, self.values

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
        for layer in self.layers:
            layer._apply(remap)

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
        self.lengths.copy_(self.token_mask[:, :keep].sum(1))
        self.seen.fill_(keep)
        self._seen_host = keep
        self.host_epoch += 1
        for layer in self.layers:
            layer.rebuild(self.lengths)


# ----------------------------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------------------------


class AxialPositionEmbedding(nn.Module):
    """Axial positions (`axial_position_embeddings`): position p -> per_bucket[p // B] + in_bucket[p % B]."""

    def __init__(self, max_positions: int, bucket_size: int, dim: int):
        super().__init__()
        self.bucket_size = bucket_size
        self.per_bucket = nn.Parameter(torch.empty(math.ceil(max_positions / bucket_size), dim))
        self.in_bucket = nn.Parameter(torch.empty(bucket_size, dim))

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.per_bucket[position_ids // self.bucket_size] + self.in_bucket[position_ids % self.bucket_size]


@dataclass
class SinkhornRouting(ModelOutput):
    """One layer's routing (output_attentions=True), over all heads (local heads first, then the Sinkhorn heads;
    causal models: ordinary, then shifted).

    key_buckets: [batch, heads, query buckets, picks] long: the key buckets each query bucket attends besides its
        own (causal: strictly earlier buckets), as indices in the head's own bucket grid (bucket u of head h covers
        tokens u * bucket_size - offsets[h] onwards, counting each row's real tokens only: a padded row's buckets
        start at its first real token); -1 where a pick is a null bucket (causal models), is masked
        out (SortCut's shared pick of a bucket's own bucket) or does not exist (local heads; the ordinary causal
        heads' last row when shifted heads have one bucket more).
    weights: [batch, heads, query buckets, picks] float: the factor the pick's values are multiplied by (its
        Sinkhorn / softmax routing weight with `weight_routed_values`, else 1); 0 where the pick is not used.
    offsets: [heads] long: 0 for ordinary buckets, 1 for the causal shifted heads (their bucket u covers tokens
        u * bucket_size - 1 ... u * bucket_size + bucket_size - 2).
    null_attention: [batch, heads, seq, n_top_buckets] (causal models): each query token's attention weight on
        each null bucket's learned key (times its routing weight, as in `attentions`); the attention rows sum to 1
        minus this mass. None for non-causal models (no null buckets).
    """

    key_buckets: torch.LongTensor | None = None
    weights: torch.FloatTensor | None = None
    offsets: torch.LongTensor | None = None
    null_attention: torch.FloatTensor | None = None

    def matrix(self) -> torch.Tensor:
        """[batch, heads, query buckets, key buckets]: `weights` of each chosen key bucket, 0 elsewhere (own and
        local buckets are not routing choices and are not shown)."""
        b, h, rows, _ = self.key_buckets.shape
        chosen = self.key_buckets >= 0
        out = self.weights.new_zeros(b, h, rows, rows + 1)
        out.scatter_add_(-1, self.key_buckets.masked_fill(~chosen, rows), self.weights * chosen)
        return out[..., :rows]


@cache_output
@dataclass
class SinkhornModelOutput(ModelOutput):
    """last_hidden_state [batch, seq, hidden]; cache (when use_cache); hidden_states (when asked); with
    output_attentions: attentions (per layer [batch, heads, seq, seq]: each query's attention weights placed at
    its keys' positions, the routed buckets' weights included, so that the head's output is attentions @ values
    (+ the null buckets' share, see SinkhornRouting.null_attention)), cross_attentions (receives_context: per
    layer [batch, heads, seq, context length]) and routing (per layer a SinkhornRouting)."""

    last_hidden_state: torch.FloatTensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    cross_attentions: tuple[torch.FloatTensor, ...] | None = None
    routing: tuple[SinkhornRouting, ...] | None = None


@cache_output
@dataclass
class SinkhornCausalLMOutput(ModelOutput):
    """loss; logits [batch, seq, vocab]; cache; hidden_states; attentions, cross_attentions, routing (see
    SinkhornModelOutput)."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    cross_attentions: tuple[torch.FloatTensor, ...] | None = None
    routing: tuple[SinkhornRouting, ...] | None = None


@dataclass
class SinkhornMaskedLMOutput(ModelOutput):
    """loss; logits [batch, seq, vocab]; hidden_states; attentions, cross_attentions, routing (see
    SinkhornModelOutput)."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    cross_attentions: tuple[torch.FloatTensor, ...] | None = None
    routing: tuple[SinkhornRouting, ...] | None = None


class SinkhornPreTrainedModel(PreTrainedModel):
    config_class = SinkhornConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SinkhornLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        config = self.config
        std = config.initializer_range
        # a tied output embedding is initialised as an output layer: unit-variance logits at init
        tied_std = config.embedding_size**-0.5
        if isinstance(module, nn.Linear):
            if config.tie_word_embeddings and module is getattr(self, "lm_head", None):
                init.normal_(module.weight, mean=0.0, std=tied_std if std is None else std)
                if module.bias is not None:
                    init.zeros_(module.bias)
            elif std is None:
                # PyTorch's default for nn.Linear (the reference's init): U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for the
                # weight (kaiming-uniform with a = sqrt(5)) and the bias
                bound = module.in_features**-0.5
                init.uniform_(module.weight, -bound, bound)
                if module.bias is not None:
                    init.uniform_(module.bias, -bound, bound)
            else:
                init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            if std is not None:
                init.normal_(module.weight, mean=0.0, std=std)
            elif config.tie_word_embeddings:
                # positions at the scale of the (output-layer sized) token embedding, or they would drown it out
                init.normal_(module.weight, mean=0.0, std=tied_std)
            else:
                # PyTorch's default for nn.Embedding (the reference's token and positional embeddings): N(0, 1), so
                # that tokens and positions start far apart in the residual stream
                init.normal_(module.weight, mean=0.0, std=1.0)
        elif isinstance(module, AxialPositionEmbedding):
            # as the position nn.Embedding below: N(0, 1) (the reference's axial tables), tied-head scale, or std
            pos_std = std if std is not None else (tied_std if config.tie_word_embeddings else 1.0)
            init.normal_(module.per_bucket, mean=0.0, std=pos_std)
            init.normal_(module.in_bucket, mean=0.0, std=pos_std)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, ProductKeyMemory):
            # the same distributions as ProductKeyMemory.reset_parameters, through the loading-aware initialisers
            init.normal_(module.keys, mean=0.0, std=module.dim_key**-0.5)
            init.normal_(module.values.weight, mean=0.0, std=module.values.weight.shape[1] ** -0.5)
        elif isinstance(module, CausalSinkhornHeads) and not module.cross:
            init.normal_(module.null_keys, mean=0.0, std=1.0)
            init.normal_(module.null_values, mean=0.0, std=1.0)
        elif isinstance(module, SinkhornHeads) and module.sort_net is not None:
            init.normal_(module.sort_net, mean=0.0, std=module.sort_net.shape[1] ** -0.5)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    # attention implementation: transformers resolves `attn_implementation` (argument or config) through these;
    # the head groups take the result when they are built, and `set_attn_implementation` hands them a new one

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        if requested_attention is not None and requested_attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(_unsupported_attention(requested_attention))
        return super().get_correct_attn_implementation(requested_attention, is_init_check)

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True

    def set_attn_implementation(self, attn_implementation: str | dict, allow_all_kernels: bool = False) -> None:
        super().set_attn_implementation(attn_implementation, allow_all_kernels=allow_all_kernels)
        implementation = _implementation(self.config)
        for module in self.modules():
            if isinstance(module, (LocalHeads, SinkhornHeads, CausalSinkhornHeads)):
                module.implementation = implementation


def _permute_tokens(t: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """t [b, L, e] with its tokens in the order `order` [b, L] (None: unchanged)."""
    return t if order is None else t.gather(1, order[..., None].expand_as(t))


def _permute_map(t: torch.Tensor, order: torch.Tensor | None, keys: bool) -> torch.Tensor:
    """An attention map t [b, h, L, K] with its query tokens (and, `keys`, its key tokens: K = L) in the order
    `order` [b, L] (None: unchanged)."""
    if order is None:
        return t
    b, h, length, k = t.shape
    t = t.gather(2, order[:, None, :, None].expand(b, h, length, k))
    return t.gather(3, order[:, None, None, :].expand(b, h, length, k)) if keys else t


def _check_mask(mask: torch.Tensor | None, shape: tuple[int, int], name: str) -> None:
    if mask is not None and tuple(mask.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (batch, sequence), got {tuple(mask.shape)}")


class SinkhornModel(SinkhornPreTrainedModel):
    """Token ids (or `inputs_embeds`) to hidden states (the seed's `SinkhornTransformer` / `return_embeddings`).

    Inputs of any length are padded to a multiple of `bucket_size` (padding masked, output trimmed). Any padding
    (left padding for generation) is supported: positions count real tokens only, and each row's real tokens are
    moved to the front before the layers (and the outputs back after), so buckets start at a row's first real
    token and a row's outputs equal those of the unpadded row.
    """

    def __init__(self, config: SinkhornConfig):
        super().__init__(config)
        config.validate_sinkhorn()
        emb = config.embedding_size
        self.embed_tokens = nn.Embedding(config.vocab_size, emb)
        if config.axial_position_embeddings:
            self.embed_positions = AxialPositionEmbedding(config.max_position_embeddings, config.bucket_size, emb)
        else:
            self.embed_positions = nn.Embedding(config.max_position_embeddings, emb)
        self.emb_dropout = nn.Dropout(config.emb_dropout)
        self.project_in = nn.Linear(emb, config.hidden_size) if emb != config.hidden_size else None
        pkm = set(config.pkm_layers)
        if config.weight_tie:
            # one shared layer; product-key layers keep their own memory in place of the shared feed-forward
            self.layers = nn.ModuleList([SinkhornLayer(config, use_pkm=False)])
            self.pkm_blocks = nn.ModuleDict({str(i): FeedForwardBlock(config, use_pkm=True) for i in sorted(pkm)})
        else:
            self.layers = nn.ModuleList(
                [SinkhornLayer(config, use_pkm=i + 1 in pkm) for i in range(config.num_hidden_layers)]
            )
            self.pkm_blocks = None
        # norm_after_project_out: the language model normalises after its projection back to emb_dim instead
        self.norm = (
            nn.Identity()
            if config.norm_after_project_out
            else nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        )
        # the reversible stack only references the blocks above (kept out of the module tree, so parameter names are
        # the same with and without `reversible`)
        self._reversible = (ReversibleSequence(self._stack_blocks()),) if config.reversible else None
        self.gradient_checkpointing = False
        self.post_init()

    def _layer_at(self, depth: int) -> tuple[SinkhornLayer, nn.Module | None]:
        if self.config.weight_tie:
            key = str(depth + 1)
            return self.layers[0], (self.pkm_blocks[key] if key in self.pkm_blocks else None)
        return self.layers[depth], None

    def _stack_blocks(self) -> list[tuple[nn.Module, nn.Module]]:
        blocks = []
        for depth in range(self.config.num_hidden_layers):
            layer, ff = self._layer_at(depth)
            blocks.extend(layer.blocks(ff))
        return blocks

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        **kwargs,
    ) -> SinkhornModelOutput:
        config = self.config
        output_attentions = kwargs.get("output_attentions")
        if output_attentions is None:
            output_attentions = getattr(config, "output_attentions", False)
        if output_attentions and self.training and config.layer_dropout > 0:
            raise ValueError(
                "SinkhornModel: output_attentions with layer_dropout > 0 in training mode is not supported (a "
                "dropped layer attends nothing); call model.eval() first"
            )
        if (input_ids is None) == (inputs_embeds is None):
            raise ValueError("SinkhornModel: pass exactly one of input_ids or inputs_embeds")
        cache = cache if cache is not None else past_key_values
        # a cache is for generation: by default none in training mode, and only a causal model can use one
        if use_cache is None:
            use_cache = config.use_cache and not self.training
        use_cache = use_cache and config.causal
        output_hidden_states = output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        if output_hidden_states and config.reversible:
            raise ValueError("SinkhornModel: output_hidden_states is not available with reversible=True")
        if encoder_hidden_states is not None and not config.receives_context:
            raise ValueError("SinkhornModel: encoder_hidden_states needs a config with receives_context=True")
        if (
            config.receives_context
            and encoder_hidden_states is None
            and not (isinstance(cache, SinkhornCache) and cache.prefilled)
        ):
            raise ValueError("SinkhornModel: receives_context=True needs encoder_hidden_states (the context)")
        if cache is not None and not isinstance(cache, SinkhornCache):
            if cache.get_seq_length() > 0:
                raise ValueError(f"SinkhornModel: expected a SinkhornCache, got a filled {type(cache).__name__}")
            # an empty generic cache (e.g. from EncoderDecoderModel.generate): use our own, not marked compileable,
            # since that caller would then build transformers' 4-D attention masks from it
            cache = SinkhornCache(config, compileable=False) if use_cache else None
        elif use_cache and cache is None:
            cache = SinkhornCache(config)
        if not use_cache:
            cache = None

        batch, length = (input_ids if input_ids is not None else inputs_embeds).shape[:2]
        stepping = cache is not None and cache.prefilled
        if output_attentions and stepping:
            raise ValueError(
                "SinkhornModel: output_attentions is not available for tokens fed on top of a filled cache (cached "
                "decoding steps); the forward that fills the cache, or a forward over the whole sequence, returns them"
            )
        # tokens given before (host count; unknown after compiled steps, which check nothing here)
        past = (cache._seen_host if stepping else 0) if not torch.compiler.is_compiling() else None
        if past is not None and past + length > config.max_position_embeddings:
            raise ValueError(
                f"SinkhornModel: sequence length {past + length} exceeds max_position_embeddings "
                f"({config.max_position_embeddings})"
            )
        if input_ids is not None:
            check_token_ids(input_ids, config.vocab_size)
        if attention_mask is not None:
            if stepping and attention_mask.dim() == 2 and attention_mask.shape[1] > length:
                attention_mask = attention_mask[:, -length:]  # generate() passes the mask of the whole sequence so far
            _check_mask(attention_mask, (batch, length), "attention_mask")
            attention_mask = attention_mask.bool()

        # several new tokens on top of a filled cache: feed them one at a time (exact, generation-only path)
        if stepping and length > 1:
            outputs = []
            for t in range(length):
                out = self.forward(
                    input_ids=input_ids[:, t : t + 1] if input_ids is not None else None,
                    inputs_embeds=inputs_embeds[:, t : t + 1] if inputs_embeds is not None else None,
                    attention_mask=attention_mask[:, t : t + 1] if attention_mask is not None else None,
                    position_ids=position_ids[:, t : t + 1] if position_ids is not None else None,
                    encoder_hidden_states=encoder_hidden_states,
                    encoder_attention_mask=encoder_attention_mask,
                    cache=cache,
                    use_cache=True,
                    return_dict=True,
                )
                outputs.append(out.last_hidden_state)
            return SinkhornModelOutput(last_hidden_state=torch.cat(outputs, dim=1), cache=cache)

        device = (input_ids if input_ids is not None else inputs_embeds).device
        mask = (
            attention_mask if attention_mask is not None else torch.ones(batch, length, dtype=torch.bool, device=device)
        )
        if position_ids is None:
            before = cache.lengths[:, None] if stepping else 0
            position_ids = (before + mask.long().cumsum(1) - 1).clamp_min(0)
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)
        hidden = inputs_embeds + self.embed_positions(position_ids.clamp_max(config.max_position_embeddings - 1))
        hidden = self.emb_dropout(hidden)
        if self.project_in is not None:
            hidden = self.project_in(hidden)

        context = context_mask = None
        if encoder_hidden_states is not None and not stepping:
            context, context_mask = self._pad_context(encoder_hidden_states, encoder_attention_mask)

        # buckets start at each row's first real token: the real tokens of every row move to the front (in order),
        # the outputs go back to their places at the end, so a row's outputs depend neither on its padding nor on
        # the other rows
        back = None
        if stepping:
            cache.begin_step(mask[:, 0])
            padded_mask = mask
        else:
            if cache is not None:
                cache.begin_prefill(mask)
            if attention_mask is not None:
                order = real_tokens_first(mask)  # [b, L]
                back = order.argsort(dim=1)
                hidden, mask = _permute_tokens(hidden, order), mask.gather(1, order)
            pad = (-length) % config.bucket_size
            hidden = F.pad(hidden, (0, 0, 0, pad))
            padded_mask = F.pad(mask, (0, pad), value=False)

        # layer dropout: the residual stack drops a layer by discarding its output on the device (no host read, so
        # a training step never waits for the device; the layer is still computed). The reversible stack needs the
        # choice on the host to make the block an identity: it draws it on the CPU (a host-side read, no device sync)
        layer_drop = self.training and config.layer_dropout > 0
        skip = [False] * config.num_hidden_layers
        keep = None
        if layer_drop and self._reversible is not None:
            skip = (torch.rand(config.num_hidden_layers) < config.layer_dropout).tolist()
        elif layer_drop:
            keep = torch.rand(config.num_hidden_layers, device=hidden.device) >= config.layer_dropout

        all_hidden = (_permute_tokens(hidden[:, :length], back),) if output_hidden_states else None
        looks = [{} if output_attentions else None for _ in range(config.num_hidden_layers)]
        if self._reversible is not None and cache is None and not output_attentions:
            per_layer = len(self.layers[0].blocks())
            block_skip = [s for s in skip for _ in range(per_layer)]
            f_kwargs = dict(attention_mask=padded_mask, context=context, context_mask=context_mask)
            y1, y2 = self._reversible[0](hidden, hidden, f_kwargs=f_kwargs, skip=block_skip)
            hidden = (y1 + y2) / 2
        elif self._reversible is not None:
            # with a cache or output_attentions: the same two-stream computation as a plain loop (blocks write the
            # cache, the attention weights)
            x1 = x2 = hidden
            for depth in range(config.num_hidden_layers):
                if skip[depth]:
                    continue
                layer, ff = self._layer_at(depth)
                kwargs_f = dict(
                    attention_mask=padded_mask,
                    context=context,
                    context_mask=context_mask,
                    layer_cache=cache.layers[depth] if cache is not None else None,
                    attn_weights=looks[depth],
                )
                for f, g in layer.blocks(ff):
                    x1 = x1 + f(x2, **kwargs_f)
                    x2 = x2 + g(x1)
            hidden = (x1 + x2) / 2
        else:
            for depth in range(config.num_hidden_layers):
                layer, ff = self._layer_at(depth)
                out = layer(
                    hidden,
                    attention_mask=padded_mask,
                    context=context,
                    context_mask=context_mask,
                    layer_cache=cache.layers[depth] if cache is not None else None,
                    feed_forward=ff,
                    attn_weights=looks[depth],
                )
                hidden = out if keep is None else torch.where(keep[depth], out, hidden)
                if output_hidden_states:
                    all_hidden = all_hidden + (_permute_tokens(hidden[:, :length], back),)
        hidden = self.norm(_permute_tokens(hidden[:, :length], back))

        if cache is not None:
            if stepping:
                cache.end_step(mask[:, 0])
            else:
                cache.end_prefill()
        attentions = cross_attentions = routing = None
        if output_attentions:
            # (maps in the order of the given tokens; routing in each row's bucket grid of its real tokens)
            attentions = tuple(_permute_map(look["map"][:, :, :length, :length], back, keys=True) for look in looks)
            routing = tuple(
                SinkhornRouting(
                    key_buckets=look["route"],
                    weights=look["route_weight"],
                    offsets=look["offset"],
                    null_attention=None
                    if look["null"] is None
                    else _permute_map(look["null"][:, :, :length], back, keys=False),
                )
                for look in looks
            )
            if context is not None:
                lc = encoder_hidden_states.shape[1]
                cross_attentions = tuple(
                    _permute_map(look["cross"]["map"][:, :, :length, :lc], back, keys=False) for look in looks
                )
        return SinkhornModelOutput(
            last_hidden_state=hidden,
            cache=cache,
            hidden_states=all_hidden,
            attentions=attentions,
            cross_attentions=cross_attentions,
            routing=routing,
        )

    def _pad_context(self, context: torch.Tensor, context_mask: torch.Tensor | None):
        b, lc, _ = context.shape
        _check_mask(context_mask, (b, lc), "encoder_attention_mask")
        mask = (
            context_mask.bool()
            if context_mask is not None
            else torch.ones(b, lc, dtype=torch.bool, device=context.device)
        )
        pad = (-lc) % self.config.context_bucket
        return F.pad(context, (0, 0, 0, pad)), F.pad(mask, (0, pad), value=False)


class _SinkhornLanguageModel(SinkhornPreTrainedModel):
    """The base model plus the language-model head shared by the causal and the masked LM: with factorised
    embeddings (`emb_dim`) the hidden states are projected back to `emb_dim` before the (optionally tied) output
    layer."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    _needs_causal: bool

    def __init__(self, config: SinkhornConfig):
        super().__init__(config)
        if config.causal != self._needs_causal:
            other = "SinkhornForMaskedLM" if config.causal else "SinkhornForCausalLM"
            raise ValueError(
                f"{type(self).__name__} needs causal={self._needs_causal} (use {other} for causal={config.causal})"
            )
        self.model = SinkhornModel(config)
        emb = config.embedding_size
        self.project_out = nn.Linear(config.hidden_size, emb) if emb != config.hidden_size else None
        self.norm_out = nn.LayerNorm(emb, eps=config.layer_norm_eps) if config.norm_after_project_out else None
        self.lm_head = nn.Linear(emb, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.project_out is not None:
            hidden = self.project_out(hidden)
        if self.norm_out is not None:
            hidden = self.norm_out(hidden)
        return self.lm_head(hidden)  # [batch, seq, vocab]


class SinkhornForCausalLM(_SinkhornLanguageModel, GenerationMixin):
    _needs_causal = True

    # generate(): a SinkhornCache sized for the whole generation (so decoding steps keep static shapes and compile),
    # and the attention mask of the new tokens only (the cache keeps the padding of earlier tokens itself)

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ) -> None:
        check_assisted_decoding(generation_mode)
        given = model_kwargs.get("cache") is not None or model_kwargs.get("past_key_values") is not None
        if given or generation_config.use_cache is False or generation_config.cache_implementation is not None:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        requested = getattr(generation_config, "max_cache_len", None)  # not a GenerationConfig field in older releases
        if requested is not None:
            max_cache_length = max(max_cache_length, requested)
        model_kwargs["cache"] = SinkhornCache(self.config, max_cache_len=max_cache_length)

    def create_masks_for_generate(self, attention_mask=None, cache=None, inputs_embeds=None, **kwargs):
        if attention_mask is not None and isinstance(cache, SinkhornCache) and cache.prefilled:
            return attention_mask[:, -inputs_embeds.shape[1] :]  # a fixed shape for compiled decoding steps
        return attention_mask

    def _random_truncate(self, input_ids, attention_mask, labels):
        """Cut every row at a random length (>= 2) and move it to the end of the window (left padding)."""
        b, n = input_ids.shape
        keep = torch.randint(2, n + 1, (b,), device=input_ids.device)
        src = torch.arange(n, device=input_ids.device)[None, :] - (n - keep)[:, None]
        inside = src >= 0
        src = src.clamp_min(0)
        pad_id = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        input_ids = input_ids.gather(1, src).masked_fill(~inside, pad_id)
        mask = inside if attention_mask is None else inside & attention_mask.bool().gather(1, src)
        if labels is not None:
            labels = labels.gather(1, src).masked_fill(~inside, -100)
        return input_ids, mask, labels

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        past_key_values: Cache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> SinkhornCausalLMOutput:
        if (
            self.training
            and self.config.randomly_truncate_sequence
            and input_ids is not None
            and input_ids.shape[1] > 2
        ):
            input_ids, attention_mask, labels = self._random_truncate(input_ids, attention_mask, labels)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            cache=cache if cache is not None else past_key_values,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_attentions=kwargs.pop("output_attentions", None),
            return_dict=True,
        )
        hidden = outputs.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self._logits(hidden)
        loss = None
        if labels is not None:
            loss = self.loss_function(logits, labels, vocab_size=self.config.vocab_size, **kwargs)
        return SinkhornCausalLMOutput(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            cross_attentions=outputs.cross_attentions,
            routing=outputs.routing,
        )


class SinkhornForMaskedLM(_SinkhornLanguageModel):
    _needs_causal = False

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        **kwargs,
    ) -> SinkhornMaskedLMOutput:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            use_cache=False,
            output_hidden_states=output_hidden_states,
            output_attentions=kwargs.pop("output_attentions", None),
            return_dict=True,
        )
        logits = self._logits(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return SinkhornMaskedLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            cross_attentions=outputs.cross_attentions,
            routing=outputs.routing,
        )


__all__ = [
    "SinkhornCache",
    "SinkhornForCausalLM",
    "SinkhornForMaskedLM",
    "SinkhornModel",
    "SinkhornPreTrainedModel",
    "SinkhornRouting",
]
