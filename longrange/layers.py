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


def is_exporting() -> bool:
    """Whether torch.export is tracing (torch >= 2.7; before: never known, and a dynamic length does not export).

    Read from the flag torch.export sets, not from `torch.compiler.is_exporting()`: the dynamo of torch 2.7-2.11
    answers that call with True inside every torch.compile (pytorch/pytorch#176347; 2.13 reads the flag too), so
    compiled graphs took the export-only paths (the Sinkhorn routing's k rounds instead of one sort). On torch 2.7,
    strict export's dynamo pass comes before the flag is set and reads False; non-strict export (the default, and
    torch.onnx's first strategy) sets it."""
    check = getattr(torch.compiler, "is_exporting", None)
    if check is None:
        return False
    flag = getattr(torch.compiler, "_is_exporting_flag", None)
    return check() if flag is None else bool(flag)


def merge_heads(out: torch.Tensor) -> torch.Tensor:
    """[batch, heads, len, d_head] -> [batch, len, heads * d_head]. While exporting, through an explicit contiguous
    copy: torch.onnx's decomposition of `scaled_dot_product_attention` returns other strides than the traced op, so a
    `reshape` traced as a view fails there (pytorch/pytorch#136543); eager and compiled calls keep the plain reshape
    (a view where the kernel's layout allows)."""
    out = out.transpose(1, 2)
    if is_exporting():
        out = out.clone(memory_format=torch.contiguous_format)
    return out.reshape(*out.shape[:2], -1)


def where(condition: torch.Tensor, input: torch.Tensor, other: torch.Tensor) -> torch.Tensor:
    """`torch.where`; over bool tensors, while exporting, as `(condition & input) | (~condition & other)` (the same
    values): onnxruntime has no kernel for ONNX's Where over bool tensors (microsoft/onnxruntime#9539, #24127), which
    the decoding caches' in-place masks would otherwise need."""
    if input.dtype == torch.bool and is_exporting():
        return (condition & input) | (~condition & other)
    return torch.where(condition, input, other)


def unit_output(module: nn.Module, output: torch.Tensor) -> torch.Tensor:
    """`output` of `module`, a tensor of its own (not a view) where `module` is an FSDP2 unit of its own (weight
    tie's shared modules are): FSDP2 hooks a unit's output for the backward's parameter gathering, and an in-place
    op on a view (a linear layer's 3-D output is one) would lose that hook, so torch warns about every such output.
    Elsewhere, and while compiling, the output is returned as it is: no copy."""
    if torch.compiler.is_compiling() or output._base is None or not torch.is_grad_enabled():
        return output
    if not torch.distributed.is_available():
        return output
    from torch.distributed.fsdp import FSDPModule

    return output.clone() if isinstance(module, FSDPModule) else output


def register_fsdp_methods(layers: nn.ModuleList) -> None:
    """Per-layer FSDP units (FSDP2's `fully_shard` on each layer, as Accelerate's `TRANSFORMER_BASED_WRAP` does
    with `_no_split_modules`): registers each layer's `FSDP_FORWARD_METHODS` (the methods the model calls on a layer
    outside its forward) as FSDP forward methods, so that calling one gathers the layer's parameters (and
    reduces their gradients) as its forward does. Once per layer; a no-op for layers that are not FSDP units.
    Called by the model's forward outside compilation (sharding happens after construction, on the user's side)."""
    if torch.compiler.is_compiling() or not torch.distributed.is_available():
        return
    from torch.distributed.fsdp import FSDPModule, register_fsdp_forward_method

    for layer in layers:  # fully_shard makes each unit an instance of FSDPModule
        if isinstance(layer, FSDPModule) and not getattr(layer, "_fsdp_methods_registered", False):
            for name in layer.FSDP_FORWARD_METHODS:
                register_fsdp_forward_method(layer, name)
            layer._fsdp_methods_registered = True


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
        # one pass over the [.., q_len, k_len] scores: masked entries become the most negative float (a Python
        # number: a tensor made of it on an accelerator would be a host-to-device copy, which waits for the device)
        additive = torch.where(
            mask, additive if additive is not None else query.new_zeros(()), torch.finfo(query.dtype).min
        )
    probs = None
    if implementation == "sdpa" and not return_weights:
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=additive, dropout_p=dropout, scale=scale)
    else:
        scores = _scaled_scores(query, key, additive, scale)
        # softmax in float32 at least (float64 inputs keep their precision)
        probs = scores.to(torch.promote_types(scores.dtype, torch.float32)).softmax(dim=-1).to(query.dtype)
        probs = F.dropout(probs, p=dropout, training=dropout > 0)
        out = torch.matmul(probs, value)
    if mask is not None:
        # a query with no visible key attends to nothing: output exactly zero
        any_visible = mask.any(dim=-1, keepdim=True)  # (bool: the product keeps the float dtype, with no cast)
        out = out * any_visible
        if probs is not None:
            probs = probs * any_visible
    if return_weights:
        return out, probs
    return out


def _scaled_scores(query: torch.Tensor, key: torch.Tensor, additive: torch.Tensor | None, scale: float):
    """scale * query key^T + additive, the explicit softmax's input. When `additive` has the scores' full shape (a
    position bias, bucket masks), one batched product adds it in its epilogue (`baddbmm`), where a product, a
    scaling and an addition would pass over the [..., q_len, k_len] scores three times."""
    shape = (*query.shape[:-1], key.shape[-2])
    if additive is None or additive.shape != shape or key.shape[:-2] != query.shape[:-2]:
        scores = torch.matmul(query, key.transpose(-1, -2)) * scale
        return scores if additive is None else scores + additive
    bias, flat_query, flat_key = (t.reshape(-1, *t.shape[-2:]) for t in (additive, query, key))
    return torch.baddbmm(bias, flat_query, flat_key.transpose(1, 2), alpha=scale).view(shape)


class FeedForward(nn.Module):
    """Position-wise feed-forward: Linear -> GELU (or GEGLU when `glu`) -> dropout -> Linear.

    On the CPU, inputs with more than `block_elements` intermediate activations are computed over blocks of rows
    (the same numbers): the CPU allocator serves tensors of 32 MB and more with freshly mapped pages on every call,
    whose page faults cost more than the smaller matrix products (one training step of the Sinkhorn benchmark size:
    1.0 s of 8.0 s). Accelerators' caching allocators reuse memory, and there more blocks only mean more kernel
    launches, so other devices run one pass."""

    block_elements = 1 << 22  # 16 MB of float32 intermediate activations per block

    def __init__(self, hidden_size: int, intermediate_size: int, dropout: float = 0.0, glu: bool = False):
        super().__init__()
        self.glu = glu
        self.up = nn.Linear(hidden_size, intermediate_size * (2 if glu else 1))
        self.down = nn.Linear(intermediate_size, hidden_size)
        self.dropout = nn.Dropout(dropout)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.device.type != "cpu" or is_exporting():  # one pass (export: any length)
            return unit_output(self, self._rows(hidden_states))
        rows = hidden_states.shape[:-1].numel()
        blocks = -(-rows * self.up.out_features // self.block_elements)
        if blocks > 1:
            flat = hidden_states.reshape(rows, hidden_states.shape[-1])
            out = torch.cat([self._rows(part) for part in flat.chunk(blocks)])
            return unit_output(self, out.view(*hidden_states.shape[:-1], out.shape[-1]))
        return unit_output(self, self._rows(hidden_states))

    def _rows(self, hidden_states: torch.Tensor) -> torch.Tensor:
        h = self.up(hidden_states)  # [..., intermediate (x2 with GLU)]
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


def distance_encodings(length: int, dim: int, like: torch.Tensor) -> torch.Tensor:
    """[length, dim] sinusoidal encodings of the distances length - 1 ... 0, in the dtype and on the device of
    `like` (the Compressive layers' relative positions: the same for every layer, each projects them itself)."""
    distances = torch.arange(length - 1, -1, -1, device=like.device)
    return sinusoidal_embedding(distances, dim).to(like.dtype)


# ----------------------------------------------------------------------------------------------------------------
# Blockwise attention for training
# ----------------------------------------------------------------------------------------------------------------


def _shifted(table: torch.Tensor, first_row: int, q_len: int, k_len: int, keys: int) -> torch.Tensor:
    """A [N, rows, keys] view of `table` [N, rows + 1, keys + 1]: the products of query rows first_row ...
    first_row + rows (the last a spare) with the encodings of the last `keys` distance columns (of the K columns
    for distances K-1 ... 0), followed by a zero column. Entry (r, j) of the view is the score of query row
    first_row + r for its distance to key j, (k_len - q_len + first_row + r) - j. The view steps `keys` elements from
    row to row of the (keys + 1)-wide table, so no two entries share a slot and the backward pass can write through
    it. Entries of future keys (negative distances) read unrelated but finite values, which the mask removes."""
    n, rows, width = table.shape
    # column of (r, j) within the kept columns: (q_len - 1 - first_row - r + j) - (k_len - keys)
    offset = q_len - 1 - first_row - (k_len - keys)
    return table.as_strided((n, rows - 1, keys), (table.stride(0), width - 1, 1), table.storage_offset() + offset)


class _BlockwiseAttention(torch.autograd.Function):
    """softmax(q . k + shift(p . R), masked) v computed over blocks of query rows, with a hand-written backward.

    Against autograd over the same operations it keeps every temporary at the size of one block (a few MB, which
    the allocator recycles instead of mapping fresh pages for each [batch, heads, q, K] tensor), fuses the
    scaling, the relative-position term, the mask and the softmax into in-place passes over the block, and skips
    the keys a block of causal queries cannot see. Inputs are flattened to [N = batch * heads, ...]."""

    @staticmethod
    def forward(ctx, query, key, value, mask, position_query, relative, heads, dropout, causal, block_rows):
        # query [N, q, d] (scaled), key/value [N, K, d], mask bool [B, 1 or H, q, K] (N = B * H),
        # position_query [N, q, d] (scaled) and relative [H, d, K] or None
        n_rows, q_len, k_len = query.shape[0], query.shape[1], key.shape[1]
        batch = n_rows // heads
        relative_ext = None
        if relative is not None:
            # [N, d, K + 1]: a zero column, then the spare row of each block reads it (see `_shifted`)
            relative_ext = (
                F.pad(relative, (0, 1))[None].expand(batch, -1, -1, -1).reshape(n_rows, relative.shape[1], -1)
            )
            position_query = F.pad(position_query, (0, 0, 0, 1))  # a spare (zero) query row after the last
        out = query.new_empty(query.shape[0], q_len, value.shape[-1])
        probs, keeps = [], []
        neg = torch.finfo(query.dtype).min
        # a query that sees no key at all (padding) attends to nothing: its output row is zeroed at the end, and its
        # gradient in backward (cheaper than zeroing its weights, a pass over every block's [N, rows, keys])
        visible = mask.any(dim=-1).expand(batch, heads, q_len).reshape(n_rows, q_len, 1).to(query.dtype)
        for start in range(0, q_len, block_rows):
            end = min(q_len, start + block_rows)
            keys_seen = k_len - q_len + end if causal else k_len  # later keys are in every row's future
            scores = torch.matmul(query[:, start:end], key[:, :keys_seen].transpose(1, 2))  # [N, rows, keys]
            if relative_ext is not None:
                # only distances up to the block's largest are needed: the last `keys_seen` + 1 columns
                table = torch.bmm(position_query[:, start : end + 1], relative_ext[:, :, k_len - keys_seen :])
                scores += _shifted(table, start, q_len, k_len, keys_seen)
            blocked = ~mask[:, :, start:end, :keys_seen]  # [B, 1 or H, rows, keys]
            scores = scores.view(batch, heads, end - start, keys_seen).masked_fill_(blocked, neg)
            weights = torch.softmax(scores, dim=-1)
            del scores
            weights = weights.view(n_rows, end - start, keys_seen)
            used = weights
            if dropout > 0:
                keep = torch.rand_like(weights) >= dropout
                used = weights * keep / (1 - dropout)
                keeps.append(keep)
            torch.bmm(used, value[:, :keys_seen], out=out[:, start:end])
            probs.append(weights)
        out.mul_(visible)  # (never NaN or a uniform average: finite scores, a uniform softmax, zeroed here)
        ctx.save_for_backward(query, key, value, position_query, relative_ext, out, visible)
        ctx.probs, ctx.keeps = probs, keeps
        ctx.options = (heads, dropout, causal, block_rows, relative is not None)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        # the products below run in the inputs' dtype even when backward() is called inside an autocast region
        saved = ctx.saved_tensors  # unpacked once (activation checkpointing allows no more)
        with torch.autocast(grad_out.device.type, enabled=False):
            return _BlockwiseAttention._backward(ctx, saved, grad_out.to(saved[0].dtype))

    @staticmethod
    def _backward(ctx, saved, grad_out):
        query, key, value, position_query, relative_ext, out, visible = saved
        heads, dropout, causal, block_rows, has_relative = ctx.options
        n_rows, q_len, k_len = query.shape[0], query.shape[1], key.shape[1]
        grad_out = grad_out * visible  # rows that see no key: zero output, no gradient
        row_dots = torch.linalg.vecdot(grad_out, out)[..., None]  # [N, q, 1]
        grad_query = torch.empty_like(query)
        grad_position = torch.empty_like(position_query[:, :q_len]) if has_relative else None
        grad_key = grad_value = grad_relative = None
        starts = list(range(0, q_len, block_rows))
        # last block first: it sees every key (and every distance column), so its products allocate the
        # gradients of keys, values and encodings, and the earlier blocks add into their leading parts in place
        for index in reversed(range(len(starts))):
            start = starts[index]
            end = min(q_len, start + block_rows)
            keys_seen = k_len - q_len + end if causal else k_len
            weights = ctx.probs[index]  # [N, rows, keys]
            d_out = grad_out[:, start:end]
            used = weights
            if dropout > 0:
                keep = ctx.keeps[index]
                used = weights * keep / (1 - dropout)
            if grad_value is None:
                grad_value = torch.bmm(used.transpose(1, 2), d_out)
            else:
                grad_value[:, :keys_seen] += torch.bmm(used.transpose(1, 2), d_out)
            grad_scores = torch.matmul(d_out, value[:, :keys_seen].transpose(1, 2))  # d weights (after dropout)
            if dropout > 0:
                grad_scores.mul_(keep).div_(1 - dropout)
            # softmax backward in place: dS = P * (dP - sum_j dP P), where sum_j dP P = dO . O (even with dropout)
            grad_scores.sub_(row_dots[:, start:end]).mul_(weights)
            torch.bmm(grad_scores, key[:, :keys_seen], out=grad_query[:, start:end])
            if grad_key is None:
                grad_key = torch.bmm(grad_scores.transpose(1, 2), query[:, start:end])
            else:
                grad_key[:, :keys_seen] += torch.bmm(grad_scores.transpose(1, 2), query[:, start:end])
            if has_relative:
                columns = slice(k_len - keys_seen, None)
                grad_table = grad_scores.new_zeros(n_rows, end - start + 1, keys_seen + 1)
                _shifted(grad_table, start, q_len, k_len, keys_seen).copy_(grad_scores)
                del grad_scores
                relative_t = relative_ext[:, :, columns].transpose(1, 2)
                torch.bmm(grad_table[:, :-1], relative_t, out=grad_position[:, start:end])
                position_t = position_query[:, start : end + 1].transpose(1, 2)
                if grad_relative is None:
                    grad_relative = torch.bmm(position_t, grad_table)
                else:
                    grad_relative[:, :, columns] += torch.bmm(position_t, grad_table)
        if has_relative:
            grad_relative = grad_relative.view(-1, heads, *grad_relative.shape[1:]).sum(0)[..., :-1]
        return grad_query, grad_key, grad_value, None, grad_position, grad_relative, None, None, None, None


def blockwise_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor,
    scale: float,
    dropout: float = 0.0,
    causal: bool = False,
    position_query: torch.Tensor | None = None,
    relative: torch.Tensor | None = None,
    block_elements: int = 1 << 20,
) -> torch.Tensor:
    """Training-time attention, numerically `attend(...)` (eager) with an optional Transformer-XL position term.

    query [B, H, q, d_head], key/value [B, H, K, d_head], mask bool broadcastable to [B, 1 or H, q, K]
    (True = may attend); `causal=True` promises that query i never sees key j > K - q + i (the mask must say so
    too: it only lets the kernel skip those keys). With `relative` [H, d_head, K] (encodings of distances K-1 ...
    0) and `position_query` [B, H, q, d_head], score(i, j) = scale * (query_i . key_j + position_query_i .
    relative_{(K - q + i) - j}). Rows that see no key give zeros. Computed over blocks of about
    `block_elements` scores; see `_BlockwiseAttention`.
    """
    batch, heads, q_len, d_head = query.shape
    k_len = key.shape[2]
    dtype = query.dtype
    if relative is not None and not causal:
        raise ValueError("the relative-position term needs causal=True (future distances are not encoded)")
    with torch.autocast(query.device.type, enabled=False):
        flat = [t.to(dtype).reshape(batch * heads, t.shape[2], t.shape[3]) for t in (query * scale, key, value)]
        mask = mask.expand(batch, mask.shape[1], q_len, k_len)
        if relative is not None:
            position_query = (position_query * scale).to(dtype).reshape(batch * heads, q_len, d_head)
            relative = relative.to(dtype)
        block_rows = max(1, min(q_len, block_elements // max(1, batch * heads * k_len)))
        out = _BlockwiseAttention.apply(*flat, mask, position_query, relative, heads, dropout, causal, block_rows)
    return out.view(batch, heads, q_len, -1)


def blockwise_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The blockwise kernel behind transformers' attention interface, registered as attn_implementation="blockwise"
    (so `from_pretrained(..., attn_implementation="blockwise")` is accepted, and any transformers model can train
    with it on the CPU). query [B, H, q, d], key/value [B, H_kv, K, d]; attention_mask None (causal), bool (True =
    attend) or additive float, broadcastable to [B, 1 or H, q, K]. Returns ([B, q, H, d], None)."""
    batch, heads, q_len, d_head = query.shape
    k_len = key.shape[2]
    if key.shape[1] != heads:  # grouped-query attention: each key/value head serves heads / H_kv query heads
        key, value = (t.repeat_interleave(heads // t.shape[1], dim=1) for t in (key, value))
    if attention_mask is None:
        causal = getattr(module, "is_causal", True) and q_len > 1
        mask = torch.ones(q_len, k_len, dtype=torch.bool, device=query.device)
        mask = mask.tril(k_len - q_len) if causal else mask
    elif attention_mask.dtype == torch.bool:
        mask = attention_mask
    else:
        mask = attention_mask > torch.finfo(attention_mask.dtype).min / 2
    mask = mask[(None,) * (4 - mask.dim())]
    scale = d_head**-0.5 if scaling is None else scaling
    out = blockwise_attention(query, key, value, mask, scale, dropout=dropout if module.training else 0.0)
    return out.transpose(1, 2).contiguous(), None


def _register_blockwise() -> None:
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register("blockwise", blockwise_attention_forward)
    try:  # masks for it are made as for sdpa (bool, True = attend)
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

        AttentionMaskInterface.register("blockwise", sdpa_mask)
    except ImportError:
        pass


_register_blockwise()


def put_along(buffer: torch.Tensor, dim: int, index: torch.Tensor, values: torch.Tensor, accumulate: bool = False):
    """In place, buffer[b, .., index[b, j], ..] = values[b, .., j, ..] along `dim` >= 1 (the same slots for every
    entry of the dims between 0 and `dim`, e.g. the heads), for index [batch, n] (distinct per row); with
    `accumulate`, added instead: how the static caches write.

    Eager, a `scatter_` / `scatter_add_` (the cheaper call: 15 us against 40 us for an `index_put_` on a
    [1, 8, 1100, 64] buffer on the CPU). Compiled (inductor), an `index_put_`: there a `scatter_` becomes a kernel
    that rewrites the whole buffer into a copy plus a second kernel that copies it back (an 8 MiB buffer on the CPU:
    1 ms against 70 us), and a compiled decoding step would cost more as the cache's capacity grows."""
    if not 1 <= dim < buffer.dim():
        raise ValueError(f"put_along: dim must be between 1 and {buffer.dim() - 1}, got {dim}")
    if not torch.compiler.is_compiling():
        shape = (index.shape[0],) + (1,) * (dim - 1) + (index.shape[1],) + (1,) * (buffer.dim() - dim - 1)
        index = index.reshape(shape).expand(values.shape)  # (one view: unit dims only)
        buffer.scatter_add_(dim, index, values) if accumulate else buffer.scatter_(dim, index, values)
        return
    shape = [1] * (dim + 1)  # indices broadcast to [batch, buffer.shape[1], .., buffer.shape[dim - 1], n]
    indices = [torch.arange(index.shape[0], device=index.device).view([-1] + shape[1:])]
    for d in range(1, dim):
        indices.append(torch.arange(buffer.shape[d], device=index.device).view(shape[:d] + [-1] + shape[d + 1 :]))
    indices.append(index.view([index.shape[0]] + shape[1:-1] + [index.shape[1]]))
    buffer.index_put_(tuple(indices), values, accumulate=accumulate)


def real_tokens_first(valid: torch.Tensor) -> torch.Tensor:
    """[batch, seq] bool (True = real token) -> [batch, seq] indices that put each row's real tokens first, in
    their order, then its padding: what both models use so that padding never moves a row's segments or buckets.
    A stable sort of the padding flags, written as a sort of keys without ties (flag * seq + position), which any
    sort orders the same way: torch.onnx exports no stable sort."""
    seq = valid.shape[1]
    key = (~valid).long() * seq + torch.arange(seq, device=valid.device)  # [batch, seq], distinct in each row
    return key.argsort(dim=1)


def permute_tokens(t: torch.Tensor, order: torch.Tensor | None) -> torch.Tensor:
    """t [b, L, e] with its tokens in the order `order` [b, L] (None: unchanged)."""
    return t if order is None else t.gather(1, order[..., None].expand_as(t))


def permute_map(t: torch.Tensor, order: torch.Tensor | None, keys: bool) -> torch.Tensor:
    """An attention map t [b, h, L, K] with its query tokens (and, `keys`, its key tokens: K = L) in the order
    `order` [b, L] (None: unchanged)."""
    if order is None:
        return t
    b, h, length, k = t.shape
    t = t.gather(2, order[:, None, :, None].expand(b, h, length, k))
    return t.gather(3, order[:, None, None, :].expand(b, h, length, k)) if keys else t
