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

Memory: a save hands DCP the live tensors, not copies. ``dcp.save`` is
synchronous -- it has written every byte before it returns, and nothing
trains meanwhile -- so a copy would only double the model and optimizer in
memory for the length of the save. DCP's file writer itself copies a tensor
only when it is a view into a larger storage, one tensor at a time. Under
ZeRO no rank gathers a full moment either: each rank writes the pieces of
its own partition (:class:`RowMajorPieces`), so a save adds at most the
largest single tensor (plus the writer's buffers) to what training holds.
"""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard

from rlt_scale.parallel.stages import is_pipeline_replica
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


def _unstepped_adam_state(param: torch.Tensor) -> dict[str, torch.Tensor]:
    """:func:`_fresh_adam_state`'s values for a save, without allocating them.

    The moments are one zero broadcast to the parameter's shape (stride 0):
    DCP's writer materialises such a view one tensor at a time as it writes,
    so saving before the first step does not create a whole optimizer's
    worth of zeros at once.
    """
    zero = torch.zeros((), dtype=param.dtype, device=param.device)
    return {"step": torch.tensor(0.0, dtype=torch.float32),
            "exp_avg": zero.expand(param.shape), "exp_avg_sq": zero.expand(param.shape)}


def row_major_boxes(shape: Sequence[int], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Split the elements ``[start, stop)`` of a row-major tensor of ``shape`` into boxes, in order.

    Each box is ``(offsets, sizes)`` and is itself contiguous in row-major
    order, so it is a plain view of the flat range: the elements
    ``[start, stop)`` are the boxes' elements one after the other. A range
    splits into a partial first row, whole rows and a partial last row, the
    partial rows recursively along the next dimension: at most
    ``2 * ndim - 1`` boxes.
    """
    if start >= stop:
        return []
    if not shape:  # a scalar: one element, one box
        return [((), ())]
    inner = math.prod(shape[1:])
    first, head = divmod(start, inner)
    last, tail = divmod(stop, inner)
    if first == last:  # inside one row
        return [((first, *o), (1, *z)) for o, z in row_major_boxes(shape[1:], head, tail)]
    boxes = []
    if head:
        boxes += [((first, *o), (1, *z)) for o, z in row_major_boxes(shape[1:], head, inner)]
        first += 1
    if last > first:
        boxes.append(((first, *[0] * (len(shape) - 1)), (last - first, *shape[1:])))
    if tail:
        boxes += [((last, *o), (1, *z)) for o, z in row_major_boxes(shape[1:], 0, tail)]
    return boxes


class RowMajorPieces(torch.Tensor):
    """A global tensor of which this rank writes some boxes, each a view of memory it already holds.

    DeepSpeed ZeRO-1/2 keep a parameter's AdamW moments as one contiguous run
    of the parameter's row-major elements (its *fragment*) inside each data-
    parallel rank's flat fp32 partition. Gathering the full moment on one rank
    (``safe_get_full_optimizer_state``) costs a full-size buffer per tensor and
    a collective; instead every rank hands DCP its own fragment, split by
    :func:`row_major_boxes` into boxes of the global tensor. DCP records them
    as that tensor's chunks, so the checkpoint holds the same key, shape and
    values as one written from a full tensor, and loads into any layout.

    The protocol is DCP's ``_Checkpointable`` (what ``DTensor`` implements):
    ``__create_write_items__`` names the boxes, ``__get_tensor_shard__`` hands
    one over at write time. A rank may hold no box (an empty list): the other
    ranks write the whole tensor. The object only exists to be saved;
    it is not a tensor to compute with.
    """

    _pieces: list[tuple[tuple[int, ...], torch.Tensor]]

    @staticmethod
    def __new__(cls, size: Sequence[int], pieces: list[tuple[tuple[int, ...], torch.Tensor]],
                dtype: torch.dtype, device: torch.device):
        out = torch.Tensor._make_wrapper_subclass(cls, torch.Size(size), dtype=dtype, device=device)
        out._pieces = pieces
        return out

    @classmethod
    def from_fragment(cls, fragment: torch.Tensor, start: int, local_shape: Sequence[int],
                      global_size: Sequence[int], offset: Sequence[int]) -> "RowMajorPieces":
        """``fragment``: the elements from ``start`` on of a row-major tensor of ``local_shape`` placed
        at ``offset`` in the global tensor (its TP shard's position)."""
        pieces, at = [], 0
        for box, sizes in row_major_boxes(local_shape, start, start + fragment.numel()):
            n = math.prod(sizes)
            pieces.append((tuple(b + o for b, o in zip(box, offset)), fragment.narrow(0, at, n).view(sizes)))
            at += n
        return cls(global_size, pieces, fragment.dtype, fragment.device)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise TypeError(f"{cls.__name__} only carries pieces for a checkpoint save; {func} is not defined on it")

    def __repr__(self) -> str:  # the default would dispatch an op
        return f"{type(self).__name__}(size={tuple(self.shape)}, pieces={[tuple(o) for o, _ in self._pieces]})"

    def pieces(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        """``(offsets in the global tensor, view)`` of every box this rank writes."""
        return list(self._pieces)

    def __create_write_items__(self, fqn: str, object: Any) -> list[WriteItem]:
        return [WriteItem(index=MetadataIndex(fqn, torch.Size(offsets)), type=WriteItemType.SHARD,
                          tensor_data=TensorWriteData(
                              chunk=ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=piece.shape),
                              properties=TensorProperties.create_from_tensor(piece), size=self.shape))
                for offsets, piece in self._pieces]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(o), sizes=p.shape) for o, p in self._pieces]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        for offsets, piece in self._pieces:
            if torch.Size(offsets) == index.offset:
                return piece
        raise ValueError(f"{index.fqn}: this rank holds no piece at {index.offset}")


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
        """Every tensor to save: the live weights and AdamW state, not copies (see the module's "Memory").

        Valid until the model or optimizer changes, i.e. for a synchronous
        ``dcp.save`` right away. Under ZeRO each rank contributes its own
        partition of the moments (:class:`RowMajorPieces`); no collective.
        """
        out = {f"model.{name}": self._global(t.detach(), t) for name, t in self.weights.items()}
        if self.optimizer is None:
            return out
        if self.zero is not None:
            return {**out, **self._zero_adam_state()}
        for name, param in self.params.items():
            state = self.optimizer.state.get(param) or _unstepped_adam_state(param)
            for key in ADAM_MOMENTS:
                out[f"optimizer.{name}.{key}"] = self._global(state[key], param)
            out[f"optimizer.{name}.step"] = torch.as_tensor(state["step"], dtype=torch.float32).reshape(1)
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
    def _zero_adam_state(self) -> dict:
        """``optimizer.*`` entries under ZeRO-1/2: each moment as this rank's pieces of it.

        DeepSpeed links every parameter that has elements in this rank's
        partition to its *fragment* there (``param._hp_mapping``, what
        ``safe_get_full_optimizer_state`` reads): the elements from
        ``lp_fragment_address.start`` of the flattened (TP-local) parameter,
        and views of them in the optimizer state. A parameter with no element
        here has no mapping. Only one rank of the model writes a copy:
        TP-replicated parameters are written from TP rank 0 only (the other
        TP ranks partition identical copies), pipeline replicas of the memory
        projection from the stage that owns them (they are identical too).
        """
        zero_opt = self._zero_optimizer()
        out = {}
        for i, group in enumerate(zero_opt.bit16_groups):
            step = zero_opt.optimizer.state[zero_opt.single_partition_of_fp32_groups[i]]["step"]
            for p in group:
                out[f"optimizer.{self.names[p]}.step"] = torch.as_tensor(step, dtype=torch.float32).reshape(1)
        for name, param in self.params.items():
            tp_sharded = is_tp_sharded(param) and self.ctx.tp > 1
            mapping = getattr(param, "_hp_mapping", None)
            writes = mapping is not None and not is_pipeline_replica(param) and (tp_sharded or self.ctx.tp_rank == 0)
            offset, size = [0] * param.dim(), list(param.shape)
            if tp_sharded:
                offset[param.partition_dim] = self.ctx.tp_rank * param.shape[param.partition_dim]
                size[param.partition_dim] *= self.ctx.tp
            for key in ADAM_MOMENTS:
                if writes:
                    fragment = mapping.get_optim_state_fragment(key)
                    pieces = RowMajorPieces.from_fragment(fragment, mapping.lp_fragment_address.start,
                                                          param.shape, size, offset)
                else:
                    pieces = RowMajorPieces(size, [], torch.float32, param.device)
                out[f"optimizer.{name}.{key}"] = pieces
        return out

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
