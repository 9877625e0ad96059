"""The Compressive Transformer (Rae et al. 2019) as a transformers model.

Read top to bottom: the compression functions `f_c`, Transformer-XL relative attention, the decoder layer, the
PreTrainedModel, the base model (which runs long inputs segment by segment and applies the memory schedule to the
cache) and the causal LM head. The memory cache, `CompressiveMemoryCache`, lives in `cache_compressive.py`.

Memory schedule (per layer, after every complete segment, without gradient):
    mem = cat(mem, segment layer inputs)
    if len(mem) > mem_len: the oldest ceil((len - mem_len) / c) * c entries are evicted, compressed c -> 1 by the
    layer's f_c, appended to the compressed memory, which keeps its newest c_mem_len entries.
Each layer attends over [compressed memory, memory, current segment]; memories are fully visible (where valid),
the current segment causally. Tokens of an unfinished segment are kept in the cache ("pending") so that decoding
one token at a time follows exactly the segmenting of a single forward over the whole sequence. Segments count
each row's real tokens only (padding never enters the memories). Decoding steps use the cache's static form
(StaticLayout): fixed-size buffers and per-row counters, updated in place, so a step compiles to one graph.

Only same-folder relative imports: `save_pretrained` copies them next to the weights, so a saved folder loads
with `trust_remote_code=True` where `longrange` is not installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.generation import GenerationMode
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.utils import ModelOutput

from .cache_compressive import (
    CompressiveMemoryCache,
    StaticLayout,
    gather_slots,
    slot_dim,
    slot_index,
    write_slots,
)
from .compat import CACHE_NAME, cache_output, check_assisted_decoding, use_own_cache
from .configuration_compressive import CompressiveConfig
from .inputs import check_cache, check_lm_labels, check_mask, check_tokens
from .layers import (
    FeedForward,
    attend,
    blockwise_attention,
    put_along,
    real_tokens_first,
    register_fsdp_methods,
    sinusoidal_embedding,
)
from .loading import checked_from_pretrained
from .product_key_memory import ProductKeyMemory

# ----------------------------------------------------------------------------------------------------------------
# Compression functions f_c: [batch, n, hidden] evicted memories (n a multiple of c) -> [batch, n / c, hidden]
# Each also maps the validity of the n slots to the n / c compressed slots (valid if any source was valid) and
# only lets valid memories into the result.
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


COMPRESSION_CLASSES = {
    "conv1d": ConvCompression,
    "dilated_conv": DilatedConvCompression,
    "max_pool": MaxPoolCompression,
    "mean_pool": MeanPoolCompression,
    "most_used": MostUsedCompression,
}


# ----------------------------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------------------------


def relative_shift(scores: torch.Tensor) -> torch.Tensor:
    """[..., q_len, k_len] scores against relative encodings ordered by distance k_len - 1 ... 0 ->
    [..., q_len, k_len] where entry (i, j) is the score for distance (k_len - q_len + i) - j.

    Transformer-XL's pad-and-reshape trick: entry (i, j) comes from column j + q_len - 1 - i. Entries with
    j > k_len - q_len + i (future keys) hold unrelated values; the causal mask removes them.
    """
    *batch, q_len, k_len = scores.shape
    padded = F.pad(scores, (1, 0))  # [..., q_len, k_len + 1]
    padded = padded.view(*batch, k_len + 1, q_len)
    return padded[..., 1:, :].reshape(*batch, q_len, k_len)


class CompressiveAttention(nn.Module):
    """Transformer-XL relative multi-head attention over [compressed memory, memory, segment].

    score(i, j) = (q_i + u) . k_j + (q_i + v) . r_{i - j}, with r the projected sinusoidal encoding of the
    distance. The content part runs through `attend` as the query/key product, the position part is passed as an
    additive bias, so the sdpa kernel does the softmax and the weighted sum.
    """

    def __init__(self, config: CompressiveConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.head_dim = config.hidden_size // config.num_attention_heads
        self.scale = self.head_dim**-0.5
        self.dropout = config.attention_dropout
        self.implementation = config._attn_implementation or "sdpa"
        self.q_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.kv_proj = nn.Linear(config.hidden_size, 2 * config.hidden_size, bias=False)
        self.r_proj = nn.Linear(config.hidden_size, config.hidden_size, bias=False)
        self.o_proj = nn.Linear(config.hidden_size, config.hidden_size)
        self.content_bias = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))  # u
        self.position_bias = nn.Parameter(torch.zeros(self.num_heads, self.head_dim))  # v

    def kernel(self, device: torch.device, need_weights: bool = False) -> str:
        """The one place the attention kernel is chosen (from `config._attn_implementation`).

        "eager" is the explicit softmax(QK^T + bias) V. "blockwise" is the CPU training kernel of `layers.py`
        (row blocks, hand-written backward; inference uses sdpa). "sdpa", the default, is the fastest exact kernel of
        the device: torch's `scaled_dot_product_attention` with the position term as an additive bias that receives
        its gradient (fused kernels on GPUs, no loop, and what a compiled graph holds), except for eager training on
        the CPU, where the blockwise kernel is faster (1.4x the reference instead of 1.0x, docs/benchmarks)."""
        if need_weights:
            return "eager"
        if not torch.is_grad_enabled():
            return "eager" if self.implementation == "eager" else "sdpa"
        if self.implementation == "sdpa" and device.type == "cpu" and not torch.compiler.is_compiling():
            return "blockwise"
        if self.implementation == "blockwise" and torch.compiler.is_compiling():
            return "sdpa"  # the blockwise kernel is a Python loop over row blocks: compiled graphs fuse sdpa instead
        return self.implementation

    def split_heads(self, x: torch.Tensor) -> torch.Tensor:
        # [batch, len, hidden] -> [batch, heads, len, d_head]
        return x.view(x.shape[0], x.shape[1], self.num_heads, self.head_dim).transpose(1, 2)

    def project_kv(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.kv_proj(normed).chunk(2, dim=-1)
        return self.split_heads(keys), self.split_heads(values)  # [batch, heads, len, d_head] each

    def project_relative(self, sinusoid: torch.Tensor) -> torch.Tensor:
        # [len, hidden] -> [heads, d_head, len]: the layout the position matmul reads without a copy
        return self.r_proj(sinusoid).view(-1, self.num_heads, self.head_dim).permute(1, 2, 0).contiguous()

    def forward(
        self,
        query_input: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        relative: torch.Tensor,
        mask: torch.Tensor,
        need_weights: bool = False,
        key_columns: torch.Tensor | None = None,
    ):
        """query_input [batch, q, hidden] (normalised segment inputs); keys/values [batch, heads, K, d_head] over
        [c_mem, mem, pending, segment]; relative [heads, d_head, K] for distances K-1 ... 0; mask [batch, 1, q, K].
        With `key_columns` [batch, K] (one query per row, keys in any order: the static decoding cache), key j's
        position term is read from column key_columns[:, j] of `relative` (which then covers every distance)
        instead of the compact layout's shift."""
        batch, q_len, hidden = query_input.shape
        query = self.split_heads(self.q_proj(query_input))  # [batch, heads, q, d_head]
        kernel = self.kernel(query_input.device, need_weights)
        if kernel == "blockwise":
            out = blockwise_attention(
                query + self.content_bias[:, None],
                keys,
                values,
                mask,
                self.scale,
                dropout=self.dropout if self.training else 0.0,
                causal=True,
                position_query=query + self.position_bias[:, None],
                relative=relative,
            )
            out = out.transpose(1, 2).reshape(batch, q_len, hidden)
            return self.o_proj(out), None, query
        # position scores: (q + v) . r for every distance, then shifted to (query, key) pairs, passed to the kernel
        # as an additive bias (which receives its gradient); the scale is folded into the small query
        position_query = (query + self.position_bias[:, None]) * self.scale
        position = torch.matmul(position_query, relative)  # [batch, heads, q, distances]
        if key_columns is None:
            position = relative_shift(position)  # [batch, heads, q, K]
        else:
            columns = key_columns[:, None, None, :].expand(batch, self.num_heads, q_len, -1)
            position = position.gather(-1, columns)
        result = attend(
            query + self.content_bias[:, None],
            keys,
            values,
            mask=mask,
            bias=position,
            dropout=self.dropout if self.training else 0.0,
            implementation=kernel,
            scale=self.scale,
            return_weights=need_weights,
        )
        out, weights = result if need_weights else (result, None)
        out = out.transpose(1, 2).reshape(batch, q_len, hidden)
        return self.o_proj(out), weights, query


# ----------------------------------------------------------------------------------------------------------------
# Decoder layer
# ----------------------------------------------------------------------------------------------------------------


class _MemoryProjection(torch.autograd.Function):
    """linear(layer_norm(memory)) for memories, which are constants (detached layer inputs of earlier segments).

    With x_hat the normalised memory and G the gradient of the output, autograd would run two products (the
    weight's gradient G^T (x_hat * w + b), and G W to reach the norm's parameters). One is enough:
    M = G^T x_hat gives the weight's gradient M * w + outer(sum G, b), the norm scale's sum_o W * M and the norm
    shift's (sum G) W. Without a norm (post-LN layers) it is the weight's gradient G^T memory alone."""

    @staticmethod
    def forward(ctx, memory, norm_weight, norm_bias, eps, weight, known_tail):
        # known_tail [batch, F, out]: the projection of the last F memories, already computed by the layer's
        # previous chunk in this forward (same inputs, same weights): only the others are projected here
        if norm_weight is None:
            x_hat, normed = memory, memory
        else:
            x_hat = F.layer_norm(memory, memory.shape[-1:], None, None, eps)
            normed = torch.addcmul(norm_bias, x_hat, norm_weight)
        ctx.save_for_backward(x_hat, norm_weight, norm_bias, weight)
        if known_tail is None:
            return F.linear(normed, weight)
        return torch.cat([F.linear(normed[:, : memory.shape[1] - known_tail.shape[1]], weight), known_tail], dim=1)

    @staticmethod
    def backward(ctx, grad_out):
        x_hat, norm_weight, norm_bias, weight = ctx.saved_tensors
        grad_2d = grad_out.reshape(-1, grad_out.shape[-1])
        products = grad_2d.T @ x_hat.reshape(-1, x_hat.shape[-1])  # [out, in]
        if norm_weight is None:
            return None, None, None, None, products, None
        grad_sum = grad_2d.sum(0)  # [out]
        grad_weight = torch.addr(products * norm_weight, grad_sum, norm_bias)
        grad_norm_weight = (weight * products).sum(0)
        grad_norm_bias = grad_sum @ weight
        return None, grad_norm_weight, grad_norm_bias, None, grad_weight, None


def _detached_norm(norm: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """The layer's attention norm applied with detached parameters (the reconstruction loss must not train it)."""
    if isinstance(norm, nn.LayerNorm):
        return F.layer_norm(x, norm.normalized_shape, norm.weight.detach(), norm.bias.detach(), norm.eps)
    return norm(x)  # Identity (post-LN): nothing to detach


class CompressiveDecoderLayer(GradientCheckpointingLayer):
    """Attention over memories and segment, then feed-forward (or product-key memory), pre- or post-LN.

    The LayerNorm placement is chosen once here: with "pre" the `*_input_norm`s are LayerNorms (also applied to
    the stored, un-normalised memories) and the `*_output_norm`s are identities; with "post" the other way round.
    Each layer owns its compression function `f_c` and, for the auto-encoding loss, its decoder.
    """

    def __init__(self, config: CompressiveConfig, layer_idx: int):
        super().__init__()
        hidden, eps = config.hidden_size, config.layer_norm_eps
        pre = config.layer_norm_position == "pre"
        self.attn_input_norm = nn.LayerNorm(hidden, eps=eps) if pre else nn.Identity()
        self.attn_output_norm = nn.Identity() if pre else nn.LayerNorm(hidden, eps=eps)
        self.ff_input_norm = nn.LayerNorm(hidden, eps=eps) if pre else nn.Identity()
        self.ff_output_norm = nn.Identity() if pre else nn.LayerNorm(hidden, eps=eps)
        self.attention = CompressiveAttention(config)
        if layer_idx + 1 in config.pkm_layers:
            self.feed_forward = ProductKeyMemory(
                hidden, num_keys=config.pkm_num_keys, heads=config.pkm_heads, topk=config.pkm_topk
            )
        else:
            self.feed_forward = FeedForward(hidden, config.intermediate_size, dropout=config.hidden_dropout)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.compress = COMPRESSION_CLASSES[config.compression_function](hidden, config.compression_rate)
        self.decompress = (
            nn.ConvTranspose1d(hidden, hidden, config.compression_rate, stride=config.compression_rate)
            if config.reconstruction_loss == "autoencoding"
            else None
        )

    def forward(
        self,
        hidden_states: torch.Tensor,
        relative: torch.Tensor,
        memory: torch.Tensor | None = None,
        memory_keys: torch.Tensor | None = None,
        memory_values: torch.Tensor | None = None,
        memory_length: int | None = None,
        attention_mask: torch.Tensor | None = None,
        need_weights: bool = False,
        memory_tail_kv: torch.Tensor | None = None,
        write_index: torch.Tensor | None = None,
        key_columns: torch.Tensor | None = None,
    ):
        """hidden_states [batch, q, hidden]: this chunk's layer inputs; relative [heads, d_head, K]: projected
        encodings of distances K-1 ... 0 (positional, like hidden_states: it carries gradient to r_proj). Either
        `memory` [batch, M, hidden] (raw [c_mem, mem, pending], projected here so the LM loss trains the key/value
        projection) or, in inference, the cache's key/value buffers `memory_keys` / `memory_values`
        [batch, heads, capacity, d_head] holding M = `memory_length` projected entries; the chunk's keys/values
        are written into them in place. Memories are passed under these names, never `cache`, so gradient
        checkpointing keeps them. `memory_tail_kv` [batch, F, 2 * hidden]: the key/value projection of the last F
        memories when this forward already computed it (they are the previous chunk's inputs). Static decoding
        (one token per row): `write_index` [batch] is the slot of each row's token in the buffers, which are
        attended whole, and `key_columns` [batch, capacity] each slot's column of `relative` (see
        CompressiveAttention.forward).
        Returns (output [batch, q, hidden], the chunk's queries [batch, heads, q, d_head], keys and values
        [batch, heads, M + q, d_head] of everything attended, attention probabilities or None); the reconstruction
        loss reuses the queries and keys/values (detached) instead of projecting them again."""
        query_input = self.attn_input_norm(hidden_states)
        new_keys, new_values = self.attention.project_kv(query_input)  # [batch, heads, q, d_head] each
        if memory is not None:
            # projected apart from the segment: memories are detached, so backward only needs the weight gradient
            # for these rows, not an input gradient
            memory_keys, memory_values = self._project_memory(memory, memory_tail_kv)
            keys = torch.cat([memory_keys, new_keys], dim=2)
            values = torch.cat([memory_values, new_values], dim=2)
        elif write_index is not None:
            put_along(memory_keys, 2, write_index[:, None], new_keys)
            put_along(memory_values, 2, write_index[:, None], new_values)
            keys, values = memory_keys, memory_values
        else:
            end = memory_length + new_keys.shape[2]
            memory_keys[:, :, memory_length:end] = new_keys
            memory_values[:, :, memory_length:end] = new_values
            keys, values = memory_keys[:, :, :end], memory_values[:, :, :end]
        attn_out, weights, query = self.attention(
            query_input, keys, values, relative, attention_mask, need_weights, key_columns
        )
        hidden_states = self.attn_output_norm(hidden_states + self.dropout(attn_out))
        ff_out = self.feed_forward(self.ff_input_norm(hidden_states))
        hidden_states = self.ff_output_norm(hidden_states + self.dropout(ff_out))
        return hidden_states, query, keys, values, weights

    # What the model calls on a layer outside its forward: positions, the memory update and its loss. Each is a
    # method of the layer (never a direct call of a submodule), so that under per-layer FSDP units it can gather
    # the layer's parameters as forward does (`register_fsdp_methods`).
    FSDP_FORWARD_METHODS = (
        "relative_table",
        "project_memory",
        "compress_memory",
        "attention_reconstruction_loss",
        "autoencoding_loss",
        "compression_zero",
    )

    def relative_table(self, encodings: torch.Tensor) -> torch.Tensor:
        """[len, hidden] sinusoidal encodings of distances -> the projected table [heads, d_head, len]."""
        return self.attention.project_relative(encodings)

    def compress_memory(
        self, memories: torch.Tensor, valid: torch.Tensor, usage: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """f_c: [batch, n * rate, hidden] memories (their validity and, for "most_used", the attention they
        received) -> [batch, n, hidden] compressed memories and their validity."""
        return self.compress(memories, valid, usage)

    def compression_zero(self) -> torch.Tensor:
        """An exact zero that touches every parameter of f_c (and of the decoder): the reconstruction loss of a
        step that evicted nothing, so that data-parallel training sees the same parameters used on every step."""
        modules = [self.compress] + ([self.decompress] if self.decompress is not None else [])
        return torch.stack([p.sum() for module in modules for p in module.parameters()]).sum() * 0.0

    def project_memory(
        self, memory: torch.Tensor, known_tail: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys/values [batch, heads, len, d_head] of stored (un-normalised) memories. `known_tail`
        [batch, F, 2 * hidden]: the key/value projection of the last F memories, when already known."""
        return self._project_memory(memory, known_tail)

    def _project_memory(self, memory, known_tail=None):
        # (forward calls this, never the FSDP forward method above: a nested one would reshard on return)
        attention = self.attention
        if torch.is_grad_enabled() and not torch.is_autocast_enabled(memory.device.type) and memory.shape[1]:
            # training: memories are constants, so one product gives every gradient (see _MemoryProjection)
            norm = self.attn_input_norm
            affine = (norm.weight, norm.bias, norm.eps) if isinstance(norm, nn.LayerNorm) else (None, None, 0.0)
            kv = _MemoryProjection.apply(memory.detach(), *affine, attention.kv_proj.weight, known_tail)
            keys, values = kv.chunk(2, dim=-1)
            return attention.split_heads(keys), attention.split_heads(values)
        return attention.project_kv(self.attn_input_norm(memory))

    def attention_reconstruction_loss(
        self,
        segment: torch.Tensor,
        segment_valid: torch.Tensor,
        evicted: torch.Tensor,
        evicted_valid: torch.Tensor,
        compressed: torch.Tensor,
        compressed_valid: torch.Tensor,
        reused: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """MSE between attending (without positions) from the segment to the evicted memories and to their
        compression. Every weight is used detached (`F.linear` on `.detach()`ed tensors, never by switching
        `requires_grad`), and all inputs but `compressed` are detached, so only f_c receives this gradient.
        `reused` = (segment queries, evicted keys, evicted values) [batch, heads, len, d_head] as the layer's
        attention computed them (the same numbers); they are detached here, which cuts them off exactly like the
        detached weights would."""
        attention = self.attention
        if reused is not None:
            query, evicted_keys, evicted_values = (t.detach() for t in reused)
        else:
            query = F.linear(_detached_norm(self.attn_input_norm, segment.detach()), attention.q_proj.weight.detach())
            query = attention.split_heads(query)  # [batch, heads, s, d_head]

        def keys_values(memories):
            kv = F.linear(_detached_norm(self.attn_input_norm, memories), attention.kv_proj.weight.detach())
            keys, values = kv.chunk(2, dim=-1)
            return attention.split_heads(keys), attention.split_heads(values)

        implementation = "eager" if attention.implementation == "eager" else "sdpa"
        if reused is None:
            with torch.no_grad():
                evicted_keys, evicted_values = keys_values(evicted.detach())
        with torch.no_grad():
            target = attend(
                query, evicted_keys, evicted_values, mask=evicted_valid[:, None, None, :], implementation=implementation
            )
        prediction = attend(
            query, *keys_values(compressed), mask=compressed_valid[:, None, None, :], implementation=implementation
        )
        return _masked_mse(prediction.transpose(1, 2), target.transpose(1, 2), segment_valid)

    def autoencoding_loss(self, evicted: torch.Tensor, evicted_valid: torch.Tensor, compressed: torch.Tensor):
        """MSE between the evicted memories and their reconstruction from the compressed ones (trains f_c and
        the decoder only: the evicted memories are detached)."""
        decoded = self.decompress(compressed.transpose(1, 2)).transpose(1, 2)  # [batch, n, hidden]
        return _masked_mse(decoded, evicted.detach(), evicted_valid)


def _masked_mse(prediction: torch.Tensor, target: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    # prediction/target [batch, len, ...]; valid [batch, len]: mean squared error over valid positions only
    weights = valid.to(prediction.dtype).view(*valid.shape, *([1] * (prediction.dim() - 2)))
    squared = (prediction.float() - target.float()).pow(2) * weights
    count = weights.sum() * prediction[0, 0].numel()
    return squared.sum() / count.clamp_min(1.0)


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------


@cache_output
@dataclass
class CompressiveModelOutput(ModelOutput):
    """last_hidden_state [batch, seq, hidden]; cache (when use_cache); hidden_states (embeddings + each layer's
    output, when asked); attentions (with output_attentions: per layer [batch, heads, seq, c_mem_len + mem_len +
    segment_length], each token's attention over the compressed-memory slots, the memory slots (both newest last)
    and the positions of its segment; slots not held are zero); reconstruction_loss (training with a
    reconstruction loss, once compression happened)."""

    last_hidden_state: torch.FloatTensor | None = None
    cache: CompressiveMemoryCache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    reconstruction_loss: torch.FloatTensor | None = None


@cache_output
@dataclass
class CompressiveCausalLMOutput(ModelOutput):
    """loss = lm_loss + reconstruction_loss_weight * reconstruction_loss (what Trainer optimises); lm_loss and
    reconstruction_loss separately for logging; logits [batch, seq, vocab]; cache; hidden_states; attentions (see
    CompressiveModelOutput)."""

    loss: torch.FloatTensor | None = None
    lm_loss: torch.FloatTensor | None = None
    reconstruction_loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache: CompressiveMemoryCache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None


class CompressivePreTrainedModel(PreTrainedModel):
    config_class = CompressiveConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["CompressiveDecoderLayer"]
    _supports_sdpa = True
    _can_compile_fullgraph = True
    # not stateful for generate(): a croppable cache (crop_margin > 0) restores memories exactly, so assisted
    # decoding may verify and reject draft tokens (with "most_used" the cache is not croppable and transformers
    # refuses assisted decoding for that reason)
    _is_stateful = False

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' `from_pretrained`, checked (longrange/loading.py): an unreadable weights file, weights that
        do not match config.json (missing, or with no place in the model) and non-finite weights raise, naming the
        file or the weights, instead of giving a model with re-initialised or garbage weights."""
        return checked_from_pretrained(super().from_pretrained, cls, *args, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # Linear, Conv1d, ConvTranspose1d, Embedding, LayerNorm
        if isinstance(module, CompressiveAttention):
            # Transformer-XL initialises its u / v biases like the other weights
            init.normal_(module.content_bias, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.position_bias, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, ProductKeyMemory):
            module.reset_parameters()  # its own keys/values scheme (the Linear/LayerNorm inside are done above)


class CompressiveModel(CompressivePreTrainedModel):
    """Embeddings, the decoder layers and the final norm; runs any input length segment by segment."""

    def __init__(self, config: CompressiveConfig):
        super().__init__(config)
        if (config._attn_implementation or "sdpa") not in ("sdpa", "eager", "blockwise"):
            raise ValueError(
                f"attn_implementation must be 'sdpa', 'eager' or 'blockwise' for the Compressive model, got "
                f"{config._attn_implementation!r}"
            )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.dropout = nn.Dropout(config.hidden_dropout)
        self.layers = nn.ModuleList(CompressiveDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        # pre-LN needs a final norm; post-LN outputs are already normalised
        pre = config.layer_norm_position == "pre"
        self.norm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps) if pre else nn.Identity()
        # c_mem_len = 0 is Transformer-XL: evicted memories are dropped one by one, never compressed
        self.compresses = config.c_mem_len > 0
        self.eviction_unit = config.compression_rate if self.compresses else 1  # evictions take whole groups of it
        self.track_usage = config.compression_function == "most_used" and self.compresses
        # most key slots any chunk can see: a full compressed memory, a full memory and a whole segment
        self._capacity = config.c_mem_len + config.mem_len + config.segment_length
        self.gradient_checkpointing = False
        self.post_init()

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: CompressiveMemoryCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: CompressiveMemoryCache | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> CompressiveModelOutput | tuple:
        config = self.config
        output_attentions = output_attentions if output_attentions is not None else config.output_attentions
        if kwargs.get("position_ids") is not None:
            raise ValueError(
                "position_ids is not supported by the Compressive model: positions are relative (Transformer-XL) and "
                "follow from the tokens the cache has seen; pass the tokens in order instead"
            )
        if cache is None:
            cache = past_key_values
        if cache is not None:
            check_cache(cache, "compressive", 0, 0)
            if not isinstance(cache, CompressiveMemoryCache):
                raise TypeError(f"cache must be a CompressiveMemoryCache, got {type(cache).__name__}")
        if cache is not None and cache.crop_margin and self.track_usage:
            raise ValueError(
                "a CompressiveMemoryCache with crop_margin > 0 (croppable, e.g. for assisted decoding) needs a "
                "compression_function other than 'most_used' (its choice depends on attention a crop cannot undo)"
            )
        if use_cache is None:
            use_cache = config.use_cache and not self.training
        register_fsdp_methods(self.layers)  # per-layer FSDP units: what the model calls on a layer outside forward
        output_hidden_states = output_hidden_states if output_hidden_states is not None else config.output_hidden_states
        return_dict = return_dict if return_dict is not None else config.return_dict

        hidden_states = self._embed(input_ids, inputs_embeds)  # [batch, seq, hidden]
        batch, seq_len, _ = hidden_states.shape
        if cache is None:
            cache = CompressiveMemoryCache(config.num_hidden_layers)
        else:
            check_cache(cache, "compressive", batch, 0 if cache.layers[0].is_empty else cache.layers[0].batch_size)
        valid = self._token_validity(attention_mask, batch, seq_len, cache.seen_tokens, hidden_states.device)

        # decoding (one token, no gradient): the static form, each row at its own fill, fixed shapes, nothing read
        # back to the host. A croppable cache also takes the last crop_margin tokens of longer calls one at a
        # time, so that a crop finds what it needs in the static buffers.
        stepped = 0
        if not torch.is_grad_enabled():
            stepped = seq_len if seq_len == 1 else min(seq_len, cache.crop_margin)
        head = seq_len - stepped
        layer_outputs, layer_attentions, reconstruction_losses = [], None, []
        if head:
            outputs, layer_outputs, layer_attentions, reconstruction_losses = self._forward_tokens(
                hidden_states[:, :head],
                valid[:, :head],
                cache,
                attention_mask is not None,
                use_cache,
                output_hidden_states,
                output_attentions,
            )
        if stepped:
            if not cache.is_static:
                self._to_static(cache, hidden_states)
            steps = [
                self._decode_step(
                    hidden_states[:, t : t + 1],
                    valid[:, t],
                    cache,
                    output_hidden_states,
                    output_attentions,
                    tokens_real=attention_mask is None,
                )
                for t in range(head, seq_len)
            ]
            step_outputs = torch.cat([out for out, _, _ in steps], dim=1)
            outputs = torch.cat([outputs, step_outputs], dim=1) if head else step_outputs
            if output_hidden_states:
                step_layers = [torch.cat(layer, dim=1) for layer in zip(*(hidden for _, hidden, _ in steps))]
                if head:
                    step_layers = [torch.cat(pair, dim=1) for pair in zip(layer_outputs, step_layers)]
                layer_outputs = step_layers
            if output_attentions:
                step_maps = [torch.cat(layer, dim=2) for layer in zip(*(maps for _, _, maps in steps))]
                if head:
                    step_maps = [torch.cat(pair, dim=2) for pair in zip(layer_attentions, step_maps)]
                layer_attentions = step_maps
        cache.seen_tokens += seq_len

        all_hidden = None
        final = self.norm(outputs)
        if output_hidden_states:
            all_hidden = (hidden_states, *layer_outputs[:-1], final)
        reconstruction_loss = torch.stack(reconstruction_losses).mean() if reconstruction_losses else None
        if reconstruction_loss is None and self.training and torch.is_grad_enabled():
            if config.reconstruction_loss != "none":
                # no memory was evicted in this call: an exact zero that still touches every f_c (and decoder)
                # parameter, so data-parallel training sees the same parameters used on every step
                reconstruction_loss = torch.stack([layer.compression_zero() for layer in self.layers]).sum()
        result = CompressiveModelOutput(
            last_hidden_state=final,
            cache=cache if use_cache else None,
            hidden_states=all_hidden,
            attentions=tuple(layer_attentions) if output_attentions else None,
            reconstruction_loss=reconstruction_loss,
        )
        return result if return_dict else result.to_tuple()

    def _forward_tokens(self, hidden_states, valid, cache, masked, use_cache, output_hidden_states, output_attentions):
        """Any number of tokens through the compact form. Each row's real tokens are moved to the front first (a
        stable sort of the mask, undone on the outputs), so segments and memory slots count real tokens only:
        a row's outputs do not depend on its padding. Trailing padding left by a shorter row would still enter
        that row's memory, so when the cache is kept and rows hold different numbers of real tokens (or the
        cache's rows are at different fills), the rows run one at a time (`_forward_rows`)."""
        split = False
        if cache.is_static:
            lengths = cache.row_lengths()  # multi-token calls may read the fills back; decoding steps never do
            split = any(row != lengths[0] for row in lengths)
        counts = None
        if masked and (use_cache or split):
            counts = valid.sum(dim=1).tolist()
            split = split or any(count != counts[0] for count in counts)
        if split:
            return self._forward_rows(hidden_states, valid, cache, output_hidden_states, output_attentions)
        if cache.is_static:
            self._to_compact(cache)
        if cache.layers[0].is_empty:
            for layer_state in cache.layers:
                layer_state.init_empty(hidden_states.detach(), self.track_usage)
        if not masked or (counts is not None and counts[0] == valid.shape[1]):  # no padding: nothing to move
            return self._run_segments(hidden_states, valid, cache, output_hidden_states, output_attentions)

        batch, seq_len, hidden = hidden_states.shape
        order = real_tokens_first(valid)
        kept = seq_len if counts is None else counts[0]  # a kept cache takes no all-padding columns
        order = order[:, :kept]
        rolled = hidden_states.gather(1, order[..., None].expand(-1, -1, hidden))
        outputs, layer_outputs, layer_attentions, losses = self._run_segments(
            rolled, valid.gather(1, order), cache, output_hidden_states, output_attentions
        )

        def unroll(tensor, dim):
            shape = list(tensor.shape)
            shape[dim] = seq_len
            index = order.view(batch, *([1] * (dim - 1)), kept, *([1] * (tensor.dim() - dim - 1)))
            return tensor.new_zeros(shape).scatter(dim, index.expand_as(tensor), tensor)

        outputs = unroll(outputs, 1)
        if output_hidden_states:
            layer_outputs = [unroll(h, 1) for h in layer_outputs]
        if output_attentions:
            layer_attentions = [unroll(a, 2) for a in layer_attentions]
        return outputs, layer_outputs, layer_attentions, losses

    def _forward_rows(self, hidden_states, valid, cache, output_hidden_states, output_attentions):
        """Rows one at a time (each on its real tokens only, from its own fill); the cache is left in the static
        form, where rows may differ."""
        if not cache.is_static:
            self._to_static(cache, hidden_states)
        batch, seq_len, _ = hidden_states.shape
        outputs = hidden_states.new_zeros(hidden_states.shape)
        layer_outputs = (
            [hidden_states.new_zeros(hidden_states.shape) for _ in self.layers] if output_hidden_states else None
        )
        layer_attentions = [None] * len(self.layers)
        losses = []
        for row in range(batch):
            index = valid[row].nonzero()[:, 0]
            if index.numel() == 0:
                continue
            sub = cache.select_row(row)
            self._to_compact(sub)
            out, hidden, attentions, row_losses = self._run_segments(
                hidden_states[row : row + 1, index], valid[row : row + 1, index], sub, output_hidden_states,
                output_attentions,
            )  # fmt: skip
            self._to_static(sub, hidden_states)
            cache.put_row(row, sub)
            outputs[row, index] = out[0]
            losses.extend(row_losses)
            for i in range(len(self.layers)):
                if output_hidden_states:
                    layer_outputs[i][row, index] = hidden[i][0]
                if output_attentions:
                    if layer_attentions[i] is None:
                        layer_attentions[i] = attentions[i].new_zeros(batch, *attentions[i].shape[1:2], seq_len,
                                                                      attentions[i].shape[3])  # fmt: skip
                    layer_attentions[i][row, :, index] = attentions[i][0]
        return outputs, layer_outputs, layer_attentions, losses

    def _run_segments(self, hidden_states, valid, cache, output_hidden_states, output_attentions):
        """The compact form's segment loop: [batch, seq, hidden] layer-0 inputs -> (last layer's outputs, each
        layer's outputs (with output_hidden_states), each layer's attentions (with output_attentions),
        reconstruction losses)."""
        config = self.config
        seq_len = hidden_states.shape[1]
        # projected memories are reused only when nothing is trained (weights cannot change under a no-grad call)
        reuse_projections = not torch.is_grad_enabled()
        if reuse_projections:
            for layer, layer_state in zip(self.layers, cache.layers):
                if layer_state.rel_table is None:
                    layer_state.rel_table = self._relative_table(layer, self._capacity, hidden_states)
            relative_tables = [layer_state.rel_table for layer_state in cache.layers]
        else:
            for layer_state in cache.layers:
                layer_state.drop_projections()
            # projected once per call (with gradient) for the longest key span any chunk of this call can reach
            max_keys = min(self._capacity, cache.memory_slots() + seq_len)
            relative_tables = [self._relative_table(layer, max_keys, hidden_states) for layer in self.layers]

        outputs, per_layer_outputs = [], [[] for _ in self.layers] if output_hidden_states else None
        per_layer_attentions = [[] for _ in self.layers] if output_attentions else None
        reconstruction_losses = []
        # per layer, the previous chunk's key/value projection (detached): the next chunk's memories end with
        # that chunk's inputs, whose projection need not be computed again within this call
        recent_kv = [None] * len(self.layers)
        start = 0
        while start < seq_len:
            # chunks end at segment boundaries counted over all tokens seen, so that any split of a sequence into
            # calls (one forward, segment-wise calls, or token-by-token decoding) gives the same segmenting
            pending_len = cache.layers[0].pending.shape[1]
            end = min(seq_len, start + config.segment_length - pending_len)
            chunk_out, chunk_hidden, chunk_attentions = self._forward_chunk(
                hidden_states[:, start:end],
                valid[:, start:end],
                cache,
                relative_tables,
                reconstruction_losses,
                recent_kv,
                output_attentions,
            )
            outputs.append(chunk_out)
            if output_hidden_states:
                for layer_outputs, h in zip(per_layer_outputs, chunk_hidden):
                    layer_outputs.append(h)
            if output_attentions:
                for layer_attentions, weights in zip(per_layer_attentions, chunk_attentions):
                    layer_attentions.append(weights)
            start = end
        return (
            torch.cat(outputs, dim=1),
            [torch.cat(h, dim=1) for h in per_layer_outputs] if output_hidden_states else None,
            [torch.cat(a, dim=2) for a in per_layer_attentions] if output_attentions else None,
            reconstruction_losses,
        )

    def _embed(self, input_ids, inputs_embeds) -> torch.Tensor:
        check_tokens(input_ids, inputs_embeds, self.config.vocab_size, self.config.hidden_size)
        return self.dropout(self.embed_tokens(input_ids) if input_ids is not None else inputs_embeds)

    @staticmethod
    def _token_validity(attention_mask, batch, seq_len, seen, device) -> torch.Tensor:
        """[batch, seq] bool for the new tokens. The mask may cover only the new tokens or, as generate() passes
        it, every token seen so far plus the new ones; the cache already holds the validity of the older ones."""
        if attention_mask is None:
            return torch.ones(batch, seq_len, dtype=torch.bool, device=device)
        return check_mask(attention_mask, batch, (seq_len, seen + seq_len), seq_len).to(device=device)

    def _relative_table(self, layer, length: int, like: torch.Tensor) -> torch.Tensor:
        # [heads, d_head, length]: the layer's projected sinusoidal encodings of distances length - 1 ... 0, so that
        # the K keys of any chunk read the last K columns (a view)
        distances = torch.arange(length - 1, -1, -1, device=like.device)
        return layer.relative_table(sinusoidal_embedding(distances, self.config.hidden_size).to(like.dtype))

    # ------------------------------------------------------------------------------------------------------------
    # The static form (StaticLayout): conversions and the one-token decoding step
    # ------------------------------------------------------------------------------------------------------------

    @torch.no_grad()
    def _to_static(self, cache, like: torch.Tensor) -> None:
        """Compact form (every row at the same fill; empty allowed) -> static form, numbering the held tokens from
        0 (distances only depend on differences) and the compressed entries likewise."""
        config = self.config
        layout = StaticLayout(
            config.c_mem_len,
            config.mem_len,
            config.segment_length,
            self.eviction_unit,
            grouped=self.compresses and not self.track_usage,
            margin=cache.crop_margin,
        )
        cache._layout = layout
        if cache.layers[0].is_empty:
            for layer_state in cache.layers:
                layer_state.init_empty(like.detach(), self.track_usage)
        c_len, m_len, p_len = cache.layers[0].lengths()
        held = m_len + p_len
        batch, device = cache.layers[0].mem.shape[0], like.device

        def counter(value):
            return torch.full((batch,), value, dtype=torch.long, device=device)

        # tokens numbered from rate * c_len (start = rate * compressed always; see StaticLayout)
        first = self.eviction_unit * c_len
        cache.rows_seen, cache.rows_start = counter(first + held), counter(first)
        cache.rows_pending, cache.rows_compressed = counter(p_len), counter(c_len)
        cache._host_rows = [[first + held, first, p_len, c_len] for _ in range(batch)]
        cache._step_geometry = None
        # (start, compressed) before each of the last `history` segment completions; -1: not recorded
        cache.rows_history = torch.full((batch, layout.history, 2), -1, dtype=torch.long, device=device)
        tokens = layout.c_ring + (first + torch.arange(held, device=device)) % layout.ring
        for layer, state in zip(self.layers, cache.layers):
            if state.rel_table is None:
                state.rel_table = self._relative_table(layer, self._capacity, state.mem)
            if state.keys is None:
                state.store_projected(*layer.project_memory(state.context()), self._capacity)
            keys, values = state.projected()
            memory = torch.cat([state.mem, state.pending], dim=1)
            memory_valid = torch.cat([state.mem_valid, state.pending_valid], dim=1)
            state.ring = state.mem.new_zeros(batch, layout.slots, state.mem.shape[-1])
            state.ring[:, :c_len], state.ring[:, tokens] = state.c_mem, memory
            state.ring_real = torch.zeros(batch, layout.slots, dtype=torch.bool, device=device)
            state.ring_real[:, :c_len], state.ring_real[:, tokens] = state.c_mem_valid, memory_valid
            state.ring_keys = keys.new_zeros(batch, keys.shape[1], layout.slots, keys.shape[3])
            state.ring_values = torch.zeros_like(state.ring_keys)
            for buffer, projected in ((state.ring_keys, keys), (state.ring_values, values)):
                buffer[:, :, :c_len], buffer[:, :, tokens] = projected[:, :, :c_len], projected[:, :, c_len:]
            if self.track_usage:
                state.ring_usage = torch.zeros(batch, layout.slots, dtype=torch.float32, device=device)
                state.ring_usage[:, tokens] = torch.cat([state.mem_usage, state.pending_usage], dim=1)
            state.clear_compact()
        cache._groups_ready = False  # compressed by the first branch-free step (see _materialize_groups)

    def _materialize_groups(self, cache, layout) -> None:
        """Compresses (and projects) every group of every row's held tokens into the group buffers, which
        branch-free decoding steps then keep current (eager steps that follow the fills on the host compress at
        eviction instead and leave the buffers stale). Groups are aligned on `start` (a multiple of the rate): the
        first one is compressed as the first of a block (the oldest group is always evicted first)."""
        rate = self.config.compression_rate
        count = layout.groups - 2  # ceil(ring / rate): every held group
        start = cache.rows_start
        tokens = start[:, None] + torch.arange(count * rate, device=start.device)  # [batch, count * rate]
        slots = layout.c_ring + tokens % layout.ring
        in_ring = tokens < cache.rows_seen[:, None]
        group_slots = ((start // rate)[:, None] + torch.arange(count, device=start.device)) % layout.groups
        for layer, state in zip(self.layers, cache.layers):
            batch, hidden = state.ring.shape[0], state.ring.shape[-1]
            heads, head_dim = layer.attention.num_heads, layer.attention.head_dim
            block = gather_slots(state.ring, slots)
            block_valid = gather_slots(state.ring_real, slots) & in_ring
            variants = [("grouped", layer.compress_memory(block, block_valid))]
            if isinstance(layer.compress, DilatedConvCompression):  # each group also compressed alone
                alone = layer.compress_memory(block.reshape(batch * count, rate, hidden), block_valid.reshape(-1, rate))
                variants.append(("leading", (alone[0].view(batch, count, hidden), alone[1].view(batch, count))))
            for name, (compressed, compressed_valid) in variants:
                values = (compressed, *layer.project_memory(compressed), compressed_valid)
                buffers = (
                    state.ring.new_zeros(batch, layout.groups, hidden),
                    state.ring.new_zeros(batch, heads, layout.groups, head_dim),
                    state.ring.new_zeros(batch, heads, layout.groups, head_dim),
                    torch.zeros(batch, layout.groups, dtype=torch.bool, device=start.device),
                )
                for suffix, buffer, value in zip(("", "_keys", "_values", "_valid"), buffers, values):
                    buffer.scatter_(slot_dim(buffer), slot_index(buffer, group_slots), value)
                    setattr(state, name + suffix, buffer)
        cache._groups_ready = True

    @torch.no_grad()
    def _to_compact(self, cache) -> None:
        """Static form whose rows are all at the same fill -> compact form (reads the fills back to the host)."""
        layout = cache._layout
        c_len, m_len, p_len = cache.row_lengths()[0]
        device = cache.rows_seen.device
        c_index = (cache.rows_compressed[:, None] - c_len + torch.arange(c_len, device=device)) % layout.c_ring
        held = torch.arange(m_len + p_len, device=device)
        token_index = layout.c_ring + (cache.rows_start[:, None] + held) % layout.ring
        index = torch.cat([c_index, token_index], dim=1)  # [batch, c + m + p], in compact order
        for state in cache.layers:
            context = state.ring.gather(1, index[..., None].expand(-1, -1, state.ring.shape[-1]))
            state.c_mem, state.mem, state.pending = context.split([c_len, m_len, p_len], dim=1)
            real = state.ring_real.gather(1, index)
            state.c_mem_valid, state.mem_valid, state.pending_valid = real.split([c_len, m_len, p_len], dim=1)
            kv_index = index[:, None, :, None].expand(-1, state.ring_keys.shape[1], -1, state.ring_keys.shape[3])
            keys, values = state.ring_keys.gather(2, kv_index), state.ring_values.gather(2, kv_index)
            state.store_projected(keys, values, self._capacity)
            if self.track_usage:
                usage = state.ring_usage.gather(1, token_index)
                state.mem_usage, state.pending_usage = usage.split([m_len, p_len], dim=1)
            state.clear_static()
        for name in CompressiveMemoryCache._ROWS:
            setattr(cache, name, None)
        cache._host_rows = cache._step_geometry = None

    def _decode_step(self, hidden_states, token_valid, cache, output_hidden_states, output_attentions, tokens_real):
        """One token per row [batch, 1, hidden] through the static form. The token goes to its row's own slot;
        a row whose segment it completes evicts and compresses at once; every update is an in-place, fixed-shape
        write selected per row (no branch on values, no host read). `tokens_real`: the caller knows every token is
        real (no attention mask); eager steps then follow the rows' fills on the host (`_host_rows`) and skip the
        group compression and the eviction copies on the steps where no row needs them."""
        layout, rate, segment = cache._layout, self.eviction_unit, self.config.segment_length
        device = hidden_states.device
        seen, start = cache.rows_seen, cache.rows_start
        pending, compressed = cache.rows_pending, cache.rows_compressed
        write = layout.c_ring + seen % layout.ring  # [batch]: the new token's slot
        host = cache._host_rows if tokens_real and not torch.compiler.is_compiling() else None
        segments_complete = host is None or any(row[2] + 1 == segment for row in host)
        if host is not None:
            cache._groups_ready = False  # eager steps compress at eviction and leave the group buffers stale

        # geometry of the held slots, shared by the layers: visibility and each slot's column in the relative table.
        # Between two segment completions, eager steps that follow the fills on the host only move it by one token.
        if host is not None and cache._step_geometry is not None:
            columns, in_window = cache._step_geometry
            columns.sub_(1).clamp_min_(0).scatter_(1, write[:, None], self._capacity - 1)
            in_window.scatter_(1, write[:, None], True)
        else:
            columns, in_window = self._geometry(cache, layout, write)
        cache._step_geometry = (columns, in_window) if host is not None and not segments_complete else None
        if segments_complete:
            # the memory update of rows whose segment this token completes
            completes = token_valid & (pending + 1 == segment)
            memory_len = seen + 1 - start - segment  # before the update, for completing rows
            overflow = (memory_len + segment - layout.mem_len).clamp_min(0)
            evicted = torch.where(completes, -(-overflow // rate) * rate, 0)
            new_entries = evicted // rate if self.compresses else torch.zeros_like(evicted)
            entry_index = torch.arange(layout.max_new_entries, device=device)
            targets = (compressed[:, None] + entry_index) % layout.c_ring  # [batch, max_new_entries]
            takes = entry_index < new_entries[:, None]
        if layout.grouped and host is None:
            # branch-free: the new token's group is compressed now (a partial group is rewritten when it completes;
            # evictions only take complete groups), with the group before it for the dilated convolution
            if not cache._groups_ready:
                self._materialize_groups(cache, layout)
            group = seen // rate
            span = 2 * rate if self.config.compression_function == "dilated_conv" else rate
            group_tokens = group[:, None] * rate + torch.arange(rate - span, rate, device=device)
            group_slots = layout.c_ring + group_tokens % layout.ring
            sources = ((start // rate)[:, None] + entry_index) % layout.groups  # the evicted groups' slots

        layer_outputs, layer_attentions = [], []
        for layer, state in zip(self.layers, cache.layers):
            put_along(state.ring, 1, write[:, None], hidden_states)
            put_along(state.ring_real, 1, write[:, None], token_valid[:, None])
            mask = (in_window & state.ring_real)[:, None, None, :]  # the new token is visible: written above
            out, _, _, _, weights = layer(
                hidden_states,
                state.rel_table,
                memory_keys=state.ring_keys,
                memory_values=state.ring_values,
                attention_mask=mask,
                need_weights=self.track_usage or output_attentions,
                write_index=write,
                key_columns=columns,
            )
            if output_attentions:
                layer_attentions.append(self._static_slot_layout(weights, cache, layout))
            buffers = (state.ring, state.ring_keys, state.ring_values, state.ring_real)
            if layout.grouped and host is not None:
                if segments_complete:  # the evicted blocks compressed at once, as the compact form does
                    window = torch.arange(layout.max_new_entries * rate, device=device)
                    window_slots = layout.c_ring + (start[:, None] + window) % layout.ring
                    window_valid = gather_slots(state.ring_real, window_slots) & (window < evicted[:, None])
                    compressed_entries, entries_valid = layer.compress_memory(
                        gather_slots(state.ring, window_slots), window_valid
                    )
                    entries = (compressed_entries, *layer.project_memory(compressed_entries), entries_valid)
                    for buffer, values in zip(buffers, entries):
                        write_slots(buffer, targets, takes, values)
            elif layout.grouped:
                self._compress_group(layer, state, group, group_tokens, group_slots, layout)
                grouped = (state.grouped, state.grouped_keys, state.grouped_values, state.grouped_valid)
                entries = [gather_slots(buffer, sources) for buffer in grouped]
                if state.leading is not None:  # a block's first group, as the convolution sees it there
                    leading = (state.leading, state.leading_keys, state.leading_values, state.leading_valid)
                    entries = [
                        torch.cat([gather_slots(lead, sources[:, :1]), rest.narrow(dim, 1, rest.shape[dim] - 1)],
                                  dim=dim)
                        for lead, rest, dim in ((a, b, slot_dim(b)) for a, b in zip(leading, entries))
                    ]  # fmt: skip
                for buffer, values in zip(buffers, entries):
                    write_slots(buffer, targets, takes, values)
            elif self.track_usage:  # most used: the chosen tokens are copied into the compressed slots
                received = weights.float().sum(dim=(1, 2)) * token_valid[:, None]  # [batch, slots]
                state.ring_usage.scatter_(1, write[:, None], 0.0).add_(received)
                if segments_complete:
                    chosen = self._select_most_used(layer, state, start, evicted, new_entries, layout)
                    for buffer, values in zip(buffers, [gather_slots(buffer, chosen) for buffer in buffers]):
                        write_slots(buffer, targets, takes, values)
            layer_outputs.append(out)
            hidden_states = out

        if not segments_complete:  # (followed on the host: every token real, no completion)
            cache.rows_pending.add_(1)
            cache.rows_seen.add_(1)
        else:
            if layout.history:
                before = torch.stack([start, compressed], dim=1)[:, None]
                shifted = torch.cat([cache.rows_history[:, 1:], before], dim=1)
                cache.rows_history.copy_(torch.where(completes[:, None, None], shifted, cache.rows_history))
            cache.rows_start.add_(evicted)
            cache.rows_compressed.add_(new_entries)
            cache.rows_pending.copy_(torch.where(completes, 0, pending + token_valid))
            cache.rows_seen.add_(token_valid.long())
        cache._host_rows = None if host is None else [self._host_step(row) for row in host]
        return hidden_states, layer_outputs if output_hidden_states else None, layer_attentions

    def _static_slot_layout(self, weights: torch.Tensor, cache, layout) -> torch.Tensor:
        """A decoding step's probabilities [batch, heads, 1, slots] over the static form's slots (compressed ring,
        then token ring) -> the fixed slot layout of `_slot_layout`, from each slot's entry / token index: compressed
        entry e at c_mem_len - (compressed - e), token t at c_mem_len + mem_len + t - (first token of the segment)."""
        config = self.config
        seen, start, compressed = cache.rows_seen[:, None], cache.rows_start[:, None], cache.rows_compressed[:, None]
        device = seen.device
        c_slots = torch.arange(layout.c_ring, device=device)
        entry = c_slots + layout.c_ring * torch.div(compressed - 1 - c_slots, layout.c_ring, rounding_mode="floor")
        token_slots = torch.arange(layout.ring, device=device)
        held = token_slots + layout.ring * torch.div(seen - token_slots, layout.ring, rounding_mode="floor")
        memory_end, size = config.c_mem_len + config.mem_len, config.c_mem_len + config.mem_len + config.segment_length
        entry_column = config.c_mem_len - (compressed - entry)
        token_column = memory_end + held - (seen - cache.rows_pending[:, None])
        shown = torch.cat([(entry >= 0) & (entry_column >= 0), held >= start], dim=1)
        columns = torch.where(shown, torch.cat([entry_column, token_column], dim=1), size)  # size: not held
        out = weights.new_zeros(*weights.shape[:-1], size + 1)
        return out.scatter_add_(-1, columns[:, None, None, :].expand_as(weights), weights)[..., :size]

    def _geometry(self, cache, layout, write):
        """[batch, slots] column of each slot in the relative table (capacity-1 minus the distance from the new
        token, at slot `write`, to what the slot holds) and whether the slot is held (compressed memory, memory,
        the unfinished segment, the token itself); padding slots are masked apart (`ring_real`)."""
        seen, start, compressed = cache.rows_seen, cache.rows_start, cache.rows_compressed
        device = seen.device
        token_slots = torch.arange(layout.ring, device=device)
        held = token_slots + layout.ring * torch.div(seen[:, None] - token_slots, layout.ring, rounding_mode="floor")
        c_slots = torch.arange(layout.c_ring, device=device)
        entry = c_slots + layout.c_ring * torch.div(
            compressed[:, None] - 1 - c_slots, layout.c_ring, rounding_mode="floor"
        )  # newest compressed entry in each slot
        entry_visible = (entry >= 0) & (entry >= compressed[:, None] - layout.c_mem_len)
        token_visible = held >= start[:, None]  # held <= seen by construction
        distance = torch.cat([(seen - start + compressed)[:, None] - entry, seen[:, None] - held], dim=1)
        columns = (self._capacity - 1 - distance).clamp(0, self._capacity - 1)
        return columns, torch.cat([entry_visible, token_visible], dim=1)

    def _host_step(self, row: list[int]) -> list[int]:
        """(seen, start, pending, compressed) of a row after one real token: the schedule, on the host."""
        seen, start, pending, compressed = row
        if pending + 1 < self.config.segment_length:
            return [seen + 1, start, pending + 1, compressed]
        rate = self.eviction_unit
        overflow = max(0, seen + 1 - start - self.config.mem_len)  # memory + segment beyond mem_len
        evicted = -(-overflow // rate) * rate
        return [seen + 1, start + evicted, 0, compressed + evicted // rate]

    def _compress_group(self, layer, state, group, group_tokens, group_slots, layout) -> None:
        """Compresses the group of the newest token (with the group before it for the dilated convolution) into
        its group slot, projected."""
        hidden = state.ring.shape[-1]
        members = state.ring.gather(1, group_slots[..., None].expand(-1, -1, hidden))  # [batch, span, hidden]
        real = state.ring_real.gather(1, group_slots) & (group_tokens >= 0)
        slot = (group % layout.groups)[:, None]
        compressed, compressed_valid = (t[:, -1:] for t in layer.compress_memory(members, real))  # [batch, 1, ...]
        targets = [(state.grouped, state.grouped_keys, state.grouped_values, state.grouped_valid)]
        results = [(compressed, *layer.project_memory(compressed), compressed_valid)]
        if state.leading is not None:
            rate = self.config.compression_rate
            compressed, compressed_valid = layer.compress_memory(members[:, -rate:], real[:, -rate:])
            targets.append((state.leading, state.leading_keys, state.leading_values, state.leading_valid))
            results.append((compressed, *layer.project_memory(compressed), compressed_valid))
        for buffers, values in zip(targets, results):
            for buffer, value in zip(buffers, values):
                put_along(buffer, slot_dim(buffer), slot, value)

    def _select_most_used(self, layer, state, start, evicted, new_entries, layout) -> torch.Tensor:
        """Most-used compression: the slots [batch, max_new_entries] of the tokens each row keeps from its evicted
        block (the first new_entries[b] count), in temporal order."""
        window = torch.arange(layout.max_new_entries * self.config.compression_rate, device=start.device)
        window_slots = layout.c_ring + (start[:, None] + window) % layout.ring
        valid = state.ring_real.gather(1, window_slots) & (window < evicted[:, None])
        chosen, _ = layer.compress.select(valid, state.ring_usage.gather(1, window_slots), new_entries)
        return window_slots.gather(1, chosen)

    def _forward_chunk(
        self, hidden_states, valid, cache, relative_tables, reconstruction_losses, recent_kv, output_attentions=False
    ):
        """One chunk (the rest of the current segment at most) through every layer, then the memory update of each
        layer if the chunk completes the segment. With `output_attentions`, also each layer's attention
        probabilities in the fixed slot layout of `_slot_layout`."""
        config = self.config
        q_len = hidden_states.shape[1]
        first = cache.layers[0]
        key_valid = torch.cat([first.context_valid(), valid], dim=1)  # [batch, K]: the same for every layer
        k_len = key_valid.shape[1]
        # query i sits at key position k_len - q_len + i: memories and earlier segment tokens visible, future not
        causal = torch.ones(q_len, k_len, dtype=torch.bool, device=valid.device).tril(k_len - q_len)
        mask = key_valid[:, None, None, :] & causal  # [batch, 1, q, K]
        completes_segment = first.pending.shape[1] + q_len == config.segment_length
        reuse_projections = not torch.is_grad_enabled()
        need_weights = self.track_usage or output_attentions

        layer_outputs, layer_attentions = [], []
        for index, (layer, state, table) in enumerate(zip(self.layers, cache.layers, relative_tables)):
            relative = table[:, :, -k_len:]  # [heads, d_head, K], distances K-1 ... 0
            if reuse_projections:
                if state.keys is None:
                    state.store_projected(*layer.project_memory(state.context()), self._capacity)
                out, query, keys, values, weights = layer(
                    hidden_states,
                    relative,
                    memory_keys=state.keys,
                    memory_values=state.values,
                    memory_length=state.projected_len,
                    attention_mask=mask,
                    need_weights=need_weights,
                )
            else:
                tail = recent_kv[index]
                if tail is not None:  # the memories' last rows are the previous chunk's inputs (the oldest may be gone)
                    _, m_len, p_len = state.lengths()
                    tail = tail[:, max(0, tail.shape[1] - m_len - p_len) :]
                out, query, keys, values, weights = layer(
                    hidden_states,
                    relative,
                    memory=state.context(),
                    attention_mask=mask,
                    need_weights=need_weights,
                    memory_tail_kv=tail,
                )
                # this chunk's projection, as the raw [batch, q, 2 * hidden] layout of kv_proj
                recent_kv[index] = torch.cat(
                    [t[:, :, -q_len:].transpose(1, 2).flatten(2) for t in (keys, values)], dim=-1
                ).detach()
            starts_segment = state.pending.shape[1] == 0
            if output_attentions:
                layer_attentions.append(self._slot_layout(weights, state))
            self._store_chunk(state, hidden_states.detach(), valid, weights if self.track_usage else None)
            if completes_segment:
                # the chunk is the whole segment when it started one: its projections can serve the reconstruction
                projections = (query, keys, values) if starts_segment else None
                loss = self._update_memory(layer, state, projections)
                if loss is not None:
                    reconstruction_losses.append(loss)
            layer_outputs.append(out)
            hidden_states = out
        return hidden_states, layer_outputs, layer_attentions

    def _slot_layout(self, weights: torch.Tensor, state) -> torch.Tensor:
        """[batch, heads, q, c_len + m_len + p_len + q] probabilities -> [batch, heads, q, c_mem_len + mem_len +
        segment_length]: the compressed-memory slots (newest last), the memory slots (newest last), then the
        positions of the current segment; slots not held yet are zero. Every chunk of a call lands in the same
        layout, so the layers' attentions concatenate over the whole input."""
        config = self.config
        c_len, m_len, _ = state.lengths()
        compressed, memory, segment = weights.split([c_len, m_len, weights.shape[-1] - c_len - m_len], dim=-1)
        layout = weights.new_zeros(*weights.shape[:-1], config.c_mem_len + config.mem_len + config.segment_length)
        layout[..., config.c_mem_len - c_len : config.c_mem_len] = compressed
        memory_end = config.c_mem_len + config.mem_len
        layout[..., memory_end - m_len : memory_end] = memory
        layout[..., memory_end : memory_end + segment.shape[-1]] = segment
        return layout

    def _store_chunk(self, state, inputs, valid, weights) -> None:
        """Append the chunk's layer inputs to the pending segment (and its keys/values when reusing projections);
        accumulate attention received per slot for the most-used compression."""
        if weights is not None:
            # [batch, heads, q, K] -> attention received by each key slot from the chunk's real tokens
            received = (weights.detach().float() * valid[:, None, :, None]).sum(dim=(1, 2))
            c_len, m_len, p_len = state.lengths()
            state.mem_usage = state.mem_usage + received[:, c_len : c_len + m_len]
            pending_usage = state.pending_usage + received[:, c_len + m_len : c_len + m_len + p_len]
            state.pending_usage = torch.cat([pending_usage, received[:, c_len + m_len + p_len :]], dim=1)
        state.pending = torch.cat([state.pending, inputs], dim=1)
        state.pending_valid = torch.cat([state.pending_valid, valid], dim=1)
        if state.keys is not None:
            state.projected_len += inputs.shape[1]  # the layer already wrote the chunk's keys/values in place

    def _update_memory(self, layer, state, projections=None) -> torch.Tensor | None:
        """The schedule after a complete segment: mem = cat(mem, segment); evict the oldest
        ceil((len - mem_len) / c) * c into f_c; c_mem keeps its newest c_mem_len entries.
        `projections` (segment queries, keys/values of [c_mem, mem, segment]) lets the reconstruction loss reuse
        what the layer already computed."""
        config = self.config
        rate = self.eviction_unit
        c_len, m_len, _ = state.lengths()
        segment, segment_valid = state.pending, state.pending_valid
        memory = torch.cat([state.mem, segment], dim=1)
        memory_valid = torch.cat([state.mem_valid, segment_valid], dim=1)
        usage = torch.cat([state.mem_usage, state.pending_usage], dim=1) if self.track_usage else None
        keys = values = None
        if state.keys is not None:
            all_keys, all_values = state.projected()
            keys, values = all_keys[:, :, c_len:], all_values[:, :, c_len:]  # of [mem, segment]
        overflow = memory.shape[1] - config.mem_len
        n_evict = -(-overflow // rate) * rate if overflow > 0 else 0
        loss = None
        if n_evict > 0 and not self.compresses:  # Transformer-XL: the evicted memories are dropped
            memory, memory_valid = memory[:, n_evict:], memory_valid[:, n_evict:]
            if keys is not None:
                state.store_projected(keys[:, :, n_evict:], values[:, :, n_evict:], self._capacity)
        elif n_evict > 0:
            evicted, evicted_valid = memory[:, :n_evict], memory_valid[:, :n_evict]
            train_compression = self.training and torch.is_grad_enabled() and config.reconstruction_loss != "none"
            with torch.set_grad_enabled(train_compression):
                compressed, compressed_valid = layer.compress_memory(
                    evicted, evicted_valid, None if usage is None else usage[:, :n_evict]
                )
            if train_compression:
                if config.reconstruction_loss == "attention":
                    reused = None
                    if projections is not None:
                        query, all_keys, all_values = projections  # evicted = first n_evict after c_mem
                        evicted_kv = slice(c_len, c_len + n_evict)
                        reused = (query, all_keys[:, :, evicted_kv], all_values[:, :, evicted_kv])
                    loss = layer.attention_reconstruction_loss(
                        segment, segment_valid, evicted, evicted_valid, compressed, compressed_valid, reused
                    )
                else:
                    loss = layer.autoencoding_loss(evicted, evicted_valid, compressed)
            compressed = compressed.detach()
            state.c_mem = torch.cat([state.c_mem, compressed], dim=1)[:, -config.c_mem_len :]
            state.c_mem_valid = torch.cat([state.c_mem_valid, compressed_valid], dim=1)[:, -config.c_mem_len :]
            memory, memory_valid = memory[:, n_evict:], memory_valid[:, n_evict:]
            if usage is not None:
                usage = usage[:, n_evict:]
            if keys is not None:
                c_keys, c_values = layer.project_memory(compressed)
                keys, values = keys[:, :, n_evict:], values[:, :, n_evict:]
                c_keys = torch.cat([all_keys[:, :, :c_len], c_keys], dim=2)[:, :, -config.c_mem_len :]
                c_values = torch.cat([all_values[:, :, :c_len], c_values], dim=2)[:, :, -config.c_mem_len :]
                keys, values = torch.cat([c_keys, keys], dim=2), torch.cat([c_values, values], dim=2)
                state.store_projected(keys, values, self._capacity)
        # without an eviction the buffers already read [c_mem, mem + segment]: nothing to move
        state.mem, state.mem_valid = memory, memory_valid
        state.pending, state.pending_valid = segment[:, :0], segment_valid[:, :0]
        if usage is not None:
            state.mem_usage, state.pending_usage = usage, usage[:, :0]
        return loss


class CompressiveForCausalLM(CompressivePreTrainedModel, GenerationMixin):
    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}

    def __init__(self, config: CompressiveConfig):
        super().__init__(config)
        self.model = CompressiveModel(config)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # the cache holds memories, not keys/values: forward creates a CompressiveMemoryCache

    def _prepare_cache_for_generation(self, generation_config, model_kwargs, generation_mode, *args, **kwargs):
        """generate() starts from an empty CompressiveMemoryCache (unless given one), so that it sees a compileable
        cache and compiles the decoding steps where it compiles (CUDA; any device with `compile_config`). Assisted
        and prompt-lookup decoding (and an assistant model's own generate) get a croppable one: it can take back
        as many tokens as one generate() call adds, at least 64 and two segments."""
        check_assisted_decoding(generation_mode)
        use_own_cache(generation_config, model_kwargs, "CompressiveMemoryCache")
        if model_kwargs.get(CACHE_NAME) is None and generation_config.use_cache is not False:
            margin = 0
            assisted = generation_mode == GenerationMode.ASSISTED_GENERATION or generation_config.is_assistant
            if assisted and not self.model.track_usage:
                margin = max(64, 2 * self.config.segment_length, (generation_config.max_new_tokens or 0) + 1)
            model_kwargs[CACHE_NAME] = CompressiveMemoryCache(self.config.num_hidden_layers, crop_margin=margin)
        return super()._prepare_cache_for_generation(generation_config, model_kwargs, generation_mode, *args, **kwargs)

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: CompressiveMemoryCache | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        return_dict: bool | None = None,
        past_key_values: CompressiveMemoryCache | None = None,
        output_attentions: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CompressiveCausalLMOutput | tuple:
        """labels [batch, seq] are shifted here (HF convention; -100 ignored): position t predicts labels[t + 1],
        over the whole input, across segment boundaries. `shift_labels` [batch, seq] (already shifted: position t
        predicts shift_labels[t], as Trainer passes them under sequence parallelism) may replace labels.
        `num_items_in_batch` (from Trainer) normalises the sum."""
        return_dict = return_dict if return_dict is not None else self.config.return_dict
        num_items_in_batch = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            cache=cache if cache is not None else past_key_values,
            inputs_embeds=inputs_embeds,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=True,
            **kwargs,
        )
        hidden_states = outputs.last_hidden_state
        if logits_to_keep:
            hidden_states = hidden_states[:, -logits_to_keep:]
        logits = self.lm_head(hidden_states)  # [batch, seq, vocab]

        loss = lm_loss = None
        reconstruction_loss = outputs.reconstruction_loss
        if check_lm_labels(labels, shift_labels, logits.shape[:2], self.config.vocab_size):
            lm_loss = self.loss_function(
                logits, labels, self.config.vocab_size, num_items_in_batch=num_items_in_batch, shift_labels=shift_labels
            )
            loss = lm_loss
            if reconstruction_loss is not None:
                loss = lm_loss + self.config.reconstruction_loss_weight * reconstruction_loss
        result = CompressiveCausalLMOutput(
            loss=loss,
            lm_loss=lm_loss,
            reconstruction_loss=reconstruction_loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
        )
        return result if return_dict else result.to_tuple()

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        cache: CompressiveMemoryCache | None = None,
        attention_mask: torch.Tensor | None = None,
        inputs_embeds: torch.FloatTensor | None = None,
        use_cache: bool | None = None,
        next_sequence_length: int | None = None,
        is_first_iteration: bool | None = False,
        past_key_values: CompressiveMemoryCache | None = None,
        **kwargs,
    ) -> dict:
        """Feeds only the tokens the cache has not seen; the (full-length) attention mask is mapped onto the
        bounded memory inside forward. Decoding steps (one new token after the first iteration) pass no mask: the
        token is one generate() appended, always real, and a forward without a mask knows it on the host."""
        cache = cache if cache is not None else past_key_values
        seen = cache.get_seq_length() if cache is not None else 0
        if next_sequence_length == 1 and not is_first_iteration and seen:
            attention_mask = None
        model_inputs = {"cache": cache, "attention_mask": attention_mask, "use_cache": use_cache}
        if inputs_embeds is not None and is_first_iteration:  # the embeddings the cache has not seen
            new = next_sequence_length if next_sequence_length is not None else inputs_embeds.shape[1] - seen
            model_inputs.update(input_ids=None, inputs_embeds=inputs_embeds[:, inputs_embeds.shape[1] - new :])
        elif next_sequence_length is not None:
            model_inputs["input_ids"] = input_ids[:, -next_sequence_length:]
        else:
            model_inputs["input_ids"] = input_ids[:, seen:] if seen else input_ids
        for key in ("output_hidden_states", "output_attentions", "return_dict", "logits_to_keep"):
            if key in kwargs:
                model_inputs[key] = kwargs[key]
        return model_inputs


__all__ = [
    "CompressiveForCausalLM",
    "CompressiveModel",
    "CompressivePreTrainedModel",
]
