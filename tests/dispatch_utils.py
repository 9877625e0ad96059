"""Counting the operators a call dispatches (what a GPU would launch, and any read back to the host)."""

from __future__ import annotations

import collections

from torch.utils._python_dispatch import TorchDispatchMode

# operators that read a tensor value back to the host (a device synchronisation on a GPU)
HOST_READS = ("_local_scalar_dense", "nonzero", "item")


class _Counter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def count_dispatched_ops(fn) -> collections.Counter:
    """Runs fn() and returns how many times each aten operator (by packet name, e.g. "mm") was dispatched."""
    with _Counter() as counter:
        fn()
    return counter.counts
