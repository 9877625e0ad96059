"""Loads transformers' common test modules from `.cache/transformers-tests/<installed version>/tests/`.

They are imported as the package `transformers_common_tests` (not `tests`, which is this repository's folder). The
sdist leaves out three modules they import; stand-ins written here are registered in their place:

- `generation/test_utils.py`: `GenerationTesterMixin` is an empty class (the generation tests themselves are not in
  the sdist, so none run; `ModelTesterMixin.test_generation_tester_mixin_inheritance` only checks that a tester of
  a model that can generate inherits the class);
- `exporters/test_export.py`: `ExportTesterMixin` (the base class of `ModelTesterMixin`) is an empty class;
- `utils/test_configuration_utils.py`: `config_common_kwargs`, the general `PreTrainedConfig` options
  `ConfigTester.check_config_arguments_init` passes to a config and reads back, here with values of our own choice.

When the folder is absent (a run without the fetch; the floor environment), or `parameterized` (which the common
tests import) is not installed, `load()` skips the calling test module, saying what to run.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from importlib.metadata import version
from pathlib import Path
from unittest import mock

import pytest

REPO = Path(__file__).resolve().parents[2]
TRANSFORMERS_VERSION = version("transformers")
FOLDER = REPO / ".cache" / "transformers-tests" / TRANSFORMERS_VERSION / "tests"
FETCH_COMMAND = "python tools/fetch_transformers_tests.py"
PACKAGE = "transformers_common_tests"


class GenerationTesterMixin:
    """Stand-in for transformers' `tests/generation/test_utils.py` mixin (not in the sdist): no tests."""


class ExportTesterMixin:
    """Stand-in for transformers' `tests/exporters/test_export.py` mixin (not in the sdist): no tests."""


# general PreTrainedConfig options, each set to a value other than its default; a config must keep them as given
config_common_kwargs = {
    "return_dict": False,
    "output_hidden_states": True,
    "dtype": "float16",
    "chunk_size_feed_forward": 3,
    "is_encoder_decoder": True,
    "architectures": ["SomeModelForCausalLM"],
    "id2label": {0: "negative", 1: "positive"},
    "label2id": {"negative": 0, "positive": 1},
    "problem_type": "single_label_classification",
}

_STAND_INS = {
    "generation.test_utils": {"GenerationTesterMixin": GenerationTesterMixin},
    "exporters.test_export": {"ExportTesterMixin": ExportTesterMixin},
    "utils.test_configuration_utils": {"config_common_kwargs": config_common_kwargs},
}


def _register() -> None:
    if PACKAGE in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        PACKAGE, FOLDER / "__init__.py", submodule_search_locations=[str(FOLDER)]
    )
    package = importlib.util.module_from_spec(spec)
    sys.modules[PACKAGE] = package
    spec.loader.exec_module(package)
    for dotted, names in _STAND_INS.items():
        parent = PACKAGE
        for part in dotted.split("."):
            name = f"{parent}.{part}"
            if name not in sys.modules:
                module = types.ModuleType(name, f"stand-in written in {__name__} (not in the transformers sdist)")
                module.__path__ = []  # a package, so that the next part can be found below it
                sys.modules[name] = module
                setattr(sys.modules[parent], part, module)
            parent = name
        vars(sys.modules[parent]).update(names)


def load(*modules: str) -> list[types.ModuleType]:
    """The named modules of transformers' tests folder (e.g. "test_modeling_common"); skips the calling test module
    when they cannot be loaded here."""
    if not (FOLDER / "__init__.py").is_file():
        pytest.skip(
            f"transformers {TRANSFORMERS_VERSION}'s common tests are not fetched (no {FOLDER.relative_to(REPO)}): "
            f"run `{FETCH_COMMAND}`",
            allow_module_level=True,
        )
    if importlib.util.find_spec("parameterized") is None:
        pytest.skip(
            "transformers' common tests import `parameterized`: `pip install parameterized`", allow_module_level=True
        )
    _register()
    return [importlib.import_module(f"{PACKAGE}.{name}") for name in modules]


def without_checked_loading(test_case) -> None:
    """For the rest of `test_case`'s test, our models' `from_pretrained` accepts checkpoints that lack weights.

    By design, `from_pretrained` of both models refuses a checkpoint lacking weights of the model body
    (`longrange/loading.py`: a ValueError naming them, where transformers initialises them afresh and logs it). Two
    common tests load such checkpoints on purpose to inspect what transformers does then (`_init_weights` reaches
    every weight; the loading report names exactly the model's weights as missing), which the refusal would hide;
    for them, the check is switched off. Nothing to do where `longrange.loading` does not exist."""
    if importlib.util.find_spec("longrange.loading") is None:
        return
    patcher = mock.patch("longrange.loading.check_loaded", lambda *args, **kwargs: None)
    patcher.start()
    test_case.addCleanup(patcher.stop)


def list_in_auto_tables(test_case, model_type: str, **tables: str) -> None:
    """Lists our model classes in transformers' Auto name tables (e.g. `MODEL_FOR_CAUSAL_LM_MAPPING_NAMES=
    "CompressiveForCausalLM"`) for the duration of `test_case`'s test, as a model built into transformers is listed.

    The common tests decide by these tables which classes are base models (not trained by `test_training`), which
    take token labels, which are decoder-only language models; `import longrange` registers our classes with the Auto
    classes themselves (`AutoModel.register`), which the tables do not see. The config table is left alone, so no
    Auto mapping ever tries to import a `transformers.models.<model_type>` module."""
    from transformers.models.auto import modeling_auto

    for table, class_name in tables.items():
        patcher = mock.patch.dict(getattr(modeling_auto, table), {model_type: class_name})
        patcher.start()
        test_case.addCleanup(patcher.stop)
