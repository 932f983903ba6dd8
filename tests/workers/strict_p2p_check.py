"""Check tests/strict_p2p.py against the NCCL behaviour it models (2 ranks).

    torchrun --nproc-per-node 2 tests/workers/strict_p2p_check.py OUT_FILE

Each rank sends the other a tensor and receives one, three ways, and writes
to OUT_FILE.rank<r> what happened to each (``"ok"`` with the right data,
``"wrong data"`` or ``"deadlock"``):

* ``gloo``: plain gloo, each rank ``isend`` then ``recv``: completes (gloo buffers the send);
* ``strict_unbatched``: the same under the double: both sends wait for receives
  queued behind them on the same pair's stream, so both ranks deadlock, as under NCCL;
* ``strict_batched``: under the double, each rank's receive and send as one
  ``batch_isend_irecv`` group (receive listed first): the group's operations
  progress together and complete.
"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: strict_p2p


def _swap(rank: int, batched: bool) -> str:
    peer = 1 - rank
    mine, theirs = torch.full((3,), float(rank)), torch.empty(3)
    try:
        if batched:
            works = dist.batch_isend_irecv([dist.P2POp(dist.irecv, theirs, peer), dist.P2POp(dist.isend, mine, peer)])
            for work in works:
                work.wait()
        else:
            sent = dist.isend(mine, peer)
            dist.recv(theirs, peer)
            sent.wait()
    except RuntimeError as exc:
        if type(exc).__name__ == "P2PDeadlock":
            return "deadlock"
        raise
    return "ok" if torch.equal(theirs, torch.full((3,), float(peer))) else "wrong data"


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    results = {"gloo": _swap(rank, batched=False)}
    dist.barrier()
    import strict_p2p

    strict_p2p.install(timeout=5)
    results["strict_unbatched"] = _swap(rank, batched=False)
    dist.barrier()  # the stuck pair stream stays stuck; batches run on their own stream
    results["strict_batched"] = _swap(rank, batched=True)
    torch.save(results, f"{sys.argv[1]}.rank{rank}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
