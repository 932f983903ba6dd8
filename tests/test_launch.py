"""Launchers and preemption, end to end on this machine (loopback only)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, free_port, tiny_run_overrides as _overrides
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
    cmd = [sys.executable, "-m", "rlt_scale.cli.train", "configs/tiny.yaml", *_overrides(data, run, 10_000)]
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


class Launch:
    """``bash SCRIPT configs/tiny.yaml ...`` in its own process group, output to a file; killed if left running."""

    def __init__(self, script: str, args: list[str], log: Path, **env):
        env = _env(NPROC_PER_NODE="2", RDZV_ENDPOINT=f"127.0.0.1:{free_port()}", MASTER_PORT=str(free_port()),
                   DEEPSPEED=str(Path(sys.executable).parent / "deepspeed"), WANDB_MODE="disabled", **env)
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(["bash", script, "configs/tiny.yaml", *args], cwd=ROOT, env=env,
                                         stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_for_steps(self, run: Path, n: int, timeout: float = 240) -> None:
        deadline = time.time() + timeout
        while len(_steps(run)) < n:
            assert self.proc.poll() is None, f"ended early ({self.proc.returncode}):\n{self.output()[-4000:]}"
            assert time.time() < deadline, f"no {n} steps in {timeout} s:\n{self.output()[-4000:]}"
            time.sleep(0.2)

    def wait(self, timeout: float = 240) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"still running after {timeout} s:\n{self.output()[-4000:]}") from None

    def kill(self) -> None:
        """SIGKILL the launcher's process group and every process under it (torchrun's workers have their own)."""
        import psutil

        try:
            tree = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        for p in tree:
            try:
                p.kill()
            except psutil.Error:
                pass
        self.proc.wait(timeout=30)


@pytest.mark.parametrize("script", ["launch/torchrun.sh", "launch/deepspeed.sh"])
def test_sigterm_to_launcher_checkpoints_exits_0_and_resumes(data, tmp_path, script):
    # SIGTERM to the launcher alone (what Kubernetes or `kill PID` does): the workers checkpoint at
    # the step they are on and exit 0, and so does the launcher, without a traceback (torchrun used
    # to exit 1 with a SignalException traceback; the deepspeed runner died at once, leaving the workers).
    run = tmp_path / "run"
    launch = Launch(script, _overrides(data, run, 10_000, interval=1000), tmp_path / "first.log",
                    SHUTDOWN_TIMEOUT="90")
    try:
        launch.wait_for_steps(run, 3)
        launch.proc.send_signal(signal.SIGTERM)
        code = launch.wait(timeout=150)
    finally:
        launch.kill()
    out = launch.output()
    assert code == 0, out[-4000:]
    assert "Traceback" not in out, out[-4000:]
    assert "SIGTERM: every worker exited 0" in out, out[-4000:]
    stopped_at = _steps(run)[-1]
    assert f"SIGTERM received: checkpointing at step {stopped_at} and exiting" in out, out[-4000:]
    latest = (run / "checkpoints" / "latest").read_text().strip()
    assert latest == f"step_{stopped_at:08d}"  # nothing trained was lost
    assert json.loads((run / "checkpoints" / latest / "meta.json").read_text())["world_size"] == 2

    again = Launch(script, _overrides(data, run, stopped_at + 2, interval=1000), tmp_path / "again.log")
    try:
        code = again.wait()
    finally:
        again.kill()
    assert code == 0, again.output()[-4000:]
    assert f"resumed from {run / 'checkpoints' / latest} at step {stopped_at}" in again.output()
    assert _steps(run)[-2:] == [stopped_at + 1, stopped_at + 2]


def test_sigterm_with_a_worker_failing_to_checkpoint_exits_nonzero(data, tmp_path):
    # The checkpoint directory is a file by the time SIGTERM arrives: rank 0 raises while saving,
    # so not every worker exited 0 and torchrun.sh must not report success.
    run = tmp_path / "run"
    launch = Launch("launch/torchrun.sh", _overrides(data, run, 10_000, interval=1000, timeout_s=20),
                    tmp_path / "first.log", SHUTDOWN_TIMEOUT="60", MAX_RESTARTS="0")
    try:
        launch.wait_for_steps(run, 3)
        shutil.rmtree(run / "checkpoints", ignore_errors=True)
        (run / "checkpoints").write_text("not a directory\n")
        launch.proc.send_signal(signal.SIGTERM)
        code = launch.wait(timeout=150)
    finally:
        launch.kill()
    out = launch.output()
    assert code == 128 + signal.SIGTERM, out[-4000:]
    assert "SIGTERM: not every worker exited 0 (local rank 0: exit " in out, out[-4000:]


def test_worker_error_without_a_signal_still_fails_the_launch(data, tmp_path):
    # No signal at all: a worker that fails (here: a missing data set) fails the launch as before.
    launch = Launch("launch/torchrun.sh", [*_overrides(data, tmp_path / "run", 3), f"data.path={tmp_path / 'none'}"],
                    tmp_path / "first.log", MAX_RESTARTS="0")
    try:
        code = launch.wait()
    finally:
        launch.kill()
    assert code == 1, launch.output()[-4000:]
    assert "ChildFailedError" in launch.output()


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
