"""What differs between the transformers 5.x releases this package supports (setup.cfg), in one place.

The modeling files import this module relatively, so `save_pretrained` copies it next to them and a saved folder
loads with `trust_remote_code=True` across the same range.

- transformers 5.24 renamed the cache argument and output field `past_key_values` to `cache`. Before 5.24,
  `generate()` carries the cache from one step to the next only under `past_key_values` (an output field named
  `cache` is silently dropped, so every step after the first would run without context). `cache_output` gives an
  output dataclass the field name of the installed version, accepting `cache=` and answering `.cache` on both, so
  the modeling code is written once, with `cache`.
- Before 5.10.1, `Trainer` counted every label (`labels.ne(-100)`) for `num_items_in_batch`, the divisor of a
  causal LM's summed loss, where only `labels[..., 1:]` are predicted: one token per row too many.
  `TRAINER_COUNTS_PREDICTED_LABELS` says whether the installed Trainer counts right (longrange finetune corrects
  the count where it does not).
"""

from __future__ import annotations

import functools
from dataclasses import field, fields, make_dataclass

import transformers
from packaging.version import Version
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.modeling_outputs import BaseModelOutputWithPast as _BaseModelOutputWithPast
from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions as _CausalLMOutputWithCrossAttentions
from transformers.utils import logging

logger = logging.get_logger(__name__)

# the name under which the installed transformers passes and returns caches (generate() results included)
CACHE_NAME = "cache" if "cache" in {f.name for f in fields(GenerateDecoderOnlyOutput)} else "past_key_values"

TRAINER_COUNTS_PREDICTED_LABELS = Version(transformers.__version__).release >= (5, 10, 1)


def cache_output(cls: type) -> type:
    """Output dataclass `cls` (fields `cache` or `past_key_values`) with the installed version's cache field name.

    From transformers 5.24 on, `cls` itself. Before, a class whose field is `past_key_values` (so generate() finds
    it, and tuples and `keys()` look like transformers' own outputs of that version), whose constructor also
    accepts `cache=` and which answers `.cache`.
    """
    if CACHE_NAME == "cache":
        return cls
    name, module = cls.__name__, __name__  # a subclass of one of transformers' outputs lives here
    if "cache" in {f.name for f in fields(cls)}:  # one of ours: the same fields, the cache one renamed
        module = cls.__module__
        spec = [
            ("past_key_values" if f.name == "cache" else f.name, f.type, field(default=f.default)) for f in fields(cls)
        ]
        cls = make_dataclass(f"_{name}Fields", spec, bases=cls.__bases__, namespace={"__module__": module})

    @functools.wraps(cls.__init__)
    def __init__(self, *args, cache=None, **kwargs):
        if cache is not None:
            if kwargs.get("past_key_values") is not None:
                raise ValueError("pass the cache as `cache` or as `past_key_values`, not both")
            kwargs["past_key_values"] = cache
        cls.__init__(self, *args, **kwargs)

    namespace = {
        "__init__": __init__,
        "cache": property(
            lambda self: self.past_key_values, doc="The cache (transformers < 5.24 name: past_key_values)."
        ),
        "__doc__": cls.__doc__,
        "__module__": module,
        "__qualname__": name,
    }
    return type(name, (cls,), namespace)


BaseModelOutputWithPast = cache_output(_BaseModelOutputWithPast)
CausalLMOutputWithCrossAttentions = cache_output(_CausalLMOutputWithCrossAttentions)


def check_assisted_decoding(generation_mode) -> None:
    """Assisted and prompt-lookup decoding need transformers >= 5.24: older releases build their own caches beside
    the model's (`cache_implementation` with `past_key_values`) and crop by length. Refused clearly there."""
    from transformers.generation.configuration_utils import GenerationMode

    if CACHE_NAME != "cache" and generation_mode == GenerationMode.ASSISTED_GENERATION:
        raise NotImplementedError(
            "assisted and prompt-lookup decoding of longrange models need transformers >= 5.24, installed "
            f"{transformers.__version__}"
        )


def use_own_cache(generation_config, model_kwargs, cache_class: str) -> None:
    """`generate(cache_implementation=...)` asks transformers to build one of its key/value caches. These models
    keep their own cache (static shapes, compileable, bounded: what "static" asks for), which generate() uses
    instead: with no cache given, the option is dropped from this call's generation config, with a warning."""
    chosen = generation_config.cache_implementation
    if chosen is None or model_kwargs.get(CACHE_NAME) is not None or generation_config.use_cache is False:
        return
    logger.warning_once(
        f"cache_implementation={chosen!r} is ignored: this model keeps its own {cache_class}, whose shapes are "
        "static and which generate() compiles like a StaticCache"
    )
    generation_config.cache_implementation = None
