"""The model boundary: every check of what a caller hands to either model's forward, in one place.

Each check names the argument and what was expected, and raises `ValueError` (a wrong value or shape) or
`TypeError` (a wrong kind of object or dtype) before any computation, so a bad input never ends in a deep
`RuntimeError` / `IndexError` or a silent answer. Checks of shapes and dtypes read only metadata. Checks of values
(token ids and labels in range, masks holding only 0 and 1) never read a tensor back to the host: they are an
asynchronous device assert, which a CUDA step does not wait for and a compiled graph keeps; on the CPU (eager) its
failure becomes a `ValueError` here.

Both modeling files import this module (relative import), so `save_pretrained` copies it next to the weights.
"""

from __future__ import annotations

import torch

IGNORE_INDEX = -100


def assert_values(ok: torch.Tensor, message: str, describe=None) -> None:
    """Refuses when the 0-d bool tensor `ok` is False, without a host read (see the module docstring). `describe`
    (called only after a failure on the CPU) adds what was found to the message."""
    if torch.compiler.is_compiling() or ok.device.type != "cpu":
        torch._assert_async(ok, message)
        return
    try:
        torch._assert_async(ok, message)
    except RuntimeError as error:
        raise ValueError(message + (f", {describe()}" if describe is not None else "")) from error


def _tensor(value, name: str) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def _integer(t: torch.Tensor, name: str, what: str) -> None:
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise TypeError(f"{name} must hold integer {what} (torch.long), got dtype {t.dtype}")


def check_token_ids(input_ids: torch.Tensor, vocab_size: int, name: str = "input_ids") -> None:
    """Token ids in [0, vocab_size), checked on the device (no host read)."""
    in_range = ((input_ids >= 0) & (input_ids < vocab_size)).all()
    assert_values(
        in_range,
        f"{name} must lie in [0, vocab_size={vocab_size})",
        lambda: f"got values in [{input_ids.min()}, {input_ids.max()}]",
    )


def check_tokens(input_ids, inputs_embeds, vocab_size: int, embed_width: int) -> tuple[int, int]:
    """Exactly one of input_ids [batch, seq] (integer ids in [0, vocab_size)) and inputs_embeds [batch, seq,
    embed_width] (floating point), neither empty -> (batch, seq)."""
    if (input_ids is None) == (inputs_embeds is None):
        given = "both" if input_ids is not None else "neither"
        raise ValueError(f"pass exactly one of input_ids and inputs_embeds, got {given}")
    if input_ids is not None:
        _tensor(input_ids, "input_ids")
        _integer(input_ids, "input_ids", "token ids")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, seq], got shape {tuple(input_ids.shape)}")
        shape, name = input_ids.shape, "input_ids"
    else:
        _tensor(inputs_embeds, "inputs_embeds")
        if not inputs_embeds.dtype.is_floating_point:
            raise TypeError(f"inputs_embeds must be floating point, got dtype {inputs_embeds.dtype}")
        if inputs_embeds.dim() != 3 or inputs_embeds.shape[-1] != embed_width:
            raise ValueError(f"inputs_embeds must be [batch, seq, {embed_width}], got {tuple(inputs_embeds.shape)}")
        shape, name = inputs_embeds.shape, "inputs_embeds"
    if shape[0] == 0 or shape[1] == 0:
        raise ValueError(f"{name} is empty (shape {tuple(shape)}): needs at least one row and one token")
    if input_ids is not None:
        check_token_ids(input_ids, vocab_size)
    return shape[0], shape[1]


def check_mask(mask, batch: int, lengths: tuple[int, ...], new: int, name: str = "attention_mask") -> torch.Tensor:
    """A 2-D padding mask [batch, length] with length in `lengths` (the new tokens only or, as generate() passes it,
    every token so far), of bool, integer or floating dtype holding only 0 and 1 (1 = a real token) -> its last
    `new` columns (the new tokens') as bool. A float mask of other values (an additive bias, a soft weight) is
    refused rather than rounded; only the new columns' values are checked (older ones were checked when new)."""
    _tensor(mask, name)
    if mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] not in lengths:
        expected = " or ".join(f"[batch={batch}, {n}]" for n in dict.fromkeys(lengths))
        raise ValueError(f"{name} must be {expected} (1 = real token, 0 = padding), got shape {tuple(mask.shape)}")
    if mask.dtype.is_complex:
        raise TypeError(f"{name} must be bool, integer or floating point, got dtype {mask.dtype}")
    mask = mask[:, mask.shape[1] - new :]
    if mask.dtype != torch.bool:
        binary = ((mask == 0) | (mask == 1)).all()
        assert_values(binary, f"{name} must hold only 0 and 1 (1 = real token, 0 = padding)")
    return mask.bool()


def check_labels(labels, shape: tuple[int, int], vocab_size: int, name: str = "labels") -> None:
    """labels of `shape` [batch, seq], integer, each in [0, vocab_size) or -100 (ignored)."""
    _tensor(labels, name)
    _integer(labels, name, "token ids")
    if tuple(labels.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)} (batch, sequence), got {tuple(labels.shape)}")
    ok = (((labels >= 0) & (labels < vocab_size)) | (labels == IGNORE_INDEX)).all()
    assert_values(ok, f"{name} must lie in [0, vocab_size={vocab_size}) or be {IGNORE_INDEX} (ignored)")


def check_lm_labels(labels, shift_labels, shape: tuple[int, int], vocab_size: int) -> bool:
    """A causal LM's `labels` (shifted by the loss) and / or `shift_labels` (already shifted, as Trainer passes
    them under sequence parallelism), each checked by `check_labels` -> whether a loss is asked for."""
    for name, given in (("labels", labels), ("shift_labels", shift_labels)):
        if given is not None:
            check_labels(given, shape, vocab_size, name)
    return labels is not None or shift_labels is not None


def check_cache(cache, model_type: str, batch: int, cache_batch: int) -> None:
    """A cache of this model (a longrange cache states its model_type) whose rows match the inputs' batch
    (cache_batch 0: an empty cache, which takes any batch)."""
    other = getattr(cache, "model_type", None)
    if other is not None and other != model_type:
        raise TypeError(f"cache is a {type(cache).__name__} of a {other} model; this {model_type} model needs its own")
    if cache_batch and cache_batch != batch:
        raise ValueError(f"cache holds batch size {cache_batch}, inputs have batch size {batch}")


def check_position_ids(position_ids, batch: int, length: int) -> torch.Tensor:
    """position_ids [batch or 1, length] of integer positions -> [batch, length] (a view)."""
    _tensor(position_ids, "position_ids")
    _integer(position_ids, "position_ids", "positions")
    if position_ids.dim() != 2 or position_ids.shape[0] not in (1, batch) or position_ids.shape[1] != length:
        raise ValueError(f"position_ids must be [batch={batch}, {length}], got shape {tuple(position_ids.shape)}")
    return position_ids.expand(batch, length)


def check_document_bounds(bounds: dict, batch: int, length: int) -> None:
    """The flash-attention-style document boundaries that transformers' `DataCollatorWithFlattening` sends:
    `cu_seq_lens_q` / `cu_seq_lens_k` (equal; [documents + 1] cumulative lengths over the batch's flattened
    tokens, from 0 to batch * length, a row's first token always starting a document) and / or `seq_idx`
    [batch, length] (each token's document index, constant within a document). `max_length_q` / `max_length_k`
    are derived values and not checked."""
    for name in ("cu_seq_lens_q", "cu_seq_lens_k"):
        cu = bounds.get(name)
        if cu is None:
            continue
        _integer(_tensor(cu, name), name, "offsets")
        if cu.dim() != 1 or cu.shape[0] < 2:
            raise ValueError(f"{name} must be 1-D [documents + 1], got shape {tuple(cu.shape)}")
        rows = torch.arange(0, batch * length, length, device=cu.device)
        ok = (cu[0] == 0) & (cu[-1] == batch * length) & (cu.diff() > 0).all() & torch.isin(rows, cu).all()
        assert_values(
            ok, f"{name} must rise from 0 to batch * length = {batch * length}, every row starting a document"
        )
    q, k = bounds.get("cu_seq_lens_q"), bounds.get("cu_seq_lens_k")
    if q is not None and k is not None and (q.shape != k.shape or not torch.equal(q, k)):
        raise ValueError("cu_seq_lens_q and cu_seq_lens_k must be equal (documents attend within themselves)")
    seq_idx = bounds.get("seq_idx")
    if seq_idx is not None:
        _integer(_tensor(seq_idx, "seq_idx"), "seq_idx", "document indices")
        if tuple(seq_idx.shape) != (batch, length):
            raise ValueError(f"seq_idx must be [batch={batch}, {length}], got shape {tuple(seq_idx.shape)}")
