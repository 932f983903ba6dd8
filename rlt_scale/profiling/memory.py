"""Analytic memory of an RLT training step, per layer and per rank of a layout.

Static memory per rank: parameters, gradients and AdamW state, sharded by
TP (column/row projections, heads, vocabulary; norms and the merge are
replicated), placed by PP stage (encoder layer ``l`` and decoder layer ``l``
on one stage; embedding on the first stage; merge, final norm and readout
on the last; a memory group on every stage that reads it) and, with ZeRO,
sharded over DP (stage 1: optimizer state, 2: + gradients, 3: + parameters).

Activations are what autograd keeps for backward *in this implementation*,
per micro-batch (the measured mode prints the same quantity, and the tests
hold the two within a few percent). Per token and layer they are a few
``d``-sized tensors (norm outputs, residuals, q/k/v/out of each attention,
``4 f`` for SwiGLU), plus terms that are not per token:

* no attention masks: the encoder's causal attention runs SDPA's
  ``is_causal`` kernel for single documents, or query tiles that build each
  tile's mask on the fly for packed ones (``rlt_scale/model/attention.py``),
  so nothing O(T^2) is kept (these samples are single documents);
* decoder keys: one store per layer and chunk holds the chunk's keys and
  values plus the ``W-1`` carried ones, written in place; each attention
  saves its queries only (``rlt_scale/model/window.py``), so the decoder
  keeps O(T d) whatever the window and the memory length;
* decoder projections: on weight tapes (``rlt_scale/model/deferred.py``,
  every chunk of more than one segment) each RMSNorm keeps its input and
  ``rstd`` and the SwiGLU its fused gate/up, ``3(d+1) + 2f`` per token
  instead of ``3(2d+1) + 4f``;
* rotary tables (``head_dim`` per token per table), the loss's
  log-probabilities (``V`` per token) and the carried state ``s``.

With chunk checkpointing a chunk's merge, decoder and readout activations
are dropped after forward and rebuilt in backward; what forward keeps is the
encoder and memory (O(T)), plus, per chunk boundary, the carried state
``(s, window caches)`` (O(T/C)); backward adds one chunk's activations (O(C)).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from dataclasses import asdict, dataclass, field

from rlt_scale.config import ModelConfig
from rlt_scale.model.deferred import defers
from rlt_scale.profiling.workload import Workload

DTYPE_BYTES = {"float32": 4, "float64": 8, "bfloat16": 2}
INDEX_BYTES = 8  # int64 positions and document ids carried with every key


@dataclass(frozen=True)
class Layout:
    """Process layout and optimizer bookkeeping for the per-rank numbers.

    ``microbatches_in_flight``: micro-batches whose activations a stage holds
    at once; the decoder ring needs ``M >= PP`` (DESIGN.md section 3), 0
    means ``PP``. ``master_weights``: keep an fp32 copy of low-precision
    parameters in the optimizer (automatic for bfloat16 parameters).
    ``dp_bucket_mb``: gradient communication bucket (DDP's 25 MB; DeepSpeed's
    ``reduce_bucket_size`` is 5e8 elements, set it to match your json).
    """

    tp: int = 1
    pp: int = 1
    dp: int = 1
    zero_stage: int = 0
    microbatches_in_flight: int = 0
    dp_bucket_mb: float = 25.0

    @property
    def in_flight(self) -> int:
        return self.microbatches_in_flight or self.pp


@dataclass
class LayerMemory:
    """One layer on one TP rank: parameter count, activations, carried state."""

    layer: str
    stages: list[int]
    params: int
    """Parameter elements on one TP rank (tied attention/FFN belong to the encoder layer)."""
    activation_bytes: int
    """Kept for backward at the end of forward, one micro-batch, no checkpointing."""
    activation_bytes_ckpt: int
    """The same with chunk checkpointing (at the workload's chunk size; encoder layers too when recomputed)."""
    recompute_bytes: int
    """Rebuilt in backward under checkpointing: the largest chunk, or the whole layer for a recomputed encoder."""
    state_bytes: int
    """Recurrent state: window caches (decoder) or the encoder memory (memory groups)."""


@dataclass
class RankMemory:
    """Peak-relevant bytes on one rank of a pipeline stage (all TP/DP ranks of a stage alike)."""

    stage: int
    params: int
    grads: int
    optimizer: int
    activations: int
    """Activations of this stage's layers for every in-flight micro-batch (no checkpointing)."""
    activations_ckpt: int
    """The same with chunk checkpointing, plus one chunk (all this stage's layers) rebuilt in backward."""
    comm_buffers: int

    @property
    def static(self) -> int:
        return self.params + self.grads + self.optimizer

    @property
    def total(self) -> int:
        return self.static + self.activations + self.comm_buffers

    @property
    def total_ckpt(self) -> int:
        return self.static + self.activations_ckpt + self.comm_buffers


@dataclass
class MemoryReport:
    """Per-layer and per-rank memory of one layout and workload."""

    layout: Layout
    work: Workload
    dtype_bytes: int
    layers: list[LayerMemory] = field(default_factory=list)
    ranks: list[RankMemory] = field(default_factory=list)

    def activations_per_token(self, ckpt: bool = False) -> float:
        key = "activation_bytes_ckpt" if ckpt else "activation_bytes"
        return sum(getattr(m, key) for m in self.layers) / self.work.tokens

    def to_dict(self) -> dict:
        return {
            "layout": asdict(self.layout), "workload": asdict(self.work), "dtype_bytes": self.dtype_bytes,
            "activation_bytes_per_token": self.activations_per_token(False),
            "activation_bytes_per_token_ckpt": self.activations_per_token(True),
            "layers": [asdict(m) for m in self.layers],
            "ranks": [dict(asdict(r), static=r.static, total=r.total, total_ckpt=r.total_ckpt) for r in self.ranks],
        }


# ------------------------------------------------------------------ parameters
def layer_params(cfg: ModelConfig, tp: int = 1) -> "OrderedDict[str, int]":
    """Parameter elements per layer on one TP rank, in execution order."""
    d, f, vocab = cfg.d_model, cfg.ffn_size, cfg.vocab_size
    attn_ffn = (3 * d * d + d * d + 2 * f * d + f * d) // tp
    out: OrderedDict[str, int] = OrderedDict()
    out["embed"] = vocab // tp * d
    for i in range(cfg.n_enc_layers):
        out[f"encoder.{i}"] = 2 * d + attn_ffn
    for g in range(cfg.memory_groups):
        out[f"memory.{g}"] = d + 2 * d * d // tp
    if cfg.feedback_block:
        out["merge"] = d + (2 * d * d + d) + d * d + d + int(cfg.learn_feedback_scale)
    for i in range(cfg.n_dec_layers):
        own = 0 if cfg.tie_layers else attn_ffn
        out[f"decoder.{i}"] = 3 * d + 2 * d * d // tp + own
    out["readout"] = d + vocab // tp * d
    return out


def layer_stages(cfg: ModelConfig, pp: int) -> "OrderedDict[str, list[int]]":
    """Pipeline stages holding each layer (a shared memory group sits on several)."""
    dec_stage = [i * pp // cfg.n_dec_layers for i in range(cfg.n_dec_layers)]
    out: OrderedDict[str, list[int]] = OrderedDict()
    out["embed"] = [0]
    for i in range(cfg.n_enc_layers):
        out[f"encoder.{i}"] = [dec_stage[i] if cfg.tie_layers else i * pp // cfg.n_enc_layers]
    for g in range(cfg.memory_groups):
        out[f"memory.{g}"] = sorted({dec_stage[i] for i in range(cfg.n_dec_layers) if cfg.memory_group_of(i) == g})
    if cfg.feedback_block:
        out["merge"] = [pp - 1]
    for i in range(cfg.n_dec_layers):
        out[f"decoder.{i}"] = [dec_stage[i]]
    out["readout"] = [pp - 1]
    return out


# ----------------------------------------------------------------- activations
def layer_activations(cfg: ModelConfig, work: Workload, tp: int = 1, dtype_bytes: int = 4) -> dict:
    """Bytes per layer: kept after forward (plain / checkpointed), rebuilt per chunk, carried state.

    Elements are ``dtype_bytes`` wide, positions and document ids 8 bytes.
    Head-split tensors divide by ``tp``; residual-stream tensors and masks
    are replicated on every TP rank (no sequence parallelism).
    """
    d, f, h, hd, vocab = cfg.d_model, cfg.ffn_size, cfg.n_heads, cfg.head_dim, cfg.vocab_size
    bsz, t_len, w = work.batch, work.seq_len, cfg.window
    d_tp, f_tp, h_tp, v_tp = d // tp, f // tp, h // tp, vocab // tp
    p = dtype_bytes
    norm = 2 * d + 1                       # x * rsqrt and the scaled output, plus the rsqrt
    plan = work.plan(cfg.feedback_block)
    segments = list(zip(plan.segments, plan.chunk_of))
    chunk_ends = {b for _, b in plan.chunks}

    def attention(s: int) -> int:
        """One causal attention over ``s`` queries: q, out, logsumexp (no mask: ``is_causal``)."""
        merge_copy = d_tp if s > 1 else 0  # merge_heads copies unless a single position
        return s * (2 * d_tp + h_tp + merge_copy)

    out: dict[str, dict[str, int]] = OrderedDict()

    def put(layer, held, held_ckpt=None, recompute=0, state=0):
        out[layer] = {"held": held, "held_ckpt": held if held_ckpt is None else held_ckpt,
                      "recompute": recompute, "state": state}

    put("embed", bsz * t_len * d * p)
    per_token = 2 * norm + 2 * d + 4 * f_tp + 2 * d_tp   # norms, residuals, SwiGLU, k and v
    for i in range(cfg.n_enc_layers):
        held = bsz * p * (t_len * per_token + attention(t_len))
        if work.recompute_encoder:  # forward keeps the layer's output (the next one's input) only
            put(f"encoder.{i}", held, held_ckpt=bsz * t_len * d * p, recompute=held)
        else:
            put(f"encoder.{i}", held)
    for g in range(cfg.memory_groups):
        # the rotated k and a contiguous copy of v (the fused k|v output is then freed)
        held = bsz * t_len * (norm + 2 * d_tp) * p
        put(f"memory.{g}", held, state=bsz * t_len * 2 * d_tp * p)
    # A chunk of more than one segment runs its decoder projections on weight tapes
    # (model/deferred.py), which keep their own copies of what backward needs.
    taped = {c for c, n in Counter(plan.chunk_of).items() if defers(cfg.decoder_wgrad_block, n)}
    # With decoder_step=fused those chunks are one walk each (model/walk.py): the same per-layer rows
    # as a tape, the feedback each position read, and of the s of its segments only the last.
    walked = taped if cfg.decoder_step == "fused" else set()
    if cfg.feedback_block:
        # [e ; r], the gate, alpha * gate, Ws r and u per position (u only where the first decoder
        # layer's norm keeps it, not its tape's copy); RMSNorm(s) per segment, whose broadcast
        # over a segment of S > 1 positions is materialised for Ws r.
        per_chunk: dict[int, int] = {}
        for (a, b), c in segments:
            s = b - a
            per_chunk[c] = per_chunk.get(c, 0) + (s * d if c in walked else s * (5 if c in taped else 6) * d + (
                norm if s == 1 else d + 1 + s * d))
        put("merge", bsz * p * sum(per_chunk.values()), held_ckpt=0,
            recompute=bsz * p * max(per_chunk.values()))
    chunks = [(a, b, min(w - 1, a)) for a, b in plan.chunks]  # each chunk's span and carried cache
    for i in range(cfg.n_dec_layers):
        residuals = 3 if i < cfg.n_dec_layers - 1 else 2  # the last layer's output is not saved
        # norms, residuals, SwiGLU, and per attention (window and memory) the queries it saves
        # and its output; keys live in one store per chunk, written in place (model/window.py),
        # so nothing here depends on the window W beyond the W-1 carried slots.
        per_tok = 3 * norm + residuals * d + 4 * f_tp + 2 * 2 * d_tp
        # On a tape: each norm's input and rstd, the two attention outputs, the fused gate/up
        # (model/deferred.py), and the queries the two reads save.
        per_tok_taped = 3 * (d + 1) + 2 * d_tp + 2 * f_tp + 2 * d_tp
        per_chunk = [(b - a) * (per_tok_taped if c in taped else per_tok) + (cache + b - a) * 2 * d_tp
                     for c, (a, b, cache) in enumerate(chunks)]
        state = bsz * (w - 1) * (2 * d_tp * p + 2 * INDEX_BYTES)
        put(f"decoder.{i}", bsz * p * sum(per_chunk), held_ckpt=0,
            recompute=bsz * p * max(per_chunk), state=state)
    put("readout", bsz * t_len * norm * p, held_ckpt=0, recompute=bsz * work.chunk * norm * p)
    # Outside the modules: rotary tables (encoder, memory, decoder), the concatenated decoder
    # output, log-probabilities, targets and their mask; the fed-back s of every segment; each
    # chunk's key positions/documents (int64), and the window caches it hands on (copies of its
    # newest W-1 keys): only the last chunk's are kept, or every chunk's under checkpointing.
    bookkeeping = bsz * t_len * (INDEX_BYTES + 1)
    bookkeeping += sum(bsz * (cache + b - a) * 2 * INDEX_BYTES for a, b, cache in chunks)
    s_per = bsz * d * p if cfg.feedback_block else 0
    handed_on = [cfg.n_dec_layers * bsz * min(w - 1, b) * 2 * d_tp * p for _, b, _ in chunks]
    carried_s = sum(1 for _, c in segments if c not in walked) + len(walked)
    put("other", bsz * t_len * (3 * hd + d + v_tp) * p + bookkeeping + carried_s * s_per + handed_on[-1],
        held_ckpt=bsz * t_len * 2 * hd * p + bookkeeping + len(chunk_ends) * s_per + sum(handed_on),
        recompute=bsz * work.chunk * (hd + d + v_tp) * p)
    return out


# ------------------------------------------------------------------- the report
def analytic_memory(cfg: ModelConfig, work: Workload, layout: Layout = Layout()) -> MemoryReport:
    """Per-layer and per-stage memory of ``work`` under ``layout``."""
    p = DTYPE_BYTES[cfg.params_dtype]
    params = layer_params(cfg, layout.tp)
    stages = layer_stages(cfg, layout.pp)
    acts = layer_activations(cfg, work, layout.tp, p)
    report = MemoryReport(layout, work, p)
    for name in list(params) + ["other"]:
        a = acts[name]
        report.layers.append(LayerMemory(
            layer=name, stages=stages.get(name, list(range(layout.pp))), params=params.get(name, 0),
            activation_bytes=a["held"], activation_bytes_ckpt=a["held_ckpt"],
            recompute_bytes=a["recompute"], state_bytes=a["state"],
        ))
    for stage in range(layout.pp):
        report.ranks.append(_rank(cfg, work, layout, p, stage, [m for m in report.layers if stage in m.stages]))
    return report


def _rank(cfg, work, layout: Layout, p: int, stage: int, layers: list[LayerMemory]) -> RankMemory:
    n_params = sum(m.params for m in layers)
    low_precision = p < 4
    grad_bytes = n_params * p
    # AdamW: m and v in fp32, plus an fp32 master copy when parameters are low precision.
    opt_bytes = n_params * (8 + (4 if low_precision else 0))
    param_bytes = n_params * p
    dp = layout.dp
    if layout.zero_stage >= 1:
        opt_bytes //= dp
    if layout.zero_stage >= 2:
        grad_bytes //= dp
    if layout.zero_stage >= 3:
        param_bytes //= dp
    m = layout.in_flight
    acts = m * sum(x.activation_bytes for x in layers)
    # Backward rebuilds one decoder chunk at a time, but all of that chunk's layers on this stage at
    # once; after the decoder, one recomputed encoder layer at a time.
    encoder = [x.recompute_bytes for x in layers if x.layer.startswith("encoder.")]
    rebuilt = max(sum(x.recompute_bytes for x in layers if not x.layer.startswith("encoder.")), max(encoder, default=0))
    acts_ckpt = m * sum(x.activation_bytes_ckpt for x in layers) + rebuilt
    return RankMemory(stage, param_bytes, grad_bytes, opt_bytes, acts, acts_ckpt,
                      _comm_buffers(cfg, work, layout, p, n_params))


def _comm_buffers(cfg: ModelConfig, work: Workload, layout: Layout, p: int, n_params: int) -> int:
    """Buffers that exist only because of parallelism.

    DP: gradient buckets (two in flight, never larger than the gradients).
    PP: per in-flight micro-batch, send and receive buffers for the encoder
    activations between stages ``[B, T, d]`` and the memory groups that other
    stages read ``[B, T, 2d/tp]``; the ring's ``u``/``s`` messages are ``[B, d]``.
    TP: the row-parallel all-reduce runs in place; no extra buffer.
    """
    total = 0
    if layout.dp > 1:
        bucket = int(layout.dp_bucket_mb * 2**20)
        total += 2 * min(bucket, n_params * p)
    if layout.pp > 1:
        bsz, t_len, d = work.batch, work.seq_len, cfg.d_model
        per_mb = 2 * bsz * t_len * d * p + cfg.memory_groups * bsz * t_len * 2 * d // layout.tp * p + 4 * bsz * d * p
        total += layout.in_flight * per_mb
    return total
