"""A decoder layer's step as one autograd node with static shapes: the math, forward and backward.

Why this exists. On the taped path (:mod:`rlt_scale.model.deferred`) one
decoder layer at one position is about a dozen autograd nodes and some
sixty small kernels, each launched on its own: at small batch the step is
bound by launches and host overhead, not by FLOPs. Here the whole step is
two pure functions, :func:`step_forward` and :func:`step_backward`, written
out by hand, whose tensors have the same shapes at every position:

* the window is read as a fixed span of ``W - 1 + s`` slots gathered by an
  index (slots before the store's start are clamped and masked), not as a
  slice that grows or shrinks at a chunk's edges;
* the memory is read whole (the chunk's ``offset + S`` entries), with the
  future hidden by the mask, not up to the segment's end;
* positions are tensors (indices), never Python ints, so a compiled step is
  traced once and serves every position.

Being pure (no writes into their inputs), both functions can run under
``torch.compile`` and, on CUDA, be captured as CUDA graphs (compile's
``reduce-overhead``): the writes into the key stores and the weight tape's
block buffers are done by the caller, :class:`FusedStep`, with one indexed
copy each. The numbers are the taped path's to rounding (float64 tests);
the memory read does more FLOPs (up to 2x of the memory attention in a
chunk's first positions), the price of one shape per chunk.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from typing import Callable

import torch
import torch._dynamo.config
import torch._inductor.config
import torch.nn.functional as F

from rlt_scale.model.blocks import _heads
from rlt_scale.model.deferred import (NORMED, PLAIN, WeightTape, _unpack, swiglu_interleaved,
                                      swiglu_interleaved_backward)
from rlt_scale.model.layers import (attend_backward, attention_probabilities, merge_heads, rms_norm_backward,
                                    rms_rstd, Rotary, visibility)
from rlt_scale.model.window import KeyStore, MemoryKeys, WindowKeys

_HIDDEN = torch.iinfo(torch.int64).max  # the position of a clamped window slot: never visible


def _unheads(parts, n_heads: int):
    """Inverse of :func:`_heads`: ``parts`` tensors ``[B, h, s, hd]`` -> ``[B, s, h*parts*hd]``."""
    x = torch.stack(parts, dim=0)  # [parts, B, h, s, hd]
    p, b, h, s, hd = x.shape
    return x.permute(1, 3, 2, 0, 4).reshape(b, s, h * p * hd)


def _window_span(at, s: int, window: int, pos, doc):
    """Slots ``at - (W-1) .. at + s - 1`` of a store (clamped at 0) and their positions/documents.

    A clamped slot gets a position no query sees, so the mask drops it.
    """
    idx = at - (window - 1) + torch.arange(window - 1 + s, device=pos.device)
    clamped = idx.clamp(min=0)
    span_pos = torch.where(idx >= 0, pos.index_select(1, clamped), _HIDDEN)
    return clamped, span_pos, doc.index_select(1, clamped)


def _attend(q, k, v, mask, cast):
    """Masked attention written out, so that a compiler fuses the mask and the softmax (CPU SDPA's
    flash kernel also spends much of its time tiling when there is a single query row)."""
    if cast is not None:
        q, k, v = q.to(cast), k.to(cast), v.to(cast)
    return attention_probabilities(q, k, mask) @ v


def _attend_backward(q, k, v, mask, d_out, cast):
    if cast is not None:  # as the forward saw them
        q = q.to(cast)
    return attend_backward(q, k, v, mask, d_out)


def step_forward(z, w: dict, norm: dict, eps: float, n_heads: int, window: int, tp_sum: Callable,
                 cos, sin, store_k, store_v, store_pos, store_doc, at,
                 mem_k, mem_v, mem_pos, mem_doc, q_pos, q_doc):
    """One decoder layer over positions ``[B, s]`` that share one feedback (DecoderLayer's math).

    ``w``: the projections' weights in the compute dtype; ``norm``: the
    three RMSNorm weights. ``store_*`` is the layer's key store, whose slot
    ``at`` (a tensor) is the segment's first; the segment's own keys are not
    in it yet and are joined to the span here. Returns the output and what
    the caller writes (keys, block buffers) and saves (queries).
    """
    cast = w["qkv"].dtype if w["qkv"].dtype != z.dtype else None
    s = z.shape[1]

    def project(name, h):
        return F.linear(h.to(w[name].dtype), w[name])

    def normed(name, x):
        rstd = rms_rstd(x, eps)
        return x * rstd * norm[name], rstd

    n1, rstd1 = normed("qkv", z)
    q, k, v = _heads(project("qkv", n1), n_heads, 3)
    rope = Rotary(cos, sin)
    q, k = rope(q), rope(k)
    # the span's last s slots are the segment's own: not yet in the store, joined here
    idx, span_pos, span_doc = _window_span(at, s, window, store_pos, store_doc)
    earlier = idx[: window - 1]
    span_k = torch.cat([store_k.index_select(2, earlier).to(k.dtype), k], dim=2)
    span_v = torch.cat([store_v.index_select(2, earlier).to(v.dtype), v], dim=2)
    h = merge_heads(_attend(q, span_k, span_v, visibility(q_pos, q_doc, span_pos, span_doc, window), cast))
    z1 = z + tp_sum(project("out", h))

    n2, rstd2 = normed("cross_q", z1)
    qc = rope(_heads(project("cross_q", n2), n_heads, 1)[0])
    hc = merge_heads(_attend(qc, mem_k, mem_v, visibility(q_pos, q_doc, mem_pos, mem_doc), cast))
    z2 = z1 + tp_sum(project("cross_out", hc))

    n3, rstd3 = normed("gate_up", z2)
    gu = project("gate_up", n3)
    z3 = z2 + tp_sum(project("down", swiglu_interleaved(gu)))
    keep = {"x": {"qkv": z, "cross_q": z1, "gate_up": z2, "out": h, "cross_out": hc},
            "rstd": {"qkv": rstd1, "cross_q": rstd2, "gate_up": rstd3}, "gu": gu}
    return z3, (k, v), keep, (q, qc)


def step_backward(dz, w: dict, norm: dict, n_heads: int, window: int, tp_sum: Callable,
                  cos, sin, store_k, store_v, store_pos, store_doc, at, own_dk, own_dv,
                  mem_k, mem_v, mem_pos, mem_doc, q_pos, q_doc, q, qc, x: dict, rstd: dict, gu):
    """Gradients of :func:`step_forward` with its weights held fixed (the tape forms theirs).

    ``own_dk``/``own_dv``: what later positions' reads left for the
    segment's own keys. ``x``/``rstd``/``gu`` are the segment's rows of the
    block buffers. Returns ``dz`` of the input, the gradients of the earlier
    window slots and of the memory, and each projection's output gradient
    (``dy``) and each norm's output gradient (``dnormed``) for the tape.
    """
    cast = w["qkv"].dtype if w["qkv"].dtype != dz.dtype else None
    s = dz.shape[1]
    dy, dnormed = {}, {}  # per projection, and per norm

    def back(name, g):  # the input gradient of a projection, after filing its output gradient
        g = g.to(w[name].dtype)
        dy[name] = g
        return g @ w[name]

    def norm_back(name, g, x_in):
        g = tp_sum(g.to(x_in.dtype))  # a column projection's input gradient is a partial sum over ranks
        dnormed[name] = g
        return rms_norm_backward(g, x_in, rstd[name], norm[name])

    # feed-forward
    d_h = back("down", dz)
    d_gu = swiglu_interleaved_backward(d_h, gu.to(d_h.dtype))
    dz2 = dz + norm_back("gate_up", back("gate_up", d_gu), x["gate_up"])

    # cross-attention over the memory
    d_hc = back("cross_out", dz2)
    d_oc = d_hc.view(*d_hc.shape[:2], n_heads, -1).transpose(1, 2)
    mask = visibility(q_pos, q_doc, mem_pos, mem_doc)
    dqc, d_mem_k, d_mem_v = _attend_backward(qc, mem_k, mem_v, mask, d_oc, cast)
    d_cq = merge_heads(Rotary(cos, -sin)(dqc))
    dz1 = dz2 + norm_back("cross_q", back("cross_q", d_cq), x["cross_q"])

    # window self-attention
    d_h = back("out", dz1)
    d_o = d_h.view(*d_h.shape[:2], n_heads, -1).transpose(1, 2)
    # the caller wrote the segment's own keys into the store after forward: the whole span is there
    idx, span_pos, span_doc = _window_span(at, s, window, store_pos, store_doc)
    span_k, span_v = store_k.index_select(2, idx), store_v.index_select(2, idx)
    dq, d_span_k, d_span_v = _attend_backward(q, span_k, span_v,
                                              visibility(q_pos, q_doc, span_pos, span_doc, window), d_o, cast)
    dk = own_dk + d_span_k[:, :, window - 1:].to(own_dk.dtype)  # summed in the store's dtype, as the store does
    dv = own_dv + d_span_v[:, :, window - 1:].to(own_dv.dtype)
    d_qkv = _unheads((Rotary(cos, -sin)(dq), Rotary(cos, -sin)(dk), dv), n_heads)
    dz0 = dz1 + norm_back("qkv", back("qkv", d_qkv), x["qkv"])
    earlier = (d_span_k[:, :, : window - 1], d_span_v[:, :, : window - 1])
    return dz0, earlier, (d_mem_k, d_mem_v), dy, dnormed


@functools.lru_cache(maxsize=None)
def step_functions(mode: str = "none", cache_dir: str = "") -> tuple[Callable, Callable]:
    """``(forward, backward)`` of the fused step: the functions themselves, or compiled (``mode``:
    ``default``, or ``reduce-overhead`` for CUDA graphs on CUDA), cached under ``cache_dir``.

    Shapes are the same at every position of a chunk. What changes between chunks (the memory's
    length, a last chunk's, the strides of inputs that are slices of longer tensors) and feedback
    blocks cut short at document starts are a few more graphs, all compiled in the first
    training step: compile's automatic dynamic shapes take over after the first change. One
    compiled pair serves every model in the process.
    """
    if mode == "none":
        return step_forward, step_backward
    if cache_dir:  # inductor looks the directory up in the environment whenever it reads or writes
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache_dir)
    torch._inductor.config.fx_graph_cache = True  # the persistent cache (on by default; made explicit)
    # past the limit dynamo would quietly run a function eagerly; a handful of graphs per shape class
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    options = dict(mode=None if mode == "default" else mode, fullgraph=True)
    return torch.compile(step_forward, **options), torch.compile(step_backward, **options)


class _Step(torch.autograd.Function):
    """One layer over one segment ``[a, b)``; links order backward as in :mod:`~rlt_scale.model.window`."""

    @staticmethod
    def forward(ctx, z, window_link, tape_link, memory_link, step: "FusedStep", a: int, b: int):
        out, saved, ctx.job = step.forward(z, a, b)
        ctx.save_for_backward(*saved)
        return out, window_link.new_empty(0), tape_link.new_empty(0)

    @staticmethod
    def backward(ctx, dz, _window, _tape):
        dz = ctx.job.run(dz, ctx.saved_tensors)  # unpacked once: checkpointing allows no second time
        ctx.job = None
        return dz, None, None, None, None, None, None


@dataclass
class _BackwardJob:
    """What one step's backward needs besides its saved tensors: no tensor of its own, so that
    chunk checkpointing, which drops and rebuilds saved tensors, frees everything a step keeps."""

    backward: Callable  # step_backward, or its compiled version
    n_heads: int
    window: int
    tp_sum: Callable
    tape: WeightTape
    store: KeyStore
    memory: KeyStore
    block: object
    rows: tuple[int, int]  # the segment's rows of the tape's block
    a: int  # the segment's first position in the chunk
    at: int  # and its slot in the store
    s: int  # its length

    def run(self, dz, saved):
        i, j = self.rows
        at, end, store, block = self.at, self.at + self.s, self.store, self.block
        q, qc, cos, sin, slots, store_k, store_v, store_pos, store_doc, *memory = saved[:13]
        x, rstd, gu = _unpack(list(saved[13:]))
        store.ensure_grad()
        own_dk, own_dv = store.grad(at, end)  # complete: later readers ran backward first
        with torch.autocast(dz.device.type, enabled=False):
            dz0, (dk, dv), (dmk, dmv), dy, dnormed = self.backward(
                dz, self.tape.weight, self.tape.norm, self.n_heads, self.window, self.tp_sum,
                cos[:, :, self.a:self.a + self.s], sin[:, :, self.a:self.a + self.s], store_k, store_v,
                store_pos, store_doc, slots[at], own_dk, own_dv, *memory,
                store_pos[:, at:end], store_doc[:, at:end], q, qc,
                {name: t[:, i:j] for name, t in x.items()}, {name: t[:, i:j] for name, t in rstd.items()},
                gu[:, i:j])
        # the earlier slots' span, less the slots clamped at the store's start (their gradients are 0)
        lo = at - (self.window - 1)
        skip = max(-lo, 0)
        store.add_grad(lo + skip, at, dk[:, :, skip:], dv[:, :, skip:])
        self.memory.add_grad(0, dmk.shape[2], dmk, dmv)
        for name, g in dy.items():
            block.put_grad(block.dy, name, i, j, g)
        for name, g in dnormed.items():
            block.put_grad(block.dnormed, name, i, j, g)
        return dz0


class FusedStep:
    """A decoder layer's walk over one chunk, one :class:`_Step` node per segment.

    Drives the same stores and tape as the layer-by-layer path: the window's
    :class:`~rlt_scale.model.window.KeyStore` (written in place), the
    memory's, and the :class:`~rlt_scale.model.deferred.WeightTape`'s block
    buffers, whose weight-gradient GEMMs run as before.
    """

    def __init__(self, layer, window: WindowKeys, read: MemoryKeys, tape: WeightTape, cos, sin,
                 slots, tp_sum: Callable, functions: tuple[Callable, Callable]):
        self.window, self.read, self.tape = window, read, tape
        self.run_forward, self.run_backward = functions
        self.n_heads, self.size = layer.n_heads, layer.window
        self.cos, self.sin, self.tp_sum = cos, sin, tp_sum
        self.slots = slots  # every slot's index, so that a step's position is data, not a constant

    def __call__(self, z, a: int, b: int):
        window, tape = self.window, self.tape
        window.open()
        tape.enter(a, b, z.shape[0])
        out, window.link, tape.link = _Step.apply(z, window.link, tape.link, self.read.link, self, a, b)
        return out

    def forward(self, z, a: int, b: int):
        store, memory, tape, block = self.window.store, self.read.store, self.tape, self.tape.block
        at, s = self.window.offset + a, b - a
        with torch.autocast(z.device.type, enabled=False):  # the math casts explicitly, as autocast would
            out, (k, v), keep, (q, qc) = self.run_forward(
                z, tape.weight, tape.norm, tape.eps, self.n_heads, self.size, self.tp_sum,
                self.cos[:, :, a:b], self.sin[:, :, a:b], store.k, store.v, store.pos, store.doc, self.slots[at],
                memory.k, memory.v, memory.pos, memory.doc, store.pos[:, at:at + s], store.doc[:, at:at + s])
        store.write(at, at + s, k, v)
        i, j = tape.i, tape.j
        for name in NORMED + PLAIN:
            block.x[name].data[:, i:j] = keep["x"][name]
        for name in NORMED:
            block.rstd[name].data[:, i:j] = keep["rstd"][name]
        block.gu.data[:, i:j] = keep["gu"]
        saved = [q, qc, self.cos, self.sin, self.slots, store.k, store.v, store.pos, store.doc,
                 memory.k, memory.v, memory.pos, memory.doc, *block.saved()]
        job = _BackwardJob(self.run_backward, self.n_heads, self.size, self.tp_sum, tape, store, memory, block,
                           (i, j), a, at, s)
        return out, saved, job
