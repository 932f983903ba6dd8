"""One ring benchmark point (run under torchrun by bench/bench_ring.py).

Times a few training steps of the real trainer at a given PP and micro-batch
count M and prints one JSON line from rank 0: tokens/s and stage 0's ring
bubble (scheduled and measured)."""

import json
import sys
import time


def main() -> None:
    from rlt_scale.config import load_config
    from rlt_scale.distributed import init_distributed
    from rlt_scale.training.trainer import Trainer

    steps, overrides = int(sys.argv[1]), sys.argv[2:]
    cfg = load_config(None, overrides)
    ctx = init_distributed(cfg.parallel, "cpu")
    trainer = Trainer(cfg, ctx)
    batches = iter(trainer.loader)
    trainer.train_step([next(batches) for _ in range(cfg.trainer.grad_accum_steps)])  # warm-up
    start = time.perf_counter()
    for _ in range(steps):
        trainer.train_step([next(batches) for _ in range(cfg.trainer.grad_accum_steps)])
    elapsed = time.perf_counter() - start
    if ctx.rank == 0:
        tokens = steps * cfg.trainer.grad_accum_steps * cfg.trainer.micro_batch_size * trainer.loader.seq_len
        stats = trainer.engine.ring.stats if hasattr(trainer.engine, "ring") else None
        print(json.dumps({
            "pp": ctx.pp, "m": cfg.trainer.grad_accum_steps, "tokens_per_s": tokens / elapsed,
            "ticks": stats.ticks if stats else None,
            "idle_scheduled": stats.idle_fraction if stats else 0.0,
            "idle_measured": stats.measured_idle_fraction if stats else 0.0,
        }), flush=True)


if __name__ == "__main__":
    main()
