"""PreemptionFlag: every rank stops at the same step and names the signal, signalled or not.

Two gloo processes (torch.multiprocessing). On a two-node Slurm job each
node's agent forwards SIGTERM on its own schedule, so rank 0 (which writes
the log) can be the rank that has not been signalled yet when the ranks
agree to stop; tests/test_cluster.py's requeue test then found
"signal received" in rank 0's log instead of "SIGTERM received".
"""

from __future__ import annotations

import os
import signal

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from helpers import free_port
from rlt_scale.training.preemption import PreemptionFlag


def _agree(rank: int, world: int, port: int, signals: dict[int, int], out: dict) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    flag = PreemptionFlag().install()
    try:
        if rank in signals:
            os.kill(os.getpid(), signals[rank])  # delivered to this (the main) thread before os.kill returns
        out[rank] = (flag.requested, flag.agreed(world, torch.device("cpu")))
    finally:
        flag.uninstall()
        dist.destroy_process_group()


@pytest.mark.parametrize("signals, expected", [
    ({}, ""),                                                 # nobody signalled: go on
    ({1: signal.SIGTERM}, "SIGTERM"),                         # only rank 1: rank 0 stops and names it too
    ({0: signal.SIGUSR1, 1: signal.SIGTERM}, "SIGTERM"),      # two signals: the larger number, on every rank
], ids=["none", "rank1-only", "both"])
def test_every_rank_agrees_on_the_signal_any_rank_received(signals, expected):
    with mp.Manager() as manager:
        out = manager.dict()
        mp.spawn(_agree, args=(2, free_port(), signals, out), nprocs=2)
        got = dict(out)
    assert got == {rank: (rank in signals, expected) for rank in range(2)}


def test_one_process_names_its_own_signal_and_restores_the_handlers():
    before = {sig: signal.getsignal(sig) for sig in PreemptionFlag.SIGNALS}
    flag = PreemptionFlag().install()
    try:
        assert flag.agreed(1, torch.device("cpu")) == ""
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.agreed(1, torch.device("cpu")) == "SIGUSR1"
    finally:
        flag.uninstall()
    assert {sig: signal.getsignal(sig) for sig in PreemptionFlag.SIGNALS} == before
