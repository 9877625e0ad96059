"""Run at start-up by Python subprocesses of the test suite (this folder is put on their PYTHONPATH).

Installs the read guard described by the LONGRANGE_READ_GUARD_* variables (see readguard.py), then runs the
`sitecustomize` this file shadows, if the environment has one further down sys.path.
"""

import importlib.machinery
import importlib.util
import os
import sys

import readguard

readguard.install_from_env()

_here = os.path.dirname(os.path.realpath(__file__))
_rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _module = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_module)
