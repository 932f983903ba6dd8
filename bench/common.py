"""Shared helpers of the benches: model shapes, machine facts, results as JSON and a table.

Every bench builds the model through :func:`rlt_scale.model.build_model` and
runs ``run_sequence`` + the trainer's AdamW (rlt_scale.profiling.workload), the
code training runs. Results land in ``bench/results/<name>.json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from rlt_scale.config import ModelConfig, load_config  # noqa: E402
from rlt_scale.profiling.machine import environment  # noqa: E402
from rlt_scale.profiling.report import table  # noqa: E402

RESULTS = ROOT / "bench" / "results"

CONFIGS = {
    # name: (yaml, fallback ModelConfig when the yaml is absent)
    "tiny": ("configs/tiny.yaml", dict(vocab_size=260, d_model=64, n_heads=4, n_enc_layers=2, n_dec_layers=2, window=8)),
    "mid": ("configs/rlt-100m.yaml", dict(vocab_size=32768, d_model=640, n_heads=10, n_enc_layers=10,
                                          n_dec_layers=10, window=256)),
}


def model_config(name: str, overrides: tuple[str, ...] = ()) -> tuple[ModelConfig, str]:
    """The model of a named config (from its YAML when present) and where it came from."""
    path, fallback = CONFIGS[name]
    if (ROOT / path).is_file():
        return load_config(str(ROOT / path), [f"model.{o}" for o in overrides]).model, path
    cfg = ModelConfig(**fallback)
    for item in overrides:
        key, value = item.split("=", 1)
        setattr(cfg, key, type(getattr(cfg, key))(value))
    cfg.validate()
    return cfg, "built in (no yaml)"


def set_threads(threads: int) -> int:
    if threads:
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def machine() -> dict:
    """What the numbers were measured on, including how busy the machine was."""
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip()
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "rlt_scale/model"], cwd=ROOT,
                                    capture_output=True, text=True).stdout.strip())
    except OSError:
        commit, dirty = "", False
    return {
        **environment(),
        "load_average_1m": os.getloadavg()[0], "git_commit": commit, "model_code_modified": dirty,
        "cuda": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "when": time.strftime("%Y-%m-%d %H:%M:%S"),
    }


class Clock:
    """Wall and process-CPU seconds of a block (CPU time is less sensitive to other jobs on the box)."""

    def __enter__(self):
        self.wall0, self.cpu0 = time.perf_counter(), time.process_time()
        return self

    def __exit__(self, *exc):
        self.wall = time.perf_counter() - self.wall0
        self.cpu = time.process_time() - self.cpu0


def write_results(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2, default=str))
    return path


def print_table(headers, rows, title="") -> None:
    print(table(headers, rows, title), flush=True)


def warn_if_busy(info: dict) -> None:
    if info["load_average_1m"] > info["cores"]:
        print(f"# note: load average {info['load_average_1m']:.1f} on {info['cores']} cores: other jobs share "
              f"this machine; wall times are inflated, CPU times less so", flush=True)
