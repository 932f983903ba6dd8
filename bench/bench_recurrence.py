"""The cost of recurrence: RLT-1 against RLT-2 (K=4, 16) and RLT-0 of the same config, in one run.

    python bench/bench_recurrence.py                     # tiny, batch 32, T=128, ~2-3 minutes
    python bench/bench_recurrence.py --batch 32 --seq-len 256 --rounds 5
    python bench/bench_recurrence.py --ks 1,0 --set d_model=512 --set n_heads=8 --no-profile
    python bench/bench_recurrence.py --ks 1 --batch 32,4 --seq-len 128,1024   # same tokens, two lengths

The models differ only in the feedback block K (same widths, seed and
tokens); the chunk size and checkpointing are the tiny config's. Steps
(forward + backward + AdamW) of all variants are interleaved round by round,
so a busy machine slows them alike; the ratios use per-round pairs. Comma
lists in --batch/--seq-len add workloads (paired in order), interleaved the
same way. MFU is model FLOPs / median step wall / the best fp32 matmul peak of
this process (measured before and after the rounds, same threads). Then one
step of RLT-1 and of RLT-0 is profiled (aten op counts, torch.profiler self
CPU time by kind of op) to show what the gap is made of.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common import Clock, machine, model_config, print_table, set_threads, warn_if_busy, write_results

from rlt_scale.config import OptimizerConfig
from rlt_scale.profiling.flops import analytic_flops
from rlt_scale.profiling.peak import measure_peak
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
    p.add_argument("--batch", default="32", help="batch size; a comma list adds workloads, paired with --seq-len")
    p.add_argument("--seq-len", default="128", help="sequence length; a comma list adds workloads")
    p.add_argument("--ks", default="1,4,16,0", help="feedback blocks to compare (0 = RLT-0)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="model override, repeatable (e.g. --set d_model=512 --set n_heads=8)")
    p.add_argument("--out", default="recurrence", help="results name: bench/results/<out>.json")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads (default 1: on a shared 2-core box, 2 OpenMP threads stall on each other)")
    p.add_argument("--no-profile", action="store_true")
    args = p.parse_args(argv)
    threads = set_threads(args.threads)
    info = machine()
    warn_if_busy(info)
    ks = [int(k) for k in args.ks.split(",")]
    overrides = tuple(args.set)
    base, source = model_config(args.config, overrides)
    from bench_throughput import schedule_of

    batches, lens = [int(x) for x in args.batch.split(",")], [int(x) for x in args.seq_len.split(",")]
    n = max(len(batches), len(lens))
    batches, lens = batches * (n // len(batches)), lens * (n // len(lens))
    works, schedules = [], []
    for b, t in zip(batches, lens):
        chunk, ckpt = schedule_of(args.config, t)
        works.append(Workload(b, t, chunk_size=chunk, checkpoint=ckpt))
        schedules.append((chunk, ckpt))
    # variant id: the K alone for one workload (the JSON's old keys), else "K@BxT"
    variants = [(k, w) for w in range(n) for k in ks]
    vid = {(k, w): (k if n == 1 else f"{k}@{works[w].batch}x{works[w].seq_len}") for k, w in variants}
    models, optims, tokens = {}, {}, []
    for k in ks:
        cfg, _ = model_config(args.config, overrides + (f"feedback_block={k}",))
        models[k] = make_model(cfg, seed=0)
        optims[k] = build_optimizer(models[k], OptimizerConfig())
    for work in works:
        tokens.append(make_tokens(base, work))
    dims = f"d_model={base.d_model}, n_heads={base.n_heads}" + (f" ({', '.join(overrides)})" if overrides else "")
    print(f"# {args.config} ({source}), {dims}, {'; '.join(w.describe() for w in works)}, {threads} threads; "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}; peak + warm-up ...", flush=True)
    peaks = [measure_peak()]
    for k, w in variants:
        train_step(models[k], optims[k], tokens[w], works[w])
    wall = {v: [] for v in variants}
    cpu = {v: [] for v in variants}
    loads = [os.getloadavg()]
    for r in range(args.rounds):
        for k, w in variants:
            with Clock() as c:
                train_step(models[k], optims[k], tokens[w], works[w])
            wall[(k, w)].append(c.wall)
            cpu[(k, w)].append(c.cpu)
        loads.append(os.getloadavg())
        print(f"# round {r + 1}: " + "  ".join(f"{vid[v]} {wall[v][-1]:.2f}s" for v in variants)
              + f"  (load {' '.join(f'{x:.2f}' for x in loads[-1])})", flush=True)
    peaks.append(measure_peak())
    peak = max(peaks, key=lambda x: x.flops_per_s)
    ref = 0 if 0 in ks else ks[-1]
    rows, results = [], {}
    for k, w in variants:
        cfg, work = models[k].cfg, works[w]
        flops = analytic_flops(cfg, work)
        ratio_wall = statistics.median(a / b for a, b in zip(wall[(k, w)], wall[(ref, w)]))
        ratio_cpu = statistics.median(a / b for a, b in zip(cpu[(k, w)], cpu[(ref, w)]))
        step = statistics.median(wall[(k, w)])
        name = {0: "RLT-0", 1: "RLT-1"}.get(k, f"RLT-2 K={k}")
        results[vid[(k, w)]] = {
            "name": name, "feedback_block": k, "batch": work.batch, "seq_len": work.seq_len,
            "chunk_size": schedules[w][0], "checkpoint": schedules[w][1],
            "step_wall_s": wall[(k, w)], "step_cpu_s": cpu[(k, w)],
            "ratio_wall_vs_rlt0": ratio_wall, "ratio_cpu_vs_rlt0": ratio_cpu,
            "segments": len(work.plan(cfg.feedback_block).segments),
            "sequential_decoder_depth": len(work.plan(cfg.feedback_block).segments) * cfg.n_dec_layers,
            "hardware_flops": flops.hardware_flops, "model_flops": flops.model_flops,
            "mfu": flops.model_flops / step / peak.flops_per_s,
            "hfu": flops.hardware_flops / step / peak.flops_per_s,
            "mfu_cpu_time": flops.model_flops / statistics.median(cpu[(k, w)]) / (peak.flops_per_s / threads)}
        r = results[vid[(k, w)]]
        rows.append([name, work.describe(), r["segments"], f"{step:.2f}s", f"{statistics.median(cpu[(k, w)]):.2f}s",
                     f"{ratio_wall:.2f}x", f"{ratio_cpu:.2f}x", f"{flops.hardware_flops / 1e9:.2f}G",
                     f"{100 * r['mfu']:.1f}%", f"{100 * r['hfu']:.1f}%"])
    vs = results[vid[(ref, 0)]]["name"]
    print_table(["variant", "workload", "segments", "step (wall)", "step (cpu)", f"vs {vs} wall", f"vs {vs} cpu",
                 "executed FLOPs", "MFU", "HFU"], rows,
                f"Recurrence cost: {args.config}, {dims}, median of {args.rounds} interleaved rounds; "
                f"peak {peak.flops_per_s / 1e9:.1f} GFLOP/s ({peak.source}; before/after "
                f"{', '.join(f'{x.flops_per_s / 1e9:.1f}' for x in peaks)})")
    if n > 1:  # MFU of each workload against the first one's, per-round pairs (same K)
        rows = []
        for k, w in variants:
            if w:
                f0, f1 = results[vid[(k, 0)]]["model_flops"], results[vid[(k, w)]]["model_flops"]
                ratio = statistics.median((f1 / a) / (f0 / b) for a, b in zip(wall[(k, w)], wall[(k, 0)]))
                results[vid[(k, w)]]["mfu_vs_first_workload"] = ratio
                rows.append([results[vid[(k, w)]]["name"], works[w].describe(), works[0].describe(),
                             f"{100 * results[vid[(k, w)]]['mfu']:.1f}% vs {100 * results[vid[(k, 0)]]['mfu']:.1f}%",
                             f"{ratio:.2f}x"])
        print_table(["variant", "workload", "against", "MFU (medians)", "MFU ratio (per-round median)"], rows,
                    "MFU across workloads")
    work, chunk, ckpt, tokens = works[0], schedules[0][0], schedules[0][1], tokens[0]

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
                    f"RLT-1 runs {a['aten_ops'] / max(results[vid[(1, 0)]]['segments'], 1):,.0f} aten ops per position")
    path = write_results(args.out, {"machine": info, "threads": threads, "config": args.config,
                                    "overrides": list(overrides), "d_model": base.d_model, "n_heads": base.n_heads,
                                    "workload": "; ".join(w.describe() for w in works), "batch": batches,
                                    "seq_len": lens, "chunk_size": chunk, "checkpoint": ckpt, "rounds": args.rounds,
                                    "load_averages": loads, "peak": peak.to_dict(),
                                    "peaks": [x.to_dict() for x in peaks], "results": results,
                                    "profiles": profiles})
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
