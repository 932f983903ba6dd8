"""Train with the real trainer (resuming from ``latest`` when the run has one); save what must match.

    torchrun --nproc-per-node N tests/workers/checkpoint_run.py OUT_FILE key=value ...

``Trainer.fit()`` as ``rlt-train`` runs it: resume, train to trainer.max_steps,
checkpoint every checkpoint.interval steps and at the end. The first rank of
each pipeline stage then writes the losses of the steps this launch trained
and the stage's full (TP-gathered) parameters to OUT_FILE.stage<N>.
The ``__main__`` guard matters: megatron's checkpoint save starts a
multiprocessing Manager.
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
    trainer = Trainer(cfg, ctx)
    summary = trainer.fit()
    params = full_state(trainer.model, ctx.tp_group)
    if ctx.tp_rank == 0 and ctx.dp_rank == 0:  # one file per pipeline stage
        torch.save({"losses": summary.losses, "steps": summary.steps, "params": params}, f"{out_file}.stage{ctx.pp_rank}")
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
