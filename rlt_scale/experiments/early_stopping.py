"""Early stopping on validation accuracy, for the RLT's ``Trainer`` and the baselines.

:class:`EarlyStopper` keeps the best validation accuracy, the step it was
reached and a copy of those weights. A run stops when the validation accuracy
reaches ``target`` (the task is solved at the training length) or has not
improved by ``min_delta`` for ``patience`` evaluations; the best weights are
then restored for the test evaluation.

:class:`EarlyStoppingTrainer` is the ordinary :class:`~rlt_scale.training.trainer.Trainer`
(the ``rlt-train`` path: same loader, optimizer, schedule, checkpoints and
metrics) whose periodic evaluation on ``data.eval_path`` also measures
final-state accuracy and, when the stopper says so, ends ``fit()`` at the
current step (it lowers ``trainer.max_steps`` to the current step, so the
loop exits and saves its final checkpoint as usual). With a ``targets`` function
(:mod:`rlt_scale.experiments.supervision`) it trains on those targets instead of
the data's next-token targets; evaluation is unchanged.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch

from rlt_scale.config import Config
from rlt_scale.experiments.evaluate import Accuracy, batches_of, predictions
from rlt_scale.experiments.supervision import TargetFn, masked_cross_entropy
from rlt_scale.training.bptt import run_sequence
from rlt_scale.training.trainer import Trainer


def _snapshot(model: torch.nn.Module) -> dict:
    """A copy of the state dict (megatron layers add non-tensor ``_extra_state`` entries: kept as they are)."""
    return {k: v.detach().clone() if isinstance(v, torch.Tensor) else v for k, v in model.state_dict().items()}


@dataclass
class EarlyStopper:
    target: float = 0.995
    """Stop as soon as validation accuracy reaches this (1.0 or more: never stop for being solved)."""
    patience: int = 5
    """Stop after this many evaluations without an improvement of ``min_delta`` (0: never)."""
    min_delta: float = 0.002
    best_acc: float = -1.0
    best_step: int = 0
    stale: int = 0
    stopped_early: bool = False
    history: list[tuple[int, float]] = field(default_factory=list)
    best_state: Optional[dict] = None

    def update(self, step: int, acc: float, model: torch.nn.Module) -> bool:
        """Record ``acc`` at ``step``; returns True when training should stop."""
        self.history.append((step, acc))
        if acc > self.best_acc + self.min_delta or self.best_state is None:
            self.best_acc, self.best_step, self.stale = acc, step, 0
            self.best_state = _snapshot(model)
        else:
            self.stale += 1
            if acc > self.best_acc:  # a small gain still moves the kept weights, not the patience
                self.best_acc, self.best_step = acc, step
                self.best_state = _snapshot(model)
        stop = acc >= self.target or (self.patience > 0 and self.stale >= self.patience)
        self.stopped_early = self.stopped_early or stop
        return stop

    def restore(self, model: torch.nn.Module) -> None:
        """Load the best weights seen (no-op when nothing was evaluated)."""
        if self.best_state is not None:
            model.load_state_dict(self.best_state)


class EarlyStoppingTrainer(Trainer):
    """``Trainer`` whose evaluation on ``data.eval_path`` also drives early stopping on accuracy.

    The evaluation reads up to ``val_samples`` samples of the validation set
    once (loss and final-state accuracy in one pass) and returns the loss, so
    ``metrics.jsonl`` keeps its ``eval_loss`` records; the accuracy goes to
    ``val.jsonl`` in the run directory.
    """

    def __init__(self, cfg: Config, stopper: EarlyStopper, answer_tokens: Optional[Sequence[int]] = None,
                 val_samples: int = 512, val_batch_size: int = 256, targets: Optional[TargetFn] = None):
        super().__init__(cfg)
        self.stopper, self.answer_tokens = stopper, answer_tokens
        self.val_samples, self.val_batch_size = val_samples, val_batch_size
        self.targets = targets

    def forward_backward(self, batches: list[dict]) -> float:
        """The ordinary step, or with ``targets``: the mean loss over those targets (one process only)."""
        if self.targets is None:
            return super().forward_backward(batches)
        if self.ctx.world_size != 1 or self.zero is not None:
            raise NotImplementedError("task-specific targets are a single-process experiment feature")
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        pairs = [self.targets(b["tokens"]) for b in batches]
        n_targets = max(sum(int(valid.sum()) for _, valid in pairs), 1)
        total = 0.0
        for batch, (targets, valid) in zip(batches, pairs):
            with self._autocast():
                out = run_sequence(self.model, batch["tokens"], batch["doc_ids"], batch["loss_mask"], self.bptt,
                                   want_logits=True)
            loss = masked_cross_entropy(out.logits, targets, valid) / n_targets
            loss.backward()
            total += loss.item()
        return total

    @torch.no_grad()
    def evaluate(self) -> Optional[float]:
        path = self.cfg.data.eval_path
        if not path:
            return None
        self.model.eval()
        loss_sum, n_targets, acc = 0.0, 0, Accuracy(0, 0)
        for batch in batches_of(path, self.val_batch_size):
            if acc.total >= self.val_samples:
                break
            batch = {k: v[: self.val_samples - acc.total] for k, v in batch.items()}
            real = batch["loss_mask"][:, -1].bool()
            batch = self._to_device({k: v[real] for k, v in batch.items()})
            if not len(batch["tokens"]):
                continue
            with self._autocast():
                out = run_sequence(self.model, batch["tokens"], batch["doc_ids"], batch["loss_mask"], self.bptt,
                                   want_logits=True)
            loss_sum += float(out.loss_sum)
            n_targets += int(out.n_targets)
            pred = predictions(out.logits[:, -1].float(), self.answer_tokens)
            acc = acc + Accuracy(int((pred == batch["tokens"][:, -1]).sum()), len(pred))
        stop = self.stopper.update(self.step, acc.accuracy, self.model)
        with open(self.run_dir / "val.jsonl", "a") as f:
            f.write(json.dumps({"step": self.step, "val_acc": acc.accuracy, "val_samples": acc.total,
                                "best_acc": self.stopper.best_acc, "stop": stop}) + "\n")
        print(f"step {self.step:>6}  val acc {acc.accuracy:.4f} (best {self.stopper.best_acc:.4f} "
              f"at {self.stopper.best_step}){'  -> early stop' if stop else ''}", flush=True)
        if stop:
            self.cfg.trainer.max_steps = self.step  # the fit loop exits and saves its final checkpoint
        return loss_sum / max(n_targets, 1)
