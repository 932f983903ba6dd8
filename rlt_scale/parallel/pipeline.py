"""The ring pipeline schedule for the recurrent decoder (DESIGN.md section 3).

Segment n+1 (a token for K=1) can enter stage 0 only after the feedback s
of segment n has left the last stage, so a 1F1B schedule cannot run the
decoder. Here the decoder is a ring: the last stage merges that s with the
encoder output of segment n+1 and sends the merged input u to stage 0, and
M >= PP micro-batches circulate so that every stage is busy at every tick.

Timeline. With R = max(M, PP), micro-batch m's segment n runs on stage s at
tick ``n*R + m + s``. Its input was produced at the previous tick (by stage
s-1), or for stage 0 at tick ``(n-1)*R + m + PP-1 < n*R + m`` by the last
stage, so blocking receives never wait on a later tick. Fill and drain cost
PP-1 ticks per sample, not per micro-batch.

Backward runs the same ticks in reverse. Every (stage, micro-batch, segment)
piece of work keeps its own small graph whose inputs are leaves: the received
activation, the incoming window caches, the carried feedback (last stage),
and shared leaves for the encoder output and the memory. Backward of a piece
takes the gradients of its outputs (from the next stage, from its own
successor in time, from the loss) and yields the gradients of those leaves,
which travel back around the ring. The encoder runs as an ordinary pipeline
over all positions; its final output is broadcast to every stage, which
builds the memory groups its decoder layers read.

The trainer's :class:`~rlt_scale.training.bptt.BPTT` applies here as in
one process, through each micro-batch's :class:`~rlt_scale.training.bptt.SegmentPlan`:

* segments never straddle a chunk boundary;
* chunk activation checkpointing: the forward ring runs without graphs and
  keeps only each segment's received activation and each chunk's incoming
  state; backward recomputes a chunk's segments on this stage (no
  communication) just before it needs their graphs;
* truncated BPTT: at a truncation point the carried feedback enters the merge
  detached, the window-cache gradients are not passed back, and the memory
  entries before the point receive no gradient from later segments.

A memory group read on several stages is computed on each of them; the
gradients of its keys/values are summed over those stages before they flow
into the projection, so every replica's weights get the same, complete
gradient, and only the owning stage passes the memory's gradient on to the
encoder output.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist

from rlt_scale.distributed import ParallelContext
from rlt_scale.training.bptt import BPTT, Targets, next_token_targets
from rlt_scale.model.rlt import RLT
from rlt_scale.model.state import KV
from rlt_scale.parallel.ring_work import Boundary, MicroBatch, RingStats, SegmentWork, leaf, leaf_kv
from rlt_scale.parallel.stages import StagePlan, stages_reading_group

GRAPH, CHECKPOINT, EVAL = "graph", "checkpoint", "eval"


class RingPipeline:
    def __init__(self, model: RLT, plan: StagePlan, ctx: ParallelContext, bptt: BPTT = BPTT()):
        self.model, self.plan, self.ctx, self.bptt = model, plan, ctx, bptt
        ranks = ctx.pp_ranks
        self.next_rank = ranks[(plan.stage + 1) % plan.n_stages]
        self.prev_rank = ranks[(plan.stage - 1) % plan.n_stages]
        self.first_rank, self.last_rank = ranks[0], ranks[-1]
        self.replica_groups = self._replica_groups()
        self.owns = {g: stages_reading_group(model.cfg, g, plan.n_stages)[0] == plan.stage
                     for g in plan.memory_groups}
        self.stats = RingStats(0, 0)
        self._loss_total = 0.0
        self._correct_total = 0
        self._answers = None  # evaluation: count right answers among these token ids
        self._ring_start = 0.0

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

    def _tick_order(self, micro: list[MicroBatch]):
        """(tick, micro-batch index, segment index) of this stage's work, in tick order."""
        n, stage = self.plan.n_stages, self.plan.stage
        period = max(len(micro), n)
        longest = max(len(mb.segments) for mb in micro)
        ticks = period * longest + n - 1
        order = []
        for tick in range(ticks):
            j = tick - stage
            m, n = j % period, j // period
            if j >= 0 and m < len(micro) and n < len(micro[m].segments):
                order.append((tick, m, n))
        self.stats = RingStats(ticks, len(order))  # the receive timer restarts here
        return order

    # ------------------------------------------------------------- forward
    def _encoder_forward(self, mb: MicroBatch, pending: list) -> None:
        model, plan = self.model, self.plan
        b, length = mb.x.shape
        d = model.cfg.d_model
        if plan.first:
            x = model.embed(mb.x)
        else:
            mb.enc_in = leaf(self._recv((b, length, d), model.tp.dtype, self.prev_rank))
            x = mb.enc_in
        x, _ = model.encoder_layers(x, mb.pos, mb.doc, plan.encoder_layers)
        mb.enc_out = x
        if not plan.last:
            self._send(x, self.next_rank, pending)
            e = torch.empty_like(x)
        else:
            e = x.detach().clone()
        dist.broadcast(e, self.last_rank, group=self.ctx.pp_group)
        mb.e = leaf(e)
        rope = model.rotary(mb.pos)
        for g in plan.memory_groups:
            # A replica's gradient reaches e through its owner only (see _encoder_backward).
            source = mb.e if self.owns[g] else mb.e.detach()
            mb.memory[g] = model.memory[g](source, rope, mb.pos, mb.doc)
            mb.memory_leaves[g] = leaf_kv(mb.memory[g])

    def _run_segment(self, mb: MicroBatch, n: int, z_in: torch.Tensor, caches_in: dict[int, KV],
                     f_in) -> SegmentWork:
        """This stage's decoder layers (and on the last stage the loss and the next merge) for segment n.

        Pure computation from the given leaves; the caller communicates.
        """
        model, plan, detach = self.model, self.plan, self.bptt.detach
        a, b = mb.segments[n]
        pos, doc = mb.pos[:, a:b], mb.doc[:, a:b]
        memory_cut = mb.plan.truncation_start(n) if "memory" in detach else 0
        memory = {g: kv.first(b).detach_before(memory_cut) for g, kv in mb.memory_leaves.items()}
        z, caches_out = model.decoder_layers(z_in, pos, doc, caches_in, memory, plan.decoder_layers)
        work = SegmentWork(z_in, caches_in, caches_out, z)
        if plan.last:
            work.loss = model.segment_loss(z, mb.targets[:, a:b], mb.valid[:, a:b])
            work.f_in = f_in
            carried = model.carry(z, pos, f_in)
            if n + 1 < len(mb.segments):
                if "s" in detach and mb.plan.starts_truncation(n + 1):
                    carried = carried.detach()
                work.u_next, work.f_next = self._feedback_in(mb, n + 1, carried)
        return work

    def _feedback_in(self, mb: MicroBatch, n: int, carried: torch.Tensor):
        a, b = mb.segments[n]
        return self.model.feedback_in(mb.e[:, a:b], mb.pos[:, a:b], carried)

    def _forward_segment(self, mb: MicroBatch, n: int, caches: dict[int, KV], pending: list, mode: str):
        """Receive, run and send segment n; returns the caches it leaves for segment n+1."""
        plan = self.plan
        a, b = mb.segments[n]
        source = self.prev_rank if not plan.first else self.last_rank
        z_in = self._recv((mb.x.shape[0], b - a, self.model.cfg.d_model), self.model.tp.dtype, source)
        f_in = mb.feedback if plan.last else None
        if mode == CHECKPOINT:
            mb.received[n] = z_in
            if mb.plan.chunk_first(n) == n:
                mb.boundaries[n] = Boundary(caches, f_in)
        grad = contextlib.nullcontext() if mode == GRAPH else torch.no_grad()
        with grad:
            work = self._run_segment(mb, n, leaf(z_in), {i: leaf_kv(c) for i, c in caches.items()},
                                     leaf(f_in) if plan.last else None)
        if not plan.last:
            self._send(work.z_out, self.next_rank, pending)
        else:
            self._loss_total += float(work.loss)
            if self._answers is not None:
                a, b = mb.segments[n]
                self._correct_total += int(self.model.answer_correct(
                    work.z_out, mb.targets[:, a:b], mb.valid[:, a:b], self._answers))
            if work.u_next is not None:
                self._send(work.u_next, self.first_rank, pending)
            mb.feedback = work.f_next
        if mode == GRAPH:
            mb.work[n] = work
        return work.caches_out

    def _forward(self, micro: list[MicroBatch], mode: str):
        """Encoder pipeline, then the forward ring; returns this stage's schedule."""
        model, plan = self.model, self.plan
        pending: list = []
        self._loss_total, self._correct_total = 0.0, 0
        for mb in micro:
            self._encoder_forward(mb, pending)
        if plan.last:
            for mb in micro:
                mb.pre = self._feedback_in(mb, 0, model.initial_feedback(mb.x.shape[0], mb.x.device))
                mb.feedback = mb.pre[1]
                self._send(mb.pre[0], self.first_rank, pending)
        order = self._tick_order(micro)
        self._ring_start = time.perf_counter()
        caches = {m: {i: model.empty_kv(mb.x.shape[0], mb.x.device) for i in plan.decoder_layers}
                  for m, mb in enumerate(micro)}
        for _, m, n in order:
            caches[m] = self._forward_segment(micro[m], n, caches[m], pending, mode)
        for work in pending:
            work.wait()
        return order

    # ------------------------------------------------------------ backward
    def _recompute_chunk(self, mb: MicroBatch, n: int) -> None:
        """Rebuild the graphs of segment n's chunk, up to n, from the state kept at its start."""
        first = mb.plan.chunk_first(n)
        boundary = mb.boundaries.pop(first)
        caches, feedback = boundary.caches, boundary.feedback
        for earlier in range(first, n + 1):
            work = self._run_segment(mb, earlier, leaf(mb.received.pop(earlier)),
                                     {i: leaf_kv(c) for i, c in caches.items()},
                                     leaf(feedback) if self.plan.last else None)
            mb.work[earlier] = work
            caches, feedback = work.caches_out, work.f_next

    def _backward_segment(self, mb: MicroBatch, n: int, loss_scale: float, pending: list) -> None:
        plan = self.plan
        if n not in mb.work:
            self._recompute_chunk(mb, n)
        work = mb.work[n]
        outputs, grads = [], []
        nxt = mb.work.get(n + 1)
        truncated = nxt is not None and mb.plan.starts_truncation(n + 1)
        if nxt is not None and not (truncated and "cache" in self.bptt.detach):
            for i, c in work.caches_out.items():
                for out, lf in ((c.k, nxt.caches_in[i].k), (c.v, nxt.caches_in[i].v)):
                    if lf.grad is not None:
                        outputs.append(out)
                        grads.append(lf.grad)
        if not plan.last:
            outputs.append(work.z_out)
            grads.append(self._recv(work.z_out.shape, work.z_out.dtype, self.next_rank))
        else:
            outputs.append(work.loss)
            grads.append(torch.full_like(work.loss, loss_scale))
            if work.u_next is not None:
                outputs.append(work.u_next)
                grads.append(self._recv(work.u_next.shape, work.u_next.dtype, self.first_rank))
                if nxt.f_in.grad is not None and work.f_next.requires_grad:
                    outputs.append(work.f_next)
                    grads.append(nxt.f_in.grad)
        torch.autograd.backward(outputs, grads)
        target = self.prev_rank if not plan.first else self.last_rank
        self._send(work.z_in.grad, target, pending)
        if nxt is not None:  # the successor's graph is done with; free it
            del mb.work[n + 1]

    def _backward_pre(self, mb: MicroBatch) -> None:
        u0, f0 = mb.pre
        grad_u0 = self._recv(u0.shape, u0.dtype, self.first_rank)
        outputs, grads = [u0], [grad_u0]
        if mb.work[0].f_in.grad is not None and f0.requires_grad:
            outputs.append(f0)
            grads.append(mb.work[0].f_in.grad)
        torch.autograd.backward(outputs, grads)

    def _encoder_backward(self, mb: MicroBatch, pending: list) -> None:
        plan = self.plan
        outs, grads = [], []
        for g in sorted(mb.memory):  # the same order on every stage: replica all-reduces pair up
            kv, lf = mb.memory[g], mb.memory_leaves[g]
            for out, leaf_t in ((kv.k, lf.k), (kv.v, lf.v)):
                grad = leaf_t.grad if leaf_t.grad is not None else torch.zeros_like(leaf_t)
                if g in self.replica_groups:
                    dist.all_reduce(grad, group=self.replica_groups[g])
                outs.append(out)
                grads.append(grad)
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
    def _micro_batches(self, batches: list[dict], targets: Targets) -> list[MicroBatch]:
        return [MicroBatch.from_batch(batch, self.model, self.bptt, targets) for batch in batches]

    def _pipeline_sums(self) -> tuple[float, float]:
        """(summed loss, right answers) of the last pass, from the last stage to every stage."""
        last = self.plan.last
        sums = torch.tensor([self._loss_total if last else 0.0, self._correct_total if last else 0.0],
                            dtype=torch.float64, device=self.ctx.device)
        dist.all_reduce(sums, group=self.ctx.pp_group)
        return float(sums[0]), float(sums[1])

    def forward_backward(self, batches: list[dict], n_targets: float, targets: Targets = next_token_targets) -> float:
        """Accumulate gradients of sum(loss) / n_targets over ``batches`` (the micro-batches).

        ``targets`` says what the loss trains (the data's next tokens by
        default). Returns the summed loss of these micro-batches (known on every stage).
        """
        micro = self._micro_batches(batches, targets)
        order = self._forward(micro, CHECKPOINT if self.bptt.checkpoint else GRAPH)
        pending: list = []
        scale = 1.0 / n_targets
        for _, m, n in reversed(order):
            self._backward_segment(micro[m], n, scale, pending)
        if self.plan.last:
            for mb in reversed(micro):
                self._backward_pre(mb)
        self.stats.wall_s = time.perf_counter() - self._ring_start
        ring_wait = self.stats.wait_s  # the encoder pipeline's waits below are not the ring's bubble
        for mb in reversed(micro):
            self._encoder_backward(mb, pending)
        for work in pending:
            work.wait()
        self.stats.wait_s = ring_wait
        return self._pipeline_sums()[0]

    @torch.no_grad()
    def forward_loss(self, batches: list[dict], targets: Targets = next_token_targets,
                     answer_tokens=None) -> tuple[float, float, float]:
        """(summed loss, valid targets, right answers) of ``batches``, forward only (evaluation).

        Right answers are counted only when ``answer_tokens`` are given (else 0).
        """
        micro = self._micro_batches(batches, targets)
        self._answers = answer_tokens
        try:
            self._forward(micro, EVAL)
        finally:
            self._answers = None
        loss, correct = self._pipeline_sums()
        return loss, float(sum(int(mb.valid.sum()) for mb in micro)), correct
