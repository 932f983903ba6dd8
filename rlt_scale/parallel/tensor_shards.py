"""Tensor-parallel shards: which parameters are split, and how to reassemble them.

megatron-core marks every split parameter with ``tensor_model_parallel=True``
and the dimension it is split along (``partition_dim``); everything else
(norms, the merge, s_*) is replicated on every TP rank.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def is_tp_sharded(param: torch.Tensor) -> bool:
    return bool(getattr(param, "tensor_model_parallel", False))


def gather_full(tensor: torch.Tensor, param: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """A full-size copy of a (possibly) TP-sharded parameter's ``tensor`` (its data or grad)."""
    if not is_tp_sharded(param) or dist.get_world_size(group) == 1:
        return tensor.detach().clone()
    parts = [torch.empty_like(tensor) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=param.partition_dim)


def full_state(model: torch.nn.Module, group: dist.ProcessGroup, grads: bool = False) -> dict[str, torch.Tensor]:
    """Every parameter (or its gradient) at full size, by name; collective over ``group``."""
    out = {}
    for name, param in model.named_parameters():
        value = param.grad if grads else param.data
        if value is None:
            value = torch.zeros_like(param)
        out[name] = gather_full(value, param, group)
    return out
