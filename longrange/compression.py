"""The compression functions `f_c` of the Compressive Transformer: [batch, n, hidden] evicted memories (n a
multiple of the compression rate c) -> [batch, n / c, hidden] compressed memories. Each also maps the validity of
the n slots to the n / c compressed slots (valid if any source was valid) and only lets valid memories into the
result. One per decoder layer (`CompressiveDecoderLayer.compress`), chosen by `config.compression_function`.

Only same-folder relative imports: `save_pretrained` copies this file next to the weights.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# ----------------------------------------------------------------------------------------------------------------


def _group_any(valid: torch.Tensor, rate: int) -> torch.Tensor:
    # [batch, n] -> [batch, n / rate]: a compressed slot is valid if any of its sources was
    return valid.view(valid.shape[0], -1, rate).any(dim=-1)


class ConvCompression(nn.Module):
    """1D convolution with kernel = stride = c (the paper's and the seed's best); invalid memories read as zero."""

    def __init__(self, hidden_size: int, rate: int):
        super().__init__()
        self.rate = rate
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel_size=rate, stride=rate)

    def forward(self, memories, valid, usage=None):
        batch, n, hidden = memories.shape
        memories = memories * valid[..., None].to(memories.dtype)
        # kernel = stride = c: each output reads one group of c consecutive memories, so the convolution is a
        # linear map of the flattened groups (one matrix product, faster than the convolution kernel on CPU). The
        # weight [out, in, tap] and the groups [tap, in] disagree on the flattening order: one of them is copied,
        # the weight, or the memories when they are a single group (decoding compresses one group per step)
        groups = memories.view(batch, n // self.rate, self.rate, hidden)
        if n == self.rate:
            flat, weight = groups.transpose(2, 3).reshape(batch, n // self.rate, -1), self.conv.weight.flatten(1)
        else:
            flat = groups.reshape(batch, n // self.rate, -1)
            weight = self.conv.weight.transpose(1, 2).reshape(hidden, self.rate * hidden)  # [out, (tap, in)]
        return F.linear(flat, weight, self.conv.bias), _group_any(valid, self.rate)


class DilatedConvCompression(nn.Module):
    """Dilated convolution: kernel c, dilation 2, stride c, left-padded with c - 1 zero slots, so compressed slot j
    sees every second memory of the 2c - 1 ending at the end of its group (a wider, sparser field than conv1d)."""

    def __init__(self, hidden_size: int, rate: int):
        super().__init__()
        self.rate = rate
        self.conv = nn.Conv1d(hidden_size, hidden_size, kernel_size=rate, stride=rate, dilation=2)

    def forward(self, memories, valid, usage=None):
        memories = memories * valid[..., None].to(memories.dtype)
        padded = F.pad(memories.transpose(1, 2), (self.rate - 1, 0))  # [batch, hidden, n + c - 1]
        compressed = self.conv(padded).transpose(1, 2)
        # the same receptive field applied to the validity mask
        valid_padded = F.pad(valid.to(memories.dtype)[:, None], (self.rate - 1, 0))
        compressed_valid = F.max_pool1d(valid_padded, self.rate, self.rate, dilation=2)[:, 0] > 0
        return compressed, compressed_valid


class MaxPoolCompression(nn.Module):
    """Max over each group of c valid memories (zero for an all-padding group)."""

    def __init__(self, hidden_size: int, rate: int):
        super().__init__()
        self.rate = rate

    def forward(self, memories, valid, usage=None):
        batch, n, hidden = memories.shape
        groups = memories.masked_fill(~valid[..., None], float("-inf")).view(batch, n // self.rate, self.rate, hidden)
        group_valid = _group_any(valid, self.rate)
        compressed = groups.amax(dim=2).masked_fill(~group_valid[..., None], 0.0)
        return compressed, group_valid


class MeanPoolCompression(nn.Module):
    """Mean over the valid memories of each group of c (zero for an all-padding group)."""

    def __init__(self, hidden_size: int, rate: int):
        super().__init__()
        self.rate = rate

    def forward(self, memories, valid, usage=None):
        batch, n, hidden = memories.shape
        weights = valid.to(memories.dtype).view(batch, n // self.rate, self.rate, 1)
        sums = (memories.view(batch, n // self.rate, self.rate, hidden) * weights).sum(dim=2)
        counts = weights.sum(dim=2)
        return sums / counts.clamp_min(1.0), counts[..., 0] > 0


class MostUsedCompression(nn.Module):
    """Keeps the n / c evicted memories that received the most attention while in memory, in temporal order."""

    def __init__(self, hidden_size: int, rate: int):
        super().__init__()
        self.rate = rate

    def forward(self, memories, valid, usage):
        chosen, chosen_valid = self.select(valid, usage)
        compressed = memories.gather(1, chosen[..., None].expand(-1, -1, memories.shape[-1]))
        return compressed, chosen_valid

    def select(self, valid, usage, keep=None):
        """[batch, n] validity and usage -> the chosen slots [batch, n / c] in temporal order and their validity.
        `keep` [batch] (static decoding, where each row evicts its own number of memories from a fixed window):
        only the first keep[b] chosen slots of row b count (the top keep[b] of its valid slots, in temporal order;
        the rest are marked invalid)."""
        slots = valid.shape[1] // self.rate
        score = usage.float().masked_fill(~valid, float("-inf"))
        ranked = score.topk(slots, dim=1).indices  # [batch, n / c], best first
        if keep is None:
            chosen = ranked.sort(dim=1).values
            return chosen, valid.gather(1, chosen)
        kept = torch.arange(slots, device=valid.device) < keep[:, None]
        chosen = ranked.masked_fill(~kept, valid.shape[1]).sort(dim=1).values.clamp_max(valid.shape[1] - 1)
        return chosen, valid.gather(1, chosen) & kept


# ----------------------------------------------------------------------------------------------------------------
# Pieces of the reconstruction losses that train f_c (`MemoryUpdate.attention_reconstruction_loss`,
# `autoencoding_loss`, in memory_compressive.py)
# ----------------------------------------------------------------------------------------------------------------


def detached_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's attention norm applied with detached parameters (the reconstruction loss must not train it)."""
    if isinstance(norm, nn.LayerNorm):
        return F.layer_norm(x, norm.normalized_shape, norm.weight.detach(), norm.bias.detach(), norm.eps)
    return norm(x)  # Identity (post-LN): nothing to detach


def masked_mse(prediction: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # prediction/target [batch, len, ...]; valid [batch, len]: mean squared error over valid positions only
    weights = valid.to(prediction.dtype).view(*valid.shape, *([1] * (prediction.dim() - 2)))
    squared = (prediction.float() - target.float()).pow(2) * weights
    count = weights.sum() * prediction[0, 0].numel()
    return squared.sum() / count.clamp_min(1.0)


COMPRESSION_CLASSES = {
    "conv1d": ConvCompression,
    "dilated_conv": DilatedConvCompression,
    "max_pool": MaxPoolCompression,
    "mean_pool": MeanPoolCompression,
    "most_used": MostUsedCompression,
}
