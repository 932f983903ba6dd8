"""Global gradient-norm clipping when parameters are split across ranks.

The norm must count every element of the *model* once: a TP-sharded gradient
contributes its shard on each TP rank, a replicated one only on TP rank 0
(its copies on the other ranks are identical), and a memory projection
replicated on several pipeline stages only on the stage that owns it. The
squared partial sums are
then added over the model-parallel group. Data-parallel replicas hold the
same (already reduced) gradients and are not summed again.
"""

from __future__ import annotations

from typing import Iterable, Optional

import torch
import torch.distributed as dist

from rlt_scale.parallel.tensor_shards import is_tp_sharded
from rlt_scale.parallel.stages import is_pipeline_replica


def global_grad_norm(params: Iterable[torch.Tensor], tp_rank: int, model_parallel_group: Optional[dist.ProcessGroup],
                     device: Optional[torch.device] = None) -> torch.Tensor:
    """The global L2 norm of the gradients, a float64 scalar on ``device`` (default: the parameters').

    A rank with nothing to count (no gradients, or only replicas another rank
    counts) still takes part in the all-reduce with a zero that must live on
    the communication device: NCCL rejects a CPU tensor. Pass the
    ParallelContext's device where ``params`` may be empty (the engines pass
    only the parameters that have gradients).
    """
    squares = None
    for p in params:
        if device is None:
            device = p.device
        if p.grad is None or (tp_rank != 0 and not is_tp_sharded(p)) or is_pipeline_replica(p):
            continue
        s = p.grad.detach().double().pow(2).sum()
        squares = s if squares is None else squares + s
    if squares is None:
        squares = torch.zeros((), dtype=torch.float64, device=device)
    if model_parallel_group is not None and dist.get_world_size(model_parallel_group) > 1:
        dist.all_reduce(squares, group=model_parallel_group)
    return squares.sqrt()


def clip_grads(params: list[torch.Tensor], max_norm: float, tp_rank: int, model_parallel_group,
               device: Optional[torch.device] = None) -> float:
    """Scale gradients so the global norm is at most ``max_norm`` (0: measure only)."""
    norm = global_grad_norm(params, tp_rank, model_parallel_group, device)
    if max_norm > 0:
        scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
        for p in params:
            if p.grad is not None:
                p.grad.mul_(scale.to(p.grad.dtype))
    return float(norm)
