"""Configuration of the Compressive Transformer (Rae et al. 2019).

Every field is documented below and validated in `__post_init__`; a bad value raises `ValueError` naming the field
and what is allowed, so the model itself can trust its config. The annotated seed's option names (`d_model`,
`n_layers`, `heads`, `d_ff`, `dropout_prob`) are accepted as aliases of the transformers names.
"""

from __future__ import annotations

from transformers import PreTrainedConfig

from .configuration_checks import warn_near_misses

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
            when memories are compressed (`c_mem_len` > 0).
        c_mem_len (`int`, defaults to 128): most compressed memories kept per layer. 0 is Transformer-XL: evicted
            memories are dropped, one at a time (the memory keeps exactly the newest `mem_len`), nothing is
            compressed and there is no reconstruction loss; the `f_c` weights still exist, unused.
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

    def __post_init__(self, **kwargs):
        fields = [*self.__dataclass_fields__, *self.attribute_map]
        warn_near_misses(sorted(k for k in kwargs if k not in fields), fields, type(self).__name__)
        super().__post_init__(**kwargs)  # applies seed aliases passed as keyword arguments
        self.pkm_layers = list(self.pkm_layers)
        if self.pkm_topk is None and isinstance(self.pkm_num_keys, int):  # a bad pkm_num_keys is refused below
            self.pkm_topk = min(32, self.pkm_num_keys)
        self._validate()

    @classmethod
    def from_dict(cls, config_dict: dict, **kwargs):
        """Rebuild a saved config; see "Saved configs" in the class docstring."""
        found = config_dict.get("model_type") if isinstance(config_dict, dict) else None
        if found is not None and found != cls.model_type:
            raise ValueError(
                f"{cls.__name__}: this config is for model_type {found!r}, not {cls.model_type!r}; load the folder "
                "with the class of its own type (AutoModelForCausalLM / AutoConfig pick it from config.json's "
                "model_type)"
            )
        return super().from_dict(config_dict, **kwargs)

    def _validate(self) -> None:
        def positive_int(name: str, minimum: int = 1) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
                raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")

        def probability(name: str) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0.0 <= value < 1.0:
                raise ValueError(f"{name} must be a float in [0, 1), got {value!r}")

        def choice(name: str, allowed: tuple[str, ...]) -> None:
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name} must be one of {allowed}, got {getattr(self, name)!r}")

        for name in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "intermediate_size"):
            positive_int(name)
        for name in ("segment_length", "mem_len", "compression_rate", "pkm_num_keys", "pkm_heads"):
            positive_int(name)
        positive_int("c_mem_len", minimum=0)  # 0: Transformer-XL
        positive_int("pkm_topk")
        if self.c_mem_len > 0 and self.mem_len < self.compression_rate:
            raise ValueError(
                f"mem_len ({self.mem_len}) must be >= compression_rate ({self.compression_rate}) when c_mem_len > 0: "
                "evictions come in whole groups of compression_rate memories"
            )
        if self.hidden_size % self.num_attention_heads != 0:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                f"({self.num_attention_heads})"
            )
        if self.hidden_size % 2 != 0:
            raise ValueError(f"hidden_size must be even (sinusoidal relative encodings), got {self.hidden_size}")
        probability("hidden_dropout")
        probability("attention_dropout")
        for name in ("layer_norm_eps", "initializer_range"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{name} must be a positive float, got {value!r}")
        value = self.reconstruction_loss_weight
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise ValueError(f"reconstruction_loss_weight must be a float >= 0, got {value!r}")
        choice("compression_function", COMPRESSION_FUNCTIONS)
        choice("reconstruction_loss", RECONSTRUCTION_LOSSES)
        choice("layer_norm_position", LAYER_NORM_POSITIONS)
        if self.reconstruction_loss != "none" and self.compression_function not in TRAINABLE_COMPRESSION_FUNCTIONS:
            raise ValueError(
                f"reconstruction_loss={self.reconstruction_loss!r} needs a compression_function with parameters "
                f"{TRAINABLE_COMPRESSION_FUNCTIONS}; compression_function={self.compression_function!r} has none, "
                "so use reconstruction_loss='none'"
            )
        for layer in self.pkm_layers:
            if isinstance(layer, bool) or not isinstance(layer, int) or not 1 <= layer <= self.num_hidden_layers:
                raise ValueError(
                    f"pkm_layers entries must be layer numbers in 1..num_hidden_layers ({self.num_hidden_layers}), "
                    f"got {self.pkm_layers!r}"
                )
        if len(set(self.pkm_layers)) != len(self.pkm_layers):
            raise ValueError(f"pkm_layers must not repeat a layer, got {self.pkm_layers!r}")
        if self.pkm_topk > self.pkm_num_keys:
            raise ValueError(
                f"pkm_topk ({self.pkm_topk}) must not exceed pkm_num_keys ({self.pkm_num_keys}): a head selects "
                "pkm_topk of the pkm_num_keys sub-keys of each half (leave pkm_topk unset for min(32, pkm_num_keys))"
            )
        for name in ("tie_word_embeddings", "use_cache"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        eos = self.eos_token_id
        eos_ids = eos if isinstance(eos, (list, tuple)) else [eos]
        if eos is not None and any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in eos_ids):
            raise ValueError(f"eos_token_id must be None, a token id >= 0 or a list of them, got {eos!r}")
        for name in ("pad_token_id", "bos_token_id"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
                raise ValueError(f"{name} must be None or a token id >= 0, got {value!r}")


__all__ = ["CompressiveConfig"]
