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
step 3, and whether a save/load round trip of every rank's adapter state
(``torch.save`` / ``torch.load(weights_only=True)``) into a fresh trainer and
adapter resumes step 4 bit-identically (loss, norm, parameters, state).
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
    from rlt_scale.parallel.shards import full_state
    from rlt_scale.training.trainer import Trainer

    base = load_config(None, overrides)
    ctx = init_distributed(base.parallel, base.trainer.device)
    t = base.trainer

    def build(stage):
        trainer = Trainer(load_config(None, overrides + [f"parallel.zero_stage={stage}"]), ctx)
        return trainer, trainer.zero

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

        # save / load round trip, per rank, then one more step both ways
        saved = out_file.parent / f"{out_file.stem}.zero{stage}.rank{ctx.rank}.pt"
        torch.save({"model": trainer.model.state_dict(), "zero": zero.state_dict(),
                    "lr_schedule": trainer.lr_schedule.state_dict()}, saved)
        extra = [next(batches) for _ in range(t.grad_accum_steps)]
        after = []
        for resumed in (False, True):
            if resumed:
                trainer, zero = build(stage)
                state = torch.load(saved, map_location="cpu", weights_only=True)
                trainer.model.load_state_dict(state["model"])
                zero.load_state_dict(state["zero"])
                trainer.lr_schedule.load_state_dict(state["lr_schedule"])
            loss = trainer.forward_backward(extra)
            norm = trainer.optimizer_step()
            after.append((loss, norm, {k: v.clone() for k, v in trainer.model.state_dict().items() if v is not None}, zero.state_dict()))
        (l0, n0, p0, s0), (l1, n1, p1, s1) = after
        same = l0 == l1 and n0 == n1 and all(torch.equal(p0[k], p1[k]) for k in p0) and _equal(s0, s1)
        flag = torch.tensor([1 if same else 0])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        results[stage] = {"losses": losses, "norms": norms, "grads": first_grads, "norm_check": first_norm_check,
                          "params": params, "resume_bit_identical": bool(flag.item()),
                          "init_s": init_s, "steps_s": steps_s}
    if ctx.tp_rank == 0 and ctx.dp_rank == 0:  # one file per pipeline stage
        torch.save(results, f"{out_file}.stage{ctx.pp_rank}")
    dist.barrier()
    dist.destroy_process_group()


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(_equal(x, y) for x, y in zip(a, b))
    return a == b


if __name__ == "__main__":
    main()
