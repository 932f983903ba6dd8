"""Analytic FLOPs of one RLT training step, per layer application.

Counted per application, not per parameter (DESIGN.md section 6): a tied
block does encoder work *and* decoder work; the SwiGLU FFN has three
matrices (``2 * d * 2f`` for the fused gate/up plus ``2 * f * d`` for the
down projection, i.e. ``6 d f``, not the ``4 d h`` of a plain MLP).

Two numbers per component:

* ``model``: the *useful* forward work of DESIGN.md section 1. Attention at
  position ``t`` reads ``t`` keys (encoder, cross-attention over memory
  entries ``1..t``) or ``min(t, W)`` keys (decoder window; the encoder's
  ``model.encoder_window`` likewise). MFU uses
  ``3 x model`` (forward + backward = 2 x forward).
* ``fwd`` / ``bwd`` / ``attn_recompute`` / ``ckpt_recompute``: the matmul
  work the code *executes*, exactly what ``FlopCounterMode`` counts. The
  code runs dense attention under masks, so it executes more than it needs:
  the encoder's causal attention is a full ``T x T`` product (with an
  encoder window, query tiles over their visible spans); the decoder's
  window attention of a segment of ``S`` positions reads its carried cache
  (``min(W-1, start)`` entries) plus the ``S`` new keys; its cross-attention
  reads the memory up to the segment end. The fused decoder step
  (``decoder_step=fused``, ``model/walk.py``) reads fixed spans instead:
  ``W-1+S`` window slots, and the memory up to its chunk's end; its backward
  recomputes the memory scores and their gradient once more per block of
  positions (the memory's key/value gradients as GEMMs), and its merge
  applies ``Ws`` and the ``r`` half of ``Wg`` once per segment, recomputing
  them and ``Wg e`` in backward. A fused attention backward
  recomputes the scores (``attn_recompute``, half a forward; a windowed
  encoder's query tiles re-run their whole forward first); chunk
  checkpointing re-runs the merge, decoder and readout forward in backward
  (``ckpt_recompute``). HFU uses the sum of all four.

``vector`` is a rough forward estimate of the non-matmul work (norms,
rotary, softmax, SwiGLU gating, loss). ``FlopCounterMode`` does not count it
and MFU/HFU exclude it, as is conventional; it is there to show it is small.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field

from rlt_scale.config import ModelConfig
from rlt_scale.model.attention import TILE, _index_spans
from rlt_scale.model.deferred import defers
from rlt_scale.profiling.workload import Workload

# Non-matmul FLOPs per element (rough, forward only; see module docstring).
NORM_PER_ELEM = 4       # square, mean, rsqrt-scale, weight
ROTARY_PER_ELEM = 3     # two products and a sum per rotated element
SOFTMAX_PER_SCORE = 5   # scale, max, exp, sum, divide
SWIGLU_PER_UNIT = 5     # silu (~4) and the gating product
LOSS_PER_LOGIT = 4      # log-softmax and the pick

FLOP_FIELDS = ("model", "fwd", "bwd", "attn_recompute", "ckpt_recompute", "vector")


@dataclass
class ComponentFlops:
    """FLOPs of one component (e.g. ``ffn``) of one layer (e.g. ``decoder.1``) for a whole step."""

    layer: str
    component: str
    model: int = 0
    fwd: int = 0
    bwd: int = 0
    attn_recompute: int = 0
    ckpt_recompute: int = 0
    vector: int = 0

    @property
    def executed(self) -> int:
        """Hardware FLOPs: everything the step runs, recomputation included."""
        return self.fwd + self.bwd + self.attn_recompute + self.ckpt_recompute

    @property
    def model_step(self) -> int:
        """Model FLOPs of the step: useful forward plus its 2x backward."""
        return 3 * self.model


@dataclass
class FlopReport:
    """Per-component analytic FLOPs of one step of ``work`` on one tensor-parallel rank."""

    work: Workload
    tp: int
    rows: list[ComponentFlops] = field(default_factory=list)

    def layers(self) -> list[str]:
        return list(OrderedDict.fromkeys(r.layer for r in self.rows))

    def by_layer(self) -> "OrderedDict[str, ComponentFlops]":
        """Rows summed per layer (component ``*``), in execution order."""
        out: OrderedDict[str, ComponentFlops] = OrderedDict()
        for r in self.rows:
            acc = out.setdefault(r.layer, ComponentFlops(r.layer, "*"))
            for name in FLOP_FIELDS:
                setattr(acc, name, getattr(acc, name) + getattr(r, name))
        return out

    def total(self) -> ComponentFlops:
        acc = ComponentFlops("total", "*")
        for r in self.rows:
            for name in FLOP_FIELDS:
                setattr(acc, name, getattr(acc, name) + getattr(r, name))
        return acc

    @property
    def model_flops(self) -> int:
        """MFU numerator for the step."""
        return self.total().model_step

    @property
    def hardware_flops(self) -> int:
        """HFU numerator for the step (equals what FlopCounterMode counts)."""
        return self.total().executed

    def to_dict(self) -> dict:
        tot = self.total()
        return {
            "workload": asdict(self.work),
            "tp": self.tp,
            "model_flops": self.model_flops,
            "hardware_flops": self.hardware_flops,
            "model_flops_per_token": self.model_flops / self.work.tokens,
            "hardware_flops_per_token": self.hardware_flops / self.work.tokens,
            "total": asdict(tot),
            "rows": [asdict(r) for r in self.rows],
        }


def causal_pairs(t_len: int, window: int | None = None) -> int:
    """Useful (query, key) pairs of causal attention over ``t_len`` tokens, each seeing at most ``window``
    keys itself included (None: all before it)."""
    if window is None or window >= t_len:
        return t_len * (t_len + 1) // 2
    return sum(min(t, window) for t in range(1, t_len + 1))


def _attention_pairs(cfg: ModelConfig, work: Workload) -> dict[str, int]:
    """(query, key) pairs per sample: useful and executed, for the three attentions."""
    t_len, w = work.seq_len, cfg.window
    plan = work.plan(cfg.feedback_block)
    fused = walked_chunks(cfg, work)
    window_exec = cross_exec = cross_flush = 0
    for (start, end), c in zip(plan.segments, plan.chunk_of):
        s = end - start
        if c in fused:
            window_exec += s * (w - 1 + s)
            cross_exec += s * plan.chunks[c][1]
            cross_flush += s * plan.chunks[c][1]
        else:
            window_exec += s * (min(w - 1, start) + s)
            cross_exec += s * end
    causal = t_len * (t_len + 1) // 2
    enc_w = cfg.encoder_window or None
    # A windowed encoder runs query tiles over their visible spans (model/attention.py), else one T x T product.
    encoder_exec = t_len * t_len if enc_w is None else sum(
        (b - a) * (hi - lo) for a, b, lo, hi in _index_spans(t_len, t_len, enc_w, TILE))
    return {
        "encoder_useful": causal_pairs(t_len, enc_w),
        "encoder_exec": encoder_exec,
        "window_useful": causal_pairs(t_len, w), "window_exec": window_exec,
        "cross_useful": causal, "cross_exec": cross_exec, "cross_flush": cross_flush,
    }


def walked_chunks(cfg: ModelConfig, work: Workload) -> set[int]:
    """The chunks whose decoder runs as one walk (``decoder_step=fused``, model/walk.py): fixed spans,
    the whole memory, the merge per segment."""
    if cfg.decoder_step != "fused":
        return set()
    plan = work.plan(cfg.feedback_block)
    return {c for c, n in Counter(plan.chunk_of).items() if defers(cfg.decoder_wgrad_block, n)}


def analytic_flops(cfg: ModelConfig, work: Workload, tp: int = 1) -> FlopReport:
    """FLOPs of one forward+backward of ``work`` on one of ``tp`` tensor-parallel ranks.

    Column/row-parallel projections, attention heads and the vocabulary are
    split ``tp`` ways; the merge (replicated, DESIGN.md section 3) is not.
    """
    d, f, vocab = cfg.d_model, cfg.ffn_size, cfg.vocab_size
    bsz, n_tok = work.batch, work.tokens
    d_tp, f_tp, v_tp, h_tp = d // tp, f // tp, vocab // tp, cfg.n_heads // tp
    pairs = _attention_pairs(cfg, work)
    report = FlopReport(work, tp)
    rows = report.rows

    def linear(layer: str, comp: str, d_in: int, d_out: int, vector: int = 0) -> None:
        fl = 2 * n_tok * d_in * d_out
        rows.append(ComponentFlops(layer, comp, model=fl, fwd=fl, bwd=2 * fl, vector=vector))

    def attention(layer: str, comp: str, useful: int, executed: int, rotated: int, tiled: bool = False) -> None:
        # q @ k^T and p @ v: 2 matmuls of 2*hd FLOPs per (query, key, head).
        per_pair = 4 * bsz * d_tp
        fwd = per_pair * executed
        vector = bsz * (SOFTMAX_PER_SCORE * h_tp * executed + ROTARY_PER_ELEM * rotated * d_tp * work.seq_len)
        # Query tiles keep no activations: backward re-runs each tile's forward before the SDPA backward.
        recompute = fwd // 2 + (fwd if tiled else 0)
        rows.append(ComponentFlops(layer, comp, model=per_pair * useful, fwd=fwd, bwd=2 * fwd,
                                   attn_recompute=recompute, vector=vector))

    def norms(layer: str, count: int, positions: int = n_tok) -> None:
        rows.append(ComponentFlops(layer, "norm", vector=NORM_PER_ELEM * count * positions * d))

    rows.append(ComponentFlops("embed", "embed"))
    for i in range(cfg.n_enc_layers):
        layer = f"encoder.{i}"
        norms(layer, 2)
        linear(layer, "qkv", d, 3 * d_tp)
        attention(layer, "attn", pairs["encoder_useful"], pairs["encoder_exec"], rotated=2,
                  tiled=bool(cfg.encoder_window))
        linear(layer, "out", d_tp, d, vector=n_tok * d)
        linear(layer, "ffn", d, 2 * f_tp, vector=n_tok * (SWIGLU_PER_UNIT * f_tp + d))
        linear(layer, "ffn", f_tp, d)
    for g in range(cfg.memory_groups):
        layer = f"memory.{g}"
        norms(layer, 1)
        linear(layer, "kv", d, 2 * d_tp, vector=ROTARY_PER_ELEM * n_tok * d_tp)
    if cfg.feedback_block:
        plan = work.plan(cfg.feedback_block)
        norms("merge", 1, positions=bsz * len(plan.segments))
        walked = walked_chunks(cfg, work)
        lengths = [b - a for a, b in plan.segments]
        tok_w = bsz * sum(n for n, c in zip(lengths, plan.chunk_of) if c in walked)  # positions of walked chunks
        seg_w = bsz * sum(1 for c in plan.chunk_of if c in walked)                 # and their segments
        tok_o = n_tok - tok_w
        dd = 2 * d * d
        # the layers: Wg [e ; r] and Ws r at every position, autograd's backward
        rows.append(ComponentFlops("merge", "gate", model=2 * dd * tok_o, fwd=2 * dd * tok_o, bwd=4 * dd * tok_o,
                                   vector=n_tok * 4 * d))
        rows.append(ComponentFlops("merge", "proj", model=dd * tok_o, fwd=dd * tok_o, bwd=2 * dd * tok_o,
                                   vector=n_tok * 3 * d))
        # a walk: Wg e per position, Wg r and Ws r per segment; backward forms de per position and dr per
        # segment, recomputes the forward, and the weight GEMMs run over positions (model/fused.py)
        rows.append(ComponentFlops("merge", "gate", model=2 * dd * tok_w, fwd=dd * (tok_w + seg_w),
                                   bwd=dd * (3 * tok_w + seg_w), attn_recompute=dd * (tok_w + seg_w)))
        rows.append(ComponentFlops("merge", "proj", model=dd * tok_w, fwd=dd * seg_w, bwd=dd * (tok_w + seg_w),
                                   attn_recompute=dd * seg_w))
    for i in range(cfg.n_dec_layers):
        layer = f"decoder.{i}"
        norms(layer, 3)
        linear(layer, "qkv", d, 3 * d_tp)
        attention(layer, "attn", pairs["window_useful"], pairs["window_exec"], rotated=2)
        linear(layer, "out", d_tp, d, vector=n_tok * d)
        linear(layer, "cross_q", d, d_tp)
        attention(layer, "cross", pairs["cross_useful"], pairs["cross_exec"], rotated=1)
        # a walk's memory gradients: scores and their gradient recomputed per block (two of the four GEMMs)
        rows.append(ComponentFlops(layer, "cross", attn_recompute=4 * bsz * d_tp * pairs["cross_flush"]))
        linear(layer, "cross_out", d_tp, d, vector=n_tok * d)
        linear(layer, "ffn", d, 2 * f_tp, vector=n_tok * (SWIGLU_PER_UNIT * f_tp + d))
        linear(layer, "ffn", f_tp, d)
    norms("readout", 1)
    linear("readout", "readout", d, v_tp)
    rows.append(ComponentFlops("loss", "loss", vector=LOSS_PER_LOGIT * n_tok * v_tp))

    _merge_duplicates(report)
    if work.checkpoint:
        for r in rows:
            if r.layer in ("merge", "readout", "loss") or r.layer.startswith("decoder."):
                r.ckpt_recompute = r.fwd
    return report


def _merge_duplicates(report: FlopReport) -> None:
    """Sum rows that share (layer, component), e.g. the two FFN matrices."""
    merged: OrderedDict[tuple[str, str], ComponentFlops] = OrderedDict()
    for r in report.rows:
        acc = merged.get((r.layer, r.component))
        if acc is None:
            merged[(r.layer, r.component)] = r
        else:
            for name in FLOP_FIELDS:
                setattr(acc, name, getattr(acc, name) + getattr(r, name))
    report.rows[:] = list(merged.values())
