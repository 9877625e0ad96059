"""New tokens on top of a filled Sinkhorn cache outside `SinkhornModel.forward`'s own paths (one token, or a chunk
of several in one pass): a few tokens on a long cache one at a time, and steps that return attention maps.
Functions of the model, which call its forward; they return the fields of its output.

Only same-folder relative imports: `save_pretrained` copies this file next to the weights.
"""

from __future__ import annotations

import torch


def position_ids(mask: torch.Tensor, before) -> torch.Tensor:
    """Position ids [b, L] of new tokens that count real tokens only: `before` (0, or [b, 1] real tokens cached)
    plus the real tokens up to each one (padding takes its neighbour's, clamped at 0)."""
    return (before + mask.long().cumsum(1) - 1).clamp_min(0)


def tokens_one_at_a_time(model, input_ids, inputs_embeds, attention_mask, positions, cache, hidden_states: bool):
    """Several new tokens on a filled cache, fed one at a time: what a few tokens on a long cache cost least as
    (see `SinkhornCache.takes_chunk`).
    Returns the output fields: last_hidden_state [b, L, emb], the cache and, when `hidden_states`, every layer's
    hidden states [b, L, hidden] over the L tokens (each step's, joined)."""

    def column(t, i):
        return t[:, i : i + 1] if t is not None else None

    outputs, per_step = [], []
    for i in range((input_ids if input_ids is not None else inputs_embeds).shape[1]):
        out = model.forward(
            input_ids=column(input_ids, i),
            inputs_embeds=column(inputs_embeds, i),
            attention_mask=column(attention_mask, i),
            position_ids=column(positions, i),
            cache=cache,
            use_cache=True,
            output_hidden_states=hidden_states,
            return_dict=True,
        )
        outputs.append(out.last_hidden_state)
        per_step.append(out.hidden_states)
    joined = tuple(torch.cat(layer, dim=1) for layer in zip(*per_step)) if hidden_states else None
    return dict(last_hidden_state=torch.cat(outputs, dim=1), cache=cache, hidden_states=joined)


def _inputs_so_far(cache, embeds, positions, mask):
    """Records a cached step's inputs (embeddings [b, n, e], position ids and padding mask [b, n]) in the cache ->
    those of every token given so far: (embeddings, position ids, mask, context, context mask)."""
    if cache.recorded is None:
        raise ValueError(
            "SinkhornModel: output_attentions on tokens fed on top of a filled cache needs the forward that "
            "filled it to ask for output_attentions too"
        )
    past = cache.recorded[0].shape[1]
    full_mask = torch.cat([cache.token_mask[:, :past], mask], dim=1)
    cache.record_inputs(embeds, positions)
    all_embeds, all_positions, context, context_mask = cache.recorded
    return all_embeds, all_positions, full_mask, context, context_mask


def step_with_attentions(model, input_ids, inputs_embeds, attention_mask, positions, cache, hidden_states: bool):
    """Tokens on top of a filled cache with output_attentions: the cached step gives the outputs, and the new
    tokens' attention rows [batch, heads, new, all tokens so far] come from a forward over every token given so
    far without the cache (the cache records their embeddings and positions while maps are asked for; cached
    and uncached forwards give the same numbers). Slow, and only when asked. Returns the output fields."""
    embeds = inputs_embeds if inputs_embeds is not None else model.embed_tokens(input_ids)
    mask = (
        attention_mask
        if attention_mask is not None
        else torch.ones(embeds.shape[:2], dtype=torch.bool, device=embeds.device)
    )
    if positions is None:  # as the step computes them
        positions = position_ids(mask, cache.lengths[:, None])
    all_embeds, all_positions, full_mask, context, context_mask = _inputs_so_far(cache, embeds, positions, mask)
    full = model.forward(
        inputs_embeds=all_embeds, attention_mask=full_mask, position_ids=all_positions,
        encoder_hidden_states=context, encoder_attention_mask=context_mask, use_cache=False,
        output_attentions=True,
    )  # fmt: skip
    step = model.forward(
        inputs_embeds=embeds, attention_mask=attention_mask, position_ids=positions, cache=cache,
        use_cache=True, output_hidden_states=hidden_states, output_attentions=False,
    )  # fmt: skip
    length = embeds.shape[1]
    cross = full.cross_attentions
    return dict(
        last_hidden_state=step.last_hidden_state,
        cache=cache,
        hidden_states=step.hidden_states,
        attentions=tuple(a[:, :, -length:] for a in full.attentions),
        cross_attentions=None if cross is None else tuple(a[:, :, -length:] for a in cross),
    )


__all__ = ["position_ids", "step_with_attentions", "tokens_one_at_a_time"]
