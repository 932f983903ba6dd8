"""A parallel-in-time decoder: Jacobi fixed-point sweeps with an exact adjoint (docs/JACOBI.md).

Why. The decoder's recurrence (DESIGN.md section 1) is sequential: a chunk of
S positions is ``ceil(S/K)`` dependent decoder steps, each of which reads every
decoder weight for a handful of tokens. Only the *feedback* is sequential,
though. Given a guess ``F_t`` of the feedback every position reads, nothing
else is: every position merges its own guess, ``u_t = merge(e_t, F_t)``, and
the decoder layers run over the whole chunk at once, as the K=0 path does
(window self-attention over the carried cache and the chunk, cross-attention
over the memory). Reading each position's feedback off those outputs gives the
next guess::

    F  <-  Phi(F) = feedback read off decoder(merge(e, F))

The true trajectory ``F*`` is the fixed point of ``Phi``. ``Phi`` is causal
(``Phi(F)_t`` depends on guesses of earlier blocks only), so after n sweeps
the first n blocks are exact and ``ceil(S/K)`` sweeps reach ``F*`` exactly;
where the learned dynamics contract, a few sweeps reach it to a tolerance.

Forward: sweeps without autograd until every position's residual
``|Phi(F)_t - F_t| / |Phi(F)_t|`` is at most ``tol``. When the budget runs
out, the positions before the first one above ``tol`` are kept and the
sequential decoder continues from there (:func:`decode`).

Backward (:class:`_Implicit`): with ``g`` the loss's gradient with respect to
the feedback the outputs read and ``J = dPhi/dF`` at the fixed point, the
gradient is that of the outputs plus ``lambda`` pushed through ``Phi``, where
``lambda = g + J^T lambda`` (implicit function theorem). One parallel pass is
rebuilt with autograd at the fixed point; ``lambda`` is solved by sweeps of
vector-Jacobian products through that one graph, to the same tolerance. The
sweeps themselves are never differentiated. ``J^T`` is anti-causal, so where
the adjoint budget runs out the positions from the last one above ``tol`` on
are exact: the span before it is recomputed sequentially and differentiated by
plain autograd, the rest implicitly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.distributed as dist
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from rlt_scale.model.rlt import RLT, feedback_segments
from rlt_scale.model.state import KV, DecoderState


@dataclass(frozen=True)
class JacobiSolver:
    """``model.jacobi_tol`` and ``model.jacobi_max_sweeps``."""

    tol: float
    max_sweeps: int


def solver_for(cfg) -> Optional[JacobiSolver]:
    """The Jacobi solver a ``ModelConfig`` asks for, or None for the sequential walk.

    K=0 has no feedback: its sequential walk is already one parallel pass.
    """
    if cfg.decoder_solver != "jacobi" or cfg.feedback_block == 0:
        return None
    return JacobiSolver(cfg.jacobi_tol, cfg.jacobi_max_sweeps)


# ------------------------------------------------------------------ the map Phi
class Span:
    """The decoder over positions ``[0, S)`` of one chunk (or a part of it), from a carried state.

    ``e``, ``pos``, ``doc`` cover the span; ``memory`` holds the entries up to
    its end, ``offset`` is its first position's index into the memory and
    ``segments`` its cuts, relative to it.
    """

    def __init__(self, model: RLT, e, pos, doc, memory: list[KV], state: DecoderState, offset: int,
                 segments: list[tuple[int, int]]):
        self.model, self.e, self.pos, self.doc = model, e, pos, doc
        self.memory, self.state, self.offset, self.segments = memory, state, offset, segments
        k = model.cfg.feedback_block
        # Which output each position reads (DESIGN.md: the previous block's last position),
        # the learned s* in a document's first block, the carried s before the span.
        self.source = torch.arange(pos.shape[1], device=pos.device) - pos % k - 1
        self.reads_start = pos < k
        self.reads_carried = ~self.reads_start & (self.source < 0)
        self.ends_block = (pos[:, -1] + 1) % k == 0
        self.rope = model.rotary(pos)

    # -- the parallel pass and the feedback read off it
    def run(self, feedback: torch.Tensor) -> tuple[torch.Tensor, list[KV]]:
        """Every position merged with its own ``feedback`` ``[B, S, d]``, all decoder layers at once."""
        layers = range(len(self.model.decoder))
        u = self.model.merge(self.e, feedback)
        z, caches = self.model.decoder_layers(u, self.pos, self.doc, dict(enumerate(self.state.caches)),
                                              self.memory, layers, self.rope)
        return z, [caches[i] for i in layers]

    def feedback(self, z: torch.Tensor, carried: torch.Tensor) -> torch.Tensor:
        """``Phi``'s output: the feedback each position reads, given the outputs ``z`` and the carried ``s``."""
        inner = z.gather(1, self.source.clamp(min=0)[..., None].expand_as(z))
        from_carried = torch.where(self.reads_carried[..., None], carried[:, None], inner)
        return torch.where(self.reads_start[..., None], self.model.merge.initial_state, from_carried)

    def carried(self, z: torch.Tensor, feedback: torch.Tensor) -> torch.Tensor:
        """The ``s`` the span leaves: its last output where a block ends there, else what it read (``RLT.carry``)."""
        return torch.where(self.ends_block[:, None], z[:, -1], feedback[:, -1])

    # -- parts of the span
    def segment_around(self, t: int) -> tuple[int, int]:
        return next((a, b) for a, b in self.segments if a <= t < b)

    def head(self, t: int) -> "Span":
        """Positions ``[0, t)`` (``t`` a segment start)."""
        return Span(self.model, self.e[:, :t], self.pos[:, :t], self.doc[:, :t],
                    [m.first(self.offset + t) for m in self.memory], self.state, self.offset,
                    [(a, b) for a, b in self.segments if b <= t])

    def tail(self, t: int, state: DecoderState) -> "Span":
        """Positions ``[t, S)`` (``t`` a segment start), from the ``state`` the head left."""
        return Span(self.model, self.e[:, t:], self.pos[:, t:], self.doc[:, t:], self.memory, state,
                    self.offset + t, [(a - t, b - t) for a, b in self.segments if a >= t])

    def sequential(self, t: int, state: Optional[DecoderState] = None):
        """The sequential decoder (``RLT.decode``) over ``[t, S)`` from ``state`` (the span's own by default)."""
        return self.model.decode(self.e[:, t:], self.pos[:, t:], self.doc[:, t:], self.memory,
                                 state or self.state, self.offset + t,
                                 [(a - t, b - t) for a, b in self.segments if a >= t])

    # -- the tensors a gradient reaches, flat (for the autograd.Function)
    def tensors(self) -> list[torch.Tensor]:
        caches = self.state.caches
        return [self.e, self.state.s, *(c.k for c in caches), *(c.v for c in caches),
                *(m.k for m in self.memory), *(m.v for m in self.memory)]

    def with_tensors(self, ts: list[torch.Tensor]) -> "Span":
        n, g = len(self.state.caches), len(self.memory)
        e, s, ks, vs = ts[0], ts[1], ts[2:2 + n], ts[2 + n:2 + 2 * n]
        mk, mv = ts[2 + 2 * n:2 + 2 * n + g], ts[2 + 2 * n + g:]
        caches = [KV(k, v, c.pos, c.doc) for k, v, c in zip(ks, vs, self.state.caches)]
        memory = [KV(k, v, m.pos, m.doc) for k, v, m in zip(mk, mv, self.memory)]
        return Span(self.model, e, self.pos, self.doc, memory, DecoderState(s, caches), self.offset, self.segments)

    def parameters(self) -> list[torch.nn.Parameter]:
        """The trained weights a pass reads: the merge and the decoder layers (tied ones included, once)."""
        modules = [self.model.merge, *self.model.decoder]
        unique = {id(p): p for m in modules for p in m.parameters()}
        return [p for p in unique.values() if p.requires_grad]


def residual(new: torch.Tensor, old: torch.Tensor, per_row_scale: bool = False) -> torch.Tensor:
    """``[S]``: the largest change of any row at each position, relative to the new vector's norm.

    ``per_row_scale`` measures against the row's largest vector instead (the
    adjoint, which is zero at positions the loss does not reach). A NaN or
    inf anywhere counts as an infinite residual: ``NaN <= tol`` and
    ``NaN > tol`` are both false, so a NaN would otherwise pass every
    convergence check silently instead of falling back and being logged.
    """
    wide = torch.promote_types(new.dtype, torch.float32)
    change = (new - old).to(wide).norm(dim=-1)
    size = new.to(wide).norm(dim=-1)
    if per_row_scale:
        size = size.amax(dim=1, keepdim=True)
    r = (change / size.clamp_min(torch.finfo(wide).tiny)).amax(dim=0)
    return torch.nan_to_num(r, nan=float("inf"))


def _agreed(r: torch.Tensor, model: RLT) -> torch.Tensor:
    """The largest residual over the tensor-parallel ranks: every rank sweeps as often (collectives match)."""
    if model.tp.size > 1:
        dist.all_reduce(r, op=dist.ReduceOp.MAX, group=model.tp.group)
    return r


@dataclass
class Sweeps:
    """Where forward sweeps stopped: the last pass's input ``feedback`` and its outputs."""

    feedback: torch.Tensor
    z: torch.Tensor
    caches: list[KV]
    s: torch.Tensor
    residual: torch.Tensor
    """``[S]`` per position: how far the last pass moved its input."""
    sweeps: int


@torch.no_grad()
def sweep(span: Span, tol: float, max_sweeps: int, trace: Optional[list] = None) -> Sweeps:
    """Jacobi sweeps over ``span`` until every position's residual is at most ``tol`` or ``max_sweeps`` ran.

    ``trace`` (a list) receives the largest residual of every sweep.
    """
    s0 = span.state.s
    guess = span.feedback(span.e, s0)  # first guess: outputs ~ inputs (residual stream); s*, s0 exact
    for n in range(1, max_sweeps + 1):
        z, caches = span.run(guess)
        new = span.feedback(z, s0)
        r = _agreed(residual(new, guess), span.model)
        if trace is not None:
            trace.append(float(r.max()))
        if n == max_sweeps or r.max() <= tol:
            return Sweeps(guess, z, caches, span.carried(z, new), r, n)
        guess = new
    raise ValueError(f"max_sweeps must be >= 1, got {max_sweeps}")


# ---------------------------------------------------------------------- the solver
def decode(model: RLT, e, pos, doc, memory: list[KV], state: DecoderState, offset: int = 0,
           segments: Optional[list[tuple[int, int]]] = None, checkpoint: bool = False):
    """``RLT.decode`` by the configured solver: ``(z [B, S, d], state)`` of a chunk.

    The same contract as :meth:`RLT.decode` (training, evaluation and
    prefill may all call this). ``checkpoint`` recomputes a sequential
    fall-back in backward instead of keeping its activations; the Jacobi part
    keeps only its inputs and the fixed point either way.
    """
    solver = solver_for(model.cfg)
    if solver is None:
        return model.decode(e, pos, doc, memory, state, offset, segments)
    segments = list(segments) if segments is not None else feedback_segments(pos, model.cfg.feedback_block)
    length = e.shape[1]
    span = Span(model, e, pos, doc, [m.first(offset + length) for m in memory], state, offset, segments)
    result = sweep(span, solver.tol, solver.max_sweeps)
    above = (result.residual > solver.tol).nonzero()
    if len(above) == 0:
        STATS.forward(result.sweeps, float(result.residual.max()), fell_back=False)
        return _attach(span, result)

    # Out of budget: keep the positions before the first one above tol; walk on from there.
    start, _ = span.segment_around(int(above[0]))
    kept = float(result.residual[:start].max()) if start else 0.0
    STATS.forward(result.sweeps, kept, fell_back=True)
    warn(f"jacobi decoder: positions {offset}..{offset + length - 1} not within jacobi_tol={solver.tol:g} after "
         f"{result.sweeps} sweeps (residual {float(result.residual.max()):.2e}); sequential decoder from position "
         f"{offset + start}")
    mid = state
    z_head = e.new_zeros(e.shape[0], 0, e.shape[2])
    if start > 0:
        head = span.head(start)
        with torch.no_grad():  # the head's own pass: the outputs its backward will rebuild
            z, caches = head.run(result.feedback[:, :start])
            s = head.carried(z, head.feedback(z, state.s))
        z_head, mid = _attach(head, Sweeps(result.feedback[:, :start], z, caches, s, result.residual[:start], 0))
    if checkpoint and torch.is_grad_enabled():
        z_tail, out = activation_checkpoint(span.sequential, start, mid, use_reentrant=False)
    else:
        z_tail, out = span.sequential(start, mid)
    return torch.cat([z_head, z_tail], dim=1), out


def _readout(model: RLT, z, targets, valid, want_logits, answers):
    correct = model.answer_correct(z, targets, valid, answers) if answers is not None else None
    return model.segment_loss(z, targets, valid), (model.logits(z) if want_logits else None), correct


def chunk_loss(model: RLT, e, pos, doc, memory, state, offset, segments, targets, valid, want_logits, answers,
               recompute: bool = False):
    """``bptt``'s chunk step by the Jacobi solver: (summed loss, state, logits or None, correct or None).

    ``recompute`` (chunk activation checkpointing) recomputes the readout and
    any sequential fall-back in backward; the Jacobi part keeps only its
    inputs and the fixed point, checkpointed or not.
    """
    z, state = decode(model, e, pos, doc, memory, state, offset, segments, checkpoint=recompute)
    if recompute:
        loss, logits, correct = activation_checkpoint(_readout, model, z, targets, valid, want_logits, answers,
                                                      use_reentrant=False)
    else:
        loss, logits, correct = _readout(model, z, targets, valid, want_logits, answers)
    return loss, state, logits, correct


def _attach(span: Span, result: Sweeps) -> tuple[torch.Tensor, DecoderState]:
    """The outputs of a converged span, joined to the graph through the implicit gradient."""
    if not torch.is_grad_enabled():
        return result.z, DecoderState(result.s, result.caches)
    n = len(result.caches)
    out = _Implicit.apply(span, result, *span.tensors(), *span.parameters())
    z, s, ks, vs = out[0], out[1], out[2:2 + n], out[2 + n:]
    return z, DecoderState(s, [KV(k, v, c.pos, c.doc) for k, v, c in zip(ks, vs, result.caches)])


class _Implicit(torch.autograd.Function):
    """Outputs of a span at its fixed point; backward solves the adjoint (module docstring).

    Inputs: the span, its sweeps, then :meth:`Span.tensors` and
    :meth:`Span.parameters`. Outputs: ``z``, the carried ``s``, every layer's
    cache keys, then values. Saves only the inputs and the fixed point.
    """

    @staticmethod
    def forward(ctx, span: Span, result: Sweeps, *inputs):
        n = len(span.tensors())
        ctx.span, ctx.params = span, inputs[n:]
        ctx.save_for_backward(result.feedback, *inputs[:n])
        device = span.e.device.type
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        return (result.z, result.s, *(c.k.clone() for c in result.caches), *(c.v.clone() for c in result.caches))

    @staticmethod
    def backward(ctx, *grad_out):
        feedback, *saved = ctx.saved_tensors
        needs = ctx.needs_input_grad[2:]
        device, enabled, dtype = ctx.autocast
        tol, max_sweeps = ctx.span.model.cfg.jacobi_tol, ctx.span.model.cfg.jacobi_max_sweeps
        with torch.enable_grad(), torch.autocast(device, dtype=dtype, enabled=enabled):
            leaves = [t.detach().requires_grad_(need) for t, need in zip(saved, needs)]
            live = ctx.span.with_tensors(leaves)
            wanted = [x for x, need in zip([*leaves, *ctx.params], needs) if need]
            F = feedback.detach().requires_grad_()
            z, caches = live.run(F)
            F_out = live.feedback(z, live.state.s)
            outs, grads = _with_grads([z, live.carried(z, F_out), *(c.k for c in caches), *(c.v for c in caches)],
                                      grad_out)
            g = _grad(outs, F, grads)
            lam, r, n = _adjoint(g, F_out, F, tol, max_sweeps, live.model)
            above = (r > tol).nonzero()
            if len(above) == 0:
                STATS.adjoint(n, float(r.max()), fell_back=False)
                got = torch.autograd.grad(outs + [F_out], wanted, grads + [lam], allow_unused=True)
            else:
                _, cut = live.segment_around(int(above[-1]))
                STATS.adjoint(n, float(r[cut:].max()) if cut < len(r) else 0.0, fell_back=True)
                warn(f"jacobi decoder: adjoint of positions {live.offset}..{live.offset + len(r) - 1} not within "
                     f"jacobi_tol={tol:g} after {n} sweeps (residual {float(r.max()):.2e}); sequential autograd "
                     f"before position {live.offset + cut}")
                del outs, F_out, z, caches  # free the parallel graph before building the split one
                got = _split_gradient(live, feedback, lam, cut, grad_out, wanted)
        got = iter(got)
        return (None, None, *(next(got) if need else None for need in needs))


def _with_grads(outs: list[torch.Tensor], grads) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The outputs that received a gradient, and those gradients."""
    kept = [(o, g) for o, g in zip(outs, grads) if g is not None]
    return [o for o, _ in kept], [g for _, g in kept]


def _grad(outs, x, grads) -> torch.Tensor:
    (g,) = torch.autograd.grad(outs, x, grads, retain_graph=True, allow_unused=True)
    return torch.zeros_like(x) if g is None else g


def _adjoint(g, F_out, F, tol: float, max_sweeps: int, model: RLT):
    """Sweeps ``lambda <- g + J^T lambda`` (VJPs through one retained graph); ``(lambda, residual [S], sweeps)``."""
    lam = g
    for n in range(1, max_sweeps + 1):
        new = g + _grad([F_out], F, [lam])
        r = _agreed(residual(new, lam, per_row_scale=True), model)
        lam = new
        if r.max() <= tol:
            break
    return lam, r, n


def _split_gradient(live: Span, feedback, lam, cut: int, grad_out, wanted):
    """Gradients when the adjoint is exact only from ``cut`` on: sequential autograd before, implicit after."""
    z_head, mid = live.model.decode(live.e[:, :cut], live.pos[:, :cut], live.doc[:, :cut], live.memory,
                                    live.state, live.offset, [(a, b) for a, b in live.segments if b <= cut])
    if cut == live.e.shape[1]:
        outs = [z_head, mid.s, *(c.k for c in mid.caches), *(c.v for c in mid.caches)]
        extra, extra_grad = [], []
    else:
        tail = live.tail(cut, mid)
        z, caches = tail.run(feedback[:, cut:])
        F_out = tail.feedback(z, mid.s)
        outs = [torch.cat([z_head, z], 1), tail.carried(z, F_out), *(c.k for c in caches), *(c.v for c in caches)]
        extra, extra_grad = [F_out], [lam[:, cut:]]
    outs, grads = _with_grads(outs, grad_out)
    return torch.autograd.grad(outs + extra, wanted, grads + extra_grad, allow_unused=True)


# ------------------------------------------------------------------- reporting
class SolverStats:
    """Sweeps, residuals and fall-backs since the last :meth:`drain` (the trainer's logged step)."""

    def __init__(self):
        self.drain()

    def forward(self, sweeps: int, residual: float, fell_back: bool) -> None:
        self.chunks += 1
        self.sweeps += sweeps
        self.sweeps_max = max(self.sweeps_max, sweeps)
        self.residual = max(self.residual, residual)
        self.fallbacks += fell_back

    def adjoint(self, sweeps: int, residual: float, fell_back: bool) -> None:
        self.adjoint_chunks += 1
        self.adjoint_sweeps += sweeps
        self.adjoint_sweeps_max = max(self.adjoint_sweeps_max, sweeps)
        self.adjoint_residual = max(self.adjoint_residual, residual)
        self.adjoint_fallbacks += fell_back

    def drain(self) -> dict:
        """The metrics of the spans solved since the last drain (empty when none), and start afresh."""
        out = {}
        if getattr(self, "chunks", 0):
            out = {"jacobi_sweeps": self.sweeps / self.chunks, "jacobi_sweeps_max": self.sweeps_max,
                   "jacobi_residual": self.residual, "jacobi_fallbacks": self.fallbacks}
        if getattr(self, "adjoint_chunks", 0):
            out.update({"jacobi_adjoint_sweeps": self.adjoint_sweeps / self.adjoint_chunks,
                        "jacobi_adjoint_sweeps_max": self.adjoint_sweeps_max,
                        "jacobi_adjoint_residual": self.adjoint_residual,
                        "jacobi_adjoint_fallbacks": self.adjoint_fallbacks})
        self.chunks = self.sweeps = self.sweeps_max = self.fallbacks = 0
        self.adjoint_chunks = self.adjoint_sweeps = self.adjoint_sweeps_max = self.adjoint_fallbacks = 0
        self.residual = self.adjoint_residual = 0.0
        return out


STATS = SolverStats()
WARNINGS_SHOWN = 20
_warned = 0


def warn(message: str) -> None:
    """A fall-back, on the run log of the logging rank; after 20, only the metrics count them."""
    global _warned
    if dist.is_initialized() and dist.get_rank() != 0:
        return
    _warned += 1
    if _warned <= WARNINGS_SHOWN:
        suffix = "" if _warned < WARNINGS_SHOWN else " (further fall-backs: jacobi_fallbacks in metrics.jsonl)"
        print(f"warning: {message}{suffix}", flush=True)
