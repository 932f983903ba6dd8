"""Plain data parallelism: sum gradients and statistics over the data-parallel group.

Each rank's loss is already divided by the global number of targets, so a
*sum* (not a mean) of gradients over data-parallel ranks is the exact
single-process gradient. Gradients are flattened into one buffer per dtype
so that a step costs one all-reduce, not one per parameter.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from rlt_scale.distributed import ParallelContext


def dp_sum(values: torch.Tensor, ctx: ParallelContext) -> torch.Tensor:
    """Sum a small CPU tensor over the data-parallel ranks (a copy; the input is untouched)."""
    out = values.clone()
    if ctx.dp > 1:
        moved = out.to(ctx.device)
        dist.all_reduce(moved, group=ctx.dp_group)
        out = moved.cpu()
    return out


def reduce_gradients(model: torch.nn.Module, ctx: ParallelContext) -> None:
    if ctx.dp == 1:
        return
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)  # every rank must take part in the same all-reduce
        by_dtype.setdefault(p.grad.dtype, []).append(p.grad)
    for grads in by_dtype.values():
        flat = _flatten_dense_tensors(grads)
        dist.all_reduce(flat, group=ctx.dp_group)
        for g, reduced in zip(grads, _unflatten_dense_tensors(flat, grads)):
            g.copy_(reduced)
