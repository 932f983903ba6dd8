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
        self.signum = 0
        """The signal this process received (0: none); with two, the later one."""
        self._previous = {}

    @property
    def requested(self) -> bool:
        """Whether this process itself has been signalled."""
        return self.signum != 0

    def install(self) -> "PreemptionFlag":
        for sig in self.SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handle(self, signum, _frame) -> None:
        self.signum = signum

    def agreed(self, world_size: int, device: torch.device) -> str:
        """The signal any rank received ('' if none), the same on every rank (collective when world > 1).

        Two signals on different ranks agree on the larger number (SIGTERM over SIGUSR1).
        """
        signum = self.signum
        if world_size > 1:
            flag = torch.tensor([float(signum)], device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            signum = int(flag.item())
        return signal.Signals(signum).name if signum else ""
