"""Attention over the documents packed in a sample, without a T×T mask.

Who sees whom is :func:`rlt_scale.model.layers.visibility` (DESIGN.md
section 1): a query sees the keys of its own document that are not in its
future and, with a window ``W``, fewer than ``W`` positions back. Written out
as a boolean mask that rule costs ``B·Sq·Sk`` bytes per layer, and SDPA keeps
a float copy of it for backward: at T=4096, 67 MB (float32) per layer per
sample, four times as much for twice the sequence.

:func:`document_attention` computes the same numbers in memory linear in the
sequence, two ways:

* **One document per row, no window, as many queries as keys.** The rule is
  plain causal attention, and SDPA's ``is_causal`` kernel needs no mask.
* **Otherwise, query tiles.** The keys a tile of queries can see lie in one
  span of the sample: it ends at the tile's last query (later keys are in its
  future) and starts no earlier than the first query's document start (a
  document's tokens are contiguous) or, with a window, ``W - 1`` keys before
  the first query. Each tile builds the mask of its span only and runs SDPA
  on it. Backward recomputes each tile from ``q``, ``k``, ``v`` and the
  positions, which is all that autograd keeps. Transient memory is
  ``O(TILE × Sk)``, never ``O(Sq × Sk)``.

The spans are the one thing read on the host: one small read per call. They
rely on what every caller in this model passes (keys in sample order,
document ids that never decrease along a row, positions that count up by one
inside a document, queries that are the last keys); the same read checks it,
and where it does not hold every tile reads every key, which is slower and
still exact.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from rlt_scale.model.layers import autocast_as, autocast_of, visibility

TILE = 256
"""Queries per tile: the transient mask is ``[B, 1, TILE, span]``."""


Spans = list[tuple[int, int, int, int]]
"""Per tile ``(a, b, lo, hi)``: queries ``[a, b)`` read keys ``[lo, hi)``."""


@dataclass(frozen=True)
class AttentionPlan:
    """How :func:`document_attention` runs for one set of positions: ``spans`` of tiles, or
    None for SDPA's ``is_causal`` kernel. Every layer of a pass reads the same positions,
    so one plan (one host read) serves them all."""

    spans: Optional[Spans]


def plan_attention(q_pos: torch.Tensor, q_doc: torch.Tensor, k_pos: torch.Tensor, k_doc: torch.Tensor,
                   window: Optional[int] = None, *, single_document: bool = False) -> AttentionPlan:
    """The plan for queries ``q_*`` ``[B, Sq]`` that are the last ``Sq`` of the keys ``k_*`` ``[B, Sk]``.

    ``single_document=True`` is the caller's promise that each row holds one
    document, which spares the host read.
    """
    sq, sk = q_pos.shape[1], k_pos.shape[1]
    if single_document:
        single, spans = True, _index_spans(sq, sk, window, TILE)
    else:
        spans, single = _document_spans(q_pos, q_doc, k_pos, k_doc, window, TILE)
    return AttentionPlan(None if single and window is None and sq == sk else spans)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       q_pos: torch.Tensor, q_doc: torch.Tensor, k_pos: torch.Tensor, k_doc: torch.Tensor,
                       window: Optional[int] = None, *, plan: Optional[AttentionPlan] = None,
                       single_document: bool = False) -> torch.Tensor:
    """``attend(q, k, v, visibility(q_pos, q_doc, k_pos, k_doc, window))`` without the mask.

    ``q`` is ``[B, h, Sq, hd]``, ``k``/``v`` ``[B, h, Sk, hd]`` with
    ``Sq <= Sk``; ``*_pos``/``*_doc`` are ``[B, Sq]`` and ``[B, Sk]``. The
    queries are the *last* ``Sq`` keys (e.g. a chunk at an offset, with the
    keys of the sample before it). ``plan`` is :func:`plan_attention` of these
    positions, made here when not given.
    """
    if plan is None:
        plan = plan_attention(q_pos, q_doc, k_pos, k_doc, window, single_document=single_document)
    if plan.spans is None:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return _TiledAttention.apply(q, k, v, q_pos, q_doc, k_pos, k_doc, window, plan.spans)


def _index_spans(sq: int, sk: int, window: Optional[int], tile: int) -> Spans:
    """Spans of one document per row: only the future and the window bound them."""
    offset, spans = sk - sq, []
    for a in range(0, sq, tile):
        b = min(a + tile, sq)
        lo = 0 if window is None else max(offset + a - (window - 1), 0)
        spans.append((a, b, lo, offset + b))
    return spans


def _document_spans(q_pos, q_doc, k_pos, k_doc, window: Optional[int], tile: int) -> tuple[Spans, bool]:
    """Spans of packed documents, and whether every row holds one document, in one host read.

    Query ``i`` is key ``offset + i``; the first key it can see is where its
    document's run of keys starts (or ``W - 1`` keys back). That index never
    decreases along a row, so a tile's earliest key is its first query's,
    taken over the rows.
    """
    sq, sk = q_pos.shape[1], k_pos.shape[1]
    offset = sk - sq
    index = torch.arange(sk, device=k_pos.device)
    new_run = torch.ones_like(k_doc, dtype=torch.bool)
    new_run[:, 1:] = k_doc[:, 1:] != k_doc[:, :-1]
    first = torch.where(new_run, index, 0).cummax(dim=1).values[:, offset:]
    if window is not None:
        first = torch.maximum(first, index[offset:] - (window - 1))
    lows = first[:, ::tile].amin(dim=0)
    ordered = ((k_doc[:, 1:] >= k_doc[:, :-1]).all()
               & (new_run[:, 1:] | (k_pos[:, 1:] == k_pos[:, :-1] + 1)).all()
               & (q_pos == k_pos[:, offset:]).all() & (q_doc == k_doc[:, offset:]).all())
    single = ~new_run[:, 1:].any()
    *lows, ordered, single = torch.cat([lows, torch.stack([ordered, single]).to(lows.dtype)]).tolist()
    if not ordered:  # the bounds would not be safe: every tile reads every key (still exact)
        return [(a, min(a + tile, sq), 0, sk) for a in range(0, sq, tile)], False
    return [(a, min(a + tile, sq), lo, offset + min(a + tile, sq)) for a, lo in zip(range(0, sq, tile), lows)], \
        bool(single)


def _tile(span, q, k, v, q_pos, q_doc, k_pos, k_doc) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """The slices one tile reads: its queries ``[a, b)`` and its keys ``[lo, hi)``, then their positions."""
    a, b, lo, hi = span
    return (q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi]), (q_pos[:, a:b], q_doc[:, a:b], k_pos[:, lo:hi], k_doc[:, lo:hi])


def _masked(q, k, v, positions, window):
    """SDPA under the rule's mask, built for these (tile-sized) queries and keys only."""
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visibility(*positions, window))


class _TiledAttention(torch.autograd.Function):
    """Tile by tile forward; backward recomputes each tile and adds its share of dk/dv.

    Saves ``q``, ``k``, ``v`` and the positions only. Recomputing a tile in
    backward costs one more forward of it: the price of keeping nothing
    ``O(Sq × Sk)`` between forward and backward.
    """

    @staticmethod
    def forward(ctx, q, k, v, q_pos, q_doc, k_pos, k_doc, window, spans):
        out = q.new_empty(*q.shape[:-1], v.shape[-1])
        for span in spans:
            qkv, positions = _tile(span, q, k, v, q_pos, q_doc, k_pos, k_doc)
            out[:, :, span[0]:span[1]] = _masked(*qkv, positions, window)
        ctx.save_for_backward(q, k, v, q_pos, q_doc, k_pos, k_doc)
        ctx.window, ctx.spans, ctx.autocast = window, spans, autocast_of(q)
        return out

    @staticmethod
    def backward(ctx, d_out):
        q, k, v, *positions = ctx.saved_tensors
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for a, b, lo, hi in ctx.spans:
            qkv, tile_positions = _tile((a, b, lo, hi), q, k, v, *positions)
            with torch.enable_grad(), autocast_as(q, ctx.autocast):  # recompute as forward ran
                qkv = [x.detach().requires_grad_() for x in qkv]
                out = _masked(*qkv, tile_positions, ctx.window)
                dq_t, dk_t, dv_t = torch.autograd.grad(out, qkv, d_out[:, :, a:b])
            dq[:, :, a:b] = dq_t
            dk[:, :, lo:hi] += dk_t
            dv[:, :, lo:hi] += dv_t
        return dq, dk, dv, None, None, None, None, None, None
