"""How a call is laid out before a model's layers: packed documents as rows of their own, and a dynamic length
under torch.export padded to its bound. Everything else reaches the forward unchanged (`call_layout`).

Packed sequences: `DataCollatorWithFlattening` (and TRL's `SFTTrainer(packing=True)`) concatenate documents into
one row and restart `position_ids` at 0 for each; with `return_flash_attn_kwargs=True` they also send the
boundaries as `cu_seq_lens_q` / `cu_seq_lens_k` (with `max_length_q` / `max_length_k`), with
`return_seq_idx=True` each token's document index as `seq_idx`. transformers' models then attend within each
document only, and so do ours: each document becomes a row of its own that starts at its first token (so at a
bucket or segment boundary, with positions from 0 and an empty memory) and is padded at its end; the forward runs
on those rows with their padding mask (a row's outputs never depend on its padding), and every output goes back
to its token's place in the packed row. Each document's computation is then the one it gets when run alone.
Documents of similar length run together, a forward per group (`group_sizes`: the cheapest split, longest first,
when a group costs its rows' padded positions plus a call's fixed cost, `GROUP_COST`), so that many short documents
beside a long one are not all padded to its length.

Positions mark documents when every row's `position_ids` count up by one from 0 and restart at 0 at each new
document (padding skipped); other positions are not packed documents (each model keeps its own rule for them).
Refused with packed documents, naming the argument: padding in `attention_mask`, a cache or `use_cache=True`,
`output_attentions`.

Both modeling files import this module (relative import), so `save_pretrained` copies it next to the weights.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .inputs import check_document_bounds, check_position_ids
from .layers import is_exporting, real_tokens_first

# what DataCollatorWithFlattening(return_flash_attn_kwargs=True, return_seq_idx=True) adds to a batch
DOCUMENT_KWARGS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")


def pop_document_kwargs(kwargs: dict) -> dict:
    """The document boundaries among a language model's kwargs, taken out of them: the LM hands them to its base
    model (which lays the documents out), not to its loss."""
    return {name: kwargs.pop(name) for name in DOCUMENT_KWARGS if name in kwargs}


# A forward call's fixed cost, in padded tokens: what one more group of rows must save to be worth it. Measured with
# `benchmarks/benchmark_packing.py --calibrate` on 2 CPU cores: a training step's call costs 110-150 tokens at hidden
# 512 x 4 layers. A GPU call, bound by kernel launches, costs far more tokens: raise it there.
GROUP_COST = 128


def group_sizes(lengths: list[int], unit: int, cost: int = GROUP_COST) -> list[int]:
    """How many documents each group takes, for `lengths` sorted longest first: the split into consecutive groups
    that costs least, a group costing its documents x its longest (rounded up to `unit`: the model pads rows to a
    multiple of its bucket or segment) plus `cost` tokens for its call. Dynamic programming over the points where
    the rounded length changes (a split anywhere else only adds a call)."""
    rounded = [-(-n // unit) * unit for n in lengths]
    ends = [k + 1 for k in range(len(rounded)) if k + 1 == len(rounded) or rounded[k + 1] != rounded[k]]
    points = [0, *ends]  # candidate split points (documents before them)
    best, cut = [0] + [0] * len(ends), [0] * len(points)  # best[j]: least cost of the documents before points[j]
    for j in range(1, len(points)):
        best[j], cut[j] = min((best[i] + (points[j] - points[i]) * rounded[points[i]] + cost, i) for i in range(j))
    sizes, j = [], len(points) - 1
    while j:
        sizes.append(points[j] - points[cut[j]])
        j = cut[j]
    return sizes[::-1]


@dataclass
class DocumentGroup:
    """Documents of similar length as rows of their own [count, longest] (see the module)."""

    source: torch.Tensor  # [count, longest] long: each document token's flat index (row * seq + t); clamped after
    mask: torch.Tensor  # [count, longest] bool: a token of the document (False: padding after its end)
    rows: torch.Tensor  # [count] long: the packed row each document comes from

    def spread(self, t: torch.Tensor) -> torch.Tensor:
        """[batch, seq, ...] -> [count, longest, ...] (padding holds some token's value; the mask says which)."""
        return t.flatten(0, 1)[self.source]


@dataclass
class Documents:
    """The documents of packed rows [batch, seq], longest first, in groups of similar length (see the module)."""

    groups: list[DocumentGroup]
    back: torch.Tensor  # [batch * seq] long: each packed token's index in the groups' rows, flattened one after another
    shape: tuple[int, int]  # (batch, seq)

    @classmethod
    def of(cls, starts: torch.Tensor, unit: int = 1, cost: int = GROUP_COST) -> Documents:
        """starts [batch, seq] bool: True at the first token of each document (each row's first token is one);
        `unit`, `cost`: see `group_sizes`."""
        batch, seq = starts.shape
        flat = starts.flatten()
        first = flat.nonzero().squeeze(1)  # [count] flat index of each document's first token
        lengths = torch.cat([first[1:], first.new_full((1,), batch * seq)]) - first  # rows end where the next starts
        order = lengths.argsort(descending=True, stable=True)
        ordered = lengths[order].tolist()  # host read: the groups' lengths
        offset = torch.empty_like(first)  # each document's first token's index in the groups' flattened rows
        groups, done, placed = [], 0, 0
        for size in group_sizes(ordered, unit, cost):
            members, longest = order[done : done + size], ordered[done]
            steps = torch.arange(longest, device=starts.device)
            offset[members] = placed + torch.arange(size, device=starts.device) * longest
            groups.append(
                DocumentGroup(
                    source=(first[members, None] + steps).clamp_max(batch * seq - 1),
                    mask=steps < lengths[members, None],
                    rows=first[members] // seq,
                )
            )
            done, placed = done + size, placed + size * longest
        document = flat.long().cumsum(0) - 1  # [batch * seq] each token's document
        within = torch.arange(batch * seq, device=starts.device) - first[document]
        return cls(groups=groups, back=offset[document] + within, shape=(batch, seq))

    def gather(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The groups' [count, longest, ...] -> [batch, seq, ...]: each packed token's result back at its place."""
        return torch.cat([t.flatten(0, 1) for t in outputs])[self.back].unflatten(0, self.shape)


def _restarts(positions: torch.Tensor, real: torch.Tensor) -> torch.Tensor | None:
    """[batch, seq] positions and real tokens [batch, seq] (False: padding) -> True at each real token that
    starts a document, when the real tokens' positions are packed restarts (every row counts up by one from 0
    and restarts at 0 at each document); None otherwise. Padding is skipped (generate() gives it some position)."""
    order = real_tokens_first(real)
    kept, ordered = real.gather(1, order), positions.gather(1, order)  # each row's real tokens first
    zero = ordered == 0
    counts_on = ordered[:, 1:] == ordered[:, :-1] + 1
    if not bool((zero[:, 0] | ~kept[:, 0]).all() & (zero[:, 1:] | counts_on | ~kept[:, 1:]).all()):  # host read
        return None
    return (positions == 0) & real


def _real_tokens(mask, tokens: torch.Tensor) -> torch.Tensor | None:
    """[batch, length] bool, False at padding: the mask's last `length` columns (generate() passes the mask of
    every token so far); None for a mask that is not [batch, >= length]."""
    batch, length = tokens.shape[:2]
    if mask is None:
        return torch.ones(batch, length, dtype=torch.bool, device=tokens.device)
    if not isinstance(mask, torch.Tensor) or mask.dim() != 2 or mask.shape[0] != batch or mask.shape[1] < length:
        return None
    return mask[:, mask.shape[1] - length :] != 0


def document_starts(position_ids, bounds: dict, real: torch.Tensor, batch: int, length: int) -> torch.Tensor | None:
    """[batch, seq] bool, True at each document's first token, when the call's rows hold documents marked by
    packed-restart `position_ids` and / or the `bounds` (DOCUMENT_KWARGS); None when nothing marks documents.
    `real` [batch, seq]: False at padding. Marks that disagree are refused."""
    check_document_bounds(bounds, batch, length)
    marks = {}
    if position_ids is not None:
        restarts = _restarts(check_position_ids(position_ids, batch, length), real)
        if restarts is not None:
            marks["position_ids"] = restarts
        elif bounds:
            raise ValueError(
                f"position_ids must restart at 0 at each document's first token and count up by one inside it, as "
                f"{' and '.join(bounds)} mark documents"
            )
    cu = bounds.get("cu_seq_lens_q", bounds.get("cu_seq_lens_k"))
    if cu is not None:
        flat = torch.zeros(batch * length, dtype=torch.bool, device=cu.device)
        flat[cu[:-1].long()] = True
        marks["cu_seq_lens_q" if "cu_seq_lens_q" in bounds else "cu_seq_lens_k"] = flat.view(batch, length)
    if bounds.get("seq_idx") is not None:
        seq_idx = bounds["seq_idx"]
        changes = seq_idx[:, 1:] != seq_idx[:, :-1]
        marks["seq_idx"] = torch.cat([torch.ones_like(changes[:, :1]), changes], dim=1)
    if not marks:
        return None
    (name, starts), *others = marks.items()
    for other, theirs in others:
        if not torch.equal(starts, theirs.to(starts.device)):
            raise ValueError(f"{name} and {other} mark different documents")
    return starts


def _refuse(model, kwargs: dict, several: bool) -> None:
    """What cannot run with packed documents (`several`: some row holds more than one), named."""
    what = f"{type(model).__name__}: position_ids (or cu_seq_lens_q / seq_idx) that mark packed documents"
    mask = kwargs.get("attention_mask")
    if mask is not None and not bool((mask != 0).all()):  # host read
        raise ValueError(
            f"{what} cannot be combined with padding in attention_mask (a padded row's positions are ambiguous): "
            "pass either packed rows without padding or padded rows without position_ids"
        )
    cache = kwargs.get("cache") if kwargs.get("cache") is not None else kwargs.get("past_key_values")
    if cache is not None or kwargs.get("use_cache"):
        raise ValueError(
            f"{what} cannot be combined with a cache or use_cache=True: every document starts from nothing "
            "(pass use_cache=False, or one sequence per row to generate)"
        )
    attentions = kwargs.get("output_attentions")
    if several and (attentions if attentions is not None else getattr(model.config, "output_attentions", False)):
        raise ValueError(f"{what} cannot be combined with output_attentions")


def _run_documents(forward, model, kwargs: dict, starts: torch.Tensor, layout: Layout, tuples: bool):
    """The call with its documents as rows, one call per group (see the module). `tuples`: the forward takes
    `return_dict`."""
    several = bool((starts.sum(dim=1) > 1).any())  # host read
    if not several and layout.absolute_positions:  # one document per row: the positions as given (generate's prompts)
        return forward(model, **kwargs)
    _refuse(model, kwargs, several)
    kwargs = dict(kwargs, use_cache=False)
    if not layout.absolute_positions:  # relative positions: position_ids only marked the documents
        kwargs.pop("position_ids", None)
    if not several:
        return forward(model, **kwargs)
    documents = Documents.of(starts, getattr(model.config, layout.unit), GROUP_COST)
    return_dict = kwargs.get("return_dict")
    kwargs.update(output_attentions=False)
    if tuples:
        kwargs["return_dict"] = True
    terms = layout.loss_terms
    if terms:
        kwargs[terms] = []  # every group's loss terms, for their mean over the whole call
    outs = [forward(model, **_group_kwargs(kwargs, documents.shape, group)) for group in documents.groups]
    out = outs[0]
    out.last_hidden_state = documents.gather([o.last_hidden_state for o in outs])
    if out.hidden_states is not None:
        out.hidden_states = tuple(map(documents.gather, zip(*(o.hidden_states for o in outs))))
    if terms and kwargs[terms]:  # (none: the first group's loss is what a call without terms gives)
        setattr(out, layout.loss, torch.stack(kwargs[terms]).mean())
    if return_dict is None:
        return_dict = getattr(model.config, "return_dict", True)
    return out if return_dict or not tuples else out.to_tuple()


def _group_kwargs(kwargs: dict, shape: tuple[int, int], group: DocumentGroup) -> dict:
    """A forward's arguments for one group's rows: its tokens and positions spread, its rows' context."""
    kwargs = dict(kwargs, attention_mask=group.mask)
    for name in ("input_ids", "inputs_embeds", "position_ids"):
        if kwargs.get(name) is not None:
            kwargs[name] = group.spread(kwargs[name].expand(*shape, *kwargs[name].shape[2:]))
    for name in ("encoder_hidden_states", "encoder_attention_mask"):  # each document keeps its row's context
        if kwargs.get(name) is not None:
            kwargs[name] = kwargs[name][group.rows]
    return kwargs


# ----------------------------------------------------------------------------------------------------------------
# torch.export with a dynamic sequence length
# ----------------------------------------------------------------------------------------------------------------


def length_bound(length) -> int | None:
    """While torch.export traces with a dynamic sequence length: the largest length the exported program takes
    (its `Dim`'s max); None for a concrete length (eager, compiled, or exported with a static length)."""
    if not isinstance(length, torch.SymInt) or not is_exporting():
        return None
    from torch.utils._sympy.numbers import int_oo  # (torch's unbounded integer, only needed here)

    node = length.node
    upper = node.shape_env.bound_sympy(node.expr).upper
    if upper == int_oo or not upper.is_finite:
        raise ValueError(
            "torch.export with a dynamic sequence length needs a maximum: give its Dim a max, e.g. "
            "Dim('seq', max=1024) (the exported program pads every call to it)"
        )
    return int(upper)


def _padded_to_bound(forward, model, kwargs: dict, bound: int, bounds: dict, tuples: bool):
    """The forward traced at the static length `bound`: the tokens padded at the end, an attention mask that
    marks the padding (a row's outputs never depend on its padding) and the outputs cut back to the given length
    (index_select: a fresh tensor, so that no stride depends on the length). The segment loop and the bucket
    layout then see one fixed length, and the one program serves every length up to the bound, at its cost."""
    given = [name for name in ("position_ids", "cache", "past_key_values") if kwargs.get(name) is not None]
    given += [name for name in ("use_cache", "output_attentions") if kwargs.get(name)] + list(bounds)
    if given:
        raise ValueError(
            f"torch.export with a dynamic sequence length takes input_ids or inputs_embeds (and attention_mask) "
            f"with use_cache=False; got {', '.join(given)}"
        )
    name = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
    tokens = kwargs[name]
    length = tokens.shape[1]
    pad = bound - length
    kwargs[name] = F.pad(tokens, (0, 0) * (tokens.dim() - 2) + (0, pad))
    real = torch.arange(bound, device=tokens.device)[None, :] < length  # [1, bound]
    if kwargs.get("attention_mask") is not None:
        real = real & (F.pad(kwargs["attention_mask"], (0, pad)) != 0)
    kwargs.update(attention_mask=real.expand(tokens.shape[0], bound), use_cache=False, output_attentions=False)
    if tuples:
        kwargs["return_dict"] = True
    out = forward(model, **kwargs)
    kept = torch.arange(length, device=tokens.device)
    out.last_hidden_state = out.last_hidden_state.index_select(1, kept)
    if out.hidden_states is not None:
        out.hidden_states = tuple(h.index_select(1, kept) for h in out.hidden_states)
    return out


@dataclass(frozen=True)
class Layout:
    """How a model's calls are laid out (`call_layout`). `absolute_positions`: the model embeds positions
    (Sinkhorn), and the documents' rows get the given ones; else (the Compressive model's relative positions)
    position_ids only mark the documents and are not passed on. `unit`: the config field a row's length is padded
    to a multiple of (its bucket or segment). `loss_terms`: a keyword the forward takes a list with, to which it
    appends the terms whose mean is its output field `loss` (the Compressive model's reconstruction loss), so
    that a call made of several groups gives the mean of all their terms, as one call would."""

    absolute_positions: bool
    unit: str
    loss_terms: str | None = None
    loss: str | None = None


def call_layout(layout: Layout):
    """Decorates a base model's forward so that packed documents (see the module) each run as a row of their own
    (documents of similar length together, a call per group) and a dynamic length under torch.export is padded to
    its bound (see `_padded_to_bound`); any other call goes to the forward unchanged."""

    def decorate(forward):
        names = tuple(inspect.signature(forward).parameters)[1:]

        @functools.wraps(forward)
        def forward_laid_out(model, *args, **kwargs):
            kwargs.update(zip(names, args))
            bounds = {name: kwargs.pop(name) for name in DOCUMENT_KWARGS if name in kwargs}
            bounds = {name: value for name, value in bounds.items() if value is not None and "max_length" not in name}
            position_ids = kwargs.get("position_ids")
            tokens = kwargs.get("input_ids") if kwargs.get("input_ids") is not None else kwargs.get("inputs_embeds")
            if not isinstance(tokens, torch.Tensor) or tokens.dim() < 2:
                return forward(model, **kwargs)  # forward's checks say what is wrong
            bound = length_bound(tokens.shape[1])
            if bound is not None:  # torch.export with a dynamic length
                return _padded_to_bound(forward, model, kwargs, bound, bounds, "return_dict" in names)
            if position_ids is None and not bounds:
                return forward(model, **kwargs)  # nothing marks documents
            if layout.absolute_positions and not bounds and tokens.shape[1] == 1:
                return forward(model, **kwargs)  # a decoding step: one token is one document
            batch, length = tokens.shape[:2]
            real = _real_tokens(kwargs.get("attention_mask"), tokens)
            if real is None:
                return forward(model, **kwargs)  # a mask of another shape: forward's checks say what is wrong
            starts = document_starts(position_ids, bounds, real, batch, length)
            if starts is None:  # positions that are not packed restarts: the model's own rule
                return forward(model, **kwargs)
            return _run_documents(forward, model, kwargs, starts, layout, "return_dict" in names)

        return forward_laid_out

    return decorate
