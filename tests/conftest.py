"""Shared fixtures, and the read guard: the suite must read nothing outside the repository.

Every test runs under `read_guard/readguard.py`: an audit hook records any file or folder opened or listed in a
sibling of the repository (e.g. ../shared/data), in this process and in its Python subprocesses. A test that does so
fails at teardown, naming the paths; anything recorded outside a test (collection, module-scoped fixture teardown)
fails the session at the end.
"""

from __future__ import annotations

import atexit
import getpass
import os
import random
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent / "read_guard"))
import readguard  # noqa: E402

os.environ.pop(readguard.ENV_TEST, None)  # a session started by a test has tests of its own
_LOG_DIR = tempfile.mkdtemp(prefix="longrange-read-guard-")
atexit.register(shutil.rmtree, _LOG_DIR, True)  # also when pytest stops before the session ends (usage errors)
GUARD = readguard.ReadGuard(REPO, log=os.path.join(_LOG_DIR, "reads.jsonl")).install()
os.environ.update(GUARD.child_env())  # subprocesses started by tests inherit the guard
_seen = {"checked": 0, "reported": set()}


# markers transformers' common model tests (tests/models) put on some tests; its own conftest.py registers them
TRANSFORMERS_MARKERS = ("accelerate_tests", "flash_attn_test", "flash_attn_3_test", "flash_attn_4_test",
                        "is_training_test", "torch_compile_test", "torch_export_test", "generate")  # fmt: skip


def pytest_configure(config):
    for marker in TRANSFORMERS_MARKERS:
        config.addinivalue_line("markers", f"{marker}: a marker of transformers' common model tests")
    import longrange

    where = Path(longrange.__file__).resolve()
    if REPO not in where.parents:
        raise pytest.UsageError(
            f"the tests import longrange from {where}, outside this repository ({REPO}); run `python -m pytest` "
            "from the repository root or put it first on PYTHONPATH"
        )


@pytest.fixture(scope="session", autouse=True)
def _read_guard_allows_pytest_temporary_folders(tmp_path_factory):
    # with no --basetemp, pytest numbers its folders under <tmp>/pytest-of-<user>, which it scans to prune old ones
    # when the base folder is first asked for (just below)
    GUARD.allow(Path(tempfile.gettempdir()) / f"pytest-of-{getpass.getuser()}")
    GUARD.allow(tmp_path_factory.getbasetemp())
    # torch.compile's inductor keeps its cache in <tmp>/torchinductor_<user> unless TORCHINDUCTOR_CACHE_DIR names
    # one: a sibling of the repository when the checkout itself lies directly in the temporary folder
    GUARD.allow(Path(tempfile.gettempdir()) / f"torchinductor_{getpass.getuser()}")
    os.environ.update(GUARD.child_env())


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    GUARD.test = os.environ[readguard.ENV_TEST] = item.nodeid
    yield
    GUARD.test = None
    os.environ.pop(readguard.ENV_TEST, None)


def _describe(entries: list[dict]) -> str:
    return "\n".join(f"  {e['event']}: {e['path']}" + (f"  (pid {e['pid']})" if e["pid"] != os.getpid() else "")
                     for e in entries)  # fmt: skip


@pytest.fixture(autouse=True)
def _no_reads_outside_the_repository(request):
    yield
    entries = GUARD.logged()
    mine = []
    for i in range(_seen["checked"], len(entries)):
        if entries[i]["test"] == request.node.nodeid:
            mine.append(entries[i])
            _seen["reported"].add(i)
    _seen["checked"] = len(entries)
    if mine:
        what = f"read outside the repository {REPO} (or started a Python subprocess without the read guard)"
        pytest.fail(f"the test {what}:\n{_describe(mine)}", pytrace=False)


def pytest_sessionfinish(session, exitstatus):
    entries = GUARD.logged()
    GUARD.uninstall()
    shutil.rmtree(_LOG_DIR, ignore_errors=True)
    left = [e for i, e in enumerate(entries) if i not in _seen["reported"]]
    if left:
        by_test = {}
        for e in left:
            by_test.setdefault(e["test"] or "outside any test", []).append(e)
        text = "\n".join(f"{test}:\n{_describe(found)}" for test, found in by_test.items())
        session.config._read_guard_report = f"reads outside the repository {REPO}:\n{text}"
        if session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    report = getattr(config, "_read_guard_report", None)
    if report:
        terminalreporter.section("read guard", red=True)
        terminalreporter.write_line(report)


# ---- generated text: every test corpus is made here, nothing is read from outside the repository --------------

SPEAKERS = ["ROMEO", "JULIET", "KING HENRY", "FIRST CITIZEN", "LADY MACBETH", "MENENIUS", "ÆNEAS", "NURSE"]
WORDS = (
    "the and to of my is that in you not with me it for be his this your he but have thou as so will what thee "
    "shall by all do no if lord our good now more sir are on there then love am let hath king how man yet come "
    "night heart death fair sweet blood honour crown grace world tongue noble gentle speak hear stay go away "
    "naïve café father mother brother sword time day eyes hand"
).split()


def generate_play(n_chars: int, seed: int = 0) -> str:
    """A deterministic play-like text (speakers, verse lines, punctuation, a few non-ASCII letters), UTF-8."""
    rng = random.Random(seed)
    parts, size = [], 0
    while size < n_chars:
        speech = [rng.choice(SPEAKERS) + ":\n"]
        for _ in range(rng.randint(1, 4)):
            words = [rng.choice(WORDS) for _ in range(rng.randint(4, 10))]
            words[0] = words[0].capitalize()
            speech.append(" ".join(words) + rng.choice([",", ".", ";", ":", "!", "?", ""]) + "\n")
        speech.append("\n")
        text = "".join(speech)
        parts.append(text)
        size += len(text)
    return "".join(parts)[:n_chars]


@pytest.fixture(scope="session")
def play_text() -> str:
    """120,000 characters of generated play text (the suite's stand-in for Tiny Shakespeare)."""
    return generate_play(120_000)


@pytest.fixture(scope="session")
def play_file(tmp_path_factory, play_text) -> Path:
    """`play_text` written to a UTF-8 file."""
    path = tmp_path_factory.mktemp("corpus") / "play.txt"
    path.write_text(play_text, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def single_thread():
    """Tiny tensors on a shared 2-core machine: intra-op threads only add contention (100x slower under load).
    A module opts in with `pytestmark = pytest.mark.usefixtures("single_thread")`."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def gpu_kernels(monkeypatch):
    """The Compressive attention kernel chosen as for a CUDA device (the CPU's own is the blockwise kernel)."""
    import torch

    from longrange.modeling_compressive import CompressiveAttention

    kernel = CompressiveAttention.kernel

    def as_on_gpu(self, device, need_weights=False, static=False):
        return kernel(self, torch.device("cuda"), need_weights, static)

    monkeypatch.setattr(CompressiveAttention, "kernel", as_on_gpu)
