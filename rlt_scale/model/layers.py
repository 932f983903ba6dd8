"""Small building blocks: RMSNorm, rotary positions, masked attention, SwiGLU.

Positions are *document-relative* token indices (0 at a document start) and
documents are identified by integer ids, so packing several documents in one
sample needs nothing but masks: a query sees a key only when both belong to
the same document (see :func:`visibility`).
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F
from torch import nn


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype: torch.dtype):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * rms_rstd(x, self.eps) * self.weight


def rms_rstd(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``1 / sqrt(mean(x^2) + eps)`` over the last dim (kept): RMSNorm's scale."""
    return torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Rotary:
    """Rotary embedding tables for a batch of positions.

    Built once per chunk from positions ``[B, S]`` and shared by every layer
    that rotates queries or keys at those positions; ``rows(a, b)`` gives the
    tables of positions ``a..b-1`` without recomputing them.
    """

    def __init__(self, cos: torch.Tensor, sin: torch.Tensor):
        self.cos, self.sin = cos, sin  # [B, 1, S, hd/2]: broadcast over heads

    @classmethod
    def at(cls, positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype) -> "Rotary":
        exponent = torch.arange(0, head_dim, 2, device=positions.device, dtype=torch.float64) / head_dim
        angles = positions.to(torch.float64)[..., None] / theta**exponent  # [B, S, hd/2]
        return cls(angles.cos().to(dtype)[:, None], angles.sin().to(dtype)[:, None])

    def rows(self, start: int, stop: int) -> "Rotary":
        return Rotary(self.cos[:, :, start:stop], self.sin[:, :, start:stop])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate ``x`` of shape ``[B, h, S, hd]`` (rotate-half convention)."""
        x1, x2 = x.chunk(2, dim=-1)
        cos, sin = self.cos, self.sin
        return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)


def visibility(
    q_pos: torch.Tensor,
    q_doc: torch.Tensor,
    k_pos: torch.Tensor,
    k_doc: torch.Tensor,
    window: Optional[int] = None,
) -> torch.Tensor:
    """Boolean mask ``[B, 1, Sq, Sk]``: key visible to query.

    Visible means: same document, not in the future, and (with a window W)
    fewer than W positions back, so the window holds ``t-W+1 .. t``.
    """
    qp, kp = q_pos[:, :, None], k_pos[:, None, :]
    mask = (q_doc[:, :, None] == k_doc[:, None, :]) & (kp <= qp)
    if window is not None:
        mask &= kp > qp - window
    return mask[:, None]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Scaled dot-product attention ``[B, h, Sq, hd]`` under a boolean mask.

    Every query sees at least its own position, so no row is fully masked.
    """
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


def attention_probabilities(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``softmax(q k^T / sqrt(hd))`` under a boolean mask, in ``q``'s dtype."""
    scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
    return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1).to(q.dtype)


def attention_score_grads(q, k, v, mask, d_out):
    """``(p, ds)``: the probabilities of :func:`attend` (recomputed, as a fused backward does) and the
    gradient of its pre-softmax scores; ``k``, ``v``, ``d_out`` are taken in ``q``'s dtype."""
    k, v, d_out = k.to(q.dtype), v.to(q.dtype), d_out.to(q.dtype)
    p = attention_probabilities(q, k, mask)
    dp = d_out @ v.transpose(-1, -2)
    ds = (p * (dp - (dp * p).sum(-1, keepdim=True)) * q.shape[-1] ** -0.5).to(q.dtype)
    return p, ds


def attend_backward(q, k, v, mask, d_out):
    """``(dq, dk, dv)`` of :func:`attend`; ``k``, ``v``, ``d_out`` are taken in ``q``'s dtype."""
    p, ds = attention_score_grads(q, k, v, mask, d_out)
    return ds @ k.to(q.dtype), ds.transpose(-1, -2) @ q, p.transpose(-1, -2) @ d_out.to(q.dtype)


def rms_norm_backward(dy, x, rstd, weight):
    """Input gradient of ``RMSNorm(x) = x * rstd * weight`` from its output gradient ``dy``."""
    normalised = x * rstd
    g = dy * weight
    return rstd * (g - normalised * (g * normalised).mean(-1, keepdim=True))


def autocast_of(t: torch.Tensor) -> Optional[torch.dtype]:
    """The autocast dtype in force for ``t``'s device type now, or None: what a custom
    autograd Function records in forward so that its backward can restore it."""
    kind = t.device.type
    return torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None


def autocast_as(t: torch.Tensor, dtype: Optional[torch.dtype]):
    """Run under the autocast that :func:`autocast_of` recorded. Autograd runs a custom
    Function's backward outside the forward's autocast; without this a bf16 forward
    would meet an fp32 backward (mixed-dtype matmuls, or silently other numbers)."""
    if dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(t.device.type, dtype=dtype)


def split_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """``[B, S, h*hd] -> [B, h, S, hd]``."""
    b, s, _ = x.shape
    return x.view(b, s, n_heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    """``[B, h, S, hd] -> [B, S, h*hd]``."""
    b, h, s, hd = x.shape
    return x.transpose(1, 2).reshape(b, s, h * hd)


def swiglu(gate_up: torch.Tensor) -> torch.Tensor:
    """SwiGLU on a fused ``[gate ; up]`` projection (split on the last dim)."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def document_positions(doc_ids: torch.Tensor) -> torch.Tensor:
    """Document-relative positions ``[B, T]`` from per-token document ids.

    A document starts wherever the id changes; positions count from 0 there.
    """
    b, t = doc_ids.shape
    index = torch.arange(t, device=doc_ids.device).expand(b, t)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    last_start = torch.where(starts, index, torch.zeros_like(index)).cummax(dim=1).values
    return index - last_start
