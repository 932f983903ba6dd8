"""Training throughput (tokens/s) and MFU of the tiny and a mid-size config on this machine.

    python bench/bench_throughput.py                      # tiny + mid, ~2-3 minutes on 2 cores
    python bench/bench_throughput.py --configs tiny --steps 5

Each config runs full optimizer steps (run_sequence + backward + clip + AdamW,
as the trainer does) on random tokens, with the recurrence schedule of its
YAML (chunk size, chunk checkpointing) at the sequence length and batch given
here (the 100M config's own 16 x 1024 would take minutes per step on a CPU).
MFU's peak is measured in the same run, before and after the configs, by a
large float32 matmul on the same cores and threads; the higher is used and both
are reported. MFU = useful model FLOPs / step time / peak; HFU counts what is
executed (masked attention, recomputation). FLOPs from rlt_scale.profiling.
"""

from __future__ import annotations

import argparse
import statistics
import sys

from common import Clock, machine, model_config, print_table, set_threads, warn_if_busy, write_results

from rlt_scale.config import OptimizerConfig, load_config
from rlt_scale.profiling.flops import analytic_flops
from rlt_scale.profiling.peak import measure_peak
from rlt_scale.profiling.workload import Workload, make_model, make_tokens, train_step
from rlt_scale.training.optim import build_optimizer

# (seq_len, batch, timed steps) per config: tiny as `make train` runs it (128 tokens, micro-batch 8);
# mid at a size whose CPU step takes ~30 s (its own 16 x 1024 would take ~15 min per step).
SHAPES = {"tiny": (128, 8, 3), "mid": (128, 1, 2)}


def schedule_of(name: str, seq_len: int) -> tuple[int, bool]:
    from common import CONFIGS, ROOT

    path = ROOT / CONFIGS[name][0]
    if not path.is_file():
        return 0, False
    t = load_config(str(path)).trainer
    chunk = t.chunk_size if t.chunk_size < seq_len else 0
    return chunk, t.activation_checkpointing == "chunk"


def run_config(name: str, steps: int, seq_len: int, batch: int) -> dict:
    cfg, source = model_config(name)
    chunk, ckpt = schedule_of(name, seq_len)
    work = Workload(batch, seq_len, chunk_size=chunk, checkpoint=ckpt)
    model = make_model(cfg)
    optimizer = build_optimizer(model, OptimizerConfig())
    tokens = make_tokens(cfg, work)
    with Clock() as first:
        train_step(model, optimizer, tokens, work)
    walls, cpus = [], []
    for _ in range(steps):
        with Clock() as c:
            train_step(model, optimizer, tokens, work)
        walls.append(c.wall)
        cpus.append(c.cpu)
    flops = analytic_flops(cfg, work)
    counts = model.parameter_counts()
    return {
        "config": name, "source": source, "workload": work.describe(), "seq_len": seq_len, "batch": batch,
        "chunk_size": chunk, "checkpoint": ckpt, "feedback_block": cfg.feedback_block,
        "parameters_unique": counts["unique"], "parameters_applied": counts["applied"],
        "first_step_s": first.wall, "step_wall_s": walls, "step_cpu_s": cpus,
        "median_step_s": statistics.median(walls), "median_cpu_s": statistics.median(cpus),
        "tokens": work.tokens, "model_flops": flops.model_flops, "hardware_flops": flops.hardware_flops,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="tiny,mid")
    p.add_argument("--steps", type=int, help="timed steps per config after one warm-up (default 3 tiny, 2 mid)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core box, 2 OpenMP threads stall on each other)")
    p.add_argument("--seq-len", type=int, help="override every config's sequence length")
    p.add_argument("--batch", type=int, help="override every config's batch")
    args = p.parse_args(argv)
    threads = set_threads(args.threads)
    info = machine()
    warn_if_busy(info)
    peaks = [measure_peak()]
    results = []
    for name in args.configs.split(","):
        seq_len, batch, steps = SHAPES[name]
        print(f"# {name}: running ...", flush=True)
        results.append(run_config(name, args.steps or steps, args.seq_len or seq_len, args.batch or batch))
    peaks.append(measure_peak())
    peak = max(peaks, key=lambda x: x.flops_per_s)
    rows = []
    for r in results:
        step = r["median_step_s"]
        r["tokens_per_s"] = r["tokens"] / step
        r["mfu"] = r["model_flops"] / step / peak.flops_per_s
        r["hfu"] = r["hardware_flops"] / step / peak.flops_per_s
        r["mfu_cpu_time"] = r["model_flops"] / r["median_cpu_s"] / (peak.flops_per_s / threads)
        rows.append([r["config"], f"{r['parameters_unique'] / 1e6:.1f}M", r["workload"], f"K={r['feedback_block']}",
                     f"{step:.2f}s", f"{r['median_cpu_s']:.2f}s", f"{r['tokens_per_s']:,.0f}",
                     f"{r['model_flops'] / r['tokens'] / 1e6:.2f}M", f"{100 * r['mfu']:.2f}%", f"{100 * r['hfu']:.2f}%"])
    print_table(["config", "params", "workload", "recurrence", "step", "cpu/step", "tokens/s", "FLOPs/token",
                 "MFU", "HFU"], rows,
                f"Training throughput, {threads} threads; peak {peak.flops_per_s / 1e9:.1f} GFLOP/s "
                f"(float32 {peak.size}x{peak.size} matmul, best of before/after: "
                f"{', '.join(f'{x.flops_per_s / 1e9:.1f}' for x in peaks)})")
    path = write_results("throughput", {"machine": info, "threads": threads,
                                        "peak": peak.to_dict(), "peaks": [x.to_dict() for x in peaks],
                                        "results": results})
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
