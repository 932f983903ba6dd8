"""The ring pipeline schedule for the recurrent decoder (DESIGN.md section 3).

Segment n+1 (a token for K=1) can enter stage 0 only after the feedback s
of segment n has left the last stage, so a 1F1B schedule cannot run the
decoder. Here the decoder is a ring: the last stage merges that s with the
encoder output of segment n+1 and sends the merged input u to stage 0, and
M >= PP micro-batches circulate so that every stage is busy at every tick.

Timeline (:class:`~rlt_scale.parallel.ring_work.RingSchedule`). With
R = max(M, PP), micro-batch m's segment n runs on stage s at tick
``n*R + m + s``. Its input was produced at the previous tick (by stage s-1),
or for stage 0 at tick ``(n-1)*R + m + PP-1 < n*R + m`` by the last stage.
Fill and drain cost PP-1 ticks per sample, not per micro-batch. Every message
is exchanged at its consumer's tick, posted with that tick's other sends and
receives as one group (:mod:`rlt_scale.parallel.ring_p2p`): under NCCL, whose
sends do not buffer, any other order can deadlock.

Backward runs the same ticks in reverse. Every (stage, micro-batch, segment)
piece of work keeps its own small graph whose inputs are leaves: the received
activation, the incoming window caches, the carried feedback (last stage),
and shared leaves for the encoder output and the memory. Backward of a piece
takes the gradients of its outputs (from the next stage, from its own
successor in time, from the loss) and yields the gradients of those leaves,
which travel back around the ring. The last stage reads out and takes the
loss once per chunk, as one process does, from leaves of its segments'
outputs. The encoder runs as an ordinary pipeline over the micro-batches
(M + PP - 1 stage-times each way); its final output is broadcast to every
stage, which builds the memory groups its decoder layers read.

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

Losses and right answers are summed on the device and read once per pass:
a host read per segment would stall a GPU at every token.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from rlt_scale.distributed import ParallelContext
from rlt_scale.training.bptt import BPTT, Targets, next_token_targets
from rlt_scale.model.rlt import RLT
from rlt_scale.model.state import KV
from rlt_scale.parallel.ring_p2p import TickExchange, WaitTimer
from rlt_scale.parallel.ring_work import (Boundary, MicroBatch, RingSchedule, RingStats, SegmentWork, leaf,
                                          leaf_kv)
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
        self._sums = torch.zeros(3, dtype=torch.float64, device=ctx.device)  # last stage: loss, right answers, targets
        self._answers = None  # evaluation: count right answers among these token ids

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

    def _links(self, timer: WaitTimer | None = None) -> TickExchange:
        return TickExchange(self.ctx.pp_group, self.ctx.device, timer)

    def _activation(self, mb: MicroBatch, length: int) -> tuple[int, int, int]:
        return mb.x.shape[0], length, self.model.cfg.d_model

    # ----------------------------------------------------------- encoder
    def _encoder_forward(self, micro: list[MicroBatch]) -> None:
        """Every micro-batch's encoder layers as a plain pipeline: stage s runs micro-batch m at tick m + s.

        Then the last stage's outputs are broadcast, all at once: waiting for
        each micro-batch's broadcast in turn would cost M x PP stage-times.
        """
        model, plan = self.model, self.plan
        links = self._links()
        for tick in range(len(micro) + plan.n_stages - 1):
            m = tick - plan.stage
            mb = micro[m] if 0 <= m < len(micro) else None
            receive = []
            if mb is not None and not plan.first:
                receive = [(self.prev_rank, self._activation(mb, mb.x.shape[1]), model.tp.dtype)]
            got = links.exchange(tick, receive)
            if mb is None:
                continue
            if plan.first:
                x = model.embed(mb.x)
            else:
                mb.enc_in = x = leaf(got[0])
            mb.enc_out, _ = model.encoder_layers(x, mb.pos, mb.doc, plan.encoder_layers,
                                                 recompute=self.bptt.recompute_encoder)
            if not plan.last:
                links.send_at(tick + 1, self.next_rank, mb.enc_out)
        links.close()
        shared = []
        for mb in micro:
            e = mb.enc_out.detach().clone() if plan.last else torch.empty_like(mb.enc_out)
            shared.append((e, dist.broadcast(e, self.last_rank, group=self.ctx.pp_group, async_op=True)))
        for mb, (e, handle) in zip(micro, shared):
            handle.wait()
            mb.e = leaf(e)
            rope = model.rotary(mb.pos)
            for g in plan.memory_groups:
                # A replica's gradient reaches e through its owner only (see _encoder_backward).
                source = mb.e if self.owns[g] else mb.e.detach()
                mb.memory[g] = model.memory[g](source, rope, mb.pos, mb.doc)
                mb.memory_leaves[g] = leaf_kv(mb.memory[g])

    def _encoder_backward(self, micro: list[MicroBatch]) -> None:
        """The memory's and then the encoder's backward, for every micro-batch (last first).

        Every all-reduce is posted before the backward chain starts: the
        replica sums of the memory gradients, then the sums of each
        micro-batch's gradient of e over the stages. The chain (last stage to
        first, a plain pipeline) waits only for what it reads, so its
        micro-batches overlap: M + PP - 1 stage-times, not M x PP. The
        operations and their order per tensor are those of a one-by-one
        walk, so the gradients are bit-identical to it.
        """
        plan, order = self.plan, list(reversed(micro))
        memory_grads = []
        for mb in order:
            outs, grads, handles = [], [], []
            for g in sorted(mb.memory):  # the same order on every stage: replica all-reduces pair up
                kv, lf = mb.memory[g], mb.memory_leaves[g]
                for out, leaf_t in ((kv.k, lf.k), (kv.v, lf.v)):
                    grad = leaf_t.grad if leaf_t.grad is not None else torch.zeros_like(leaf_t)
                    if g in self.replica_groups:
                        handles.append(dist.all_reduce(grad, group=self.replica_groups[g], async_op=True))
                    outs.append(out)
                    grads.append(grad)
            memory_grads.append((outs, grads, handles))
        grad_e_sums = []
        for mb, (outs, grads, handles) in zip(order, memory_grads):
            for handle in handles:
                handle.wait()
            if outs:
                torch.autograd.backward(outs, grads)
            grad_e = mb.e.grad if mb.e.grad is not None else torch.zeros_like(mb.e)
            grad_e_sums.append((grad_e, dist.all_reduce(grad_e, group=self.ctx.pp_group, async_op=True)))
        links = self._links()
        for tick in range(len(order) + plan.n_stages - 1):
            j = tick - (plan.n_stages - 1 - plan.stage)
            mb = order[j] if 0 <= j < len(order) else None
            receive = []
            if mb is not None and not plan.last:
                receive = [(self.next_rank, tuple(mb.enc_out.shape), mb.enc_out.dtype)]
            got = links.exchange(tick, receive)
            if mb is None:
                continue
            if plan.last:
                grad_out, handle = grad_e_sums[j]
                handle.wait()
            else:
                grad_out = got[0]
            torch.autograd.backward([mb.enc_out], [grad_out])
            if not plan.first:
                links.send_at(tick + 1, self.prev_rank, mb.enc_in.grad)
        links.close()
        for _, handle in grad_e_sums:  # the other stages' contributions must be sent before their buffers go
            handle.wait()

    # ------------------------------------------------------------- forward
    def _run_segment(self, mb: MicroBatch, n: int, z_in: torch.Tensor, caches_in: dict[int, KV],
                     f_in) -> SegmentWork:
        """This stage's decoder layers (and on the last stage the next merge) for segment n.

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

    def _chunk_loss(self, mb: MicroBatch, c: int, z: torch.Tensor) -> torch.Tensor:
        """Summed cross-entropy of chunk ``c``'s readout from its outputs ``z`` (its segments' in order)."""
        a, b = mb.plan.chunks[c]
        return self.model.segment_loss(z, mb.targets[:, a:b], mb.valid[:, a:b])

    def _read_out(self, mb: MicroBatch, n: int, work: SegmentWork, graph: bool) -> None:
        """Last stage: keep segment n's output; at the end of its chunk, read the chunk out and count its loss.

        One readout and loss per chunk, as in one process (``bptt._chunk_loss``):
        their tensor-parallel all-reduces run per chunk, not per token. With a
        graph the loss reads leaves of the segments' outputs, so that backward
        can hand each segment the gradient of its own output.
        """
        if graph:
            work.z_read = leaf(work.z_out)
        mb.chunk_z.append(work.z_read if graph else work.z_out)
        if not mb.ends_chunk(n):
            return
        c = mb.plan.chunk_of[n]
        z, mb.chunk_z = torch.cat(mb.chunk_z, dim=1), []
        loss = self._chunk_loss(mb, c, z)
        if graph:
            mb.chunk_loss[c] = loss
        self._sums[0] += loss.detach()
        if self._answers is not None:
            a, b = mb.plan.chunks[c]
            self._sums[1] += self.model.answer_correct(z, mb.targets[:, a:b], mb.valid[:, a:b], self._answers)

    def _forward_segment(self, mb: MicroBatch, m: int, n: int, z_in: torch.Tensor, caches: dict[int, KV],
                         links: TickExchange, schedule: RingSchedule, mode: str):
        """Run segment n on the received ``z_in`` and hold its outputs; returns the caches it leaves for n+1."""
        plan = self.plan
        f_in = mb.feedback if plan.last else None
        if mode == CHECKPOINT:
            mb.received[n] = z_in
            if mb.plan.chunk_first(n) == n:
                mb.boundaries[n] = Boundary(caches, f_in)
        with contextlib.nullcontext() if mode == GRAPH else torch.no_grad():
            work = self._run_segment(mb, n, leaf(z_in), {i: leaf_kv(c) for i, c in caches.items()},
                                     leaf(f_in) if plan.last else None)
            if plan.last:
                self._read_out(mb, n, work, graph=mode == GRAPH)
        if not plan.last:
            links.send_at(schedule.tick(plan.stage, m, n) + 1, self.next_rank, work.z_out)
        else:
            if work.u_next is not None:  # stage 0 runs segment n+1 of this micro-batch at that tick
                links.send_at(schedule.tick(0, m, n + 1), self.first_rank, work.u_next)
            mb.feedback = work.f_next
        if mode == GRAPH:
            mb.work[n] = work
        return work.caches_out

    def _forward(self, micro: list[MicroBatch], mode: str, timer: WaitTimer | None = None) -> RingSchedule:
        """Encoder pipeline, then the forward ring; returns the ring's schedule."""
        model, plan = self.model, self.plan
        self._sums.zero_()
        self._encoder_forward(micro)
        schedule = RingSchedule.of(micro, plan.n_stages)
        links = self._links(timer)
        if plan.last:
            self._sums[2] += sum(mb.valid.sum() for mb in micro)
            for m, mb in enumerate(micro):
                mb.pre = self._feedback_in(mb, 0, model.initial_feedback(mb.x.shape[0], mb.x.device))
                mb.feedback = mb.pre[1]
                links.send_at(schedule.tick(0, m, 0), self.first_rank, mb.pre[0])
        caches = {m: {i: model.empty_kv(mb.x.shape[0], mb.x.device) for i in plan.decoder_layers}
                  for m, mb in enumerate(micro)}
        source = self.prev_rank if not plan.first else self.last_rank
        if timer:
            timer.start()
        for tick in range(schedule.ticks):
            slot = schedule.work(plan.stage, tick)
            receive = []
            if slot is not None:
                mb = micro[slot[0]]
                a, b = mb.segments[slot[1]]
                receive = [(source, self._activation(mb, b - a), model.tp.dtype)]
            got = links.exchange(tick, receive)
            if slot is not None:
                m, n = slot
                caches[m] = self._forward_segment(micro[m], m, n, got[0], caches[m], links, schedule, mode)
        links.close()
        return schedule

    # ------------------------------------------------------------ backward
    def _recompute_chunk(self, mb: MicroBatch, n: int) -> None:
        """Rebuild the graphs of segment n's chunk, which n ends, from the state kept at its start."""
        first = mb.plan.chunk_first(n)
        boundary = mb.boundaries.pop(first)
        caches, feedback = boundary.caches, boundary.feedback
        for earlier in range(first, n + 1):
            work = self._run_segment(mb, earlier, leaf(mb.received.pop(earlier)),
                                     {i: leaf_kv(c) for i, c in caches.items()},
                                     leaf(feedback) if self.plan.last else None)
            mb.work[earlier] = work
            caches, feedback = work.caches_out, work.f_next
        if self.plan.last:  # and the chunk's readout and loss
            chunk = [mb.work[i] for i in range(first, n + 1)]
            for work in chunk:
                work.z_read = leaf(work.z_out)
            c = mb.plan.chunk_of[n]
            mb.chunk_loss[c] = self._chunk_loss(mb, c, torch.cat([w.z_read for w in chunk], dim=1))

    def _backward_segment(self, mb: MicroBatch, m: int, n: int, received: list[torch.Tensor], loss_scale: float,
                          links: TickExchange, schedule: RingSchedule) -> None:
        plan = self.plan
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
            grads.append(received[0])
        else:
            loss = mb.chunk_loss.pop(mb.plan.chunk_of[n], None)
            if loss is not None:  # backward meets a chunk at its last segment: the readout's backward
                torch.autograd.backward(loss, torch.full_like(loss, loss_scale))  # grads every segment's output
            outputs.append(work.z_out)
            grads.append(work.z_read.grad)
            if work.u_next is not None:
                outputs.append(work.u_next)
                grads.append(received[0])
                if nxt.f_in.grad is not None and work.f_next.requires_grad:
                    outputs.append(work.f_next)
                    grads.append(nxt.f_in.grad)
        torch.autograd.backward(outputs, grads)
        # Where the gradient of z_in is needed: by the stage before at the next step, or for stage 0 by
        # the last stage when it undoes segment n-1 (u_n came from there), or after the ring (u_0).
        step = schedule.step(schedule.tick(plan.stage, m, n))
        if not plan.first:
            links.send_at(step + 1, self.prev_rank, work.z_in.grad)
        elif n > 0:
            links.send_at(schedule.step(schedule.tick(plan.n_stages - 1, m, n - 1)), self.last_rank, work.z_in.grad)
        else:
            links.send_at(schedule.ticks, self.last_rank, work.z_in.grad)
        if nxt is not None:  # the successor's graph is done with; free it
            del mb.work[n + 1]

    def _backward_pre(self, mb: MicroBatch, grad_u0: torch.Tensor) -> None:
        u0, f0 = mb.pre
        outputs, grads = [u0], [grad_u0]
        if mb.work[0].f_in.grad is not None and f0.requires_grad:
            outputs.append(f0)
            grads.append(mb.work[0].f_in.grad)
        torch.autograd.backward(outputs, grads)

    def _backward(self, micro: list[MicroBatch], schedule: RingSchedule, loss_scale: float,
                  timer: WaitTimer | None = None) -> None:
        """The backward ring: forward's ticks in reverse, then the gradients of the first merges."""
        plan = self.plan
        links = self._links(timer)
        for step in range(schedule.ticks):
            slot = schedule.work(plan.stage, schedule.step(step))
            receive = []
            if slot is not None:
                m, n = slot
                mb = micro[m]
                if n not in mb.work:  # local work first, then wait for the gradient
                    self._recompute_chunk(mb, n)
                work = mb.work[n]
                if not plan.last:
                    receive = [(self.next_rank, tuple(work.z_out.shape), work.z_out.dtype)]
                elif work.u_next is not None:
                    receive = [(self.first_rank, tuple(work.u_next.shape), work.u_next.dtype)]
            got = links.exchange(step, receive)
            if slot is not None:
                self._backward_segment(micro[m], m, n, got, loss_scale, links, schedule)
        # Stage 0 holds u_0's gradients for one more step, in the order it made them (last micro-batch first).
        last_first = list(reversed(micro))
        receive = [(self.first_rank, tuple(mb.pre[0].shape), mb.pre[0].dtype) for mb in last_first if plan.last]
        got = links.exchange(schedule.ticks, receive)
        for mb, grad in zip(last_first, got):
            self._backward_pre(mb, grad)
        links.close()

    # ---------------------------------------------------------------- run
    def _micro_batches(self, batches: list[dict], targets: Targets) -> list[MicroBatch]:
        return [MicroBatch.from_batch(batch, self.model, self.bptt, targets) for batch in batches]

    def _pipeline_sums(self) -> list[float]:
        """(summed loss, right answers, valid targets) of the last pass, on every stage.

        Summed on the last stage's device and read here: the pass's one host read.
        """
        sums = self._sums.clone()  # zero except on the last stage
        dist.all_reduce(sums, group=self.ctx.pp_group)
        return sums.tolist()

    def forward_backward(self, batches: list[dict], n_targets: float, targets: Targets = next_token_targets) -> float:
        """Accumulate gradients of sum(loss) / n_targets over ``batches`` (the micro-batches).

        ``targets`` says what the loss trains (the data's next tokens by
        default). Returns the summed loss of these micro-batches (known on every stage).
        """
        micro = self._micro_batches(batches, targets)
        timer = WaitTimer(self.ctx.device)
        schedule = self._forward(micro, CHECKPOINT if self.bptt.checkpoint else GRAPH, timer)
        self._backward(micro, schedule, 1.0 / n_targets, timer)
        timer.stop()  # the encoder's backward below is not the ring's
        self._encoder_backward(micro)
        loss = self._pipeline_sums()[0]
        self.stats = RingStats(schedule.ticks, schedule.busy, *timer.totals())
        return loss

    @torch.no_grad()
    def forward_loss(self, batches: list[dict], targets: Targets = next_token_targets,
                     answer_tokens=None) -> tuple[float, float, float]:
        """(summed loss, valid targets, right answers) of ``batches``, forward only (evaluation).

        Right answers are counted only when ``answer_tokens`` are given (else 0).
        ``stats`` keep describing the last training pass.
        """
        micro = self._micro_batches(batches, targets)
        self._answers = answer_tokens
        try:
            self._forward(micro, EVAL)
        finally:
            self._answers = None
        loss, correct, n_valid = self._pipeline_sums()
        return loss, n_valid, correct
