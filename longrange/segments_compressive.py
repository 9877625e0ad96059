"""How one call of the Compressive model runs its tokens through the decoder layers against the memory cache.

`SegmentRunner.run` is the model's "layers" step (embed -> layers -> norm): it cuts the call's tokens into chunks
that end at segment boundaries (counted over every token the cache has seen, so any split of a sequence into calls
segments it the same way), runs each chunk through every layer, and lets each layer update its memory when the
chunk completes a segment. Which form of the cache serves the call:
    - one token without gradient (a decoding step): the static form (`DecodeStep`), fixed shapes, nothing read
      back to the host, so a step compiles to one graph;
    - any other call: the compact form, every row at the same fill; padded rows are reordered real tokens first;
    - rows at different fills (a kept cache and rows of different real lengths): the cache runs them one at a time
      (`CompressiveMemoryCache.run_rows`) and stays in the static form.
`LayerRun` is what a run gives back, and how runs over consecutive tokens (chunks, steps) or rows are joined.

Only same-folder relative imports: `save_pretrained` copies this file next to the weights.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .cache_compressive import CompressiveMemoryCache, StaticLayout
from .cache_compressive_static import compress_groups_ahead
from .layers import distance_encodings, real_tokens_first


@dataclass
class LayerRun:
    """Tokens run through the layers: `outputs` [batch, seq, hidden] of the last layer; `hidden` each layer's
    outputs [batch, seq, hidden] (with output_hidden_states, else None); `attentions` each layer's probabilities
    [batch, heads, seq, c_mem_len + mem_len + segment_length] in the cache's slot layout (with output_attentions,
    else None); `losses` the reconstruction losses of the evictions that trained f_c."""

    outputs: torch.Tensor
    hidden: list[torch.Tensor] | None
    attentions: list[torch.Tensor] | None
    losses: list[torch.Tensor]

    @staticmethod
    def concatenate(runs: list[LayerRun]) -> LayerRun:
        """Runs over consecutive tokens -> one run over all of them (in order)."""
        if len(runs) == 1:
            return runs[0]
        first = runs[0]
        hidden = attentions = None
        if first.hidden is not None:
            hidden = [torch.cat(layer, dim=1) for layer in zip(*(run.hidden for run in runs))]
        if first.attentions is not None:
            attentions = [torch.cat(layer, dim=2) for layer in zip(*(run.attentions for run in runs))]
        outputs = torch.cat([run.outputs for run in runs], dim=1)
        return LayerRun(outputs, hidden, attentions, [loss for run in runs for loss in run.losses])

    def unrolled(self, order: torch.Tensor, seq_len: int) -> LayerRun:
        """Undoes a real-tokens-first order [batch, kept] (kept <= seq_len): every result back at its token's
        position of the call, zeros where padding was left out."""
        batch, kept = order.shape

        def unroll(tensor, dim):
            shape = list(tensor.shape)
            shape[dim] = seq_len
            index = order.view(batch, *([1] * (dim - 1)), kept, *([1] * (tensor.dim() - dim - 1)))
            return tensor.new_zeros(shape).scatter(dim, index.expand_as(tensor), tensor)

        hidden = None if self.hidden is None else [unroll(h, 1) for h in self.hidden]
        attentions = None if self.attentions is None else [unroll(a, 2) for a in self.attentions]
        return LayerRun(unroll(self.outputs, 1), hidden, attentions, self.losses)

    def without_padding(self, valid: torch.Tensor) -> LayerRun:
        """Zero results at padding positions (valid [batch, seq] False), whichever path ran them: run as trailing
        tokens after the real ones, a padding token's result would depend on the call's later real tokens (assisted
        decoding's candidates), left out it is zero, stepped it reads the cache: three answers to one question."""
        kept = valid[..., None]  # [batch, seq, 1]
        hidden = None if self.hidden is None else [h.masked_fill(~kept, 0.0) for h in self.hidden]
        attentions = None
        if self.attentions is not None:
            attentions = [a.masked_fill(~valid[:, None, :, None], 0.0) for a in self.attentions]
        return LayerRun(self.outputs.masked_fill(~kept, 0.0), hidden, attentions, self.losses)

    @staticmethod
    def of_rows(rows: list, like: torch.Tensor, num_layers: int, with_hidden: bool, with_attentions: bool):
        """[(row, index [n] of the row's real tokens, the one-row run over them)] -> the run of the whole batch
        (`like` [batch, seq, hidden]: the call's inputs); positions no row ran are zero."""
        batch, seq_len, _ = like.shape
        outputs = like.new_zeros(like.shape)
        hidden = [like.new_zeros(like.shape) for _ in range(num_layers)] if with_hidden else None
        attentions = [None] * num_layers if with_attentions else None
        losses = []
        for row, index, run in rows:
            outputs[row, index] = run.outputs[0]
            losses.extend(run.losses)
            for i in range(num_layers):
                if with_hidden:
                    hidden[i][row, index] = run.hidden[i][0]
                if with_attentions:
                    heads, slots = run.attentions[i].shape[1], run.attentions[i].shape[3]
                    if attentions[i] is None:
                        attentions[i] = run.attentions[i].new_zeros(batch, heads, seq_len, slots)
                    attentions[i][row, :, index] = run.attentions[i][0]
        return LayerRun(outputs, hidden, attentions, losses)


def _own_layout(hidden_states: torch.Tensor, start: int, end: int) -> torch.Tensor:
    """Tokens start..end of [batch, seq, hidden] with the strides of a tensor of their own, as the layers' outputs have
    (a copy, also of a slice `contiguous()` would pass through: with batch 1 a slice is contiguous, yet its batch
    stride is the whole sequence's): under regional compilation the first layer then reuses the graph of the others
    instead of compiling one more for a layout that differs in a stride alone."""
    if (start, end) == (0, hidden_states.shape[1]) and hidden_states.is_contiguous():
        return hidden_states
    return hidden_states[:, start:end].clone(memory_format=torch.contiguous_format)


class SegmentRunner:
    """Runs one call's layer-0 inputs through the model's decoder layers against `cache` (see the module)."""

    def __init__(self, model, cache: CompressiveMemoryCache, output_hidden_states: bool, output_attentions: bool):
        self.config = model.config
        self.layers = model.layers
        self.cache = cache
        self.track_usage = model.track_usage  # "most_used": the cache accumulates the attention each slot receives
        self.output_hidden_states = output_hidden_states
        self.output_attentions = output_attentions
        self.need_weights = self.track_usage or output_attentions
        # projected memories are reused only when nothing is trained (weights cannot change under a no-grad call)
        self.reuse_projections = not torch.is_grad_enabled()
        config = self.config
        # most key slots any chunk can see: a full compressed memory, a full memory and a whole segment
        self.capacity = config.c_mem_len + config.mem_len + config.segment_length
        # per layer, the previous chunk's key/value projection (training; see `_attend`)
        self.recent_kv = [None] * len(self.layers)

    def run(self, hidden_states: torch.Tensor, valid: torch.Tensor, masked: bool, use_cache: bool) -> LayerRun:
        """[batch, seq, hidden] layer-0 inputs and their validity [batch, seq] -> the layers' results. A croppable
        cache also takes the last crop_margin tokens of longer no-grad calls one at a time, so that a crop finds
        what it needs in the static buffers. `masked`: the caller passed an attention mask (else every token is
        real, known on the host)."""
        seq_len = hidden_states.shape[1]
        stepped = 0
        if not torch.is_grad_enabled():
            stepped = seq_len if seq_len == 1 else min(seq_len, self.cache.crop_margin)
        head = seq_len - stepped
        runs = []
        if head:
            runs.append(self._run_tokens(hidden_states[:, :head], valid[:, :head], masked, use_cache))
        if stepped or (self.cache.prefill_to_static and not torch.is_grad_enabled()):
            if not self.cache.is_static:
                self._to_static(self.cache, hidden_states)
            for t in range(head, seq_len):
                runs.append(self._decode_step(hidden_states[:, t : t + 1], valid[:, t], tokens_real=not masked))
            if seq_len > 1 and self.cache.steps_compiled and not torch.compiler.is_compiling():
                compress_groups_ahead(self.cache, self.layers)  # (else the first compiled step: a graph of its own)
        run = LayerRun.concatenate(runs)
        return run.without_padding(valid) if masked else run

    # ------------------------------------------------------------------------------------------------------------
    # The compact form: segment by segment
    # ------------------------------------------------------------------------------------------------------------

    def _run_tokens(self, hidden_states, valid, masked: bool, use_cache: bool) -> LayerRun:
        """Any number of tokens through the compact form. Each row's real tokens are moved to the front first (a
        stable sort of the mask, undone on the results), so segments and memory slots count real tokens only: a
        row's outputs do not depend on its padding. Trailing padding left by a shorter row would still enter
        that row's memory, so when the cache is kept and rows hold different numbers of real tokens (or the
        cache's rows are at different fills), the rows run one at a time."""
        cache = self.cache
        split = cache.is_static and cache.fills_differ()  # multi-token calls may read the fills back
        counts = None
        if masked and (use_cache or split):
            counts = valid.sum(dim=1).tolist()
            split = split or any(count != counts[0] for count in counts)
        if split:
            return self._run_rows(hidden_states, valid)
        if cache.is_static:
            cache.to_compact()
        self._start(cache, hidden_states)
        if not masked or (counts is not None and counts[0] == valid.shape[1]):  # no padding: nothing to move
            return self._run_segments(hidden_states, valid, cache)
        seq_len, hidden = hidden_states.shape[1:]
        kept = seq_len if counts is None else counts[0]  # a kept cache takes no all-padding columns
        order = real_tokens_first(valid)[:, :kept]  # [batch, kept]
        rolled = hidden_states.gather(1, order[..., None].expand(-1, -1, hidden))
        return self._run_segments(rolled, valid.gather(1, order), cache).unrolled(order, seq_len)

    def _run_rows(self, hidden_states, valid) -> LayerRun:
        """Rows one at a time, each on its real tokens only and from its own fill: the cache runs them (in its
        static form, where rows may differ) and gives each row's run back."""
        if not self.cache.is_static:
            self._to_static(self.cache, hidden_states)

        def run_row(row_cache, row, index):  # row_cache: the row alone, in the compact form
            return self._run_segments(hidden_states[row : row + 1, index], valid[row : row + 1, index], row_cache)

        rows = self.cache.run_rows(valid, run_row, self.layers)
        return LayerRun.of_rows(
            rows, hidden_states, len(self.layers), self.output_hidden_states, self.output_attentions
        )

    def _run_segments(self, hidden_states, valid, cache) -> LayerRun:
        """The compact form's segment loop over [batch, seq, hidden] layer-0 inputs. Chunks end at segment
        boundaries counted over all tokens seen, so that any split of a sequence into calls (one forward,
        segment-wise calls, or token-by-token decoding) gives the same segmenting."""
        seq_len = hidden_states.shape[1]
        tables = self._relative_tables(cache, hidden_states)
        self.recent_kv = [None] * len(self.layers)
        runs, start = [], 0
        while start < seq_len:
            end = min(seq_len, start + self.config.segment_length - cache.layers[0].pending.shape[1])
            runs.append(self._run_chunk(_own_layout(hidden_states, start, end), valid[:, start:end], cache, tables))
            start = end
        return LayerRun.concatenate(runs)

    def _relative_tables(self, cache, like: torch.Tensor) -> list[torch.Tensor]:
        """Each layer's projected relative encodings [heads, d_head, len] of distances len - 1 ... 0, so that the K
        keys of any chunk read the last K columns (a view). Inference keeps them (and the memories' projections)
        in the cache; training projects them once per call (with gradient), for the longest key span any chunk
        of the call can reach."""
        if self.reuse_projections:
            for layer, state in zip(self.layers, cache.layers):
                state.prepare_projections(layer, self.capacity, like)
            return [state.rel_table for state in cache.layers]
        for state in cache.layers:
            state.drop_projections()
        max_keys = min(self.capacity, cache.memory_slots() + like.shape[1])
        encodings = distance_encodings(max_keys, self.layers[0].hidden_size, like)  # once for every layer
        return [layer.relative_table(encodings) for layer in self.layers]

    def _run_chunk(self, hidden_states, valid, cache, tables) -> LayerRun:
        """One chunk (the rest of the current segment at most) through every layer: each layer attends, hands its
        inputs to its cache layer and, if the chunk completes the segment, updates its memory."""
        q_len = hidden_states.shape[1]
        first = cache.layers[0]
        mask = first.chunk_mask(valid)  # [batch, 1, q, K]: the same for every layer
        k_len = mask.shape[-1]
        completes_segment = first.pending.shape[1] + q_len == self.config.segment_length
        config = self.config
        outputs, maps, losses = [], [], []
        for index, (layer, state, table) in enumerate(zip(self.layers, cache.layers, tables)):
            relative = table[:, :, -k_len:]  # [heads, d_head, K], distances K-1 ... 0
            out, query, keys, values, weights = self._attend(index, layer, state, hidden_states, relative, mask)
            starts_segment = state.pending.shape[1] == 0
            if self.output_attentions:
                maps.append(state.slot_layout(weights, config.c_mem_len, config.mem_len, config.segment_length))
            state.append_chunk(hidden_states.detach(), valid, weights if self.track_usage else None)
            if completes_segment:
                # the chunk is the whole segment when it started one: its projections can serve the reconstruction
                loss = layer.update_memory(state, (query, keys, values) if starts_segment else None)
                if loss is not None:
                    losses.append(loss)
            outputs.append(out)
            hidden_states = out
        return LayerRun(
            hidden_states,
            outputs if self.output_hidden_states else None,
            maps if self.output_attentions else None,
            losses,
        )

    def _attend(self, index: int, layer, state, hidden_states, relative, mask):
        """One layer over one chunk. Inference reads (and extends in place) the keys/values the cache layer holds;
        training projects the memories again (the LM loss trains the projection), except the newest ones when
        they are the previous chunk's inputs, whose projection this call already made. Returns the layer's
        (output, queries, keys, values, attention probabilities or None)."""
        if self.reuse_projections:
            return layer(
                hidden_states,
                relative,
                memory_keys=state.keys,
                memory_values=state.values,
                memory_length=state.projected_len,
                attention_mask=mask,
                need_weights=self.need_weights,
            )
        tail = self.recent_kv[index]
        if tail is not None:  # the memories' last rows are the previous chunk's inputs (the oldest may be gone)
            _, m_len, p_len = state.lengths()
            tail = tail[:, max(0, tail.shape[1] - m_len - p_len) :]
        result = layer(
            hidden_states,
            relative,
            memory=state.context(),
            attention_mask=mask,
            need_weights=self.need_weights,
            memory_tail_kv=tail,
        )
        _, _, keys, values, _ = result
        # this chunk's projection, as the raw [batch, q, 2 * hidden] layout of kv_proj
        q_len = hidden_states.shape[1]
        self.recent_kv[index] = torch.cat(
            [t[:, :, -q_len:].transpose(1, 2).flatten(2) for t in (keys, values)], dim=-1
        ).detach()
        return result

    # ------------------------------------------------------------------------------------------------------------
    # The static form: one-token decoding steps
    # ------------------------------------------------------------------------------------------------------------

    def _start(self, cache, like: torch.Tensor) -> None:
        # an empty cache gets empty memories of the call's batch, width, dtype and device
        if cache.layers[0].is_empty:
            for state in cache.layers:
                state.init_empty(like.detach(), self.track_usage)

    def _to_static(self, cache, like: torch.Tensor) -> None:
        self._start(cache, like)
        cache.to_static(StaticLayout.for_config(self.config, cache.crop_margin), self.layers)

    def _decode_step(self, hidden_states, token_valid, tokens_real: bool) -> LayerRun:
        """One token per row [batch, 1, hidden] through the cache's static form (see `DecodeStep`): each layer
        attends the slot buffers the token was written into, then compresses what its row evicts."""
        step = self.cache.decode_step(token_valid, tokens_real, self.layers)
        outputs, maps = [], []
        for layer, state in zip(self.layers, self.cache.layers):
            mask = step.write_token(state, hidden_states)  # [batch, 1, 1, slots]
            hidden_states, _, _, _, weights = layer(
                hidden_states,
                state.rel_table,
                memory_keys=state.ring_keys,
                memory_values=state.ring_values,
                attention_mask=mask,
                need_weights=self.need_weights,
                write_index=step.write,
                key_columns=step.columns,
            )
            if self.output_attentions:
                maps.append(step.slot_layout(weights))
            step.compress_evicted(state, layer, weights)
            outputs.append(hidden_states)
        step.finish()
        return LayerRun(
            hidden_states,
            outputs if self.output_hidden_states else None,
            maps if self.output_attentions else None,
            [],
        )
