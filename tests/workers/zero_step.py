"""Run 3 optimizer steps through the ZeRO adapter in one layout; save what must match.

    torchrun --nproc-per-node N tests/workers/zero_step.py OUT_FILE STAGES key=value ...

STAGES is a comma list of ZeRO stages (``1,2``) run one after the other on a
fresh trainer each (``parallel.zero_stage`` set accordingly), so one launch
covers both. The step is the trainer's own ``forward_backward`` +
``optimizer_step``, which hand the DP reduction, clipping and the optimizer
step to :class:`ZeroDataParallel`.

The first rank of each pipeline stage writes to OUT_FILE.stage<N>, per ZeRO stage: the step losses and grad norms, the full gradients
of step 1 (TP gathered) and the global norm of those gradients by
``rlt_scale.parallel.grad_norm.global_grad_norm``, the full parameters after
step 3, and whether the trainer's own checkpoint (``Trainer.save``, the sharded
format) resumed into a fresh trainer continues steps 4 and 5 bit-identically
(losses, norms, parameters).
"""

import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def main() -> None:
    out_file, stages, overrides = Path(sys.argv[1]), [int(s) for s in sys.argv[2].split(",")], sys.argv[3:]
    from rlt_scale.config import load_config
    from rlt_scale.distributed import init_distributed
    from rlt_scale.parallel.grad_norm import global_grad_norm
    from rlt_scale.parallel.tensor_shards import full_state
    from rlt_scale.training.trainer import Trainer

    base = load_config(None, overrides)
    ctx = init_distributed(base.parallel, base.trainer.device)
    t = base.trainer

    def build(stage):
        run_dir = out_file.parent / f"{out_file.stem}-zero{stage}"  # its own checkpoints
        trainer = Trainer(load_config(None, overrides + [f"parallel.zero_stage={stage}", f"checkpoint.dir={run_dir}"]),
                          ctx)
        return trainer, trainer.engine.zero

    def check_norm(trainer, zero):
        """global_grad_norm of the adapter's (DP-reduced, TP-local) gradients."""
        grads = zero.full_grads(tp_gather=False)
        params = dict(trainer.model.named_parameters())
        for name, g in grads.items():
            params[name].grad = g
        norm = float(global_grad_norm(params.values(), ctx.tp_rank, ctx.model_parallel_group))
        for p in params.values():
            p.grad = None
        return norm

    results = {}
    for stage in stages:
        start = time.perf_counter()
        trainer, zero = build(stage)
        init_s = time.perf_counter() - start
        batches = iter(trainer.loader)
        losses, norms, first_grads, first_norm_check = [], [], None, None
        for step in range(t.max_steps):
            losses.append(trainer.forward_backward([next(batches) for _ in range(t.grad_accum_steps)]))
            if step == 0:
                first_grads = zero.full_grads()
                first_norm_check = check_norm(trainer, zero)
            norms.append(trainer.optimizer_step())
        params = full_state(trainer.model, ctx.tp_group)
        steps_s = time.perf_counter() - start - init_s

        # the trainer's checkpoint round trip, then two more steps both ways: both steps
        # read the restored AdamW moments, so the weights after them match only if those did
        trainer.step = t.max_steps
        trainer.save()
        extra = [[next(batches) for _ in range(t.grad_accum_steps)] for _ in range(2)]
        after = []
        for resumed in (False, True):
            if resumed:
                trainer, zero = build(stage)
                trainer.maybe_resume()
            steps = [(trainer.forward_backward(b), trainer.optimizer_step()) for b in extra]
            after.append((steps, {k: v.clone() for k, v in trainer.model.state_dict().items() if v is not None}))
        (s0, p0), (s1, p1) = after
        same = s0 == s1 and all(torch.equal(p0[k], p1[k]) for k in p0)
        flag = torch.tensor([1 if same else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        results[stage] = {"losses": losses, "norms": norms, "grads": first_grads, "norm_check": first_norm_check,
                          "params": params, "resume_bit_identical": bool(flag.item()),
                          "init_s": init_s, "steps_s": steps_s}
    if ctx.tp_rank == 0 and ctx.dp_rank == 0:  # one file per pipeline stage
        torch.save(results, f"{out_file}.stage{ctx.pp_rank}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
