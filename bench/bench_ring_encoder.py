"""The ring's encoder pipeline: M + PP - 1 stage-times each way, not M x PP (issue #17, item 4).

    .venv/bin/python bench/bench_ring_encoder.py                       # this tree
    .venv/bin/python bench/bench_ring_encoder.py --code /path/to/old   # another checkout, for comparison

Every encoder layer sleeps ``--tau`` seconds in forward and in backward
(bench/ring_encoder_worker.py), standing in for a stage's compute, so the
timeline is the schedule's and not this 2-core machine's. One encoder layer
per stage; the decoder (K=0, 4 tokens) costs little. Expected: a pipelined
encoder takes about ``2 (M + PP - 1) tau`` per step; one that waits for each
micro-batch's broadcast and all-reduce, ``2 M PP tau``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))
from helpers import torchrun  # noqa: E402

from common import machine, print_table, write_results  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tau", type=float, default=0.05)
    p.add_argument("--micro", default="1,4,8")
    p.add_argument("--pps", default="2,4")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--code", help="measure the rlt_scale package of this checkout (PYTHONPATH)")
    p.add_argument("--tree", default="new", help="a label for the code measured")
    args = p.parse_args(argv)
    env = {"PYTHONPATH": args.code} if args.code else None
    spec = {"tau": args.tau, "micro": [int(m) for m in args.micro.split(",")], "tokens": 4, "rounds": args.rounds}
    rows, points = [], []
    for pp in (int(x) for x in args.pps.split(",")):
        proc = torchrun("bench/ring_encoder_worker.py", pp, [json.dumps(spec)], timeout=600, env=env)
        for line in proc.stdout.splitlines():
            if line.startswith("{"):
                pt = json.loads(line)
                m = pt["m"]
                pt.update(pipelined_s=2 * (m + pp - 1) * args.tau, serial_s=2 * m * pp * args.tau)
                points.append(pt)
                rows.append([args.tree, pp, m, f"{pt['step_s']:.3f}", f"{pt['pipelined_s']:.3f}", f"{pt['serial_s']:.3f}"])
    print_table(["code", "PP", "M", "step s", "2(M+PP-1)tau", "2 M PP tau"], rows,
                f"ring step with encoder stage-time tau={args.tau}s")
    write_results(f"ring_encoder_{args.tree}", {"machine": machine(), "tau": args.tau, "points": points})
    return 0


if __name__ == "__main__":
    sys.exit(main())
