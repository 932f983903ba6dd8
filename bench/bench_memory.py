"""Memory against sequence length, with and without chunk checkpointing.

    python bench/bench_memory.py                         # T = 256, 1024, 4096; ~2-3 minutes
    python bench/bench_memory.py --seq-lens 256,1024 --chunk 64 --k 1

Each (T, checkpointing) point runs in a fresh process (so malloc has cached
nothing) with the tiny model's widths and one sample:

* ``rss``: the process's peak resident memory during its first training
  step above its resident memory just before (``/proc/self`` VmHWM, reset
  at the step start). What a machine must have free; includes one-time
  allocations and malloc slack.
* ``tensors``: a second step under the profiler's allocation tracker: peak
  bytes of live tensors, and what forward leaves alive for backward, split
  into the encoder side (embedding, encoder, memory: never checkpointed)
  and the decoder side (merge, decoder, readout, loss).

The analytic model of rlt_scale.profiling.memory is printed beside it.

K defaults to 16 (RLT-2): RLT-1 at T=4096 spends most of an hour per step on
this 2-core machine (per-position overhead and O(T) gradient slicing per
position; see bench_recurrence.py), and activation memory depends on K only
through small per-segment terms.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

from common import ROOT, machine, model_config, print_table, warn_if_busy, write_results

MB = 2**20
ENCODER_SIDE = ("embed", "encoder", "memory")


def child(seq_len: int, chunk: int, ckpt: bool, k: int) -> dict:
    """One measurement point (runs in its own process)."""
    from rlt_scale.profiling import rss
    from rlt_scale.profiling.measure import profile_layers
    from rlt_scale.profiling.memory import analytic_memory
    from rlt_scale.profiling.workload import Workload, forward_backward, make_model, make_tokens

    cfg, _ = model_config("tiny", (f"feedback_block={k}",))
    work = Workload(1, seq_len, chunk_size=chunk if chunk < seq_len else 0, checkpoint=ckpt)
    model = make_model(cfg)
    tokens = make_tokens(cfg, work)
    base = rss.reset_peak()
    forward_backward(model, tokens, work)
    rss_peak = rss.peak_rss() - base
    model.zero_grad(set_to_none=True)
    prof = profile_layers(model, tokens, work)
    held = {"encoder side": 0, "decoder side": 0}
    for row in prof.rows.values():
        side = "encoder side" if row.layer.split(".")[0] in ENCODER_SIDE else "decoder side"
        held[side] += row.held_bytes
    mem = analytic_memory(cfg, work)
    key = "activation_bytes_ckpt" if ckpt else "activation_bytes"
    an_dec = sum(getattr(m, key) for m in mem.layers if m.layer.split(".")[0] not in ENCODER_SIDE)
    an_enc = sum(getattr(m, key) for m in mem.layers if m.layer.split(".")[0] in ENCODER_SIDE)
    rebuilt = sum(m.recompute_bytes for m in mem.layers) if ckpt else 0
    return {"seq_len": seq_len, "checkpoint": ckpt, "chunk": work.chunk, "feedback_block": k,
            "rss_peak_bytes": rss_peak, "tensor_peak_bytes": prof.peak, "tensor_peak_at": prof.peak_phase,
            "held_after_forward_bytes": prof.held_total, "held_encoder_side": held["encoder side"],
            "held_decoder_side": held["decoder side"], "analytic_encoder_side": an_enc,
            "analytic_decoder_side": an_dec, "analytic_rebuilt_per_chunk": rebuilt}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq-lens", default="256,1024,4096")
    p.add_argument("--chunk", type=int, default=64)
    p.add_argument("--k", type=int, default=16, help="feedback block (1 = RLT-1, 0 = RLT-0)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        seq_len, chunk, ckpt, k = (int(x) for x in args.child.split(","))
        print(json.dumps(child(seq_len, chunk, bool(ckpt), k)))
        return 0
    info = machine()
    warn_if_busy(info)
    points = []
    for seq_len in (int(t) for t in args.seq_lens.split(",")):
        for ckpt in (False, True):
            print(f"# T={seq_len} checkpoint={ckpt} ...", flush=True)
            out = subprocess.run([sys.executable, __file__, "--child", f"{seq_len},{args.chunk},{int(ckpt)},{args.k}"],
                                 cwd=ROOT, capture_output=True, text=True, check=True)
            points.append(json.loads(out.stdout.strip().splitlines()[-1]))
    rows = []
    for pt in points:
        rows.append([pt["seq_len"], "chunk ckpt" if pt["checkpoint"] else "none",
                     f"{pt['rss_peak_bytes'] / MB:.1f}", f"{pt['tensor_peak_bytes'] / MB:.1f}",
                     f"{pt['held_encoder_side'] / MB:.2f}", f"{pt['analytic_encoder_side'] / MB:.2f}",
                     f"{pt['held_decoder_side'] / MB:.2f}", f"{pt['analytic_decoder_side'] / MB:.2f}",
                     f"{pt['analytic_rebuilt_per_chunk'] / MB:.2f}"])
    print_table(["T", "checkpointing", "RSS peak MB", "tensor peak MB", "enc-side kept", "(analytic)",
                 "dec-side kept", "(analytic)", "rebuilt/chunk"], rows,
                f"Memory of one training step vs T (tiny widths, K={args.k}, batch 1, C={args.chunk}); "
                f"'kept' = alive after forward, measured vs analytic")
    by = {(pt["seq_len"], pt["checkpoint"]): pt for pt in points}
    lens = sorted({pt["seq_len"] for pt in points})
    growth = []
    for a, b in zip(lens, lens[1:]):
        growth.append([f"{a} -> {b} ({b / a:.0f}x)",
                       f"{by[(b, False)]['held_decoder_side'] / by[(a, False)]['held_decoder_side']:.2f}x",
                       f"{by[(b, True)]['held_decoder_side'] / by[(a, True)]['held_decoder_side']:.2f}x",
                       f"{by[(b, False)]['held_encoder_side'] / by[(a, False)]['held_encoder_side']:.2f}x",
                       f"{by[(b, False)]['tensor_peak_bytes'] / by[(a, False)]['tensor_peak_bytes']:.2f}x",
                       f"{by[(b, True)]['tensor_peak_bytes'] / by[(a, True)]['tensor_peak_bytes']:.2f}x"])
    print_table(["T", "decoder kept, plain", "decoder kept, ckpt", "encoder kept", "peak, plain", "peak, ckpt"],
                growth, "Growth factors")
    path = write_results("memory", {"machine": info, "k": args.k, "chunk": args.chunk, "batch": 1, "points": points})
    print(f"# wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
