"""What the ring pipeline carries around: micro-batches, their segments, one segment's graph, the ticks.

Kept apart from :mod:`rlt_scale.parallel.pipeline` (the passes and their
communication) so that each file reads on its own.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from rlt_scale.model.layers import document_positions
from rlt_scale.training.bptt import BPTT, SegmentPlan, Targets, next_token_targets, split_batch
from rlt_scale.model.rlt import RLT
from rlt_scale.model.state import KV


def leaf(t: torch.Tensor) -> torch.Tensor:
    """A graph input: detached from whatever produced ``t``, gradients collected in ``.grad``."""
    return t.detach().requires_grad_(True)


def leaf_kv(kv: KV) -> KV:
    return KV(leaf(kv.k), leaf(kv.v), kv.pos, kv.doc)


@dataclass
class SegmentWork:
    """One segment of one micro-batch on this stage: leaves in, outputs out."""

    z_in: torch.Tensor
    caches_in: dict[int, KV]
    caches_out: dict[int, KV]
    z_out: torch.Tensor
    f_in: Optional[torch.Tensor] = None       # last stage: feedback used by this segment
    f_next: Optional[torch.Tensor] = None     # last stage: feedback for the next segment
    u_next: Optional[torch.Tensor] = None     # last stage: merged input sent to stage 0
    z_read: Optional[torch.Tensor] = None     # last stage, with a graph: leaf of z_out that the chunk's readout reads


@dataclass
class Boundary:
    """What chunk activation checkpointing keeps of a chunk: its incoming state."""

    caches: dict[int, KV]
    feedback: Optional[torch.Tensor]  # last stage only


@dataclass
class MicroBatch:
    x: torch.Tensor
    pos: torch.Tensor
    doc: torch.Tensor
    targets: torch.Tensor
    valid: torch.Tensor
    plan: SegmentPlan
    """The batch's chunks, segments and truncation points."""
    enc_in: Optional[torch.Tensor] = None
    enc_out: Optional[torch.Tensor] = None
    e: Optional[torch.Tensor] = None                      # leaf: final encoder output
    memory: dict[int, KV] = field(default_factory=dict)   # graph from e (or from e.detach() on replicas)
    memory_leaves: dict[int, KV] = field(default_factory=dict)
    work: dict[int, SegmentWork] = field(default_factory=dict)
    pre: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # last stage: (u_0, f_0)
    feedback: Optional[torch.Tensor] = None   # last stage: f_next of the newest segment run
    received: dict[int, torch.Tensor] = field(default_factory=dict)  # checkpointing: z_in of every segment
    boundaries: dict[int, Boundary] = field(default_factory=dict)    # checkpointing: state at chunk starts
    chunk_z: list[torch.Tensor] = field(default_factory=list)        # last stage: outputs of the current chunk so far
    chunk_loss: dict[int, torch.Tensor] = field(default_factory=dict)  # last stage: summed CE of a chunk, with its graph

    @property
    def segments(self) -> tuple[tuple[int, int], ...]:
        """``[a, b)`` of every segment; segments never straddle a chunk boundary."""
        return self.plan.segments

    def ends_chunk(self, n: int) -> bool:
        """Whether segment ``n`` is the last of its chunk."""
        chunk_of = self.plan.chunk_of
        return n + 1 == len(chunk_of) or chunk_of[n + 1] != chunk_of[n]

    @classmethod
    def from_batch(cls, batch: dict, model: RLT, bptt: BPTT, targets_of: Targets = next_token_targets) -> "MicroBatch":
        x, doc, _, _ = split_batch(batch["tokens"], batch["doc_ids"], batch["loss_mask"])
        targets, valid = targets_of(batch)
        pos = document_positions(doc)
        return cls(x, pos, doc, targets, valid, SegmentPlan.build(pos, model.cfg.feedback_block, bptt))


@dataclass
class RingStats:
    """This stage's view of the last forward/backward pass through the ring."""

    ticks: int
    """Ticks of the forward ring (the backward ring has as many)."""
    busy: int
    """Ticks at which this stage had a segment to run."""
    wall_s: float = 0.0
    """Wall time of the two ring passes (on a GPU: of the CUDA stream)."""
    wait_s: float = 0.0
    """Part of wall_s spent waiting for messages (on a GPU: the stream stalled on them); see ring_p2p.WaitTimer."""

    @property
    def idle_fraction(self) -> float:
        """Scheduled idle share: 1 - busy/ticks (ideal (PP-1)/ticks when M >= PP)."""
        return 1.0 - self.busy / self.ticks if self.ticks else 0.0

    @property
    def measured_idle_fraction(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s else 0.0


@dataclass(frozen=True)
class RingSchedule:
    """Which segment each stage runs at each tick of the decoder ring.

    With ``period = max(M, PP)``, micro-batch m's segment n runs on stage s at
    tick ``n * period + m + s``: its input was produced at an earlier tick (by
    stage s-1, or for stage 0 by the last stage at ``(n-1) * period + m + PP-1``).
    The backward ring runs the same ticks in reverse: the work of forward tick
    t is undone at backward step ``ticks - 1 - t``.
    """

    n_stages: int
    period: int
    segments: tuple[int, ...]
    """Number of segments of every micro-batch."""

    @classmethod
    def of(cls, micro: list[MicroBatch], n_stages: int) -> "RingSchedule":
        return cls(n_stages, max(len(micro), n_stages), tuple(len(mb.segments) for mb in micro))

    @property
    def ticks(self) -> int:
        return self.period * max(self.segments) + self.n_stages - 1

    def tick(self, stage: int, m: int, n: int) -> int:
        return n * self.period + m + stage

    def step(self, tick: int) -> int:
        """The backward step that undoes forward tick ``tick``."""
        return self.ticks - 1 - tick

    def work(self, stage: int, tick: int) -> Optional[tuple[int, int]]:
        """(micro-batch, segment) that ``stage`` runs at ``tick``, or None when it idles."""
        j = tick - stage
        m, n = j % self.period, j // self.period
        if j >= 0 and m < len(self.segments) and n < self.segments[m]:
            return m, n
        return None

    @property
    def busy(self) -> int:
        """Ticks at which a stage has a segment to run (every stage runs every segment once)."""
        return sum(self.segments)
