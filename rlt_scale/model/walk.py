"""The sequential decoder's walk over one chunk as one autograd node (``model.decoder_step=fused``).

Why this exists. Walked as modules, every position of a chunk adds the
merge's and every layer's autograd nodes, their saved tensors, and in
backward a weight-sized and a memory-sized gradient per layer. Here the
chunk is one node. Its forward calls one step function per segment
(:func:`~rlt_scale.model.fused.segment_forward`: the merge, every layer, the
carry; compiled as one graph under ``model.decoder_compile``) and writes
what the step returns into buffers allocated once per chunk:

* per layer a key store ``[B, h, P + S, hd]`` (the ``P`` carried window
  entries, then one slot per position, written in place);
* per layer two rows per position (:class:`~rlt_scale.model.fused.Rows`),
  and per position the feedback it read;
* the outputs ``z`` ``[B, S, d]`` for the readout.

Its backward walks the segments in reverse, one step function each
(:func:`~rlt_scale.model.fused.segment_backward`), adding the window keys'
gradients into a gradient store. Each block of ``model.decoder_wgrad_block``
positions then forms every weight gradient (decoder layers and merge) as one
GEMM, and the memory's key/value gradients as two per layer: nothing
weight- or memory-sized is written per position.

Everything the node keeps is saved through ``save_for_backward``, so chunk
checkpointing drops and rebuilds it like any activation. Buffers are
allocated inside each layer's (and the merge's) module call, so the
profiler charges them to that layer. Values and gradients equal the layer
path's to rounding (float64 tests); DESIGN.md section 2 allows this
implementation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, fields
from typing import Optional

import torch

from rlt_scale.model.deferred import weight_gradients
from rlt_scale.model.fused import PROJECTIONS, Rows, StepShape, memory_gradients, merge_gradients, step_functions
from rlt_scale.model.layers import autocast_of, visibility
from rlt_scale.model.state import KV, DecoderState

_MERGE_PARAMS = ("norm.weight", "gate.weight", "gate.bias", "proj.weight", "initial_state", "scale")


def _layer_params(layer) -> dict:
    return {"qkv": layer.attn.qkv.weight, "out": layer.attn.out.weight, "cross_q": layer.cross_q.weight,
            "cross_out": layer.cross_out.weight, "gate_up": layer.ffn.gate_up.weight, "down": layer.ffn.down.weight,
            "norm.qkv": layer.norm_attn.weight, "norm.cross_q": layer.norm_cross.weight,
            "norm.gate_up": layer.norm_ffn.weight}


def _heads_view(row: torch.Tensor, n_heads: int) -> torch.Tensor:
    return row.view(*row.shape[:2], n_heads, -1).transpose(1, 2)


@dataclass
class _Tables:
    """The chunk's position tensors: what every step reads besides activations and weights."""

    pos: torch.Tensor  # [B, S] positions of the chunk
    doc: torch.Tensor
    key_pos: torch.Tensor  # [B, P + S] of the store's slots (the P carried entries first)
    key_doc: torch.Tensor
    slots: torch.Tensor  # every slot's index, so that a step's position is data, not a constant
    cos: torch.Tensor  # rotary tables of the chunk's positions
    sin: torch.Tensor
    mem_pos: torch.Tensor  # [B, M] of the memory entries the chunk reads
    mem_doc: torch.Tensor

    @classmethod
    def count(cls) -> int:
        return len(fields(cls))

    def tensors(self) -> list[torch.Tensor]:
        return [getattr(self, f.name) for f in fields(self)]  # not dataclasses.astuple: it deep-copies


class ChunkWalk:
    """One chunk's walk: the model's parts it reads and the non-tensor facts of the chunk.

    ``segments`` are the chunk's ``[a, b)`` cuts, ``blocks`` the runs of whole
    segments whose weight gradients form one GEMM each
    (:func:`~rlt_scale.model.deferred.weight_blocks`); ``offset`` is the
    chunk's first position (the memory holds entries ``< offset + S``).
    """

    def __init__(self, model, pos, doc, carried: list[KV], memory: list[KV], offset: int,
                 segments: list[tuple[int, int]], blocks: list[tuple[int, int]], cos, sin):
        cfg = model.cfg
        layer = model.decoder[0]
        self.model, self.segments, self.blocks = model, segments, blocks
        self.shape = _shape(StepShape(
            n_heads=layer.n_heads, head_dim=cfg.head_dim, window=cfg.window, eps=cfg.norm_eps,
            feedback_block=cfg.feedback_block, groups=tuple(cfg.memory_group_of(i) for i in range(len(model.decoder))),
            d_model=cfg.d_model, ffn=layer.ffn.down.weight.shape[1], tp_sum=model.tp.sum))
        self.rows = _rows(self.shape)
        self.functions = step_functions(cfg.decoder_compile, cfg.decoder_compile_cache)
        self.n_carried, self.n_groups = len(carried[0]), len(memory)
        key_pos = torch.cat([carried[0].pos, pos], 1)  # every layer's store holds the same positions
        mem = [m.first(offset + pos.shape[1]) for m in memory]
        # Tensors reach backward only through save_for_backward (chunk checkpointing drops them there).
        self.tables: Optional[_Tables] = _Tables(
            pos, doc, key_pos, torch.cat([carried[0].doc, doc], 1), torch.arange(key_pos.shape[1], device=pos.device),
            cos, sin, mem[0].pos, mem[0].doc)
        self.layer_params = [_layer_params(layer) for layer in model.decoder]
        named = dict(model.merge.named_parameters()) | dict(model.merge.named_buffers())
        self.merge_params = {name: named[name] for name in _MERGE_PARAMS}
        self.tracked = [p for p in self.merge_params.values() if p.requires_grad]
        self.inputs = ([c.k for c in carried] + [c.v for c in carried] + [m.k for m in mem] + [m.v for m in mem]
                       + self.tracked + [p for params in self.layer_params for p in params.values()])

    def run(self, e: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, DecoderState]:
        """The chunk's outputs ``[B, S, d]`` and the state it hands on.

        With gradients one :class:`_Walk` node; without (evaluation, a prompt)
        the same steps, keeping nothing for a backward.
        """
        key_pos, key_doc = self.tables.key_pos, self.tables.key_doc
        if torch.is_grad_enabled():
            z, s, *caches = _Walk.apply(self, e, s, *self.inputs)
        else:
            z, s, caches = self.forward(e, s, self.inputs, keep=False)[:3]
        self.inputs = None
        n_layers, n = len(self.model.decoder), caches[0].shape[2]
        end = key_pos.shape[1]
        return z, DecoderState(s, [KV(caches[i], caches[n_layers + i], key_pos[:, end - n:], key_doc[:, end - n:])
                                   for i in range(n_layers)])

    def forward(self, e, s, inputs, keep: bool):
        """Walk the chunk: ``(z, s, new caches, stores, rows, feedbacks, memory, params)``.

        ``keep``: allocate and fill what backward reads (each layer's rows,
        each position's feedback); without it only the key stores are kept
        for the window.
        """
        model, shape, rows, t = self.model, self.shape, self.rows, self.tables
        n_layers, n_groups = len(model.decoder), self.n_groups
        caches_k, caches_v = inputs[:n_layers], inputs[n_layers:2 * n_layers]
        mem = list(zip(inputs[2 * n_layers:2 * n_layers + n_groups], inputs[2 * n_layers + n_groups:2 * (n_layers + n_groups)]))
        params = inputs[2 * (n_layers + n_groups):]
        dtype = autocast_of(e) or model.decoder[0].attn.qkv.weight.dtype
        merge_w, layers_w = self.weights(params, dtype)
        b, length, d = e.shape
        p, n_keys = self.n_carried, t.key_pos.shape[1]

        def layer_buffers(i):
            def make():
                k = caches_k[i].new_zeros(b, shape.n_heads, n_keys, shape.head_dim)  # masked slots must be finite
                v = caches_v[i].new_zeros(b, shape.n_heads, n_keys, shape.head_dim)
                k[:, :, :p], v[:, :, :p] = caches_k[i], caches_v[i]
                return (k, v), ((e.new_empty(b, length, Rows.width(rows.resid)),
                                 e.new_empty(b, length, Rows.width(rows.proj), dtype=dtype)) if keep else None)
            return _in_scope(model.decoder[i], make)

        stores, kept = zip(*(layer_buffers(i) for i in range(n_layers)))
        feedbacks = _in_scope(model.merge, lambda: e.new_empty(b, length, d)) if keep else None
        z_all = e.new_empty(b, length, d)
        step, _ = self.functions
        with torch.autocast(e.device.type, enabled=False):  # the step casts explicitly, as autocast would
            for a, c in self.segments:
                at = p + a
                z, s, feedback, out = step(
                    e[:, a:c], s, t.pos[:, a:c], merge_w, layers_w, shape, t.cos[:, :, a:c], t.sin[:, :, a:c],
                    stores, t.key_pos, t.key_doc, t.slots[at], mem, t.mem_pos, t.mem_doc, t.doc[:, a:c])
                z_all[:, a:c] = z
                for (store_k, store_v), (k, v, _, _) in zip(stores, out):
                    store_k[:, :, at:at + c - a], store_v[:, :, at:at + c - a] = k, v
                if keep:
                    feedbacks[:, a:c] = feedback[:, None]
                    for (resid, proj), (_, _, resid_rows, proj_rows) in zip(kept, out):
                        resid[:, a:c], proj[:, a:c] = resid_rows, proj_rows
        n = min(shape.window - 1, n_keys)
        new_caches = [store[j][:, :, n_keys - n:].clone() for j in (0, 1) for store in stores]
        return z_all, s, new_caches, stores, kept, feedbacks, mem, params

    # ----------------------------------------------------------- weights
    def weights(self, params: list[torch.Tensor], dtype) -> tuple[dict, list]:
        """The merge's and every layer's weights as the step reads them: projections in the compute
        ``dtype`` (cast once per chunk, as autocast would per use), norms and the state in their own."""
        it = iter(params)
        merge = {name: (next(it) if p.requires_grad else p).detach() for name, p in self.merge_params.items()}
        for name in ("gate.weight", "gate.bias", "proj.weight"):
            merge[name] = merge[name].to(dtype)
        merge = {"norm": merge["norm.weight"], "gate": merge["gate.weight"], "bias": merge["gate.bias"],
                 "proj": merge["proj.weight"], "s_star": merge["initial_state"], "scale": merge["scale"]}
        layers = []
        for names in self.layer_params:
            p = {name: next(it).detach() for name in names}
            layers.append(({name: p[name].to(dtype) for name in PROJECTIONS},
                           {name[5:]: p[name] for name in p if name.startswith("norm.")}))
        return merge, layers


@functools.lru_cache(maxsize=None)
def _shape(shape: StepShape) -> StepShape:
    """One object per distinct shape, so that a compiled step's guards see the same constants."""
    return shape


@functools.lru_cache(maxsize=None)
def _rows(shape: StepShape) -> Rows:
    return Rows(shape)


def _in_scope(module, make):
    """``make()`` run inside ``module``'s call, so that the profiler charges what it allocates to it."""
    return module(None, None, run=make)


class _Walk(torch.autograd.Function):
    @staticmethod
    def forward(ctx, walk: ChunkWalk, e, s, *inputs):
        z_all, s, new_caches, stores, kept, feedbacks, mem, params = walk.forward(e, s, inputs, keep=True)
        ctx.walk, ctx.cast = walk, autocast_of(e)
        ctx.save_for_backward(e, feedbacks, *walk.tables.tensors(), *(x for store in stores for x in store),
                              *(x for row in kept for x in row), *(x for kv in mem for x in kv), *params)
        walk.tables = None  # from here on only what was saved
        return (z_all, s, *new_caches)

    @staticmethod
    def backward(ctx, dz_all, ds, *d_caches):
        walk = ctx.walk
        shape, rows, model = walk.shape, walk.rows, walk.model
        n_layers, n_groups = len(model.decoder), walk.n_groups
        e, feedbacks, *saved = ctx.saved_tensors
        t = _Tables(*saved[:_Tables.count()])
        saved = saved[_Tables.count():]
        pairs = lambda n, at: [tuple(saved[at + 2 * i:at + 2 * i + 2]) for i in range(n)]  # noqa: E731
        stores, kept, mem = pairs(n_layers, 0), pairs(n_layers, 2 * n_layers), pairs(n_groups, 4 * n_layers)
        params = saved[4 * n_layers + 2 * n_groups:]
        dtype = ctx.cast or model.decoder[0].attn.qkv.weight.dtype
        merge_w, layers_w = walk.weights(params, dtype)
        b, length, d = e.shape
        p, n_keys = walk.n_carried, t.key_pos.shape[1]
        dz_all = torch.zeros_like(e) if dz_all is None else dz_all
        ds = torch.zeros_like(feedbacks[:, 0]) if ds is None else ds
        d_stores = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in stores]
        n = min(shape.window - 1, n_keys)
        for j in (0, 1):  # the caches handed on: later chunks' reads of them
            for d_store, grad in zip(d_stores, d_caches[j * n_layers:(j + 1) * n_layers]):
                if grad is not None:
                    d_store[j][:, :, n_keys - n:] += grad
        de = torch.empty_like(e)
        sums = feedbacks.new_zeros(2 * d + 1)  # [d s* | d norm weight | d scale], summed over segments
        longest = max(stop - start for start, stop in walk.blocks)
        dy = [e.new_empty(b, longest, Rows.width(rows.dy), dtype=dtype) for _ in range(n_layers)]
        dn = [e.new_empty(b, longest, Rows.width(rows.dnormed)) for _ in range(n_layers)]
        merge_rows = e.new_empty(b, longest, 2 * d, dtype=dtype)
        grads = _Grads()
        _, backward = walk.functions
        with torch.autocast(e.device.type, enabled=False):
            for start, stop in reversed(walk.blocks):
                for a, c in reversed([seg for seg in walk.segments if start <= seg[0] < stop]):
                    at, i, j = p + a, a - start, c - start
                    own = [(dk[:, :, at:at + c - a], dv[:, :, at:at + c - a]) for dk, dv in d_stores]
                    de_seg, ds, seg_sums, out, merge_row = backward(
                        dz_all[:, a:c], ds, e[:, a:c], feedbacks[:, a], t.pos[:, a:c], merge_w, layers_w, shape,
                        rows, t.cos[:, :, a:c], t.sin[:, :, a:c], stores, t.key_pos, t.key_doc, t.slots[at], own, mem,
                        t.mem_pos, t.mem_doc, t.doc[:, a:c], [(resid[:, a:c], proj[:, a:c]) for resid, proj in kept])
                    de[:, a:c] = de_seg
                    sums += seg_sums
                    merge_rows[:, i:j] = merge_row
                    lo = at - (shape.window - 1)
                    skip = max(-lo, 0)  # slots clamped at the store's start: their gradients are zero
                    for (dk_store, dv_store), dy_l, dn_l, (dk, dv, dy_rows, dn_rows) in zip(d_stores, dy, dn, out):
                        dk_store[:, :, lo + skip:at] += dk[:, :, skip:]
                        dv_store[:, :, lo + skip:at] += dv[:, :, skip:]
                        dy_l[:, i:j], dn_l[:, i:j] = dy_rows, dn_rows
                _flush_block(walk, grads, t, start, stop, e, feedbacks, kept, mem, merge_w, layers_w, dy, dn,
                             merge_rows)
        ctx.walk = None
        merge_grads = grads.merge
        merge_grads.update({"initial_state": sums[:d], "norm.weight": sums[d:2 * d], "scale": sums[2 * d]})
        tracked = [_cast_like([merge_grads[name]], [prm])[0] for name, prm in walk.merge_params.items()
                   if prm.requires_grad]
        layer_grads = [grads.layers[i].get(name) for i, names in enumerate(walk.layer_params) for name in names]
        d_carried = [d_store[j][:, :, :p] for j in (0, 1) for d_store in d_stores]
        d_mem = [grads.memory[g][j] if g in grads.memory else None for j in (0, 1) for g in range(n_groups)]
        return (None, de, ds, *d_carried, *d_mem, *tracked, *_cast_like(layer_grads, params[len(tracked):]))


class _Grads:
    """Gradients summed over a chunk's blocks: per layer by parameter name, the merge's, the memory's."""

    def __init__(self):
        self.layers: dict[int, dict] = {}
        self.merge: dict = {}
        self.memory: dict[int, list] = {}

    @staticmethod
    def add(into: dict, key, grad) -> None:
        into[key] = grad if key not in into else into[key] + grad


def _flush_block(walk: ChunkWalk, grads: _Grads, t: _Tables, start, stop, e, feedbacks, kept, mem, merge_w,
                 layers_w, dy, dn, merge_rows) -> None:
    """A block's weight gradients (one GEMM per weight) and memory gradients (two GEMMs per layer)."""
    rows, shape, n = walk.rows, walk.shape, stop - start
    mask = visibility(t.pos[:, start:stop], t.doc[:, start:stop], t.mem_pos, t.mem_doc)
    for i, ((resid, proj), (w, norm), dy_l, dn_l) in enumerate(zip(kept, layers_w, dy, dn)):
        x = Rows.split(resid[:, start:stop], rows.resid)
        pr = Rows.split(proj[:, start:stop], rows.proj)
        g_dy = Rows.split(dy_l[:, :n], rows.dy)
        layer = grads.layers.setdefault(i, {})
        for name, g in weight_gradients(
                w, norm, {"qkv": x["z"], "cross_q": x["z1"], "gate_up": x["z2"], "out": pr["h"], "cross_out": pr["hc"]},
                {"qkv": x["rstd1"], "cross_q": x["rstd2"], "gate_up": x["rstd3"]}, pr["gu"],
                {name: g_dy[name] for name in PROJECTIONS}, Rows.split(dn_l[:, :n], rows.dnormed)).items():
            _Grads.add(layer, name, g)
        group = shape.groups[i]
        dk, dv = memory_gradients(_heads_view(pr["qc"], shape.n_heads), _heads_view(g_dy["d_oc"], shape.n_heads),
                                  *mem[group], mask)
        memory = grads.memory.setdefault(group, [0, 0])
        memory[0] = memory[0] + dk.to(mem[group][0].dtype)
        memory[1] = memory[1] + dv.to(mem[group][1].dtype)
    for name, g in merge_gradients(merge_w, e[:, start:stop], feedbacks[:, start:stop], merge_rows[:, :n],
                                   shape.eps).items():
        _Grads.add(grads.merge, name, g)


def _cast_like(grads: list[Optional[torch.Tensor]], params) -> list[Optional[torch.Tensor]]:
    return [None if g is None else g.to(p.dtype) for g, p in zip(grads, params)]
