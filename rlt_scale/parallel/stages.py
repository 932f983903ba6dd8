"""Pipeline stages: which layers live where, and cutting a model down to one stage.

Stages hold contiguous, equal layer ranges, and encoder layer l sits with
decoder layer l, so tied weights stay on one stage. Stage 0 also holds the
embedding; the last stage the merge, the output norm and the readout (the
decoder ring closes there). A memory group is needed on every stage whose
decoder layers read it; its first such stage owns it, the others hold
replicas whose gradients are all-reduced with the owner's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlt_scale.config import ModelConfig
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


def cut_to_stage(model: RLT, plan: StagePlan) -> RLT:
    """Drop every module this stage does not run (in place) and mark memory replicas.

    The full model is built first on every stage so that each stage's weights
    are exactly the single-process model's (same initialisation stream).
    """
    cfg = model.cfg
    for i in range(cfg.n_enc_layers):
        if i not in plan.encoder_layers:
            model.encoder[i] = nn.Identity()
    for i in range(cfg.n_dec_layers):
        if i not in plan.decoder_layers:
            model.decoder[i] = nn.Identity()
    for g in range(cfg.memory_groups):
        if g not in plan.memory_groups:
            model.memory[g] = nn.Identity()
        elif stages_reading_group(cfg, g, plan.n_stages)[0] != plan.stage:
            for p in model.memory[g].parameters():
                p.pipeline_replica = True  # counted once (on the owner) in the gradient norm
                p.ds_pipe_replicated = True  # the same rule for DeepSpeed ZeRO's norm
    if not plan.first:
        model.embed = None
    if not plan.last:
        model.merge = None
        model.norm_out = None
        model.readout = None
    return model


def is_pipeline_replica(param: torch.Tensor) -> bool:
    return bool(getattr(param, "pipeline_replica", False))
