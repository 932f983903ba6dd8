"""Measured mode: run the real model and attribute FLOPs, time and memory per layer.

One instrumented step runs under :class:`LayerProfiler`, a
``TorchDispatchMode`` that sees every aten op of forward, backward and
checkpoint recomputation, with the layer and component each belongs to
(:mod:`.scopes`):

* FLOPs with the formula table of ``FlopCounterMode`` (:mod:`.counting`);
  a separate ``FlopCounterMode`` step gives the totals to compare.
* Op time (kernel wall time; on CUDA each op is synchronised).
* Memory: every storage an op allocates is tracked until it is freed, so
  the live tensor bytes, their peak and the component that allocated them
  are known; ``saved_tensors_hooks`` mark which of them autograd holds for
  backward (the activations). Kernel-internal scratch is not seen.

Step time and process memory come from separate, uninstrumented steps:
median wall time, and the peak RSS of one step (CPU, :mod:`.rss`) or
``torch.cuda.max_memory_allocated`` (GPU).
"""

from __future__ import annotations

import statistics
import time
import weakref
from collections import OrderedDict
from dataclasses import asdict, dataclass, field
from typing import Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlt_scale.config import ModelConfig
from rlt_scale.model import RLT
from rlt_scale.training.bptt import run_sequence
from rlt_scale.profiling import rss
from rlt_scale.profiling.counting import CountedFlops, count_step_flops, flop_formulas
from rlt_scale.profiling.scopes import ScopeTracker
from rlt_scale.profiling.workload import Workload, forward_backward, make_tokens

PHASES = ("fwd", "bwd", "recompute")


@dataclass
class MeasuredComponent:
    """What one component of one layer did in the instrumented step."""

    layer: str
    component: str
    fwd_flops: int = 0
    bwd_flops: int = 0
    recompute_flops: int = 0
    fwd_s: float = 0.0
    bwd_s: float = 0.0
    recompute_s: float = 0.0
    ops: int = 0
    saved_bytes: int = 0
    """Bytes this component allocated that autograd saved for backward (alive at the end of forward)."""
    held_bytes: int = 0
    """Bytes this component allocated that are still alive at the end of forward (saved or carried)."""
    peak_live_bytes: int = 0
    """Highest live tensor bytes (whole step) seen while this component allocated."""

    @property
    def flops(self) -> int:
        return self.fwd_flops + self.bwd_flops + self.recompute_flops

    @property
    def seconds(self) -> float:
        return self.fwd_s + self.bwd_s + self.recompute_s


@dataclass
class MeasuredStep:
    """Measured mode's result for one configuration and workload."""

    work: Workload
    device: str
    threads: int
    rows: list[MeasuredComponent] = field(default_factory=list)
    counted: Optional[CountedFlops] = None
    """FlopCounterMode's totals for one step (independent of the per-layer attribution)."""
    step_times_s: list[float] = field(default_factory=list)
    peak_live_bytes: int = 0
    """Peak bytes of tensors allocated during the instrumented step."""
    peak_live_phase: str = ""
    saved_bytes: int = 0
    """Activation bytes autograd saved for backward, alive at the end of forward."""
    held_bytes: int = 0
    """All bytes allocated in forward and alive at its end (activations, carried state, loss)."""
    step_peak_bytes: Optional[int] = None
    """Peak process memory of the first (uninstrumented) step above its start: RSS on CPU,
    including one-time allocations; allocator bytes on CUDA."""
    parameters: int = 0

    @property
    def step_s(self) -> float:
        return statistics.median(self.step_times_s) if self.step_times_s else float("nan")

    def by_layer(self) -> "OrderedDict[str, MeasuredComponent]":
        out: OrderedDict[str, MeasuredComponent] = OrderedDict()
        for r in self.rows:
            acc = out.setdefault(r.layer, MeasuredComponent(r.layer, "*"))
            for name in ("fwd_flops", "bwd_flops", "recompute_flops", "fwd_s", "bwd_s", "recompute_s",
                         "ops", "saved_bytes", "held_bytes"):
                setattr(acc, name, getattr(acc, name) + getattr(r, name))
            acc.peak_live_bytes = max(acc.peak_live_bytes, r.peak_live_bytes)
        return out

    def to_dict(self) -> dict:
        out = asdict(self)
        out["step_s"] = self.step_s
        out["counted_total"] = self.counted.total if self.counted else None
        return out


class LayerProfiler(TorchDispatchMode):
    """Per-(layer, component, phase) FLOPs, op time and memory of everything run inside it."""

    def __init__(self, model: RLT):
        super().__init__()
        self.scopes = ScopeTracker(model)
        self.formulas = flop_formulas()
        self.rows: OrderedDict[tuple[str, str], MeasuredComponent] = OrderedDict()
        self.live: dict[int, tuple[int, tuple[str, str]]] = {}
        self.live_bytes = 0
        self.peak = 0
        self.peak_phase = ""
        self.saved: dict[int, tuple[int, tuple[str, str]]] = {}
        self.saved_total = self.held_total = 0  # set by end_forward
        self.sync = next(model.parameters()).is_cuda

    # ------------------------------------------------------------- memory
    def _free(self, key: int) -> None:
        nbytes, _ = self.live.pop(key, (0, None))
        self.saved.pop(key, None)
        self.live_bytes -= nbytes

    def _track(self, args, out, scope: tuple[str, str], phase: str) -> None:
        """Count storages ``out`` allocated (views and in-place results share an input's)."""
        inputs = {id(t.untyped_storage()) for t in _flat(args) if t.device.type != "meta"}
        for t in _flat(out):
            if t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = id(storage)
            if key in self.live or key in inputs:
                continue
            nbytes = storage.nbytes()
            self.live[key] = (nbytes, scope)
            self.live_bytes += nbytes
            weakref.finalize(storage, self._free, key)
        if self.live_bytes > self.peak:
            self.peak, self.peak_phase = self.live_bytes, f"{phase} {scope[0]}/{scope[1]}"

    def _pack(self, t: torch.Tensor):
        key = id(t.untyped_storage())
        if key in self.live and key not in self.saved:
            self.saved[key] = self.live[key]
        return t

    def saving(self):
        """Context for the forward: records which allocations autograd keeps for backward."""
        return torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def end_forward(self) -> tuple[int, int]:
        """Attribute what forward leaves alive; returns (saved, held) bytes."""
        saved = held = 0
        for key, (nbytes, scope) in self.live.items():
            row = self._row(scope)
            row.held_bytes += nbytes
            held += nbytes
            if key in self.saved:
                row.saved_bytes += nbytes
                saved += nbytes
        self.saved.clear()
        return saved, held

    # ---------------------------------------------------------------- ops
    def _row(self, scope: tuple[str, str]) -> MeasuredComponent:
        row = self.rows.get(scope)
        if row is None:
            row = self.rows[scope] = MeasuredComponent(*scope)
        return row

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # As FlopCounterMode does: count a composite op through its decomposition.
        if func is not torch.ops.prim.device.default:
            with self:
                decomposed = func.decompose(*args, **kwargs)
            if decomposed is not NotImplemented:
                return decomposed
        phase, scope = self.scopes.phase_and_scope()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if self.sync:
            torch.cuda.synchronize()
        elapsed = time.perf_counter() - start
        row = self._row(scope)
        row.ops += 1
        setattr(row, f"{phase}_s", getattr(row, f"{phase}_s") + elapsed)
        formula = self.formulas.get(func._overloadpacket)
        if formula is not None:
            flops = formula(*args, **kwargs, out_val=out)
            setattr(row, f"{phase}_flops", getattr(row, f"{phase}_flops") + flops)
        self._track((args, kwargs), out, scope, phase)
        row.peak_live_bytes = max(row.peak_live_bytes, self.live_bytes)
        return out

    def close(self) -> None:
        self.scopes.close()


def _flat(out):
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (list, tuple)):
        for item in out:
            yield from _flat(item)
    elif isinstance(out, dict):
        for item in out.values():
            yield from _flat(item)


def profile_layers(model: RLT, tokens: torch.Tensor, work: Workload) -> LayerProfiler:
    """One forward+backward under :class:`LayerProfiler`."""
    model.zero_grad(set_to_none=True)
    prof = LayerProfiler(model)
    try:
        with prof:
            with prof.saving():
                out = run_sequence(model, tokens, bptt=work.bptt())
                loss = out.loss_sum / out.n_targets.clamp(min=1)
            prof.saved_total, prof.held_total = prof.end_forward()
            loss.backward()
    finally:
        prof.close()
    model.zero_grad(set_to_none=True)
    return prof


def measure_step_peak(model: RLT, tokens: torch.Tensor, work: Workload) -> Optional[int]:
    """Peak memory of one forward+backward above the memory at its start."""
    model.zero_grad(set_to_none=True)
    if tokens.is_cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        forward_backward(model, tokens, work)
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    elif rss.available():
        base = rss.reset_peak()
        forward_backward(model, tokens, work)
        peak = rss.peak_rss() - base
    else:
        return None
    model.zero_grad(set_to_none=True)
    return peak


def measure(model: RLT, cfg: ModelConfig, work: Workload, steps: int = 3, warmup: int = 1,
            seed: int = 0) -> MeasuredStep:
    """Measured mode: FlopCounterMode totals, per-layer attribution, step time and peak memory."""
    device = next(model.parameters()).device
    tokens = make_tokens(cfg, work, seed, device)
    result = MeasuredStep(work, str(device), torch.get_num_threads(),
                          parameters=sum(p.numel() for p in model.parameters()))

    def loss():
        out = run_sequence(model, tokens, bptt=work.bptt())
        return out.loss_sum / out.n_targets.clamp(min=1)

    # The first step gives the process-memory peak: later steps reuse memory malloc kept,
    # so their RSS barely moves (it includes the first step's one-time allocations).
    result.step_peak_bytes = measure_step_peak(model, tokens, work)
    for _ in range(warmup):
        forward_backward(model, tokens, work)
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        forward_backward(model, tokens, work)
        if device.type == "cuda":
            torch.cuda.synchronize()
        result.step_times_s.append(time.perf_counter() - start)
    model.zero_grad(set_to_none=True)
    result.counted = count_step_flops(loss)
    model.zero_grad(set_to_none=True)
    prof = profile_layers(model, tokens, work)
    result.rows = list(prof.rows.values())
    result.peak_live_bytes, result.peak_live_phase = prof.peak, prof.peak_phase
    result.saved_bytes, result.held_bytes = prof.saved_total, prof.held_total
    return result
