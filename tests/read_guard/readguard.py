"""Read guard for the test suite: records every file or folder a test opens or lists outside the repository.

"Outside" means inside a sibling of the repository: an entry (file or folder) that sat next to the repository
folder when the guard started, such as `../shared/data`. Not outside, so never recorded:

- anything inside the repository, and anything that is not below the repository's parent folder;
- hidden entries (a path component starting with "."): tool state such as ~/.cache or ~/.config;
- the allowed roots: the temporary folder, pytest's base temporary folder, the Python installation (prefixes, the
  standard library, site-packages: the standard library's sources are a test corpus), cache folders named by the
  environment (HF_HOME, XDG_CACHE_HOME, ...), and, when the repository sits at the filesystem root, the system
  folders (/usr, /etc, /proc, ...);
- files read by the import system (module code, path scans) and files inside an imported package other than
  `longrange` (a package's own resources are code, not data).

One `sys.addaudithook` hook (audit events "open", "os.listdir", "os.scandir", "subprocess.Popen") feeds every
installed `ReadGuard`; a guard keeps what it sees in `records` and, with a log file, appends each record to it as a
JSON line. Subprocesses are covered through `sitecustomize.py` next to this file: `child_env()` puts this folder on
PYTHONPATH and the settings in LONGRANGE_READ_GUARD_* variables, and a Python child started with them installs its
own guard that writes to the same log. A Python subprocess started without them is itself recorded, so coverage
cannot lapse silently. Reads done in C or Rust (safetensors, tokenizers' `from_file`) raise no audit event and are
not seen.
"""

from __future__ import annotations

import json
import os
import sys
import sysconfig
import tempfile
import threading
from contextlib import contextmanager
from pathlib import Path

GUARD_DIR = str(Path(__file__).resolve().parent)
ENV_REPO, ENV_LOG, ENV_ALLOW, ENV_TEST, ENV_DIR = (
    f"LONGRANGE_READ_GUARD_{k}" for k in ("REPO", "LOG", "ALLOW", "TEST", "DIR")
)
WATCHED = {"open", "os.listdir", "os.scandir", "subprocess.Popen"}
# top-level system folders, allowed when the repository's parent is the filesystem root
SYSTEM_DIRS = {"bin", "boot", "dev", "etc", "lib", "lib32", "lib64", "libx32", "opt", "proc", "run", "sbin", "srv",
               "sys", "usr", "var", "snap", "nix", "private", "System", "Library", "Applications"}  # fmt: skip
CACHE_VARIABLES = ("HF_HOME", "HF_DATASETS_CACHE", "HF_HUB_CACHE", "HF_MODULES_CACHE", "HUGGINGFACE_HUB_CACHE",
                   "TRANSFORMERS_CACHE", "TORCH_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "MPLCONFIGDIR", "TMPDIR",
                   "TORCHINDUCTOR_CACHE_DIR")  # fmt: skip
IMPORT_SYSTEM_FILES = ("<frozen importlib._bootstrap_external>", "<frozen importlib._bootstrap>", "<frozen zipimport>")

_guards: list[ReadGuard] = []
_busy = threading.local()
_hook_installed = False


def _real(path: str | os.PathLike) -> str:
    return os.path.realpath(os.fsdecode(path))


def _inside(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def default_allowed_roots() -> list[str]:
    """Folders every Python process may read: temp folder, the Python installation, caches named in the environment."""
    roots = [tempfile.gettempdir(), sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix]
    roots += [p for p in sysconfig.get_paths().values() if p]
    try:
        import site

        roots += site.getsitepackages() + [site.getusersitepackages()]
    except (AttributeError, OSError):  # some virtualenv flavours lack these
        pass
    roots += [os.environ[v] for v in CACHE_VARIABLES if os.environ.get(v)]
    return roots


class ReadGuard:
    """Records opens and listings of paths in the siblings of `repo` (see the module docstring for what is allowed)."""

    def __init__(self, repo: str | os.PathLike, allowed=(), log: str | os.PathLike | None = None, defaults=True):
        self.repo = _real(repo)
        self.parent = os.path.dirname(self.repo)
        # an allowed root that holds the whole parent would allow everything: only roots below the parent count
        roots = [*(default_allowed_roots() if defaults else []), *allowed]
        if log is not None:
            roots.append(os.path.dirname(_real(log)))
        self.allowed: list[str] = []
        for root in roots:
            self.allow(root)
        self.siblings = []
        for name in sorted(os.listdir(self.parent)):
            path = os.path.join(self.parent, name)
            at_root = self.parent == os.path.dirname(self.parent)
            if name.startswith(".") or path == self.repo or (at_root and name in SYSTEM_DIRS):
                continue
            self.siblings.append(path)
        self.log = None if log is None else os.fspath(log)
        self.records: list[dict] = []
        self.test: str | None = None  # the test being run, stamped on each record

    def allow(self, root: str | os.PathLike) -> None:
        """Allow reads below `root`, unless it holds the repository's parent (that would allow everything)."""
        root = _real(root)
        if not _inside(self.parent, root) and root not in self.allowed:
            self.allowed.append(root)

    # ---- policy ----------------------------------------------------------------------------------------------

    def outside(self, path: str | os.PathLike) -> bool:
        """Whether opening or listing `path` (relative paths: from the current folder) reads outside the repository."""
        absolute = os.path.normpath(os.path.join(os.getcwd(), os.fsdecode(path)))
        if not _inside(absolute, self.parent) and any(_inside(absolute, r) for r in self.allowed):
            return False  # fast path (no symbolic links resolved) for the Python installation's own files
        real = _real(absolute)
        if not any(_inside(real, s) for s in self.siblings):
            return False
        if any(part.startswith(".") for part in os.path.relpath(real, self.parent).split(os.sep)):
            return False
        if any(_inside(real, r) for r in self.allowed):
            return False
        return not any(_inside(real, r) for r in _package_roots())

    def unguarded_child(self, args, env) -> bool:
        """Whether a subprocess (Popen's `args` and `env`) is a Python process that would run without a read guard."""
        argv = [args] if isinstance(args, (str, bytes, os.PathLike)) else list(args or [])
        if not argv:
            return False
        program = os.path.basename(os.fsdecode(argv[0])).split()[0] if argv[0] else ""
        if not (program.startswith("python") or _real(argv[0]) == _real(sys.executable)):
            return False
        env = os.environ if env is None else {os.fsdecode(k): os.fsdecode(v) for k, v in env.items()}
        on_path = [_real(p) for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        return not (env.get(ENV_LOG) and env.get(ENV_REPO) and _real(GUARD_DIR) in on_path)

    def observe(self, event: str, args: tuple, caller: str) -> None:
        """Called by the audit hook; `caller` is the file name of the Python code that raised the event."""
        if event == "subprocess.Popen":
            if self.unguarded_child(args[1], args[3]):
                self.record("unguarded subprocess", " ".join(map(os.fsdecode, args[1] or [])))
            return
        path = args[0]
        if caller in IMPORT_SYSTEM_FILES or isinstance(path, int):
            return
        if path is None:
            path = "."  # os.listdir() / os.scandir(): the current folder
        if self.outside(path):
            self.record(event, _real(os.path.join(os.getcwd(), os.fsdecode(path))))

    def record(self, event: str, path: str) -> None:
        entry = {"test": self.test or os.environ.get(ENV_TEST), "event": event, "path": path, "pid": os.getpid()}
        self.records.append(entry)
        if self.log is not None:
            with open(self.log, "a", encoding="utf-8") as f:
                f.write(json.dumps(entry) + "\n")

    def logged(self) -> list[dict]:
        """Every record in the log file: this process's and its subprocesses'."""
        if self.log is None or not os.path.exists(self.log):
            return []
        with open(self.log, encoding="utf-8") as f:
            return [json.loads(line) for line in f if line.strip()]

    # ---- wiring ----------------------------------------------------------------------------------------------

    def child_env(self) -> dict[str, str]:
        """Environment variables that make a Python subprocess run its own guard for this repository."""
        path = [GUARD_DIR, *[p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and p != GUARD_DIR]]
        env = {ENV_REPO: self.repo, ENV_ALLOW: os.pathsep.join(self.allowed), "PYTHONPATH": os.pathsep.join(path)}
        env[ENV_DIR] = GUARD_DIR  # for a test that clears PYTHONPATH but must keep the guard
        if self.log is not None:
            env[ENV_LOG] = self.log
        return env

    def install(self) -> ReadGuard:
        global _hook_installed
        if not _hook_installed:
            sys.addaudithook(_hook)
            _hook_installed = True
        _guards.append(self)
        return self

    def uninstall(self) -> None:
        _guards.remove(self)

    @contextmanager
    def installed(self):
        self.install()
        try:
            yield self
        finally:
            self.uninstall()


def _package_roots() -> list[str]:
    roots = []
    for name, module in list(sys.modules.items()):
        if "." in name or name == "longrange" or module is None:
            continue
        file = getattr(module, "__file__", None)
        if file and os.path.basename(file).startswith("__init__."):
            roots.append(os.path.dirname(os.path.realpath(file)))
    return roots


def _hook(event: str, args: tuple) -> None:
    if event not in WATCHED or not _guards or getattr(_busy, "on", False):
        return
    _busy.on = True  # the guard's own file access must not come back here
    try:
        # no Python frame at all while the interpreter opens the main script
        frame = sys._getframe(1) if sys._getframe(0).f_back is not None else None
        caller = frame.f_code.co_filename if frame is not None else ""
        for guard in list(_guards):
            try:
                guard.observe(event, args, caller)
            except Exception as err:  # an exception here would make the audited operation itself fail
                guard.record("read guard error", f"{event} {args!r}: {err!r}")
    finally:
        _busy.on = False


def install_from_env() -> ReadGuard | None:
    """In a subprocess: install the guard described by the LONGRANGE_READ_GUARD_* variables, if they are set."""
    repo, log = os.environ.get(ENV_REPO), os.environ.get(ENV_LOG)
    if not repo or not log:
        return None
    allowed = [p for p in os.environ.get(ENV_ALLOW, "").split(os.pathsep) if p]
    return ReadGuard(repo, allowed=allowed, log=log).install()
