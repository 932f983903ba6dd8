"""Model, optimizer and RNG state as layout-free ``torch.distributed.checkpoint`` state dicts.

Every tensor is named and shaped as in the *global* (single-process) model,
so ``torch.distributed.checkpoint`` (DCP) can write it from any TP x PP x DP x
ZeRO layout and read it back into any other (docs/CHECKPOINTS.md):

* ``model.<name>`` -- a parameter or persistent buffer. Names are global:
  pipeline stages replace other stages' modules with ``nn.Identity`` rather
  than renumbering, so ``encoder.3.attn...`` is called the same on every
  layout. A tensor-parallel shard (megatron's ``tensor_model_parallel`` with
  its ``partition_dim``) is a ``DTensor`` sharded along that dimension over
  the TP group; megatron's fused layers lay out their rows so that TP shards
  concatenate to the single-process weight. Everything else is a plain
  tensor, which DCP treats as replicated: written once, by one of the ranks
  holding it (DP replicas, TP copies of norms, pipeline replicas of a memory
  projection), and read by all of them.
* ``optimizer.<name>.exp_avg`` / ``.exp_avg_sq`` / ``.step`` -- AdamW's state
  for that parameter, sharded like it (``step`` has shape (1,)). Plain AdamW
  and DeepSpeed ZeRO-1/2 write the same keys (ZeRO through
  ``deepspeed.utils.safe_get/set_full_*``, which assemble a parameter's slice
  from the flat DP partitions), so a checkpoint moves between ZeRO stages, DP
  sizes and plain data parallelism freely.
* ``rng.<generator>.rank<R>`` -- one entry per global rank, meaningful only in
  the same layout; :class:`CheckpointManager` skips it otherwise.

ZeRO-1/2 here train fp32 parameters, and DeepSpeed copies its fp32 master
partition back into them after every step bit for bit, so ``model.<name>``
is also the master weight; loading sets both.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from rlt_scale.parallel.tensor_shards import is_tp_sharded

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def named_weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Parameters (a tied one once) and persistent buffers by global name: what a model is saved as."""
    persistent = model.state_dict(keep_vars=True)
    buffers = {name: buf for name, buf in model.named_buffers() if name in persistent}
    return {**dict(model.named_parameters()), **buffers}


def _fresh_adam_state(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """What torch's AdamW creates for ``param`` on its first step (non-capturable, non-fused)."""
    return {"step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
            "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format)}


class ModelOptimizerState:
    """The model's weights and AdamW state (plain, or partitioned by ZeRO) in the global format.

    With ``optimizer=None`` only the weights are saved or loaded (inference, export).
    """

    def __init__(self, model: torch.nn.Module, optimizer: Optional[torch.optim.Optimizer], ctx, zero=None):
        self.model, self.optimizer, self.ctx, self.zero = model, optimizer, ctx, zero
        self.weights = named_weights(model)
        self.params = dict(model.named_parameters())
        self.names = {param: name for name, param in self.params.items()}
        self._mesh: Optional[DeviceMesh] = None

    # ------------------------------------------------------------ global tensors
    def _global(self, local: torch.Tensor, like: torch.Tensor):
        """``local`` (shaped like ``like``'s local shard) as a tensor of the single-process model."""
        if not is_tp_sharded(like) or self.ctx.tp == 1:
            return local
        if self._mesh is None:
            self._mesh = DeviceMesh.from_group(self.ctx.tp_group, self.ctx.device.type)
        return DTensor.from_local(local, self._mesh, [Shard(like.partition_dim)], run_check=False)

    @staticmethod
    def _local(value) -> torch.Tensor:
        return value.to_local() if isinstance(value, DTensor) else value

    # ------------------------------------------------------------ the state dict
    def sharded_state_dict(self) -> dict:
        """Every tensor to save (copies; the optimizer's gathered over DP under ZeRO -- collective)."""
        out = {f"model.{name}": self._global(t.detach().clone(), t) for name, t in self.weights.items()}
        if self.optimizer is None:
            return out
        for name, state in self._adam_state().items():
            param = self.params[name]
            for key in ADAM_MOMENTS:
                out[f"optimizer.{name}.{key}"] = self._global(state[key], param)
            out[f"optimizer.{name}.step"] = state["step"]
        return out

    def load_targets(self) -> dict:
        """Empty tensors of :meth:`sharded_state_dict`'s keys and shapes, for DCP to load into."""
        out = {f"model.{name}": self._global(torch.empty_like(t), t) for name, t in self.weights.items()}
        if self.optimizer is None:
            return out
        for name, param in self.params.items():
            for key in ADAM_MOMENTS:
                out[f"optimizer.{name}.{key}"] = self._global(torch.empty_like(param, requires_grad=False), param)
            out[f"optimizer.{name}.step"] = torch.empty(1, dtype=torch.float32)
        return out

    def load_sharded_state_dict(self, loaded: dict) -> None:
        """Copy what DCP loaded into :meth:`load_targets` into the model and optimizer."""
        with torch.no_grad():
            for name, tensor in self.weights.items():
                tensor.copy_(self._local(loaded[f"model.{name}"]))
        if self.optimizer is None:
            return
        moments = {(name, key): self._local(loaded[f"optimizer.{name}.{key}"])
                   for name in self.params for key in ADAM_MOMENTS}
        steps = {name: loaded[f"optimizer.{name}.step"].reshape(()) for name in self.params}
        if self.zero is None:
            for name, param in self.params.items():
                state = self.optimizer.state.setdefault(param, {})
                for key in ADAM_MOMENTS:
                    state[key] = moments[name, key].to(param.dtype).clone()
                state["step"] = steps[name].clone()
        else:
            self._load_zero(moments, steps)

    # ------------------------------------------------------------ AdamW state
    def _adam_state(self) -> dict[str, dict[str, torch.Tensor]]:
        """Per parameter: exp_avg, exp_avg_sq (TP-local, full over DP) and step (shape (1,))."""
        if self.zero is None:
            out = {}
            for name, param in self.params.items():
                state = self.optimizer.state.get(param) or _fresh_adam_state(param)
                out[name] = {"exp_avg": state["exp_avg"].clone(), "exp_avg_sq": state["exp_avg_sq"].clone(),
                             "step": torch.as_tensor(state["step"], dtype=torch.float32).reshape(1).clone()}
            return out
        from deepspeed.utils import safe_get_full_optimizer_state

        zero_opt = self._zero_optimizer()
        steps = {}
        for i, group in enumerate(zero_opt.bit16_groups):
            step = zero_opt.optimizer.state[zero_opt.single_partition_of_fp32_groups[i]]["step"]
            steps.update({self.names[p]: torch.as_tensor(step, dtype=torch.float32).reshape(1).clone() for p in group})
        return {name: {**{k: safe_get_full_optimizer_state(param, k).to(param.dtype) for k in ADAM_MOMENTS},
                       "step": steps[name]}
                for name, param in self.params.items()}  # collective over DP, same order on every rank

    def _zero_optimizer(self):
        """DeepSpeed's ZeRO-1/2 optimizer with AdamW state for every group and each parameter's slice linked.

        State absent (before the first step) is created as AdamW's first step
        would. The links are redone for every group: DeepSpeed 0.19.8 links all
        groups right after stepping the *first* one, when the second group's
        state does not exist yet, and never again -- so with two parameter
        groups (decay / no decay) ``safe_get_full_optimizer_state`` would fail
        with "exp_avg not found in optimizer state fragment".
        """
        from deepspeed.utils import lazy_init_hp_params_optimizer_state

        zero_opt = self.zero.engine.optimizer
        for i, flat in enumerate(zero_opt.single_partition_of_fp32_groups):
            if not zero_opt.optimizer.state.get(flat):
                zero_opt.optimizer.state[flat] = _fresh_adam_state(flat)
            lazy_init_hp_params_optimizer_state(zero_opt.bit16_groups[i], flat, zero_opt.optimizer.state)
        return zero_opt

    def _load_zero(self, moments: dict, steps: dict) -> None:
        from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

        zero_opt = self._zero_optimizer()
        for name, param in self.params.items():
            safe_set_full_fp32_param(param, param.detach().float())  # the master copy = the loaded weight
            for key in ADAM_MOMENTS:
                safe_set_full_optimizer_state(param, moments[name, key].float(), key)
        for i, group in enumerate(zero_opt.bit16_groups):
            group_steps = {float(steps[self.names[p]]) for p in group}
            if len(group_steps) != 1:
                raise ValueError(f"ZeRO keeps one AdamW step per parameter group; the checkpoint has {sorted(group_steps)}")
            state = zero_opt.optimizer.state[zero_opt.single_partition_of_fp32_groups[i]]
            state["step"] = torch.tensor(group_steps.pop(), dtype=torch.as_tensor(state["step"]).dtype)


class RNGState:
    """The generators a resumed run needs to continue identically, one entry per global rank.

    ``layout_bound``: an entry belongs to a rank of one particular layout, so the
    checkpoint manager restores these only into the same layout and otherwise
    calls :meth:`reseed`.
    """

    layout_bound = True

    def __init__(self, ctx):
        self.ctx = ctx

    def _key(self, generator: str) -> str:
        return f"rng.{generator}.rank{self.ctx.rank:05d}"

    def sharded_state_dict(self) -> dict:
        states = {self._key("torch"): torch.get_rng_state()}
        if torch.cuda.is_available():
            states[self._key("cuda")] = torch.cuda.get_rng_state()
        return states

    def load_targets(self) -> dict:
        return {k: torch.empty_like(v) for k, v in self.sharded_state_dict().items()}

    def load_sharded_state_dict(self, loaded: dict) -> None:
        torch.set_rng_state(loaded[self._key("torch")])
        if torch.cuda.is_available():
            torch.cuda.set_rng_state(loaded[self._key("cuda")])

    def reseed(self, seed: int, step: int) -> None:
        """A deterministic fresh start for a new layout: a function of (seed, step, rank) only."""
        torch.manual_seed(seed + 1_000_003 * step + 7919 * self.ctx.rank)
