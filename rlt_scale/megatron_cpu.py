"""Route megatron-core's few hard-wired ``torch.cuda`` calls to the CPU.

megatron-core assumes a GPU in a handful of places that rlt-scale reaches:
buffers allocated on ``torch.cuda.current_device()`` (tensor-parallel
gather/scatter, the P2P communicator), ``torch.cuda.synchronize()`` and the
CUDA RNG state behind its model-parallel RNG tracker (``_get_cuda_rng_state``
/ ``_set_cuda_rng_state``, ``torch.cuda.get_rng_state`` / ``manual_seed``).
On a CPU-only machine each of those raises. :func:`route_megatron_to_cpu`
points them at the CPU equivalents, so the same code runs on CPU + gloo (the
tests, CI) and unchanged on GPUs + NCCL, where this module does nothing.

It is applied once, by :func:`rlt_scale.distributed.init_distributed`, and
only when CUDA is unavailable. It changes process-global functions, which is
why it lives in this one small module and nowhere else.
"""

from __future__ import annotations

import torch

_applied = False


def _cpu_device(*_args, **_kwargs) -> torch.device:
    return torch.device("cpu")


def _noop(*_args, **_kwargs) -> None:
    return None


def _get_cpu_rng_state(*_args, **_kwargs) -> torch.Tensor:
    return torch.get_rng_state()


def _set_cpu_rng_state(state: torch.Tensor, *_args, **_kwargs) -> None:
    torch.set_rng_state(state)


def _cpu_manual_seed(seed: int) -> None:
    torch.manual_seed(seed)


def route_megatron_to_cpu() -> bool:
    """Apply the routing if CUDA is unavailable; returns whether it is active."""
    global _applied
    if torch.cuda.is_available():
        return False
    if _applied:
        return True
    from megatron.core.tensor_parallel import random as mp_random

    torch.cuda.current_device = _cpu_device
    torch.cuda.synchronize = _noop
    torch.cuda.get_rng_state = _get_cpu_rng_state
    torch.cuda.set_rng_state = _set_cpu_rng_state
    torch.cuda.manual_seed = _cpu_manual_seed
    mp_random._get_cuda_rng_state = _get_cpu_rng_state
    mp_random._set_cuda_rng_state = _set_cpu_rng_state
    _applied = True
    return True
