"""Ring pipeline benchmark: tokens/s and bubble for PP = 1, 2, 4 and M = 1, 2, 4, 8.

    .venv/bin/python bench/bench_ring.py [--steps 2] [--out bench/results/ring.json]

Each point is a torchrun job of the real trainer (gloo, CPU) on a small
synthetic parity set, a 4+4-layer model (d=32) and micro-batches of 2
samples. "ideal" is (PP-1)/ticks for M >= PP with ticks = M*T + PP - 1 per
sample of T segments; for M < PP the ring cannot fill and the scheduled idle
share is 1 - M*T/ticks. Measured idle is the share of the ring's wall time
stage 0 spent blocked in receives. On a 2-core machine PP=4 oversubscribes
the cores, so its tokens/s measure the schedule's overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
from helpers import torchrun  # noqa: E402

from rlt_scale.data.prepare import prepare_task  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--length", type=int, default=24, help="parity bits per sample (T ~ length + 3)")
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "ring.json"))
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        prepare_task("parity", Path(tmp) / "data", num_samples=256, length=args.length, seed=0, eval_samples=0)
        for pp in (1, 2, 4):
            for m in (1, 2, 4, 8):
                overrides = [
                    f"data.path={tmp}/data", f"checkpoint.dir={tmp}/run", "logging.wandb_mode=disabled",
                    "model.d_model=32", "model.n_heads=4", "model.n_enc_layers=4", "model.n_dec_layers=4",
                    "model.window=8", f"parallel.pp={pp}", "trainer.micro_batch_size=2",
                    f"trainer.grad_accum_steps={m}", "trainer.threads=1", "parallel.timeout_s=120",
                ]
                proc = torchrun("bench/ring_worker.py", pp, [str(args.steps)] + overrides, timeout=900)
                row = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
                segments = args.length + 2  # inputs per sample: BOS, bits, separator (see docs/DATA.md)
                ticks = max(m, pp) * segments + pp - 1
                row["ideal"] = (pp - 1) / ticks if m >= pp else 1 - m * segments / ticks
                rows.append(row)
                print(f"PP={pp} M={m}: {row['tokens_per_s']:8.0f} tokens/s  idle scheduled {row['idle_scheduled']:.3f}"
                      f"  measured {row['idle_measured']:.3f}  ideal {row['ideal']:.3f}", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))
    print("\n| PP | M | tokens/s | idle (scheduled) | idle (measured, stage 0) | ideal |\n|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['pp']} | {r['m']} | {r['tokens_per_s']:.0f} | {r['idle_scheduled']:.3f} | "
              f"{r['idle_measured']:.3f} | {r['ideal']:.3f} |")


if __name__ == "__main__":
    main()
