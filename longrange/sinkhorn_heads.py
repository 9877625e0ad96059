"""The Sinkhorn model's bucketed attention heads: the head groups (local, Sinkhorn, causal Sinkhorn and its
cross-attention variant) and the one-pass pair of ordinary and shifted causal groups. `sinkhorn_attention.py`
builds the attention layers from these groups; the routing math is in `sinkhorn_routing.py`; the algorithm is
described in `modeling_sinkhorn.py`.

Only same-folder relative imports: `save_pretrained` copies this file next to the weights.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .layers import attend
from .sinkhorn_routing import (
    BucketMask,
    CausalTerms,
    SortTerms,
    additive,
    attend_buckets,
    bucket_mask,
    bucket_sums,
    earlier_sums,
    pick_buckets,
    prev_bucket,
    routing_einsum,
    routing_matmul,
    running_sums,
    select_buckets,
    token_weights,
    weighted_sums,
)

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
        """q, k, v: [b, h, L, d]; mask: [b, L] real tokens (or the model's BucketMask). Nothing to record for the
        cache: a step reads the window straight from the cached keys/values. `attn_weights`: a dict that receives
        the dense attention map (output_attentions; see `SinkhornSelfAttention.forward`, sinkhorn_attention.py)."""
        b, h, length, d = q.shape
        size = self.bucket_size
        n = length // size
        bq, bk, bv = (t.reshape(b, h, n, size, d) for t in (q, k, v))  # [b, h, n, B, d]
        shifts = self._shifts()
        keys = torch.cat([prev_bucket(bk, 2, s, 0.0) if s else bk for s in shifts], dim=3)  # [b, h, n, kB, d]
        values = torch.cat([prev_bucket(bv, 2, s, 0.0) if s else bv for s in shifts], dim=3)
        key = ("local", size, self.causal, q.dtype)
        bias = bucket_mask(mask).terms(key, lambda m: self._bias(m, q.dtype))  # [b, 1, n, B, kB]
        if attn_weights is not None:
            out, probs = attend_buckets(bq, keys, values, None, self._p(), self.implementation, bias, True)
            pos = torch.arange(length, device=q.device).view(1, 1, n, size)
            key_pos = torch.cat([prev_bucket(pos, 2, s, -1) if s else pos for s in shifts], dim=3)
            attn_weights["map"] = token_weights(probs, key_pos, None, length)
            return out.reshape(b, h, length, d)
        out = attend_buckets(bq, keys, values, None, self._p(), self.implementation, bias=bias)
        return out.reshape(b, h, length, d)

    def _shifts(self) -> tuple[int, ...]:
        """The key windows of query window u, as shifts: u - 1 and u (and u + 1 when non-causal)."""
        return (1, 0) if self.causal else (1, 0, -1)

    def _bias(self, mask, dtype) -> torch.Tensor:
        """The additive mask [b, 1, n, B, kB] of every query window over its key windows, from the padding mask
        [b, L] alone (the same in every layer: see BucketMask)."""
        size, shifts = self.bucket_size, self._shifts()
        b, n = mask.shape[0], mask.shape[1] // size
        bm = mask.view(b, 1, n, size)
        key_mask = torch.cat([prev_bucket(bm, 2, s, False) if s else bm for s in shifts], dim=3)  # [b,1,n,kB]
        attn_mask = key_mask[:, :, :, None, :]  # [b, 1, n, 1, kB]
        if self.causal:
            own = torch.ones(size, size, dtype=torch.bool, device=mask.device).tril()
            pattern = torch.cat([torch.ones(size, size, dtype=torch.bool, device=mask.device), own], dim=1)
            attn_mask = attn_mask & pattern  # [b, 1, n, B, 2B]
        # every query sees itself (its own window is the second of `shifts`), padded queries too: no row is fully
        # masked, so an additive mask is enough and the gradient of a padded query's output (which a shifted
        # language-model label can read) is that of an ordinary softmax in every attention implementation
        itself = F.pad(torch.eye(size, dtype=torch.bool, device=mask.device), (size, size * (len(shifts) - 2)))
        return additive(attn_mask | itself, dtype)

    def _p(self) -> float:
        return self.dropout if self.training else 0.0

    def step(self, q, keys, values, heads, position, origin):
        """One new token per row at `position` [b] (keys/values: the layer's cache [b, H, S, d], already holding it
        at slot origin + position for this group's `heads`; a row's cached tokens are its real tokens,
        left-aligned). q: [b, h, 1, d]. The window: the previous bucket and the own bucket up to the token."""
        size = self.bucket_size
        u = torch.div(position, size, rounding_mode="floor")  # [b]
        which = torch.stack([u - 1, u], dim=-1)[:, None]  # [b, 1, 2]
        k, v = pick_buckets((keys, values), heads, origin, size, which)
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
        that receives the dense attention map and the routing (output_attentions).

        Steps: bucket summaries; the sort net's scores; the routing choice and gathering the chosen buckets (each
        query bucket's own, or SortCut's one choice shared by all); the own bucket; attention."""
        b, h, lq, d = q.shape
        nq, nk = lq // self.bucket_size, k.shape[2] // self.kv_bucket_size
        bq = q.reshape(b, h, nq, self.bucket_size, d)
        bk = k.reshape(b, h, nk, self.kv_bucket_size, d)
        bv = v.reshape(b, h, nk, self.kv_bucket_size, d)
        terms = SortTerms.of(self, q_mask, k_mask, h)  # self-attention: once per forward (see BucketMask)
        q_sums = weighted_sums(q, terms.q_weights)  # [b, h, nq, d]
        k_sums = weighted_sums(k, terms.k_weights)
        scores, n_sel = self._scores(q_sums, k_sums, terms)  # [b, h, 1 or nq, nk]
        parts = _KeyParts()
        bkm = terms.k_mask
        if n_sel > 0:
            idx, picked_valid, scale = select_buckets(
                scores,
                terms.valid,
                n_sel,
                self.temperature,
                self.sinkhorn_iter,
                self.training,
                self.weight_routed_values,
                self.sequential_weights,
            )  # [b, h, 1 or nq, n_sel]
            self._add_chosen(parts, (bk, bv, bkm), idx, picked_valid, scale, terms, nq, attn_weights)
        if self.include_own:
            parts.add(bk, bv, bkm[:, None].expand(b, h, nq, -1))
            if attn_weights is not None:
                ones = torch.ones(b, h, nq, self.kv_bucket_size, device=q.device)
                parts.place(terms.k_pos.expand(b, h, nq, -1), ones)
        out = self._attend(bq, parts, attn_weights, k.shape[2])
        return out.reshape(b, h, lq, d)

    def excludes_own(self) -> bool:
        """Whether a query bucket's own key bucket is no routing choice: it is attended anyway (self-attention),
        unless route_own_bucket."""
        return self.include_own and not self.route_own_bucket

    def _scores(self, q_sums, k_sums, terms: SortTerms):
        """The sort net -> scores [b, h, 1 or nq, nk] (float32) and how many key buckets are chosen (which may be:
        `terms.valid`).

        SortCut: one summary of all queries scores the key buckets (one row). Otherwise per query bucket: the
        attention sort net (mean query . mean key / sqrt(d)) or the simple one (relu(W [sum q; sum k]) scores key
        positions directly); Sinkhorn balancing leaves query buckets of padding alone out; a bucket's own key
        bucket is no choice when it is attended anyway (unless route_own_bucket)."""
        d, nk = q_sums.shape[-1], k_sums.shape[2]
        q_counts, k_counts = terms.q_counts, terms.k_counts
        if self.n_sortcut > 0:
            summary = q_sums.sum(2, keepdim=True) / q_counts.sum(1).clamp_min(1)[:, None, None, None]
            scores = routing_matmul(summary, (k_sums / k_counts.clamp_min(1)[:, None, :, None]).transpose(-1, -2))
            return scores * d**-0.5, min(self.n_sortcut, nk)
        if self.sort_net is not None:
            feats = torch.cat([q_sums, k_sums], dim=-1)  # [b, h, n, 2d] (self-attention: nq == nk)
            scores = F.relu(routing_einsum("bhne,hem->bhnm", feats, self.sort_net))[..., :nk]
            if self.simple_scores == "log_relu":
                scores = torch.log(scores + 1e-6)
        else:
            sq = q_sums / q_counts.clamp_min(1)[:, None, :, None]
            sk = k_sums / k_counts.clamp_min(1)[:, None, :, None]
            scores = routing_matmul(sq, sk.transpose(-1, -2)) * d**-0.5  # [b, h, nq, nk]
        return scores, min(self.n_top, nk - 1 if self.excludes_own() else nk)

    def _add_chosen(self, parts, bucketed, idx, picked_valid, scale, terms: SortTerms, nq: int, attn_weights) -> None:
        """The chosen key buckets (`bucketed`: keys, values [b, h, nk, Bk, d], mask [b, nk, Bk]; idx [b, h, 1 or nq,
        n_sel]) as every query bucket's keys; values (and keys with weight_routed_keys) times the routing weight or
        its straight-through scale. output_attentions: their columns and factors, and the routing."""
        bk, bv, bkm = bucketed
        b, h, rows, n_sel = idx.shape  # rows: 1 with SortCut (shared by every query bucket), else nq
        d = bk.shape[-1]
        bi, hi = terms.index
        routed_k = bk[bi, hi, idx]  # [b, h, 1 or nq, n_sel, Bk, d]
        routed_v = bv[bi, hi, idx]
        if scale is not None:
            routed_v = routed_v * scale[..., None, None].to(bv.dtype)
            if self.weight_routed_keys:
                routed_k = routed_k * scale[..., None, None].to(bk.dtype)
        routed_m = bkm[bi, idx] & picked_valid[..., None]  # [b, h, 1 or nq, n_sel, Bk]
        if self.n_sortcut > 0 and self.include_own and not self.route_own_bucket:
            # a query bucket already attends its own bucket: drop it from the shared choice
            routed_m = routed_m & (idx[..., None] != terms.own[None, None, :, None, None])
        parts.add(
            routed_k.reshape(b, h, rows, -1, d).expand(b, h, nq, -1, d),
            routed_v.reshape(b, h, rows, -1, d).expand(b, h, nq, -1, d),
            routed_m.reshape(b, h, routed_m.shape[2], -1).expand(b, h, nq, -1),
        )
        if attn_weights is None:
            return
        weight = torch.ones_like(idx, dtype=torch.float32) if scale is None else scale.float()
        factor = weight[..., None].expand(*idx.shape, self.kv_bucket_size).reshape(b, h, rows, -1)
        parts.place(terms.k_pos[idx].reshape(b, h, rows, -1).expand(b, h, nq, -1), factor.expand(b, h, nq, -1))
        # the routing: each query bucket's chosen key buckets (-1 where a pick is masked out) and weights
        shown = routed_m.any(-1).expand(b, h, nq, n_sel)
        attn_weights["route"] = idx.expand(b, h, nq, n_sel).masked_fill(~shown, -1)
        attn_weights["route_weight"] = weight.expand(b, h, nq, n_sel).masked_fill(~shown, 0.0)

    def _attend(self, bq, parts, attn_weights, key_length: int):
        """Attention of each query bucket [b, h, nq, B, d] over its keys (`parts`) -> [b, h, nq, B, d]."""
        keys = torch.cat(parts.keys, dim=3)  # [b, h, nq, K, d]
        values = torch.cat(parts.values, dim=3)
        attn_mask = torch.cat(parts.mask, dim=3)[:, :, :, None, :]  # [b, h, nq, 1, K]
        p = self.dropout if self.training else 0.0
        want = attn_weights is not None
        if self.include_own:  # a real query always sees itself: an additive mask is enough
            bias = additive(attn_mask, bq.dtype)
            out = attend_buckets(bq, keys, values, None, p, self.implementation, bias=bias, return_weights=want)
        else:  # cross-attention: a row may see no context at all and must then give zeros
            out = attend_buckets(bq, keys, values, attn_mask, p, self.implementation, return_weights=want)
        if want:
            out, probs = out
            key_pos, factor = torch.cat(parts.pos, dim=3), torch.cat(parts.factor, dim=3)
            attn_weights["map"] = token_weights(probs, key_pos, factor, key_length)
        return out


class _KeyParts:
    """The pieces of each query bucket's keys, concatenated along the key dim: keys, values [b, h, nq, K_i, d],
    mask [b, h, nq, K_i] and, for output_attentions, their columns in the map and value factors."""

    def __init__(self):
        self.keys, self.values, self.mask, self.pos, self.factor = [], [], [], [], []

    def add(self, keys, values, mask) -> None:
        self.keys.append(keys)
        self.values.append(values)
        self.mask.append(mask)

    def place(self, pos, factor) -> None:
        self.pos.append(pos)
        self.factor.append(factor)


class _Bank(NamedTuple):
    """A causal group's routing candidates (see `CausalSinkhornHeads.bucketed`): scores [b, h, n, candidates]
    (float32), which may be chosen (bool, broadcastable to it), how many are chosen, and the bank they are picked
    from: keys, values [b, h, candidates, slots, d], key mask [b, candidates, slots] (self-attention: the null
    buckets, then every key bucket, the own ones included). Self-attention also keeps the key-bucket sums (for the
    cache); cross-attention has none."""

    scores: torch.Tensor
    valid: torch.Tensor
    n_sel: int
    keys: torch.Tensor
    values: torch.Tensor
    mask: torch.Tensor
    k_sums: torch.Tensor | None = None


class CausalDecoding:
    """The causal Sinkhorn heads' side of a cached decoding step (mixed into `CausalSinkhornHeads`): the routing
    choice of one query bucket per row and one token's attention. The cache keeps the routing state
    (`RoutingState`, cache_sinkhorn.py) and answers with summaries and the keys and values to attend; the heads
    choose and attend. Static shapes and no host reads: every step computes a routing choice and keeps it only in
    the rows whose token leads a bucket (torch.where); positions are per-row tensors."""

    def choose(self, sq, sk, valid_real):
        """Routing of one query bucket per row from the query summary sq [b, h, d] over the key-bucket summaries
        sk [b, h, n, d] (valid_real: [b, n] candidates that may be chosen). -> idx, picked_valid, weight (None
        unless weight_routed_values), each [b, h, n_sel]."""
        scores, valid, n_sel = self._step_scores(sq, sk, valid_real)
        idx, picked_valid, weight = self._select(scores, valid, n_sel)
        return idx[:, :, 0], picked_valid[:, :, 0], weight[:, :, 0] if self.weight_routed_values else None

    def _step_scores(self, sq, sk, valid_real):
        """`choose`'s candidates: the null buckets, then the key buckets -> scores [b, h, 1, n_null + n], which may
        be chosen (bool, broadcastable) and how many are chosen."""
        b, h, d = sq.shape
        column = sq[..., None] * d**-0.5  # [b, h, d, 1]
        if self.zero_null_score:
            null_scores = sq.new_zeros(b, h, self.n_top, 1)
        else:
            null_scores = routing_matmul(self.null_keys, column)  # [b, h, n_null, 1]
        scores = torch.cat([null_scores, routing_matmul(sk, column)], dim=2).transpose(-1, -2)
        nulls = torch.ones(b, self.n_top, dtype=torch.bool, device=sq.device)
        return scores, torch.cat([nulls, valid_real], dim=-1)[:, None, None, :], self.n_top

    def _route(self, state, position, real, u, context=None) -> None:
        """Rows whose real token (`real` [b]) at `position` [b] leads a bucket choose that bucket's key buckets, from
        the running query mean and the key-bucket summaries the cache keeps (cross-attention: the context's)."""
        sq = state.query_summary(position, real)  # [b, h, d]
        if context is None:
            sk, k_valid = state.key_summaries(u, position + real.long())
        else:
            sk, k_valid = context["sk"], context["k_valid"]
        lead = real & ((position + self.offset) % self.bucket_size == 0)
        state.keep_route(lead, *self.choose(sq, sk, k_valid))

    def step(self, q, k, v, keys, values, heads, step, state):
        """Causal self-attention of one new token per row (q, k, v: [b, h, 1, d]; step: the cache's DecodingStep,
        positions [b] and real [b]). keys/values: the layer's bank [b, H, S, d], the new token already written;
        for this group's `heads` it holds, as whole buckets from slot `1 - offset` on, the null buckets then the
        row's real tokens (see `SinkhornLayerState`): the bucket bank of `bucketed`, so the chosen buckets and the
        own bucket are picked by index, one block copy each. state: this group's `RoutingState`.

        Attention over the chosen buckets of the current query bucket and the own bucket up to the token: at most
        (n_top + 1) * bucket_size keys. A host-following step (see `SinkhornCache`) routes only when some row
        starts a bucket, and the cache reuses the last step's window otherwise."""
        ix = state.step_index(step)
        state.add_token(q, k, step.position, ix)
        routes = step.routes if step.host is None else state.any_row_leads(step.host)
        if routes:
            self._route(state, step.position, ix["counted"], ix["u"])
        keys_all, values_all, bias = state.window((keys, values), heads, step, ix, (k, v), routes, q.dtype)
        return attend(q, keys_all, values_all, bias=bias, implementation=self.implementation)


class CausalSinkhornHeads(CausalDecoding, nn.Module):
    """Causal Sinkhorn attention for a slice of heads whose buckets start at `offset` tokens before the usual ones
    (offset 0: ordinary buckets; offset 1: buckets shifted by bucket_size - 1, the reference's rotated heads).

    Query bucket u chooses `n_top` candidates among `n_top` learned null buckets and the strictly earlier,
    non-empty key buckets, from the cumulative mean of the queries up to its leading token. A null bucket is one
    learned key/value per head; the query bucket attends the chosen buckets and, causally, its own bucket. A
    causal decoder's cross-attention is `CausalContextHeads`.
    """

    cross = False  # (CausalContextHeads: True)

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
        weight_routed_values: bool = False,
        weight_routed_keys: bool = False,
        sequential_weights: bool = False,
        key_summary: str = "mean",
        null_score: str = "learned",
        null_copies: bool = False,
        skip_first_bucket: bool = False,
        routing_gradient: str = "values",
    ):
        super().__init__()
        self.weight_routed_values, self.attention_gradient = weight_routed_values, routing_gradient == "attention"
        self.weight_routed_keys, self.sequential_weights = weight_routed_keys, sequential_weights
        # self-attention routing variants (see SinkhornConfig: causal_key_summary, causal_null_score,
        # null_bucket_copies, shifted_heads_skip_first_bucket)
        self.running_key_summary, self.zero_null_score = key_summary == "running_mean_sum", null_score == "zero"
        self.null_copies, self.skip_first = null_copies, skip_first_bucket and offset > 0
        self.num_heads, self.head_dim, self.bucket_size = num_heads, head_dim, bucket_size
        self.n_top, self.offset = n_top, offset
        self.temperature, self.dropout, self.implementation = temperature, dropout, implementation
        if not self.cross:
            self.null_keys = nn.Parameter(torch.empty(num_heads, n_top, head_dim))
            self.null_values = nn.Parameter(torch.empty(num_heads, n_top, head_dim))

    # -- full sequence -----------------------------------------------------------------------------------------

    def forward(self, q, k, v, mask, k_mask=None, record=None, attn_weights=None, first: int = 0):
        """q, k, v: [b, h, L, d] (L a multiple of bucket_size); mask: [b, L] real query tokens;
        k_mask: context mask for cross-attention (self-attention uses `mask`). `record`: a dict that receives
        what the generation cache needs; `attn_weights`: one that receives the attention map and the routing.
        `first`: a chunk's first token; the outputs of the query buckets before its bucket are not computed (zeros)."""
        size, off = self.bucket_size, self.offset
        length = q.shape[2]
        if off:
            # shift by one: the first bucket holds a virtual token plus tokens 0 .. size-2
            q, k, v = (F.pad(t, (0, 0, off, size - off)) for t in (q, k, v))
            pad = (off, size - off)
            mask = bucket_mask(mask).terms(("shifted", pad), lambda m: BucketMask(F.pad(m, pad, value=False)))
        null = None if self.cross else (self.null_keys[None], self.null_values[None])
        first = (first + off) // size if first else 0  # (bucket 0 holds only the virtual token when size is 1)
        out = self.bucketed(q, k, v, mask, k_mask, record, null, attn_weights, first)
        if record is not None:
            record["offset"] = off
        if attn_weights is not None:
            trim_weights(attn_weights, off, length, None if self.cross else self.n_top)
        return out[:, :, off : off + length]

    def bucketed(self, q, k, v, mask, k_mask, record, null, attn_weights=None, first: int = 0):
        """The attention over buckets of already shifted inputs (length a multiple of bucket_size), output not
        trimmed. null: (null keys, null values) [b or 1, h, n_null, d] for self-attention, None for cross.
        attn_weights: receives the map [b, h, L, L + n_null] (self-attention: the null buckets' keys in the last
        columns) or [b, h, L, Lk] (cross), and the routing (bucket indices into the bank: null buckets first).

        Steps: the query summaries at each bucket's leading token; the candidate bank and the sort net's scores;
        the routing choice; gathering the chosen buckets; attention (self: chosen buckets plus the own bucket,
        causal); what the generation cache keeps. A chunk (`first` > 0, no record, no maps) gathers and attends
        only the query buckets from `first` on: the routing of every bucket is cheap, attending them is not."""
        b, h, lq, d = q.shape
        bq = q.reshape(b, h, lq // self.bucket_size, self.bucket_size, d)  # [b, h, n, B, d]
        terms = CausalTerms.of(self, mask, q.dtype)  # the same in every layer (see BucketMask)
        q_sums, sq = self._query_summaries(q, bq, terms)
        bank = self._bank(sq, k, v, terms, k_mask, null)
        idx, picked_valid, scale = self._select(bank.scores, bank.valid, bank.n_sel)  # [b, h, n, n_sel]
        if first:  # a chunk's query buckets
            bq, idx, picked_valid, terms = (
                bq[:, :, first:],
                idx[:, :, first:],
                picked_valid[:, :, first:],
                terms.from_bucket(first),
            )
            scale = None if scale is None else scale[:, :, first:]
        # the chosen buckets' keys, values, mask [b, h, n, n_sel * B(, d)]
        routed = self._gather_chosen(bank, idx, picked_valid, scale, terms)
        placed = None
        if attn_weights is not None:
            placed = self._routed_columns(bank, idx, picked_valid, scale, lq, attn_weights)
        out = self._attend(bq, routed, bank, terms, placed, attn_weights, k.shape[2])
        if record is not None:
            self._record(record, q_sums, terms.counted, idx, picked_valid, scale, bank, k)
        out = out.reshape(b, h, -1, d)
        return F.pad(out, (0, 0, first * self.bucket_size, 0)) if first else out  # (a zero pad would copy)

    def _query_summaries(self, q, bq, terms: CausalTerms):
        """-> the per-bucket query sums [b, h, n, d] of the counted tokens and, per bucket, the mean of the queries
        up to its leading token (inclusive) [b, h, n, d]: what the bucket's routing may depend on."""
        q_sums = weighted_sums(q, terms.weights)  # [b, h, n, d]
        lead_q = bq[:, :, :, 0].float() * terms.lead_real[:, None, :, None]  # leading tokens [b, h, n, d]
        lead_sum = earlier_sums(q_sums, terms.before) + lead_q  # queries summed up to each leading token (inclusive)
        return q_sums, lead_sum / terms.lead_count[:, None, :, None]

    def _bank(self, sq, k, v, terms: CausalTerms, k_mask, null) -> _Bank:
        """Self-attention: the candidates are the null buckets (the learned key in every slot, all but slot 0
        masked unless null_copies), then the strictly earlier, non-empty key buckets."""
        size, n_null = self.bucket_size, self.n_top
        b, h, length, d = k.shape
        n = length // size
        bk, bv = k.reshape(b, h, n, size, d), v.reshape(b, h, n, size, d)
        k_sums = weighted_sums(k, terms.weights)
        if self.running_key_summary:
            # each key bucket: the sum over its tokens of the running mean of all keys so far
            c = terms.weights.view(b, 1, length, 1)
            running = running_sums(k.float() * c, size, terms.within, terms.before) / terms.running_counts
            k_sums = (running * c).view(b, h, n, size, d).sum(3)  # [b, h, n, d]
            sk = k_sums
        else:
            sk = k_sums / terms.counts.clamp_min(1)[:, None, :, None]
        null_keys, null_values = null
        if self.zero_null_score:
            null_scores = sq.new_zeros(b, h, n, n_null)
            scores = torch.cat([null_scores, routing_matmul(sq, sk.transpose(-1, -2))], dim=-1) * d**-0.5
        else:  # the null keys and the key summaries scored in one product
            summaries = torch.cat([null_keys.expand(b, -1, -1, -1).to(sk.dtype), sk], dim=2)  # [b, h, n_null + n, d]
            scores = routing_matmul(sq, summaries.transpose(-1, -2)) * d**-0.5
        null_k = null_keys[:, :, :, None].expand(-1, -1, -1, size, -1).to(k.dtype).expand(b, -1, -1, -1, -1)
        null_v = null_values[:, :, :, None].expand(-1, -1, -1, size, -1).to(v.dtype).expand(b, -1, -1, -1, -1)
        return _Bank(
            scores=scores,
            valid=terms.valid,
            n_sel=n_null,
            keys=torch.cat([null_k, bk], dim=2),  # [b, h, n_null + n, B, d]
            values=torch.cat([null_v, bv], dim=2),
            mask=terms.bank_mask,  # [b, n_null + n, B]
            k_sums=k_sums,
        )

    def _gather_chosen(self, bank: _Bank, idx, picked_valid, scale, terms: CausalTerms):
        """The chosen buckets' keys, values [b, h, n, n_sel * B, d] (values, and keys with weight_routed_keys,
        times the routing weight or its straight-through scale; self-attention: the own bucket after them, picked in
        the same copy: [b, h, n, (n_sel + 1) * B, d]), the chosen buckets' key mask [b, h, n, n_sel * B] and, with
        routing_gradient="attention", the straight-through log-scale for the attention logits (else None)."""
        b, h, n, _ = idx.shape
        d = bank.keys.shape[-1]
        bi, hi = terms.index
        picks = idx
        if not self.cross:  # the own bucket u is bank bucket n_null + u
            picks = torch.cat([idx, terms.own[:, None].expand(b, h, n, 1)], dim=-1)
        routed_k = bank.keys[bi, hi, picks]  # [b, h, n, n_sel (+ 1), B, d]
        routed_v = bank.values[bi, hi, picks]
        log_scale = None
        if scale is not None and self.attention_gradient:  # zeros added to the logits, d/d log weight backward
            log_scale = scale.log()[..., None].expand(*idx.shape, routed_k.shape[4]).reshape(b, h, n, -1)
        elif scale is not None:
            scale = scale if picks is idx else F.pad(scale, (0, 1), value=1.0)  # (the own bucket: weight 1)
            routed_v = routed_v * scale[..., None, None].to(routed_v.dtype)
            if self.weight_routed_keys:
                routed_k = routed_k * scale[..., None, None].to(routed_k.dtype)
        routed_k = routed_k.reshape(b, h, n, -1, d)
        routed_v = routed_v.reshape(b, h, n, -1, d)
        routed_m = (bank.mask[bi, idx] & picked_valid[..., None]).reshape(b, h, n, -1)  # [b, h, n, n_sel * B]
        return routed_k, routed_v, routed_m, log_scale

    def _routed_columns(self, bank: _Bank, idx, picked_valid, scale, lq: int, attn_weights: dict):
        """output_attentions: each chosen slot's column in the map [b, h, n, n_sel * B] (bank bucket j's slot s is
        token j * B + s; self-attention: the null buckets, first in the bank, are the columns after the tokens)
        and the factor its value was multiplied by; the routing goes to `attn_weights`."""
        b, h, n, _ = idx.shape
        nb, slots = bank.keys.shape[2], bank.keys.shape[3]
        bank_pos = self._bank_columns(nb, slots, bank.n_sel, lq, idx.device)
        routed_pos = bank_pos[idx].reshape(b, h, n, -1)  # [b, h, n, n_sel * B]
        weight = torch.ones_like(idx, dtype=torch.float32) if scale is None else scale.float()
        routed_factor = weight[..., None].expand(*idx.shape, slots).reshape(b, h, n, -1)
        attn_weights["route"] = idx.masked_fill(~picked_valid, -1)
        attn_weights["route_weight"] = weight.masked_fill(~picked_valid, 0.0)
        return routed_pos, routed_factor

    def _bank_columns(self, nb: int, slots: int, n_sel: int, lq: int, device) -> torch.Tensor:
        """Each bank slot's column in the attention map [nb, slots]: the null buckets (first in the bank) are the
        columns after the `lq` tokens, the key buckets' slots their tokens."""
        size = self.bucket_size
        return torch.cat(
            [
                (lq + torch.arange(n_sel, device=device))[:, None].expand(-1, size),
                torch.arange(lq, device=device).view(lq // size, size),
            ]
        )  # [n_null + n, B]

    def _attend(self, bq, routed, bank: _Bank, terms: CausalTerms, placed, attn_weights, key_length: int):
        """Self-attention over the chosen buckets and the own bucket up to each query -> [b, h, n, B, d]."""
        keys, values, routed_m, log_scale = routed  # keys, values [b, h, n, (n_sel + 1) B, d]: the own bucket last
        b, h, n, size, _ = bq.shape
        # every row sees at least one key (each pick is a valid null or non-empty bucket), so the mask is
        # built additive from its two small pieces: one pass over the full [b, h, n, B, K] tensor
        routed_bias = additive(routed_m, bq.dtype)
        if log_scale is not None:
            routed_bias = routed_bias + log_scale.to(bq.dtype)
        bias = torch.cat(
            [
                routed_bias[:, :, :, None, :].expand(b, h, n, size, -1),
                terms.own_bias.expand(b, h, n, size, size),
            ],
            dim=-1,
        )
        want = attn_weights is not None
        out = attend_buckets(bq, keys, values, None, self._p(), self.implementation, bias=bias, return_weights=want)
        if want:
            out, probs = out
            routed_pos, routed_factor = placed
            own_pos = torch.arange(n * size, device=bq.device).view(1, 1, n, size).expand(b, h, n, size)
            key_pos = torch.cat([routed_pos, own_pos], dim=3)
            factor = torch.cat([routed_factor, routed_factor.new_ones(b, h, n, size)], dim=3)
            attn_weights["map"] = token_weights(probs, key_pos, factor, n * size + bank.n_sel)
        return out

    def _p(self) -> float:
        return self.dropout if self.training else 0.0

    def _record(self, record, q_sums, counted, idx, picked_valid, scale, bank: _Bank, k) -> None:
        """What the generation cache keeps of a full pass (see `SinkhornLayerState.fill_self` / `fill_cross`)."""
        record["q_sum"] = q_sums.sum(2)  # [b, h, d]
        record["route"] = idx  # [b, h, n, n_sel]: the cache keeps the row of the current bucket
        record["route_valid"] = picked_valid
        record["route_weight"] = scale.detach() if self.weight_routed_values else None  # [b, h, n, n_sel]
        if not self.cross:
            record["k_sum"] = bank.k_sums  # [b, h, n, d] (running_key_summary: the summaries themselves)
            if self.running_key_summary:
                record["k_run_sum"] = (k.float() * counted[:, None, :, None]).sum(2)  # [b, h, d]

    def _select(self, scores, valid, n_sel):
        """`select_buckets` with this group's routing options (a causal group never runs Sinkhorn balancing)."""
        options = dict(weighted=self.weight_routed_values, sequential=self.sequential_weights)
        return select_buckets(scores, valid, n_sel, self.temperature, **options)


class CausalContextHeads(CausalSinkhornHeads):
    """A causal decoder's cross-attention: query bucket u chooses `n_top` of the context's non-empty buckets (of
    `kv_bucket_size`; no null buckets, no own bucket, no causality constraint on which context bucket may be
    chosen) from the cumulative mean of its queries up to its leading token, as the self-attention heads do."""

    cross = True

    def __init__(
        self, num_heads, head_dim, bucket_size, kv_bucket_size, n_top, temperature, dropout, implementation, **routing
    ):
        super().__init__(num_heads, head_dim, bucket_size, n_top, 0, temperature, dropout, implementation, **routing)
        self.kv_bucket_size = kv_bucket_size

    def _bank(self, sq, k, v, terms, k_mask, null) -> _Bank:
        """Cross-attention: the context buckets are the candidates, any non-empty one may be chosen."""
        b, h, _, d = k.shape
        kv_size = self.kv_bucket_size
        nk = k.shape[2] // kv_size
        k_sums, k_counts = bucket_sums(k, k_mask, kv_size)
        sk = k_sums / k_counts.clamp_min(1)[:, None, :, None]
        scores = routing_matmul(sq, sk.transpose(-1, -2)) * d**-0.5  # [b, h, n, nk]
        return _Bank(
            scores=scores,
            valid=(k_counts > 0)[:, None, None, :],
            n_sel=min(self.n_top, nk),
            keys=k.reshape(b, h, nk, kv_size, d),
            values=v.reshape(b, h, nk, kv_size, d),
            mask=k_mask.view(b, nk, kv_size),
        )

    def _attend(self, bq, routed, bank, terms, placed, attn_weights, key_length: int):
        """Cross-attention over the chosen context buckets -> [b, h, n, B, d]. A row may see no context at all (a
        fully padded context): a bool mask, which gives such rows zeros."""
        routed_k, routed_v, routed_m, _ = routed  # (routing_gradient applies to self-attention)
        want = attn_weights is not None
        out = attend_buckets(
            bq, routed_k, routed_v, routed_m[:, :, :, None, :], self._p(), self.implementation, return_weights=want
        )
        if want:
            out, probs = out
            attn_weights["map"] = token_weights(probs, *placed, key_length)
        return out

    def _bank_columns(self, nb: int, slots: int, n_sel: int, lq: int, device) -> torch.Tensor:
        """Bank bucket j's slot s is context token j * slots + s -> [nb, slots]."""
        return torch.arange(nb, device=device)[:, None] * slots + torch.arange(slots, device=device)

    def _step_scores(self, sq, sk, valid_real):
        """`choose`'s candidates: the context buckets -> scores [b, h, 1, nk], which may be chosen, how many."""
        column = sq[..., None] * sq.shape[-1] ** -0.5  # [b, h, d, 1]
        scores = routing_matmul(sk, column).transpose(-1, -2)  # [b, h, 1, n]
        return scores, valid_real[:, None, None, :], min(self.n_top, sk.shape[2])

    def cross_step(self, q, step, state, context):
        """Causal decoder cross-attention of one new token per row (q [b, h, 1, d]). context: the cached context
        (bucketed keys, values, mask and summaries, see `SinkhornLayerState.fill_cross`)."""
        state.add_query(q, step.position, step.real)
        if step.routes:
            self._route(state, step.position, step.real, None, context)
        keys, values, mask = state.chosen_context(context)
        return attend(q, keys, values, mask, implementation=self.implementation)


def trim_weights(attn_weights: dict, off: int, length: int, n_null: int | None, rows=slice(None)) -> None:
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
    plain: CausalSinkhornHeads, shifted: CausalSinkhornHeads, q, k, v, mask, records=None, attn_weights=None, first=0
):
    """The ordinary and the shifted causal Sinkhorn heads of a layer in ONE pass, with the numbers of two
    `forward` calls and half their kernel launches. The batch is doubled: its first half holds the ordinary heads'
    rows with one empty bucket appended (a later bucket, so never a candidate, and its queries are dropped), its
    second half the shifted heads' rows, padded as in `forward`. Needs equal head counts.

    q, k, v: [b, 2h, L, d] (ordinary heads first); mask: [b, L]; records, attn_weights: None or one dict per
    group; first: a chunk's first token (see `CausalSinkhornHeads.forward`)."""
    size, h, off = plain.bucket_size, plain.num_heads, shifted.offset
    b, _, length, _ = q.shape
    pads = ((0, size), (off, size - off))

    def stack(t):  # [b, 2h, L, d] -> [2b, h, L + size, d]
        return torch.cat([F.pad(part, (0, 0, *pad)) for part, pad in zip(t.split(h, dim=1), pads)])

    masks = bucket_mask(mask).terms(  # [2b, L + size]
        ("pair", pads), lambda m: BucketMask(torch.cat([F.pad(m, pad, value=False) for pad in pads]))
    )
    null = tuple(
        torch.stack([getattr(plain, name), getattr(shifted, name)])[:, None]
        .expand(-1, b, -1, -1, -1)
        .reshape(2 * b, h, plain.n_top, -1)
        for name in ("null_keys", "null_values")
    )  # each group's null buckets for its rows
    record = {} if records is not None else None
    both = {} if attn_weights is not None else None
    first = first // size  # the first query bucket of either half (the shifted heads' may be one later)
    out = plain.bucketed(stack(q), stack(k), stack(v), masks, None, record, null, both, first)  # [2b, h, L + size, d]
    if attn_weights is not None:
        for half, group, target in ((slice(0, b), plain, attn_weights[0]), (slice(b, 2 * b), shifted, attn_weights[1])):
            target.update(both)
            trim_weights(target, group.offset, length, group.n_top, half)
        n = length // size  # the ordinary heads' appended empty bucket has no routing
        attn_weights[0]["route"] = attn_weights[0]["route"][:, :, :n]
        attn_weights[0]["route_weight"] = attn_weights[0]["route_weight"][:, :, :n]
    if records is not None:
        for half, group, target in ((slice(0, b), plain, records[0]), (slice(b, 2 * b), shifted, records[1])):
            target.update({key: val if val is None else val[half] for key, val in record.items()})
            target["offset"] = group.offset
    # [b, 2h, L, d] laid out as [b, L, 2h, d]: the projection back reads it without a copy
    halves = (out[:b, :, :length], out[b:, :, off : off + length])
    return torch.cat([half.transpose(1, 2) for half in halves], dim=2).transpose(1, 2)
