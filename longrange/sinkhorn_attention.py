"""The Sinkhorn model's attention layers: projections plus head groups (`sinkhorn_heads.py`).

Self-attention splits its heads into groups, each a contiguous slice: [local | Sinkhorn] (causal: [local |
ordinary | shifted]). A full-sequence call runs every group (the two causal Sinkhorn groups in one `causal_pair`
pass when they can) and hands what the generation cache needs to the layer's cache; a decoding step asks the
cache for the bank of cached keys/values with the new token written (`SinkhornLayerState.update`) and lets each
group attend one token. Several new tokens on a filled cache (a chunk) are written to the cache and attend as in
a full-sequence call over every token so far, which the cache holds. Cross-attention attends a bucketed context
(`encoder_hidden_states`).

Only same-folder relative imports: `save_pretrained` copies this file next to the weights.
"""

from __future__ import annotations

from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn

from .configuration_sinkhorn import SinkhornConfig
from .layers import ATTENTION_IMPLEMENTATIONS, merge_heads, unit_output
from .sinkhorn_heads import CausalContextHeads, CausalSinkhornHeads, LocalHeads, SinkhornHeads, causal_pair
from .sinkhorn_routing import BucketMask


def attention_implementation(config: SinkhornConfig) -> str:
    """The attention implementation of every head group, read from `config._attn_implementation` when the model is
    built (transformers resolves it, from `attn_implementation=` or the config, before the modules exist; unset =
    "sdpa" on every device).

    "sdpa": `torch.nn.functional.scaled_dot_product_attention`, fused kernels on CUDA and on the CPU (where it is
    at least as fast as "eager" on the benchmark's 128 x 384 bucket blocks, forward and backward); "eager": the
    explicit softmax(q k^T / sqrt(d) + mask) v, the same numbers."""
    impl = getattr(config, "_attn_implementation", None) or "sdpa"
    if impl not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(unsupported_attention(impl))
    return impl


def unsupported_attention(impl) -> str:
    return (
        f'Specified `attn_implementation="{impl}"` is not supported by Sinkhorn; allowed values: '
        f"{', '.join(repr(name) for name in ATTENTION_IMPLEMENTATIONS)} (bucketed attention runs through "
        "scaled_dot_product_attention or the explicit softmax; flash and flex attention are not available)"
    )


def _routing_options(config: SinkhornConfig) -> dict:
    return dict(
        weight_routed_values=config.weight_routed_values,
        weight_routed_keys=config.weight_routed_keys,
        sequential_weights=config.sequential_routing_weights,
    )


def _causal_heads(config: SinkhornConfig, count: int, offset: int, impl: str) -> CausalSinkhornHeads:
    """A causal Sinkhorn group: ordinary buckets (offset 0) or buckets shifted by bucket_size - 1 (offset 1)."""
    return CausalSinkhornHeads(
        count,
        config.head_dim,
        config.bucket_size,
        config.n_top_buckets,
        offset,
        config.sort_temperature,
        config.attn_dropout,
        impl,
        key_summary=config.causal_key_summary,
        null_score=config.causal_null_score,
        null_copies=config.null_bucket_copies,
        skip_first_bucket=config.shifted_heads_skip_first_bucket,
        routing_gradient=config.routing_gradient,
        **_routing_options(config),
    )


def _sinkhorn_heads(config: SinkhornConfig, count: int, impl: str) -> SinkhornHeads:
    """The non-causal Sinkhorn group (self-attention: own bucket included)."""
    size = config.bucket_size
    return SinkhornHeads(
        count,
        config.head_dim,
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
    )


def at_slots(out: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
    """The rows [b, H, L, d] of out [b, H, T, d] at each row's slots [b, L] (a chunk's tokens, see `_chunk`)."""
    b, h, _, d = out.shape
    return out.gather(2, slot[:, None, :, None].expand(b, h, slot.shape[1], d))


def _head_groups(config: SinkhornConfig) -> list[tuple[nn.Module, int]]:
    """(group, head count) in head order, groups without heads left out: local heads, then the Sinkhorn heads
    (causal: half ordinary, the other half, one more when odd, shifted)."""
    impl = attention_implementation(config)
    n_local = config.n_local_attn_heads
    n_sink = config.num_attention_heads - n_local
    groups = [(LocalHeads(n_local, config.bucket_size, config.causal, config.attn_dropout, impl), n_local)]
    if config.causal:
        n_plain = n_sink // 2
        groups += [(_causal_heads(config, n, offset, impl), n) for n, offset in ((n_plain, 0), (n_sink - n_plain, 1))]
    else:
        groups.append((_sinkhorn_heads(config, n_sink, impl), n_sink))
    return [(group, count) for group, count in groups if count > 0]


def _runs(groups: nn.ModuleList) -> list[list[int]]:
    """Runs of groups computed together: the two causal Sinkhorn groups in one `causal_pair` pass when their head
    counts are equal (an odd number of Sinkhorn heads runs them one after the other) and the shifted heads route
    like the ordinary ones (not with shifted_heads_skip_first_bucket); every other group alone."""
    runs = [[i] for i in range(len(groups))]
    causal = [i for i, g in enumerate(groups) if isinstance(g, CausalSinkhornHeads)]
    if len(causal) == 2 and len({groups[i].num_heads for i in causal}) == 1 and not groups[causal[1]].skip_first:
        runs = [run for run in runs if run[0] not in causal] + [causal]
    return runs


class _Projections(nn.Module):
    """What self- and cross-attention share: queries from the hidden states, keys and values (one product) from
    what they attend, split into heads; the heads' outputs projected back to the hidden size."""

    def __init__(self, config: SinkhornConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        inner = self.num_heads * self.head_dim
        self.to_q = nn.Linear(config.hidden_size, inner, bias=False)
        self.to_kv = nn.Linear(config.hidden_size, 2 * inner, bias=False)
        self.to_out = nn.Linear(inner, config.hidden_size)

    def _heads(self, x: torch.Tensor) -> torch.Tensor:
        b, length, _ = x.shape
        return x.view(b, length, -1, self.head_dim).transpose(1, 2)  # [b, H, L, d]

    def _keys_values(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(self._heads(t) for t in self.to_kv(x).chunk(2, dim=-1))  # [b, H, L, d] each

    def _output(self, out: torch.Tensor) -> torch.Tensor:
        """The heads' outputs [b, H, L, d] -> [b, L, e]."""
        return unit_output(self, self.to_out(merge_heads(out)))


class SinkhornSelfAttention(_Projections):
    """Projections plus the head groups: [local heads | Sinkhorn heads] (causal: [local | ordinary | shifted])."""

    def __init__(self, config: SinkhornConfig):
        super().__init__(config)
        groups = _head_groups(config)
        self.groups = nn.ModuleList(group for group, _ in groups)
        ends = accumulate(count for _, count in groups)
        self.slices = [(end - count, end) for (_, count), end in zip(groups, ends)]  # each group's heads
        self.runs = _runs(self.groups)

    def forward(self, hidden_states, attention_mask, layer_cache=None, attn_weights=None):
        """hidden_states [b, L, e] -> [b, L, e]. attn_weights (output_attentions): a dict that receives, over all
        heads, "map" [b, H, L, L] (each query's attention weights at its keys' positions, routed values' weights
        included), "null" [b, H, L, n_top] (causal: the weight on each null bucket's key; None for non-causal
        models), "route" / "route_weight" [b, H, query buckets, n_chosen] (chosen key buckets in each head's bucket
        grid, -1 for none or a null bucket; 0-weight where nothing is chosen) and "offset" [H] (head h's bucket u
        starts at token u * bucket_size - offset[h])."""
        q = self._heads(self.to_q(hidden_states))  # [b, H, L, d]
        k, v = self._keys_values(hidden_states)
        if layer_cache is not None and layer_cache.is_stepping:
            step = self._step if layer_cache.chunk is None else self._chunk
            return self._output(step(q, k, v, layer_cache))
        return self._output(self._full(q, k, v, attention_mask, layer_cache, attn_weights))

    def _full(self, q, k, v, mask, layer_cache, attn_weights, first: int = 0):
        """Every group over the whole sequence (q, k, v [b, H, L, d]) -> [b, H, L, d]; the groups' records go to
        the cache (a prefill), their maps and routing to `attn_weights`."""
        records = [None] * len(self.groups) if layer_cache is None else [{} for _ in self.groups]
        looks = [None] * len(self.groups) if attn_weights is None else [{} for _ in self.groups]
        outs = []
        for run in self.runs:
            s, e = self.slices[run[0]][0], self.slices[run[-1]][1]
            if len(run) == 2:
                pair_records = None if layer_cache is None else [records[i] for i in run]
                pair_looks = None if attn_weights is None else [looks[i] for i in run]
                plain, shifted = (self.groups[i] for i in run)
                qs, ks, vs = q[:, s:e], k[:, s:e], v[:, s:e]
                outs.append(causal_pair(plain, shifted, qs, ks, vs, mask, pair_records, pair_looks, first))
            else:
                group, i = self.groups[run[0]], run[0]
                chunk = {"first": first} if first and not isinstance(group, LocalHeads) else {}  # (local: all, cheap)
                qs, ks, vs = q[:, s:e], k[:, s:e], v[:, s:e]
                outs.append(group(qs, ks, vs, mask, record=records[i], attn_weights=looks[i], **chunk))
        if layer_cache is not None:
            layer_cache.fill_self(q, k, v, records, self.groups, self.slices)
        if attn_weights is not None:
            attn_weights.update(self._gather_weights(looks, q.shape[2]))
        return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)

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

    def _chunk(self, q, k, v, layer_cache):
        """Several new tokens per row (q, k, v [b, H, L, d]) on a filled cache -> [b, H, L, d]: the cache keeps the
        queries, keys and values of every token so far, so the new tokens attend as in a forward over all of them
        (one pass, exact), and the routing state follows from the cached queries and keys (as after `crop`)."""
        q_all, k_all, v_all, mask = layer_cache.write_chunk(q, k, v)
        out = self._full(q_all, k_all, v_all, BucketMask(mask), None, None, layer_cache.chunk.first)  # [b, H, T, d]
        layer_cache.rebuild(layer_cache.chunk.lengths, layer_cache.chunk.length, cross=False)
        return at_slots(out, layer_cache.chunk.slot)

    def _step(self, q, k, v, layer_cache):
        """One new token per row (q, k, v [b, H, 1, d]) on a filled cache -> [b, H, 1, d]."""
        keys, values, step = layer_cache.update(k, v)  # [b, H, slots, d] each, the new token written
        outs = []
        for group, (s, e), state in zip(self.groups, self.slices, layer_cache.groups):
            heads = slice(s, e)
            if isinstance(group, LocalHeads):
                outs.append(group.step(q[:, s:e], keys, values, heads, step.position, step.origin))
            else:
                outs.append(group.step(q[:, s:e], k[:, s:e], v[:, s:e], keys, values, heads, step, state))
        return torch.cat(outs, dim=1)


class SinkhornCrossAttention(_Projections):
    """Attention from the decoder to `encoder_hidden_states` (the seed's `context`), bucketed with
    `context_bucket_size`. Causal decoders route per query bucket from its leading token; non-causal models use
    SortCut (`context_n_sortcut`) or per-bucket routing over the context buckets."""

    def __init__(self, config: SinkhornConfig):
        super().__init__(config)
        self.causal = config.causal
        impl = attention_implementation(config)
        if config.causal:
            self.heads = CausalContextHeads(
                self.num_heads,
                self.head_dim,
                config.bucket_size,
                config.context_bucket,
                config.context_top,
                config.sort_temperature,
                config.attn_dropout,
                impl,
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

    def forward(self, hidden_states, attention_mask, context, context_mask, layer_cache=None, attn_weights=None):
        """hidden_states [b, L, e], context [b, Lc, e] -> [b, L, e]. attn_weights: a dict that receives "map"
        [b, H, L, context length]. A decoding step reads the context from the cache, which a prefill filled."""
        q = self._heads(self.to_q(hidden_states))
        if layer_cache is not None and layer_cache.is_stepping and layer_cache.chunk is not None:
            q_all, mask, k, v, k_mask = layer_cache.chunk_context(q)  # as SinkhornSelfAttention._chunk
            out = at_slots(self.heads(q_all, k, v, BucketMask(mask), k_mask=k_mask), layer_cache.chunk.slot)
            layer_cache.rebuild(layer_cache.chunk.lengths, layer_cache.chunk.length, cross=True)
        elif layer_cache is not None and layer_cache.is_stepping:
            out = self.heads.cross_step(q, layer_cache.step, layer_cache.cross_state, layer_cache.context)
        else:
            k, v = self._keys_values(context)  # [b, H, Lc, d]
            if self.causal:
                record = {} if layer_cache is not None else None
                out = self.heads(q, k, v, attention_mask, k_mask=context_mask, record=record, attn_weights=attn_weights)
                if layer_cache is not None:
                    layer_cache.fill_cross(q, k, v, context_mask, record, self.heads)
            else:
                out = self.heads(q, k, v, attention_mask, context_mask, attn_weights=attn_weights)
        return self._output(out)
