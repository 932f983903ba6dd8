"""Run 3 optimizer steps of the real trainer in one layout; save what must match.

    torchrun --nproc-per-node N tests/workers/layout_step.py OUT_FILE key=value ...

The first rank of each pipeline stage writes the step losses, grad norms, the
stage's full (TP-gathered) gradients of the first step, its full
parameters after the last step and the evaluation loss and right answers
(``data.eval_path``) to OUT_FILE.stage<N>. ``RLT_TEST_SUPERVISION=parity``
trains the state-tracking experiments' running-state objective instead.
"""

import sys

import torch


def main() -> None:
    out_file, overrides = sys.argv[1], sys.argv[2:]
    from rlt_scale.config import load_config
    from rlt_scale.distributed import init_distributed
    from rlt_scale.parallel.tensor_shards import full_state
    from rlt_scale.training.trainer import Trainer

    cfg = load_config(None, overrides)
    ctx = init_distributed(cfg.parallel, cfg.trainer.device)
    trainer = Trainer(cfg, ctx, objective=_objective())
    batches = iter(trainer.loader)
    losses, norms, first_grads = [], [], None
    for step in range(cfg.trainer.max_steps):
        losses.append(trainer.forward_backward([next(batches) for _ in range(cfg.trainer.grad_accum_steps)]))
        if step == 0:
            first_grads = full_state(trainer.model, ctx.tp_group, grads=True)
        norms.append(trainer.optimizer_step())
    params = full_state(trainer.model, ctx.tp_group)
    tp_consistent = _replicated_params_agree(trainer.model, ctx.tp_group)
    sums = trainer.evaluate_sums()
    if ctx.tp_rank == 0 and ctx.dp_rank == 0:  # one file per pipeline stage
        torch.save({"losses": losses, "norms": norms, "grads": first_grads, "params": params,
                    "eval_loss": sums and sums.mean_loss, "eval_correct": sums and sums.correct,
                    "tp_replicas_agree": tp_consistent},
                   f"{out_file}.stage{ctx.pp_rank}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


def _objective():
    """The trainer's default objective, or with RLT_TEST_SUPERVISION=<task> that task's running-state
    targets and answer accuracy (the state-tracking experiments' objective)."""
    import os

    from rlt_scale.training.engine import Objective

    task = os.environ.get("RLT_TEST_SUPERVISION")
    if not task:
        return Objective()
    from rlt_scale.experiments.evaluate import ANSWER_TOKENS
    from rlt_scale.experiments.supervision import as_objective_targets, target_fn

    return Objective(targets=as_objective_targets(target_fn(task, "running")), answer_tokens=ANSWER_TOKENS[task])


def _replicated_params_agree(model, tp_group) -> bool:
    """Whether every parameter that TP does not split (norms, merge, s_*) is bit-identical on all TP ranks."""
    from rlt_scale.parallel.tensor_shards import is_tp_sharded

    agree = True
    size = torch.distributed.get_world_size(tp_group)
    for _, p in model.named_parameters():
        if not is_tp_sharded(p):
            copies = [torch.empty_like(p.data) for _ in range(size)]
            torch.distributed.all_gather(copies, p.data.contiguous(), group=tp_group)
            agree &= all(torch.equal(c, copies[0]) for c in copies)
    return agree


if __name__ == "__main__":
    main()
