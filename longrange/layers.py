"""Building blocks shared by both models: the attention kernel and the feed-forward.

Both modeling files import from here (relative import), so `save_pretrained` copies this file next to the
weights and a saved model loads with `trust_remote_code=True` without `longrange` installed.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

ATTENTION_IMPLEMENTATIONS = ("sdpa", "eager")


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    dropout: float = 0.0,
    implementation: str = "sdpa",
    scale: float | None = None,
    return_weights: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Scaled dot-product attention used by every attention layer of the package.

    query: [..., q_len, d_head]; key/value: [..., k_len, d_head]
    mask:  bool, broadcastable to [..., q_len, k_len]; True = may attend.
    bias:  float, broadcastable to [..., q_len, k_len]; added to the scaled scores (relative positions).
    A row whose keys are all masked returns zeros (never NaN), so padded queries stay finite.

    "sdpa" runs `torch.nn.functional.scaled_dot_product_attention` with mask and bias folded into one additive
    float mask; "eager" is the explicit softmax(QK^T * scale + bias) V, kept for debugging and attention weights.
    """
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    additive = None
    if bias is not None:
        additive = bias.to(query.dtype)
    if mask is not None:
        neg = torch.tensor(torch.finfo(query.dtype).min, dtype=query.dtype, device=query.device)
        # one pass over the [.., q_len, k_len] scores: masked entries become the most negative float
        additive = torch.where(mask, additive if additive is not None else query.new_zeros(()), neg)
    probs = None
    if implementation == "sdpa" and not return_weights:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=additive, dropout_p=dropout, scale=scale)
    else:
        scores = torch.matmul(query, key.transpose(-1, -2)) * scale
        if additive is not None:
            scores = scores + additive
        probs = scores.float().softmax(dim=-1).to(query.dtype)
        probs = F.dropout(probs, p=dropout, training=dropout > 0)
        out = torch.matmul(probs, value)
    if mask is not None:
        # a query with no visible key attends to nothing: output exactly zero
        any_visible = mask.any(dim=-1, keepdim=True)
        out = out * any_visible.to(out.dtype)
        if probs is not None:
            probs = probs * any_visible.to(probs.dtype)
    if return_weights:
        return out, probs
    return out


class FeedForward(nn.Module):
    """Position-wise feed-forward: Linear -> GELU (or GEGLU when `glu`) -> dropout -> Linear."""

    def __init__(self, hidden_size: int, intermediate_size: int, dropout: float = 0.0, glu: bool = False):
        super().__init__()
        self.glu = glu
        self.up = nn.Linear(hidden_size, intermediate_size * (2 if glu else 1))
        self.down = nn.Linear(intermediate_size, hidden_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = self.up(hidden_states)  # [batch, seq, intermediate (x2 with GLU)]
        if self.glu:
            h, gate = h.chunk(2, dim=-1)
            h = h * F.gelu(gate)
        else:
            h = F.gelu(h)
        return self.down(self.dropout(h))


def sinusoidal_embedding(positions: torch.Tensor, dim: int) -> torch.Tensor:
    """Transformer sinusoidal encoding of (possibly negative or reversed) positions: [len] -> [len, dim]."""
    inv_freq = torch.exp(
        torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) * (-math.log(10000.0) / dim)
    )
    angles = positions.float()[:, None] * inv_freq[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=-1)
