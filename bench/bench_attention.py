"""The encoder's attention: a T×T mask against mask-free attention (rlt_scale.model.attention).

    python bench/bench_attention.py                          # T = 1024, 4096, 16384; a few minutes
    python bench/bench_attention.py --seq-lens 32768 --paths single,packed

One forward + backward of the tiny model's encoder (d=64, 4 heads, 2
layers, float32, B=1, one thread) per point, each point in a fresh process:

* ``masked``: today's rule as a dense mask, ``attend(q, k, v, visibility(...))``
  (SDPA keeps a float copy of the ``[B, 1, T, T]`` mask for backward);
* ``single``: :func:`document_attention`, one document per row (SDPA ``is_causal``);
* ``packed``: :func:`document_attention`, documents of ``--doc-len`` tokens
  packed in the row (the tiled path).

``rss``: peak resident memory during the step above the resident memory just
before it (``VmHWM`` reset at the step start, rlt_scale.profiling.rss); what
a machine must have free. Wall and process-CPU seconds beside it: on a busy
machine trust the CPU seconds more.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from common import ROOT, Clock, machine, model_config, print_table, warn_if_busy, write_results

MB = 2**20


def child(seq_len: int, path: str, doc_len: int) -> dict:
    """One measurement point (runs in its own process)."""
    import torch

    import rlt_scale.model.blocks as blocks
    from rlt_scale.model.layers import attend, document_positions, visibility
    from rlt_scale.profiling import rss
    from rlt_scale.profiling.workload import make_model

    torch.set_num_threads(1)
    if path == "masked":  # the encoder as it was: the whole rule as one mask
        blocks.document_attention = lambda q, k, v, qp, qd, kp, kd, window, **_: attend(
            q, k, v, visibility(qp, qd, kp, kd, window))
    cfg, _ = model_config("tiny")
    model = make_model(cfg)
    tokens = torch.randint(0, cfg.vocab_size, (1, seq_len), generator=torch.Generator().manual_seed(0))
    doc = (torch.arange(seq_len) // doc_len)[None] if path == "packed" else torch.zeros_like(tokens)
    pos = document_positions(doc)
    base = rss.reset_peak()
    with Clock() as clock:
        e, _ = model.encode(tokens, pos, doc)
        e.square().mean().backward()
    return {"seq_len": seq_len, "path": path, "rss_mb": (rss.peak_rss() - base) / MB,
            "wall_s": clock.wall, "cpu_s": clock.cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-lens", default="1024,4096,16384")
    p.add_argument("--paths", default="masked,single,packed")
    p.add_argument("--doc-len", type=int, default=1000, help="document length of the packed rows")
    p.add_argument("--child", nargs=3, metavar=("T", "PATH", "DOC_LEN"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(int(args.child[0]), args.child[1], int(args.child[2]))))
        return

    info = machine()
    warn_if_busy(info)
    rows = []
    for seq_len in map(int, args.seq_lens.split(",")):
        for path in args.paths.split(","):
            cmd = [sys.executable, __file__, "--child", str(seq_len), path, str(args.doc_len)]
            done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True,
                                  env={**os.environ, "OMP_NUM_THREADS": "1"})
            if done.returncode != 0:
                print(done.stderr[-2000:], file=sys.stderr)
                continue
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            r = rows[-1]
            print(f"T={seq_len:6d} {path:7s} rss {r['rss_mb']:9.1f} MB  wall {r['wall_s']:7.2f} s  "
                  f"cpu {r['cpu_s']:7.2f} s", flush=True)
    print_table(["T", "path", "peak RSS (MB)", "wall (s)", "CPU (s)"],
                [[r["seq_len"], r["path"], f"{r['rss_mb']:.1f}", f"{r['wall_s']:.2f}", f"{r['cpu_s']:.2f}"]
                 for r in rows], "encoder forward + backward, tiny model, B=1, 1 thread")
    info["load_average_1m_after"] = os.getloadavg()[0]
    print("written", write_results("attention", {"machine": info, "doc_len": args.doc_len, "rows": rows}))


if __name__ == "__main__":
    main()
