"""The memory update of the Compressive decoder layer: what a layer does with its memory between segments.

After every complete segment the segment runner (`segments_compressive.py`) calls each layer's `update_memory`:
the layer's cache layer hands back the entries the segment pushed out of the memory, the layer's f_c
(`compression.py`) compresses them, a reconstruction loss (attention or auto-encoding) trains f_c, and the
compressed entries go back to the cache. The same methods project stored memories into keys/values and give the
relative-position table, for the layer's forward and for the cache's static form (`cache_compressive_static.py`).

This is the `MemoryUpdate` mixin of `CompressiveDecoderLayer` (`modeling_compressive.py`), which keeps the
attention and feed-forward. A mixin rather than a submodule: the parameters it uses stay the layer's own, so the
names in the state dict (`layers.N.compress.*`, `layers.N.attention.*`) and the per-layer FSDP units are those of
the layer.

Only same-folder relative imports: `save_pretrained` copies this file next to the weights (`modeling_compressive.py`
imports it directly for that reason).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .compression import detached_norm, masked_mse
from .layers import attend, distance_encodings


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


class MemoryUpdate:
    """The decoder layer's memory update after a complete segment, its memory projection and reconstruction losses.

    A plain class mixed into `CompressiveDecoderLayer` (before `GradientCheckpointingLayer`): it holds methods only,
    no state and no `forward`. It expects the class that uses it to be an `nn.Module` that sets, in its `__init__`:
    `attention` (a `CompressiveAttention`), `attn_input_norm` (the attention's input norm: a LayerNorm for pre-LN,
    an Identity for post-LN), `compress` (f_c), `decompress` (the auto-encoding decoder, or None), `mem_len`,
    `c_mem_len` and `eviction_unit` (the memory schedule's sizes), `reconstruction` ("attention", "autoencoding" or
    "none") and `hidden_size`; `training` is nn.Module's own flag.
    """

    def update_memory(self, state, projections: tuple | None = None) -> torch.Tensor | None:
        """The schedule after a complete segment: the cache layer `state` hands back what the segment pushed out of
        its memory; f_c compresses it (trained by the reconstruction loss, returned when training) and the entries
        go back to the cache (dropped when c_mem_len = 0). `projections` (the segment's queries, the keys/values of
        [c_mem, mem, segment]) lets the attention reconstruction loss reuse what forward computed."""
        eviction = state.complete_segment(self.mem_len, self.eviction_unit)
        if eviction is None:
            return None
        if not self.c_mem_len:
            state.store_compressed(eviction)  # Transformer-XL: the evicted memories are dropped
            return None
        train_compression = self.training and torch.is_grad_enabled() and self.reconstruction != "none"
        with torch.set_grad_enabled(train_compression):
            compressed, compressed_valid = self.compress_memory(eviction.memories, eviction.valid, eviction.usage)
        loss = None
        if train_compression:
            loss = self._reconstruction_loss(eviction, compressed, compressed_valid, projections)
        state.store_compressed(eviction, compressed.detach(), compressed_valid, self.c_mem_len, self.project_memory)
        return loss

    def _reconstruction_loss(self, eviction, compressed, compressed_valid, projections) -> torch.Tensor:
        """The loss that trains f_c on one eviction: attention reconstruction (reusing the segment's queries and
        the evicted keys/values when forward computed them) or auto-encoding. A row trains f_c only when its real
        tokens completed the segment (its last token is real: real tokens come first), as the row alone would: a
        segment that its padding completed (after a shorter row's end) compresses, but trains nothing."""
        completed = eviction.segment_valid[:, -1:]  # [batch, 1]
        if self.reconstruction != "attention":
            return self.autoencoding_loss(eviction.memories, eviction.valid & completed, compressed)
        reused = None
        if projections is not None:
            query, all_keys, all_values = projections  # evicted = the first memories after c_mem
            evicted_kv = slice(eviction.c_len, eviction.c_len + eviction.memories.shape[1])
            reused = (query, all_keys[:, :, evicted_kv], all_values[:, :, evicted_kv])
        return self.attention_reconstruction_loss(
            eviction.segment,
            eviction.segment_valid & completed,
            eviction.memories,
            eviction.valid,
            compressed,
            compressed_valid,
            reused,
        )

    def position_table(self, length: int, like: torch.Tensor) -> torch.Tensor:
        """[heads, d_head, length]: the projected sinusoidal encodings of distances length - 1 ... 0 (in the dtype
        and on the device of `like`), so that the K keys of any chunk read the last K columns (a view)."""
        return self.relative_table(distance_encodings(length, self.hidden_size, like))

    # The layer's parameters used outside its forward (by `update_memory`, `position_table` and the cache's static
    # form): every such use goes through one of these methods (never a direct call of a submodule), so that under
    # per-layer FSDP units it gathers the layer's parameters as forward does (`register_fsdp_methods`).
    # `update_memory` and `position_table` touch parameters only through them and are not registered themselves
    # (a nested FSDP method would reshard on return).
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
            query = F.linear(detached_norm(self.attn_input_norm, segment.detach()), attention.q_proj.weight.detach())
            query = attention.split_heads(query)  # [batch, heads, s, d_head]

        def keys_values(memories):
            kv = F.linear(detached_norm(self.attn_input_norm, memories), attention.kv_proj.weight.detach())
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
        return masked_mse(prediction.transpose(1, 2), target.transpose(1, 2), segment_valid)

    def autoencoding_loss(self, evicted: torch.Tensor, evicted_valid: torch.Tensor, compressed: torch.Tensor):
        """MSE between the evicted memories and their reconstruction from the compressed ones (trains f_c and
        the decoder only: the evicted memories are detached)."""
        decoded = self.decompress(compressed.transpose(1, 2)).transpose(1, 2)  # [batch, n, hidden]
        return masked_mse(decoded, evicted.detach(), evicted_valid)
