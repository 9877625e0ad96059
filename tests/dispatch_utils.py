"""Count the operators a piece of code dispatches (host syncs, kernel launches), shared by the model tests."""

from __future__ import annotations

import collections
from collections.abc import Callable

from torch.utils._python_dispatch import TorchDispatchMode

# operators that read a device value back to the host (a host-device synchronisation on an accelerator)
SYNC_OPS = ("aten._local_scalar_dense", "aten.nonzero", "aten.item", "aten.equal", "aten.is_nonzero")


class _Recorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1  # e.g. "aten.mm" (overload names merged)
        return func(*args, **(kwargs or {}))


def count_dispatched_ops(fn: Callable[[], object]) -> collections.Counter:
    """Run `fn()` and return how often each aten operator was dispatched (keys like "aten.mm"), forward and
    backward alike when `fn` calls `backward()`. Views and in-place ops count too: each dispatched operator is
    roughly one kernel launch on an accelerator."""
    recorder = _Recorder()
    with recorder:
        fn()
    return recorder.counts


def sync_ops(counts: collections.Counter) -> dict[str, int]:
    """The host-synchronising operators among `counts` (empty dict when there are none)."""
    return {name: n for name, n in counts.items() if name in SYNC_OPS}
