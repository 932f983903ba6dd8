"""``rlt-profile``: per-layer FLOPs and memory of a config, analytic and (optionally) measured.

Examples::

    rlt-profile configs/tiny.yaml --seq-len 256
    rlt-profile configs/rlt-100m.yaml --seq-len 1024 --tp 2 --pp 2 --dp 8 --zero 1
    rlt-profile configs/tiny.yaml --seq-len 128 --batch 4 --measure --steps 3
    rlt-profile model.feedback_block=0 model.window=32 --seq-len 512 --json out.json --png out.png
    rlt-profile configs/rlt-48x48.yaml --seq-len 4096 --hbm h100 --sequences 1 8 64

Without ``--measure`` nothing runs: the numbers come from the cost model
(:mod:`.flops`, :mod:`.memory`). ``--measure`` runs the model on this machine
(CPU or ``--device cuda``) for a few steps, counts FLOPs with
``FlopCounterMode``, attributes FLOPs, op time and memory per layer, measures
the matmul peak in the same process (or takes ``--peak-tflops``), and prints
analytic and measured side by side. Last comes the decoder step's
bandwidth bound against the FLOP bound for several sequences per step
(:mod:`.bandwidth`): which one binds, and what more sequences buy.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Optional

from rlt_scale.config import load_config
from rlt_scale.profiling.bandwidth import HBM_BYTES_PER_S, bound_table, decoder_step_bound
from rlt_scale.profiling.flops import analytic_flops
from rlt_scale.profiling.memory import Layout, analytic_memory
from rlt_scale.profiling.peak import PeakFlops, measure_peak, named_peak
from rlt_scale.profiling.report import (
    Utilisation, flops_table, memory_table, plot, rank_table, summary_lines, write_json,
)
from rlt_scale.profiling.workload import Workload


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="rlt-profile", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("config", nargs="?", help="YAML config (optional); further positional key=value are overrides")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. model.window=32")
    p.add_argument("--seq-len", type=int, default=256, help="tokens per sample T (default 256)")
    p.add_argument("--batch", type=int, help="samples per micro-batch (default trainer.micro_batch_size)")
    p.add_argument("--chunk", type=int, help="decoder chunk length C (default trainer.chunk_size; 0 = whole sample)")
    ckpt = p.add_mutually_exclusive_group()
    ckpt.add_argument("--checkpoint", dest="checkpoint", action="store_true", default=None,
                      help="chunk activation checkpointing (default: trainer.activation_checkpointing)")
    ckpt.add_argument("--no-checkpoint", dest="checkpoint", action="store_false")
    ckpt.add_argument("--full-checkpoint", dest="checkpoint", action="store_const", const="full",
                      help="chunk checkpointing plus every encoder layer recomputed (activation_checkpointing: full)")
    p.set_defaults(checkpoint=None)
    p.add_argument("--tp", type=int, help="tensor-parallel size (default parallel.tp)")
    p.add_argument("--pp", type=int, help="pipeline-parallel size (default parallel.pp)")
    p.add_argument("--dp", type=int, help="data-parallel size (default parallel.dp or 1)")
    p.add_argument("--zero", type=int, choices=(0, 1, 2, 3), help="ZeRO stage (default parallel.zero_stage)")
    p.add_argument("--in-flight", type=int, default=0, help="micro-batches in flight per stage (default PP)")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DP gradient bucket size in MB")
    p.add_argument("--measure", action="store_true", help="also run the model here and measure")
    p.add_argument("--steps", type=int, default=3, help="timed steps in measured mode")
    p.add_argument("--device", default="cpu", help="cpu or cuda (measured mode)")
    p.add_argument("--threads", type=int, help="torch CPU threads (default: trainer.threads, else torch's choice)")
    p.add_argument("--peak-tflops", type=float, help="use this peak instead of measuring one")
    p.add_argument("--hbm", default="h100",
                   help="memory bandwidth of the decoder-step bound: h100, h200, a100 or TB/s (default h100)")
    p.add_argument("--sequences", type=int, nargs="+",
                   help="sequences per decoder step to tabulate (default: 1, the micro-batch, 8, 64, 512)")
    p.add_argument("--json", help="write everything here (default profiles/<name>.json)")
    p.add_argument("--png", help="write the chart here (default profiles/<name>.png)")
    p.add_argument("--no-png", action="store_true", help="skip the chart")
    args = p.parse_args(argv)
    if args.config and "=" in args.config:  # only overrides were given
        args.overrides.insert(0, args.config)
        args.config = None
    return args


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    cfg = load_config(args.config, args.overrides)
    t, par = cfg.trainer, cfg.parallel
    chunk = t.chunk_size if args.chunk is None else args.chunk
    mode = t.activation_checkpointing if args.checkpoint is None else (
        args.checkpoint if isinstance(args.checkpoint, str) else ("chunk" if args.checkpoint else "none"))
    work = Workload(batch=args.batch or t.micro_batch_size, seq_len=args.seq_len,
                    chunk_size=chunk if chunk < args.seq_len else 0, checkpoint=mode != "none",
                    recompute_encoder=mode == "full")
    layout = Layout(tp=args.tp or par.tp, pp=args.pp or par.pp, dp=args.dp or par.dp or 1,
                    zero_stage=par.zero_stage if args.zero is None else args.zero,
                    microbatches_in_flight=args.in_flight, dp_bucket_mb=args.bucket_mb)
    name = Path(args.config).stem if args.config else "profile"

    flops = analytic_flops(cfg.model, work, tp=1)
    mem = analytic_memory(cfg.model, work, layout)
    measured = peak = None
    if args.measure:
        import torch

        from rlt_scale.profiling.measure import measure
        from rlt_scale.profiling.workload import make_model

        threads = args.threads or getattr(t, "threads", 0)  # the trainer's setting, when the config has one
        if threads:
            torch.set_num_threads(threads)
        model = make_model(cfg.model, seed=t.seed, device=args.device)
        print(f"measuring {work.describe()} on {args.device} ({torch.get_num_threads()} threads) ...",
              file=sys.stderr, flush=True)
        measured = measure(model, cfg.model, work, steps=args.steps)
        dtype = next(model.parameters()).dtype
        peak = named_peak(args.peak_tflops) if args.peak_tflops else measure_peak(args.device, dtype)
    elif args.peak_tflops:
        peak = named_peak(args.peak_tflops)

    mem_tp1 = analytic_memory(cfg.model, work, Layout()) if layout.tp > 1 and measured else mem
    print(flops_table(flops, measured))
    print()
    print(memory_table(mem_tp1, measured))
    print()
    print(rank_table(mem))
    print()
    print(summary_lines(flops, peak, measured))
    print()
    bandwidth = HBM_BYTES_PER_S.get(args.hbm.lower()) or float(args.hbm) * 1e12
    sequences = args.sequences or sorted({1, work.batch, 8, 64, 512})
    bound_kw = dict(bandwidth=bandwidth, **({"peak_flops": args.peak_tflops * 1e12} if args.peak_tflops else {}))
    decoder_side = ("merge", "decoder.", "readout", "other")
    key = "activation_bytes_ckpt" if work.checkpoint else "activation_bytes"
    per_sequence = sum(getattr(m, key) for m in mem.layers if m.layer.startswith(decoder_side)) / work.batch
    print(bound_table(cfg.model, work.seq_len, layout.tp, layout.pp, sequences,
                      decoder_bytes_per_sequence=per_sequence, **bound_kw))

    payload = {
        "config": args.config, "overrides": args.overrides, "model": asdict(cfg.model),
        "workload": asdict(work), "layout": asdict(layout),
        "flops": flops.to_dict(), "memory": mem.to_dict(),
        "flops_per_tp_rank": analytic_flops(cfg.model, work, tp=layout.tp).to_dict() if layout.tp > 1 else None,
        "peak": peak.to_dict() if peak else None,
        "measured": measured.to_dict() if measured else None,
        "utilisation": asdict(Utilisation.of(flops, measured.step_s, peak)) if measured and peak else None,
        "decoder_step_bound": [decoder_step_bound(cfg.model, work.seq_len, n, layout.tp, layout.pp, **bound_kw).to_dict()
                               for n in sequences],
    }
    json_path = write_json(args.json or f"profiles/{name}.json", payload)
    print(f"\nwrote {json_path}")
    if not args.no_png:
        try:
            png = plot(args.png or f"profiles/{name}.png", flops, mem_tp1, measured)
            print(f"wrote {png}")
        except ImportError:
            print("matplotlib missing: pip install 'rlt-scale[plots]' for the chart", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
