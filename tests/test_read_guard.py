"""The read guard (tests/read_guard/readguard.py) flags reads in a sibling of the repository, and only those.

Each test builds its own layout `parent/{repo, shared, ...}` in a temporary folder and a guard for `parent/repo`;
the session's guard ignores these reads (they are inside pytest's temporary folder).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import conftest
import pytest
import readguard


@pytest.fixture
def layout(tmp_path):
    parent = tmp_path / "parent"
    for name in ("repo/data", "shared/data", ".cache/hub", "venv/lib"):
        (parent / name).mkdir(parents=True)
    (parent / "repo" / "data" / "inside.txt").write_text("inside")
    (parent / "shared" / "data" / "corpus.txt").write_text("outside")
    (parent / "notes.md").write_text("a file next to the repository")
    (parent / ".cache" / "hub" / "blob").write_text("tool state")
    (parent / "venv" / "lib" / "module.py").write_text("x = 1")
    (parent / "repo" / "link.txt").symlink_to(parent / "shared" / "data" / "corpus.txt")
    return parent


def test_policy_flags_siblings_only(layout, tmp_path, monkeypatch):
    guard = readguard.ReadGuard(layout / "repo", allowed=[layout / "venv"], defaults=False)
    assert guard.outside(layout / "shared" / "data" / "corpus.txt")
    assert guard.outside(layout / "shared")
    assert guard.outside(layout / "notes.md")
    assert guard.outside(layout / "repo" / "link.txt")  # a link inside the repository to a sibling's file
    assert not guard.outside(layout / "repo" / "data" / "inside.txt")
    assert not guard.outside(layout / "repo")
    assert not guard.outside(layout / ".cache" / "hub" / "blob")  # hidden: tool state, not data
    assert not guard.outside(layout / "venv" / "lib" / "module.py")  # an allowed root
    assert not guard.outside(tmp_path / "elsewhere.txt")  # not below the repository's parent
    monkeypatch.chdir(layout / "repo")
    assert guard.outside("../shared/data/corpus.txt") and not guard.outside("data/inside.txt")
    # an allowed root that holds the repository's parent would allow everything: it is ignored
    assert readguard.ReadGuard(layout / "repo", allowed=[tmp_path], defaults=False).outside(layout / "notes.md")


def test_audit_hook_records_opens_and_listings_in_this_process(layout):
    with readguard.ReadGuard(layout / "repo", defaults=False).installed() as guard:
        (layout / "repo" / "data" / "inside.txt").read_text()
        os.listdir(layout / "repo" / "data")
        assert not guard.records
        (layout / "shared" / "data" / "corpus.txt").read_text()
        list((layout / "shared").rglob("*.txt"))  # os.scandir
        with open(layout / "notes.md", "rb"):
            pass
    events = [(r["event"], os.path.relpath(r["path"], layout)) for r in guard.records]
    assert events[0] == ("open", os.path.join("shared", "data", "corpus.txt"))
    assert ("os.scandir", "shared") in events and ("os.scandir", os.path.join("shared", "data")) in events
    assert events[-1] == ("open", "notes.md")
    (layout / "shared" / "data" / "corpus.txt").read_text()
    assert len(guard.records) == len(events)  # uninstalled: nothing more recorded


def test_python_subprocesses_run_their_own_guard(layout, tmp_path):
    log = tmp_path / "log" / "reads.jsonl"
    log.parent.mkdir()
    guard = readguard.ReadGuard(layout / "repo", log=log, defaults=False)
    env = {**os.environ, **guard.child_env(), readguard.ENV_TEST: "child-test"}
    inside, outside = layout / "repo" / "data" / "inside.txt", layout / "shared" / "data" / "corpus.txt"
    for path in (inside, outside):
        code = f"open({str(path)!r}).read()"
        subprocess.run([sys.executable, "-c", code], env=env, cwd=layout / "repo", check=True, timeout=60)
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [(r["event"], r["path"], r["test"]) for r in logged] == [("open", str(outside), "child-test")]
    assert logged[0]["pid"] != os.getpid()


def test_a_python_subprocess_without_the_guard_is_recorded(layout):
    guard = readguard.ReadGuard(layout / "repo", defaults=False)
    guarded = {**os.environ, **guard.child_env()}
    bare = {k: v for k, v in guarded.items() if not k.startswith("LONGRANGE_READ_GUARD") and k != "PYTHONPATH"}
    # what the audit hook passes for subprocess.Popen: (executable, args, cwd, env)
    guard.observe("subprocess.Popen", (sys.executable, [sys.executable, "-c", "pass"], None, bare), caller="test")
    guard.observe("subprocess.Popen", (sys.executable, [sys.executable, "-c", "pass"], None, guarded), caller="t")
    guard.observe("subprocess.Popen", ("git", ["git", "status"], None, bare), caller="test")  # not Python
    assert [r["event"] for r in guard.records] == ["unguarded subprocess"]
    assert guard.records[0]["path"].endswith("-c pass")


def test_the_session_guard_watches_this_repository():
    assert conftest.GUARD in readguard._guards
    assert conftest.GUARD.repo == str(conftest.REPO)
    assert os.environ[readguard.ENV_LOG] == conftest.GUARD.log
    assert not readguard.ReadGuard(conftest.REPO).unguarded_child([sys.executable, "-c", "pass"], None)


INNER_TESTS = {
    "test_clean.py": """
def test_reads_inside(tmp_path):
    (tmp_path / "x.txt").write_text("x")
    assert (tmp_path / "x.txt").read_text() == "x"
""",
    "test_reads_sibling.py": """
import subprocess, sys
from pathlib import Path
SHARED = Path(__file__).resolve().parents[2] / "shared" / "data.txt"

def test_reads_a_sibling():
    SHARED.read_text()

def test_subprocess_reads_a_sibling():
    subprocess.run([sys.executable, "-c", f"open({str(SHARED)!r}).read()"], check=True)
""",
    "test_collection_read.py": """
from pathlib import Path
(Path(__file__).resolve().parents[2] / "shared" / "data.txt").read_text()  # while the module is collected

def test_passes():
    pass
""",
}


def test_a_session_with_reads_outside_the_repository_fails(layout):
    """An inner pytest session with this suite's conftest, in a layout whose repository has a sibling `shared/`."""
    tests = layout / "repo" / "tests"
    shutil.copytree(Path(conftest.__file__).parent / "read_guard", tests / "read_guard")
    shutil.copy(conftest.__file__, tests / "conftest.py")
    (layout / "repo" / "longrange").mkdir()
    (layout / "repo" / "longrange" / "__init__.py").write_text("")  # the conftest checks where longrange is from
    for name, text in INNER_TESTS.items():
        (tests / name).write_text(text)
    (layout / "shared" / "data.txt").write_text("outside")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(layout / "repo"), os.environ["PYTHONPATH"]])}

    def inner(*args):
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
        run = subprocess.run(command, cwd=layout / "repo", env=env, capture_output=True, text=True, timeout=120)
        return run.returncode, run.stdout

    # (a session without such reads passes: this whole suite runs under the same conftest)
    code, out = inner("tests/test_clean.py", "tests/test_reads_sibling.py")
    assert code == 1 and "3 passed, 2 errors" in out, out  # a test that fails at teardown counts as passed too
    shared = str(layout / "shared" / "data.txt")
    assert "ERROR at teardown of test_reads_a_sibling" in out and f"open: {shared}" in out
    assert "ERROR at teardown of test_subprocess_reads_a_sibling" in out and f"open: {shared}  (pid " in out
    code, out = inner("tests/test_collection_read.py")  # every test passes, the session still fails
    assert code == 1 and "1 passed" in out and "read guard" in out and "outside any test" in out, out
