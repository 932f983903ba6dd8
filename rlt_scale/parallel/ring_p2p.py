"""The ring pipeline's point-to-point traffic, posted tick by tick, and how long the ring waits for it.

Why ticks. NCCL does not buffer a send: it completes only when the peer's
matching receive runs, and the operations one rank issues towards one peer
run in order, on one stream. Two ranks that each queue a send before the
receive the other one waits on deadlock. gloo buffers sends on the host and
hides this. At PP=2 the ring's previous and next stage are the same rank,
and a ring that sends as soon as it can does exactly that.

So the pipeline's schedules (the encoder's and the decoder ring's) run in
ticks, and every message is exchanged at the tick of its *consumer*: the
producer holds it until then (:meth:`TickExchange.send_at`), and at that
tick each rank posts its held sends together with its own receives as one
``batch_isend_irecv`` group, whose operations progress together. Every rank
walks the ticks in order and the operations of one tick pair up exactly
across ranks, so tick t needs nothing but every rank having finished tick
t-1: no cycle of waits can form, whatever the backend buffers.

:class:`WaitTimer` measures the ring's bubble: the time spent waiting for
those messages, on the host clock on a CPU and with CUDA events on a GPU.
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from typing import Optional, Sequence

import torch
import torch.distributed as dist

Receive = tuple[int, tuple[int, ...], torch.dtype]
"""What to receive: (source global rank, shape, dtype)."""


class WaitTimer:
    """The wall time of a span of the ring and the part of it spent waiting for messages.

    On a CPU gloo's ``wait()`` blocks the host, so the host clock is right.
    Under NCCL ``wait()`` only makes the current CUDA stream wait and returns
    at once: the host clock would read a bubble of ~0. There CUDA events,
    recorded on the current stream around each wait, measure how long the
    stream stalled. The events are read once, by :meth:`totals`, after the
    step has synchronised anyway (so timing adds no host synchronisation).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._start = self._stop = None
        self._waits: list = []

    def _mark(self):
        if self.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            return event
        return time.perf_counter()

    def _seconds(self, start, stop) -> float:
        return start.elapsed_time(stop) / 1000.0 if self.cuda else stop - start

    def start(self) -> None:
        self._start = self._mark()

    def stop(self) -> None:
        self._stop = self._mark()

    @contextlib.contextmanager
    def waiting(self):
        """Count the time inside this block as waiting."""
        before = self._mark()
        yield
        self._waits.append((before, self._mark()))

    def totals(self) -> tuple[float, float]:
        """(wall seconds from start to stop, seconds waited in between)."""
        if self._start is None or self._stop is None:
            return 0.0, 0.0
        if self.cuda:
            self._stop.synchronize()
        wall = self._seconds(self._start, self._stop)
        return wall, sum(self._seconds(a, b) for a, b in self._waits)


class TickExchange:
    """One schedule's messages, each exchanged at the tick its consumer runs (see the module doc).

    Ranks are global; the operations run on ``group`` (the pipeline's group).
    Call :meth:`exchange` at every tick, in order, on every rank of the
    pipeline, with nothing to receive where a rank has nothing to run, and
    :meth:`close` at the end.
    """

    def __init__(self, group: dist.ProcessGroup, device: torch.device, timer: Optional[WaitTimer] = None):
        self.group, self.device, self.timer = group, device, timer
        self._outbox: dict[int, list[tuple[int, torch.Tensor]]] = defaultdict(list)
        self._sent: list = []

    def send_at(self, tick: int, dst: int, tensor: torch.Tensor) -> None:
        """Hold ``tensor`` for rank ``dst`` until ``tick``.

        Several messages to one peer at one tick pair with the peer's receives
        in the order they were given.
        """
        self._outbox[tick].append((dst, tensor.detach().contiguous()))

    def exchange(self, tick: int, receives: Sequence[Receive] = ()) -> list[torch.Tensor]:
        """Post ``tick``'s held sends and ``receives`` as one group; returns the received tensors.

        Waits for the receives (that wait is the ring's bubble); the sends'
        buffers are kept until :meth:`close`.
        """
        sends = self._outbox.pop(tick, [])
        buffers = [torch.empty(shape, dtype=dtype, device=self.device) for _, shape, dtype in receives]
        ops = [dist.P2POp(dist.isend, tensor, dst, self.group) for dst, tensor in sends]
        ops += [dist.P2POp(dist.irecv, buf, src, self.group) for (src, _, _), buf in zip(receives, buffers)]
        if not ops:
            return buffers
        works = dist.batch_isend_irecv(ops)
        if len(works) == len(ops):  # gloo: one work per operation; the sends may finish later
            sent, waited = works[:len(sends)], works[len(sends):]
        else:  # NCCL coalesces the group into one work: the group completes as a whole
            sent, waited = [], works
        self._sent.append((sent, [t for _, t in sends]))
        with self.timer.waiting() if self.timer else contextlib.nullcontext():
            for work in waited:
                work.wait()
        return buffers

    def close(self) -> None:
        """Wait for the sends; every held message must have been exchanged."""
        if self._outbox:
            raise RuntimeError(f"ring messages held for ticks {sorted(self._outbox)} were never exchanged")
        for works, _ in self._sent:
            for work in works:
                work.wait()
        self._sent.clear()
