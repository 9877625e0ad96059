"""Sinkhorn Transformer (Tay et al. 2020, "Sparse Sinkhorn Attention") as a transformers model.

Reading order: this file holds the outputs, the PreTrainedModel, SinkhornModel (embed -> layers -> norm) and the
language models. Its pieces live below it: `sinkhorn_layer.py` (the layer and its pre-norm blocks),
`sinkhorn_attention.py` (self / cross attention built from head groups), `sinkhorn_heads.py` (the head groups:
local, Sinkhorn, causal Sinkhorn), `sinkhorn_routing.py` (the sort net's routing math, and `BucketMask`: the
padding mask with what the groups derive from it, computed once for all layers), `reversible.py` (the
two-stream stack), `cache_sinkhorn.py` (the generation cache, `SinkhornCache`) and `sinkhorn_steps.py` (new tokens
on a filled cache outside the one-token step).

The sequence is cut into buckets of `bucket_size`. A sort net scores every (query bucket, key bucket) pair from
bucket summaries; each query bucket attends its own bucket plus the `n_top_buckets` best key buckets in ONE
softmax. The sort net chooses the bucket indices; by default (`weight_routed_values`) the values of each chosen
bucket are multiplied by its routing weight, as the seed's reordering matrix does, which trains the sort net and
lets a query bucket turn down a weak choice. With `weight_routed_values=False` a straight-through weight (exactly
1 in the forward pass) carries the routing softmax's gradient instead, and outputs are plain attention over the
chosen keys and values.

Causal variant: a query bucket may choose strictly earlier key buckets or learned null buckets (so bucket 0 has
something to choose), and attends causally inside its own bucket. The choice for a bucket is made from the
cumulative mean of the queries up to the bucket's *leading* (first) token and the means of earlier key buckets:
it only depends on tokens that exist when the leading token is processed, which is what makes the generation
cache exact. Half of the Sinkhorn heads use buckets shifted by `bucket_size - 1` (the reference "rotates" them by
that amount), so that the last token of every ordinary bucket leads a shifted bucket and gets a say in routing;
the first `bucket_size - 1` tokens form a short leading bucket that can only choose null buckets (the reference's
masked wrap-around).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import GenerationMixin, PreTrainedModel
from transformers import initialization as init
from transformers.cache_utils import Cache
from transformers.utils import ModelOutput
from transformers.utils.generic import can_return_tuple

# A saved folder's code (trust_remote_code) is copied from the modules this file imports itself: for a local
# folder some transformers releases (5.5, the floor) do not follow the imports of those modules, so every module
# a saved model needs is imported here directly (tests/test_checkpoints.py checks the list is complete).
from .cache_sinkhorn import SinkhornCache
from .cache_sinkhorn_calls import CacheCalls  # noqa: F401  (see the note above)
from .classification import QuestionAnswering, SequenceClassification, TokenClassification
from .compat import CACHE_NAME, cache_output, check_assisted_decoding, use_own_cache
from .configuration_checks import warn_near_misses  # noqa: F401  (see the note above)
from .configuration_sinkhorn import SinkhornConfig
from .inputs import check_cache, check_labels, check_lm_labels, check_mask, check_tokens
from .layers import ATTENTION_IMPLEMENTATIONS, permute_map, permute_tokens, real_tokens_first
from .loading import checked_from_pretrained, map_every_auto_class, rename_moved_keys
from .outputs import ClassifierOutput  # noqa: F401  (see the note above)
from .packing import Layout, call_layout, pop_document_kwargs
from .product_key_memory import ProductKeyMemory
from .reversible import ReversibleSequence
from .sinkhorn_attention import attention_implementation, unsupported_attention
from .sinkhorn_heads import CausalSinkhornHeads, LocalHeads, SinkhornHeads
from .sinkhorn_layer import AxialPositionEmbedding, SinkhornLayer, build_layers, tied_norm_sources
from .sinkhorn_routing import BucketMask
from .sinkhorn_steps import position_ids as position_ids_of
from .sinkhorn_steps import step_with_attentions, tokens_one_at_a_time

# ----------------------------------------------------------------------------------------------------------------
# models
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class SinkhornRouting(ModelOutput):
    """One layer's routing (output_attentions=True), over all heads (local heads first, then the Sinkhorn heads;
    causal models: ordinary, then shifted).

    key_buckets: [batch, heads, query buckets, picks] long: the key buckets each query bucket attends besides its
        own (causal: strictly earlier buckets), as indices in the head's own bucket grid (bucket u of head h covers
        tokens u * bucket_size - offsets[h] onwards, counting each row's real tokens only: a padded row's buckets
        start at its first real token); -1 where a pick is a null bucket (causal models), is masked
        out (SortCut's shared pick of a bucket's own bucket) or does not exist (local heads; the ordinary causal
        heads' last row when shifted heads have one bucket more).
    weights: [batch, heads, query buckets, picks] float: the factor the pick's values are multiplied by (its
        Sinkhorn / softmax routing weight with `weight_routed_values`, else 1); 0 where the pick is not used.
    offsets: [heads] long: 0 for ordinary buckets, 1 for the causal shifted heads (their bucket u covers tokens
        u * bucket_size - 1 ... u * bucket_size + bucket_size - 2).
    null_attention: [batch, heads, seq, n_top_buckets] (causal models): each query token's attention weight on
        each null bucket's learned key (times its routing weight, as in `attentions`); the attention rows sum to 1
        minus this mass. None for non-causal models (no null buckets).
    """

    key_buckets: torch.LongTensor | None = None
    weights: torch.FloatTensor | None = None
    offsets: torch.LongTensor | None = None
    null_attention: torch.FloatTensor | None = None

    def matrix(self) -> torch.Tensor:
        """[batch, heads, query buckets, key buckets]: `weights` of each chosen key bucket, 0 elsewhere (own and
        local buckets are not routing choices and are not shown)."""
        b, h, rows, _ = self.key_buckets.shape
        chosen = self.key_buckets >= 0
        out = self.weights.new_zeros(b, h, rows, rows + 1)
        out.scatter_add_(-1, self.key_buckets.masked_fill(~chosen, rows), self.weights * chosen)
        return out[..., :rows]


@cache_output
@dataclass
class SinkhornModelOutput(ModelOutput):
    """last_hidden_state [batch, seq, hidden]; cache (when use_cache); hidden_states (when asked); with
    output_attentions: attentions (per layer [batch, heads, seq, seq]: each query's attention weights placed at
    its keys' positions, the routed buckets' weights included, so that the head's output is attentions @ values
    (+ the null buckets' share, see SinkhornRouting.null_attention)), cross_attentions (receives_context: per
    layer [batch, heads, seq, context length]) and routing (per layer a SinkhornRouting)."""

    last_hidden_state: torch.FloatTensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    cross_attentions: tuple[torch.FloatTensor, ...] | None = None
    routing: tuple[SinkhornRouting, ...] | None = None


@cache_output
@dataclass
class SinkhornCausalLMOutput(ModelOutput):
    """loss; logits [batch, seq, vocab]; cache; hidden_states; attentions, cross_attentions, routing (see
    SinkhornModelOutput)."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    cache: Cache | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    cross_attentions: tuple[torch.FloatTensor, ...] | None = None
    routing: tuple[SinkhornRouting, ...] | None = None


@dataclass
class SinkhornMaskedLMOutput(ModelOutput):
    """loss; logits [batch, seq, vocab]; hidden_states; attentions, cross_attentions, routing (see
    SinkhornModelOutput)."""

    loss: torch.FloatTensor | None = None
    logits: torch.FloatTensor | None = None
    hidden_states: tuple[torch.FloatTensor, ...] | None = None
    attentions: tuple[torch.FloatTensor, ...] | None = None
    cross_attentions: tuple[torch.FloatTensor, ...] | None = None
    routing: tuple[SinkhornRouting, ...] | None = None


class SinkhornPreTrainedModel(PreTrainedModel):
    config_class = SinkhornConfig
    base_model_prefix = "model"
    supports_gradient_checkpointing = True
    _no_split_modules = ["SinkhornLayer"]
    _supports_sdpa = True

    @torch.no_grad()
    def _init_weights(self, module: nn.Module) -> None:
        config = self.config
        std = config.initializer_range
        # a tied output embedding is initialised as an output layer: unit-variance logits at init
        tied_std = config.embedding_size**-0.5
        if isinstance(module, nn.Linear):
            if config.tie_word_embeddings and module is getattr(self, "lm_head", None):
                init.normal_(module.weight, mean=0.0, std=tied_std if std is None else std)
                if module.bias is not None:
                    init.zeros_(module.bias)
            elif std is None:
                # PyTorch's default for nn.Linear (the reference's init): U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for the
                # weight (kaiming-uniform with a = sqrt(5)) and the bias
                bound = module.in_features**-0.5
                init.uniform_(module.weight, -bound, bound)
                if module.bias is not None:
                    init.uniform_(module.bias, -bound, bound)
            else:
                init.normal_(module.weight, mean=0.0, std=std)
                if module.bias is not None:
                    init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            if std is not None:
                init.normal_(module.weight, mean=0.0, std=std)
            elif config.tie_word_embeddings:
                # positions at the scale of the (output-layer sized) token embedding, or they would drown it out
                init.normal_(module.weight, mean=0.0, std=tied_std)
            else:
                # PyTorch's default for nn.Embedding (the reference's token and positional embeddings): N(0, 1), so
                # that tokens and positions start far apart in the residual stream
                init.normal_(module.weight, mean=0.0, std=1.0)
        elif isinstance(module, AxialPositionEmbedding):
            # as the position nn.Embedding below: N(0, 1) (the reference's axial tables), tied-head scale, or std
            pos_std = std if std is not None else (tied_std if config.tie_word_embeddings else 1.0)
            init.normal_(module.per_bucket, mean=0.0, std=pos_std)
            init.normal_(module.in_bucket, mean=0.0, std=pos_std)
        elif isinstance(module, nn.LayerNorm):
            init.ones_(module.weight)
            init.zeros_(module.bias)
        elif isinstance(module, ProductKeyMemory):
            # the same distributions as ProductKeyMemory.reset_parameters, through the loading-aware initialisers
            init.normal_(module.keys, mean=0.0, std=module.dim_key**-0.5)
            init.normal_(module.values.weight, mean=0.0, std=module.values.weight.shape[1] ** -0.5)
        elif isinstance(module, CausalSinkhornHeads) and not module.cross:
            init.normal_(module.null_keys, mean=0.0, std=1.0)
            init.normal_(module.null_values, mean=0.0, std=1.0)
        elif isinstance(module, SinkhornHeads) and module.sort_net is not None:
            init.normal_(module.sort_net, mean=0.0, std=module.sort_net.shape[1] ** -0.5)

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        """transformers' `from_pretrained`, checked (longrange/loading.py): an unreadable weights file, weights that
        do not match config.json (missing, or with no place in the model) and non-finite weights raise, naming the
        file or the weights, instead of giving a model with re-initialised or garbage weights."""
        return checked_from_pretrained(super().from_pretrained, cls, *args, **kwargs)

    def save_pretrained(self, *args, **kwargs):
        """transformers' `save_pretrained`; config.json's `auto_map` names every Auto class (longrange/loading.py): a
        causal folder loaded as the masked LM (or the other way) is refused naming the class to use."""
        heads = {"AutoModelForCausalLM": SinkhornForCausalLM, "AutoModelForMaskedLM": SinkhornForMaskedLM}
        heads.update(AutoModelForSequenceClassification=SinkhornForSequenceClassification)
        heads.update(AutoModelForTokenClassification=SinkhornForTokenClassification)
        heads.update(AutoModelForQuestionAnswering=SinkhornForQuestionAnswering)
        map_every_auto_class(self.config, {"AutoModel": SinkhornModel, **heads})
        return super().save_pretrained(*args, **kwargs)

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False

    def tie_weights(self, *args, **kwargs):
        # from_pretrained passes the keys its checkpoint lacked: weight_tie folders of the old layout lack the
        # LayerNorms of layers >= 1, which start from layer 0's (SinkhornModel._fill_tied_norms)
        super().tie_weights(*args, **kwargs)
        missing = kwargs.get("missing_keys", args[0] if args else None)
        base = self.base_model
        if missing is not None and isinstance(base, SinkhornModel):
            base._fill_tied_norms(missing, "" if base is self else f"{self.base_model_prefix}.")

    # attention implementation: transformers resolves `attn_implementation` (argument or config) through these;
    # the head groups take the result when they are built, and `set_attn_implementation` hands them a new one

    def get_correct_attn_implementation(self, requested_attention: str | None, is_init_check: bool = False) -> str:
        if requested_attention is not None and requested_attention not in ATTENTION_IMPLEMENTATIONS:
            raise ValueError(unsupported_attention(requested_attention))
        return super().get_correct_attn_implementation(requested_attention, is_init_check)

    @classmethod
    def _can_set_attn_implementation(cls) -> bool:
        return True

    def set_attn_implementation(self, attn_implementation: str | dict, allow_all_kernels: bool = False) -> None:
        super().set_attn_implementation(attn_implementation, allow_all_kernels=allow_all_kernels)
        implementation = attention_implementation(self.config)
        for module in self.modules():
            if isinstance(module, (LocalHeads, SinkhornHeads, CausalSinkhornHeads)):
                module.implementation = implementation


class SinkhornModel(SinkhornPreTrainedModel):
    """Token ids (or `inputs_embeds`) to hidden states (the seed's `SinkhornTransformer` / `return_embeddings`).

    Inputs of any length are padded to a multiple of `bucket_size` (padding masked, output trimmed). Any padding
    (left padding for generation) is supported: positions count real tokens only, and each row's real tokens are
    moved to the front before the layers (and the outputs back after), so buckets start at a row's first real
    token and a row's outputs equal those of the unpadded row.
    """

    def __init__(self, config: SinkhornConfig):
        super().__init__(config)
        config.validate_sinkhorn()
        emb = config.embedding_size
        self.embed_tokens = nn.Embedding(config.vocab_size, emb)
        if config.axial_position_embeddings:
            self.embed_positions = AxialPositionEmbedding(config.max_position_embeddings, config.bucket_size, emb)
        else:
            self.embed_positions = nn.Embedding(config.max_position_embeddings, emb)
        self.emb_dropout = nn.Dropout(config.emb_dropout)
        self.project_in = nn.Linear(emb, config.hidden_size) if emb != config.hidden_size else None
        self.layers, self.pkm_blocks, shared = build_layers(config)
        if shared:  # weight_tie: modules shared across layers are FSDP units of their own (see build_layers)
            self._no_split_modules = [*self._no_split_modules, *shared]
        # the final norm, then with factorised embeddings the projection back to emb_dim (as OPT's project_out), so
        # that last_hidden_state is what the output embedding reads; norm_after_project_out normalises after it
        after = config.norm_after_project_out
        self.norm = nn.Identity() if after else nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)
        self.project_out = nn.Linear(config.hidden_size, emb) if emb != config.hidden_size else None
        self.norm_out = nn.LayerNorm(emb, eps=config.layer_norm_eps) if after else None
        # the reversible stack only references the blocks above (kept out of the module tree, so parameter names are
        # the same with and without `reversible`)
        self._reversible = (ReversibleSequence(self._stack_blocks()),) if config.reversible else None
        self.gradient_checkpointing = False
        self.post_init()

    def _tied_norm_sources(self) -> list[tuple[str, str]]:
        """weight_tie: (name, layer 0's name) of every LayerNorm weight that layers >= 1 hold of their own."""
        return tied_norm_sources(self.layers) if self.config.weight_tie else []

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # weight_tie folders saved before the layers had LayerNorms of their own hold one shared set (layer 0's):
        # every layer starts from it, which gives that model's outputs exactly
        for name, source in self._tied_norm_sources():
            if prefix + name not in state_dict and prefix + source in state_dict:
                state_dict[prefix + name] = state_dict[prefix + source].clone()
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def _fill_tied_norms(self, missing_keys: set[str], prefix: str) -> None:
        """The same for `from_pretrained` (called by `tie_weights` with the keys the checkpoint lacked)."""
        with torch.no_grad():
            for name, source in self._tied_norm_sources():
                if prefix + name in missing_keys and prefix + source not in missing_keys:
                    self.get_parameter(name).copy_(self.get_parameter(source))
                    missing_keys.discard(prefix + name)

    def _layer_at(self, depth: int) -> tuple[SinkhornLayer, nn.Module | None]:
        key = str(depth + 1)
        if self.pkm_blocks is not None and key in self.pkm_blocks:
            return self.layers[depth], self.pkm_blocks[key]
        return self.layers[depth], None

    def _stack_blocks(self) -> list[tuple[nn.Module, nn.Module]]:
        """Every layer's (f, g) pairs in order: the reversible stack's blocks."""
        layers = [self._layer_at(depth) for depth in range(self.config.num_hidden_layers)]
        return [pair for layer, ff in layers for pair in layer.blocks(ff)]

    @can_return_tuple
    @call_layout(Layout(absolute_positions=True, unit="bucket_size"))  # packed documents; torch.export: any length
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> SinkhornModelOutput:
        config = self.config
        output_attentions, output_hidden_states = _output_options(self, output_attentions, output_hidden_states)
        batch, length = check_tokens(input_ids, inputs_embeds, config.vocab_size, config.embedding_size)
        cache = _cache_for(self, cache if cache is not None else past_key_values, use_cache, batch)
        _check_context(config, encoder_hidden_states, cache)
        stepping = cache is not None and cache.prefilled
        attention_mask = _check_length_and_mask(config, attention_mask, batch, length, cache if stepping else None)
        if stepping and (output_attentions or (length > 1 and not cache.takes_chunk(length))):
            # sinkhorn_steps.py: attention maps (slow, only when asked) or a few new tokens one at a time
            step = step_with_attentions if output_attentions else tokens_one_at_a_time
            args = (input_ids, inputs_embeds, attention_mask, position_ids, cache, output_hidden_states)
            return SinkhornModelOutput(**step(self, *args))

        given = input_ids if input_ids is not None else inputs_embeds[..., 0]  # [b, L]
        mask = attention_mask if attention_mask is not None else torch.ones_like(given, dtype=torch.bool)
        if position_ids is None:  # positions count real tokens only
            position_ids = position_ids_of(mask, cache.lengths[:, None] if stepping else 0)  # [b, L]
        if inputs_embeds is None:
            inputs_embeds = self.embed_tokens(input_ids)  # [b, L, emb]
        if output_attentions and cache is not None:  # what later cached steps need for their attention maps
            cache.record_inputs(inputs_embeds, position_ids, encoder_hidden_states, encoder_attention_mask)
        hidden = self._embed(inputs_embeds, position_ids)  # [b, L, hidden]
        context = context_mask = None
        if encoder_hidden_states is not None and not stepping:
            context, context_mask = _pad_context(encoder_hidden_states, encoder_attention_mask, config.context_bucket)
        hidden, padded_mask, back = self._enter_buckets(hidden, mask, attention_mask is not None, cache, stepping)

        looks = [{} if output_attentions else None for _ in range(config.num_hidden_layers)]
        # the padding mask and what the head groups derive from it, computed once for all layers
        shared = dict(attention_mask=BucketMask(padded_mask), context=context, context_mask=context_mask)
        hidden, all_hidden = self._run_layers(hidden, shared, cache, looks, length, back, output_hidden_states)
        hidden = self._final(permute_tokens(hidden[:, :length], back))  # [b, L, emb] in the given order

        if stepping:
            cache.end_step(mask[:, 0]) if length == 1 else cache.end_chunk()
        elif cache is not None:
            cache.end_prefill()
        context_length = encoder_hidden_states.shape[1] if context is not None else None
        maps = _attention_outputs(looks, back, length, context_length) if output_attentions else {}
        return SinkhornModelOutput(last_hidden_state=hidden, cache=cache, hidden_states=all_hidden, **maps)

    # -- the forward's steps, in its order ---------------------------------------------------------------------------

    def _embed(self, inputs_embeds: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings plus positions, dropout, and the projection to the layers' width (factorised `emb_dim`)."""
        positions = position_ids.clamp_max(self.config.max_position_embeddings - 1)
        hidden = self.emb_dropout(inputs_embeds + self.embed_positions(positions))  # [b, L, emb]
        return self.project_in(hidden) if self.project_in is not None else hidden

    def _final(self, hidden: torch.Tensor) -> torch.Tensor:
        """The layers' output [b, L, hidden] -> last_hidden_state [b, L, emb] (norm, projection: see __init__)."""
        hidden = self.norm(hidden) if self.project_out is None else self.project_out(self.norm(hidden))
        return self.norm_out(hidden) if self.norm_out is not None else hidden

    def _enter_buckets(self, hidden, mask, padding_given: bool, cache, stepping: bool):
        """The layers' token layout -> hidden [b, L', e], its mask [b, L'] and the order that gives the tokens back
        ([b, L], None: unchanged); the cache starts the call (a prefill or a step).

        Buckets start at each row's first real token: the real tokens of every row move to the front, in order,
        so a row's outputs depend neither on its padding nor on the other rows (`real_tokens_first`); then the
        sequence is padded to whole buckets (L' >= L). New tokens on a filled cache need neither: one token per row
        is a decoding step, several a chunk (the cache lays them out, see `SinkhornCache.begin_chunk`)."""
        if stepping:
            cache.begin_step(mask[:, 0]) if mask.shape[1] == 1 else cache.begin_chunk(mask)
            return hidden, mask, None
        if cache is not None:
            cache.begin_prefill(mask)
        back = None
        if padding_given:
            order = real_tokens_first(mask)  # [b, L]
            back = order.argsort(dim=1)  # [b, L]: each token's place in the given order
            hidden, mask = permute_tokens(hidden, order), mask.gather(1, order)
        size = self.config.bucket_size  # padded to (length + size - 1) // size buckets: a multiple (torch.export)
        pad = (hidden.shape[1] + size - 1) // size * size - hidden.shape[1]
        if isinstance(pad, int) and pad == 0:  # whole buckets already (a symbolic length pads: no guard on it)
            return hidden, mask, back
        return F.pad(hidden, (0, 0, 0, pad)), F.pad(mask, (0, pad), value=False), back

    def _run_layers(self, hidden, shared: dict, cache, looks: list, length: int, back, output_hidden_states: bool):
        """The layer stack -> (hidden [b, L', e], hidden states of every layer or None). `shared`: the kwargs every
        layer gets (masks, context); each layer also gets its cache layer and its attention-map dict (`looks`).
        Reversible layers run as one two-stream stack (reversible.py), the others as residual layers."""
        per_layer = [
            dict(layer_cache=cache.layers[depth] if cache is not None else None, attn_weights=looks[depth])
            for depth in range(self.config.num_hidden_layers)
        ]
        if self._reversible is not None:
            # layer dropout makes a dropped block an identity: the choice is drawn on the CPU (no device sync)
            skip = [False] * self.config.num_hidden_layers
            if self.training and self.config.layer_dropout > 0:
                skip = (torch.rand(self.config.num_hidden_layers) < self.config.layer_dropout).tolist()
            per_block = len(self.layers[0].blocks())
            writes = cache is not None or looks[0] is not None  # blocks that fill a cache or maps run exactly once
            block_kwargs = [kwargs for kwargs in per_layer for _ in range(per_block)] if writes else None
            block_skip = [s for s in skip for _ in range(per_block)]
            return self._reversible[0].run(hidden, shared, block_skip, block_kwargs), None
        return self._residual_layers(hidden, shared, per_layer, length, back, output_hidden_states)

    def _residual_layers(self, hidden, shared, per_layer, length, back, output_hidden_states):
        """x = x + f(x); x = x + g(x) per block, layer by layer (each layer a gradient-checkpointing unit). Layer
        dropout discards a dropped layer's output on the device (no host read, so a training step never waits for
        the device; the layer is still computed)."""
        keep = None
        if self.training and self.config.layer_dropout > 0:
            keep = torch.rand(self.config.num_hidden_layers, device=hidden.device) >= self.config.layer_dropout

        def given_order(h):  # [b, L, e] in the order of the given tokens
            return permute_tokens(h[:, :length], back)

        all_hidden = (given_order(hidden),) if output_hidden_states else None
        for depth, kwargs in enumerate(per_layer):
            layer, ff = self._layer_at(depth)
            out = layer(hidden, **shared, **kwargs, feed_forward=ff)
            hidden = out if keep is None else torch.where(keep[depth], out, hidden)
            if output_hidden_states:
                all_hidden = all_hidden + (given_order(hidden),)
        return hidden, all_hidden


# ----------------------------------------------------------------------------------------------------------------
# the model boundary: SinkhornModel.forward's checks and the cache a call uses (the shared checks: inputs.py)
# ----------------------------------------------------------------------------------------------------------------


def _output_options(model, output_attentions, output_hidden_states) -> tuple[bool, bool]:
    """output_attentions / output_hidden_states, defaulting to the config's, refused where the model cannot give
    them."""
    config = model.config
    if output_attentions is None:
        output_attentions = getattr(config, "output_attentions", False)
    if output_attentions and model.training and config.layer_dropout > 0:
        raise ValueError(
            "SinkhornModel: output_attentions with layer_dropout > 0 in training mode is not supported (a "
            "dropped layer attends nothing); call model.eval() first"
        )
    if output_hidden_states is None:
        output_hidden_states = config.output_hidden_states
    if output_hidden_states and config.reversible:
        raise ValueError("SinkhornModel: output_hidden_states is not available with reversible=True")
    return output_attentions, output_hidden_states


def _cache_for(model, cache, use_cache, batch: int) -> SinkhornCache | None:
    """The SinkhornCache this call fills or steps, or None. A cache is for generation: by default none in
    training mode, and only a causal model uses one. An empty generic cache (e.g. from
    EncoderDecoderModel.generate) is replaced by our own, not marked compileable, since that caller would then
    build transformers' 4-D attention masks from it."""
    config = model.config
    if cache is not None:
        check_cache(cache, "sinkhorn", batch, cache.batch_size if isinstance(cache, SinkhornCache) else 0)
    if use_cache is None:
        use_cache = config.use_cache and not model.training
    use_cache = use_cache and config.causal
    if cache is not None and not isinstance(cache, SinkhornCache):
        if cache.get_seq_length() > 0:
            raise ValueError(f"SinkhornModel: expected a SinkhornCache, got a filled {type(cache).__name__}")
        cache = SinkhornCache(config, compileable=False) if use_cache else None
    elif use_cache and cache is None:
        cache = SinkhornCache(config)
    return cache if use_cache else None


def _check_context(config, encoder_hidden_states, cache) -> None:
    """encoder_hidden_states exactly when the model cross-attends (a filled cache keeps the context)."""
    if encoder_hidden_states is not None and not config.receives_context:
        raise ValueError("SinkhornModel: encoder_hidden_states needs a config with receives_context=True")
    filled = cache is not None and cache.prefilled
    if config.receives_context and encoder_hidden_states is None and not filled:
        raise ValueError("SinkhornModel: receives_context=True needs encoder_hidden_states (the context)")


def _check_length_and_mask(config, attention_mask, batch: int, length: int, filled: SinkhornCache | None):
    """Refuses sequences longer than the position table; the padding mask of the new tokens (generate() passes
    the mask of the whole sequence so far) as bool, or None. `filled`: the cache being stepped."""
    # tokens given before: none without a filled cache (also when compiled: the length is known while tracing), else
    # the cache's host count (unknown inside compiled decoding steps, which check nothing here)
    past = 0 if filled is None else None if torch.compiler.is_compiling() else filled.host_seq_length
    limit = config.max_position_embeddings
    if past is not None and past + length > limit:
        raise ValueError(f"SinkhornModel: sequence length {past + length} exceeds max_position_embeddings ({limit})")
    if attention_mask is None:
        return None
    so_far = past + length if past is not None else getattr(attention_mask, "shape", (0, length))[-1]
    return check_mask(attention_mask, batch, (length, so_far) if filled is not None else (length,), length)


def _pad_context(context: torch.Tensor, context_mask: torch.Tensor | None, bucket: int):
    """The encoder states [b, Lc, e] and their mask [b, Lc], padded to whole context buckets of `bucket`."""
    b, lc, _ = context.shape
    if context_mask is not None:
        mask = check_mask(context_mask, b, (lc,), lc, "encoder_attention_mask")
    else:
        mask = torch.ones(b, lc, dtype=torch.bool, device=context.device)
    pad = (-lc) % bucket
    return F.pad(context, (0, 0, 0, pad)), F.pad(mask, (0, pad), value=False)


def _attention_outputs(looks: list[dict], back, length: int, context_length: int | None) -> dict:
    """The layers' attention dicts -> the output's attentions, cross_attentions (None without a context) and
    routing: maps in the order of the given tokens; routing in each row's bucket grid of its real tokens."""

    def given_order(t, keys):
        return permute_map(t, back, keys=keys)

    attentions = tuple(given_order(look["map"][:, :, :length, :length], True) for look in looks)
    routing = tuple(
        SinkhornRouting(
            key_buckets=look["route"],
            weights=look["route_weight"],
            offsets=look["offset"],
            null_attention=None if look["null"] is None else given_order(look["null"][:, :, :length], False),
        )
        for look in looks
    )
    cross_attentions = None
    if context_length is not None:
        cross_attentions = tuple(
            given_order(look["cross"]["map"][:, :, :length, :context_length], False) for look in looks
        )
    return dict(attentions=attentions, cross_attentions=cross_attentions, routing=routing)


class _SinkhornLanguageModel(SinkhornPreTrainedModel):
    """The base model plus the language-model head shared by the causal and the masked LM: the (optionally tied)
    output layer reads the base model's last_hidden_state (with factorised embeddings already projected back to
    `emb_dim` by the base model), so `get_output_embeddings()(model.model(ids).last_hidden_state)` are the logits."""

    _tied_weights_keys = {"lm_head.weight": "model.embed_tokens.weight"}
    # folders saved before the base model held the projection back (this class did): their names, renamed on load
    _moved_keys = {"project_out.": "model.project_out.", "norm_out.": "model.norm_out."}
    _needs_causal: bool

    def __init__(self, config: SinkhornConfig):
        super().__init__(config)
        if config.causal != self._needs_causal:
            other = "SinkhornForCausalLM" if config.causal else "SinkhornForMaskedLM"
            raise ValueError(
                f"{type(self).__name__} needs causal={self._needs_causal} (use {other} for causal={config.causal})"
            )
        self.model = SinkhornModel(config)
        self.lm_head = nn.Linear(config.embedding_size, config.vocab_size, bias=config.lm_head_bias)
        self.post_init()

    def get_output_embeddings(self):
        return self.lm_head

    def set_output_embeddings(self, new_embeddings):
        self.lm_head = new_embeddings

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        rename_moved_keys(state_dict, prefix, self._moved_keys)  # load_state_dict (from_pretrained: loading.py)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


class SinkhornForCausalLM(_SinkhornLanguageModel, GenerationMixin):
    _needs_causal = True

    # generate(): a SinkhornCache sized for the whole generation (so decoding steps keep static shapes and compile),
    # and the attention mask of the new tokens only (the cache keeps the padding of earlier tokens itself)

    def _prepare_cache_for_generation(
        self, generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
    ) -> None:
        check_assisted_decoding(generation_mode)
        use_own_cache(generation_config, model_kwargs, "SinkhornCache")
        given = model_kwargs.get("cache") is not None or model_kwargs.get("past_key_values") is not None
        if given or generation_config.use_cache is False or generation_config.cache_implementation is not None:
            return super()._prepare_cache_for_generation(
                generation_config, model_kwargs, generation_mode, batch_size, max_cache_length
            )
        requested = getattr(generation_config, "max_cache_len", None)  # not a GenerationConfig field in older releases
        if requested is not None:
            max_cache_length = max(max_cache_length, requested)
        model_kwargs["cache"] = SinkhornCache(self.config, max_cache_len=max_cache_length)

    def prepare_inputs_for_generation(self, input_ids, attention_mask=None, inputs_embeds=None, **kwargs) -> dict:
        """transformers' inputs; on a filled cache, the padding mask of the new tokens only, as a fresh tensor (a
        view of the growing mask would change strides every step, and a compiled step would be compiled and
        recorded again), and before a one-token step the cache is told that the new token is real in every row,
        so that it knows on the host whether routing can be skipped (`plan_real_step`)."""
        inputs = super().prepare_inputs_for_generation(
            input_ids, attention_mask=attention_mask, inputs_embeds=inputs_embeds, **kwargs
        )
        cache, new = inputs.get(CACHE_NAME), inputs.get("input_ids", inputs.get("inputs_embeds"))
        if isinstance(cache, SinkhornCache) and cache.prefilled and new is not None:
            mask = inputs.get("attention_mask")
            if isinstance(mask, torch.Tensor) and mask.dim() == 2:
                inputs["attention_mask"] = mask[:, -new.shape[1] :].clone(memory_format=torch.contiguous_format)
            if new.shape[1] == 1:
                cache.plan_real_step()
        return inputs

    def create_masks_for_generate(self, attention_mask=None, **kwargs):
        """The 2-D padding mask as it is (the model builds its bucket masks itself; see prepare_inputs_for_generation)."""
        return attention_mask

    def _random_truncate(self, input_ids, attention_mask, labels):
        """Cut every row at a random length (>= 2) and move it to the end of the window (left padding)."""
        b, n = input_ids.shape
        keep = torch.randint(2, n + 1, (b,), device=input_ids.device)
        src = torch.arange(n, device=input_ids.device)[None, :] - (n - keep)[:, None]
        inside = src >= 0
        src = src.clamp_min(0)
        pad_id = self.config.pad_token_id if self.config.pad_token_id is not None else 0
        input_ids = input_ids.gather(1, src).masked_fill(~inside, pad_id)
        mask = inside if attention_mask is None else inside & attention_mask.bool().gather(1, src)
        if labels is not None:
            labels = labels.gather(1, src).masked_fill(~inside, -100)
        return input_ids, mask, labels

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        past_key_values: Cache | None = None,
        labels: torch.LongTensor | None = None,
        use_cache: bool | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> SinkhornCausalLMOutput:
        shift_labels = kwargs.pop("shift_labels", None)
        if self.training and self.config.randomly_truncate_sequence and input_ids is not None:
            check_tokens(input_ids, None, self.config.vocab_size, self.config.embedding_size)
            if shift_labels is not None:
                raise ValueError(
                    "shift_labels cannot be used with randomly_truncate_sequence=True (the truncation moves each "
                    "row's tokens; pass labels, which it moves with them)"
                )
            if input_ids.shape[1] > 2:
                input_ids, attention_mask, labels = self._random_truncate(input_ids, attention_mask, labels)
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            cache=cache if cache is not None else past_key_values,
            use_cache=use_cache,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=True,
            **pop_document_kwargs(kwargs),
        )
        hidden = outputs.last_hidden_state
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self.lm_head(hidden)  # [batch, seq, vocab]
        loss = None
        if check_lm_labels(labels, shift_labels, logits.shape[:2], self.config.vocab_size):
            loss = self.loss_function(logits, labels, self.config.vocab_size, shift_labels=shift_labels, **kwargs)
        return SinkhornCausalLMOutput(
            loss=loss,
            logits=logits,
            cache=outputs.cache,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            cross_attentions=outputs.cross_attentions,
            routing=outputs.routing,
        )


class SinkhornForMaskedLM(_SinkhornLanguageModel):
    _needs_causal = False

    @can_return_tuple
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        encoder_hidden_states: torch.Tensor | None = None,
        encoder_attention_mask: torch.Tensor | None = None,
        labels: torch.LongTensor | None = None,
        output_hidden_states: bool | None = None,
        output_attentions: bool | None = None,
        **kwargs,
    ) -> SinkhornMaskedLMOutput:
        outputs = self.model(
            input_ids=input_ids,
            attention_mask=attention_mask,
            position_ids=position_ids,
            inputs_embeds=inputs_embeds,
            encoder_hidden_states=encoder_hidden_states,
            encoder_attention_mask=encoder_attention_mask,
            use_cache=False,
            output_hidden_states=output_hidden_states,
            output_attentions=output_attentions,
            return_dict=True,
            **pop_document_kwargs(kwargs),
        )
        logits = self.lm_head(outputs.last_hidden_state)
        loss = None
        if labels is not None:
            check_labels(labels, logits.shape[:2], self.config.vocab_size)
            loss = F.cross_entropy(logits.float().view(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100)
        return SinkhornMaskedLMOutput(
            loss=loss,
            logits=logits,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            cross_attentions=outputs.cross_attentions,
            routing=outputs.routing,
        )


class SinkhornForSequenceClassification(SequenceClassification, SinkhornPreTrainedModel):
    """A label per sequence (longrange/classification.py), causal or not."""

    base_model_class = SinkhornModel


class SinkhornForTokenClassification(TokenClassification, SinkhornPreTrainedModel):
    """A label per token (longrange/classification.py), causal or not."""

    base_model_class = SinkhornModel


class SinkhornForQuestionAnswering(QuestionAnswering, SinkhornPreTrainedModel):
    """An answer span's start and end (longrange/classification.py); causal or not."""

    base_model_class = SinkhornModel


__all__ = [
    "SinkhornForCausalLM",
    "SinkhornForQuestionAnswering",
    "SinkhornForMaskedLM",
    "SinkhornForSequenceClassification",
    "SinkhornForTokenClassification",
    "SinkhornModel",
    "SinkhornPreTrainedModel",
    "SinkhornRouting",
]
