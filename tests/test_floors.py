"""The floors declared in setup.cfg are exactly the versions .ci/run installs (and tests) in its floor environment."""

from __future__ import annotations

import configparser
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parent.parent


def declared_floors() -> dict[str, str]:
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    floors = {}
    for line in config["options"]["install_requires"].strip().splitlines():
        requirement = Requirement(line.strip())
        lower = [spec.version for spec in requirement.specifier if spec.operator == ">="]
        assert len(lower) == 1, f"{line.strip()}: give exactly one '>=' floor"
        floors[canonicalize_name(requirement.name)] = lower[0]
    return floors


def pinned_floors() -> dict[str, str]:
    pins = {}
    for line in (ROOT / ".ci" / "floor-constraints.txt").read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            requirement = Requirement(line)
            (spec,) = requirement.specifier
            assert spec.operator == "==", f"{line}: pin with '=='"
            pins[canonicalize_name(requirement.name)] = spec.version
    return pins


def test_setup_cfg_floors_equal_the_ci_floor_pins():
    assert declared_floors() == pinned_floors()
