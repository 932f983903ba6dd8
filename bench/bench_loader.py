"""Loader throughput against what training consumes.

    python bench/bench_loader.py                          # data/stdlib, prepared on demand
    python bench/bench_loader.py --workers 0,1,2 --consume-tokens-per-s 5000 --dp-size 2

For each worker count the loader yields ``--epochs`` full epochs of batches
(``--batch-size`` rows of ``seq_len + 1`` tokens) as one DP rank of
``--dp-size`` would; the clock starts before the first batch is requested, so
start-up (workers, first shard read and checksummed) is included. Tokens/s
count the tokens the trainer consumes per sample (``seq_len``). The ratio is
loader tokens/s over training tokens/s; it should stay above 20, or the loader
would show up in the step time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from rlt_scale.data.config import DataConfig  # noqa: E402
from rlt_scale.data.loader import StreamingLoader  # noqa: E402


def ensure_dataset(path: Path, seq_len: int) -> None:
    if (path / "index.json").is_file():
        return
    print(f"# preparing {path} (stdlib, seq_len {seq_len})", flush=True)
    subprocess.run([sys.executable, "-m", "rlt_scale.data.prepare", "--source", "stdlib", "--out", str(path),
                    "--seq-len", str(seq_len), "--quiet"], check=True, cwd=ROOT)


def measure(path: Path, workers: int, batch_size: int, dp_size: int, epochs: float) -> dict:
    cfg = DataConfig(path=str(path), num_workers=workers)
    loader = StreamingLoader(cfg, batch_size=batch_size, dp_rank=0, dp_size=dp_size)
    batches = max(1, int(epochs * loader.samples_per_epoch / loader.global_batch_size))
    started = time.perf_counter()
    iterator = iter(loader)
    next(iterator)
    first = time.perf_counter() - started
    for _ in range(batches - 1):
        next(iterator)
    elapsed = time.perf_counter() - started
    del iterator  # stops the workers
    samples = batches * batch_size
    return {"workers": workers, "dp_size": dp_size, "batch_size": batch_size, "batches": batches,
            "first_batch_s": round(first, 3), "seconds": round(elapsed, 3), "samples_per_s": samples / elapsed,
            "tokens_per_s": samples * loader.seq_len / elapsed}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--path", type=Path, default=ROOT / "data" / "stdlib")
    p.add_argument("--seq-len", type=int, default=256, help="only used when the dataset has to be prepared")
    p.add_argument("--batch-size", type=int, default=8, help="micro batch size of one DP rank")
    p.add_argument("--dp-size", type=int, default=1, help="measure DP rank 0 of this many")
    p.add_argument("--workers", default="0,1,2", help="comma-separated num_workers values")
    p.add_argument("--epochs", type=float, default=3.0, help="how much data each measurement reads")
    p.add_argument("--consume-tokens-per-s", type=float, default=5000.0,
                   help="training consumption of one rank (tiny config on a 2-core CPU: ~2,000-5,000)")
    p.add_argument("--json", action="store_true", help="print one JSON object per measurement")
    args = p.parse_args(argv)
    ensure_dataset(args.path, args.seq_len)
    print(f"# {args.path}: batch {args.batch_size}, DP rank 0 of {args.dp_size}, "
          f"training consumes {args.consume_tokens_per_s:.0f} tokens/s")
    worst = float("inf")
    for workers in (int(w) for w in args.workers.split(",")):
        result = measure(args.path, workers, args.batch_size, args.dp_size, args.epochs)
        result["ratio"] = result["tokens_per_s"] / args.consume_tokens_per_s
        worst = min(worst, result["ratio"])
        if args.json:
            print(json.dumps(result))
        else:
            print(f"workers={workers}: {result['samples_per_s']:8.0f} samples/s {result['tokens_per_s']:10.0f} tokens/s "
                  f" ratio {result['ratio']:6.1f}x  (first batch {result['first_batch_s']:.2f} s, "
                  f"{result['batches']} batches in {result['seconds']:.1f} s)")
    verdict = "ok" if worst >= 20 else "BELOW TARGET"
    print(f"# worst ratio {worst:.1f}x (target >= 20x): {verdict}")
    return 0 if worst >= 20 else 1


if __name__ == "__main__":
    sys.exit(main())
