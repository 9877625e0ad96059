"""Checked loading of saved folders: both models' `from_pretrained` goes through `checked_from_pretrained`.

transformers loads what it can and reports the rest in a log: weights the checkpoint lacks are initialised afresh,
weights the model has no place for are dropped, and a damaged weights file surfaces as a bare safetensors error.
Here instead (each a clear error naming the folder, the file or the weights):

- a weights file that cannot be read (truncated, corrupted header, empty): `OSError` naming the file;
- weights of the model body (the base model: embeddings, layers, final norm) that the checkpoint lacks, or body
  weights in the checkpoint that the model built from config.json has no place for: `ValueError` listing them. Both
  mean that config.json does not describe these weights (a field was edited, or is missing and took its default);
- a weight holding NaN or infinity (a damaged file, or a diverged run): `ValueError` naming it;
- weights whose shapes differ from the model's (without `ignore_mismatched_sizes=True`): `WeightShapeError`, both
  a `ValueError` and the `RuntimeError` transformers raises there, naming config fields the folder lacks.

Tolerated as in transformers: a language-model head that the checkpoint lacks (a folder saved from the base model:
the head starts from its initialisation, and transformers' load report says so), weights the model derives itself
(the tied output embedding; the per-layer LayerNorms of a `weight_tie` Sinkhorn folder saved when they were shared),
and size mismatches the caller allowed with `ignore_mismatched_sizes=True`. A damaged weights file whose bytes still
parse as finite numbers cannot be told from trained weights (safetensors keeps no checksum).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from safetensors import SafetensorError


def _show(keys, limit: int = 6) -> str:
    keys = sorted(keys)
    more = f" and {len(keys) - limit} more" if len(keys) > limit else ""
    return ", ".join(keys[:limit]) + more


def _unreadable_file(source, subfolder: str) -> str:
    """The first weights file of a local folder that safetensors cannot open (else a generic name)."""
    from safetensors import safe_open

    folder = Path(str(source)) / subfolder if source is not None else None
    if folder is not None and folder.is_dir():
        for path in sorted(folder.glob("*.safetensors")):
            try:
                with safe_open(str(path), framework="pt") as f:
                    for key in f.keys():
                        f.get_slice(key)
            except Exception:  # noqa: BLE001  (any failure marks the file)
                return str(path)
    return f"the weights file (model.safetensors) of {source}"


def _missing_fields(source, cls, subfolder: str) -> str:
    """' (config.json lacks ...: they took their defaults)' for the model's own config fields absent from a local
    folder's config.json, else ''."""
    path = Path(str(source)) / subfolder / "config.json" if source is not None else None
    if path is None or not path.is_file():
        return ""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return ""
    config_class = cls.config_class
    fields = [f for f in config_class.__dict__.get("__annotations__", {}) if not f.startswith("_")]
    absent = [f for f in fields if f not in saved]
    if not absent:
        return ""
    shown = ", ".join(f"{f}={getattr(config_class, f, None)!r}" for f in absent[:8])
    return f" (config.json lacks {len(absent)} field(s), which took their defaults: {shown})"


def _body_key(key: str, model) -> bool:
    """Whether `key` (a name in the model's state dict naming) belongs to the base model's body."""
    base = model.base_model
    if base is not model:
        prefix = f"{model.base_model_prefix}."
        if not key.startswith(prefix):
            return False
        key = key[len(prefix) :]
    return key.split(".", 1)[0] in dict(base.named_children())


def check_loaded(model, info: dict, source, hint: str = "") -> None:
    """Raise for body weights missing from (or left over in) the checkpoint and for non-finite weights."""
    name = type(model).__name__
    missing = {k for k in info.get("missing_keys", ()) if _body_key(k, model)}
    unexpected = {k for k in info.get("unexpected_keys", ()) if _body_key(k, model)}
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"the checkpoint lacks {len(missing)} weight(s) the model needs ({_show(missing)})")
        if unexpected:
            parts.append(f"it holds {len(unexpected)} the model has no place for ({_show(unexpected)})")
        raise ValueError(
            f"{name}.from_pretrained({str(source)!r}): the weights do not match config.json: {'; '.join(parts)}. A "
            f"field of config.json differs from the model the weights were saved from, or is missing and took its "
            f"default{hint}; compare it with the weight names in the weights file. To load the matching weights "
            "anyway, build the model from the config and call load_state_dict(..., strict=False)"
        )
    bad = []
    with torch.no_grad():
        for key, tensor in model.state_dict().items():
            if tensor.is_floating_point() and tensor.device.type != "meta" and not bool(torch.isfinite(tensor).all()):
                bad.append(key)
    if bad:
        raise ValueError(
            f"{name}.from_pretrained({str(source)!r}): weight(s) holding NaN or infinity: {_show(bad)}. The weights "
            "file is corrupted, or was saved from a run that diverged"
        )


class WeightShapeError(ValueError, RuntimeError):
    """Weight shapes that do not match config.json: a ValueError, as every other check here, and a RuntimeError,
    what transformers itself raises for them (callers catching either keep working)."""


def checked_from_pretrained(load, cls, *args, **kwargs):
    """`load(*args, **kwargs)` (transformers' `from_pretrained`) with the checks of this module's docstring; weights
    saved under the names in the class's `_moved_keys` ({old prefix: new prefix}) load under their new names."""
    source = args[0] if args else kwargs.get("pretrained_model_name_or_path")
    want_info = kwargs.pop("output_loading_info", False)
    subfolder = kwargs.get("subfolder") or ""
    moved = getattr(cls, "_moved_keys", None)
    if moved:  # weights saved under names that have moved since
        kwargs["key_mapping"] = moved_keys(moved, kwargs.get("key_mapping"))
    try:
        model, info = load(*args, output_loading_info=True, **kwargs)
    except SafetensorError as err:
        raise OSError(
            f"{cls.__name__}.from_pretrained({str(source)!r}): cannot read {_unreadable_file(source, subfolder)}: "
            f"{err}. The file is truncated or corrupted; save or download it again"
        ) from err
    except RuntimeError as err:
        if "ignore_mismatched_sizes" not in str(err):
            raise
        raise WeightShapeError(
            f"{cls.__name__}.from_pretrained({str(source)!r}): weight shapes do not match config.json (the load "
            f"report above lists them): a field of config.json differs from the model the weights were saved from, "
            f"or is missing and took its default{_missing_fields(source, cls, subfolder)}; a classification head "
            "loaded with another num_labels starts afresh with ignore_mismatched_sizes=True"
        ) from err
    check_loaded(model, info, source, _missing_fields(source, cls, subfolder))
    return (model, info) if want_info else model


def map_every_auto_class(config, classes: dict[str, type]) -> None:
    """Names every Auto class of the model type in `config.auto_map` (before `save_pretrained`, which adds only the
    saved class's own), so that a saved folder loads as any of them with `trust_remote_code=True` where longrange is
    not installed, as a Llama folder loads as `AutoModel` (the feature-extraction pipeline) or its LM head. Entries
    already there win (a folder's own map, a Hub repository's prefix)."""
    mapped = {auto: f"{cls.__module__.rsplit('.', 1)[-1]}.{cls.__name__}" for auto, cls in classes.items()}
    config.auto_map = {**mapped, **(getattr(config, "auto_map", None) or {})}


def moved_keys(moved: dict[str, str], given: dict[str, str] | None = None) -> dict[str, str]:
    """from_pretrained's `key_mapping` (regular expressions) for weights whose names moved: {old prefix: new prefix}
    of the model's state dict, matched at the start of a name; the caller's own `given` mapping comes first."""
    mapping = dict(given or {})
    for old, new in moved.items():
        mapping.setdefault("^" + re.escape(old), new)
    return mapping


def rename_moved_keys(state_dict: dict, prefix: str, moved: dict[str, str]) -> None:
    """The same renaming for `load_state_dict` (a module's `_load_from_state_dict` hook, `prefix` its place in the
    state dict): in place, a weight under an old name is moved to its new name unless that name is present."""
    for key in [k for k in state_dict if k.startswith(prefix)]:
        for old, new in moved.items():
            if key.startswith(prefix + old) and prefix + new + key[len(prefix + old) :] not in state_dict:
                state_dict[prefix + new + key[len(prefix + old) :]] = state_dict.pop(key)


__all__ = ["WeightShapeError", "check_loaded", "checked_from_pretrained", "moved_keys", "rename_moved_keys"]
