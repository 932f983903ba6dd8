"""The ring's bubble timer (issue #17, item 8).

Under NCCL ``work.wait()`` only makes the CUDA stream wait and returns at
once, so host clocks around it read a bubble of ~0. On a CUDA device
:class:`WaitTimer` records CUDA events around each wait and reads them once at
the end; on a CPU (gloo blocks the host) it uses the host clock. Both are
checked here without a GPU: the CUDA path against stand-in events.
"""

from __future__ import annotations

import time

import torch

from rlt_scale.parallel.ring_p2p import WaitTimer


def test_cpu_timer_counts_host_time_spent_waiting():
    timer = WaitTimer(torch.device("cpu"))
    timer.start()
    with timer.waiting():
        time.sleep(0.05)
    time.sleep(0.02)
    timer.stop()
    wall, waited = timer.totals()
    assert 0.05 <= waited < wall


class FakeEvent:
    """A CUDA event stand-in: its 'stream time' is what the test says, not the host clock."""

    clock = 0.0
    synchronized = 0

    def __init__(self, enable_timing=False):
        assert enable_timing
        self.t = None

    def record(self):
        self.t = FakeEvent.clock

    def elapsed_time(self, other) -> float:  # milliseconds, as CUDA's
        return (other.t - self.t) * 1000.0

    def synchronize(self):
        FakeEvent.synchronized += 1


def test_cuda_timer_reads_stream_time_from_events_not_the_host_clock(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", FakeEvent)
    timer = WaitTimer(torch.device("cuda"))
    FakeEvent.clock = 1.0
    timer.start()
    with timer.waiting():  # the host returns at once (as under NCCL); the stream stalls 0.3 s
        FakeEvent.clock = 1.3
    FakeEvent.clock = 2.0
    timer.stop()
    wall, waited = timer.totals()
    assert abs(wall - 1.0) < 1e-9 and abs(waited - 0.3) < 1e-9
    assert FakeEvent.synchronized == 1  # read once, at the end of the step
