"""DeepSpeed ZeRO-1/2 data parallelism behind a four-call interface (docs/ZERO.md).

:class:`ZeroDataParallel` replaces the trainer's own data-parallel gradient
sum (:mod:`rlt_scale.parallel.data_parallel`), global-norm clipping
(:mod:`rlt_scale.parallel.grad_norm`) and ``optimizer.step()``; the forward
pass stays the trainer's (``run_sequence(model, ...)``), the optimizer is the
client torch AdamW of :func:`rlt_scale.training.optim.build_optimizer`, whose
state ZeRO partitions over the data-parallel ranks (stage 1: optimizer state;
stage 2: also the reduced gradients).

Gradient semantics are the trainer's: every rank's loss is already
``loss_sum / targets_of_the_whole_step_on_all_dp_ranks``, so the wanted
gradient is the plain SUM over data-parallel ranks and micro-batches.
DeepSpeed by default divides twice; both divisions are switched off
explicitly, not compensated by rescaling (which would add a rounding):

* the data-parallel mean: ``"gradient_allreduce_op": "sum"`` in the config
  (ZeRO-1/2 then skip their ``div_(dp_world_size)``);
* the ``1/gradient_accumulation_steps`` on the loss:
  ``engine.backward(loss, scale_wrt_gas=False)``.

Clipping is DeepSpeed's ``gradient_clipping``: the norm of the reduced
gradient partitions is summed over the DP ranks (disjoint partitions) and
then over ``mpu.get_model_parallel_group()``, counting a parameter on every
TP rank only when megatron marked it ``tensor_model_parallel`` (replicated
ones count on TP rank 0 only) -- the rule of
:func:`rlt_scale.parallel.grad_norm.global_grad_norm`.

Precision: ZeRO-1/2 keep fp32 master weights and reduce, clip-norm and
reassemble gradients in fp32 (``communication_data_type`` accepts only
fp16/bf16/fp32, ``safe_get_full_grad`` returns fp32, the CPU accelerator
lists no float64). float64 parameters would silently train in fp32, so they
are rejected here.
"""

from __future__ import annotations

import contextlib
import importlib
from typing import Optional

import torch
import torch.distributed as dist
from megatron.core import parallel_state as ps

from rlt_scale.errors import ConfigError
from rlt_scale.parallel.tensor_shards import gather_full



class MegatronMPU:
    """DeepSpeed's ``mpu`` over megatron-core's ``parallel_state``.

    What DeepSpeed 0.19.8 asks of it (ZeRO-1/2, no pipeline engine, no MoE):

    * ``get_model_parallel_group`` -- grad-norm SUM and overflow MAX
      all-reduces; ``get_model_parallel_rank/world_size`` -- checkpoint file
      naming. These are megatron's *model-parallel* group (TP x PP), which is
      the TP group while pp == 1; with pp > 1 the norm must also be summed over
      the stages and file names must differ per stage, so TP alone would be
      wrong there.
    * ``get_tensor_model_parallel_rank/world_size/group/src_rank`` -- preferred
      by ``deepspeed.utils.bwc``: ZeRO counts a replicated gradient in the norm
      only on TP rank 0.
    * ``get_pipeline_model_parallel_world_size/rank/group`` (bwc helpers).
    * ``get_data_parallel_world_size/rank/group/group_ranks`` -- the ZeRO
      partition group and the initial parameter broadcast source.

    Deliberately absent: ``initialize_sequence_parallel`` (its presence makes
    DeepSpeed treat the object as its own sequence-parallel mpu and ignore the
    model-parallel group) and ``get_sequence_parallel_*`` (absent = size 1).
    """

    def get_model_parallel_group(self):
        return ps.get_model_parallel_group()

    def get_model_parallel_world_size(self) -> int:
        return dist.get_world_size(group=ps.get_model_parallel_group())

    def get_model_parallel_rank(self) -> int:
        return dist.get_rank(group=ps.get_model_parallel_group())

    def get_tensor_model_parallel_group(self):
        return ps.get_tensor_model_parallel_group()

    def get_tensor_model_parallel_world_size(self) -> int:
        return ps.get_tensor_model_parallel_world_size()

    def get_tensor_model_parallel_rank(self) -> int:
        return ps.get_tensor_model_parallel_rank()

    def get_tensor_model_parallel_src_rank(self) -> int:
        return ps.get_tensor_model_parallel_src_rank()

    def get_pipeline_model_parallel_group(self):
        return ps.get_pipeline_model_parallel_group()

    def get_pipeline_model_parallel_world_size(self) -> int:
        return ps.get_pipeline_model_parallel_world_size()

    def get_pipeline_model_parallel_rank(self) -> int:
        return ps.get_pipeline_model_parallel_rank()

    def get_data_parallel_group(self):
        return ps.get_data_parallel_group()

    def get_data_parallel_world_size(self) -> int:
        return ps.get_data_parallel_world_size()

    def get_data_parallel_rank(self) -> int:
        return ps.get_data_parallel_rank()

    def get_data_parallel_group_ranks(self) -> list[int]:
        return dist.get_process_group_ranks(ps.get_data_parallel_group())


def deepspeed_config(micro_batch_size: int, grad_accum_steps: int, dp: int, grad_clip: float, zero_stage: int) -> dict:
    """The DeepSpeed config for the trainer's knobs (fp32, client optimizer)."""
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": grad_accum_steps,
        "train_batch_size": micro_batch_size * grad_accum_steps * dp,
        "gradient_clipping": float(grad_clip),
        "gradient_allreduce_op": "sum",  # the trainer's losses are pre-divided: sum, don't average
        "zero_optimization": {"stage": zero_stage, "overlap_comm": False},
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        "steps_per_print": None,
        "wall_clock_breakdown": False,
    }


def _skip_shm_comm_op() -> None:
    """Don't JIT-compile DeepSpeed's shared-memory comm op (30 s quiet, 591 s measured busy; then cached).

    DeepSpeed's TorchBackend builds it at init on the CPU accelerator, but only
    ``inference_all_reduce`` (inference kernels) uses it; ZeRO training goes
    through torch.distributed (gloo). Patched before the backend is created.
    """
    # importlib, not ``import deepspeed.comm.torch as m``: the package attribute
    # ``deepspeed.comm.torch`` is the real torch module, which that would patch.
    ds_torch = importlib.import_module("deepspeed.comm.torch")
    ds_torch.build_shm_op = lambda: None


class ZeroDataParallel:
    """ZeRO-1/2 over the trainer's model and client torch optimizer.

    Per optimizer step::

        for each micro-batch:   zero.backward(loss_sum / global_targets)
        norm = zero.step(lr)    # DP-sum done, clip by global norm, AdamW step
    """

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ctx, *, zero_stage: int,
                 micro_batch_size: int, grad_accum_steps: int, grad_clip: float, skip_shm_op: bool = True):
        if zero_stage not in (1, 2):
            raise ConfigError("parallel.zero_stage", f"ZeroDataParallel supports ZeRO stage 1 or 2, got {zero_stage}")
        dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
        if dtypes != {torch.float32}:
            raise ConfigError("model.params_dtype", f"DeepSpeed ZeRO-1/2 trains fp32 parameters "
                              f"(fp32 master weights and reductions); got {sorted(map(str, dtypes))}")
        import deepspeed

        if skip_shm_op and ctx.device.type == "cpu":
            _skip_shm_comm_op()
        self.ctx = ctx
        self.model = model
        self.grad_accum_steps = grad_accum_steps
        self.config = deepspeed_config(micro_batch_size, grad_accum_steps, ctx.dp, grad_clip, zero_stage)
        self.engine, self.optimizer, _, _ = deepspeed.initialize(
            model=model, optimizer=optimizer, config=self.config, mpu=MegatronMPU())
        self._micro = 0  # backward() calls in the current optimizer step
        self._boundary_done = False

    # ----------------------------------------------------------- the step
    def backward(self, loss: torch.Tensor, last: Optional[bool] = None) -> None:
        """Backward of one micro-batch's loss (already divided by the step's global target count).

        ``last`` marks the step's final micro-batch, on which ZeRO-1 reduces
        (ZeRO-2 reduces every micro-batch into its gradient partition); by
        default it is the ``grad_accum_steps``-th call since the last step().
        """
        if self._boundary_done:
            raise RuntimeError("backward() after the step's last micro-batch; call step() first")
        self._micro += 1
        if last is None:
            last = self._micro == self.grad_accum_steps
        # What engine.forward() does before each forward (the trainer calls the
        # model directly); no ZeRO hook fires between a forward and its backward.
        self.engine.optimizer.clear_backward_seen_flag()
        self.engine.set_gradient_accumulation_boundary(bool(last))
        self.engine.backward(loss, scale_wrt_gas=False)  # no 1/grad_accum_steps
        self._boundary_done = bool(last)

    @contextlib.contextmanager
    def accumulate(self):
        """All of a step's gradients come from many partial backward passes inside this block.

        The ring pipeline back-propagates segment by segment, so there is no
        single loss to hand to ``engine.backward``. DeepSpeed's
        ``coalesce_grad_reduction`` lets those passes accumulate plain
        ``.grad`` on the parameters and reduces them into ZeRO's partitions
        once, on exit; the block is the step's last (and only) micro-batch.
        """
        if self._boundary_done or self._micro:
            raise RuntimeError("accumulate() must hold all of a step's backward passes; call step() first")
        self.engine.optimizer.clear_backward_seen_flag()
        self.engine.set_gradient_accumulation_boundary(True)
        with self.engine.coalesce_grad_reduction():
            yield
        self._micro, self._boundary_done = 1, True

    def step(self, lr: float) -> float:
        """Set the learning rate, clip by the global grad norm, step; returns that norm (before clipping)."""
        if not self._boundary_done:
            raise RuntimeError("step() before the step's last micro-batch (backward(..., last=True))")
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.engine.step()
        if not self.engine.was_step_applied():
            raise RuntimeError("DeepSpeed skipped the optimizer step (overflow)")
        self._micro, self._boundary_done = 0, False
        return float(self.engine.get_global_grad_norm())

    # ------------------------------------------------------------ inspection
    def full_grads(self, tp_gather: bool = True) -> dict[str, torch.Tensor]:
        """Every parameter's reduced gradient at full size, by name (collective over DP, and TP if gathered).

        Valid after the step's last backward and before step(); fp32.
        """
        from deepspeed.utils import safe_get_full_grad

        if not self._boundary_done:
            raise RuntimeError("full_grads() needs the step's last backward first")
        out = {}
        for name, param in self.model.named_parameters():
            grad = safe_get_full_grad(param)
            if grad is None:
                grad = torch.zeros_like(param)
            grad = grad.detach().clone()
            out[name] = gather_full(grad, param, self.ctx.tp_group) if tp_gather else grad
        return out
