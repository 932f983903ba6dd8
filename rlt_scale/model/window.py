"""Keys and values written in place: the decoder's walk over a chunk in O(T·d) memory.

Why this exists. Run naively, every decoder position concatenates its window
cache with its own keys and hands the result to attention, and autograd keeps
each concatenation for backward: ``W`` entries per position per layer, so
O(T·W·d) bytes. Every position's slice of the memory (and of the encoder
output) also gets a gradient as large as the whole tensor in backward,
zero-filled, so a chunk of T positions costs O(T²) there.

Here a chunk's keys live in one :class:`KeyStore` per layer: the carried
``W-1`` entries first, then one slot per position of the chunk, each written
once, in place, when its position runs. Attention reads a window of the
store and saves only its queries; backward recomputes the attention and adds
the keys' gradients into a gradient buffer of the same shape. The memory
(the encoder's keys for cross-attention) is a store too, read-only.

Autograd cannot see that a later position reads an earlier slot, so the
order of backward is made explicit: every store operation takes a *link* (an
empty tensor) from the previous one and returns a new one. Backward runs
along the links in reverse, so by the time a slot's gradient is handed on
(to the projection that wrote it, or to the previous chunk's store), every
later reader has added its share. Values and gradients equal the naive walk
to rounding (float64 tests); DESIGN.md section 2 allows this implementation.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from rlt_scale.model import attention
from rlt_scale.model.layers import attend_backward, autocast_as, autocast_of, visibility
from rlt_scale.model.state import KV


class KeyStore:
    """One layer's keys/values ``[B, h, N, hd]`` with the position and document of each slot.

    Each read saves the store's tensors for its own backward (so chunk
    checkpointing can drop and rebuild them like any activation) and keeps
    the store object only for ``grad_k``/``grad_v``, which accumulate every
    read's gradient in backward (allocated on the first one). Slots are
    written through ``.data``: the writes are new values in unread slots,
    not changes to what an earlier read saw, so autograd's version check
    must not see them.
    """

    def __init__(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, doc: torch.Tensor):
        self.k, self.v, self.pos, self.doc = k, v, pos, doc
        self.shape, self.options = k.shape, dict(dtype=k.dtype, device=k.device)
        self.grad_k: Optional[torch.Tensor] = None
        self.grad_v: Optional[torch.Tensor] = None

    @classmethod
    def for_chunk(cls, carried: KV, pos: torch.Tensor, doc: torch.Tensor) -> "KeyStore":
        """The carried entries, then one empty slot per position of the chunk (``pos``/``doc`` cover both)."""
        b, h, p, hd = carried.k.shape
        # every read covers written slots only (its window ends at its own position)
        store = cls(carried.k.new_empty(b, h, pos.shape[1], hd), carried.v.new_empty(b, h, pos.shape[1], hd),
                    pos, doc)
        store.write(0, p, carried.k, carried.v)
        return store

    def write(self, lo: int, hi: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.data[:, :, lo:hi] = k.detach()
        self.v.data[:, :, lo:hi] = v.detach()

    def release(self) -> None:
        """Drop the store's own references once its chunk has run; the reads' saved copies remain."""
        self.k = self.v = self.pos = self.doc = None

    def ensure_grad(self) -> None:
        if self.grad_k is None:
            self.grad_k, self.grad_v = torch.zeros(self.shape, **self.options), torch.zeros(self.shape, **self.options)

    def add_grad(self, lo: int, hi: int, dk: Optional[torch.Tensor], dv: Optional[torch.Tensor]) -> None:
        self.ensure_grad()
        if dk is not None:
            self.grad_k[:, :, lo:hi] += dk
        if dv is not None:
            self.grad_v[:, :, lo:hi] += dv

    def grad(self, lo: int, hi: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        if self.grad_k is None:
            return None, None
        return self.grad_k[:, :, lo:hi].clone(), self.grad_v[:, :, lo:hi].clone()

    def free_grad(self) -> None:
        """Drop the gradient buffers once every slot's gradient has been handed on.

        Autograd frees what a node saved after its backward, but not what a
        custom Function keeps on ``ctx``; the graph (and so every chunk's
        store) lives as long as the loss tensor does. Without this each
        chunk's memory-sized buffer would stay until the end of backward:
        O(T^2 / C) for T/C chunks.
        """
        self.grad_k = self.grad_v = None


def _tiles(n_queries: int, lo: int, hi: int, window: Optional[int]):
    """``(i, j, klo, khi)``: queries ``[i, j)`` of a read over slots ``[lo, hi)`` see slots ``[klo, khi)`` at most.

    The read's queries are the store's last ``n_queries`` slots up to ``hi``
    (query ``i``'s own key, or for the memory its own position, is slot
    ``hi - n_queries + i``): later slots are its future, and a window ends
    ``W - 1`` slots back. Tiles of :data:`~rlt_scale.model.attention.TILE`
    queries keep every mask at ``TILE x span``: a segment of a whole chunk
    (K=0, long feedback blocks) never builds a ``chunk x memory`` mask. A
    read of at most one tile is one tile over exactly ``[lo, hi)``.
    """
    first = hi - n_queries
    for i in range(0, n_queries, attention.TILE):
        j = min(i + attention.TILE, n_queries)
        klo = lo if window is None else max(lo, first + i - (window - 1))
        yield i, j, klo, first + j


def _joined(parts: list[torch.Tensor]) -> torch.Tensor:
    """Tiles' results along the query dimension (one tile, the usual case, is returned as it is)."""
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=2)


def _read(store: KeyStore, q, lo, hi, q_pos, q_doc, window):
    """SDPA of ``q`` over slots ``[lo, hi)``, tile by tile (:func:`_tiles`)."""
    return _joined([
        F.scaled_dot_product_attention(
            q[:, :, i:j], store.k[:, :, klo:khi], store.v[:, :, klo:khi],
            attn_mask=visibility(q_pos[:, i:j], q_doc[:, i:j], store.pos[:, klo:khi], store.doc[:, klo:khi], window))
        for i, j, klo, khi in _tiles(q.shape[2], lo, hi, window)])


def _save_read(ctx, q, store: KeyStore, lo, hi, q_pos, q_doc, window):
    ctx.save_for_backward(q, store.k, store.v, store.pos, store.doc, q_pos, q_doc)
    ctx.store, ctx.lo, ctx.hi, ctx.window = store, lo, hi, window
    ctx.autocast = autocast_of(q)


def _read_backward(ctx, d_out):
    """dq, and the span's dk/dv added into the store, from what the read saved.

    Written out rather than left to autograd (:func:`~rlt_scale.model.layers.attend_backward`):
    the scores are recomputed from the saved queries, then the four matmuls
    of the attention backward follow.
    """
    q, k_all, v_all, k_pos, k_doc, q_pos, q_doc = ctx.saved_tensors
    with autocast_as(q, ctx.autocast):  # the forward's precision (bf16 training)
        if ctx.autocast is not None:  # as autocast's SDPA saw them in forward
            q, d_out = q.to(ctx.autocast), d_out.to(ctx.autocast)
        dq = []
        for i, j, lo, hi in _tiles(q.shape[2], ctx.lo, ctx.hi, ctx.window):
            visible = visibility(q_pos[:, i:j], q_doc[:, i:j], k_pos[:, lo:hi], k_doc[:, lo:hi], ctx.window)
            dq_tile, dk, dv = attend_backward(q[:, :, i:j], k_all[:, :, lo:hi], v_all[:, :, lo:hi], visible,
                                              d_out[:, :, i:j])
            ctx.store.add_grad(lo, hi, dk, dv)
            dq.append(dq_tile)
        return _joined(dq)


class _Open(torch.autograd.Function):
    """Start of a store's link chain; backward hands the first ``n`` slots' gradients to ``k``/``v``."""

    @staticmethod
    def forward(ctx, k, v, store: KeyStore):
        ctx.store, ctx.n = store, k.shape[2]
        return k.new_empty(0)

    @staticmethod
    def backward(ctx, _):
        dk, dv = ctx.store.grad(0, ctx.n)  # the chain's last step: every reader has added its share
        ctx.store.free_grad()
        ctx.store = None
        return dk, dv, None


class _WriteAndAttend(torch.autograd.Function):
    """Write a segment's keys into slots ``[at, hi)`` and attend from its queries over ``[lo, hi)``."""

    @staticmethod
    def forward(ctx, q, k, v, link, store: KeyStore, lo, at, hi, q_pos, q_doc, window):
        store.write(at, hi, k, v)
        _save_read(ctx, q, store, lo, hi, q_pos, q_doc, window)
        ctx.at = at
        return _read(store, q, lo, hi, q_pos, q_doc, window), link.new_empty(0)

    @staticmethod
    def backward(ctx, d_out, _):
        dq = _read_backward(ctx, d_out)
        dk, dv = ctx.store.grad(ctx.at, ctx.hi)  # complete: every later reader ran backward first
        ctx.store = None
        return dq, dk, dv, None, None, None, None, None, None, None, None


class _Attend(torch.autograd.Function):
    """Attend from a segment's queries over slots ``[lo, hi)`` of a store that is only read."""

    @staticmethod
    def forward(ctx, q, link, store: KeyStore, lo, hi, q_pos, q_doc, window):
        _save_read(ctx, q, store, lo, hi, q_pos, q_doc, window)
        return _read(store, q, lo, hi, q_pos, q_doc, window)

    @staticmethod
    def backward(ctx, d_out):
        dq = _read_backward(ctx, d_out)
        ctx.store = None
        return dq, None, None, None, None, None, None, None


class _Tail(torch.autograd.Function):
    """Copies of the last ``n`` slots (the cache the next chunk carries); backward adds into them."""

    @staticmethod
    def forward(ctx, link, store: KeyStore, n):
        ctx.store, ctx.n = store, n
        end = store.k.shape[2]
        return store.k[:, :, end - n:].clone(), store.v[:, :, end - n:].clone()

    @staticmethod
    def backward(ctx, dk, dv):
        end = ctx.store.shape[2]
        ctx.store.add_grad(end - ctx.n, end, dk, dv)
        ctx.store = None
        return None, None, None


class WindowKeys:
    """A decoder layer's window for one chunk: the carried cache plus one slot per position, in place.

    ``pos``/``doc`` ``[B, P + S]`` cover the ``P`` carried entries and the
    chunk's ``S`` positions (the same for every layer). ``attend(q, k, v, a, b)``
    runs the chunk's positions ``[a, b)`` in order, each segment once;
    :meth:`close` returns the cache of at most ``W-1`` entries that the next
    chunk starts from.
    """

    def __init__(self, carried: KV, pos: torch.Tensor, doc: torch.Tensor, window: int):
        self.carried, self.pos, self.doc, self.window = carried, pos, doc, window
        self.offset = len(carried)
        self.store: Optional[KeyStore] = None
        self.link = None

    def open(self) -> None:
        """Allocate the store at the layer's first step (so profiles charge it to the layer)."""
        if self.store is None:
            self.store = KeyStore.for_chunk(self.carried, self.pos, self.doc)
            self.link = _Open.apply(self.carried.k, self.carried.v, self.store)

    def attend(self, q, k, v, a: int, b: int) -> torch.Tensor:
        self.open()
        at, hi = self.offset + a, self.offset + b
        lo = max(at - (self.window - 1), 0)
        q_pos, q_doc = self.pos[:, at:hi], self.doc[:, at:hi]
        out, self.link = _WriteAndAttend.apply(q, k, v, self.link, self.store, lo, at, hi, q_pos, q_doc, self.window)
        return out

    def close(self) -> KV:
        """The newest ``W-1`` entries as the next chunk's cache; the store itself is released."""
        store = self.store
        end = store.shape[2]
        n = min(self.window - 1, end)
        k, v = _Tail.apply(self.link, store, n)
        store.release()
        return KV(k, v, self.pos[:, end - n:], self.doc[:, end - n:])


class MemoryKeys:
    """The memory a chunk's cross-attention reads: segment ``[a, b)`` sees entries before ``offset + b``."""

    def __init__(self, memory: KV, offset: int, length: int):
        kv = memory.first(offset + length)
        self.store = KeyStore(kv.k, kv.v, kv.pos, kv.doc)
        self.offset = offset
        self.link = _Open.apply(kv.k, kv.v, self.store)

    def attend(self, q, q_pos, q_doc, a: int, b: int) -> torch.Tensor:
        return _Attend.apply(q, self.link, self.store, 0, self.offset + b, q_pos, q_doc, None)

    def close(self) -> None:
        self.store.release()
