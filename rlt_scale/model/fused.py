"""The decoder's step as two pure functions: one segment through the merge and every decoder layer.

Why this exists. Run as modules, one decoder position is the merge plus, per
layer, about a dozen autograd nodes and some sixty small kernels, each
launched on its own: at small batch the recurrent step is bound by launches
and host overhead, not by FLOPs. Here the whole step -- merge, every layer,
the carry -- is one function, :func:`segment_forward`, and its backward is
another, :func:`segment_backward`, written out by hand. Their tensors have
the same shapes at every position of a chunk:

* the window is read as a fixed span of ``W - 1 + s`` slots gathered by an
  index (slots before the store's start are clamped and masked), not as a
  slice that grows or shrinks at a chunk's edges;
* the memory is read whole (the chunk's ``offset + S`` entries), with the
  future hidden by the mask, not up to the segment's end;
* positions are tensors (indices), never Python ints, so a compiled step is
  traced once and serves every position.

Being pure (no writes into their inputs), both functions can run under
``torch.compile`` and, on CUDA, be captured as CUDA graphs (compile's
``reduce-overhead``). The caller (:mod:`rlt_scale.model.walk`) writes what
they return into the chunk's buffers and forms, once per block of positions,
what the step leaves out: every weight gradient (one GEMM per weight,
:func:`~rlt_scale.model.deferred.weight_gradients`) and the memory's key and
value gradients (:func:`memory_gradients`). So a step's backward reads the
memory as its forward does, and writes nothing memory-sized.

What a step keeps for backward is two rows per layer and position: the
residual-stream row ``[z | z1 | z2 | rstd x 3]`` and the projection row
``[h | hc | gu | q | qc]`` (:class:`Rows`), plus the feedback it read. The
numbers are the layer path's to rounding (float64 tests).
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
from rlt_scale.model.deferred import swiglu_interleaved, swiglu_interleaved_backward
from rlt_scale.model.layers import (attend_backward, attention_probabilities, attention_score_grads, merge_heads,
                                    rms_norm_backward, rms_rstd, Rotary, visibility)

_HIDDEN = torch.iinfo(torch.int64).max  # the position of a clamped window slot: never visible
PROJECTIONS = ("qkv", "out", "cross_q", "cross_out", "gate_up", "down")
NORMS = ("qkv", "cross_q", "gate_up")  # the RMSNorm in front of each column projection, by its projection


@dataclass(frozen=True)
class StepShape:
    """What is fixed for a whole walk: the constants the step functions are specialised on."""

    n_heads: int  # local heads
    head_dim: int
    window: int
    eps: float
    feedback_block: int
    groups: tuple[int, ...]  # the memory group each decoder layer reads
    d_model: int
    ffn: int  # local SwiGLU units
    tp_sum: Callable  # sum over the tensor-parallel group (identity on one rank)

    @property
    def local(self) -> int:
        return self.n_heads * self.head_dim


class Rows:
    """Column layouts of the per-position rows a layer keeps (forward) and files (backward).

    ``resid`` ``[z | z1 | z2 | rstd1 | rstd2 | rstd3]`` in the residual
    stream's dtype; ``proj`` ``[h | hc | gu | q | qc]`` in the compute dtype;
    ``dy`` the six projections' output gradients and the cross-attention's
    output gradient ``d_oc``; ``dnormed`` the three norms' output gradients.
    """

    def __init__(self, shape: StepShape):
        d, dl, f = shape.d_model, shape.local, shape.ffn
        self.resid = _layout(z=d, z1=d, z2=d, rstd1=1, rstd2=1, rstd3=1)
        self.proj = _layout(h=dl, hc=dl, gu=2 * f, q=dl, qc=dl)
        self.dy = _layout(qkv=3 * dl, out=d, cross_q=dl, cross_out=d, gate_up=2 * f, down=d, d_oc=dl)
        self.dnormed = _layout(qkv=d, cross_q=d, gate_up=d)

    @staticmethod
    def width(layout: dict) -> int:
        return max(stop for _, stop in layout.values())

    @staticmethod
    def split(row: torch.Tensor, layout: dict) -> dict:
        return {name: row[..., a:b] for name, (a, b) in layout.items()}


def _layout(**widths) -> dict:
    out, at = {}, 0
    for name, n in widths.items():
        out[name] = (at, at + n)
        at += n
    return out


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


def _cast_of(w: dict, z: torch.Tensor):
    return w["qkv"].dtype if w["qkv"].dtype != z.dtype else None


def _project(w, h):
    return F.linear(h.to(w.dtype), w)


def _normed(x, weight, eps):
    rstd = rms_rstd(x, eps)
    return x * rstd * weight, rstd


def _unheads(parts, n_heads: int):
    """Inverse of :func:`_heads`: ``parts`` tensors ``[B, h, s, hd]`` -> ``[B, s, h*parts*hd]``."""
    x = torch.stack(parts, dim=0)  # [parts, B, h, s, hd]
    p, b, h, s, hd = x.shape
    return x.permute(1, 3, 2, 0, 4).reshape(b, s, h * p * hd)


def _split_heads(x, n_heads: int):
    return x.view(*x.shape[:2], n_heads, -1).transpose(1, 2)


# ------------------------------------------------------------------ one layer
def layer_forward(z, w: dict, norm: dict, c: StepShape, cos, sin, store_k, store_v, key_pos, key_doc, at,
                  mem_k, mem_v, mem_pos, mem_doc, q_pos, q_doc):
    """One decoder layer over positions ``[B, s]`` that share one feedback (DecoderLayer's math).

    ``w``: the projections' weights in the compute dtype; ``norm``: the three
    RMSNorm weights. ``store_*`` is the layer's key store, whose slot ``at``
    (a tensor) is the segment's first; the segment's own keys are not in it
    yet and are joined to the span here. Returns the output, the segment's
    keys and values (for the caller to write) and the two rows it keeps.
    """
    cast = _cast_of(w, z)
    s = z.shape[1]
    n1, rstd1 = _normed(z, norm["qkv"], c.eps)
    q, k, v = _heads(_project(w["qkv"], n1), c.n_heads, 3)
    rope = Rotary(cos, sin)
    q, k = rope(q), rope(k)
    idx, span_pos, span_doc = _window_span(at, s, c.window, key_pos, key_doc)
    earlier = idx[: c.window - 1]
    span_k = torch.cat([store_k.index_select(2, earlier).to(k.dtype), k], dim=2)
    span_v = torch.cat([store_v.index_select(2, earlier).to(v.dtype), v], dim=2)
    h = merge_heads(_attend(q, span_k, span_v, visibility(q_pos, q_doc, span_pos, span_doc, c.window), cast))
    z1 = z + c.tp_sum(_project(w["out"], h))

    n2, rstd2 = _normed(z1, norm["cross_q"], c.eps)
    qc = rope(_heads(_project(w["cross_q"], n2), c.n_heads, 1)[0])
    hc = merge_heads(_attend(qc, mem_k, mem_v, visibility(q_pos, q_doc, mem_pos, mem_doc), cast))
    z2 = z1 + c.tp_sum(_project(w["cross_out"], hc))

    n3, rstd3 = _normed(z2, norm["gate_up"], c.eps)
    gu = _project(w["gate_up"], n3)
    z3 = z2 + c.tp_sum(_project(w["down"], swiglu_interleaved(gu)))
    dt = gu.dtype  # the compute dtype; the backward reads q and qc only in it (as the attention did)
    resid = torch.cat([z, z1, z2, rstd1, rstd2, rstd3], dim=-1)
    proj = torch.cat([h.to(dt), hc.to(dt), gu, merge_heads(q).to(dt), merge_heads(qc).to(dt)], dim=-1)
    return z3, k, v, resid, proj


def layer_backward(dz, w: dict, norm: dict, c: StepShape, rows: Rows, cos, sin, store_k, store_v, key_pos,
                   key_doc, at, own_dk, own_dv, mem_k, mem_v, mem_pos, mem_doc, q_pos, q_doc, resid, proj):
    """Gradients of :func:`layer_forward` with its weights and the memory held fixed (the caller forms theirs).

    ``own_dk``/``own_dv``: what later positions' reads left for the
    segment's own keys. Returns ``dz`` of the input, the gradients of the
    ``W-1`` earlier window slots, and the rows the caller files for the
    deferred GEMMs: each projection's output gradient (and the
    cross-attention's output gradient), and each norm's output gradient.
    """
    s = dz.shape[1]
    x, p = Rows.split(resid, rows.resid), Rows.split(proj, rows.proj)
    rstd = {"qkv": x["rstd1"], "cross_q": x["rstd2"], "gate_up": x["rstd3"]}
    inputs = {"qkv": x["z"], "cross_q": x["z1"], "gate_up": x["z2"]}
    dy, dnormed = {}, {}

    def back(name, g):  # the input gradient of a projection, after filing its output gradient
        g = g.to(w[name].dtype)
        dy[name] = g
        return g @ w[name]

    def norm_back(name, g):
        x_in = inputs[name]
        g = c.tp_sum(g.to(x_in.dtype))  # a column projection's input gradient is a partial sum over ranks
        dnormed[name] = g
        return rms_norm_backward(g, x_in, rstd[name], norm[name])

    unrotate = Rotary(cos, -sin)
    # feed-forward
    d_h = back("down", dz)
    dz2 = dz + norm_back("gate_up", back("gate_up", swiglu_interleaved_backward(d_h, p["gu"].to(d_h.dtype))))

    # cross-attention over the memory: only the query's gradient here; the memory's are deferred
    d_hc = back("cross_out", dz2)
    qc = _split_heads(p["qc"], c.n_heads)
    _, ds = attention_score_grads(qc, mem_k, mem_v, visibility(q_pos, q_doc, mem_pos, mem_doc),
                                  _split_heads(d_hc, c.n_heads))
    dqc = ds @ mem_k.to(ds.dtype)
    dz1 = dz2 + norm_back("cross_q", back("cross_q", merge_heads(unrotate(dqc))))

    # window self-attention; the caller wrote the segment's own keys after forward: the whole span is there
    d_o = _split_heads(back("out", dz1), c.n_heads)
    idx, span_pos, span_doc = _window_span(at, s, c.window, key_pos, key_doc)
    # q is kept in the compute dtype, so the keys and values are read in it, as the forward's attention did
    dq, d_span_k, d_span_v = attend_backward(_split_heads(p["q"], c.n_heads), store_k.index_select(2, idx),
                                             store_v.index_select(2, idx),
                                             visibility(q_pos, q_doc, span_pos, span_doc, c.window), d_o)
    dk = own_dk + d_span_k[:, :, c.window - 1:].to(own_dk.dtype)  # summed in the store's dtype, as the store does
    dv = own_dv + d_span_v[:, :, c.window - 1:].to(own_dv.dtype)
    d_qkv = _unheads((unrotate(dq), unrotate(dk), dv), c.n_heads)
    dz0 = dz1 + norm_back("qkv", back("qkv", d_qkv))
    dt = dy["qkv"].dtype
    dy_row = torch.cat([dy[name].to(dt) for name in PROJECTIONS] + [d_hc.to(dt)], dim=-1)
    dn_row = torch.cat([dnormed[name] for name in NORMS], dim=-1)
    return dz0, d_span_k[:, :, : c.window - 1], d_span_v[:, :, : c.window - 1], dy_row, dn_row


# ------------------------------------------------------------ the merge and carry
def _merge_parts(e, feedback, m: dict, eps: float):
    """``(r, rstd, g, ws_r)`` of FeedbackMerge: ``r = RMSNorm(s)``, ``g = sigmoid(Wg [e ; r] + bg)``, ``Ws r``."""
    d = e.shape[-1]
    rstd = rms_rstd(feedback, eps)
    r = feedback * rstd * m["norm"]
    gate = m["gate"]
    pre = F.linear(e.to(gate.dtype), gate[:, :d]) + F.linear(r.to(gate.dtype), gate[:, d:])[:, None] + m["bias"]
    return r, rstd, torch.sigmoid(pre), F.linear(r.to(m["proj"].dtype), m["proj"])


def segment_forward(e, carried, seg_pos, merge: dict, layers: list, c: StepShape, cos, sin, stores: list,
                    key_pos, key_doc, at, memory: list, mem_pos, mem_doc, seg_doc):
    """The merge, every decoder layer and the carry over one segment ``[B, s]``.

    ``layers``: per layer ``(weights, norms)``; ``stores``: per layer its
    ``(k, v)`` store; ``memory``: per group ``(k, v)``. Returns the output
    ``z`` ``[B, s, d]``, the ``s`` the segment leaves, the feedback it read,
    and per layer its keys, values and two rows.
    """
    feedback = torch.where(seg_pos[:, :1] == 0, merge["s_star"], carried)  # a document start reads s*
    _, _, g, ws_r = _merge_parts(e, feedback, merge, c.eps)
    z = e + merge["scale"] * g * ws_r[:, None]
    out = []
    for (w, norm), (store_k, store_v), group in zip(layers, stores, c.groups):
        mem_k, mem_v = memory[group]
        z, k, v, resid, proj = layer_forward(z, w, norm, c, cos, sin, store_k, store_v, key_pos, key_doc, at,
                                             mem_k, mem_v, mem_pos, mem_doc, seg_pos, seg_doc)
        out.append((k, v, resid, proj))
    block_end = ((seg_pos[:, -1:] + 1) % c.feedback_block) == 0
    return z, torch.where(block_end, z[:, -1], feedback), feedback, out


def segment_backward(dz, ds_next, e, feedback, seg_pos, merge: dict, layers: list, c: StepShape, rows: Rows,
                     cos, sin, stores: list, key_pos, key_doc, at, own: list, memory: list, mem_pos, mem_doc,
                     seg_doc, kept: list):
    """Gradients of :func:`segment_forward` with weights and memory held fixed.

    ``dz``: the gradient of the segment's outputs (from the readout);
    ``ds_next``: of the ``s`` it leaves; ``own``: per layer what later reads
    left for its keys; ``kept``: per layer the ``(resid, proj)`` rows. Returns
    the gradient of ``e`` and of the carried ``s``; per layer the earlier
    window slots' gradients and the two backward rows; the merge's row
    ``[da | du * g]`` for its deferred GEMMs; and the segment's share of the
    gradients that are sums over segments, as one vector
    ``[d s* | d RMSNorm_s.weight | d scale]`` for the caller to add up.
    """
    block_end = ((seg_pos[:, -1:] + 1) % c.feedback_block) == 0
    dz = torch.cat([dz[:, :-1], dz[:, -1:] + torch.where(block_end, ds_next, 0)[:, None]], dim=1)
    d_feedback = torch.where(block_end, 0, ds_next)
    out = []
    for (w, norm), (store_k, store_v), (own_dk, own_dv), (resid, proj), group in reversed(
            list(zip(layers, stores, own, kept, c.groups))):
        mem_k, mem_v = memory[group]
        dz, dk, dv, dy, dn = layer_backward(dz, w, norm, c, rows, cos, sin, store_k, store_v, key_pos, key_doc, at,
                                            own_dk, own_dv, mem_k, mem_v, mem_pos, mem_doc, seg_pos, seg_doc,
                                            resid, proj)
        out.append((dk, dv, dy, dn))
    out.reverse()
    # the merge: u = e + scale * g * (Ws r), g = sigmoid(Wg [e ; r] + bg), r = RMSNorm(feedback)
    d = e.shape[-1]
    r, rstd, g, ws_r = _merge_parts(e, feedback, merge, c.eps)
    gate, proj, scale = merge["gate"], merge["proj"], merge["scale"]
    du = dz
    dug = du * g
    da = scale * du * ws_r[:, None] * g * (1 - g)  # the gradient of the gate's pre-activation
    de = du + (da.to(gate.dtype) @ gate[:, :d]).to(du.dtype)
    dr = (da.sum(1).to(gate.dtype) @ gate[:, d:] + (scale * dug.sum(1)).to(gate.dtype) @ proj).to(feedback.dtype)
    d_feedback = d_feedback + rms_norm_backward(dr, feedback, rstd, merge["norm"])
    reset = seg_pos[:, :1] == 0  # a document start read s*, not the carried s
    sums = torch.cat([torch.where(reset, d_feedback, 0).sum(0), (dr * feedback * rstd).sum(0),
                      (dug * ws_r[:, None]).sum().to(feedback.dtype)[None]])
    dt = gate.dtype
    return de, torch.where(reset, 0, d_feedback), sums, out, torch.cat([da.to(dt), dug.to(dt)], dim=-1)


def merge_gradients(merge: dict, e, feedback, merge_rows, eps: float) -> dict:
    """The merge's weight gradients over a block of positions, one GEMM each (``[B, n, ...]`` rows):
    ``gate.weight`` from ``da^T [e ; r]``, ``gate.bias``, and ``proj.weight`` from ``scale (du g)^T r``."""
    d = e.shape[-1]
    flat = lambda t: t.flatten(0, 1)  # noqa: E731
    da, dug = flat(merge_rows[..., :d]), flat(merge_rows[..., d:])
    r = flat(feedback * rms_rstd(feedback, eps) * merge["norm"])
    gate, proj = merge["gate"], merge["proj"]
    return {"gate.weight": da.t() @ torch.cat([flat(e), r], dim=-1).to(gate.dtype),
            "gate.bias": da.sum(0),
            "proj.weight": merge["scale"] * (dug.t() @ r.to(proj.dtype))}


def memory_gradients(qc, d_oc, mem_k, mem_v, mask):
    """The memory's key and value gradients from a block of cross-attention reads, two GEMMs each.

    ``qc``/``d_oc`` ``[B, h, n, hd]``: the block's queries and output
    gradients, in the compute dtype (the memory is read in it, as the
    forward's attention did); ``mask`` ``[B, 1, n, M]``: what each query saw.
    The scores are recomputed for the whole block at once, which costs two
    more GEMMs than forming them at every position but reads and writes the
    memory once per block instead of once per position.
    """
    p, ds = attention_score_grads(qc, mem_k, mem_v, mask, d_oc)
    return ds.transpose(-1, -2) @ qc, p.transpose(-1, -2) @ d_oc.to(qc.dtype)


@functools.lru_cache(maxsize=None)
def step_functions(mode: str = "none", cache_dir: str = "") -> tuple[Callable, Callable]:
    """``(forward, backward)`` of the step: the functions themselves, or compiled (``mode``:
    ``default``, or ``reduce-overhead`` for CUDA graphs on CUDA), cached under ``cache_dir``.

    Shapes are the same at every position of a chunk. What changes between chunks (the memory's
    length, a last chunk's, the strides of inputs that are slices of longer tensors) and feedback
    blocks cut short at document starts are a few more graphs, all compiled in the first
    training step: compile's automatic dynamic shapes take over after the first change. One
    compiled pair serves every model in the process.
    """
    if mode == "none":
        return segment_forward, segment_backward
    if cache_dir:  # inductor looks the directory up in the environment whenever it reads or writes
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.abspath(cache_dir)
    torch._inductor.config.fx_graph_cache = True  # the persistent cache (on by default; made explicit)
    # past the limit dynamo would quietly run a function eagerly; a handful of graphs per shape class
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
    # ``default`` also generates the graph's wrapper in C++: a step is a few dozen small kernels, and
    # their Python launch code costs as much as they do at small batch (tiny model: 0.67 s -> 0.48 s a
    # training step). CUDA graphs (``reduce-overhead``) replay without the wrapper anyway.
    options = dict(options={"cpp_wrapper": True}) if mode == "default" else dict(mode=mode)
    return (torch.compile(segment_forward, fullgraph=True, **options),
            torch.compile(segment_backward, fullgraph=True, **options))
