"""Tensor-parallel wiring: the one place where model layers meet process groups.

The model's math is written against four factories (``column``, ``row``,
``vocab_embedding``, ``vocab_readout``) and one loss (``cross_entropy``).
They return megatron-core's tensor-parallel layers, so tensor parallelism is
a matter of passing a larger ``tp_group``; at TP=1 those layers compute
exactly what ``nn.Linear`` / ``nn.Embedding`` compute.

megatron-core's layers need ``torch.distributed`` to be initialised (even for
one process): :func:`rlt_scale.distributed.init_distributed` does that.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import ModelParallelConfig
from megatron.core.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    reduce_from_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)

DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16}


def _normal_init(std: float, weight: torch.Tensor) -> None:
    torch.nn.init.normal_(weight, mean=0.0, std=std)


@dataclass
class TensorParallel:
    """Builds tensor-parallel layers for one TP group.

    ``init_std`` initialises every weight; ``out_std`` the projections that
    write into the residual stream (GPT-2's 1/sqrt(2 * depth) scaling).
    """

    group: dist.ProcessGroup
    dtype: torch.dtype
    init_std: float
    out_std: float

    @classmethod
    def build(cls, group, params_dtype: str, init_std: float, applied_depth: int) -> "TensorParallel":
        return cls(group, DTYPES[params_dtype], init_std, init_std / math.sqrt(2 * applied_depth))

    @functools.cached_property
    def size(self) -> int:
        return dist.get_world_size(self.group)

    def sum(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the group, outside autograd: a row projection's output, or a
        column projection's input gradient, in a step that writes its own backward."""
        if self.size == 1:
            return x
        return reduce_from_tensor_model_parallel_region(x, group=self.group)

    def _megatron_config(self) -> ModelParallelConfig:
        # CPU initialisation draws the full weight from torch's CPU generator
        # and keeps this rank's slice: TP layouts start from identical models.
        return ModelParallelConfig(
            tensor_model_parallel_size=self.size,
            use_cpu_initialization=True,
            perform_initialization=True,
            params_dtype=self.dtype,
        )

    def column(self, in_features: int, out_features: int, bias: bool = False) -> "Linear":
        """Output features split across TP ranks (input replicated)."""
        layer = ColumnParallelLinear(
            in_features, out_features, config=self._megatron_config(),
            init_method=partial(_normal_init, self.init_std), bias=bias,
            gather_output=False, tp_group=self.group,
        )
        return Linear(layer)

    def row(self, in_features: int, out_features: int, bias: bool = False) -> "Linear":
        """Input features split across TP ranks; output all-reduced (replicated)."""
        layer = RowParallelLinear(
            in_features, out_features, config=self._megatron_config(),
            init_method=partial(_normal_init, self.out_std), bias=bias,
            input_is_parallel=True, skip_bias_add=False, tp_group=self.group,
        )
        return Linear(layer)

    def vocab_embedding(self, vocab_size: int, dim: int) -> VocabParallelEmbedding:
        return VocabParallelEmbedding(
            vocab_size, dim, config=self._megatron_config(),
            init_method=partial(_normal_init, self.init_std), tp_group=self.group,
        )

    def vocab_readout(self, dim: int, vocab_size: int) -> "Linear":
        """Readout whose logits stay split over the vocabulary (vocab-parallel loss)."""
        return self.column(dim, vocab_size)

    def cross_entropy(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Per-position cross-entropy of (vocab-parallel) logits, unreduced.

        megatron's vocab-parallel kernel computes in float32 (its choice for
        bf16 training); with one TP rank the full vocabulary is local and
        ``F.cross_entropy`` keeps the logits' dtype, which the float64
        equivalence tests need.
        """
        if self.size == 1:
            flat = F.cross_entropy(logits.flatten(0, -2), targets.flatten(), reduction="none")
            return flat.view(targets.shape)
        return vocab_parallel_cross_entropy(logits, targets).to(logits.dtype)

    def local(self, n: int, what: str) -> int:
        if n % self.size:
            raise ValueError(f"{what}={n} is not divisible by tensor-parallel size {self.size}")
        return n // self.size


class Linear(torch.nn.Module):
    """A megatron parallel linear that returns just the output tensor.

    megatron's layers return ``(output, bias)``; the model never defers the
    bias, so this wrapper keeps call sites reading like ``nn.Linear``.

    With one tensor-parallel rank megatron's layer is a plain matmul wrapped
    in three autograd functions (copy-to-region, the linear, reduce-from-
    region) that cost ~15% of a small model's recurrent step in Python
    overhead; there the same weight is applied with ``F.linear``, which is
    the identical computation. With TP > 1 megatron's layer runs as is. It
    flattens the two leading dims in backward, so inputs are made 3-D, and
    it carries CUDA-only autocast decorators: under CPU autocast its
    backward would mix bf16 gradients with fp32 weights, so on CPU it runs
    outside autocast in the weights' dtype.
    """

    def __init__(self, layer: torch.nn.Module):
        super().__init__()
        self.layer = layer
        self.parallel = layer.tp_group is not None and dist.get_world_size(layer.tp_group) > 1

    @property
    def weight(self) -> torch.Tensor:
        return self.layer.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.parallel:
            return F.linear(x, self.layer.weight, self.layer.bias)
        shape = x.shape
        x = x.reshape(-1, 1, shape[-1]) if x.dim() != 3 else x
        if x.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
            with torch.autocast("cpu", enabled=False):
                out, _ = self.layer(x.to(self.weight.dtype))
        else:
            out, _ = self.layer(x)
        return out.reshape(*shape[:-1], out.shape[-1])
