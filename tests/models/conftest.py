"""tests/models/: transformers' own common model tests (ModelTesterMixin, ConfigTester, TrainingTesterMixin) run
against our model classes, in transformers' per-model layout (tests/models/<model>/test_modeling_<model>.py).

The common test modules come from the source distribution of the installed transformers, fetched by
`python scripts/fetch_transformers_tests.py` into the git-ignored `.cache/transformers-tests/<version>/`; they are
never copied into the repository. `transformers_common.py`, next to this file, loads them (and the test modules
skip, naming that command, when they are not there); this conftest only puts this folder on `sys.path` for it.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = str(Path(__file__).resolve().parent)
if HERE not in sys.path:
    sys.path.insert(0, HERE)

# markers transformers' common tests put on some tests (its own conftest.py registers them)
MARKERS = ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test", "is_training_test",
           "torch_compile_test", "torch_export_test", "generate")  # fmt: skip


def pytest_configure(config):
    for marker in MARKERS:
        config.addinivalue_line("markers", f"{marker}: a marker of transformers' common model tests")
