"""Early stopping on validation accuracy: a callback of the training loop.

:class:`EarlyStopper` keeps the best validation accuracy, the step it was
reached and a copy of those weights. A run stops when the validation accuracy
reaches ``target`` (the task is solved at the training length) or has not
improved by ``min_delta`` for ``patience`` evaluations; the best weights are
then restored for the test evaluation.

:meth:`EarlyStopper.callback` plugs it into the ordinary
:class:`~rlt_scale.training.trainer.Trainer` (the ``rlt-train`` loop, on any
layout): after each evaluation on ``data.eval_path`` the loop hands it the
global loss and answer accuracy, and ends ``fit()`` (with its final
checkpoint) when it says stop. Every rank sees the same sums, so every rank
stops at the same step; under pipeline parallelism each stage keeps the best
weights of its own layers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch


def snapshot(model: torch.nn.Module) -> dict:
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
            self.best_state = snapshot(model)
        else:
            self.stale += 1
            if acc > self.best_acc:  # a small gain still moves the kept weights, not the patience
                self.best_acc, self.best_step = acc, step
                self.best_state = snapshot(model)
        stop = acc >= self.target or (self.patience > 0 and self.stale >= self.patience)
        self.stopped_early = self.stopped_early or stop
        return stop

    def state_dict(self) -> dict:
        """The counters and history (JSON); the kept weights go into the checkpoint as :class:`KeptWeights`."""
        return {"best_acc": self.best_acc, "best_step": self.best_step, "stale": self.stale,
                "stopped_early": self.stopped_early, "history": [list(h) for h in self.history],
                "has_best": self.best_state is not None}

    def load_state_dict(self, state: dict) -> None:
        self.best_acc, self.best_step, self.stale = state["best_acc"], state["best_step"], state["stale"]
        self.stopped_early = state["stopped_early"]
        self.history = [(int(step), acc) for step, acc in state["history"]]
        if not state["has_best"]:  # KeptWeights, restored first, loaded the placeholder
            self.best_state = None

    STATE_NAME = "early_stopping"
    """The name of the stopper's counters and history in a checkpoint's ``meta.json`` state."""

    def checkpointed(self, model: torch.nn.Module, rank: int) -> dict:
        """What a :meth:`Trainer.checkpoint_also <rlt_scale.training.trainer.Trainer.checkpoint_also>` of
        this stopper saves, so that a resumed run stops where the uninterrupted one would have."""
        return {self.STATE_NAME: self, f"{self.STATE_NAME}_weights": KeptWeights(self, model, rank)}

    def restore(self, model: torch.nn.Module) -> None:
        """Load the best weights seen (no-op when nothing was evaluated)."""
        if self.best_state is not None:
            model.load_state_dict(self.best_state)

    def callback(self, log_file: Optional[Path] = None, log: Callable = print):
        """A :data:`~rlt_scale.training.trainer.EvalCallback`: update on each evaluation's accuracy.

        Rank 0 appends the step's record to ``log_file`` (``val.jsonl``) and logs a line.
        """

        def on_evaluate(trainer, step: int, sums) -> bool:
            stop = self.update(step, sums.accuracy, trainer.model)
            if trainer.ctx.is_logging_rank:
                if log_file is not None:
                    with open(log_file, "a") as f:
                        f.write(json.dumps({"step": step, "val_acc": sums.accuracy, "val_samples": int(sums.targets),
                                            "best_acc": self.best_acc, "stop": stop}) + "\n")
                log(f"step {step:>6}  val acc {sums.accuracy:.4f} (best {self.best_acc:.4f} at {self.best_step})"
                    f"{'  -> early stop' if stop else ''}")
            return stop

        return on_evaluate


class KeptWeights:
    """The stopper's best weights as sharded checkpoint state: each rank its own copy, under its own names.

    They are the rank's local parameters (a TP or PP shard), so they are ``layout_bound``: restored only
    into the layout that saved them. Before the first evaluation there are none; the model's current
    weights stand in, and :meth:`EarlyStopper.load_state_dict` (restored after this) drops them again.
    """

    layout_bound = True

    def __init__(self, stopper: EarlyStopper, model: torch.nn.Module, rank: int):
        self.stopper, self.model, self.prefix = stopper, model, f"early_stopping.best.rank{rank:05d}."

    def _weights(self) -> dict:
        return self.stopper.best_state if self.stopper.best_state is not None else self.model.state_dict()

    def sharded_state_dict(self) -> dict:
        return {self.prefix + k: v for k, v in self._weights().items() if isinstance(v, torch.Tensor)}

    def load_targets(self) -> dict:
        return {self.prefix + k: torch.empty_like(v) for k, v in self.model.state_dict().items()
                if isinstance(v, torch.Tensor)}

    def load_sharded_state_dict(self, loaded: dict) -> None:
        self.stopper.best_state = {k: loaded[self.prefix + k] if isinstance(v, torch.Tensor) else v
                                   for k, v in self.model.state_dict().items()}
