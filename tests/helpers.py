"""What the tests share: tiny data and runs, torchrun launches, merging per-stage results.

* :func:`parity_dataset` and :func:`tiny_overrides`: the tiny prepared task
  and the tiny model and run most tests train (``conftest.py`` makes the
  shared datasets once per session).
* :func:`torchrun`: a worker script under torchrun with a hard timeout. A
  mismatched collective would otherwise block for the process-group timeout;
  the workers use a short one (``parallel.timeout_s``) and the whole launch is
  killed after ``timeout`` seconds, so a deadlock fails a test instead of CI.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import torch

from rlt_scale.data.prepare import prepare_task

ROOT = Path(__file__).resolve().parent.parent


def parity_dataset(out: Path, num_samples: int, length: int, eval_samples: int = 0) -> Path:
    """A prepared parity task (seed 0) at ``out``; with ``eval_samples``, its eval split at ``out/eval``."""
    prepare_task("parity", out, num_samples=num_samples, length=length, seed=0, eval_samples=eval_samples)
    return out


def tiny_overrides(data, run_dir, **extra) -> list[str]:
    """The tiny model and run the in-process and launcher tests train, as ``key=value`` overrides.

    d=16, 2 heads, window 4, micro-batch 4, 4 steps, no eval set (a YAML such as
    configs/tiny.yaml names one, which the trainer opens at start-up), logging
    every step; ``extra`` (dotted keys) adds or replaces keys.
    """
    base = {
        "data.path": data, "data.eval_path": "null", "checkpoint.dir": run_dir, "logging.wandb_mode": "disabled",
        "model.d_model": 16,
        "model.n_heads": 2, "model.window": 4, "model.vocab_size": 260, "trainer.micro_batch_size": 4,
        "trainer.max_steps": 4, "trainer.log_interval": 1, "trainer.eval_interval": 0, "trainer.threads": 1,
    }
    return [f"{k}={v}" for k, v in {**base, **extra}.items()]


def step_records(run_dir: Path) -> list[dict]:
    """The step records of ``run_dir/metrics.jsonl``, in the order written (redone steps appear twice)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    records = []
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # the last line, caught mid-write
            continue
        if "loss" in record:
            records.append(record)
    return records


def grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def loss_logits_grads(model, tokens, doc, bptt):
    """One forward+backward of ``run_sequence``: the mean loss, the logits (unchunked runs) and every gradient."""
    from rlt_scale.training.bptt import run_sequence

    model.zero_grad(set_to_none=True)
    out = run_sequence(model, tokens, doc, bptt=bptt, want_logits=bptt.chunk_size == 0)
    loss = out.loss_sum / out.n_targets
    loss.backward()
    return loss.detach(), out.logits, grads(model)


def assert_same_grads(got: dict, ref: dict, tol: float) -> None:
    """The same parameters have gradients, each within ``tol`` (max abs) of the reference."""
    assert got.keys() == ref.keys()
    for name in ref:
        assert (got[name] - ref[name]).abs().max() <= tol, name


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


TORCHRUN_TIMEOUT_S = 480
"""How long :func:`torchrun` waits for a multi-process run by default."""


def torchrun(script: str, nproc: int, args: list[str], timeout: float = TORCHRUN_TIMEOUT_S, env: dict | None = None,
             check: bool = True) -> subprocess.CompletedProcess:
    """Run ``script`` on ``nproc`` ranks; ``env`` adds variables; ``check=False`` returns a failed run too."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
        "--master-addr=127.0.0.1", f"--master-port={free_port()}", str(ROOT / script), *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled", PYTHONWARNINGS="ignore", **(env or {}))
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    return proc


def layout_overrides(data, run_dir, micro: int, dtype: str, extra: list[str]) -> list[str]:
    """The tiny model and 3-step run that the layout tests (plain, ZeRO) compare across layouts."""
    precision = {"float64": "fp64", "float32": "fp32"}[dtype]
    return [
        f"data.path={data}", f"checkpoint.dir={run_dir}", "logging.wandb_mode=disabled",
        "model.d_model=16", "model.n_heads=4", "model.window=3", "model.vocab_size=260", "model.ffn_hidden_size=32",
        f"model.params_dtype={dtype}", "model.feedback_scale=0.5", f"trainer.precision={precision}",
        "trainer.max_steps=3", f"trainer.micro_batch_size={micro}", "trainer.grad_accum_steps=2",
        "trainer.eval_interval=0", "trainer.device=cpu", "checkpoint.interval=0", "parallel.timeout_s=60",
        "optimizer.grad_clip=0.5", "optimizer.warmup_steps=1",
    ] + extra


def tiny_run_overrides(data, run_dir, steps: int, *, interval: int = 2, micro: int = 2,
                       timeout_s: int = 60) -> list[str]:
    """:func:`tiny_overrides` checkpointing every ``interval`` steps: the launcher tests' run."""
    return tiny_overrides(data, run_dir, **{"trainer.max_steps": steps, "trainer.micro_batch_size": micro,
                                            "parallel.timeout_s": timeout_s, "checkpoint.interval": interval})


def merge_pipeline_stages(stages: list[dict], agree: tuple[str, ...]) -> dict:
    """One run's result from the files its pipeline stages wrote.

    Values under ``agree`` (losses, norms, ...) must be equal on every stage;
    ``grads`` and ``params`` are joined by name, and a tensor present on
    several stages (a replicated memory projection) must be bit-identical
    there. Other keys are taken from the first stage.
    """
    merged = {**stages[0], "grads": {}, "params": {}}
    for stage in stages:
        for key in agree:
            assert stage[key] == merged[key], key
        for key in ("grads", "params"):
            for name, value in stage[key].items():
                if name in merged[key]:
                    assert torch.equal(merged[key][name], value), name
                merged[key][name] = value
    return merged
