"""``rlt-export RUN_DIR --out DIR``: one consolidated safetensors file plus config, for inference.

Reads a run's newest checkpoint (or ``--checkpoint``), whatever TP x PP x DP
layout wrote it, into a one-process full-size model -- the reshard-on-load
path of :mod:`rlt_scale.training.checkpoint` with TP = PP = DP = 1 -- and
writes::

    DIR/model.safetensors   every parameter and persistent buffer, full size, by its global name
    DIR/config.yaml         the run's config (``rlt-generate DIR`` rebuilds the model from it)

No optimizer state is exported. safetensors holds raw tensors only, so
loading it cannot run code.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch
import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlt_scale.config import Config, ParallelConfig, config_to_yaml
from rlt_scale.distributed import init_distributed
from rlt_scale.errors import CheckpointError, ConfigError
from rlt_scale.model import RLT, build_model
from rlt_scale.training.checkpoint import CheckpointManager
from rlt_scale.training.sharded_state import ModelOptimizerState, named_weights

WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.yaml"


def _config_from(data) -> Config:
    merged = OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(data))
    return OmegaConf.to_object(merged)  # type: ignore[return-value]


def _one_process_model(cfg: Config, device: str) -> tuple[RLT, ModelOptimizerState]:
    ctx = init_distributed(ParallelConfig(), device)
    if ctx.world_size != 1:
        raise RuntimeError("export and generation build the full model in one process; run them without torchrun")
    model = build_model(cfg.model, ctx.tp_group).to(ctx.device)
    return model, ModelOptimizerState(model, None, ctx)


def load_checkpoint_model(run_dir: str | Path, checkpoint: Optional[str | Path] = None,
                          device: str = "cpu") -> tuple[RLT, Config, Path]:
    """(full-size model, config, checkpoint path) from a run's newest checkpoint, any layout."""
    manager = CheckpointManager(run_dir)
    path = Path(checkpoint) if checkpoint else manager.latest()
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint under {manager.root}")
    cfg = _config_from(manager.read_meta(path)["config"])
    model, weights = _one_process_model(cfg, device)
    manager.load(path, {"model": weights})
    model.eval()
    return model, cfg, path


def load_export(directory: str | Path, device: str = "cpu") -> tuple[RLT, Config]:
    """(model, config) from a directory written by :func:`export`."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    directory = Path(directory)
    if not (directory / CONFIG_FILE).is_file():
        raise CheckpointError(f"{directory / CONFIG_FILE} is missing: "
                              f"{directory} is not a complete rlt-export directory")
    try:
        cfg = _config_from(OmegaConf.load(directory / CONFIG_FILE))
    except (OmegaConfBaseException, yaml.YAMLError) as err:
        raise ConfigError(str(directory / CONFIG_FILE), f"not a valid rlt-scale config ({err})") from None
    model, weights = _one_process_model(cfg, device)
    try:
        tensors = load_file(directory / WEIGHTS_FILE, device=str(next(model.parameters()).device))
    except (OSError, SafetensorError) as err:
        raise CheckpointError(f"{directory / WEIGHTS_FILE} is unreadable ({err})") from None
    wanted = named_weights(model)
    if tensors.keys() != wanted.keys():
        missing, extra = sorted(wanted.keys() - tensors.keys()), sorted(tensors.keys() - wanted.keys())
        raise CheckpointError(f"{directory / WEIGHTS_FILE} does not match the model of {directory / CONFIG_FILE}: "
                              f"missing {missing[:5]}, unexpected {extra[:5]}")
    with torch.no_grad():
        for name, target in wanted.items():
            if tensors[name].shape != target.shape:
                raise CheckpointError(f"{directory / WEIGHTS_FILE}: {name} has shape {tuple(tensors[name].shape)}, "
                                      f"the config implies {tuple(target.shape)}")
            target.copy_(tensors[name])
    model.eval()
    return model, cfg


def export(run_dir: str | Path, out: str | Path, checkpoint: Optional[str | Path] = None) -> Path:
    from safetensors.torch import save_file

    model, cfg, path = load_checkpoint_model(run_dir, checkpoint)
    tensors = {name: t.detach().contiguous() for name, t in named_weights(model).items()}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / WEIGHTS_FILE, metadata={"checkpoint": str(path), "format": "pt"})
    (out / CONFIG_FILE).write_text(config_to_yaml(cfg))
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlt-export", description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--out", required=True, help="directory for model.safetensors and config.yaml")
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory instead of the run's newest")
    args = p.parse_args(argv)
    try:
        out = export(args.run_dir, args.out, args.checkpoint)
    except (CheckpointError, FileNotFoundError) as err:
        print(f"rlt-export: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {out / WEIGHTS_FILE} and {out / CONFIG_FILE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
