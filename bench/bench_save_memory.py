"""What a checkpoint save adds to resident memory (issue #17, item 3).

    .venv/bin/python bench/bench_save_memory.py                    # this tree, rlt-100m
    .venv/bin/python bench/bench_save_memory.py --code /path/to/old/checkout --tree old

Each point runs in a fresh process (so malloc has cached nothing): the
``mid`` (rlt-100m) model with AdamW state after one step, then one
``dcp.save`` of ``ModelOptimizerState.sharded_state_dict()`` to a temporary
directory. Reported: the resident set just before the save, its peak during
the save above that (``VmHWM`` reset at the start, rlt_scale.profiling.rss),
and for scale the model + both moments and the largest single tensor.

Two variants: ``grads kept`` (the step's gradients still allocated, as the
old ``Trainer.save`` left them) and ``grads freed`` (what ``Trainer.save``
does now, before writing). The code under test is whatever ``rlt_scale``
imports: ``--code`` points it at a checkout of an older commit (ahead of the
editable install of this one, whose finder comes after ``sys.path``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile

from common import CONFIGS, ROOT, machine, print_table, write_results  # noqa: E402

if "--code" in sys.argv:  # ahead of this tree, which common put first; only the child imports rlt_scale
    sys.path.insert(0, sys.argv[sys.argv.index("--code") + 1])
    for name in [m for m in sys.modules if m == "rlt_scale" or m.startswith("rlt_scale.")]:
        del sys.modules[name]

MB = 2**20


def child(config: str, free_grads: bool) -> dict:
    import torch
    import torch.distributed.checkpoint as dcp

    import rlt_scale
    from rlt_scale.config import ParallelConfig
    from rlt_scale.distributed import init_distributed
    from rlt_scale.model import build_model
    from rlt_scale.profiling import rss
    from rlt_scale.training.sharded_state import ModelOptimizerState

    from rlt_scale.config import load_config

    torch.set_num_threads(1)
    cfg = load_config(str(ROOT / CONFIGS[config][0])).model  # through the measured code's own config class
    ctx = init_distributed(ParallelConfig(), "cpu")
    model = build_model(cfg, ctx.tp_group)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    if free_grads:
        model.zero_grad(set_to_none=True)
    params = list(model.parameters())
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in params)
    largest = max(p.numel() * p.element_size() for p in params)
    out = tempfile.mkdtemp(prefix="bench-save-mem-")
    try:
        before = rss.reset_peak()
        dcp.save(ModelOptimizerState(model, optimizer, ctx).sharded_state_dict(), checkpoint_id=out)
        added = rss.peak_rss() - before
    finally:
        shutil.rmtree(out, ignore_errors=True)
    return {"rlt_scale": rlt_scale.__file__, "free_grads": free_grads, "rss_before": before,
            "save_added": added, "model_and_moments": state_bytes, "largest_tensor": largest}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--config", default="mid")
    p.add_argument("--tree", default="new", help="a label for the code measured (new, old, ...)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--code", help="measure the rlt_scale package of this checkout instead of the installed one")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        print(json.dumps(child(args.config, json.loads(args.child))))
        return 0
    points = []
    for _ in range(args.rounds):
        for free in (False, True):
            extra = ["--code", args.code] if args.code else []
            proc = subprocess.run([sys.executable, __file__, "--config", args.config, *extra, "--child", json.dumps(free)],
                                  capture_output=True, text=True, check=True)
            points.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    rows = [[args.tree, "freed" if pt["free_grads"] else "kept", f"{pt['rss_before'] / MB:.0f}",
             f"{pt['save_added'] / MB:.0f}", f"{pt['model_and_moments'] / MB:.0f}", f"{pt['largest_tensor'] / MB:.0f}"]
            for pt in points]
    print_table(["code", "grads", "RSS before MB", "save adds MB", "model+moments MB", "largest tensor MB"], rows,
                f"checkpoint save, {args.config}, one process ({points[0]['rlt_scale']})")
    write_results(f"save_memory_{args.tree}", {"machine": machine(), "config": args.config, "points": points})
    return 0


if __name__ == "__main__":
    sys.exit(main())
