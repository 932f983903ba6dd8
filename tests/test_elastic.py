"""Elastic training over loopback: two torchrun agents play two nodes of one job.

Each agent is ``launch/torchrun.sh`` with ``NNODES=1:2`` and one worker,
rendezvousing through the c10d store that the first agent hosts on
127.0.0.1. Two faults, as on a cluster:

* a worker dies (SIGKILL): both agents restart the group, which resumes from
  the newest checkpoint at the same size and finishes;
* a whole node dies (its agent and worker, SIGKILL): the survivor re-forms
  the job at world size 1 and resumes from a checkpoint written by two ranks,
  with a smaller data-parallel group and the same global data order.

Every launch has a hard deadline, and every process a test started (found by
a tag in its environment, so orphaned workers are found too) is killed in a
``finally``.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import psutil
import pytest

from helpers import ROOT, step_records, free_port, tiny_run_overrides
from rlt_scale.data.prepare import prepare_task

pytestmark = pytest.mark.slow

DEADLINE_S = 300
"""Hard limit on each test's launches (they take ~30-60 s here)."""

# Rendezvous settings that keep re-forming fast on loopback: a dead node's
# heartbeat is declared lost after 1 s x 3, and a round with at least MIN
# nodes closes 10 s after MIN joined (long enough for both agents to join at
# the start on a loaded machine, so the job forms at 2 and not at 1 then 2).
RDZV_CONF = "join_timeout=90,last_call_timeout=10,close_timeout=10,keep_alive_interval=1,keep_alive_max_attempt=3"
TAG = "RLT_ELASTIC_TEST_TAG"
MICRO = 2  # micro-batch size per rank: one step consumes MICRO x DP samples


def gone():
    """Ignore processes that have already exited."""
    return contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError)


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    prepare_task("parity", out, num_samples=512, length=8, seed=0, eval_samples=0)
    return out


def _overrides(data, run_dir, steps: int, interval: int) -> list[str]:
    # keep every checkpoint: test 2 replays from the one resumed
    return tiny_run_overrides(data, run_dir, steps, interval=interval, micro=MICRO, timeout_s=30) + ["checkpoint.keep=1000"]


def _latest_step(run_dir: Path) -> int:
    pointer = run_dir / "checkpoints" / "latest"
    return int(pointer.read_text().strip().removeprefix("step_")) if pointer.exists() else 0


def _before_restart(records: list[dict]) -> list[dict]:
    """The records written before the first resume (the step counter goes back)."""
    for i in range(1, len(records)):
        if records[i]["step"] <= records[i - 1]["step"]:
            return records[:i]
    return records


def _wait(condition, what: str, deadline: float, agents=()) -> None:
    """Poll ``condition`` until true; fail with the agents' output if one exits or time runs out."""
    while not condition():
        early = [a for a in agents if a.proc.poll() is not None]
        if early or time.time() > deadline:
            reason = f"agent exited early ({early[0].proc.returncode})" if early else "timed out"
            logs = "\n".join(f"--- {a.log.name}\n{a.output()[-3000:]}" for a in agents)
            raise AssertionError(f"waiting for {what}: {reason}\n{logs}")
        time.sleep(0.05)


class Agent:
    """One ``launch/torchrun.sh`` agent; its output goes to ``log``."""

    def __init__(self, tag: str, port: int, rdzv_id: str, is_host: bool, args: list[str], log: Path):
        # LOGLEVEL=INFO: torchrun logs each rendezvous and restart with a timestamp.
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", PYTHON=sys.executable,
                   WANDB_MODE="disabled", LOGLEVEL="INFO", NNODES="1:2", NPROC_PER_NODE="1", MAX_RESTARTS="3",
                   RDZV_ENDPOINT=f"127.0.0.1:{port}", RDZV_ID=rdzv_id,
                   RDZV_CONF=f"is_host={int(is_host)},{RDZV_CONF}", **{TAG: tag})
        self.log = log
        with open(log, "w") as out:
            self.proc = subprocess.Popen(["bash", "launch/torchrun.sh", "configs/tiny.yaml", *args], cwd=ROOT,
                                         env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    def workers(self) -> list[psutil.Process]:
        """The agent's live worker processes (torchrun starts each in its own session)."""
        try:
            children = psutil.Process(self.proc.pid).children()
        except psutil.NoSuchProcess:
            return []
        return [c for c in children if "rlt_scale.cli.train" in " ".join(c.cmdline())]

    def kill_node(self) -> None:
        """SIGKILL the agent and everything under it: the machine is gone."""
        agent = psutil.Process(self.proc.pid)
        for p in [agent, *agent.children(recursive=True)]:
            with gone():
                p.kill()
        self.proc.wait(timeout=10)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _kill_tagged(tag: str) -> list[int]:
    """SIGKILL every process whose environment carries this test's tag; returns their pids."""
    killed = []
    for p in psutil.process_iter():
        with gone():
            if p.pid != os.getpid() and p.environ().get(TAG) == tag:
                p.kill()
                killed.append(p.pid)
    return killed


@contextmanager
def two_agents(tmp_path: Path, args: list[str]):
    """Start host agent ``a`` and agent ``b``; on exit no process of theirs survives."""
    tag, port = uuid.uuid4().hex, free_port()
    agents = []
    try:
        for name, is_host in (("a", True), ("b", False)):
            agents.append(Agent(tag, port, f"elastic-{tag[:8]}", is_host, args, tmp_path / f"agent-{name}.log"))
        yield agents
    finally:
        for a in agents:
            with gone():
                os.killpg(a.proc.pid, signal.SIGKILL)
        _kill_tagged(tag)
        for a in agents:
            a.proc.wait(timeout=10)


def _wait_past_checkpoint(run_dir: Path, interval: int, deadline: float, agents) -> None:
    """Wait until a checkpoint exists and training is one to interval/2 steps past it.

    A kill then leaves logged steps to lose (and to report), and the next
    checkpoint is still steps away.
    """
    def ready():
        ckpt = _latest_step(run_dir)
        records = step_records(run_dir)
        return ckpt >= interval and bool(records) and 1 <= records[-1]["step"] - ckpt <= interval // 2

    _wait(ready, "a checkpoint and a step past it", deadline, agents)


def _first_step_after_restart(run_dir: Path) -> bool:
    records = step_records(run_dir)
    return len(records) > len(_before_restart(records))


def test_worker_killed_group_restarts_and_resumes(data, tmp_path):
    run, steps, interval = tmp_path / "run", 30, 6
    deadline = time.time() + DEADLINE_S
    with two_agents(tmp_path, _overrides(data, run, steps, interval)) as (a, b):
        _wait_past_checkpoint(run, interval, deadline, (a, b))
        victim = b.workers()
        assert len(victim) == 1, "agent b should run exactly one worker"
        victim[0].kill()
        t_kill = time.time()
        _wait(lambda: _first_step_after_restart(run), "the resumed group's first step", deadline, (a, b))
        restart_s = time.time() - t_kill
        for agent in (a, b):
            agent.proc.wait(timeout=max(1.0, deadline - time.time()))
            assert agent.proc.returncode == 0, agent.output()[-4000:]

    records = step_records(run)
    before = _before_restart(records)
    resumed_at = records[len(before)]["step"] - 1
    lost = before[-1]["step"] - resumed_at
    out = a.output() + b.output()
    assert resumed_at % interval == 0 and resumed_at >= interval
    assert lost > 0
    assert f"resumed from {run / 'checkpoints' / f'step_{resumed_at:08d}'} at step {resumed_at}; " \
           f"{lost} step(s) logged after it were lost and are redone" in out
    # Same size before and after: every step consumes MICRO x 2 samples, and the run completes.
    assert [r["consumed_samples"] for r in records] == [r["step"] * MICRO * 2 for r in records]
    assert records[-1]["step"] == steps
    meta = json.loads((run / "checkpoints" / f"step_{steps:08d}" / "meta.json").read_text())
    assert meta["world_size"] == 2
    print(f"\nworker kill: checkpoint {resumed_at}, {lost} step(s) lost, first step after the kill {restart_s:.1f} s later")


def test_node_lost_survivor_shrinks_and_continues_data_order(data, tmp_path):
    run, steps, interval = tmp_path / "run", 30, 6
    deadline = time.time() + DEADLINE_S
    with two_agents(tmp_path, _overrides(data, run, steps, interval)) as (a, b):
        _wait_past_checkpoint(run, interval, deadline, (a, b))
        b.kill_node()
        t_kill = time.time()
        _wait(lambda: _first_step_after_restart(run), "the survivor's first step", deadline, (a,))
        restart_s = time.time() - t_kill
        a.proc.wait(timeout=max(1.0, deadline - time.time()))
        assert a.proc.returncode == 0, a.output()[-4000:]

    records = step_records(run)
    before = _before_restart(records)
    after = records[len(before):]
    resumed_at = after[0]["step"] - 1
    lost = before[-1]["step"] - resumed_at
    out = a.output()
    assert lost > 0
    assert f"resumed from {run / 'checkpoints' / f'step_{resumed_at:08d}'} at step {resumed_at}" in out
    assert f"{lost} step(s) logged after it were lost and are redone" in out
    assert "resharded from tp=1 pp=1 dp=2" in out and "to tp=1 pp=1 dp=1" in out  # the reshard is reported
    # The global sample counter continues: 2 x MICRO per step before, MICRO per step after.
    assert [r["consumed_samples"] for r in before] == [r["step"] * MICRO * 2 for r in before]
    assert [r["consumed_samples"] for r in after] == [
        resumed_at * MICRO * 2 + (r["step"] - resumed_at) * MICRO for r in after]
    assert after[-1]["step"] == steps
    assert json.loads((run / "checkpoints" / f"step_{steps:08d}" / "meta.json").read_text())["world_size"] == 1

    # The survivor did exactly what a one-process run resumed from that checkpoint does:
    # same samples in the same order, hence the same losses.
    ref = tmp_path / "reference"
    (ref / "checkpoints").mkdir(parents=True)
    name = f"step_{resumed_at:08d}"
    shutil.copytree(run / "checkpoints" / name, ref / "checkpoints" / name)
    (ref / "checkpoints" / "latest").write_text(name)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "rlt_scale.cli.train", "configs/tiny.yaml",
                           *_overrides(data, ref, steps, interval)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=max(30.0, deadline - time.time()))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    reference = step_records(ref)
    assert [r["step"] for r in reference] == [r["step"] for r in after]
    assert [r["consumed_samples"] for r in reference] == [r["consumed_samples"] for r in after]
    assert [r["loss"] for r in reference] == [r["loss"] for r in after]
    print(f"\nnode loss: checkpoint {resumed_at} (dp=2, consumed {resumed_at * MICRO * 2}), {lost} step(s) lost, "
          f"survivor's first step {restart_s:.1f} s after the kill, consumed {after[0]['consumed_samples']} -> "
          f"{after[-1]['consumed_samples']} at dp=1")
