"""longrange: the Compressive Transformer and the Sinkhorn Transformer as Hugging Face transformers models.

Importing the package registers both model types with the Auto classes, so `AutoConfig`, `AutoModel`,
`AutoModelForCausalLM` (and `AutoModelForMaskedLM` for Sinkhorn) work for `model_type` "compressive" and "sinkhorn",
and `save_pretrained` writes an `auto_map` so saved folders also load with `trust_remote_code=True` where this
package is not installed.
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

from .configuration_compressive import CompressiveConfig
from .configuration_sinkhorn import SinkhornConfig
from .modeling_compressive import (
    CompressiveForCausalLM,
    CompressiveMemoryCache,
    CompressiveModel,
    CompressivePreTrainedModel,
)
from .modeling_sinkhorn import (
    SinkhornCache,
    SinkhornForCausalLM,
    SinkhornForMaskedLM,
    SinkhornModel,
    SinkhornPreTrainedModel,
)
from .product_key_memory import ProductKeyMemory, pkm_parameter_groups

__version__ = "0.1.0"


def _register() -> None:
    for config, base, causal in (
        (CompressiveConfig, CompressiveModel, CompressiveForCausalLM),
        (SinkhornConfig, SinkhornModel, SinkhornForCausalLM),
    ):
        AutoConfig.register(config.model_type, config, exist_ok=True)
        AutoModel.register(config, base, exist_ok=True)
        AutoModelForCausalLM.register(config, causal, exist_ok=True)
        config.register_for_auto_class()
        base.register_for_auto_class("AutoModel")
        causal.register_for_auto_class("AutoModelForCausalLM")
    AutoModelForMaskedLM.register(SinkhornConfig, SinkhornForMaskedLM, exist_ok=True)
    SinkhornForMaskedLM.register_for_auto_class("AutoModelForMaskedLM")


_register()

__all__ = [
    "CompressiveConfig",
    "CompressiveForCausalLM",
    "CompressiveMemoryCache",
    "CompressiveModel",
    "CompressivePreTrainedModel",
    "ProductKeyMemory",
    "SinkhornCache",
    "SinkhornConfig",
    "SinkhornForCausalLM",
    "SinkhornForMaskedLM",
    "SinkhornModel",
    "SinkhornPreTrainedModel",
    "pkm_parameter_groups",
]
