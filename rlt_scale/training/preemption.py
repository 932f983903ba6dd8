"""Preemption: SIGTERM (Slurm, torchrun shutting down) asks for a checkpoint, not a crash.

The signal handler only sets a flag; the training loop checks it after each
optimizer step. All ranks must agree on the step at which they stop (saving
is collective), so the flag is max-reduced over the world before use.
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

    def agreed(self, world_size: int, device: torch.device) -> bool:
        """True on every rank once any rank has been signalled (collective when world > 1)."""
        if world_size == 1:
            return self.requested
        flag = torch.tensor([1.0 if self.requested else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
