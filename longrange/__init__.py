"""longrange: the Compressive Transformer and the Sinkhorn Transformer as Hugging Face transformers models.

Importing the package registers both model types with the Auto classes, so `AutoConfig`, `AutoModel`,
`AutoModelForCausalLM`, `AutoModelForSequenceClassification`, `AutoModelForTokenClassification`,
`AutoModelForQuestionAnswering` (and `AutoModelForMaskedLM` for Sinkhorn) work for `model_type` "compressive" and
"sinkhorn", and `save_pretrained` writes an `auto_map` so saved folders also load with `trust_remote_code=True`
where this package is not installed.
"""

import importlib.abc
import importlib.util
import sys

import transformers
from transformers import AutoConfig

from .cache_compressive import CompressiveMemoryCache
from .cache_sinkhorn import SinkhornCache
from .configuration_compressive import CompressiveConfig
from .configuration_sinkhorn import SinkhornConfig
from .modeling_compressive import (
    CompressiveForCausalLM,
    CompressiveForQuestionAnswering,
    CompressiveForSequenceClassification,
    CompressiveForTokenClassification,
    CompressiveModel,
    CompressivePreTrainedModel,
)
from .modeling_sinkhorn import (
    SinkhornForCausalLM,
    SinkhornForMaskedLM,
    SinkhornForQuestionAnswering,
    SinkhornForSequenceClassification,
    SinkhornForTokenClassification,
    SinkhornModel,
    SinkhornPreTrainedModel,
    SinkhornRouting,
)
from .product_key_memory import ProductKeyMemory, pkm_parameter_groups

__version__ = "0.1.0"


# the Auto class of each model class (the class's name ends in the Auto class's suffix)
_AUTO_CLASSES = {
    CompressiveConfig: (
        CompressiveModel,
        CompressiveForCausalLM,
        CompressiveForSequenceClassification,
        CompressiveForTokenClassification,
        CompressiveForQuestionAnswering,
    ),
    SinkhornConfig: (
        SinkhornModel,
        SinkhornForCausalLM,
        SinkhornForMaskedLM,
        SinkhornForSequenceClassification,
        SinkhornForTokenClassification,
        SinkhornForQuestionAnswering,
    ),
}


def _register() -> None:
    for config, classes in _AUTO_CLASSES.items():
        AutoConfig.register(config.model_type, config, exist_ok=True)
        config.register_for_auto_class()
        for cls in classes:
            head = cls.__name__.partition("For")[2]  # "" for the base model
            auto = f"AutoModelFor{head}" if head else "AutoModel"
            getattr(transformers, auto).register(config, cls, exist_ok=True)
            cls.register_for_auto_class(auto)


_register()

# PEFT picks LoRA's default `target_modules` by model type from a table of its own: ours are added when peft is
# imported (peft takes seconds to import, so `import longrange` does not import it). The attention projections, as
# for transformers' own models: the Compressive model fuses keys and values in `kv_proj`.
PEFT_TARGET_MODULES = {
    CompressiveConfig.model_type: ["q_proj", "kv_proj", "o_proj"],
    SinkhornConfig.model_type: ["to_q", "to_kv", "to_out"],
}


def _register_peft_defaults(constants) -> None:
    for table in (
        "TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING",
        "TRANSFORMERS_MODELS_TO_ADALORA_TARGET_MODULES_MAPPING",
    ):
        if hasattr(constants, table):
            for model_type, targets in PEFT_TARGET_MODULES.items():
                getattr(constants, table).setdefault(model_type, list(targets))


class _AfterPeftConstants(importlib.abc.MetaPathFinder):
    """Runs `_register_peft_defaults` right after `peft.utils.constants` is first executed."""

    name = "peft.utils.constants"

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            execute = spec.loader.exec_module

            def exec_module(module):
                execute(module)
                _register_peft_defaults(module)

            spec.loader.exec_module = exec_module
        return spec


if _AfterPeftConstants.name in sys.modules:
    _register_peft_defaults(sys.modules[_AfterPeftConstants.name])
elif importlib.util.find_spec("peft") is not None:
    sys.meta_path.insert(0, _AfterPeftConstants())

__all__ = [
    "CompressiveConfig",
    "CompressiveForCausalLM",
    "CompressiveForQuestionAnswering",
    "CompressiveForSequenceClassification",
    "CompressiveForTokenClassification",
    "CompressiveMemoryCache",
    "CompressiveModel",
    "CompressivePreTrainedModel",
    "ProductKeyMemory",
    "SinkhornCache",
    "SinkhornConfig",
    "SinkhornForCausalLM",
    "SinkhornForMaskedLM",
    "SinkhornForQuestionAnswering",
    "SinkhornForSequenceClassification",
    "SinkhornForTokenClassification",
    "SinkhornModel",
    "SinkhornPreTrainedModel",
    "SinkhornRouting",
    "pkm_parameter_groups",
]
