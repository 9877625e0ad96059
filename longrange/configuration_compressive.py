"""Configuration of the Compressive Transformer (Rae et al. 2019).

Every field is documented below and validated in `__post_init__` against the two tables at the end of this file
(what each field accepts, which settings work together); a bad value raises `ValueError` naming the field and what
is allowed, so the model itself can trust its config. The annotated seed's option names (`d_model`, `n_layers`,
`heads`, `d_ff`, `dropout_prob`) are accepted as aliases of the transformers names.
"""

from __future__ import annotations

from transformers import PreTrainedConfig

from .configuration_checks import (
    BOOLEAN,
    CLASSIFIER_RULES,
    PKM_TOPK_FITS,
    TOKEN_ID,
    TOKEN_IDS,
    Requirement,
    check_fields,
    check_requirements,
    integer,
    non_negative_number,
    one_of,
    positive_number,
    probability,
    refuse_other_model_type,
    resolve_pkm_topk,
    warn_near_misses,
)

COMPRESSION_FUNCTIONS = ("conv1d", "max_pool", "mean_pool", "dilated_conv", "most_used")
# compression functions with parameters: only these can be trained by a reconstruction loss
TRAINABLE_COMPRESSION_FUNCTIONS = ("conv1d", "dilated_conv")
RECONSTRUCTION_LOSSES = ("attention", "autoencoding", "none")
LAYER_NORM_POSITIONS = ("pre", "post")


class CompressiveConfig(PreTrainedConfig):
    r"""
    Args:
        vocab_size (`int`, defaults to 256): number of token ids (256 = bytes).
        hidden_size (`int`, defaults to 512): model width (seed: `d_model`).
        num_hidden_layers (`int`, defaults to 6): number of layers (seed: `n_layers`).
        num_attention_heads (`int`, defaults to 8): attention heads; must divide `hidden_size` (seed: `heads`).
        intermediate_size (`int`, defaults to 2048): feed-forward inner width (seed: `d_ff`).
        hidden_dropout (`float`, defaults to 0.0): dropout on embeddings and on each residual branch (seed:
            `dropout_prob`).
        attention_dropout (`float`, defaults to 0.0): dropout on attention probabilities.
        layer_norm_eps (`float`, defaults to 1e-5): LayerNorm epsilon.
        initializer_range (`float`, defaults to 0.02): standard deviation of the normal weight initialisation.
        tie_word_embeddings (`bool`, defaults to False): share the input embedding with the output projection.
        use_cache (`bool`, defaults to True): return a `CompressiveMemoryCache` from forward when not told otherwise
            (training never returns one unless `use_cache=True` is passed explicitly).
        pad_token_id / bos_token_id / eos_token_id (`int`, optional): special token ids.
        segment_length (`int`, defaults to 512): tokens per segment; longer inputs are processed segment by
            segment, and memories are updated after each complete segment.
        mem_len (`int`, defaults to 512): most (uncompressed) memories kept per layer; at least `compression_rate`
            when `c_mem_len` > 0.
        c_mem_len (`int`, defaults to 128): most compressed memories kept per layer. 0 = no compressed memory: the
            model is a Transformer-XL (memories older than `mem_len` are dropped, not compressed).
        compression_rate (`int`, defaults to 4): `c`: evicted memories are compressed `c` to 1.
        compression_function (`str`, defaults to `"conv1d"`): `f_c`, one per layer: `"conv1d"` (kernel = stride
            = c), `"max_pool"`, `"mean_pool"`, `"dilated_conv"` (kernel c, dilation 2, stride c) or `"most_used"`
            (keep the evicted memories that received the most attention).
        reconstruction_loss (`str`, defaults to `"attention"`): how `f_c` is trained: `"attention"` (attention
            reconstruction with detached projections), `"autoencoding"` (a per-layer decoder reconstructs the
            evicted memories) or `"none"`. Compression functions without parameters need `"none"`.
        reconstruction_loss_weight (`float`, defaults to 1.0): weight of the reconstruction loss in `loss`.
        layer_norm_position (`str`, defaults to `"pre"`): `"pre"` (the seed; memories stored un-normalised and
            normalised when attended, plus a final norm) or `"post"` (the paper).
        pkm_layers (`list[int]`, defaults to `()`): layer numbers, counted from 1 as in the seeds, whose
            feed-forward is replaced by a product-key memory.
        pkm_num_keys (`int`, defaults to 128): sub-keys per half of each product-key memory (num_keys ** 2 slots).
        pkm_heads (`int`, defaults to 4): product-key memory heads.
        pkm_topk (`int`, optional): slots selected per head and token; at most `pkm_num_keys`. Default (None):
            `min(32, pkm_num_keys)`, resolved when the config is built (the resolved value is what is saved).
        classifier_pooling (`str`, optional): what a sequence-classification head summarises: `"last"` (the last
            real token) or `"mean"` (the mean of the real tokens). Default (None): `"last"`.
        classifier_dropout (`float`, optional): dropout before a token-classification head's `score`. Default
            (None): `hidden_dropout`, as transformers' heads.

    Saved configs (`from_dict`, used by `from_pretrained` and `AutoConfig`): a missing field takes its default above
    (folders saved by this package hold every field); a key that is not a field is kept as an attribute (what a user
    or a tool set before saving), with a warning when it looks like a typo of a field; a config of another
    `model_type` is refused.
    """

    model_type = "compressive"
    attribute_map = {
        "d_model": "hidden_size",
        "n_layers": "num_hidden_layers",
        "heads": "num_attention_heads",
        "d_ff": "intermediate_size",
        "dropout_prob": "hidden_dropout",
    }

    vocab_size: int = 256
    hidden_size: int = 512
    num_hidden_layers: int = 6
    num_attention_heads: int = 8
    intermediate_size: int = 2048
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    layer_norm_eps: float = 1e-5
    initializer_range: float = 0.02
    tie_word_embeddings: bool = False
    use_cache: bool = True
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    segment_length: int = 512
    mem_len: int = 512
    c_mem_len: int = 128
    compression_rate: int = 4
    compression_function: str = "conv1d"
    reconstruction_loss: str = "attention"
    reconstruction_loss_weight: float = 1.0
    layer_norm_position: str = "pre"
    pkm_layers: list[int] | tuple[int, ...] = ()
    pkm_num_keys: int = 128
    pkm_heads: int = 4
    pkm_topk: int | None = None
    classifier_pooling: str | None = None
    classifier_dropout: float | None = None

    def __post_init__(self, **kwargs):
        fields = [*self.__dataclass_fields__, *self.attribute_map]
        warn_near_misses(sorted(k for k in kwargs if k not in fields), fields, type(self).__name__)
        super().__post_init__(**kwargs)  # applies seed aliases passed as keyword arguments
        self.pkm_layers = list(self.pkm_layers)
        resolve_pkm_topk(self)
        check_fields(self, FIELD_RULES)
        check_requirements(self, REQUIREMENTS)

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """Rebuild a saved config; see "Saved configs" in the class docstring."""
        refuse_other_model_type(cls, config_dict)
        return super().from_dict(config_dict, **kwargs)


# what each field accepts, checked in this order
FIELD_RULES = {
    **dict.fromkeys(("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads"), integer(1)),
    **dict.fromkeys(("intermediate_size", "segment_length", "mem_len", "compression_rate"), integer(1)),
    "c_mem_len": integer(0),  # 0: Transformer-XL
    **dict.fromkeys(("pkm_num_keys", "pkm_heads", "pkm_topk"), integer(1)),
    "hidden_dropout": probability(),
    "attention_dropout": probability(),
    "layer_norm_eps": positive_number(),
    "initializer_range": positive_number(),
    "reconstruction_loss_weight": non_negative_number(),
    "compression_function": one_of(COMPRESSION_FUNCTIONS),
    "reconstruction_loss": one_of(RECONSTRUCTION_LOSSES),
    "layer_norm_position": one_of(LAYER_NORM_POSITIONS),
    "tie_word_embeddings": BOOLEAN,
    "use_cache": BOOLEAN,
    "eos_token_id": TOKEN_IDS,
    "pad_token_id": TOKEN_ID,
    "bos_token_id": TOKEN_ID,
    **CLASSIFIER_RULES,
}


def _is_layer_number(layer, num_hidden_layers: int) -> bool:
    """Layers are counted from 1, as in the seeds."""
    return isinstance(layer, int) and not isinstance(layer, bool) and 1 <= layer <= num_hidden_layers


# settings that only work together (checked once every field holds a value of its kind)
REQUIREMENTS = (
    Requirement(
        lambda c: c.c_mem_len > 0 and c.mem_len < c.compression_rate,
        "mem_len ({c.mem_len}) must be >= compression_rate ({c.compression_rate}): evictions come in whole groups "
        "of compression_rate memories",
    ),
    Requirement(
        lambda c: c.hidden_size % c.num_attention_heads != 0,
        "hidden_size ({c.hidden_size}) must be divisible by num_attention_heads ({c.num_attention_heads})",
    ),
    Requirement(
        lambda c: c.hidden_size % 2 != 0,
        "hidden_size must be even (sinusoidal relative encodings), got {c.hidden_size}",
    ),
    Requirement(
        lambda c: c.reconstruction_loss != "none" and c.compression_function not in TRAINABLE_COMPRESSION_FUNCTIONS,
        "reconstruction_loss={c.reconstruction_loss!r} needs a compression_function with parameters "
        + str(TRAINABLE_COMPRESSION_FUNCTIONS)
        + "; compression_function={c.compression_function!r} has none, so use reconstruction_loss='none'",
    ),
    Requirement(
        lambda c: not all(_is_layer_number(layer, c.num_hidden_layers) for layer in c.pkm_layers),
        "pkm_layers entries must be layer numbers in 1..num_hidden_layers ({c.num_hidden_layers}), "
        "got {c.pkm_layers!r}",
    ),
    Requirement(
        lambda c: len(set(c.pkm_layers)) != len(c.pkm_layers),
        "pkm_layers must not repeat a layer, got {c.pkm_layers!r}",
    ),
    PKM_TOPK_FITS,
)


__all__ = ["CompressiveConfig"]
