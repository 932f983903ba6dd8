"""The RLT's layers: attention weights, SwiGLU, encoder block, memory, merge, decoder layer.

Heads (and FFN units) are laid out so that a column-parallel split keeps
whole heads on a rank: fused projections are interleaved per head
(``[h, 3, hd]`` for Q/K/V, ``[h, 2, hd]`` for memory K/V, ``[f, 2]`` for
SwiGLU gate/up) rather than concatenated.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from rlt_scale.config import ModelConfig
from rlt_scale.model.attention import AttentionPlan, document_attention
from rlt_scale.model.layers import RMSNorm, Rotary, attend, merge_heads, swiglu, visibility
from rlt_scale.model.state import KV
from rlt_scale.model.tp import TensorParallel


def _heads(x: torch.Tensor, n_heads: int, parts: int) -> tuple[torch.Tensor, ...]:
    """``[B, S, h*parts*hd]`` interleaved per head -> ``parts`` tensors ``[B, h, S, hd]``."""
    b, s, _ = x.shape
    x = x.view(b, s, n_heads, parts, -1).permute(3, 0, 2, 1, 4)
    return tuple(x.unbind(0))


class Attention(nn.Module):
    """Q/K/V/O projections of a self-attention.

    Holds weights only: the encoder uses them causally, the decoder with a
    sliding window. With ``tie_layers`` one instance serves both.
    """

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.n_heads = tp.local(cfg.n_heads, "model.n_heads")
        self.qkv = tp.column(cfg.d_model, 3 * cfg.d_model)
        self.out = tp.row(cfg.d_model, cfg.d_model)

    def forward(self, x: torch.Tensor, rope: Rotary, pos, doc, past: KV, window: Optional[int],
                plan: Optional[AttentionPlan] = None):
        """Attend from ``x`` over ``past`` plus ``x``'s own keys; returns (output, all keys).

        Without a past (training, a prompt) every position is a query:
        :func:`document_attention` runs it in memory linear in the length
        (``plan``: its tiling for these positions, when the caller made it once for all layers).
        With a past (generation: a few new positions) the mask is only
        ``S × (past + S)``, and building it reads nothing on the host.
        """
        q, k, v = _heads(self.qkv(x), self.n_heads, 3)
        has_past = len(past) > 0  # asked before ``cat``, which may grow ``past`` in place
        q, keys = rope(q), past.cat(KV(rope(k), v, pos, doc))
        if has_past:
            out = attend(q, keys.k, keys.v, visibility(pos, doc, keys.pos, keys.doc, window))
        else:
            out = document_attention(q, keys.k, keys.v, pos, doc, keys.pos, keys.doc, window, plan=plan)
        return self.out(merge_heads(out)), keys


class FeedForward(nn.Module):
    """SwiGLU: ``W2 (silu(W1 x) * (W3 x))``, ``W1``/``W3`` fused and interleaved."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.gate_up = tp.column(cfg.d_model, 2 * cfg.ffn_size)
        self.down = tp.row(cfg.ffn_size, cfg.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gu = self.gate_up(x)
        gu = gu.view(*gu.shape[:-1], -1, 2).transpose(-1, -2).flatten(-2)
        return self.down(swiglu(gu))


class EncoderBlock(nn.Module):
    """Pre-norm causal block: x + attn(norm(x)); x + ffn(norm(x))."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.window = cfg.encoder_window or None
        self.norm_attn = RMSNorm(cfg.d_model, cfg.norm_eps, tp.dtype)
        self.attn = Attention(cfg, tp)
        self.norm_ffn = RMSNorm(cfg.d_model, cfg.norm_eps, tp.dtype)
        self.ffn = FeedForward(cfg, tp)

    def forward(self, x, rope: Rotary, pos, doc, past: KV, plan: Optional[AttentionPlan] = None):
        a, keys = self.attn(self.norm_attn(x), rope, pos, doc, past, window=self.window, plan=plan)
        x = x + a
        return x + self.ffn(self.norm_ffn(x)), keys


class MemoryProjection(nn.Module):
    """One memory group: ``k = rope(Wk RMSNorm(e), t)``, ``v = Wv RMSNorm(e)``."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.n_heads = tp.local(cfg.n_heads, "model.n_heads")
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, tp.dtype)
        self.kv = tp.column(cfg.d_model, 2 * cfg.d_model)

    def forward(self, e: torch.Tensor, rope: Rotary, pos, doc) -> KV:
        k, v = _heads(self.kv(self.norm(e)), self.n_heads, 2)
        # v laid out [B, h, T, hd] once: as a view of the interleaved k|v output, every batched matmul
        # over (B, h) that reads it (each decoder position's) would copy it first
        return KV(rope(k), v.contiguous(), pos, doc)


class FeedbackMerge(nn.Module):
    """Gated additive merge of the encoder output with the fed-back state.

    ``r = RMSNorm(s)``, ``g = sigmoid(Wg [e ; r] + bg)``, ``u = e + alpha * g * (Ws r)``.
    Small and replicated on every tensor-parallel rank.
    """

    def __init__(self, cfg: ModelConfig, dtype: torch.dtype):
        super().__init__()
        d = cfg.d_model
        self.norm = RMSNorm(d, cfg.norm_eps, dtype)
        self.gate = nn.Linear(2 * d, d, bias=True, dtype=dtype)
        self.proj = nn.Linear(d, d, bias=False, dtype=dtype)
        self.initial_state = nn.Parameter(torch.empty(d, dtype=dtype))
        scale = torch.tensor(cfg.feedback_scale, dtype=dtype)
        if cfg.learn_feedback_scale:
            self.scale = nn.Parameter(scale)
        else:
            self.register_buffer("scale", scale)
        for w in (self.gate.weight, self.proj.weight, self.initial_state):
            nn.init.normal_(w, std=cfg.init_std)
        nn.init.zeros_(self.gate.bias)

    def forward(self, e: torch.Tensor, s: torch.Tensor, run=None) -> torch.Tensor:
        """``e`` ``[B, S, d]``; ``s`` ``[B, d]`` is shared by the S positions.

        ``s`` may also be ``[B, S, d]``, one feedback per position: the
        parallel-in-time solver (:mod:`rlt_scale.training.jacobi`) merges
        every position of a chunk with its own guess at once. ``run()``, if
        given, runs instead, inside this module's call (as in :meth:`DecoderLayer.forward`).
        """
        if run is not None:
            return run()
        r = self.norm(s)
        r = r[:, None].expand_as(e) if s.dim() == 2 else r
        g = torch.sigmoid(self.gate(torch.cat([e, r], dim=-1)))
        return e + self.scale * g * self.proj(r)


class DecoderLayer(nn.Module):
    """Window self-attention, cross-attention over the memory, SwiGLU; pre-norm residuals."""

    def __init__(self, cfg: ModelConfig, tp: TensorParallel, tied: Optional[EncoderBlock]):
        super().__init__()
        self.window = cfg.window
        self.n_heads = tp.local(cfg.n_heads, "model.n_heads")
        # Tied layers reuse the encoder block's modules: one Parameter object,
        # whose gradient sums the encoder's and the decoder's use of it.
        self.attn = tied.attn if tied is not None else Attention(cfg, tp)
        self.ffn = tied.ffn if tied is not None else FeedForward(cfg, tp)
        self.norm_attn = RMSNorm(cfg.d_model, cfg.norm_eps, tp.dtype)
        self.norm_cross = RMSNorm(cfg.d_model, cfg.norm_eps, tp.dtype)
        self.cross_q = tp.column(cfg.d_model, cfg.d_model)
        self.cross_out = tp.row(cfg.d_model, cfg.d_model)
        self.norm_ffn = RMSNorm(cfg.d_model, cfg.norm_eps, tp.dtype)

    def forward(self, z, rope: Rotary, self_attend=None, cross_attend=None, ops=None, run=None):
        """Run positions ``[B, S]`` that share one feedback.

        The caller owns where keys live: ``self_attend(q, k, v)`` attends
        over the window (the cache plus these rotated keys, which it also
        records), ``cross_attend(q)`` over the memory entries these positions
        may read (see :mod:`rlt_scale.model.window`). ``ops`` runs the
        projections: the layer itself, or a :class:`~rlt_scale.model.deferred.WeightTape`
        that computes the same with its weight gradients deferred. ``run()``,
        if given, runs instead, inside this module's call: the decoder walk
        (:mod:`rlt_scale.model.walk`), which computes every layer at once,
        allocates each layer's buffers this way, so that profiles charge them
        to the layer.
        """
        if run is not None:
            return run()
        ops = self if ops is None else ops
        q, k, v = _heads(ops.project_qkv(z), self.n_heads, 3)
        z = z + ops.project_out(merge_heads(self_attend(rope(q), rope(k), v)))
        q = rope(_heads(ops.project_cross_q(z), self.n_heads, 1)[0])
        z = z + ops.project_cross_out(merge_heads(cross_attend(q)))
        return z + ops.feed_forward(z)

    # The projections, from the residual stream ``z`` or an attention's merged output ``h``.
    def project_qkv(self, z):
        return self.attn.qkv(self.norm_attn(z))

    def project_out(self, h):
        return self.attn.out(h)

    def project_cross_q(self, z):
        return self.cross_q(self.norm_cross(z))

    def project_cross_out(self, h):
        return self.cross_out(h)

    def feed_forward(self, z):
        return self.ffn(self.norm_ffn(z))
