"""Preemption: SIGTERM (Slurm, torchrun shutting down) asks for a checkpoint, not a crash.

The signal handler only sets a flag; the training loop checks it after each
optimizer step. All ranks must agree on the step at which they stop (saving
is collective), so the signal number is max-reduced over the world before
use. Every rank then names the signal, also a rank that was not itself
signalled yet: the agents on different nodes forward Slurm's SIGTERM at
different moments, and rank 0, which writes the log, may be the later one.
"""

from __future__ import annotations

import signal

import torch
import torch.distributed as dist


class PreemptionFlag:
    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self):
        self.requested = False
        self.signal_name = ""
        self._previous = {}

    def install(self) -> "PreemptionFlag":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        self.requested = True
        self.signal_name = signal.Signals(signum).name

    def agreed(self, world_size: int, device: torch.device) -> str:
        """The signal any rank received ('' if none), the same on every rank (collective when world > 1).

        Two signals on different ranks agree on the larger number (SIGTERM over SIGUSR1).
        """
        if world_size == 1:
            return self.signal_name if self.requested else ""
        number = signal.Signals[self.signal_name].value if self.requested else 0
        flag = torch.tensor([float(number)], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return signal.Signals(int(flag.item())).name if flag.item() else ""
