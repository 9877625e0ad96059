"""Fetch transformers' own common model tests, for tests/models/ (never copied into the repository).

    python tools/fetch_transformers_tests.py

Downloads the source distribution of the *installed* transformers version (`pip download --no-binary :all:
--no-deps transformers==<installed>`) and extracts its top-level `tests/` folder (test_modeling_common.py,
test_configuration_common.py, test_training_mixin.py and the other common modules; the sdist holds no per-model
tests) into `.cache/transformers-tests/<version>/tests/`, which git ignores. An empty `__init__.py` is added there
when the sdist has none, as the repository has: `test_configuration_common.py` imports that folder as a package.

Idempotent: nothing is downloaded when the folder is already complete. `--version` fetches another version (the
tests only use the installed one's).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tarfile
import tempfile
from importlib.metadata import version as installed_version
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
CACHE = REPO / ".cache" / "transformers-tests"
COMPLETE = ".complete"  # written last, inside <version>/: the folder is whole


def destination(version: str) -> Path:
    """Where the tests of transformers `version` are kept: `<version>/tests/`, complete when `<version>/.complete`
    exists."""
    return CACHE / version


def fetch(version: str) -> Path:
    target = destination(version)
    if (target / COMPLETE).is_file():
        print(f"transformers {version} tests already in {target / 'tests'}")
        return target / "tests"
    CACHE.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=CACHE, prefix=f".{version}-") as work:
        work = Path(work)
        command = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps"]
        command += ["--disable-pip-version-check", "--quiet", f"transformers=={version}", "-d", str(work)]
        print("$", " ".join(command), flush=True)
        subprocess.run(command, check=True)
        archives = list(work.glob("transformers-*.tar.gz"))
        if len(archives) != 1:
            raise SystemExit(f"expected one transformers sdist in {work}, found {[p.name for p in archives]}")
        staged = work / "staged"
        extracted = 0
        with tarfile.open(archives[0]) as archive:
            for member in archive.getmembers():
                parts = Path(member.name).parts  # transformers-<version>/tests/...
                if len(parts) < 3 or parts[1] != "tests" or not (member.isfile() or member.isdir()):
                    continue
                if member.isfile():
                    if any(part in ("..", "") for part in parts) or Path(member.name).is_absolute():
                        raise SystemExit(f"refusing archive member {member.name!r}")
                    path = staged.joinpath(*parts[1:])
                    path.parent.mkdir(parents=True, exist_ok=True)
                    with archive.extractfile(member) as source, open(path, "wb") as out:
                        shutil.copyfileobj(source, out)
                    extracted += 1
        if not (staged / "tests" / "test_modeling_common.py").is_file():
            raise SystemExit(f"the transformers {version} sdist has no tests/test_modeling_common.py")
        (staged / "tests" / "__init__.py").touch()  # empty, as in the transformers repository
        (staged / COMPLETE).write_text(f"transformers {version}: {extracted} files from {archives[0].name}\n")
        if target.exists():
            shutil.rmtree(target)  # an incomplete earlier attempt
        staged.rename(target)
    print(f"transformers {version} tests: {extracted} files in {target / 'tests'}")
    return target / "tests"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--version", default=installed_version("transformers"), help="default: the installed one")
    fetch(parser.parse_args(argv).version)


if __name__ == "__main__":
    main()
