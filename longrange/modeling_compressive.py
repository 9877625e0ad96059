"""The Compressive Transformer (Rae et al. 2019) as a transformers model.

Read top to bottom: Transformer-XL relative attention, the decoder layer (attention and feed-forward), the
PreTrainedModel, the base model (embed -> layers -> norm -> outputs) and the causal LM head.
Elsewhere: the layer's memory update after a complete segment (evict, compress, reconstruction loss) and its
projection of memories in `memory_compressive.py` (`MemoryUpdate`, a mixin of the layer); the compression functions
`f_c` in `compression.py`; the memory cache `CompressiveMemoryCache` in `cache_compressive.py` (its static decoding
form in `cache_compressive_static.py`); how a call's tokens run through the layers segment by segment against the
cache in `segments_compressive.py` (`SegmentRunner`).

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

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.generation import GenerationMode
from transformers.modeling_layers import GradientCheckpointingLayer

# A saved folder's code (trust_remote_code) is copied from the modules this file imports itself: for a local
# folder some transformers releases (5.5, the floor) do not follow the imports of those modules, so every module
# a saved model needs is imported here directly (tests/test_checkpoints.py checks the list is complete).
from .cache_compressive import CompressiveMemoryCache
from .cache_compressive_static import StaticLayout  # noqa: F401  (see the note above)
from .classification import QuestionAnswering, SequenceClassification, TokenClassification
from .compat import CACHE_NAME, check_assisted_decoding, use_own_cache
from .compression import COMPRESSION_CLASSES
from .configuration_checks import warn_near_misses  # noqa: F401  (see the note above)
from .configuration_compressive import CompressiveConfig
from .inputs import check_cache, check_lm_labels, check_mask, check_tokens
from .layers import (
    FeedForward,
    attend,
    blockwise_attention,
    merge_heads,
    put_along,
    register_fsdp_methods,
)
from .loading import checked_from_pretrained, map_every_auto_class
from .memory_compressive import MemoryUpdate
from .outputs import CompressiveCausalLMOutput, CompressiveModelOutput
from .packing import Layout, call_layout
from .product_key_memory import ProductKeyMemory
from .segments_compressive import SegmentRunner

# ----------------------------------------------------------------------------------------------------------------
# Attention
# ----------------------------------------------------------------------------------------------------------------


def relative_scores(query: torch.Tensor, relative: torch.Tensor) -> torch.Tensor:
    """query [..., q_len, d] against relative [heads, d, k_len] (encodings of distances k_len - 1 ... 0) ->
    [..., q_len, k_len] where entry (i, j) is query_i . r for the distance (k_len - q_len + i) - j.

    Transformer-XL's pad-and-reshape shift: entry (i, j) is column j + q_len - 1 - i of the scores against every
    distance, once they have a zero column in front. Eager calls put the zero column on the small table, so that
    the product writes the padded scores at once instead of a copy of them; compiled graphs pad the scores, which
    inductor fuses into their consumer (there, padding the table moves more bytes: 24.5 against 19.9 GB per bf16
    training step of the GPU benchmark, as generated for an H200). Entries with j > k_len - q_len + i (future keys)
    hold unrelated values; the causal mask removes them.
    """
    *batch, q_len, _ = query.shape
    k_len = relative.shape[-1]
    if torch.compiler.is_compiling():
        padded = F.pad(torch.matmul(query, relative), (1, 0))
    else:
        padded = torch.matmul(query, F.pad(relative, (1, 0)))  # [..., q_len, k_len + 1], column 0 zero
    return padded.view(*batch, k_len + 1, q_len)[..., 1:, :].view(*batch, q_len, k_len)


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

    def kernel(self, device: torch.device, need_weights: bool = False, static: bool = False) -> str:
        """The one place the attention kernel is chosen (from `config._attn_implementation`).

        "eager" is the explicit softmax(QK^T + bias) V. "blockwise" is the CPU kernel of `layers.py` (row blocks,
        hand-written backward). "sdpa", the default, is the fastest exact kernel of the device: torch's
        `scaled_dot_product_attention` with the position term as an additive bias that receives its gradient (fused
        kernels on GPUs, no loop, and what a compiled graph holds), except for eager calls on the CPU, where the
        blockwise kernel trains faster (1.4x the reference instead of 1.0x, docs/benchmarks) and infers as fast.
        The choice never depends on whether gradients are recorded: a forward with and one without gradient give
        the same logits (TRL's DPO compares the two). `static`: a decoding step over the static cache's slots
        (keys in any order), which only `attend` reads."""
        if need_weights or self.implementation == "eager":
            return "eager"
        if static or torch.compiler.is_compiling():
            return "sdpa"  # the blockwise kernel is a Python loop over row blocks: compiled graphs fuse sdpa instead
        if self.implementation == "sdpa" and device.type == "cpu":
            return "blockwise"
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
        batch, q_len = query_input.shape[:2]
        query = self.split_heads(self.q_proj(query_input))  # [batch, heads, q, d_head]
        kernel = self.kernel(query_input.device, need_weights, static=key_columns is not None)
        if kernel == "blockwise":  # (runs in its queries' dtype: float32 under CPU autocast, promoted by u and v)
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
            return self.o_proj(merge_heads(out)), None, query
        # position scores: (q + v) . r for every distance, then shifted to (query, key) pairs, passed to the kernel
        # as an additive bias (which receives its gradient); the scale is folded into the small query. u and v in
        # the queries' dtype: as float32 under autocast they would promote bf16 queries and the bias to float32
        u, v = (bias.to(query.dtype)[:, None] for bias in (self.content_bias, self.position_bias))
        position_query = (query + v) * self.scale
        if key_columns is None:
            position = relative_scores(position_query, relative)  # [batch, heads, q, K]
        else:
            columns = key_columns[:, None, None, :].expand(batch, self.num_heads, q_len, -1)
            position = torch.matmul(position_query, relative).gather(-1, columns)
        result = attend(
            query + u,
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
        return self.o_proj(merge_heads(out)), weights, query


# ----------------------------------------------------------------------------------------------------------------
# Decoder layer
# ----------------------------------------------------------------------------------------------------------------


class CompressiveDecoderLayer(MemoryUpdate, GradientCheckpointingLayer):
    """Attention over memories and segment, then feed-forward (or product-key memory), pre- or post-LN.

    The LayerNorm placement is chosen once here: with "pre" the `*_input_norm`s are LayerNorms (also applied to
    the stored, un-normalised memories) and the `*_output_norm`s are identities; with "post" the other way round.
    Each layer owns its compression function `f_c` and, for the auto-encoding loss, its decoder, and updates its
    own memory after a complete segment (`update_memory`: its cache layer evicts, f_c compresses, the
    reconstruction loss trains f_c). That update and the projection of memories are the `MemoryUpdate` mixin
    (`memory_compressive.py`); the parameters they use are created here, so they are this layer's own.
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
        # the memory schedule's sizes; c_mem_len = 0 is Transformer-XL: evicted memories dropped one by one
        self.mem_len, self.c_mem_len = config.mem_len, config.c_mem_len
        self.eviction_unit = config.compression_rate if config.c_mem_len else 1  # evictions take whole groups of it
        self.reconstruction = config.reconstruction_loss  # "attention", "autoencoding" or "none"
        self.hidden_size = hidden

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


# ----------------------------------------------------------------------------------------------------------------
# Models
# ----------------------------------------------------------------------------------------------------------------


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

    def save_pretrained(self, *args, **kwargs):
        """transformers' `save_pretrained`; config.json's `auto_map` names every Auto class (longrange/loading.py)."""
        heads = {"AutoModelForCausalLM": CompressiveForCausalLM}
        heads.update(AutoModelForSequenceClassification=CompressiveForSequenceClassification)
        heads.update(AutoModelForTokenClassification=CompressiveForTokenClassification)
        heads.update(AutoModelForQuestionAnswering=CompressiveForQuestionAnswering)
        map_every_auto_class(self.config, {"AutoModel": CompressiveModel, **heads})
        return super().save_pretrained(*args, **kwargs)

    def _init_weights(self, module: nn.Module) -> None:
        super()._init_weights(module)  # Linear, Conv1d, ConvTranspose1d, Embedding, LayerNorm
        if isinstance(module, CompressiveAttention):
            # Transformer-XL initialises its u / v biases like the other weights
            init.normal_(module.content_bias, mean=0.0, std=self.config.initializer_range)
            init.normal_(module.position_bias, mean=0.0, std=self.config.initializer_range)
        elif isinstance(module, ProductKeyMemory):
            module.reset_parameters()  # its own keys/values scheme (the Linear/LayerNorm inside are done above)


# packed documents: rows padded to whole segments; a grouped call pools its groups' reconstruction-loss terms
PACKED_LAYOUT = Layout(
    absolute_positions=False, unit="segment_length", loss_terms="reconstruction_terms", loss="reconstruction_loss"
)


class CompressiveModel(CompressivePreTrainedModel):
    """Embeddings, the decoder layers and the final norm; runs any input length segment by segment (the layers
    step is `SegmentRunner.run`, see `segments_compressive.py`)."""

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
        # "most_used" compression picks the memories that received the most attention: the cache accumulates it
        self.track_usage = config.compression_function == "most_used" and config.c_mem_len > 0
        self.gradient_checkpointing = False
        self.post_init()

    @call_layout(PACKED_LAYOUT)  # packed documents in groups of rows; torch.export: any length
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
        cache = self._checked_cache(cache if cache is not None else past_key_values, kwargs)
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
        valid = self._token_validity(attention_mask, batch, seq_len, cache, hidden_states.device)

        runner = SegmentRunner(self, cache, output_hidden_states, output_attentions)
        run = runner.run(hidden_states, valid, masked=attention_mask is not None, use_cache=use_cache)
        cache.count(seq_len)
        if kwargs.get("reconstruction_terms") is not None:  # packed documents' groups (longrange/packing.py)
            kwargs["reconstruction_terms"].extend(run.losses)

        final = self.norm(run.outputs)
        result = CompressiveModelOutput(
            last_hidden_state=final,
            cache=cache if use_cache else None,
            hidden_states=(hidden_states, *run.hidden[:-1], final) if output_hidden_states else None,
            attentions=tuple(run.attentions) if output_attentions else None,
            reconstruction_loss=self._reconstruction_loss_of_call(run.losses),
        )
        return result if return_dict else result.to_tuple()

    def _checked_cache(self, cache, kwargs) -> CompressiveMemoryCache | None:
        """The caller's cache (or None), refused early when it cannot serve this model (see `longrange/inputs.py`)."""
        if kwargs.get("position_ids") is not None:
            raise ValueError(
                "position_ids other than packed documents' (restarting at 0 at each document, counting up by one) are "
                "not supported by the Compressive model: positions are relative (Transformer-XL) and follow from the "
                "tokens the cache has seen; pass the tokens in order instead"
            )
        if cache is not None:
            check_cache(cache, "compressive", 0, 0)
            if not isinstance(cache, CompressiveMemoryCache):
                raise TypeError(f"cache must be a CompressiveMemoryCache, got {type(cache).__name__}")
        if cache is not None and cache.crop_margin and self.track_usage:
            raise ValueError(
                "a CompressiveMemoryCache with crop_margin > 0 (croppable, e.g. for assisted decoding) needs a "
                "compression_function other than 'most_used' (its choice depends on attention a crop cannot undo)"
            )
        return cache

    def _reconstruction_loss_of_call(self, losses: list[torch.Tensor]) -> torch.Tensor | None:
        """The mean of the call's reconstruction losses; when training evicted nothing into f_c (or c_mem_len = 0),
        an exact zero that still touches every f_c (and decoder) parameter, so that data-parallel training sees
        the same parameters used on every step; None otherwise."""
        if losses:
            return torch.stack(losses).mean()
        if self.training and torch.is_grad_enabled() and self.config.reconstruction_loss != "none":
            return torch.stack([layer.compression_zero() for layer in self.layers]).sum()
        return None

    def _embed(self, input_ids, inputs_embeds) -> torch.Tensor:
        check_tokens(input_ids, inputs_embeds, self.config.vocab_size, self.config.hidden_size)
        return self.dropout(self.embed_tokens(input_ids) if input_ids is not None else inputs_embeds)

    @staticmethod
    def _token_validity(attention_mask, batch, seq_len, cache, device) -> torch.Tensor:
        """[batch, seq] bool for the new tokens. The mask may cover only the new tokens or, as generate() passes
        it, every token seen so far plus the new ones; the cache already holds the validity of the older ones.
        Compiled steps do not check the full mask's length: the count of tokens seen is on the device only."""
        if attention_mask is None:
            return torch.ones(batch, seq_len, dtype=torch.bool, device=device)
        if torch.compiler.is_compiling():
            so_far = getattr(attention_mask, "shape", (seq_len,))[-1]
        else:
            so_far = cache.seen_tokens + seq_len
        return check_mask(attention_mask, batch, (seq_len, so_far), seq_len).to(device=device)


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
        cache = model_kwargs.get(CACHE_NAME)
        if isinstance(cache, CompressiveMemoryCache):
            cache.prefill_to_static = True  # decoding steps follow the prompt's forward
            cache.steps_compiled = self._valid_auto_compile_criteria(model_kwargs, generation_config)
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
            loss = self._total_loss(lm_loss, reconstruction_loss, labels, shift_labels, num_items_in_batch)
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

    def _total_loss(self, lm_loss, reconstruction_loss, labels, shift_labels, num_items_in_batch) -> torch.Tensor:
        """LM loss + weight x reconstruction loss. Under `Trainer` (`num_items_in_batch`: the predicted tokens of the
        whole accumulated batch, of every process when it averages tokens across them) the LM loss is this call's
        sum divided by that count, and Trainer adds the calls' losses up; the reconstruction loss, a mean over this
        call's compressions, is weighted by the call's share of those tokens likewise, so that the sum is a
        token-weighted mean of it too (not one whole mean per accumulation step and process)."""
        if reconstruction_loss is None:
            return lm_loss
        if num_items_in_batch is not None:
            predicted = shift_labels if shift_labels is not None else labels[..., 1:]
            reconstruction_loss = reconstruction_loss * (predicted.ne(-100).sum() / num_items_in_batch)
        return lm_loss + self.config.reconstruction_loss_weight * reconstruction_loss

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
        elif next_sequence_length is not None:  # contiguous: a view's stride would change with every step
            model_inputs["input_ids"] = input_ids[:, -next_sequence_length:].clone(
                memory_format=torch.contiguous_format
            )
        else:
            model_inputs["input_ids"] = input_ids[:, seen:] if seen else input_ids
        for key in ("output_hidden_states", "output_attentions", "return_dict", "logits_to_keep"):
            if key in kwargs:
                model_inputs[key] = kwargs[key]
        return model_inputs


class CompressiveForSequenceClassification(SequenceClassification, CompressivePreTrainedModel):
    """A label per sequence (longrange/classification.py); its loss includes the reconstruction loss."""

    base_model_class = CompressiveModel


class CompressiveForTokenClassification(TokenClassification, CompressivePreTrainedModel):
    """A label per token (longrange/classification.py); its loss includes the reconstruction loss."""

    base_model_class = CompressiveModel


class CompressiveForQuestionAnswering(QuestionAnswering, CompressivePreTrainedModel):
    """An answer span's start and end (longrange/classification.py); its loss includes the reconstruction loss."""

    base_model_class = CompressiveModel


__all__ = [
    "CompressiveForCausalLM",
    "CompressiveForQuestionAnswering",
    "CompressiveForSequenceClassification",
    "CompressiveForTokenClassification",
    "CompressiveModel",
    "CompressivePreTrainedModel",
]
