"""One rank of bench_ring_encoder.py: the ring's forward_backward with every encoder layer made slow.

Each encoder layer sleeps ``tau`` seconds in forward and again in backward
(an identity autograd Function), standing in for a GPU stage-time; the
decoder is tiny, so the step's wall time is the encoder pipeline's schedule.
Prints one JSON line per M from the last rank: the median wall time of
``rounds`` steps.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist


class _Slow(torch.autograd.Function):
    tau = 0.0

    @staticmethod
    def forward(ctx, x):
        time.sleep(_Slow.tau)
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(_Slow.tau)
        return grad


def main() -> None:
    spec = json.loads(sys.argv[1])
    from rlt_scale.config import ModelConfig, ParallelConfig
    from rlt_scale.distributed import init_distributed
    from rlt_scale.model import blocks
    from rlt_scale.parallel.pipeline import RingPipeline
    from rlt_scale.parallel.stages import build_stage, plan_stage
    from rlt_scale.training.bptt import BPTT

    torch.set_num_threads(1)
    _Slow.tau = spec["tau"]
    original = blocks.EncoderBlock.forward

    def slow_forward(self, x, *args, **kwargs):
        x, keys = original(self, x, *args, **kwargs)
        return _Slow.apply(x), keys

    blocks.EncoderBlock.forward = slow_forward
    ctx = init_distributed(ParallelConfig(pp=int(os.environ["WORLD_SIZE"]), timeout_s=120), "cpu")
    cfg = ModelConfig(vocab_size=23, d_model=16, n_heads=2, n_enc_layers=ctx.pp, n_dec_layers=ctx.pp, window=3,
                      memory_groups=1, feedback_block=0, tie_layers=True, ffn_hidden_size=24)
    cfg.validate()
    torch.manual_seed(0)
    plan = plan_stage(cfg, ctx.pp_rank, ctx.pp)
    ring = RingPipeline(build_stage(cfg, ctx.tp_group, plan), plan, ctx, BPTT())
    for m in spec["micro"]:
        shape = (2, spec["tokens"] + 1)
        batches = [{"tokens": torch.randint(0, 23, shape), "doc_ids": torch.zeros(shape, dtype=torch.long),
                    "loss_mask": torch.ones(shape, dtype=torch.bool)} for _ in range(m)]
        times = []
        for _ in range(spec["rounds"] + 1):  # the first is a warm-up
            dist.barrier()
            start = time.perf_counter()
            ring.forward_backward(batches, 1.0)
            dist.barrier()
            times.append(time.perf_counter() - start)
        if ctx.rank == ctx.world_size - 1:
            print(json.dumps({"pp": ctx.pp, "m": m, "step_s": statistics.median(times[1:])}), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
