"""Ways to run the sequential decoder against each other, and RLT-0 for scale, in one run.

    python bench/bench_deferred.py                                   # tiny, B=32, T=128
    python bench/bench_deferred.py --set d_model=512 --set n_heads=8 --rounds 5
    python bench/bench_deferred.py --blocks 0,16,64,128 --ks 1
    python bench/bench_deferred.py --blocks 0,64 --steps layers,fused --compile off,default

Variants differ only in ``model.decoder_wgrad_block`` (0: autograd's
per-position weight gradients; N: one GEMM per weight per N positions,
``rlt_scale/model/deferred.py``), ``model.decoder_step`` (``fused``: one
node per layer and position, ``rlt_scale/model/fused.py``; with a tape only),
``model.decoder_compile`` (fused only; the first step, which compiles, is
timed and reported apart) and the feedback block K (RLT-0 runs no tape: one
segment per chunk). Same seed, tokens and schedule (the config's
chunking). Training steps (forward + backward + AdamW) are interleaved round
by round; ratios are medians of per-round pairs against the first variant;
MFU is analytic model FLOPs / median step / the best same-process fp32
matmul peak (before and after the rounds).
"""

from __future__ import annotations

import argparse
import os
import statistics

from common import Clock, machine, model_config, print_table, set_threads, warn_if_busy, write_results

from rlt_scale.config import OptimizerConfig
from rlt_scale.profiling.flops import analytic_flops
from rlt_scale.profiling.memory import analytic_memory
from rlt_scale.profiling.peak import measure_peak
from rlt_scale.profiling.workload import Workload, make_model, make_tokens, train_step
from rlt_scale.training.optim import build_optimizer


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--blocks", default="0,64", help="decoder_wgrad_block values (RLT-1 and RLT-2)")
    p.add_argument("--steps", default="layers", help="decoder_step values, for blocks > 0")
    p.add_argument("--compile", default="none", help="decoder_compile values, for the fused step")
    p.add_argument("--ks", default="1,0", help="feedback blocks; K=0 (RLT-0) runs once, without a tape")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="model override, repeatable")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="deferred")
    args = p.parse_args(argv)
    threads = set_threads(args.threads)
    info = machine()
    warn_if_busy(info)
    from bench_throughput import schedule_of

    chunk, ckpt = schedule_of(args.config, args.seq_len)
    work = Workload(args.batch, args.seq_len, chunk_size=chunk, checkpoint=ckpt)
    variants = []  # (K, wgrad block, decoder step, compile)
    for k in (int(x) for x in args.ks.split(",")):
        for block in ([0] if k == 0 else [int(x) for x in args.blocks.split(",")]):
            for step in (args.steps.split(",") if block else ["layers"]):
                for compiled in (args.compile.split(",") if step == "fused" else ["none"]):
                    variants.append((k, block, step, compiled))
    models, optims = {}, {}
    for v in variants:
        k, block, step, compiled = v
        cfg, source = model_config(args.config, tuple(args.set) + (
            f"feedback_block={k}", f"decoder_wgrad_block={block}", f"decoder_step={step}",
            f"decoder_compile={compiled}"))
        models[v] = make_model(cfg, seed=0)
        optims[v] = build_optimizer(models[v], OptimizerConfig())
    tokens = make_tokens(cfg, work)
    name = {v: f"{'RLT-0' if v[0] == 0 else ('RLT-1' if v[0] == 1 else f'RLT-2 K={v[0]}')}"
               + (f" wgrad/{v[1]}" if v[0] else "") + (" fused" if v[2] == "fused" else "")
               + (f" compiled:{v[3]}" if v[3] != "none" else "") for v in variants}
    print(f"# {args.config} ({source}) {' '.join(args.set)}, {work.describe()}, {threads} thread(s); "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    peaks = [measure_peak()]
    first_step = {}
    for v in variants:  # warm-up; a compiled variant compiles here (twice: the cache is then warm)
        with Clock() as c:
            train_step(models[v], optims[v], tokens, work)
        first_step[v] = c.wall
        if v[3] != "none":
            print(f"# {name[v]}: first step {c.wall:.1f}s (compiles)", flush=True)
    wall = {v: [] for v in variants}
    loads = [os.getloadavg()]
    for r in range(args.rounds):
        for v in variants:
            with Clock() as c:
                train_step(models[v], optims[v], tokens, work)
            wall[v].append(c.wall)
        loads.append(os.getloadavg())
        print(f"# round {r + 1}: " + "  ".join(f"{name[v]} {wall[v][-1]:.2f}s" for v in variants)
              + f"  (load {' '.join(f'{x:.2f}' for x in loads[-1])})", flush=True)
    peaks.append(measure_peak())
    peak = max(x.flops_per_s for x in peaks)
    first, rlt0 = variants[0], next((v for v in variants if v[0] == 0), None)
    rows, results = [], {}
    for v in variants:
        cfg = models[v].cfg
        step = statistics.median(wall[v])
        mfu = analytic_flops(cfg, work).model_flops / step / peak
        vs_first = statistics.median(a / b for a, b in zip(wall[v], wall[first]))
        vs_rlt0 = statistics.median(a / b for a, b in zip(wall[v], wall[rlt0])) if rlt0 else None
        dec = next(m for m in analytic_memory(cfg, work).layers if m.layer == "decoder.0")
        per_token = dec.activation_bytes / (work.batch * work.seq_len)
        results[name[v]] = dict(feedback_block=v[0], decoder_wgrad_block=v[1], decoder_step=v[2],
                                decoder_compile=v[3], first_step_wall_s=first_step[v], step_wall_s=wall[v], mfu=mfu,
                                ratio_vs_first=vs_first, ratio_vs_rlt0=vs_rlt0,
                                decoder_activation_bytes_per_token_layer=per_token)
        rows.append([name[v], f"{step:.3f}s", f"{vs_first:.3f}x", f"{vs_rlt0:.2f}x" if vs_rlt0 else "-",
                     f"{100 * mfu:.1f}%", f"{per_token:,.0f} B"])
    print_table(["variant", "step (wall)", f"vs {name[first]}", "vs RLT-0", "MFU", "decoder acts/token/layer"], rows,
                f"{args.config} {' '.join(args.set)}: median of {args.rounds} interleaved rounds, peak "
                f"{peak / 1e9:.1f} GFLOP/s, load {' '.join(f'{x[0]:.2f}' for x in loads)}")
    write_results(args.out, {"machine": info, "threads": threads, "workload": work.describe(), "set": args.set,
                             "peak_flops_per_s": peak, "loads": loads, "variants": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
