"""Metrics sinks: the console, a JSONL file and wandb (offline unless configured)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from rlt_scale.config import LoggingConfig


class MetricsLogger:
    """Writes one record per logged step to every sink; only the logging rank writes."""

    def __init__(self, cfg: LoggingConfig, run_dir: Path, config: dict, enabled: bool, run_id: Optional[str] = None):
        self.enabled = enabled
        self.path = run_dir / "metrics.jsonl"
        self.wandb_run = None
        self.run_id = run_id
        if not enabled or cfg.wandb_mode == "disabled":
            return
        os.environ.setdefault("WANDB_SILENT", "true")
        import wandb  # imported lazily: ~0.5 s, and only where it is used

        self.wandb_run = wandb.init(
            project=cfg.project, name=cfg.run_name, mode=cfg.wandb_mode, dir=str(run_dir),
            config=config, id=run_id, resume="allow",
        )
        self.run_id = self.wandb_run.id

    def log(self, record: dict, console: Optional[str] = None) -> None:
        if not self.enabled:
            return
        if console:
            print(console, flush=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in record.items() if k != "step"}, step=record["step"])

    def close(self) -> None:
        if self.wandb_run is not None:
            self.wandb_run.finish()
