"""Launchers and preemption, end to end on this machine (loopback only)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from launch import ROOT, free_port, tiny_run_overrides as _overrides
from rlt_scale.data.prepare import prepare_task

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    prepare_task("parity", out, num_samples=128, length=8, seed=0, eval_samples=0)
    return out


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHON=sys.executable, **extra)


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


@pytest.mark.parametrize("script", ["launch/torchrun.sh", "launch/deepspeed.sh"])
def test_launcher_runs_data_parallel_training(data, tmp_path, script):
    run = tmp_path / "run"
    env = _env(NPROC_PER_NODE="2", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", MASTER_PORT=str(free_port()),
               DEEPSPEED=str(Path(sys.executable).parent / "deepspeed"))
    proc = subprocess.run(["bash", script, "configs/tiny.yaml", *_overrides(data, run, 3)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert _steps(run) == [1, 2, 3]
    meta = json.loads((run / "checkpoints" / "step_00000003" / "meta.json").read_text())
    assert meta["world_size"] == 2
    assert meta["layout"] == {"tp": 1, "pp": 1, "dp": 2, "zero_stage": 0}
    # each rank wrote its own shard file (torch.distributed.checkpoint: __<rank>_<n>.distcp)
    assert sorted(p.name for p in (run / "checkpoints" / "step_00000003" / "state").glob("*.distcp")) == [
        "__0_0.distcp", "__1_0.distcp"]


def test_sigterm_checkpoints_then_resume_continues(data, tmp_path):
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlt_scale.train", "configs/tiny.yaml", *_overrides(data, run, 10_000)]
    proc = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 240
    while len(_steps(run)) < 3 and time.time() < deadline and proc.poll() is None:
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out[-3000:]
    assert "SIGTERM received" in out and "preemption" in out
    stopped_at = _steps(run)[-1]
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{stopped_at:08d}"  # nothing trained was lost

    resumed = subprocess.run([*cmd[:-len(_overrides(data, run, 10_000))], *_overrides(data, run, stopped_at + 2)],
                             cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    assert f"resumed from {run / 'checkpoints' / latest} at step {stopped_at}" in resumed.stdout
    assert _steps(run)[-2:] == [stopped_at + 1, stopped_at + 2]


def test_deepspeed_hostfile_starts_the_slots_it_names(data, tmp_path):
    # A hostfile naming only this machine runs without pdsh; the ssh probe is skipped.
    # Its slots=2, not NPROC_PER_NODE=1, sets the process count.
    hostfile = tmp_path / "hosts.txt"
    hostfile.write_text("localhost slots=2\n")
    run = tmp_path / "run"
    env = _env(HOSTFILE=str(hostfile), NPROC_PER_NODE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()),
               DS_ARGS="--no_ssh_check", DEEPSPEED=str(Path(sys.executable).parent / "deepspeed"))
    proc = subprocess.run(["bash", "launch/deepspeed.sh", "configs/tiny.yaml", *_overrides(data, run, 2)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=480)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert _steps(run) == [1, 2]
    assert json.loads((run / "checkpoints" / "step_00000002" / "meta.json").read_text())["world_size"] == 2
