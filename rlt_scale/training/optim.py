"""AdamW with no decay on 1-D parameters, and a warmup + cosine schedule."""

from __future__ import annotations

import math

import torch

from rlt_scale.config import OptimizerConfig


def build_optimizer(model: torch.nn.Module, cfg: OptimizerConfig) -> torch.optim.AdamW:
    """Two groups: matrices decay; vectors and scalars (norms, biases, s_*, alpha) do not."""
    decay, no_decay = [], []
    for param in model.parameters():  # deduplicated: a tied weight appears once
        if param.requires_grad:
            (decay if param.dim() >= 2 else no_decay).append(param)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)


def lr_at(step: int, cfg: OptimizerConfig, max_steps: int) -> float:
    """Learning rate for optimizer step ``step`` (0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay = cfg.decay_steps or max(max_steps - cfg.warmup_steps, 1)
    progress = min((step - cfg.warmup_steps) / decay, 1.0)
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


class LRSchedule:
    """Sets the optimizer's learning rate per step; restorable from a checkpoint."""

    def __init__(self, optimizer: torch.optim.Optimizer, cfg: OptimizerConfig, max_steps: int):
        self.optimizer, self.cfg, self.max_steps = optimizer, cfg, max_steps
        self.step_count = 0

    def apply(self) -> float:
        lr = lr_at(self.step_count, self.cfg, self.max_steps)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        return lr

    def advance(self) -> None:
        self.step_count += 1

    def state_dict(self) -> dict:
        return {"step_count": self.step_count}

    def load_state_dict(self, state: dict) -> None:
        self.step_count = int(state["step_count"])
