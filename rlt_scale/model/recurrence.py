"""Chunked execution of one batch: BPTT, activation checkpointing, truncation.

DESIGN.md section 2. A sample of T positions is cut into chunks of C. The
encoder and the memory run over all chunks at once; the decoder walks the
chunks in order and carries its state across each boundary.

* Exact BPTT (default): gradients reach the parameters through ``s``, the
  window caches and the memory, across every chunk.
* ``checkpoint=True``: each chunk's decoder work (and its readout and loss)
  runs under non-reentrant activation checkpointing; only the state at chunk
  boundaries is kept and the chunk is recomputed in backward. Gradients are
  unchanged.
* ``tbptt_chunks=N``: every N chunks the carried parts named in ``detach``
  are cut from the graph ('s', 'cache', and/or 'memory': entries of earlier
  chunks). Nothing else is ever detached.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from rlt_scale.model.layers import document_positions
from rlt_scale.model.rlt import RLT
from rlt_scale.model.state import KV, DecoderState


@dataclass(frozen=True)
class Schedule:
    """How one sample is walked: chunk length, checkpointing, truncation."""

    chunk_size: int = 0
    checkpoint: bool = False
    tbptt_chunks: int = 0
    detach: frozenset[str] = field(default_factory=lambda: frozenset({"s", "cache"}))

    @classmethod
    def from_trainer(cls, t) -> "Schedule":
        return cls(t.chunk_size, t.activation_checkpointing == "chunk", t.tbptt_chunks, frozenset(t.tbptt_detach))

    def truncates_at(self, position: int) -> bool:
        """Whether truncated BPTT cuts the carried state at the chunk boundary ``position``."""
        span = self.chunk_size * self.tbptt_chunks
        return bool(span) and position > 0 and position % span == 0

    def truncation_start(self, position: int) -> int:
        """The last truncation point at or before ``position`` (0 when there is none)."""
        span = self.chunk_size * self.tbptt_chunks
        return (position // span) * span if span else 0

    def chunks(self, length: int) -> list[tuple[int, int]]:
        """``[a, b)`` of every chunk of a sample of ``length`` positions."""
        chunk = self.chunk_size or length
        return [(a, min(a + chunk, length)) for a in range(0, length, chunk)]

    def describe(self) -> str:
        grad = "exact BPTT"
        if self.tbptt_chunks:
            grad = f"TRUNCATED BPTT: detaching {sorted(self.detach)} every {self.tbptt_chunks} chunk(s)"
        chunks = f"chunks of {self.chunk_size}" if self.chunk_size else "one chunk per sample"
        ckpt = ", chunk activation checkpointing" if self.checkpoint else ""
        return f"{chunks}{ckpt}; {grad}"


@dataclass
class SequenceOutput:
    loss_sum: torch.Tensor
    """Sum of per-target cross-entropy over valid targets."""
    n_targets: torch.Tensor
    """Number of valid targets (the loss is loss_sum / n_targets)."""
    state: DecoderState
    """Decoder state after the last position."""
    logits: Optional[torch.Tensor] = None
    """Teacher-forced logits [B, T, V], only when asked for (never under checkpointing)."""


def valid_targets(tokens, doc_ids=None, loss_mask=None) -> torch.Tensor:
    """``[B, T]`` bool: which next-token targets of ``[B, T+1]`` samples count in the loss.

    A target is valid where the loss mask allows it and it belongs to the
    same document as its input: the first token of a packed document is
    independent of the previous one and is not predicted from it. Every loss
    and every target count (the divisor of a mean loss) uses this one rule.
    """
    mask = torch.ones_like(tokens, dtype=torch.bool) if loss_mask is None else loss_mask.bool()
    if doc_ids is None:
        return mask[:, 1:]
    return mask[:, 1:] & (doc_ids[:, 1:] == doc_ids[:, :-1])


def count_valid_targets(batch: dict) -> int:
    """The number of valid targets of a loader batch (``tokens``, ``doc_ids``, ``loss_mask``)."""
    return int(valid_targets(batch["tokens"], batch.get("doc_ids"), batch.get("loss_mask")).sum())


def split_batch(tokens, doc_ids=None, loss_mask=None):
    """``[B, T+1]`` sample -> inputs, input doc ids, targets, valid-target mask (:func:`valid_targets`)."""
    doc = torch.zeros_like(tokens) if doc_ids is None else doc_ids
    return tokens[:, :-1], doc[:, :-1], tokens[:, 1:], valid_targets(tokens, doc_ids, loss_mask)


def _chunk_loss(model: RLT, e, pos, doc, memory, state, offset, targets, valid, want_logits):
    z, state = model.decode(e, pos, doc, memory, state, offset)
    logits = model.logits(z)
    wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
    loss = model.tp.cross_entropy(wide, targets)
    loss_sum = torch.where(valid, loss, torch.zeros_like(loss)).sum()
    return loss_sum, state, (logits if want_logits else None)


def run_sequence(
    model: RLT,
    tokens: torch.Tensor,
    doc_ids: Optional[torch.Tensor] = None,
    loss_mask: Optional[torch.Tensor] = None,
    schedule: Schedule = Schedule(),
    want_logits: bool = False,
) -> SequenceOutput:
    """Loss of a batch of ``[B, T+1]`` token samples under ``schedule``."""
    x, doc, targets, valid = split_batch(tokens, doc_ids, loss_mask)
    batch, length = x.shape
    pos = document_positions(doc)
    e, _ = model.encode(x, pos, doc)
    memory: list[KV] = model.build_memory(e, pos, doc)
    visible_memory = memory
    state = model.initial_state(batch, x.device)

    total = torch.zeros((), dtype=e.dtype, device=x.device)
    all_logits = []
    for a, b in schedule.chunks(length):
        if schedule.truncates_at(a):
            state = state.detach(s="s" in schedule.detach, cache="cache" in schedule.detach)
            if "memory" in schedule.detach:
                visible_memory = [m.detach_before(a) for m in memory]
        args = (model, e[:, a:b], pos[:, a:b], doc[:, a:b], visible_memory, state, a,
                targets[:, a:b], valid[:, a:b], want_logits and not schedule.checkpoint)
        if schedule.checkpoint and torch.is_grad_enabled():
            loss_sum, state, logits = checkpoint(_chunk_loss, *args, use_reentrant=False)
        else:
            loss_sum, state, logits = _chunk_loss(*args)
        total = total + loss_sum
        if logits is not None:
            all_logits.append(logits)
    return SequenceOutput(
        loss_sum=total,
        n_targets=valid.sum(),
        state=state,
        logits=torch.cat(all_logits, dim=1) if all_logits else None,
    )
