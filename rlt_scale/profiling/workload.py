"""What one step is: batch shape, chunking, and the training step itself.

The cost model prices a :class:`Workload` and the measured mode and the
benches run the same one, through the same model code as training
(``run_sequence`` + the trainer's AdamW), so analytic and measured numbers
describe the same computation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from rlt_scale.config import ModelConfig, ParallelConfig
from rlt_scale.model import RLT, build_model
from rlt_scale.training.bptt import BPTT, SegmentPlan, run_sequence


@dataclass(frozen=True)
class Workload:
    """One micro-batch of ``batch`` samples of ``seq_len`` input tokens.

    ``chunk_size`` 0 runs the sample as one chunk; ``checkpoint`` recomputes
    each chunk's decoder in backward (``activation_checkpointing: chunk``).
    Samples hold one document each: packing changes only mask contents, and
    for K>1 adds block cuts at document starts.
    """

    batch: int = 8
    seq_len: int = 256
    chunk_size: int = 0
    checkpoint: bool = False
    recompute_encoder: bool = False
    """Also recompute every encoder layer in backward (``activation_checkpointing: full``)."""

    @property
    def chunk(self) -> int:
        """The longest chunk's length."""
        return max(b - a for a, b in self.plan(0).chunks)

    @property
    def tokens(self) -> int:
        return self.batch * self.seq_len

    def bptt(self) -> BPTT:
        return BPTT(chunk_size=self.chunk_size, checkpoint=self.checkpoint, recompute_encoder=self.recompute_encoder)

    def plan(self, feedback_block: int) -> SegmentPlan:
        """The segment plan of this workload's samples (one document each) for feedback blocks of K."""
        return SegmentPlan.single_document(self.seq_len, feedback_block, self.bptt())

    def describe(self) -> str:
        ckpt = f", chunks of {self.chunk} checkpointed" if self.checkpoint else (
            f", chunks of {self.chunk}" if self.chunk_size else "")
        return f"B={self.batch} x T={self.seq_len}{ckpt}" + (", encoder recomputed" if self.recompute_encoder else "")


def make_model(cfg: ModelConfig, seed: int = 0, device: str = "cpu") -> RLT:
    """A seeded single-process RLT (initialises the one-process world if needed)."""
    from rlt_scale.distributed import init_distributed

    ctx = init_distributed(ParallelConfig(), device=device)
    torch.manual_seed(seed)
    return build_model(cfg, ctx.tp_group).to(ctx.device)


def make_tokens(cfg: ModelConfig, work: Workload, seed: int = 0, device=None) -> torch.Tensor:
    """Random ``[B, T+1]`` token ids: costs do not depend on the values."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, cfg.vocab_size, (work.batch, work.seq_len + 1), generator=gen).to(device or "cpu")


def forward_backward(model: RLT, tokens: torch.Tensor, work: Workload) -> float:
    """Loss and gradients of one micro-batch, exactly as ``Trainer.train_step`` computes them."""
    out = run_sequence(model, tokens, bptt=work.bptt())
    loss = out.loss_sum / out.n_targets.clamp(min=1)
    loss.backward()
    return float(loss.detach())


def train_step(model: RLT, optimizer: Optional[torch.optim.Optimizer], tokens: torch.Tensor,
               work: Workload, grad_clip: float = 1.0) -> float:
    """A full optimizer step (zero grad, forward, backward, clip, AdamW) through the trainer's engine."""
    from rlt_scale.distributed import init_distributed
    from rlt_scale.training.engine import LocalEngine, PlainSync

    ctx = init_distributed(ParallelConfig(), device=tokens.device.type)
    engine = LocalEngine(model, ctx, PlainSync(model, optimizer, ctx, grad_clip), work.bptt())
    loss = engine.forward_backward([{"tokens": tokens}])
    engine.step(optimizer.param_groups[0]["lr"] if optimizer is not None else 0.0)
    return loss
