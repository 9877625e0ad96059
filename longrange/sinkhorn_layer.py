"""The Sinkhorn model's layer: pre-norm branches (attention, feed-forward or product-key memory, cross-attention)
and the layer that runs them as residual pairs, how `weight_tie` shares layer 0's modules with the others, and the
axial position embedding.

The reversible stack (`reversible.py`) runs the same (f, g) pairs (`SinkhornLayer.blocks`) as two streams.

Only same-folder relative imports: `save_pretrained` copies this file next to the weights.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer

from .configuration_sinkhorn import SinkhornConfig
from .layers import FeedForward, unit_output
from .product_key_memory import ProductKeyMemory
from .sinkhorn_attention import SinkhornCrossAttention, SinkhornSelfAttention


class AttentionBlock(nn.Module):
    """Pre-norm self-attention branch f(x) (the residual is added by the caller or the reversible stack)."""

    attention_class = SinkhornSelfAttention

    def __init__(self, config: SinkhornConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.attention = self.attention_class(config)
        self.dropout = nn.Dropout(config.attn_layer_dropout)

    def forward(self, hidden_states, attention_mask=None, layer_cache=None, attn_weights=None, **unused):
        return self.dropout(self.attention(self.norm(hidden_states), attention_mask, layer_cache, attn_weights))


class CrossAttentionBlock(AttentionBlock):
    """Pre-norm cross-attention branch: the same block, attending the context."""

    attention_class = SinkhornCrossAttention

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
        return unit_output(self, self.net(x))


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


def build_layers(config: SinkhornConfig) -> tuple[nn.ModuleList, nn.ModuleDict | None, list[str]]:
    """The model's layers -> (layers, product-key blocks or None, module classes that must be FSDP units of their
    own). Product-key layers (`pkm_layers`, counted from 1) hold a memory in place of the feed-forward.

    weight_tie: as in the reference, the layers share layer 0's attention and feed-forward weights (and
    cross-attention ones), each keeping its own LayerNorms (see `_tie_to_first`); product-key memories stay apart,
    in `pkm_blocks`. Per-layer FSDP units (`_no_split_modules`) would not gather the shared modules for the layers
    that call them but do not hold them: those modules are units of their own (with a product-key layer 1, layer
    0's whole feed-forward block is shared)."""
    pkm = set(config.pkm_layers)
    if not config.weight_tie:
        layers = nn.ModuleList([SinkhornLayer(config, use_pkm=i + 1 in pkm) for i in range(config.num_hidden_layers)])
        return layers, None, []
    layers = nn.ModuleList([SinkhornLayer(config, use_pkm=False) for _ in range(config.num_hidden_layers)])
    pkm_blocks = nn.ModuleDict({str(i): FeedForwardBlock(config, use_pkm=True) for i in sorted(pkm)})
    for depth in range(1, config.num_hidden_layers):
        _tie_to_first(layers, depth, config)
    shared = ["SinkhornSelfAttention", "FeedForward"]
    shared += ["SinkhornCrossAttention"] if config.receives_context else []
    shared += ["FeedForwardBlock"] if 1 in pkm else []
    return layers, pkm_blocks, shared


def _tie_to_first(layers: nn.ModuleList, depth: int, config: SinkhornConfig) -> None:
    """weight_tie: layer `depth` (>= 1) keeps its LayerNorms and uses layer 0's attention and feed-forward
    modules. These stay registered under layer 0 only (each shared weight has one name in the state dict); the
    layer holds plain references. Layer 0's whole feed-forward block, norm included, serves the first layer
    with a feed-forward when layer 0 itself is a product-key layer."""
    first, layer = layers[0], layers[depth]
    pkm = set(config.pkm_layers)
    first_ff = min((d for d in range(config.num_hidden_layers) if d + 1 not in pkm), default=None)
    shared = [(layer.attention, "attention", first.attention.attention)]
    if depth + 1 in pkm or (depth == first_ff and 1 in pkm):
        shared.append((layer, "feed_forward", first.feed_forward))  # (a product-key layer never calls it)
    else:
        shared.append((layer.feed_forward, "net", first.feed_forward.net))
    if hasattr(first, "cross_attention"):
        shared.append((layer.cross_attention, "attention", first.cross_attention.attention))
        shared.append((layer.cross_feed_forward, "net", first.cross_feed_forward.net))
    for parent, name, module in shared:
        del parent._modules[name]
        object.__setattr__(parent, name, module)  # an unregistered reference


def tied_norm_sources(layers: nn.ModuleList) -> list[tuple[str, str]]:
    """weight_tie: (name, layer 0's name) of every weight that layers >= 1 hold of their own (their LayerNorms)."""
    return [
        (f"layers.{depth}.{name}", f"layers.0.{name}")
        for depth in range(1, len(layers))
        for name, _ in layers[depth].named_parameters()
    ]


class AxialPositionEmbedding(nn.Module):
    """Axial positions (`axial_position_embeddings`): position p -> per_bucket[p // B] + in_bucket[p % B]."""

    def __init__(self, max_positions: int, bucket_size: int, dim: int):
        super().__init__()
        self.bucket_size = bucket_size
        self.per_bucket = nn.Parameter(torch.empty(math.ceil(max_positions / bucket_size), dim))
        self.in_bucket = nn.Parameter(torch.empty(bucket_size, dim))

    def forward(self, position_ids: torch.Tensor) -> torch.Tensor:
        return self.per_bucket[position_ids // self.bucket_size] + self.in_bucket[position_ids % self.bucket_size]
