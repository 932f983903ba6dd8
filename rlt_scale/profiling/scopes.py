"""Which layer and component of the RLT is running right now, forward and backward.

Forward: module pre/post hooks keep a stack of ``(layer, component)``
scopes (``encoder.0``/``ffn``, ``decoder.1``/``cross`` ...). Backward: the
autograd engine runs nodes, not modules, so every autograd node created in
forward is tagged with the scope that created it (its ``metadata``), and a
backward op reads the tag of :func:`torch._C._current_autograd_node`. An op
that runs in backward while a forward scope is open is checkpoint
recomputation.

Tagging walks the new part of the autograd graph at every hook: at a
module's entry the inputs' untagged history belongs to the enclosing scope
(ops that ran between two child calls), at its exit the rest belongs to the
module. Tied encoder/decoder weights are one module object; the layer comes
from the enclosing block, so each application is attributed to its own layer.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator, Optional

import torch
from torch import nn

from rlt_scale.model import RLT

TAG = "rlt_scope"
OTHER = ("other", "other")

# Attribute name of a submodule -> component label (shared with the analytic model).
COMPONENTS = {
    "attn": "attn", "qkv": "qkv", "out": "out", "ffn": "ffn",
    "cross_q": "cross_q", "cross_out": "cross_out", "kv": "kv",
    "gate": "gate", "proj": "proj", "readout": "readout",
    "norm": "norm", "norm_attn": "norm", "norm_ffn": "norm", "norm_cross": "norm", "norm_out": "norm",
}
# Ops a layer runs outside its submodules (e.g. the decoder's cross-attention core).
LAYER_DEFAULT = {"EncoderBlock": "residual", "DecoderLayer": "cross", "MemoryProjection": "kv",
                 "FeedbackMerge": "gate", "VocabParallelEmbedding": "embed", "Linear": "readout",
                 "RMSNorm": "norm"}


def layer_units(model: RLT) -> Iterator[tuple[str, nn.Module]]:
    """The model's layers as the cost model names them, in execution order."""
    yield "embed", model.embed
    for i, block in enumerate(model.encoder):
        yield f"encoder.{i}", block
    for g, group in enumerate(model.memory):
        yield f"memory.{g}", group
    if model.merge is not None:
        yield "merge", model.merge
    for i, layer in enumerate(model.decoder):
        yield f"decoder.{i}", layer
    yield "readout", model.norm_out
    yield "readout", model.readout


def _tensors(obj, depth: int = 0) -> Iterator[torch.Tensor]:
    """Tensors inside hook arguments: tuples, lists, dicts and dataclasses (KV, DecoderState)."""
    if depth > 4:
        return
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for item in obj:
            yield from _tensors(item, depth + 1)
    elif isinstance(obj, dict):
        for item in obj.values():
            yield from _tensors(item, depth + 1)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            yield from _tensors(getattr(obj, f.name), depth + 1)


def tag_history(roots, scope: tuple[str, str]) -> None:
    """Tag every untagged autograd node reachable from ``roots`` with ``scope``."""
    stack = [t.grad_fn for t in _tensors(roots) if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        meta = node.metadata
        if TAG in meta:
            continue
        meta[TAG] = scope
        for nxt, _ in node.next_functions:
            if nxt is not None and type(nxt).__name__ != "AccumulateGrad":  # parameters: nothing to tag
                stack.append(nxt)


class ScopeTracker:
    """Module hooks that maintain the current ``(layer, component)`` and tag the graph."""

    def __init__(self, model: RLT):
        self.stack: list[tuple[str, str]] = []
        self.handles = []
        self._hooked: set[int] = set()
        for layer, unit in layer_units(model):
            self._hook(unit, layer=layer, component=LAYER_DEFAULT.get(type(unit).__name__, "other"))
            for name, sub in unit.named_children():
                comp = COMPONENTS.get(name)
                if comp is None:
                    continue
                self._hook(sub, layer=None, component=comp)
                for sub_name, leaf in sub.named_children():
                    if sub_name in COMPONENTS and COMPONENTS[sub_name] in ("qkv", "out"):
                        self._hook(leaf, layer=None, component=COMPONENTS[sub_name])

    def _hook(self, module: nn.Module, layer: Optional[str], component: str) -> None:
        # A tied attention/FFN is one module reached from two layers: hook it once;
        # its layer is read from the stack at run time.
        if id(module) in self._hooked:
            return
        self._hooked.add(id(module))

        def pre(mod, args):
            tag_history(args, self.current)
            parent = layer or (self.stack[-1][0] if self.stack else OTHER[0])
            self.stack.append((parent, component))

        def post(mod, args, output):
            tag_history(output, self.current)
            self.stack.pop()

        self.handles.append(module.register_forward_pre_hook(pre))
        self.handles.append(module.register_forward_hook(post))

    @property
    def current(self) -> tuple[str, str]:
        return self.stack[-1] if self.stack else OTHER

    def phase_and_scope(self) -> tuple[str, tuple[str, str]]:
        """('fwd' | 'bwd' | 'recompute', scope) of the op about to run."""
        node = torch._C._current_autograd_node()
        if node is None:
            return "fwd", self.current
        if self.stack:
            return "recompute", self.current
        return "bwd", node.metadata.get(TAG, OTHER)

    def tag_loss(self, loss: torch.Tensor) -> None:
        """The ops after the last module (the loss) belong to no layer: tag them ``other``."""
        tag_history(loss, OTHER)

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles.clear()
