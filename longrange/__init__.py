"""longrange: the Compressive Transformer and the Sinkhorn Transformer as Hugging Face transformers models.

Importing the package registers both model types with the Auto classes, so `AutoConfig`, `AutoModel`,
`AutoModelForCausalLM` (and `AutoModelForMaskedLM` for Sinkhorn) work for `model_type` "compressive" and "sinkhorn".
"""

from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, AutoModelForMaskedLM

# DEV GUARD (temporary, removed before landing): the two model families are being written in parallel.
import importlib.util as _ilu

_HAS_C = _ilu.find_spec(__name__ + ".modeling_compressive") is not None
_HAS_S = _ilu.find_spec(__name__ + ".modeling_sinkhorn") is not None
if _HAS_C:
    from .configuration_compressive import CompressiveConfig
    from .modeling_compressive import (
        CompressiveForCausalLM,
        CompressiveMemoryCache,
        CompressiveModel,
        CompressivePreTrainedModel,
    )
if _HAS_S:
    from .configuration_sinkhorn import SinkhornConfig
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
    families = []
    if _HAS_C:
        families.append((CompressiveConfig, CompressiveModel, CompressiveForCausalLM))
    if _HAS_S:
        families.append((SinkhornConfig, SinkhornModel, SinkhornForCausalLM))
    for config, base, causal in families:
        AutoConfig.register(config.model_type, config, exist_ok=True)
        AutoModel.register(config, base, exist_ok=True)
        AutoModelForCausalLM.register(config, causal, exist_ok=True)
        # saved folders carry `auto_map` and the modeling code, so they load with trust_remote_code=True
        config.register_for_auto_class()
        base.register_for_auto_class("AutoModel")
        causal.register_for_auto_class("AutoModelForCausalLM")
    if not _HAS_S:
        return
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
