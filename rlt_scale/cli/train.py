"""``rlt-train CONFIG [key=value ...]``: train an RLT.

Examples::

    rlt-train configs/tiny.yaml
    rlt-train configs/tiny.yaml trainer.max_steps=50 model.window=16
"""

from __future__ import annotations

import argparse
import sys

from rlt_scale.config import load_config
from rlt_scale.errors import CheckpointError, ConfigError, DataError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="rlt-train", description=__doc__.split("\n")[0])
    parser.add_argument("config", help="YAML file, e.g. configs/tiny.yaml")
    parser.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. trainer.max_steps=10")
    # The deepspeed launcher appends --local_rank=N; the rank comes from the environment anyway.
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        cfg = load_config(args.config, args.overrides)
        from rlt_scale.training.trainer import Trainer  # heavy imports after the config is known good

        trainer = Trainer(cfg)
        summary = trainer.fit()
    except (ConfigError, DataError, FileNotFoundError, CheckpointError) as err:
        print(f"rlt-train: error: {err}", file=sys.stderr)
        return 2
    if trainer.ctx.is_logging_rank:  # the figures are already global: one summary per job
        print(summary, flush=True)
    _leave_job(trainer.ctx.world_size)
    return 0


def _leave_job(world_size: int) -> None:
    """End a multi-process job together: no rank tears down the rendezvous store (held by
    rank 0) while another still talks to it, which killed late ranks with
    ``terminate called without an active exception`` (seen across two nodes under load)."""
    import torch.distributed as dist

    if world_size > 1 and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
