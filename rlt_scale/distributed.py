"""Process groups: torch.distributed plus megatron-core's TP/PP/DP groups.

megatron-core's tensor-parallel layers and loss need initialised process
groups even in a single process, so every entry point (training, generation,
tests) calls :func:`init_distributed` first. Launched by ``torchrun`` or the
``deepspeed`` launcher it joins the job through ``env://``; run as a plain
process it forms a world of one in memory.
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from rlt_scale.config import ParallelConfig
from rlt_scale.errors import ConfigError
from rlt_scale.megatron_cpu import route_megatron_to_cpu


@dataclass
class ParallelContext:
    """This rank's place in the TP x PP x DP layout."""

    world_size: int
    rank: int
    tp: int
    pp: int
    dp: int
    dp_rank: int
    tp_rank: int
    tp_group: dist.ProcessGroup
    dp_group: dist.ProcessGroup
    model_parallel_group: dist.ProcessGroup
    """TP x PP ranks holding one replica of the model (gradient norms sum over it)."""
    pp_rank: int
    pp_group: dist.ProcessGroup
    pp_ranks: list[int]
    """Global ranks of this rank's pipeline, stage 0 first."""
    device: torch.device

    @property
    def is_logging_rank(self) -> bool:
        return self.rank == 0


def pick_device(name: str) -> torch.device:
    if name == "cuda" or (name == "auto" and torch.cuda.is_available()):
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local)
    return torch.device("cpu")


def init_distributed(cfg: ParallelConfig, device: str = "auto") -> ParallelContext:
    """Join (or form) the process group and build megatron's TP/PP/DP groups."""
    dev = pick_device(device)
    if dev.type == "cpu":
        route_megatron_to_cpu()
    backend = cfg.backend if cfg.backend != "auto" else ("nccl" if dev.type == "cuda" else "gloo")
    timeout = datetime.timedelta(seconds=cfg.timeout_s)
    if not dist.is_initialized():
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            dist.init_process_group(backend, timeout=timeout)
        else:
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
    world = dist.get_world_size()
    if world % (cfg.tp * cfg.pp):
        raise ConfigError("parallel.tp", f"tp={cfg.tp} x pp={cfg.pp} must divide the world size {world}")
    dp = world // (cfg.tp * cfg.pp)
    if cfg.dp and cfg.dp != dp:
        raise ConfigError("parallel.dp", f"world {world} / (tp {cfg.tp} x pp {cfg.pp}) = {dp}, got dp={cfg.dp}")
    if ps.model_parallel_is_initialized():
        if ps.get_tensor_model_parallel_world_size() != cfg.tp or ps.get_pipeline_model_parallel_world_size() != cfg.pp:
            ps.destroy_model_parallel()
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(
            tensor_model_parallel_size=cfg.tp,
            pipeline_model_parallel_size=cfg.pp,
            distributed_timeout_minutes=max(1, cfg.timeout_s // 60),
        )
    return ParallelContext(
        world_size=world,
        rank=dist.get_rank(),
        tp=cfg.tp,
        pp=cfg.pp,
        dp=dp,
        dp_rank=ps.get_data_parallel_rank(),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        tp_group=ps.get_tensor_model_parallel_group(),
        dp_group=ps.get_data_parallel_group(),
        model_parallel_group=ps.get_model_parallel_group(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        pp_group=ps.get_pipeline_model_parallel_group(),
        pp_ranks=dist.get_process_group_ranks(ps.get_pipeline_model_parallel_group()),
        device=dev,
    )
