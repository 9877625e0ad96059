"""Loading a script of `scripts/` as a module in tests (the scripts are not a package)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str):
    """`scripts/<name>.py` as a fresh module, registered in sys.modules (dataclasses resolve a module's annotations
    through it)."""
    # (under a prefixed name: scripts/evaluate.py registered as `evaluate` would replace the evaluate library)
    spec = importlib.util.spec_from_file_location(f"longrange_script_{name}", SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
