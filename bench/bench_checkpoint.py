"""What content checksums cost a checkpoint save and load (issue #11, item 3).

One process, the ``mid`` (rlt-100m) model with AdamW state: ~1.2 GB on disk.
Each round saves and loads the same state four ways, interleaved so that the
machine's load hits every variant alike:

* ``save``      -- ``CheckpointManager.save`` with the checksum pass switched off
* ``save+hash`` -- the real save: every file hashed (xxh3-128), recorded in meta.json
* ``load``      -- ``CheckpointManager.load`` with verification switched off
* ``load+hash`` -- the real load: every file re-hashed and compared first

The files are read back from the page cache (they were just written); on a
cold network file system hashing costs one more read of the checkpoint.

    .venv/bin/python bench/bench_checkpoint.py --rounds 3
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
from pathlib import Path

from common import Clock, machine, model_config, print_table, set_threads, warn_if_busy, write_results

import torch

from rlt_scale.config import ParallelConfig
from rlt_scale.distributed import init_distributed
from rlt_scale.model import build_model
from rlt_scale.training.checkpoint import CheckpointManager
from rlt_scale.training.checkpoint_files import file_digest
from rlt_scale.training.sharded_state import ModelOptimizerState


def build_state(name: str):
    cfg, source = model_config(name)
    ctx = init_distributed(ParallelConfig(), "cpu")
    model = build_model(cfg, ctx.tp_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():  # one step creates both Adam moments
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return {"model_and_optimizer": ModelOptimizerState(model, optimizer, ctx, None)}, source


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--config", default="mid")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    set_threads(args.threads)
    objects, source = build_state(args.config)
    root = Path(tempfile.mkdtemp(prefix="bench-ckpt-"))
    times: dict[str, list[float]] = {k: [] for k in ("save", "save+hash", "load", "load+hash", "hash only")}
    cpu: dict[str, list[float]] = {k: [] for k in times}
    verify = CheckpointManager._verify_checksums
    checksums = CheckpointManager._checksums
    size = 0
    try:
        for r in range(args.rounds):
            for hashed in (False, True) if r % 2 == 0 else (True, False):
                manager = CheckpointManager(root / ("hashed" if hashed else "plain"), keep=1)
                CheckpointManager._checksums = checksums if hashed else (lambda self, state_dir: {})
                with Clock() as c:
                    path = manager.save(r + 1, objects)
                times["save+hash" if hashed else "save"].append(c.wall)
                cpu["save+hash" if hashed else "save"].append(c.cpu)
                CheckpointManager._verify_checksums = verify if hashed else (lambda self, state_dir, meta: None)
                with Clock() as c:
                    manager.load(path, objects)
                times["load+hash" if hashed else "load"].append(c.wall)
                cpu["load+hash" if hashed else "load"].append(c.cpu)
                if hashed:
                    files = [f for f in (path / "state").iterdir()]
                    size = sum(f.stat().st_size for f in files)
                    with Clock() as c:
                        for f in files:
                            file_digest(f)
                    times["hash only"].append(c.wall)
                    cpu["hash only"].append(c.cpu)
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in times.items()),
                  flush=True)
    finally:
        CheckpointManager._verify_checksums, CheckpointManager._checksums = verify, checksums
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in times.items()}
    med_cpu = {k: statistics.median(v) for k, v in cpu.items()}
    info = machine()
    rows = [[k, f"{med[k]:.3f}", f"{med_cpu[k]:.3f}"] for k in times]
    for what in ("save", "load"):
        rows.append([f"{what} overhead", f"{med[what + '+hash'] / med[what] - 1:+.1%}",
                     f"{med_cpu[what + '+hash'] / med_cpu[what] - 1:+.1%}"])
    rows.append(["hash throughput", f"{size / med['hash only'] / 1e9:.2f} GB/s", ""])
    print_table(["what", "median wall s", "median CPU s"], rows,
                f"checkpoint checksums, {args.config} ({source}), {size / 1e9:.2f} GB, {args.rounds} rounds, "
                f"{info['torch_threads']} thread, load average {info['load_average_1m']:.2f}")
    warn_if_busy(info)
    write_results("checkpoint", {"machine": info, "config": args.config, "bytes": size, "wall_s": times,
                                 "cpu_s": cpu, "median_wall_s": med, "median_cpu_s": med_cpu})


if __name__ == "__main__":
    main()
