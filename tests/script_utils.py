"""The project's runnable code in tests: the user commands are modules of `longrange.commands` (imported as any
module); the benchmarks (`benchmarks/`) and development tools (`tools/`) are files, loaded by path."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
BENCHMARKS, TOOLS = REPO / "benchmarks", REPO / "tools"


def load_command(name: str):
    """`longrange.commands.<name>`, the module behind `longrange <name>` (train, evaluate, generate, ...)."""
    return importlib.import_module(f"longrange.commands.{name}")


def load_script(name: str):
    """`benchmarks/<name>.py` or `tools/<name>.py` as a fresh module, registered in sys.modules (dataclasses resolve
    a module's annotations through it)."""
    path = next((folder / f"{name}.py" for folder in (BENCHMARKS, TOOLS) if (folder / f"{name}.py").is_file()), None)
    if path is None:
        raise FileNotFoundError(f"no {name}.py in benchmarks/ or tools/")
    spec = importlib.util.spec_from_file_location(f"longrange_script_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module
