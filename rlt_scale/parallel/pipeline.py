"""The ring pipeline schedule for the recurrent decoder (DESIGN.md section 3).

Token (segment) t+1 can enter stage 0 only after s_t has left the last
stage, so a 1F1B schedule cannot run the decoder. Here the decoder is a ring:
the last stage merges s_t with e_{t+1} and sends u_{t+1} to stage 0, and
M >= PP micro-batches circulate so that every stage is busy at every tick.

Timeline. With R = max(M, PP), micro-batch m's segment t runs on stage s at
tick ``t*R + m + s``. Its input was produced at the previous tick (by stage
s-1), or for stage 0 at tick ``(t-1)*R + m + PP-1 < t*R + m`` by the last
stage, so blocking receives never wait on a later tick. Fill and drain cost
PP-1 ticks per sample, not per micro-batch.

Backward runs the same ticks in reverse. Every (stage, micro-batch, segment)
item keeps its own small graph whose inputs are leaves: the received
activation, the incoming window caches, the carried feedback (last stage),
and shared leaves for the encoder output and the memory. Backward of an item
takes the gradients of its outputs (from the next stage, from the item's own
successor in time, from the loss) and yields the gradients of those leaves,
which travel back around the ring. The encoder runs as an ordinary pipeline
over all positions; its final output is broadcast to every stage, which
builds the memory groups its decoder layers read.

Not yet supported with PP > 1: chunk activation checkpointing and truncated
BPTT (the trainer refuses them).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from rlt_scale.distributed import ParallelContext
from rlt_scale.model.layers import document_positions, visibility
from rlt_scale.model.recurrence import split_batch
from rlt_scale.model.rlt import RLT
from rlt_scale.model.state import KV
from rlt_scale.parallel.stages import StagePlan, stages_reading_group


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_(True)


def _leaf_kv(kv: KV) -> KV:
    return KV(_leaf(kv.k), _leaf(kv.v), kv.pos, kv.doc)


@dataclass
class _Item:
    """One segment of one micro-batch on this stage: leaves in, outputs out."""

    z_in: torch.Tensor
    caches_in: dict[int, KV]
    caches_out: dict[int, KV]
    z_out: torch.Tensor
    f_in: Optional[torch.Tensor] = None       # last stage: feedback used by this segment
    f_next: Optional[torch.Tensor] = None     # last stage: feedback for the next segment
    u_next: Optional[torch.Tensor] = None     # last stage: merged input sent to stage 0
    loss: Optional[torch.Tensor] = None       # last stage: summed CE of this segment


@dataclass
class _MicroBatch:
    x: torch.Tensor
    pos: torch.Tensor
    doc: torch.Tensor
    targets: torch.Tensor
    valid: torch.Tensor
    segments: list[tuple[int, int]]
    enc_in: Optional[torch.Tensor] = None
    enc_out: Optional[torch.Tensor] = None
    e: Optional[torch.Tensor] = None                      # leaf: final encoder output
    memory: dict[int, KV] = field(default_factory=dict)   # graph from e
    memory_leaves: dict[int, KV] = field(default_factory=dict)
    items: dict[int, _Item] = field(default_factory=dict)
    pre: Optional[tuple[torch.Tensor, torch.Tensor]] = None  # last stage: (u_0, f_0)


@dataclass
class RingStats:
    """This stage's view of the last forward/backward pass through the ring."""

    ticks: int
    """Ticks of the forward ring (the backward ring has as many)."""
    busy: int
    """Ticks at which this stage had a segment to run."""
    wall_s: float = 0.0
    """Wall time of the two ring passes."""
    wait_s: float = 0.0
    """Part of wall_s spent blocked in receives."""

    @property
    def idle_fraction(self) -> float:
        """Scheduled idle share: 1 - busy/ticks (ideal (PP-1)/ticks when M >= PP)."""
        return 1.0 - self.busy / self.ticks if self.ticks else 0.0

    @property
    def measured_idle_fraction(self) -> float:
        return self.wait_s / self.wall_s if self.wall_s else 0.0


class RingPipeline:
    def __init__(self, model: RLT, plan: StagePlan, ctx: ParallelContext):
        self.model, self.plan, self.ctx = model, plan, ctx
        ranks = ctx.pp_ranks
        self.next_rank = ranks[(plan.stage + 1) % plan.n_stages]
        self.prev_rank = ranks[(plan.stage - 1) % plan.n_stages]
        self.first_rank, self.last_rank = ranks[0], ranks[-1]
        self.replica_groups = self._replica_groups()
        self.stats = RingStats(0, 0)
        self._loss_total = 0.0

    def _replica_groups(self) -> dict[int, dist.ProcessGroup]:
        """One process group per memory group read on several stages (collective: all ranks)."""
        cfg, n = self.model.cfg, self.plan.n_stages
        pipelines = [None] * dist.get_world_size()
        dist.all_gather_object(pipelines, self.ctx.pp_ranks)
        groups = {}
        for pipeline in sorted({tuple(p) for p in pipelines}):
            for g in range(cfg.memory_groups):
                stages = stages_reading_group(cfg, g, n)
                if len(stages) > 1:
                    members = [pipeline[s] for s in stages]
                    handle = dist.new_group(members)
                    if self.ctx.rank in members:
                        groups[g] = handle
        return groups

    # ------------------------------------------------------------ helpers
    def _send(self, tensor: torch.Tensor, dst: int, pending: list) -> None:
        pending.append(dist.isend(tensor.detach().contiguous(), dst))

    def _recv(self, shape, dtype, src: int) -> torch.Tensor:
        buf = torch.empty(shape, dtype=dtype, device=self.ctx.device)
        start = time.perf_counter()
        dist.recv(buf, src)
        self.stats.wait_s += time.perf_counter() - start
        return buf

    def _schedule(self, micro: list[_MicroBatch]):
        """(tick, micro-batch index, segment index) of this stage's items, in tick order."""
        n, stage = self.plan.n_stages, self.plan.stage
        period = max(len(micro), n)
        longest = max(len(mb.segments) for mb in micro)
        ticks = period * longest + n - 1
        order = []
        for tick in range(ticks):
            j = tick - stage
            m, t = j % period, j // period
            if j >= 0 and m < len(micro) and t < len(micro[m].segments):
                order.append((tick, m, t))
        self.stats = RingStats(ticks, len(order))  # the receive timer restarts here
        return order

    # ------------------------------------------------------------- forward
    def _encoder_forward(self, mb: _MicroBatch, pending: list) -> None:
        model, plan = self.model, self.plan
        b, length = mb.x.shape
        d = model.cfg.d_model
        if plan.first:
            x = model.embed(mb.x)
        else:
            mb.enc_in = _leaf(self._recv((b, length, d), model.tp.dtype, self.prev_rank))
            x = mb.enc_in
        rope = model.rotary(mb.pos)
        for i in plan.encoder_layers:
            x, _ = model.encoder[i](x, rope, mb.pos, mb.doc, model.empty_kv(b, x.device))
        mb.enc_out = x
        if not plan.last:
            self._send(x, self.next_rank, pending)
            e = torch.empty_like(x)
        else:
            e = x.detach().clone()
        dist.broadcast(e, self.last_rank, group=self.ctx.pp_group)
        mb.e = _leaf(e)
        rope = model.rotary(mb.pos)
        for g in plan.memory_groups:
            mb.memory[g] = model.memory[g](mb.e, rope, mb.pos, mb.doc)
            mb.memory_leaves[g] = _leaf_kv(mb.memory[g])

    def _merge(self, mb: _MicroBatch, t: int, carried: torch.Tensor):
        """(u, feedback) for segment t: feedback resets to s_* at a document start."""
        a, b = mb.segments[t]
        if self.model.merge is None or self.model.cfg.feedback_block == 0:
            return mb.e[:, a:b], carried
        s_star = self.model.merge.initial_state.expand_as(carried)
        feedback = torch.where(mb.pos[:, a:a + 1] == 0, s_star, carried)
        return self.model.merge(mb.e[:, a:b], feedback), feedback

    def _run_item(self, mb: _MicroBatch, t: int, caches: dict[int, KV], pending: list) -> dict[int, KV]:
        model, plan = self.model, self.plan
        a, b = mb.segments[t]
        shape = (mb.x.shape[0], b - a, model.cfg.d_model)
        source = self.prev_rank if not plan.first else self.last_rank
        z_in = _leaf(self._recv(shape, model.tp.dtype, source))
        caches_in = {i: _leaf_kv(c) for i, c in caches.items()}
        pos, doc = mb.pos[:, a:b], mb.doc[:, a:b]
        rope = model.rotary(pos)
        cross_mask = visibility(pos, doc, mb.pos[:, :b], mb.doc[:, :b])
        z, caches_out = z_in, {}
        for i in plan.decoder_layers:
            memory = mb.memory_leaves[model.cfg.memory_group_of(i)].first(b)
            z, caches_out[i] = model.decoder[i](z, rope, pos, doc, caches_in[i], memory, cross_mask)
        item = _Item(z_in, caches_in, caches_out, z)
        if not plan.last:
            self._send(z, self.next_rank, pending)
        else:
            logits = model.logits(z)
            ce = model.tp.cross_entropy(logits.to(torch.promote_types(logits.dtype, torch.float32)), mb.targets[:, a:b])
            item.loss = torch.where(mb.valid[:, a:b], ce, torch.zeros_like(ce)).sum()
            self._loss_total += float(item.loss)
            f_in = _leaf(mb.items[t - 1].f_next if t else mb.pre[1])
            item.f_in = f_in
            k = model.cfg.feedback_block
            block_end = ((pos[:, -1:] + 1) % max(k, 1)) == 0
            carried = torch.where(block_end, z[:, -1], f_in) if k else f_in
            if t + 1 < len(mb.segments):
                item.u_next, item.f_next = self._merge(mb, t + 1, carried)
                self._send(item.u_next, self.first_rank, pending)
        mb.items[t] = item
        return caches_out

    # ------------------------------------------------------------ backward
    def _backward_item(self, mb: _MicroBatch, t: int, loss_scale: float, pending: list) -> None:
        plan, item = self.plan, mb.items[t]
        outputs, grads = [], []
        nxt = mb.items.get(t + 1)
        for i, c in item.caches_out.items():
            if nxt is not None:
                for out, leaf in ((c.k, nxt.caches_in[i].k), (c.v, nxt.caches_in[i].v)):
                    if leaf.grad is not None:
                        outputs.append(out)
                        grads.append(leaf.grad)
        if not plan.last:
            outputs.append(item.z_out)
            grads.append(self._recv(item.z_out.shape, item.z_out.dtype, self.next_rank))
        else:
            outputs.append(item.loss)
            grads.append(torch.full_like(item.loss, loss_scale))
            if item.u_next is not None:
                outputs.append(item.u_next)
                grads.append(self._recv(item.u_next.shape, item.u_next.dtype, self.first_rank))
                if nxt.f_in.grad is not None:
                    outputs.append(item.f_next)
                    grads.append(nxt.f_in.grad)
        torch.autograd.backward(outputs, grads)
        target = self.prev_rank if not plan.first else self.last_rank
        self._send(item.z_in.grad, target, pending)
        if nxt is not None:  # the successor's graph is done with; free it
            mb.items[t + 1] = None

    def _backward_pre(self, mb: _MicroBatch) -> None:
        u0, f0 = mb.pre
        grad_u0 = self._recv(u0.shape, u0.dtype, self.first_rank)
        outputs, grads = [u0], [grad_u0]
        if mb.items[0].f_in.grad is not None and f0.requires_grad:
            outputs.append(f0)
            grads.append(mb.items[0].f_in.grad)
        torch.autograd.backward(outputs, grads)

    def _encoder_backward(self, mb: _MicroBatch, pending: list) -> None:
        plan = self.plan
        if mb.memory:
            outs, grads = [], []
            for g, kv in mb.memory.items():
                leaf = mb.memory_leaves[g]
                for out, lf in ((kv.k, leaf.k), (kv.v, leaf.v)):
                    if lf.grad is not None:
                        outs.append(out)
                        grads.append(lf.grad)
            if outs:
                torch.autograd.backward(outs, grads)
        grad_e = mb.e.grad if mb.e.grad is not None else torch.zeros_like(mb.e)
        dist.all_reduce(grad_e, group=self.ctx.pp_group)
        if plan.last:
            grad_out = grad_e
        else:
            grad_out = self._recv(mb.enc_out.shape, mb.enc_out.dtype, self.next_rank)
        torch.autograd.backward([mb.enc_out], [grad_out])
        if not plan.first:
            self._send(mb.enc_in.grad, self.prev_rank, pending)

    # ---------------------------------------------------------------- run
    def forward_backward(self, batches: list[dict], n_targets: float) -> float:
        """Accumulate gradients of sum(loss) / n_targets over ``batches`` (the micro-batches).

        Returns the summed loss of these micro-batches (known on every stage).
        """
        model, plan = self.model, self.plan
        micro = []
        for batch in batches:
            x, doc, targets, valid = split_batch(batch["tokens"], batch["doc_ids"], batch["loss_mask"])
            pos = document_positions(doc)
            micro.append(_MicroBatch(x, pos, doc, targets, valid, model.segments(pos)))

        pending: list = []
        self._loss_total = 0.0
        for mb in micro:
            self._encoder_forward(mb, pending)
        if plan.last:
            for mb in micro:
                s0 = (model.merge.initial_state.expand(mb.x.shape[0], -1) if model.merge is not None
                      else torch.zeros(mb.x.shape[0], model.cfg.d_model, dtype=model.tp.dtype, device=mb.x.device))
                u0, f0 = self._merge(mb, 0, s0)
                mb.pre = (u0, f0)
                self._send(u0, self.first_rank, pending)
        order = self._schedule(micro)
        ring_start = time.perf_counter()
        caches = {m: {i: model.empty_kv(mb.x.shape[0], mb.x.device) for i in plan.decoder_layers}
                  for m, mb in enumerate(micro)}
        for _, m, t in order:
            caches[m] = self._run_item(micro[m], t, caches[m], pending)
        for work in pending:
            work.wait()
        pending.clear()

        scale = 1.0 / n_targets
        for _, m, t in reversed(order):
            self._backward_item(micro[m], t, scale, pending)
        if plan.last:
            for mb in reversed(micro):
                self._backward_pre(mb)
        self.stats.wall_s = time.perf_counter() - ring_start
        ring_wait = self.stats.wait_s
        for mb in reversed(micro):
            self._encoder_backward(mb, pending)
        for work in pending:
            work.wait()
        self.stats.wait_s = ring_wait  # encoder-pipeline waits are not the ring's bubble
        self._reduce_replicas()

        loss = torch.tensor([self._loss_total if plan.last else 0.0], dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(loss, group=self.ctx.pp_group)
        return float(loss)

    def _reduce_replicas(self) -> None:
        for g, group in self.replica_groups.items():
            for p in self.model.memory[g].parameters():
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                dist.all_reduce(p.grad, group=group)
