"""The cost of recurrence: RLT-1 against RLT-2 (K=4, 16) and RLT-0 of the same config, in one run.

    python bench/bench_recurrence.py                     # tiny, batch 32, T=128, ~2-3 minutes
    python bench/bench_recurrence.py --batch 32 --seq-len 256 --rounds 5

The models differ only in the feedback block K (same widths, seed and
tokens); the chunk size and checkpointing are the tiny config's. Steps
(forward + backward + AdamW) of all variants are interleaved round by round,
so a busy machine slows them alike; the ratios use per-round pairs. Then one
step of RLT-1 and of RLT-0 is profiled (aten op counts, torch.profiler self
CPU time by kind of op) to show what the gap is made of.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common import Clock, machine, model_config, print_table, set_threads, warn_if_busy, write_results

from rlt_scale.config import OptimizerConfig
from rlt_scale.profiling.flops import analytic_flops
from rlt_scale.profiling.workload import Workload, forward_backward, make_model, make_tokens, train_step
from rlt_scale.training.optim import build_optimizer

KINDS = {
    "matmul": ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear"),
    "attention kernels": ("aten::_scaled_dot_product",),
    "copies, cat, zero-fill": ("aten::cat", "aten::copy_", "aten::fill_", "aten::zero_", "aten::clone",
                               "aten::contiguous", "aten::empty", "aten::new_", "aten::zeros", "aten::slice_backward",
                               "aten::_to_copy", "aten::to", "aten::resize_", "aten::index"),
    "views, metadata": ("aten::view", "aten::slice", "aten::transpose", "aten::t", "aten::permute", "aten::expand",
                        "aten::as_strided", "aten::unbind", "aten::split", "aten::select", "aten::reshape",
                        "aten::detach", "aten::_unsafe_view", "aten::chunk", "aten::narrow", "aten::unsqueeze",
                        "aten::squeeze", "aten::alias", "aten::lift_fresh", "aten::flatten", "aten::unflatten"),
    "elementwise, reductions": ("aten::",),
    "autograd engine / Python nodes": ("autograd::", "Backward", "torch::autograd"),
}


class OpCounter(TorchDispatchMode):
    """Counts aten ops (deterministic, unlike time on a shared machine)."""

    def __init__(self):
        super().__init__()
        self.counts = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func._overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def kind_of(name: str) -> str:
    for kind, prefixes in KINDS.items():
        if any(name.startswith(p) or (p == "Backward" and p in name) for p in prefixes):
            return kind
    return "other"


def profile_step(model, tokens, work) -> dict:
    """Op count, wall, and torch.profiler self-CPU per kind of op for one forward+backward."""
    with OpCounter() as counter:
        forward_backward(model, tokens, work)
    model.zero_grad(set_to_none=True)
    with torch.profiler.profile() as prof:
        with Clock() as clock:
            forward_backward(model, tokens, work)
    model.zero_grad(set_to_none=True)
    by_kind = Counter()
    for event in prof.key_averages():
        by_kind[kind_of(event.key)] += event.self_cpu_time_total / 1e6
    return {"aten_ops": sum(counter.counts.values()), "top_ops": counter.counts.most_common(8),
            "profiled_wall_s": clock.wall, "self_cpu_by_kind_s": dict(by_kind),
            "untracked_s": max(clock.wall - sum(by_kind.values()), 0.0)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--ks", default="1,4,16,0", help="feedback blocks to compare (0 = RLT-0)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core box, 2 OpenMP threads stall on each other)")
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args(argv)
    threads = set_threads(args.threads)
    info = machine()
    warn_if_busy(info)
    ks = [int(k) for k in args.ks.split(",")]
    base, source = model_config(args.config)
    from bench_throughput import schedule_of

    chunk, ckpt = schedule_of(args.config, args.seq_len)
    work = Workload(args.batch, args.seq_len, chunk_size=chunk, checkpoint=ckpt)
    models, optims = {}, {}
    for k in ks:
        cfg, _ = model_config(args.config, (f"feedback_block={k}",))
        models[k] = make_model(cfg, seed=0)
        optims[k] = build_optimizer(models[k], OptimizerConfig())
    tokens = make_tokens(base, work)
    print(f"# {args.config} ({source}), {work.describe()}, {threads} threads; warm-up ...", flush=True)
    for k in ks:
        train_step(models[k], optims[k], tokens, work)
    wall = {k: [] for k in ks}
    cpu = {k: [] for k in ks}
    for r in range(args.rounds):
        for k in ks:
            with Clock() as c:
                train_step(models[k], optims[k], tokens, work)
            wall[k].append(c.wall)
            cpu[k].append(c.cpu)
        print(f"# round {r + 1}: " + "  ".join(f"K={k} {wall[k][-1]:.2f}s" for k in ks), flush=True)
    ref = 0 if 0 in ks else ks[-1]
    rows, results = [], {}
    for k in ks:
        cfg = models[k].cfg
        flops = analytic_flops(cfg, work)
        ratio_wall = statistics.median(a / b for a, b in zip(wall[k], wall[ref]))
        ratio_cpu = statistics.median(a / b for a, b in zip(cpu[k], cpu[ref]))
        name = {0: "RLT-0", 1: "RLT-1"}.get(k, f"RLT-2 K={k}")
        results[k] = {"name": name, "feedback_block": k, "step_wall_s": wall[k], "step_cpu_s": cpu[k],
                      "ratio_wall_vs_rlt0": ratio_wall, "ratio_cpu_vs_rlt0": ratio_cpu,
                      "segments": len(work.plan(cfg.feedback_block).segments),
                      "sequential_decoder_depth": len(work.plan(cfg.feedback_block).segments) * cfg.n_dec_layers,
                      "hardware_flops": flops.hardware_flops, "model_flops": flops.model_flops}
        rows.append([name, results[k]["segments"], f"{statistics.median(wall[k]):.2f}s",
                     f"{statistics.median(cpu[k]):.2f}s", f"{ratio_wall:.2f}x", f"{ratio_cpu:.2f}x",
                     f"{flops.hardware_flops / 1e9:.2f}G"])
    print_table(["variant", "segments", "step (wall)", "step (cpu)", "vs RLT-0 wall", "vs RLT-0 cpu", "executed FLOPs"],
                rows, f"Recurrence cost: {args.config}, {work.describe()}, median of {args.rounds} interleaved rounds")

    profiles = {}
    if not args.no_profile and 1 in ks and 0 in ks:
        for k in (1, 0):
            profiles[k] = profile_step(models[k], tokens, work)
        a, b = profiles[1], profiles[0]
        kinds = sorted(set(a["self_cpu_by_kind_s"]) | set(b["self_cpu_by_kind_s"]),
                       key=lambda x: -(a["self_cpu_by_kind_s"].get(x, 0) - b["self_cpu_by_kind_s"].get(x, 0)))
        gap = a["profiled_wall_s"] - b["profiled_wall_s"]
        rows = []
        for kind in kinds + ["(not in any op: Python)"]:
            if kind.startswith("(not"):
                x, y = a["untracked_s"], b["untracked_s"]
            else:
                x, y = a["self_cpu_by_kind_s"].get(kind, 0), b["self_cpu_by_kind_s"].get(kind, 0)
            rows.append([kind, f"{x:.2f}s", f"{y:.2f}s", f"{x - y:+.2f}s", f"{100 * (x - y) / gap:.0f}%"])
        rows.append(["aten ops per step", f"{a['aten_ops']:,}", f"{b['aten_ops']:,}",
                     f"{a['aten_ops'] - b['aten_ops']:+,}", ""])
        print_table(["where the time goes (one profiled step)", "RLT-1", "RLT-0", "gap", "share of gap"], rows,
                    f"RLT-1 vs RLT-0 under torch.profiler (wall {a['profiled_wall_s']:.2f}s vs {b['profiled_wall_s']:.2f}s); "
                    f"RLT-1 runs {a['aten_ops'] / max(results[1]['segments'], 1):,.0f} aten ops per position")
    path = write_results("recurrence", {"machine": info, "threads": threads, "config": args.config,
                                        "workload": work.describe(), "batch": args.batch, "seq_len": args.seq_len,
                                        "chunk_size": chunk, "checkpoint": ckpt, "rounds": args.rounds,
                                        "results": results, "profiles": profiles})
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
