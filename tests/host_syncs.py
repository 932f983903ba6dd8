"""Count the operations that make the host wait for the device.

On a GPU, ``tensor.item()``/``float(tensor)`` (``aten._local_scalar_dense``),
``nonzero`` (its output size depends on the data) and ``tolist()`` each block
the CPU until every queued kernel has finished. One such call per decoder
position stalls the whole step at every token. On CPU they cost nothing, so
the tests count them instead of timing them.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCING_OPS = ("_local_scalar_dense", "nonzero", "tolist")


class HostSyncCounter(TorchDispatchMode):
    """``with HostSyncCounter() as c: ...`` then ``c.total`` (or ``c.counts[name]``)."""

    def __init__(self):
        super().__init__()
        self.counts: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in SYNCING_OPS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


@contextlib.contextmanager
def count_host_syncs():
    """Counts every syncing op, ``tolist`` included (it reads the data without dispatching an op)."""
    counter = HostSyncCounter()
    original = torch.Tensor.tolist

    def tolist(tensor):
        counter.counts["tolist"] += 1
        return original(tensor)

    torch.Tensor.tolist = tolist
    try:
        with counter:
            yield counter
    finally:
        torch.Tensor.tolist = original
