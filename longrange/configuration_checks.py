"""What both configurations check the same way when they are built from keyword arguments or a saved dict.

Each configuration validates itself from two tables: field rules (one field, its allowed values) and requirements
(settings that only work together). A broken rule raises `ValueError` naming the field and what it must be, so the
models can trust their config. Both configuration files import this module (relative import), so `save_pretrained`
copies it next to them.
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Iterable, Mapping
from typing import Any, NamedTuple

from transformers.utils import logging

logger = logging.get_logger(__name__)


# -- field rules: one field, the values it takes -------------------------------------------------------------------


class FieldRule(NamedTuple):
    """The values one field accepts: `accepts(value)` decides, `expected` says which in words (it completes
    "<field> must be ...")."""

    accepts: Callable[[Any], bool]
    expected: str


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is an int to Python, not a size to us


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def integer(minimum: int, expected: str | None = None) -> FieldRule:
    """An integer >= `minimum` (booleans refused)."""
    return FieldRule(lambda v: _is_int(v) and v >= minimum, expected or f"an integer >= {minimum}")


def probability(expected: str = "a float in [0, 1)") -> FieldRule:
    """A dropout-like probability in [0, 1): 1 would drop everything."""
    return FieldRule(lambda v: _is_number(v) and 0.0 <= v < 1.0, expected)


def positive_number(expected: str = "a positive float") -> FieldRule:
    return FieldRule(lambda v: _is_number(v) and v > 0, expected)


def non_negative_number(expected: str = "a float >= 0") -> FieldRule:
    return FieldRule(lambda v: _is_number(v) and v >= 0, expected)


def one_of(allowed: tuple[str, ...]) -> FieldRule:
    return FieldRule(lambda v: v in allowed, f"one of {allowed}")


def optional(rule: FieldRule, expected: str | None = None) -> FieldRule:
    """`rule`, or None (the field then takes a value derived from others; a config property resolves it)."""
    return FieldRule(lambda v: v is None or rule.accepts(v), expected or rule.expected)


BOOLEAN = FieldRule(lambda v: isinstance(v, bool), "True or False")
TOKEN_ID = optional(integer(0), "None or a token id >= 0")
# eos_token_id: generate() stops at any of a list of ids
TOKEN_IDS = FieldRule(
    lambda v: v is None or all(_is_int(i) and i >= 0 for i in (v if isinstance(v, (list, tuple)) else [v])),
    "None, a token id >= 0 or a list of them",
)


# the classification heads' options (longrange/classification.py), the same in both configs
CLASSIFIER_RULES = {
    "classifier_pooling": optional(one_of(("last", "mean")), "None, 'last' or 'mean'"),
    "classifier_dropout": optional(probability(), "None or a float in [0, 1)"),
}


def check_fields(
    config, rules: Mapping[str, FieldRule], prefix: str = "", also_called: Mapping[str, str] | None = None
) -> None:
    """Raise `ValueError("<prefix><field> must be <expected>, got <value>")` for the first field its rule refuses.

    also_called: field -> the other name a user may have set it by (shown in brackets after the field's name).
    """
    for name, rule in rules.items():
        value = getattr(config, name)
        if not rule.accepts(value):
            label = f"{name} ({also_called[name]})" if also_called and name in also_called else name
            raise ValueError(f"{prefix}{label} must be {rule.expected}, got {value!r}")


# -- requirements: settings that only work together -----------------------------------------------------------------


class Requirement(NamedTuple):
    """A setting that cannot work: `broken(config)` returns what is wrong (falsy when nothing is), `message` says
    why; it is formatted with `c` (the config) and `found` (what `broken` returned)."""

    broken: Callable[[Any], Any]
    message: str


def check_requirements(config, requirements: Iterable[Requirement], prefix: str = "") -> None:
    """Raise `ValueError(prefix + message)` for the first requirement the config breaks."""
    for requirement in requirements:
        found = requirement.broken(config)
        if found:
            raise ValueError(prefix + requirement.message.format(c=config, found=found))


# the rule and the default both product-key memories follow: a head selects pkm_topk of the pkm_num_keys sub-keys
PKM_TOPK_FITS = Requirement(
    lambda c: c.pkm_topk > c.pkm_num_keys,
    "pkm_topk ({c.pkm_topk}) must not exceed pkm_num_keys ({c.pkm_num_keys}): a head selects pkm_topk of the "
    "pkm_num_keys sub-keys of each half (leave pkm_topk unset for min(32, pkm_num_keys))",
)


def resolve_pkm_topk(config) -> None:
    """Unset pkm_topk becomes min(32, pkm_num_keys), so that the saved config holds the value the model uses."""
    if config.pkm_topk is None and _is_int(config.pkm_num_keys):  # a bad pkm_num_keys is refused by validation
        config.pkm_topk = min(32, config.pkm_num_keys)


# -- saved configs --------------------------------------------------------------------------------------------------


def refuse_other_model_type(cls, config_dict) -> None:
    """Refuse a saved config of another model type (its fields would be read as ours, or left at our defaults)."""
    found = config_dict.get("model_type") if isinstance(config_dict, dict) else None
    if found is not None and found != cls.model_type:
        raise ValueError(
            f"{cls.__name__}: this config is for model_type {found!r}, not {cls.model_type!r}; load the folder with the "
            f"class of its own type (AutoModelForCausalLM / AutoConfig pick it from config.json's model_type)"
        )


def warn_near_misses(unknown, options, owner: str) -> None:
    """Warn for unknown keys that look like a typo of an option (kept as attributes; the option keeps its value)."""
    for key in unknown:
        close = difflib.get_close_matches(key, options, n=1, cutoff=0.8)
        if close:
            logger.warning(
                f"{owner}: {key!r} is not an option (did you mean {close[0]!r}?); it is kept as an attribute and "
                f"{close[0]!r} keeps its value"
            )
