"""Parameter counts of a config without allocating it: ``python tools/count_params.py CONFIG [key=value ...]``.

Builds the model on the ``meta`` device (no memory, no init) at TP=1 and
prints unique parameters and applied parameters (tied layers counted per use).
"""

from __future__ import annotations

import sys

import torch

from rlt_scale.config import ParallelConfig, load_config
from rlt_scale.distributed import init_distributed
from rlt_scale.model import build_model


def count(path: str, overrides: list[str]) -> dict[str, int]:
    cfg = load_config(path, overrides)
    ctx = init_distributed(ParallelConfig(), device="cpu")
    with torch.device("meta"):
        model = build_model(cfg.model, ctx.tp_group)
    return model.parameter_counts()


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    counts = count(sys.argv[1], sys.argv[2:])
    print(f"{sys.argv[1]}: {counts['unique']:,} unique, {counts['applied']:,} applied")
