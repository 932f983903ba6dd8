"""How much of the compiled fused decoder step is host overhead: dynamo's guard checks, per call.

    python bench/bench_host_overhead.py                                  # tiny, B=4, T=1024, 2 and 8 layers
    python bench/bench_host_overhead.py --batch 32 --seq-len 128 --layers 2

The fused walk (``model.decoder_step: fused``, ``decoder_compile: default``)
calls its compiled step function once per position forward and once
backward. Before each call dynamo checks the guards of every tensor it was
handed: each decoder weight, the stores and the rows. Two measurements per
depth (``n_enc_layers = n_dec_layers``):

* **Guard time per call**, from one profiled training step: the total and
  the count of dynamo's cache-lookup events (``torch.profiler``).
* **Step time with the guards skipped**: training steps interleaved round by
  round, as built and under ``torch.compiler.set_stance(...,
  skip_guard_eval_unsafe=True)``, which reuses the cached code without
  checking its guards. That is safe here only because the warm-up steps
  compiled every shape the step meets (this is a measurement, not a mode to
  train in); the ratio says what removing the checks would win.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch
from common import Clock, machine, model_config, print_table, set_threads, warn_if_busy, write_results

from rlt_scale.config import OptimizerConfig
from rlt_scale.profiling.workload import Workload, make_model, make_tokens, train_step
from rlt_scale.training.optim import build_optimizer

CACHE_LOOKUP = "Cache Lookup"  # dynamo's profiler event: "TorchDynamo Cache Lookup"


def guard_time(model, optim, tokens, work) -> tuple[float, int, float]:
    """(seconds of dynamo cache lookups, their count, the profiled step's wall) over one training step."""
    with Clock() as c, torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train_step(model, optim, tokens, work)
    events = [e for e in prof.events() if CACHE_LOOKUP in e.name]
    return sum(e.cpu_time_total for e in events) / 1e6, len(events), c.wall


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="tiny")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--layers", default="2,8", help="encoder and decoder depths to compare")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="model override, repeatable")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="host_overhead")
    args = p.parse_args(argv)
    threads = set_threads(args.threads)
    info = machine()
    warn_if_busy(info)
    from bench_throughput import schedule_of

    chunk, ckpt = schedule_of(args.config, args.seq_len)
    work = Workload(args.batch, args.seq_len, chunk_size=chunk, checkpoint=ckpt)
    print(f"# {args.config} {' '.join(args.set)}, {work.describe()}, {threads} thread(s); "
          f"load {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    rows, results = [], {}
    for depth in (int(x) for x in args.layers.split(",")):
        cfg, _ = model_config(args.config, tuple(args.set) + (
            "decoder_step=fused", "decoder_compile=default", f"n_enc_layers={depth}", f"n_dec_layers={depth}"))
        model = make_model(cfg, seed=0)
        optim = build_optimizer(model, OptimizerConfig())
        tokens = make_tokens(cfg, work)
        for _ in range(2):  # compiles, then meets every shape once more with a warm cache
            train_step(model, optim, tokens, work)
        lookup_s, calls, profiled_wall = guard_time(model, optim, tokens, work)
        checked, skipped, loads = [], [], []
        for r in range(args.rounds):
            with Clock() as c:
                train_step(model, optim, tokens, work)
            checked.append(c.wall)
            with Clock() as c, torch.compiler.set_stance("default", skip_guard_eval_unsafe=True):
                train_step(model, optim, tokens, work)
            skipped.append(c.wall)
            loads.append(os.getloadavg())
            print(f"# {depth} layers, round {r + 1}: guards checked {checked[-1]:.2f}s, skipped {skipped[-1]:.2f}s"
                  f"  (load {' '.join(f'{x:.2f}' for x in loads[-1])})", flush=True)
        ratio = statistics.median(b / a for a, b in zip(checked, skipped))
        per_call = lookup_s / max(calls, 1)
        results[f"{depth} layers"] = dict(layers=depth, lookup_s=lookup_s, lookup_calls=calls,
                                          lookup_us_per_call=1e6 * per_call, profiled_step_wall_s=profiled_wall,
                                          step_wall_s=checked, step_wall_guards_skipped_s=skipped,
                                          ratio_skipped_vs_checked=ratio, loads=loads)
        rows.append([f"{depth}+{depth}", f"{calls:,}", f"{1e6 * per_call:.0f} us", f"{lookup_s:.2f}s",
                     f"{statistics.median(checked):.2f}s", f"{statistics.median(skipped):.2f}s", f"{ratio:.3f}x"])
    print_table(["layers", "lookups/step", "per lookup", "lookups (profiled)", "step", "step, guards skipped",
                 "skipped / checked"], rows,
                f"{args.config} {work.describe()}: median of {args.rounds} interleaved rounds")
    write_results(args.out, {"machine": info, "threads": threads, "workload": work.describe(), "set": args.set,
                             "variants": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
