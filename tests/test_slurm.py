"""launch/slurm.sh against a real single-node Slurm (Debian's slurmctld, slurmd, munge).

``launch/slurm-local-setup.sh`` installs and starts that cluster (CI runs it
before the tests); here it is called with ``--no-install`` only to start
daemons that are installed but down. Where Slurm is not installed or does not
answer, the test is skipped with the reason.

One job trains with two processes until it is sent SIGTERM (what Slurm sends
before the time limit and on preemption), checkpoints and ends; a second job,
the same command, resumes from that checkpoint and finishes.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import ROOT, tiny_run_overrides as _overrides
from rlt_scale.data.prepare import prepare_task

pytestmark = pytest.mark.slow

JOB_DEADLINE_S = 300
"""Hard limit on each Slurm job of this test (~30-60 s here); the job is cancelled after it."""


@pytest.fixture(scope="module")
def slurm():
    if shutil.which("sbatch") is None:
        pytest.skip("Slurm is not installed (no sbatch): `sudo launch/slurm-local-setup.sh` installs a "
                    "single-node cluster (Debian/Ubuntu); CI runs it")
    setup = subprocess.run(["bash", "launch/slurm-local-setup.sh", "--no-install"], cwd=ROOT,
                           capture_output=True, text=True, timeout=120)
    if setup.returncode != 0:
        pytest.skip(f"Slurm does not accept jobs here: {setup.stderr.strip()[-600:]}")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    prepare_task("parity", out, num_samples=128, length=8, seed=0, eval_samples=0)
    return out


def _steps(run_dir: Path) -> list[int]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [r["step"] for r in map(json.loads, path.read_text().splitlines()) if "loss" in r]


FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE"}


def _job_state(job: str) -> str:
    """The job's state; UNKNOWN when slurmctld does not answer (it is busy at times on a loaded machine)."""
    out = subprocess.run(["scontrol", "show", "job", job], capture_output=True, text=True).stdout
    return next((f.split("=", 1)[1] for f in out.split() if f.startswith("JobState=")), "UNKNOWN")


class Job:
    """``sbatch launch/slurm.sh``; logs go to ``log_root`` (the job's output and torchrun's per-rank files)."""

    def __init__(self, log_root: Path, args: list[str]):
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHON=sys.executable,
                   WANDB_MODE="disabled", NPROC_PER_NODE="2", LOG_ROOT=str(log_root))
        # --cpus-per-task: the one task per node runs both workers (slurm.sh passes it on to srun).
        out = subprocess.run(["sbatch", "--parsable", "--job-name=rlt-test", "--cpus-per-task=2",
                              f"--output={log_root}/%x-%j.out",
                              "launch/slurm.sh", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                             timeout=60, check=True)
        self.id = out.stdout.strip().split(";")[0]
        self.output = log_root / f"rlt-test-{self.id}.out"
        self.log_dir = log_root / f"rlt-test-{self.id}"
        self.deadline = time.time() + JOB_DEADLINE_S

    def running(self) -> bool:
        return _job_state(self.id) not in FINAL_STATES

    def wait(self) -> str:
        """Wait for the job to end; returns its final state."""
        while (state := _job_state(self.id)) not in FINAL_STATES:
            if time.time() > self.deadline:
                raise AssertionError(f"job {self.id} still {state} after {JOB_DEADLINE_S} s:\n{self.text()[-3000:]}")
            time.sleep(0.5)
        return state

    def cancel(self) -> None:
        subprocess.run(["scancel", self.id], capture_output=True)

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else "(no job output yet)"


def test_sbatch_trains_checkpoints_on_sigterm_and_resumes(slurm, data, tmp_path):
    run, logs = tmp_path / "run", tmp_path / "logs"
    logs.mkdir()
    job = Job(logs, ["configs/tiny.yaml", *_overrides(data, run, 100_000, interval=1000)])
    try:
        while len(_steps(run)) < 3:
            assert job.running(), f"job {job.id} ended early ({_job_state(job.id)}):\n{job.text()[-3000:]}"
            assert time.time() < job.deadline, f"job {job.id} made no progress:\n{job.text()[-3000:]}"
            time.sleep(0.2)
        # What Slurm does at `--signal=TERM@120` and on preemption: SIGTERM to every process of the step.
        subprocess.run(["scancel", "--signal=TERM", job.id], check=True)
        job.wait()
    finally:
        job.cancel()
    out = job.text()
    assert f"job {job.id}: 1 node(s)" in out and "x 2 process(es)" in out
    stopped_at = _steps(run)[-1]
    assert f"SIGTERM received: checkpointing at step {stopped_at} and exiting" in out, out[-3000:]
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped_at:08d}"  # nothing lost
    # torchrun's per-rank files, one directory per node of the job
    rank_logs = sorted(job.log_dir.glob("*/*/attempt_0/*/stdout.log"))
    assert len(rank_logs) == 2, sorted(p.relative_to(logs) for p in job.log_dir.rglob("*"))
    assert "SIGTERM received" in rank_logs[0].read_text()

    # The same command again resumes from that checkpoint and runs to the end.
    resumed = Job(logs, ["configs/tiny.yaml", *_overrides(data, run, stopped_at + 2, interval=1000)])
    try:
        state = resumed.wait()
    finally:
        resumed.cancel()
    out = resumed.text()
    assert state == "COMPLETED", out[-3000:]
    assert f"resumed from {run / 'checkpoints' / f'step_{stopped_at:08d}'} at step {stopped_at}" in out
    assert _steps(run)[-2:] == [stopped_at + 1, stopped_at + 2]
    meta = json.loads((run / "checkpoints" / f"step_{stopped_at + 2:08d}" / "meta.json").read_text())
    assert meta["world_size"] == 2
