"""``FlopCounterMode`` that also counts the CPU attention kernel, and a step counter.

On CPU, ``F.scaled_dot_product_attention`` with a mask dispatches to
``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward),
which torch's flop registry does not list (it lists the CUDA flash,
efficient and cuDNN kernels). Without a formula FlopCounterMode silently
counts attention as zero on CPU. :func:`flop_counter` registers torch's own
SDPA formulas for the CPU kernels, so CPU and GPU counts agree.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch.utils.flop_counter import FlopCounterMode, flop_registry, sdpa_backward_flop_count, sdpa_flop_count

aten = torch.ops.aten


def _sdpa_forward(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """torch's formula for the CUDA kernels (two matmuls), applied to the CPU kernel."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def _sdpa_backward(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """torch's backward formula: five matmuls, one of them recomputing the scores."""
    return sdpa_backward_flop_count(grad_out_shape, query_shape, key_shape, value_shape)


def _cpu_sdpa_mapping() -> dict:
    mapping = {}
    fwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    bwd = getattr(aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)
    if fwd is not None and fwd not in flop_registry:
        mapping[fwd] = _sdpa_forward
    if bwd is not None and bwd not in flop_registry:
        mapping[bwd] = _sdpa_backward
    return mapping


def flop_counter(display: bool = False) -> FlopCounterMode:
    """A ``FlopCounterMode`` whose registry also covers the CPU attention kernels."""
    return FlopCounterMode(display=display, custom_mapping=_cpu_sdpa_mapping())


def flop_formulas() -> dict:
    """The (op packet -> formula) table ``flop_counter`` uses, for other dispatch modes."""
    return flop_counter().flop_registry


@dataclass
class CountedFlops:
    """FLOPs that ``FlopCounterMode`` counted for one forward and one backward."""

    forward: int
    backward: int
    """Backward pass, including any checkpoint recomputation it triggers."""

    @property
    def total(self) -> int:
        return self.forward + self.backward


def count_step_flops(forward: Callable[[], torch.Tensor]) -> CountedFlops:
    """Run ``forward()`` (returns a scalar loss) and its backward under FlopCounterMode."""
    with flop_counter() as fwd_counter:
        loss = forward()
    with flop_counter() as bwd_counter:
        loss.backward()
    return CountedFlops(fwd_counter.get_total_flops(), bwd_counter.get_total_flops())
