"""Pipeline stages: which layers live where, and building one stage's part of the model.

Stages hold contiguous, equal layer ranges, and encoder layer l sits with
decoder layer l, so tied weights stay on one stage. Stage 0 also holds the
embedding; the last stage the merge, the output norm and the readout (the
decoder ring closes there). A memory group is needed on every stage whose
decoder layers read it; its first such stage owns it, the others hold
replicas that receive the same, complete gradient (see the ring pipeline).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from rlt_scale.config import ModelConfig
from rlt_scale.model import build_model
from rlt_scale.model.rlt import RLT


@dataclass(frozen=True)
class StagePlan:
    stage: int
    n_stages: int
    encoder_layers: range
    decoder_layers: range
    memory_groups: tuple[int, ...]
    """Memory groups read by this stage's decoder layers."""

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.n_stages - 1


def _split(n: int, parts: int, index: int) -> range:
    size = n // parts
    return range(index * size, (index + 1) * size)


def plan_stage(cfg: ModelConfig, stage: int, n_stages: int) -> StagePlan:
    if cfg.n_enc_layers % n_stages or cfg.n_dec_layers % n_stages:
        raise ValueError(f"parallel.pp={n_stages} must divide n_enc_layers={cfg.n_enc_layers} "
                         f"and n_dec_layers={cfg.n_dec_layers}")
    decoder = _split(cfg.n_dec_layers, n_stages, stage)
    groups = tuple(sorted({cfg.memory_group_of(layer) for layer in decoder}))
    return StagePlan(stage, n_stages, _split(cfg.n_enc_layers, n_stages, stage), decoder, groups)


def stages_reading_group(cfg: ModelConfig, group: int, n_stages: int) -> list[int]:
    return [s for s in range(n_stages) if group in plan_stage(cfg, s, n_stages).memory_groups]


def stage_parts(plan: StagePlan) -> Callable[[str], bool]:
    """Which model parts (names as in :class:`~rlt_scale.model.rlt.RLT`) this stage builds."""

    def holds(name: str) -> bool:
        kind, _, index = name.partition(".")
        if kind == "encoder":
            return int(index) in plan.encoder_layers
        if kind == "decoder":
            return int(index) in plan.decoder_layers
        if kind == "memory":
            return int(index) in plan.memory_groups
        if kind == "embed":
            return plan.first
        return plan.last  # merge, norm_out, readout

    return holds


def build_stage(cfg: ModelConfig, tp_group, plan: StagePlan) -> RLT:
    """This stage's part of the model, with the same weights as in the single-process model.

    Only the stage's parts are built (each part seeds its own initialisation),
    so no rank ever holds the whole model. Memory groups read on several
    stages are marked as replicas on all but the first.
    """
    model = build_model(cfg, tp_group, stage_parts(plan))
    for g in plan.memory_groups:
        if stages_reading_group(cfg, g, plan.n_stages)[0] != plan.stage:
            for p in model.memory[g].parameters():
                # Counted once (on the owner) in the gradient norm. DeepSpeed's attribute name,
                # so ZeRO's own norm follows the same rule as grad_norm.global_grad_norm.
                p.ds_pipe_replicated = True
    return model


def is_pipeline_replica(param: torch.Tensor) -> bool:
    return bool(getattr(param, "ds_pipe_replicated", False))
