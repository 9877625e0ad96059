"""Configuration of the Sinkhorn Transformer (Tay et al. 2020, "Sparse Sinkhorn Attention").

Every option of the sinkhorn-transformer package is available under its own name: the transformers names are the
canonical fields and the package's names (`num_tokens`, `dim`, `depth`, `heads`, `max_seq_len`) are aliases. A
config validates itself when built or loaded, against the two tables at the end of this file (what each field
accepts, which settings work together), so the models can trust it.
"""

from __future__ import annotations

import contextvars
import math

from transformers import PreTrainedConfig

from .configuration_checks import (
    CLASSIFIER_RULES,
    PKM_TOPK_FITS,
    Requirement,
    check_fields,
    check_requirements,
    integer,
    one_of,
    optional,
    positive_number,
    probability,
    refuse_other_model_type,
    resolve_pkm_topk,
    warn_near_misses,
)

# set while `from_dict` (config.json, from_pretrained, AutoConfig) rebuilds a saved config: its keys that are not
# options are attributes a user or a tool set before saving, kept as they are; a constructor call refuses them
_REBUILDING_SAVED = contextvars.ContextVar("sinkhorn_config_rebuilding_saved", default=False)

# keys that PreTrainedConfig (or save_pretrained / from_pretrained / EncoderDecoderModel) may pass besides our fields
_GENERIC_KEYS = {
    "auto_map",
    "num_labels",
    "output_attentions",
    "attn_implementation",
    "experts_implementation",
    "torch_dtype",
    "name_or_path",
    "_name_or_path",
    "tokenizer_class",
    "prefix",
    "task_specific_params",
    "finetuning_task",
    "decoder_start_token_id",
    "sep_token_id",
    "cross_attention_hidden_size",
    "per_layer_config",
    "model_type",
    "_commit_hash",
    "rope_scaling",
    "rope_theta",
    "tie_encoder_decoder",
    "pruned_heads",
    "chunk_size_feed_forward",
    "_attn_implementation_internal",
    "_experts_implementation_internal",
}


class SinkhornConfig(PreTrainedConfig):
    r"""
    Configuration of [`SinkhornModel`] and its heads (causal and masked LM, sequence and token classification).

    Model size
        vocab_size (alias `num_tokens`): number of token ids.
        hidden_size (alias `dim`): width of the residual stream.
        num_hidden_layers (alias `depth`): number of layers.
        num_attention_heads (alias `heads`): attention heads per layer.
        dim_head: width of one head; default `hidden_size // num_attention_heads`. Setting it decouples the head
            width from `hidden_size` (the attention projects to `heads * dim_head` and back).
        intermediate_size: feed-forward inner width; default `4 * hidden_size`.
        ff_glu: gated (GEGLU) feed-forward.
        emb_dim: factorised embeddings (ALBERT): tokens and positions are embedded in `emb_dim` and projected to
            `hidden_size`; the language-model head projects back to `emb_dim` before the (tied) output embedding.
        max_position_embeddings (alias `max_seq_len`): number of learned absolute positions; longer inputs raise.
        axial_position_embeddings: positions embedded axially, as sinkhorn-transformer does: position p gets
            `per_bucket[p // bucket_size] + in_bucket[p % bucket_size]` instead of one learned row per position.
            Default True: over 1,200 training steps it learns text clearly faster than one row per position (docs,
            "Sinkhorn parity"); False retrieves far better: passkey recall 0.30 / 0.47 (unweighted).

    Sinkhorn attention
        bucket_size: tokens per bucket (inputs of any length are padded to a multiple, padding masked).
        causal: autoregressive attention (required by `SinkhornForCausalLM`; `is_decoder` is an alias). A query
            bucket then chooses among strictly earlier key buckets and `n_top_buckets` learned null buckets, from
            its leading token; half of the Sinkhorn heads use buckets shifted by `bucket_size - 1` (the seed's
            rotated heads) so that the last token of every bucket also leads a choice.
        n_top_buckets: key buckets each query bucket attends besides its own, chosen by the sort net.
        n_sortcut: SortCut (non-causal only). One summary of all queries chooses `n_sortcut` key buckets that every
            query bucket attends (plus its own): memory linear in length. 0 = off.
        use_simple_sort_net: the paper's sort net (learned projection of bucket sums, then Sinkhorn balancing)
            instead of the default attention sort net (dot products of bucket summaries). Non-causal only.
        sinkhorn_iter: Sinkhorn normalisation iterations, used when `non_permutative=False`.
        sort_temperature: temperature of the routing scores: the Gumbel-Sinkhorn temperature when
            `non_permutative=False`, otherwise the temperature of the routing softmax whose straight-through
            gradient trains the sort net. The seed's name `temperature` is accepted as a constructor keyword only
            (as a config attribute, `generate()` would take it for the sampling temperature).
        simple_sort_net_scores: routing logits of the simple sort net: "log_relu" (default, log(relu(W x)), the
            log-scores the paper's Gumbel-Sinkhorn balancing takes) or "relu" (relu(W x), as the package's top-k).
        non_permutative: True = each query bucket takes its top-scoring key buckets independently (a key bucket
            may serve many query buckets); False = scores are balanced by Gumbel-Sinkhorn into a soft permutation
            first (Gumbel noise only in training). False needs `causal=False`.
        weight_routed_values: True (default) = a chosen bucket's values are multiplied by its routing weight (the
            routing softmax at `sort_temperature`, or the Gumbel-Sinkhorn matrix), as the seed's reordering matrix
            does. False = the chosen buckets are attended as they are (straight-through weights train the sort
            net). True / False: Tiny Shakespeare (6 x 256, 100 steps) 3.567 / 3.611 bits/char; passkey recall
            beyond the local buckets (benchmark_recall.py) 0.11 / 0.30.
        routing_gradient: with `weight_routed_values=False`, what a chosen bucket's straight-through weight scales in
            the backward pass of causal self-attention (forward unchanged): "values" (default; d loss / d scaling
            its values) or "attention" (its attention probabilities: the derivative of including the bucket).
        n_local_attn_heads: this many heads use local windowed attention (window = `bucket_size`, looking one
            window back, and one ahead when non-causal) instead of Sinkhorn attention.
        receives_context (alias `add_cross_attention`): layers also attend `encoder_hidden_states` (seed: `context`).
        context_bucket_size: bucket size of the context; default `bucket_size`.
        context_n_sortcut: context buckets attended. Causal decoder: each query bucket chooses this many (0 =
            `n_top_buckets`) from its leading token (no future leak, cacheable). Non-causal: > 0 = SortCut (one
            choice for all query buckets), 0 = each query bucket chooses `n_top_buckets`.

    Memory savers
        reversible: reversible residual layers (Reformer); activations recomputed in backward.
        ff_chunks: the feed-forward runs over this many chunks of the sequence (1 = unchunked).
        weight_tie: the layers share one set of attention and feed-forward weights (ALBERT), each keeping its own
            LayerNorms, as sinkhorn-transformer's `weight_tie` does; product-key layers keep their own memory (folders
            saved while the LayerNorms were shared load each layer from the shared norms: the same outputs).
        layer_dropout: probability of skipping a whole layer in training ("Reducing Transformer Depth on Demand").
        pkm_layers: 1-based layer numbers whose feed-forward is replaced by a product-key memory.
        pkm_num_keys, pkm_topk, pkm_heads: product-key memory size (`pkm_num_keys ** 2` slots), slots read per
            head (at most `pkm_num_keys`; default None = `min(32, pkm_num_keys)`, resolved when the config is built
            and saved resolved), query heads.
        pkm_dim_key: width of each half of a product-key query (and of the sub-keys); default `hidden_size // 2`.
        pkm_norm_halves: the query LayerNorm normalises each half-query separately (width `pkm_dim_key`, as the
            product-key-memory package does) instead of each head's whole query (default False).

    Dropout
        emb_dropout: after the embeddings. ff_dropout: inside the feed-forward. attn_dropout: on attention
        probabilities. attn_layer_dropout: on the attention block output.

    Training
        randomly_truncate_sequence: `SinkhornForCausalLM` in training mode cuts every row at a random length and
            left-aligns it to the end of the window (the seed's trick so the sort net learns partially filled
            buckets). No effect in eval mode.

    Initialisation and output layer (defaults follow the sinkhorn-transformer package: with the transformers
    conventions instead, 0.02-normal weights and a tied output embedding, a 6 x 256 character model trained 100 steps
    on Tiny Shakespeare (benchmarks/benchmark_quality.py) scored 3.83 validation bits/char against the package's 3.60;
    with these defaults 3.61)
        initializer_range: None (default) = PyTorch's own defaults, as in the package: `nn.Linear` weights and biases
            U(-1/sqrt(fan_in), 1/sqrt(fan_in)), token and position embeddings N(0, 1) (so that tokens and positions
            start well apart in the residual stream, which the pre-LayerNorm blocks see normalised). A float = the
            transformers convention: every linear and embedding weight N(0, initializer_range), biases zero.
        tie_word_embeddings: the output layer shares the input token embedding. Default False (the package has a
            separate output layer). When tied and `initializer_range` is None, the shared matrix is initialised
            N(0, 1/embedding size) as an output layer (unit-variance logits at init) rather than N(0, 1).

    Output layer options matching sinkhorn-transformer checkpoints (`longrange convert` sets them)
        lm_head_bias: the output layer has a bias. Default False.
        norm_after_project_out: with factorised embeddings (`emb_dim` != `hidden_size`), the final LayerNorm acts
            on the `emb_dim`-sized output of the projection back (as in the package) instead of on the hidden
            states before it; `SinkhornModel` then returns un-normalised hidden states. Needs `emb_dim`.

    Routing options matching sinkhorn-transformer checkpoints (default off)
        weight_routed_keys: the keys of each chosen bucket are also multiplied by its routing weight (the package's
            reordering matrix scales keys and values). Needs `weight_routed_values`.
        sequential_routing_weights: the weight of the i-th chosen bucket is a softmax over the candidates not
            chosen before it (the package's iterative top-k), instead of the softmax over all candidates. Needs
            `non_permutative=True`.
        route_own_bucket: non-causal only: a query bucket's own bucket is also a routing candidate (with SortCut:
            stays in the shared choice), so it can be attended twice, as in the package; default False excludes it.
        causal_key_summary: causal self-attention: how a key bucket is summarised for routing. "mean" (default):
            the mean of its keys; "running_mean_sum" (the package): the sum over its tokens of the running mean of
            all keys up to each token.
        causal_null_score: causal self-attention: routing score of a null bucket. "learned" (default): the query
            summary times the null bucket's learned key; "zero" (the package): 0.
        null_bucket_copies: causal self-attention: every slot of a null bucket holds its learned key/value
            (`bucket_size` copies, as in the package) instead of one slot (default False).
        shifted_heads_skip_first_bucket: causal self-attention: the short first bucket of the shifted heads (tokens
            0 .. bucket_size-2) attends no chosen bucket, enters no routing summary and is never chosen, as in the
            package (whose rotation wraps those tokens to the end). Default False: it routes to null buckets.

    Misc: layer_norm_eps, pad/bos/eos_token_id, use_cache (generation cache; causal models only, and by default not
    in training mode); the classification heads' `classifier_pooling` ("last", "mean"; default None: "last" when
    causal, else "mean") and `classifier_dropout` (token head; default None: 0.1), see longrange/classification.py.

    Unknown keywords: the constructor refuses them, naming them (typos). A saved config (`from_dict`, which
    `from_pretrained` and `AutoConfig` use) keeps keys that are not options as attributes, since they were set on
    the config before it was saved (with a warning when one looks like a typo of an option); a missing field takes
    its default; a config of another `model_type` is refused.
    """

    model_type = "sinkhorn"
    attribute_map = {
        "num_tokens": "vocab_size",
        "dim": "hidden_size",
        "depth": "num_hidden_layers",
        "heads": "num_attention_heads",
        "max_seq_len": "max_position_embeddings",
        "is_decoder": "causal",
        "add_cross_attention": "receives_context",
    }
    # constructor-only aliases (not attributes: as an attribute, `temperature` would change sampling in generate())
    keyword_aliases = {"temperature": "sort_temperature"}

    vocab_size: int = 20000
    hidden_size: int = 512
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    dim_head: int | None = None
    intermediate_size: int | None = None
    ff_glu: bool = False
    emb_dim: int | None = None
    max_position_embeddings: int = 2048
    axial_position_embeddings: bool = True
    bucket_size: int = 64
    causal: bool = False
    n_top_buckets: int = 2
    n_sortcut: int = 0
    use_simple_sort_net: bool = False
    simple_sort_net_scores: str = "log_relu"
    sinkhorn_iter: int = 5
    sort_temperature: float = 0.75
    non_permutative: bool = True
    weight_routed_values: bool = True
    routing_gradient: str = "values"
    n_local_attn_heads: int = 0
    receives_context: bool = False
    context_bucket_size: int | None = None
    context_n_sortcut: int = 0
    reversible: bool = False
    ff_chunks: int = 1
    weight_tie: bool = False
    layer_dropout: float = 0.0
    pkm_layers: list[int] | tuple[int, ...] = ()
    pkm_num_keys: int = 128
    pkm_topk: int | None = None
    pkm_heads: int = 4
    pkm_dim_key: int | None = None
    pkm_norm_halves: bool = False
    emb_dropout: float = 0.0
    ff_dropout: float = 0.0
    attn_dropout: float = 0.0
    attn_layer_dropout: float = 0.0
    randomly_truncate_sequence: bool = False
    layer_norm_eps: float = 1e-5
    initializer_range: float | None = None
    use_cache: bool = True
    tie_word_embeddings: bool = False
    lm_head_bias: bool = False
    norm_after_project_out: bool = False
    weight_routed_keys: bool = False
    sequential_routing_weights: bool = False
    route_own_bucket: bool = False
    causal_key_summary: str = "mean"
    causal_null_score: str = "learned"
    null_bucket_copies: bool = False
    shifted_heads_skip_first_bucket: bool = False
    classifier_pooling: str | None = None
    classifier_dropout: float | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None

    def __post_init__(self, **kwargs):
        _check_keywords(type(self), kwargs)
        # the seed's `temperature`: a generation parameter name, which PreTrainedConfig would drop, and which as an
        # attribute would change sampling in generate(); stored as sort_temperature
        if "temperature" in kwargs:
            self.sort_temperature = kwargs.pop("temperature")
        super().__post_init__(**kwargs)
        self.pkm_layers = [int(i) for i in self.pkm_layers]
        resolve_pkm_topk(self)
        self.validate_sinkhorn()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """Rebuild a saved config (config.json, `from_pretrained`, `AutoConfig`); see "Unknown keywords" above."""
        refuse_other_model_type(cls, config_dict)
        token = _REBUILDING_SAVED.set(True)
        try:
            return super().from_dict(config_dict, **kwargs)
        finally:
            _REBUILDING_SAVED.reset(token)

    def validate_sinkhorn(self) -> None:
        """Raise ValueError naming the field(s) and the allowed values for every setting that cannot work."""
        check_fields(self, FIELD_RULES, PREFIX, also_called={"sort_temperature": "temperature"})
        check_requirements(self, REQUIREMENTS, PREFIX)

    @property  # derived sizes
    def head_dim(self) -> int:
        return self.dim_head if self.dim_head is not None else self.hidden_size // self.num_attention_heads

    @property
    def ff_size(self) -> int:
        return self.intermediate_size if self.intermediate_size is not None else 4 * self.hidden_size

    @property
    def embedding_size(self) -> int:
        return self.emb_dim if self.emb_dim is not None else self.hidden_size

    @property
    def context_bucket(self) -> int:
        return self.context_bucket_size if self.context_bucket_size is not None else self.bucket_size

    @property
    def context_top(self) -> int:
        return self.context_n_sortcut if self.context_n_sortcut > 0 else self.n_top_buckets

    @property
    def max_buckets(self) -> int:
        return math.ceil(self.max_position_embeddings / self.bucket_size)


def _check_keywords(cls, kwargs) -> None:
    """A constructor call refuses keywords that are not options, naming them (typos). A saved config being rebuilt
    keeps them as attributes (a user or a tool set them before saving), with a warning for a likely typo."""
    fields = set(cls.__dataclass_fields__)
    known = fields | set(cls.attribute_map) | _GENERIC_KEYS | set(cls.keyword_aliases)
    unknown = sorted(k for k in kwargs if k not in known)
    if unknown and not _REBUILDING_SAVED.get():
        raise ValueError(f"SinkhornConfig: unknown option(s) {unknown}")
    warn_near_misses(unknown, [*fields, *cls.attribute_map], cls.__name__)


# -- validation: what each field accepts, then which settings work together -------------------------------------

PREFIX = "SinkhornConfig: "
_POSITIVE = integer(1, "a positive integer")
FIELD_RULES = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"), _POSITIVE),
    **dict.fromkeys(("max_position_embeddings", "bucket_size", "n_top_buckets", "ff_chunks"), _POSITIVE),
    **dict.fromkeys(("sinkhorn_iter", "pkm_num_keys", "pkm_topk", "pkm_heads"), _POSITIVE),
    # None: a default derived from other fields (the properties above; pkm_dim_key: hidden_size // 2)
    **dict.fromkeys(("dim_head", "intermediate_size", "emb_dim", "context_bucket_size"), optional(_POSITIVE)),
    "pkm_dim_key": optional(_POSITIVE),
    **dict.fromkeys(("n_sortcut", "context_n_sortcut", "n_local_attn_heads"), integer(0)),
    **dict.fromkeys(
        ("emb_dropout", "ff_dropout", "attn_dropout", "attn_layer_dropout", "layer_dropout"), probability("in [0, 1)")
    ),
    "initializer_range": optional(positive_number(), "None (PyTorch's default init) or a float > 0"),
    "sort_temperature": positive_number("> 0"),
    "causal_key_summary": one_of(("mean", "running_mean_sum")),
    "causal_null_score": one_of(("learned", "zero")),
    "routing_gradient": one_of(("values", "attention")),
    "simple_sort_net_scores": one_of(("log_relu", "relu")),
    **CLASSIFIER_RULES,
}

# options that reproduce sinkhorn-transformer's causal self-attention (longrange convert sets them)
_REFERENCE_CAUSAL = ("causal_key_summary", "causal_null_score", "null_bucket_copies", "shifted_heads_skip_first_bucket")


def _changed_reference_causal(config) -> list[str]:
    """The reference's causal options set to something else than their default."""
    return [n for n in _REFERENCE_CAUSAL if getattr(config, n) != type(config).__dataclass_fields__[n].default]


def _pkm_layers_outside(config) -> list[int]:
    """pkm_layers entries that are not a layer number (counted from 1)."""
    return [i for i in config.pkm_layers if not 1 <= i <= config.num_hidden_layers]


REQUIREMENTS = (
    Requirement(
        lambda c: c.dim_head is None and c.hidden_size % c.num_attention_heads != 0,
        "hidden_size ({c.hidden_size}) must be divisible by num_attention_heads ({c.num_attention_heads}), "
        "or set dim_head",
    ),
    Requirement(
        lambda c: c.n_local_attn_heads > c.num_attention_heads,
        "n_local_attn_heads ({c.n_local_attn_heads}) must not exceed num_attention_heads ({c.num_attention_heads})",
    ),
    Requirement(
        lambda c: c.n_sortcut > 0 and not c.non_permutative,
        "n_sortcut > 0 needs non_permutative=True: SortCut scores the key buckets against one summary of all "
        "queries, and Sinkhorn balancing of that single row gives every bucket the same weight, so the sort net "
        "would choose nothing",
    ),
    Requirement(
        lambda c: c.causal and c.n_sortcut > 0,
        "n_sortcut > 0 needs causal=False (one summary of all queries sees the future)",
    ),
    Requirement(
        lambda c: c.causal and c.use_simple_sort_net,
        "use_simple_sort_net=True needs causal=False (the Gumbel-Sinkhorn sort net balances over all buckets and "
        "sees the future)",
    ),
    Requirement(
        lambda c: c.causal and not c.non_permutative,
        "non_permutative=False (Sinkhorn balancing) needs causal=False; use non_permutative=True with causal=True",
    ),
    Requirement(
        _pkm_layers_outside,
        "pkm_layers are 1-based layer numbers in [1, {c.num_hidden_layers}], got {found}",
    ),
    PKM_TOPK_FITS,
    Requirement(
        lambda c: c.norm_after_project_out and c.embedding_size == c.hidden_size,
        "norm_after_project_out=True needs emb_dim different from hidden_size (factorised embeddings); without "
        "them there is no output projection",
    ),
    Requirement(
        lambda c: c.weight_routed_keys and not c.weight_routed_values,
        "weight_routed_keys=True needs weight_routed_values=True",
    ),
    Requirement(
        lambda c: c.routing_gradient != "values" and (c.weight_routed_values or not c.causal),
        "routing_gradient={c.routing_gradient!r} needs causal=True and weight_routed_values=False (it chooses the "
        "straight-through gradient of causal self-attention's routing)",
    ),
    Requirement(
        lambda c: c.sequential_routing_weights and not c.non_permutative,
        "sequential_routing_weights=True needs non_permutative=True",
    ),
    Requirement(
        lambda c: c.simple_sort_net_scores != "log_relu" and not c.use_simple_sort_net,
        "simple_sort_net_scores applies to use_simple_sort_net=True only",
    ),
    Requirement(
        lambda c: not c.causal and _changed_reference_causal(c),
        "{found} apply to causal self-attention only; set causal=True",
    ),
    Requirement(
        lambda c: c.route_own_bucket and c.causal,
        "route_own_bucket=True needs causal=False (a causal query bucket chooses among strictly earlier buckets)",
    ),
    Requirement(
        lambda c: c.ff_chunks > 1 and c.ff_chunks > c.max_position_embeddings,
        "ff_chunks must not exceed max_position_embeddings",
    ),
)


__all__ = ["SinkhornConfig"]
