"""A strict stand-in for NCCL's point-to-point rules, for CPU tests (``install()`` in a worker).

gloo buffers a send on the host: ``isend`` returns, the data waits at the
receiver until a matching receive takes it. A schedule that needs its send
to be *taken* before it posts the receive its peer is waiting on therefore
runs on gloo, and deadlocks on GPUs. NCCL does not buffer a send (beyond
what its own buffers hold, which no schedule may count on), and the
operations a rank issues towards one peer run in order on one stream.
``install()`` replaces torch.distributed's point-to-point functions in this
process by an implementation with NCCL's rules:

* **Streams.** A rank's unbatched operations towards one peer (``isend``,
  ``irecv``, ``send``, ``recv``) queue on one stream per peer (NCCL: one
  communicator and stream per pair of ranks). One ``batch_isend_irecv``
  call is one *group*, queued on one stream per process group (NCCL runs a
  batch on the group's communicator). An operation or group starts only
  when everything queued before it on its stream has completed.
* **Rendezvous.** The k-th send from A to B matches the k-th receive of B
  from A on the same channel (unbatched and batched operations are separate
  channels: different communicators never match). A send and its receive
  complete together, once both have started; neither completes alone.
* **Groups.** A group's operations start together and complete in any
  order; the group completes when all have. It returns one work, as NCCL's
  coalesced batch does, and waiting on it waits for the whole group.
* **wait()** blocks the caller until its operation (group) completes. On a
  GPU the host would return and the CUDA stream would wait instead; either
  way nothing issued afterwards can start earlier, so the orderings are the same.

A background thread per process plays the device: it starts the operation
(group) at the head of each stream and completes operations as their
partners start, so operations progress while the caller is blocked
elsewhere (in a gloo collective, say). Data and the "started" marks travel
through the job's TCP store. Collectives are left to gloo. A wait that has
not completed after ``timeout`` seconds raises :class:`P2PDeadlock`, naming
what this rank still has queued.
"""

from __future__ import annotations

import atexit
import datetime
import os
import threading
import time
from collections import Counter, defaultdict, deque

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

UNBATCHED = "pair"


class P2PDeadlock(RuntimeError):
    """A point-to-point wait that NCCL would never see complete."""


class _Op:
    def __init__(self, kind: str, tensor: torch.Tensor, me: int, peer: int, channel: str, index: int):
        self.kind, self.tensor, self.peer, self.done = kind, tensor, peer, False
        src, dst = (me, peer) if kind == "send" else (peer, me)
        self.key = f"{channel}/{src}->{dst}/{index}"  # the same string on both sides of a match

    def __repr__(self) -> str:
        return f"{self.kind} {self.key}{' (done)' if self.done else ''}"


class _Group:
    """What starts and completes as one: a single operation, or one batch_isend_irecv call."""

    def __init__(self, ops: list[_Op]):
        self.ops, self.started, self.finished = ops, False, threading.Event()


class _Work:
    def __init__(self, group: _Group, engine: "_Engine"):
        self.group, self.engine = group, engine

    def wait(self, timeout=None) -> bool:
        if not self.group.finished.wait(self.engine.timeout):
            raise P2PDeadlock(f"rank {self.engine.rank}: {self.group.ops} did not complete in "
                              f"{self.engine.timeout:.0f}s; queued here: {self.engine.describe()}")
        if self.engine.error:
            raise self.engine.error
        return True

    def is_completed(self) -> bool:
        return self.group.finished.is_set()


class _Engine:
    def __init__(self, timeout: float, poll_s: float = 0.002):
        self.rank, self.timeout, self.poll_s = dist.get_rank(), timeout, poll_s
        self.error: Exception | None = None
        self.streams: dict[tuple, deque[_Group]] = defaultdict(deque)
        self.counts: Counter = Counter()  # (channel, kind, peer) -> operations issued
        self.lock = threading.Lock()
        store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
                              timeout=datetime.timedelta(seconds=timeout + 60))
        self.store = dist.PrefixStore("strict-p2p", store)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._device, daemon=True, name="strict-p2p")
        self.thread.start()
        atexit.register(self.stop)  # a thread still inside a store call at exit would abort the process

    def stop(self) -> None:
        self.stopping.set()
        self.thread.join(timeout=10)

    def post(self, stream: tuple, ops: list[tuple[str, torch.Tensor, int, str]]) -> _Group:
        """Queue ``(kind, tensor, peer, channel)`` operations as one group on ``stream``."""
        with self.lock:
            group = []
            for kind, tensor, peer, channel in ops:
                index = self.counts[channel, kind, peer]
                self.counts[channel, kind, peer] += 1
                # A send carries its data as of the call, as a stream-ordered send would.
                data = tensor.detach().cpu().clone() if kind == "send" else tensor
                group.append(_Op(kind, data, self.rank, peer, channel, index))
            unit = _Group(group)
            self.streams[stream].append(unit)
        return unit

    def describe(self) -> str:
        with self.lock:
            return "; ".join(f"{stream}: {[g.ops for g in queue]}" for stream, queue in self.streams.items() if queue)

    # ---- the "device": one thread that runs every stream
    def _device(self) -> None:
        try:
            while not self.stopping.is_set():
                with self.lock:
                    heads = [queue[0] for queue in self.streams.values() if queue]
                progressed = False
                for group in heads:
                    progressed |= self._advance(group)
                if not progressed:
                    time.sleep(self.poll_s)
        except Exception as exc:  # surface it in the waiting caller
            self.error = exc
            with self.lock:
                for queue in self.streams.values():
                    for group in queue:
                        group.finished.set()

    def _advance(self, group: _Group) -> bool:
        progressed = False
        if not group.started:  # it reached the head of its stream: mark every operation started
            for op in group.ops:
                if op.kind == "send":
                    self.store.set("data/" + op.key, op.tensor.reshape(-1).view(torch.uint8).numpy().tobytes())
                else:
                    self.store.set("ready/" + op.key, b"1")
            group.started = progressed = True
        for op in group.ops:
            if op.done:
                continue
            if op.kind == "send" and self.store.check(["ready/" + op.key]):
                self.store.delete_key("ready/" + op.key)
                op.done = progressed = True
            elif op.kind == "recv" and self.store.check(["data/" + op.key]):
                data = self.store.get("data/" + op.key)
                self.store.delete_key("data/" + op.key)
                expected = op.tensor.numel() * op.tensor.element_size()
                if len(data) != expected:
                    raise RuntimeError(f"{op}: {len(data)} bytes sent, {expected} expected")
                received = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(op.tensor.dtype)
                with torch.no_grad():
                    op.tensor.copy_(received.view(op.tensor.shape))
                op.done = progressed = True
        if all(op.done for op in group.ops):
            with self.lock:
                for queue in self.streams.values():
                    if queue and queue[0] is group:
                        queue.popleft()
            group.finished.set()
        return progressed


def _global_peer(group, peer, group_peer) -> int:
    if peer is not None:
        return peer
    return dist.get_global_rank(group, group_peer) if group is not None else group_peer


def install(timeout: float = 30.0) -> None:
    """Route this process's torch.distributed point-to-point calls through the strict double.

    Call it on every rank, after ``init_process_group`` (under torchrun).
    """
    engine = _Engine(timeout)

    def isend(tensor, dst=None, group=None, tag=0, group_dst=None):
        peer = _global_peer(group, dst, group_dst)
        return _Work(engine.post((UNBATCHED, peer), [("send", tensor, peer, UNBATCHED)]), engine)

    def irecv(tensor, src=None, group=None, tag=0, group_src=None):
        peer = _global_peer(group, src, group_src)
        return _Work(engine.post((UNBATCHED, peer), [("recv", tensor, peer, UNBATCHED)]), engine)

    def send(tensor, dst=None, group=None, tag=0, group_dst=None):
        isend(tensor, dst, group, tag, group_dst).wait()

    def recv(tensor, src=None, group=None, tag=0, group_src=None):
        irecv(tensor, src, group, tag, group_src).wait()
        return _global_peer(group, src, group_src)

    def batch_isend_irecv(p2p_op_list):
        name = "batch:" + p2p_op_list[0].group.group_name
        ops = [("send" if op.op is isend else "recv", op.tensor, op.peer, name) for op in p2p_op_list]
        return [_Work(engine.post(("batch", name), ops), engine)]

    # Both modules: P2POp checks its op against distributed_c10d's isend/irecv.
    for module in (dist, c10d):
        for fn in (isend, irecv, send, recv, batch_isend_irecv):
            setattr(module, fn.__name__, fn)
