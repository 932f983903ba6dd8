"""Chunked execution of one batch: BPTT, activation checkpointing, truncation.

DESIGN.md section 2. A sample of T positions is cut into chunks of C. The
encoder and the memory run over all chunks at once; the decoder walks the
chunks in order and carries its state across each boundary. These are
training semantics, not model math: the model (``rlt_scale.model``) computes
one segment; this module decides how a batch is cut and where gradients stop.

* Exact BPTT (default): gradients reach the parameters through ``s``, the
  window caches and the memory, across every chunk.
* ``checkpoint=True``: each chunk's decoder work (and its readout and loss)
  runs under non-reentrant activation checkpointing; only the state at chunk
  boundaries is kept and the chunk is recomputed in backward. Gradients are
  unchanged.
* ``tbptt_chunks=N``: every N chunks the carried parts named in ``detach``
  are cut from the graph ('s', 'cache', and/or 'memory': entries of earlier
  chunks). Nothing else is ever detached.

A batch's cuts -- chunks, the segments inside them, and which chunks start
with a truncation -- are built once, as a :class:`SegmentPlan`, and read by
this module, the ring pipeline and the cost model alike.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch.utils.checkpoint import checkpoint

from rlt_scale.model.layers import document_positions
from rlt_scale.model.rlt import RLT, feedback_segments
from rlt_scale.model.state import KV, DecoderState
from rlt_scale.training import jacobi


@dataclass(frozen=True)
class BPTT:
    """How a batch is walked in time: chunk length, checkpointing, truncation (``trainer.*`` keys)."""

    chunk_size: int = 0
    """Chunk length C; 0 runs the whole sample as one chunk."""
    checkpoint: bool = False
    """Recompute each chunk's decoder in backward, keeping only the state at chunk boundaries."""
    tbptt_chunks: int = 0
    """Cut the carried state every N chunks; 0 = exact BPTT."""
    detach: frozenset[str] = field(default_factory=lambda: frozenset({"s", "cache"}))
    """What a truncation cuts: 's', 'cache' and/or 'memory'."""
    recompute_encoder: bool = False
    """Recompute each encoder layer in backward, keeping only its input (``activation_checkpointing: full``)."""

    @classmethod
    def from_trainer(cls, t) -> "BPTT":
        return cls(t.chunk_size, t.activation_checkpointing in ("chunk", "full"), t.tbptt_chunks,
                   frozenset(t.tbptt_detach), recompute_encoder=t.activation_checkpointing == "full")

    def describe(self) -> str:
        grad = "exact BPTT"
        if self.tbptt_chunks:
            grad = f"TRUNCATED BPTT: detaching {sorted(self.detach)} every {self.tbptt_chunks} chunk(s)"
        chunks = f"chunks of {self.chunk_size}" if self.chunk_size else "one chunk per sample"
        ckpt = ", chunk activation checkpointing" if self.checkpoint else ""
        return f"{chunks}{ckpt}; {grad}"


@dataclass(frozen=True)
class SegmentPlan:
    """Where one batch's positions are cut, decided once: chunks, segments, truncation points.

    ``segments`` are absolute ``[a, b)``; a segment never straddles a chunk
    boundary. ``truncated[c]`` says that truncated BPTT cuts the carried
    state at the start of chunk ``c``.
    """

    chunks: tuple[tuple[int, int], ...]
    segments: tuple[tuple[int, int], ...]
    chunk_of: tuple[int, ...]
    """The chunk of every segment."""
    truncated: tuple[bool, ...]

    @classmethod
    def build(cls, pos: torch.Tensor, feedback_block: int, bptt: BPTT = BPTT()) -> "SegmentPlan":
        """The plan of a batch with positions-in-document ``pos`` ``[B, T]``."""
        length = pos.shape[1]
        size = bptt.chunk_size if 0 < bptt.chunk_size < length else length
        chunks = tuple((a, min(a + size, length)) for a in range(0, length, size))
        # Feedback blocks are cut once for the whole batch (for K > 1 that reads the positions on the
        # host: once per batch, not once per chunk), then also at every chunk start.
        starts = sorted({a for a, _ in feedback_segments(pos, feedback_block)} | {a for a, _ in chunks})
        segments = list(zip(starts, starts[1:] + [length]))
        chunk_of = [a // size for a, _ in segments]
        n = bptt.tbptt_chunks
        truncated = tuple(bool(n) and c > 0 and c % n == 0 for c in range(len(chunks)))
        return cls(chunks, tuple(segments), tuple(chunk_of), truncated)

    @classmethod
    def single_document(cls, length: int, feedback_block: int, bptt: BPTT = BPTT()) -> "SegmentPlan":
        """The plan of samples that hold one document each (the cost model's workload)."""
        return cls.build(torch.arange(length).unsqueeze(0), feedback_block, bptt)

    def chunk_segments(self, c: int) -> list[tuple[int, int]]:
        """The segments of chunk ``c``, relative to its start."""
        start = self.chunks[c][0]
        return [(a - start, b - start) for (a, b), k in zip(self.segments, self.chunk_of) if k == c]

    def chunk_first(self, t: int) -> int:
        """The index of the first segment of segment ``t``'s chunk."""
        return self.chunk_of.index(self.chunk_of[t])

    def starts_truncation(self, t: int) -> bool:
        """Whether segment ``t`` is the first of a chunk at which truncated BPTT cuts the carried state."""
        return self.truncated[self.chunk_of[t]] and self.chunk_first(t) == t

    def truncation_start(self, t: int) -> int:
        """The position of the last truncation at or before segment ``t``'s chunk (0 when none)."""
        cuts = [a for (a, _), cut in zip(self.chunks[: self.chunk_of[t] + 1], self.truncated) if cut]
        return cuts[-1] if cuts else 0


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


Targets = Callable[[dict], tuple[torch.Tensor, torch.Tensor]]
"""``targets(batch) -> (target ids [B, T], valid [B, T] bool)`` of a ``[B, T+1]`` loader batch: the loss's plug-in."""


def next_token_targets(batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """The data's own targets: the next token, where :func:`valid_targets` allows."""
    tokens = batch["tokens"]
    return tokens[:, 1:], valid_targets(tokens, batch.get("doc_ids"), batch.get("loss_mask"))


def split_batch(tokens, doc_ids=None, loss_mask=None):
    """``[B, T+1]`` sample -> inputs, input doc ids, targets, valid-target mask (:func:`valid_targets`)."""
    doc = torch.zeros_like(tokens) if doc_ids is None else doc_ids
    return tokens[:, :-1], doc[:, :-1], tokens[:, 1:], valid_targets(tokens, doc_ids, loss_mask)


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
    n_correct: Optional[torch.Tensor] = None
    """Valid targets whose most likely answer token is right, when ``answer_tokens`` were given."""


def _chunk_loss(model: RLT, e, pos, doc, memory, state, offset, segments, targets, valid, want_logits, answers):
    z, state = model.decode(e, pos, doc, memory, state, offset, segments)
    correct = model.answer_correct(z, targets, valid, answers) if answers is not None else None
    return model.segment_loss(z, targets, valid), state, (model.logits(z) if want_logits else None), correct


def run_sequence(
    model: RLT,
    tokens: torch.Tensor,
    doc_ids: Optional[torch.Tensor] = None,
    loss_mask: Optional[torch.Tensor] = None,
    bptt: BPTT = BPTT(),
    want_logits: bool = False,
    targets: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    answer_tokens: Optional[Sequence[int]] = None,
) -> SequenceOutput:
    """Loss of a batch of ``[B, T+1]`` token samples under ``bptt``.

    ``targets`` (ids, valid) replace the data's next-token targets (the
    experiments' running-state supervision); ``answer_tokens`` also counts the
    valid targets predicted right (evaluation).
    """
    x, doc, targets_in_data, valid = split_batch(tokens, doc_ids, loss_mask)
    targets, valid = targets if targets is not None else (targets_in_data, valid)
    batch = x.shape[0]
    pos = document_positions(doc)
    plan = SegmentPlan.build(pos, model.cfg.feedback_block, bptt)
    e, _ = model.encode(x, pos, doc, recompute=bptt.recompute_encoder)
    memory: list[KV] = model.build_memory(e, pos, doc)
    visible_memory = memory
    state = model.initial_state(batch, x.device)

    # model.decoder_solver=jacobi: each chunk's decoder solved in parallel sweeps (jacobi.py)
    parallel_in_time = jacobi.solver_for(model.cfg) is not None
    total = torch.zeros((), dtype=e.dtype, device=x.device)
    correct = torch.zeros((), dtype=torch.long, device=x.device) if answer_tokens is not None else None
    all_logits = []
    for c, (a, b) in enumerate(plan.chunks):
        if plan.truncated[c]:
            state = state.detach(s="s" in bptt.detach, cache="cache" in bptt.detach)
            if "memory" in bptt.detach:
                visible_memory = [m.detach_before(a) for m in memory]
        args = (model, e[:, a:b], pos[:, a:b], doc[:, a:b], visible_memory, state, a, plan.chunk_segments(c),
                targets[:, a:b], valid[:, a:b], want_logits and not bptt.checkpoint, answer_tokens)
        if parallel_in_time:  # keeps only the fixed point; recomputes the readout when checkpointing
            loss_sum, state, logits, right = jacobi.chunk_loss(*args, recompute=bptt.checkpoint and torch.is_grad_enabled())
        elif bptt.checkpoint and torch.is_grad_enabled():
            loss_sum, state, logits, right = checkpoint(_chunk_loss, *args, use_reentrant=False)
        else:
            loss_sum, state, logits, right = _chunk_loss(*args)
        total = total + loss_sum
        if right is not None:
            correct = correct + right
        if logits is not None:
            all_logits.append(logits)
    return SequenceOutput(
        loss_sum=total,
        n_targets=valid.sum(),
        state=state,
        logits=torch.cat(all_logits, dim=1) if all_logits else None,
        n_correct=correct,
    )
