"""Engines: how a layout computes and applies one optimizer step's gradients.

The :class:`~rlt_scale.training.trainer.Trainer` is the loop -- data, learning
rate, logging, checkpoints, evaluation -- and knows nothing of layouts. An
engine is the layout:

* :class:`LocalEngine` -- every rank runs the whole model on its micro-batches
  (one process, tensor and data parallelism): one backward per micro-batch.
* :class:`RingEngine` -- pipeline stages run the decoder as a ring
  (:mod:`rlt_scale.parallel.pipeline`); many partial backward passes a step.

Either hands its gradients to a *gradient sync*: :class:`PlainSync` (sum over
the data-parallel ranks, clip by the global norm, AdamW) or :class:`ZeroSync`
(DeepSpeed ZeRO-1/2, which partitions the optimizer and does all three).
:func:`build_engine` picks both from the config.

What is trained is a plug-in, an :class:`Objective`: a function from a batch to
its targets and their validity mask (the data's next-token targets by default;
the state-tracking experiments' running-state targets), and for evaluation the
answer tokens whose accuracy to count. Every engine reads the same objective,
so an experiment runs under any layout.

The mean loss of a step divides by the valid targets of the whole step on all
data-parallel ranks, so summing gradients over the ranks gives exactly the
single-process gradient.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, Optional

import torch

from rlt_scale.distributed import ParallelContext
from rlt_scale.errors import ConfigError
from rlt_scale.model.rlt import RLT, answer_predictions
from rlt_scale.parallel.data_parallel import dp_sum, reduce_gradients
from rlt_scale.parallel.grad_norm import clip_grads
from rlt_scale.training.bptt import BPTT, Targets, next_token_targets, run_sequence
from rlt_scale.training import jacobi

@dataclass(frozen=True)
class Objective:
    """What a step trains, and what an evaluation counts besides the loss."""

    targets: Targets = next_token_targets
    """The loss's targets and which of them count."""
    answer_tokens: Optional[tuple[int, ...]] = None
    """When set, evaluation also counts valid targets predicted right, the prediction being
    the most likely of these token ids (a task's possible answers)."""


@dataclass
class LossSums:
    """Sums over every valid target of a forward pass (all data-parallel ranks)."""

    loss: float
    targets: float
    correct: float = 0.0

    @property
    def mean_loss(self) -> float:
        return self.loss / max(self.targets, 1.0)

    @property
    def accuracy(self) -> float:
        return self.correct / self.targets if self.targets else float("nan")


# ---------------------------------------------------------------- gradient syncs
class PlainSync:
    """Data parallelism by hand: sum gradients over DP, clip by the global norm, step AdamW.

    Without an optimizer (the profiler's forward/backward-only steps) it clips and stops there.
    """

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], ctx: ParallelContext,
                 grad_clip: float):
        self.model, self.optimizer, self.ctx, self.grad_clip = model, optimizer, ctx, grad_clip

    def zero_grad(self) -> None:
        (self.optimizer or self.model).zero_grad(set_to_none=True)

    def accumulate(self):
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        loss.backward()

    def finish_backward(self) -> None:
        reduce_gradients(self.model, self.ctx)

    def step(self, lr: float) -> float:
        params = [p for p in self.model.parameters() if p.grad is not None]
        norm = clip_grads(params, self.grad_clip, self.ctx.tp_rank, self.ctx.model_parallel_group, self.ctx.device)
        if self.optimizer is not None:
            self.optimizer.step()
        return norm


class ZeroSync:
    """DeepSpeed ZeRO-1/2 (:class:`~rlt_scale.parallel.zero.ZeroDataParallel`) manages the gradients."""

    def __init__(self, zero):
        self.zero = zero

    def zero_grad(self) -> None:  # DeepSpeed clears its (partitioned) gradients itself
        pass

    def accumulate(self):
        return self.zero.accumulate()

    def backward(self, loss: torch.Tensor, last: bool) -> None:
        self.zero.backward(loss, last=last)

    def finish_backward(self) -> None:  # DeepSpeed sums over the DP ranks in backward
        pass

    def step(self, lr: float) -> float:
        return self.zero.step(lr)


# ---------------------------------------------------------------------- engines
class Engine:
    """The common half: target counting, the gradient sync, the step. Subclasses run the passes."""

    def __init__(self, model: torch.nn.Module, ctx: ParallelContext, sync, bptt: BPTT,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext):
        self.model, self.ctx, self.sync, self.bptt, self.autocast = model, ctx, sync, bptt, autocast

    def forward_backward(self, batches: list[dict], objective: Objective = Objective()) -> float:
        """Accumulate the gradient of the step's mean loss over ``batches`` (this rank's micro-batches).

        Returns that mean loss (the same on every rank).
        """
        self.model.train()
        counts = torch.tensor([sum(int(objective.targets(b)[1].sum()) for b in batches)], dtype=torch.float64)
        n_targets = max(float(dp_sum(counts, self.ctx)[0]), 1.0)
        self.sync.zero_grad()
        loss_sum = self._forward_backward(batches, objective, n_targets)
        self.sync.finish_backward()
        return float(dp_sum(torch.tensor([loss_sum], dtype=torch.float64), self.ctx)[0]) / n_targets

    def step(self, lr: float) -> float:
        """Clip by the global gradient norm and step the optimizer; returns the norm before clipping."""
        return self.sync.step(lr)

    @property
    def zero(self):
        """The ZeRO optimizer wrapper when DeepSpeed manages the gradients, else None (for checkpoints)."""
        return getattr(self.sync, "zero", None)

    def metrics(self) -> dict:
        """What this layout adds to a logged step: the Jacobi decoder's sweeps, residuals and
        fall-backs since the last logged step, when it ran (``model.decoder_solver``)."""
        return jacobi.STATS.drain()

    @torch.no_grad()
    def forward_loss(self, batches: list[dict], objective: Objective = Objective()) -> LossSums:
        """Sums of a forward pass over ``batches``, added up over the data-parallel ranks (evaluation)."""
        self.model.eval()
        sums = torch.zeros(3, dtype=torch.float64)
        for part in self._eval_passes(batches):
            with self.autocast():
                sums += torch.tensor(self._forward_sums(part, objective), dtype=torch.float64)
        sums = dp_sum(sums, self.ctx)
        return LossSums(*map(float, sums))

    # ---- what a layout provides
    def _forward_backward(self, batches, objective, n_targets) -> float:
        raise NotImplementedError

    def _eval_passes(self, batches: list[dict]) -> list[list[dict]]:
        raise NotImplementedError

    def _forward_sums(self, batches: list[dict], objective: Objective) -> tuple[float, float, float]:
        raise NotImplementedError


def sequence_sums(model: torch.nn.Module, batch: dict, objective: Objective, bptt: BPTT,
                  count_correct: bool = False) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """(summed loss, valid targets, correct answers or None) of one batch through a whole model.

    The RLT walks the batch under ``bptt``; any other model (the experiments'
    baselines) maps ``tokens [B, T]`` (and the document ids of a batch that has
    them, ``[B, T]``) to logits ``[B, T, V]`` in one call.
    """
    targets, valid = objective.targets(batch)
    answers = objective.answer_tokens if count_correct else None
    if isinstance(model, RLT):
        out = run_sequence(model, batch["tokens"], batch.get("doc_ids"), batch.get("loss_mask"), bptt,
                           targets=(targets, valid), answer_tokens=answers)
        return out.loss_sum, out.n_targets, out.n_correct
    doc = batch.get("doc_ids")
    logits = model(batch["tokens"][:, :-1]) if doc is None else model(batch["tokens"][:, :-1], doc[:, :-1])
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten(), reduction="none")
    loss_sum = torch.where(valid.flatten(), loss, torch.zeros_like(loss)).sum()
    correct = None
    if answers is not None:
        correct = (answer_predictions(logits[valid], answers) == targets[valid]).sum()
    return loss_sum, valid.sum(), correct


def join_batches(batches: list[dict], group: int) -> list[dict]:
    """Consecutive groups of ``group`` micro-batches, each joined along the batch dimension."""
    if group <= 1:
        return batches
    return [{key: torch.cat([b[key] for b in batches[i:i + group]]) if batches[i].get(key) is not None else None
             for key in batches[i]}
            for i in range(0, len(batches), group)]


class LocalEngine(Engine):
    """Every rank runs the whole model (PP = 1): one forward and backward per pass.

    A pass is one micro-batch, or ``micro_per_pass`` of them joined
    (``trainer.decoder_sequences``): the decoder then advances all their
    sequences together, one weight read per position for all of them.
    """

    def __init__(self, model, ctx, sync, bptt, autocast=contextlib.nullcontext, micro_per_pass: int = 1):
        super().__init__(model, ctx, sync, bptt, autocast)
        self.micro_per_pass = micro_per_pass

    def _forward_backward(self, batches, objective, n_targets) -> float:
        loss_sum = 0.0
        batches = join_batches(batches, self.micro_per_pass)
        for i, batch in enumerate(batches):
            with self.autocast():
                loss, _, _ = sequence_sums(self.model, batch, objective, self.bptt)
            self.sync.backward(loss / n_targets, last=i == len(batches) - 1)
            loss_sum += float(loss.detach())
        return loss_sum

    def _eval_passes(self, batches):
        return [[b] for b in batches]

    def _forward_sums(self, batches, objective):
        (batch,) = batches
        loss, n, correct = sequence_sums(self.model, batch, objective, self.bptt, count_correct=True)
        return float(loss), float(n), float(correct) if correct is not None else 0.0


class RingEngine(Engine):
    """Pipeline stages; the decoder runs as a ring over a step's micro-batches (``pp`` > 1)."""

    def __init__(self, ring, model, ctx, sync, bptt, autocast=contextlib.nullcontext, micro_per_pass: int = 1):
        super().__init__(model, ctx, sync, bptt, autocast)
        self.ring, self.micro_per_pass = ring, micro_per_pass

    def _forward_backward(self, batches, objective, n_targets) -> float:
        # The ring runs many partial backward passes; ZeRO reduces their sum once.
        # Autocast spans the ring's backward too: chunk recomputation happens there.
        with self.sync.accumulate(), self.autocast():
            return self.ring.forward_backward(batches, n_targets, objective.targets)

    def metrics(self) -> dict:
        stats = self.ring.stats  # rank 0 is stage 0; its bubble is representative
        return {"ring_idle": stats.measured_idle_fraction, "ring_idle_scheduled": stats.idle_fraction}

    def _eval_passes(self, batches):
        k = self.micro_per_pass  # a pass takes a step's worth of micro-batches, as in training
        return [batches[i:i + k] for i in range(0, len(batches), k)]

    def _forward_sums(self, batches, objective):
        return self.ring.forward_loss(batches, objective.targets, objective.answer_tokens)


def rank_model(cfg, ctx: ParallelContext):
    """This rank's share of the RLT of ``cfg`` (a ``ModelConfig``) and its pipeline stage (None at PP = 1).

    The whole model (TP-split) at PP = 1, else only the parts of its stage.
    """
    from rlt_scale.model import build_model
    from rlt_scale.parallel.stages import build_stage, plan_stage

    if ctx.pp == 1:
        return build_model(cfg, ctx.tp_group), None
    stage = plan_stage(cfg, ctx.pp_rank, ctx.pp)
    return build_stage(cfg, ctx.tp_group, stage), stage


def build_engine(cfg, ctx: ParallelContext, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 autocast: Callable[[], contextlib.AbstractContextManager] = contextlib.nullcontext,
                 stage_plan=None) -> Engine:
    """The engine for ``cfg``'s layout: local or ring, with plain or ZeRO gradient sync.

    ``stage_plan`` is this rank's pipeline stage (``parallel.stages.plan_stage``) when ``pp`` > 1.
    """
    t = cfg.trainer
    if cfg.parallel.zero_stage:
        from rlt_scale.parallel.zero import ZeroDataParallel

        sync = ZeroSync(ZeroDataParallel(model, optimizer, ctx, zero_stage=cfg.parallel.zero_stage,
                                         micro_batch_size=t.micro_batch_size, grad_accum_steps=t.grad_accum_steps,
                                         grad_clip=cfg.optimizer.grad_clip))
    else:
        sync = PlainSync(model, optimizer, ctx, cfg.optimizer.grad_clip)
    bptt = BPTT.from_trainer(t)
    if ctx.pp > 1:
        from rlt_scale.parallel.pipeline import RingPipeline

        if stage_plan is None:
            raise ConfigError("parallel.pp", "a prebuilt model (a baseline) runs in one pipeline stage, got pp="
                                             f"{ctx.pp}")

        ring = RingPipeline(model, stage_plan, ctx, bptt)
        return RingEngine(ring, model, ctx, sync, bptt, autocast, micro_per_pass=t.grad_accum_steps)
    group = t.decoder_sequences // t.micro_batch_size if t.decoder_sequences else 1
    return LocalEngine(model, ctx, sync, bptt, autocast, micro_per_pass=group)
