"""Deferred weight gradients: one GEMM per weight over a block of decoder positions.

Why this exists. The decoder walks a chunk position by position, so autograd
forms every weight gradient of every decoder layer once per position: a
rank-B outer product (B sequences) written into a weight-sized buffer and
added to ``.grad``, T times per chunk. That is bound by memory bandwidth
(every position reads and writes the whole gradient), and each is two more
kernels per weight per position.

Here a :class:`WeightTape` runs a layer's five projections (the norm-then-
linear Q/K/V, window-attention output, cross-attention query and output, and
the SwiGLU feed-forward) with their weights held out of autograd's sight.
Forward writes each position's projection input into a block buffer, in
place (which is also all that backward needs: each buffer is what autograd
would have saved). Backward of a position forms only the input gradient and
writes the output gradient into the block's gradient buffer. When backward
has passed every position of a block, one node per block forms each weight
gradient as one GEMM over all its positions (``dY^T Y``, with ``Y``
recomputed from the buffer: the normalised input, or SwiGLU of the fused
gate/up) and hands it to autograd like any gradient, so ZeRO, DDP and tied
encoder weights see nothing different.

What backward keeps per position is also smaller than autograd's: the
residual and ``rstd`` of each RMSNorm, not its normalised and scaled outputs
as well; the fused gate/up of the SwiGLU, not its halves, ``silu(gate)`` and
the product. The order of backward is made explicit with links (empty
tensors), as in :mod:`rlt_scale.model.window`: the block's node comes first
in forward, so it runs last in backward.

Tensor parallelism keeps megatron-core's own mappings around the local GEMMs:
copy-to-region before a column projection, reduce-from-region after a row one.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.tensor_parallel import (
    copy_to_tensor_model_parallel_region,
    reduce_from_tensor_model_parallel_region,
)

from rlt_scale.model.layers import autocast_of, rms_norm_backward, rms_rstd

# Buffers a block writes in forward: the name, the projection whose weight gradient reads it.
NORMED = ("qkv", "cross_q", "gate_up")  # RMSNorm of the residual stream, then a column projection
PLAIN = ("out", "cross_out")  # an attention's merged output, then a row projection


def _silu_parts(gu: torch.Tensor):
    """``(gate, up)`` of a fused projection interleaved per unit (``[f, 2]``, see :mod:`blocks`)."""
    return gu[..., 0::2], gu[..., 1::2]


def swiglu_interleaved(gu: torch.Tensor) -> torch.Tensor:
    gate, up = _silu_parts(gu)
    return F.silu(gate) * up


def swiglu_interleaved_backward(dh: torch.Tensor, gu: torch.Tensor) -> torch.Tensor:
    """Gradient of the fused gate/up ``gu`` from the gradient ``dh`` of :func:`swiglu_interleaved`."""
    gate, up = _silu_parts(gu)
    sig = torch.sigmoid(gate)
    d_gate = dh * up * sig * (1 + gate * (1 - sig))
    d_up = dh * gate * sig
    return torch.stack((d_gate, d_up), dim=-1).flatten(-2)


class _Block:
    """One layer's buffers for positions ``[start, stop)`` of a chunk."""

    def __init__(self, tape: "WeightTape", start: int, stop: int, batch: int):
        self.start, self.n = start, stop - start
        # The residual stream in the parameters' dtype; projection outputs in the compute dtype (bf16
        # under autocast), as autograd would have saved them.
        residual, computed = tape.norm["qkv"], tape.weight["qkv"]
        self.x = {name: residual.new_empty(batch, self.n, tape.in_features[name]) for name in NORMED}
        self.x.update({name: computed.new_empty(batch, self.n, tape.in_features[name]) for name in PLAIN})
        self.rstd = {name: residual.new_empty(batch, self.n, 1) for name in NORMED}
        self.gu = computed.new_empty(batch, self.n, tape.in_features["down"])
        self.dy: dict[str, torch.Tensor] = {}  # output gradients, allocated in backward
        self.dnormed: dict[str, torch.Tensor] = {}  # gradients of each norm's output (for its weight)

    def saved(self) -> list[torch.Tensor]:
        return [*self.x.values(), *self.rstd.values(), self.gu]

    def release(self) -> None:
        """Drop the block's own references once forward has passed it; backward reads what nodes saved."""
        self.x = self.rstd = self.gu = None

    def put_grad(self, store: dict, name: str, i: int, j: int, g: torch.Tensor) -> None:
        if name not in store:
            store[name] = g.new_zeros(g.shape[0], self.n, g.shape[-1])
        store[name][:, i:j] = g


def _unpack(block_tensors: list[torch.Tensor]):
    n = len(NORMED) + len(PLAIN)
    x = dict(zip(NORMED + PLAIN, block_tensors[:n]))
    rstd = dict(zip(NORMED, block_tensors[n:n + len(NORMED)]))
    return x, rstd, block_tensors[-1]


class _Flush(torch.autograd.Function):
    """Start of a block's link chain; backward forms the block's weight gradients, one GEMM each."""

    @staticmethod
    def forward(ctx, tape: "WeightTape", block: _Block, *weights):
        ctx.save_for_backward(*block.saved())
        ctx.tape, ctx.block = tape, block
        return weights[0].new_empty(0)

    @staticmethod
    def backward(ctx, _):
        tape, block = ctx.tape, ctx.block
        x, rstd, gu = _unpack(list(ctx.saved_tensors))
        grads = weight_gradients(tape.weight, tape.norm, x, rstd, gu, block.dy, block.dnormed)
        block.dy, block.dnormed = {}, {}
        ctx.tape = ctx.block = None
        return (None, None, *(grads[name].to(p.dtype) if name in grads else None for name, p in tape.param.items()))


def weight_gradients(weight: dict, norm: dict, x: dict, rstd: dict, gu, dy: dict, dnormed: dict) -> dict:
    """A decoder layer's weight gradients over a block of positions, one GEMM per projection.

    ``weight``/``norm``: the projections' weights (compute dtype) and the
    RMSNorm weights; ``x``, ``rstd``, ``gu``: what forward kept for the block
    (``[B, n, ...]``); ``dy``/``dnormed``: each projection's output gradient
    and each norm's output gradient, by name (absent: no gradient). Each
    projection's input is recomputed: the normalised residual, the attention
    output, or SwiGLU of the fused gate/up. Returns gradients by parameter
    name (``"norm.<name>"`` for the norms), in the weights' own dtypes.
    """
    grads = {}

    def gemm(name: str, inputs: torch.Tensor) -> None:
        g = dy.get(name)
        if g is not None:
            grads[name] = g.flatten(0, 1).t() @ inputs.flatten(0, 1).to(weight[name].dtype)

    for name in NORMED:
        normalised = x[name] * rstd[name]
        gemm(name, normalised * norm[name])
        g = dnormed.get(name)
        if g is not None:
            grads["norm." + name] = (g * normalised).sum((0, 1)).to(norm[name].dtype)
    for name in PLAIN:
        gemm(name, x[name])
    gemm("down", swiglu_interleaved(gu))
    return grads


class _Norm(torch.autograd.Function):
    """RMSNorm of positions ``[i, j)`` of a block; keeps the input and ``rstd`` in the block's buffers."""

    @staticmethod
    def forward(ctx, x, link, tape: "WeightTape", block: _Block, name: str, i: int, j: int):
        rstd = rms_rstd(x, tape.eps)
        block.x[name].data[:, i:j] = x.detach()
        block.rstd[name].data[:, i:j] = rstd
        ctx.save_for_backward(block.x[name], block.rstd[name])
        ctx.tape, ctx.block, ctx.name, ctx.i, ctx.j = tape, block, name, i, j
        return x * rstd * tape.norm[ctx.name], link.new_empty(0)

    @staticmethod
    def backward(ctx, dy, _):
        x_all, rstd_all = ctx.saved_tensors
        x, rstd = x_all[:, ctx.i:ctx.j], rstd_all[:, ctx.i:ctx.j]
        ctx.block.put_grad(ctx.block.dnormed, ctx.name, ctx.i, ctx.j, dy)
        dx = rms_norm_backward(dy, x, rstd, ctx.tape.norm[ctx.name])
        ctx.tape = ctx.block = None
        return dx, None, None, None, None, None, None


class _Linear(torch.autograd.Function):
    """``y = h W^T`` for positions ``[i, j)``; backward forms ``dh`` and files ``dy`` for the block's GEMM.

    ``keep``: write ``h`` into the block's buffer (the attention outputs);
    the other inputs are recomputed from what their norm or SwiGLU kept.
    """

    @staticmethod
    def forward(ctx, h, link, tape: "WeightTape", block: _Block, name: str, i: int, j: int, keep: bool):
        if keep:
            block.x[name].data[:, i:j] = h.detach()
        w = tape.weight[name]
        ctx.tape, ctx.block, ctx.name, ctx.i, ctx.j, ctx.dtype = tape, block, name, i, j, h.dtype
        return F.linear(h.to(w.dtype), w), link.new_empty(0)

    @staticmethod
    def backward(ctx, dy, _):
        w = ctx.tape.weight[ctx.name]
        dy = dy.to(w.dtype)
        ctx.block.put_grad(ctx.block.dy, ctx.name, ctx.i, ctx.j, dy)
        dh = (dy @ w).to(ctx.dtype)
        ctx.tape = ctx.block = None
        return dh, None, None, None, None, None, None, None


class _SwiGLU(torch.autograd.Function):
    """SwiGLU of an interleaved gate/up for positions ``[i, j)``; keeps only ``gu`` (in the block)."""

    @staticmethod
    def forward(ctx, gu, link, block: _Block, i: int, j: int):
        block.gu.data[:, i:j] = gu.detach()
        ctx.save_for_backward(block.gu)
        ctx.i, ctx.j = i, j
        return swiglu_interleaved(gu), link.new_empty(0)

    @staticmethod
    def backward(ctx, dh, _):
        (gu_all,) = ctx.saved_tensors
        return swiglu_interleaved_backward(dh, gu_all[:, ctx.i:ctx.j].to(dh.dtype)), None, None, None, None


class WeightTape:
    """A decoder layer's projections over one chunk, their weight gradients deferred to blocks.

    ``blocks``: the chunk's ``[start, stop)`` cuts, each a run of whole
    segments. :meth:`seek` moves to segment ``[a, b)`` (in order); the
    projection methods then mirror :class:`~rlt_scale.model.blocks.DecoderLayer`'s own.
    """

    def __init__(self, layer, blocks: list[tuple[int, int]]):
        self.layer, self.blocks = layer, list(blocks)
        self.linear = {"qkv": layer.attn.qkv, "out": layer.attn.out, "cross_q": layer.cross_q,
                       "cross_out": layer.cross_out, "gate_up": layer.ffn.gate_up, "down": layer.ffn.down}
        norms = {"qkv": layer.norm_attn, "cross_q": layer.norm_cross, "gate_up": layer.norm_ffn}
        self.eps = layer.norm_attn.eps
        self.param = {name: lin.weight for name, lin in self.linear.items()}
        self.param.update({"norm." + name: norm.weight for name, norm in norms.items()})
        self.in_features = {name: lin.weight.shape[1] for name, lin in self.linear.items()}
        self.in_features["down"] *= 2  # the buffer holds the fused gate/up that SwiGLU reads
        self.parallel = layer.attn.qkv.parallel
        self.tp_group = layer.attn.qkv.layer.tp_group if self.parallel else None
        cast = autocast_of(layer.attn.qkv.weight)  # bf16 training: cast each weight once per chunk
        self.weight = {name: w.detach().to(cast or w.dtype) for name, w in self.param.items()
                       if not name.startswith("norm.")}
        self.norm = {name: norm.weight.detach() for name, norm in norms.items()}
        self.block: Optional[_Block] = None
        self.opening: Optional[tuple[int, int]] = None
        self.link = None
        self.next_block = 0
        self.i = self.j = 0

    def seek(self, a: int, b: int) -> "WeightTape":
        if self.next_block < len(self.blocks) and a == self.blocks[self.next_block][0]:
            self.opening = self.blocks[self.next_block]
            self.next_block += 1
        start = self.opening[0] if self.opening else self.block.start
        self.i, self.j = a - start, b - start
        return self

    def _open(self, batch: int) -> None:
        """Allocate the next block at its first projection (so profiles charge it to the layer)."""
        if self.block is not None:
            self.block.release()
        self.block = _Block(self, *self.opening, batch)
        self.opening = None
        self.link = _Flush.apply(self, self.block, *self.param.values())

    def close(self) -> None:
        if self.block is not None:
            self.block.release()
        self.block = None

    # ---------------------------------------------------------------- the math
    def _normed(self, name: str, z: torch.Tensor) -> torch.Tensor:
        if self.opening:
            self._open(z.shape[0])
        y, self.link = _Norm.apply(z, self.link, self, self.block, name, self.i, self.j)
        if self.parallel:
            y = copy_to_tensor_model_parallel_region(y, group=self.tp_group)
        return self._project(name, y, keep=False)

    def _project(self, name: str, h: torch.Tensor, keep: bool) -> torch.Tensor:
        y, self.link = _Linear.apply(h, self.link, self, self.block, name, self.i, self.j, keep)
        if self.parallel and name not in NORMED:
            y = reduce_from_tensor_model_parallel_region(y, group=self.tp_group)
        return y

    def project_qkv(self, z: torch.Tensor) -> torch.Tensor:
        return self._normed("qkv", z)

    def project_out(self, h: torch.Tensor) -> torch.Tensor:
        return self._project("out", h, keep=True)

    def project_cross_q(self, z: torch.Tensor) -> torch.Tensor:
        return self._normed("cross_q", z)

    def project_cross_out(self, h: torch.Tensor) -> torch.Tensor:
        return self._project("cross_out", h, keep=True)

    def feed_forward(self, z: torch.Tensor) -> torch.Tensor:
        gu = self._normed("gate_up", z)
        h, self.link = _SwiGLU.apply(gu, self.link, self.block, self.i, self.j)
        return self._project("down", h, keep=False)


def defers(block: int, n_segments: int) -> bool:
    """Whether a chunk of ``n_segments`` runs on tapes under ``model.decoder_wgrad_block=block``.

    Only where backward runs over more than one segment: for one segment (K=0,
    every position at once) autograd's GEMMs already span the chunk.
    """
    return bool(block) and n_segments > 1


def weight_blocks(segments: list[tuple[int, int]], size: int) -> list[tuple[int, int]]:
    """Cut a chunk's segments into blocks of whole segments, each at least ``size`` positions but the last."""
    blocks, start = [], segments[0][0]
    for _, b in segments:
        if b - start >= size:
            blocks.append((start, b))
            start = b
    if start < segments[-1][1]:
        blocks.append((start, segments[-1][1]))
    return blocks
