"""The recurrent decoder's bandwidth bound, beside the FLOP bound (DESIGN.md section 6).

A decoder step advances every sequence of a step by one segment (one token
for K=1). It cannot start before the previous one has finished, and it reads
every decoder weight of the rank, whatever the number of sequences that
advance together. So per step the rank moves at least

    weights   = decoder weights on the rank (attention, FFN, cross-attention,
                norms; the merge on the last stage), read once in forward and
                once in backward for the input gradients; and the weight
                gradients, read and written once per step unless they are
                formed once per chunk (deferred);
    keys      = per sequence, the window (min(t, W) entries) and the memory
                (t entries) of every decoder layer, read in forward, read
                again in backward, and their gradients written: 3 times;

through memory of bandwidth ``B``, so a step takes at least
``(weights + sequences x keys) / B`` and a GPU makes at most
``sequences x K / (step x GPUs of a replica)`` tokens per second of the
model's replica, counting each GPU's share. The FLOP bound is
``MFU x peak / model FLOPs per token``. Whichever is lower binds: at few
sequences per step it is the weights (bandwidth), at many the FLOPs.

Everything is per rank of a TP x PP replica: TP splits each weight, PP runs
the stages as a ring with PP micro-batches in flight, so each stage is busy
every step and the replica advances ``sequences`` sequences per step.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from rlt_scale.config import ModelConfig
from rlt_scale.profiling.flops import analytic_flops
from rlt_scale.profiling.memory import layer_params
from rlt_scale.profiling.workload import Workload

HBM_BYTES_PER_S = {"h100": 3.35e12, "h200": 4.8e12, "a100": 2.04e12}
"""Datasheet memory bandwidths (SXM parts) the report can name."""


@dataclass
class DecoderStepBound:
    """Bytes one rank moves per decoder step, and the tokens/s per GPU that allows."""

    sequences: int
    """Sequences that advance together in one step (one weight read serves them all)."""
    tokens_per_step: int
    """Positions each sequence advances per step: K (the whole chunk for K=0)."""
    weight_bytes: int
    """Weight and weight-gradient traffic of one step on one rank."""
    key_bytes: int
    """Window and memory key/value traffic of one step on one rank, all sequences (mean position)."""
    bandwidth: float
    """Bytes per second."""
    gpus: int
    """GPUs of one model replica (TP x PP)."""
    flop_tokens_per_s: float
    """Tokens/s per GPU that the FLOP bound allows at the given MFU."""

    @property
    def step_s(self) -> float:
        return (self.weight_bytes + self.key_bytes) / self.bandwidth

    @property
    def bandwidth_tokens_per_s(self) -> float:
        """Tokens/s per GPU the bandwidth allows."""
        return self.sequences * self.tokens_per_step / self.step_s / self.gpus

    @property
    def binding(self) -> str:
        return "bandwidth" if self.bandwidth_tokens_per_s < self.flop_tokens_per_s else "FLOPs"

    def to_dict(self) -> dict:
        return dict(asdict(self), step_s=self.step_s, bandwidth_tokens_per_s=self.bandwidth_tokens_per_s,
                    binding=self.binding)


def decoder_step_bound(cfg: ModelConfig, seq_len: int, sequences: int, tp: int = 1, pp: int = 1,
                       bandwidth: float = HBM_BYTES_PER_S["h100"], peak_flops: float = 989e12,
                       mfu: float = 0.4, dtype_bytes: int = 2, grad_bytes: int = 4,
                       deferred_weight_grads: bool = False) -> DecoderStepBound:
    """The bound of a training step's decoder at ``sequences`` sequences per step.

    ``dtype_bytes``: weights and keys as the kernels read them (2 for bf16);
    ``grad_bytes``: the weight gradients' accumulation dtype (fp32).
    """
    params = layer_params(cfg, tp)
    decoder = sum(n for name, n in params.items() if name.startswith("decoder.") or name == "merge")
    if cfg.tie_layers:  # the decoder reads its tied attention/FFN too: count them once more
        decoder += sum(n for name, n in params.items() if name.startswith("encoder.")) - 2 * cfg.d_model * cfg.n_enc_layers
    per_rank = decoder // pp
    weight_traffic = 2 * per_rank * dtype_bytes  # forward, and backward's input gradients
    if not deferred_weight_grads:
        weight_traffic += 2 * per_rank * grad_bytes  # read-modify-write of every weight gradient
    k = cfg.feedback_block or seq_len
    mean_t = (seq_len + 1) / 2
    per_layer = (min(mean_t, cfg.window) + mean_t) * 2 * cfg.d_model // tp * dtype_bytes
    key_traffic = int(3 * sequences * k * per_layer * cfg.n_dec_layers / pp)
    flops_per_token = analytic_flops(cfg, Workload(1, seq_len)).model_flops / seq_len
    return DecoderStepBound(sequences, k, weight_traffic, key_traffic, bandwidth, tp * pp,
                            mfu * peak_flops / flops_per_token)


def bound_table(cfg: ModelConfig, seq_len: int, tp: int, pp: int, sequences=(1, 8, 64, 512),
                decoder_bytes_per_sequence: float = 0.0, **kw) -> str:
    """The trade-off of sequences per step (``trainer.decoder_sequences``): tokens/s per GPU,
    bandwidth against FLOPs, and what that many sequences' decoder activations cost at once
    (``decoder_bytes_per_sequence``: merge, decoder layers and readout of one sample, as kept
    for backward under the profiled checkpointing)."""
    from rlt_scale.profiling.report import table

    rows = []
    for n in sequences:
        for deferred in (False, True):
            b = decoder_step_bound(cfg, seq_len, n, tp, pp, deferred_weight_grads=deferred, **kw)
            rows.append([n, "per chunk" if deferred else "per position", f"{b.weight_bytes / 2**30:.2f}GiB",
                         f"{b.key_bytes / 2**30:.3f}GiB", f"{1e3 * b.step_s:.3f}ms",
                         f"{b.bandwidth_tokens_per_s:,.0f}", f"{b.flop_tokens_per_s:,.0f}", b.binding,
                         f"{n * decoder_bytes_per_sequence / 2**30:.2f}GiB"])
    bw = kw.get("bandwidth", HBM_BYTES_PER_S["h100"])
    title = (f"Decoder step bound per GPU (T={seq_len}, TP={tp} PP={pp}, {bw / 1e12:.2f} TB/s, "
             f"FLOP bound at {100 * kw.get('mfu', 0.4):.0f}% of {kw.get('peak_flops', 989e12) / 1e12:.0f} TFLOP/s); "
             f"more sequences per step also multiply the decoder's activations")
    return table(["sequences/step", "weight grads", "weights/step", "keys/step", "step", "tokens/s (bandwidth)",
                  "tokens/s (FLOPs)", "binds", "decoder acts"], rows, title)
