"""What both configurations check the same way when they are built from keyword arguments or a saved dict.

Both configuration files import this module (relative import), so `save_pretrained` copies it next to them.
"""

from __future__ import annotations

import difflib

from transformers.utils import logging

logger = logging.get_logger(__name__)


def warn_near_misses(unknown, options, owner: str) -> None:
    """Warn for unknown keys that look like a typo of an option (kept as attributes; the option keeps its value)."""
    for key in unknown:
        close = difflib.get_close_matches(key, options, n=1, cutoff=0.8)
        if close:
            logger.warning(
                f"{owner}: {key!r} is not an option (did you mean {close[0]!r}?); it is kept as an attribute and "
                f"{close[0]!r} keeps its value"
            )
