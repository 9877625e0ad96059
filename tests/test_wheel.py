"""The pip user's path: the wheel built from this checkout, installed into a fresh virtual environment, gives the
`longrange` command, which trains a small model and generates from it in a folder outside the checkout.

The new environment sees the running environment's packages (torch, transformers, ...) through a `.pth` file, so
nothing is downloaded; `longrange` itself comes from the wheel (checked), not from the checkout.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
COMMANDS = ("train", "finetune", "evaluate", "generate", "visualize", "convert", "push")
TINY = ["hidden_size=32", "num_hidden_layers=1", "num_attention_heads=2", "intermediate_size=64",
        "segment_length=16", "mem_len=16", "c_mem_len=8", "compression_rate=2"]  # fmt: skip


def run(command: list[str], **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(command, capture_output=True, text=True, timeout=600, **kwargs)
    assert proc.returncode == 0, f"{command}:\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


def build_wheel(dist: Path, tmp_path: Path) -> Path:
    """The wheel of a copy of what the package is built from (building in place would leave build/ and
    *.egg-info/ in the checkout). Without build isolation when setuptools can build wheels by itself (no download)."""
    source = tmp_path / "source"
    shutil.copytree(REPO / "longrange", source / "longrange", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("setup.cfg", "pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, source / name)
    try:
        import setuptools

        isolation = tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (70, 1)
    except ImportError:
        isolation = True
    flags = [] if isolation else ["--no-build-isolation"]
    run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", *flags, "-w", str(dist), "-q"])
    (wheel,) = dist.glob("longrange_transformers-*.whl")
    return wheel


def make_environment(venv: Path) -> Path:
    """A fresh virtual environment that also sees the running one's packages; returns its python. (Without pip of
    its own: venv would install it in a subprocess that drops PYTHONPATH, so the read guard; the running
    environment's pip installs into it with `--python`.)"""
    run([sys.executable, "-m", "venv", "--without-pip", str(venv)])
    python = venv / ("Scripts" if os.name == "nt" else "bin") / "python"
    site = run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    outer = sorted({sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]})
    lines = "; ".join(f"site.addsitedir({path!r})" for path in outer)
    (Path(site) / "outer_environment.pth").write_text(f"import site; {lines}\n")
    return python


@pytest.mark.slow  # builds and installs a wheel, then trains and generates in fresh processes: about 2 minutes
def test_the_wheel_gives_the_longrange_command_outside_the_checkout(tmp_path, monkeypatch):
    # pip and the commands make their temporary files below this test's folder: with the checkout directly in the
    # temporary folder, anything else there is a sibling of the repository, which the read guard refuses
    (tmp_path / "tmp").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    wheel = build_wheel(tmp_path / "dist", tmp_path)
    python = make_environment(tmp_path / "venv")
    run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "--no-index", "-q", str(wheel)])
    longrange = python.parent / "longrange"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    # the guard's PYTHONPATH entries are kept; the checkout is not on the path
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and Path(p).resolve() != REPO]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    where = run([str(python), "-c", "import longrange; print(longrange.__file__)"], cwd=elsewhere, env=env)
    assert Path(where.stdout.strip()).resolve().is_relative_to((tmp_path / "venv").resolve()), where.stdout

    usage = run([str(longrange), "--help"], cwd=elsewhere, env=env).stdout
    assert all(f"  {name} " in usage for name in COMMANDS), usage
    for name in COMMANDS:
        assert run([str(longrange), name, "--help"], cwd=elsewhere, env=env).stdout.startswith(
            f"usage: longrange {name} "
        )
    train = [str(longrange), "train", "--max_steps", "2", "--eval_tokens", "512", "--num_samples", "0",
             "--max_corpus_bytes", "300000", "--output_dir", "run", "--config", *TINY]  # fmt: skip
    assert "done: 2 steps" in run(train, cwd=elsewhere, env=env).stdout
    assert (elsewhere / "run" / "model" / "model.safetensors").is_file()
    generate = [str(longrange), "generate", "run/model", "--prompt", "def ", "--max_new_tokens", "8", "--no_stream"]
    assert run(generate, cwd=elsewhere, env=env).stdout.startswith("def ")
