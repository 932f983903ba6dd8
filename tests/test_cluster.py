"""launch/slurm.sh on two real nodes: network namespaces node0 and node1, one slurmd each.

``launch/cluster-local-setup.sh`` builds the cluster (CI runs it before the
tests): two network namespaces on a bridge, each with its own address on a
private /24 that exists only inside this machine (10.199.42.10 and .11), its
own hostname and its own ``slurmd``, and one ``slurmctld`` reached through
``SLURM_CONF``. The namespaces share the filesystem, so the checkout, its
.venv and the run directory are at the same path on both. Processes on node0
and node1 can only talk over the veth addresses: loopback is per namespace.
Where the cluster cannot be had (no root, no ``ip netns``, no Slurm), every
test skips with the reason.

Every job is ``sbatch --nodes=2 launch/slurm.sh configs/tiny.yaml ...`` with
one process per node, the c10d rendezvous on node0 and gloo between the
nodes. Tiny float64 model on parity data, so the layout-equivalence
tolerances of tests/test_parallel_layouts.py apply (DP: 1e-10 relative, TP:
1e-5). What each test shows:

* ``test_two_nodes_match_one_process[dp2|tp2]``: DP2 and TP2 across the two
  nodes train the same losses as one process with the same global batch.
* ``test_node_loss_job_shrinks_to_survivor``: every process of node1 (its
  slurmd, the job step, the agent, the worker) is SIGKILLed mid-run; the job
  goes on at world size 1 on node0 (MIN_NODES=1), resumes from the newest
  checkpoint, reports the steps it redoes, and trains exactly what a
  one-process run resumed from that checkpoint trains.
* ``test_node_rejoins_at_next_restart``: after that shrink node1 is brought
  back (its slurmd restarted) and the same command resubmitted: the job forms
  at two nodes again, reshards dp=1 -> dp=2 and continues the global sample
  order exactly (the losses of a one-process run resumed there).
* ``test_partition_reforms_without_lost_node_and_rerun_resumes``: node1's
  link goes down mid-step (its switch port, so packets vanish silently); no
  rank outlives parallel.timeout_s plus the rendezvous timeout, node0
  re-forms alone and finishes, node1's ranks exit with errors; with the link
  back, a rerun resumes from the last checkpoint on both nodes.
* ``test_requeue_checkpoints_on_every_node_and_resumes``: ``scontrol requeue``
  of the running two-node job (Slurm preemption with requeue): both nodes'
  ranks checkpoint the same step, the job is requeued and the second run
  resumes there and finishes.

Each test has a hard deadline; every process a test started (found by a tag
in its environment, on either node) is killed and its job cancelled in a
``finally``, and the cluster is restored (node1's slurmd restarted, its link
up) after each test. When this module had to start the cluster itself, it
tears it down at the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from helpers import ROOT, step_records, tiny_run_overrides
from rlt_scale.data.prepare import prepare_task

psutil = pytest.importorskip("psutil")

pytestmark = pytest.mark.slow

SETUP = ["bash", str(ROOT / "launch" / "cluster-local-setup.sh")]
CONF = os.environ.get("CLUSTER_CONF", "/etc/slurm-rlt-cluster/slurm.conf")
JOB_DEADLINE_S = 300
"""Hard limit on each Slurm job of these tests (10-40 s on an idle machine); the job is cancelled after it."""
MICRO = 2  # micro-batch per data-parallel rank
TAG = "RLT_CLUSTER_TEST_TAG"
TIMEOUT_S = 60
"""parallel.timeout_s of the fault tests: a collective waits this long for a lost peer. Not less: the
megatron groups (DP, TP, PP) take their timeout in whole minutes, at least one (rlt_scale/distributed.py),
so a smaller value only shortens the default group's."""
# Rendezvous timing as in tests/test_elastic.py: a node whose heartbeat stops is dropped after
# 1 s x 3; a round with MIN nodes closes 10 s after they joined; an agent whose store does not
# answer gives up after read_timeout.
READ_TIMEOUT_S = 30
RDZV_CONF = ("join_timeout=90,last_call_timeout=10,close_timeout=10,keep_alive_interval=1,"
             f"keep_alive_max_attempt=3,read_timeout={READ_TIMEOUT_S}")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "PREEMPTED", "NODE_FAIL", "OUT_OF_MEMORY",
                "BOOT_FAIL", "DEADLINE"}


def gone():
    return contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied, ProcessLookupError)


def _slurm(*args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), env=dict(os.environ, SLURM_CONF=CONF), capture_output=True, text=True,
                          timeout=timeout)


def _setup(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*SETUP, *args], env=dict(os.environ, CLUSTER_CONF=CONF), capture_output=True,
                          text=True, timeout=180)


@pytest.fixture(scope="module")
def cluster():
    if os.geteuid() != 0:
        pytest.skip("the two-node cluster needs root (network namespaces, slurmd): "
                    "`sudo launch/cluster-local-setup.sh`; CI runs it")
    if shutil.which("ip") is None:
        pytest.skip("no `ip` (iproute2): cannot build network namespaces")
    if shutil.which("sbatch") is None:
        pytest.skip("Slurm is not installed (no sbatch): `sudo launch/cluster-local-setup.sh` installs it "
                    "(Debian/Ubuntu) and builds the two-node cluster; CI runs it")
    was_up = _setup("--status").returncode == 0
    setup = _setup("--no-install")
    if setup.returncode != 0:
        pytest.skip(f"the two-node cluster cannot be built here: {setup.stderr.strip()[-600:]}")
    yield
    if not was_up:
        _setup("--teardown")


@pytest.fixture
def node(cluster):
    """Per test: restore the cluster afterwards (node1's slurmd, its link) for the next test."""
    yield
    _setup("--no-install")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    prepare_task("parity", out, num_samples=512, length=8, seed=0, eval_samples=0)
    return out


def _overrides(data, run_dir: Path, steps: int, *, interval: int, micro: int = MICRO,
               timeout_s: int = TIMEOUT_S, extra: tuple[str, ...] = ()) -> list[str]:
    # float64: the layout-equivalence tolerances apply; keep every checkpoint for the references.
    return tiny_run_overrides(data, run_dir, steps, interval=interval, micro=micro, timeout_s=timeout_s) + [
        "model.params_dtype=float64", "trainer.precision=fp64", "checkpoint.keep=1000", *extra]


def _segments(records: list[dict]) -> list[list[dict]]:
    """The records split where the step counter goes back (a resume)."""
    out: list[list[dict]] = []
    for r in records:
        if not out or r["step"] <= out[-1][-1]["step"]:
            out.append([])
        out[-1].append(r)
    return out


def _latest_step(run_dir: Path) -> int:
    pointer = run_dir / "checkpoints" / "latest"
    return int(pointer.read_text().strip().removeprefix("step_")) if pointer.exists() else 0


def _rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / max(abs(y), 1e-30) for x, y in zip(a, b, strict=True))


def _job_state(job: str) -> str:
    out = _slurm("scontrol", "show", "job", job).stdout
    return next((f.split("=", 1)[1] for f in out.split() if f.startswith("JobState=")), "UNKNOWN")


def _netns_pids(ns: str) -> set[int]:
    out = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout
    return {int(p) for p in out.split()}


def _tagged(tag: str) -> list[psutil.Process]:
    procs = []
    for p in psutil.process_iter():
        with gone():
            if p.pid != os.getpid() and p.environ().get(TAG) == tag:
                procs.append(p)
    return procs


def _workers(tag: str, ns: str) -> list[psutil.Process]:
    """The job's trainer processes on node ``ns``."""
    pids = _netns_pids(ns)
    out = []
    for p in _tagged(tag):
        with gone():
            cmd = p.cmdline()
            # `python -u -m rlt_scale.cli.train ...` (not srun, not the agent, not torch's helper processes)
            if p.pid in pids and "rlt_scale.cli.train" in cmd and "torch.distributed.run" not in cmd \
                    and os.path.basename(cmd[0]).startswith("python") and p.name() != "pt_elastic":
                out.append(p)
    return out


def kill_node(ns: str) -> int:
    """SIGKILL every process of node ``ns`` (slurmd, job steps, agent, workers): the machine is dead."""
    killed = 0
    for _ in range(20):
        pids = _netns_pids(ns)
        if not pids:
            break
        for pid in pids:
            with gone():
                os.kill(pid, 9)
                killed += 1
        time.sleep(0.1)
    assert not _netns_pids(ns), f"processes survive in {ns}: {_netns_pids(ns)}"
    return killed


def _watch_down(name: str) -> threading.Thread:
    """A thread that polls Slurm until node ``name`` is DOWN; its ``t_down`` is when (None: not within 120 s)."""
    def watch():
        end = time.time() + 120
        while time.time() < end:
            if _slurm("sinfo", "--noheader", f"--node={name}", "--format=%T").stdout.strip().startswith("down"):
                thread.t_down = time.time()
                return
            time.sleep(0.5)

    thread = threading.Thread(target=watch, daemon=True)
    thread.t_down = None
    thread.start()
    return thread


def set_link(k: int, up: bool) -> None:
    """node<k>'s port on the bridge: down is a cut cable (packets vanish, no reset)."""
    subprocess.run(["ip", "link", "set", f"rltv{k}", "up" if up else "down"], check=True)


class Job:
    """``sbatch --nodes=2 launch/slurm.sh configs/tiny.yaml ...``, one process per node."""

    def __init__(self, log_root: Path, tag: str, args: list[str], env: dict | None = None,
                 sbatch: tuple[str, ...] = ()):
        log_root.mkdir(parents=True, exist_ok=True)
        env = dict(os.environ, SLURM_CONF=CONF, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore",
                   PYTHON=sys.executable, WANDB_MODE="disabled", NPROC_PER_NODE="1", LOG_ROOT=str(log_root),
                   LOGLEVEL="INFO", **{TAG: tag}, **(env or {}))
        # --open-mode=append: a requeued job's second run must not truncate what the first one wrote.
        out = subprocess.run(["sbatch", "--parsable", "--nodes=2", "--job-name=rlt-cluster",
                              f"--output={log_root}/%x-%j.out", "--open-mode=append", *sbatch, "launch/slurm.sh", "configs/tiny.yaml",
                              *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        self.id = out.stdout.strip().split(";")[0]
        self.tag = tag
        self.output = log_root / f"rlt-cluster-{self.id}.out"
        self.log_dir = log_root / f"rlt-cluster-{self.id}"
        self.deadline = time.time() + JOB_DEADLINE_S

    def state(self) -> str:
        return _job_state(self.id)

    def wait(self, states=FINAL_STATES) -> str:
        while (state := self.state()) not in states:
            self.check_time(f"job {self.id} still {state}")
            time.sleep(0.5)
        return state

    def check_time(self, what: str) -> None:
        if time.time() > self.deadline:
            raise AssertionError(f"{what} after {JOB_DEADLINE_S} s:\n{self.text()[-4000:]}")

    def until(self, condition, what: str) -> None:
        while not condition():
            state = self.state()
            if state in FINAL_STATES:
                raise AssertionError(f"waiting for {what}: job {self.id} ended ({state}):\n{self.text()[-4000:]}")
            self.check_time(f"waiting for {what}")
            time.sleep(0.1)

    def cleanup(self) -> None:
        _slurm("scancel", self.id)
        for p in _tagged(self.tag):
            with gone():
                p.kill()

    def text(self) -> str:
        return self.output.read_text(errors="replace") if self.output.exists() else "(no job output yet)"

    def rank_logs(self, node: str) -> list[Path]:
        return sorted(self.log_dir.glob(f"{node}/*/attempt_*/0/stdout.log"))


@contextlib.contextmanager
def job(log_root: Path, args: list[str], **kw):
    j = Job(log_root, uuid.uuid4().hex, args, **kw)
    try:
        yield j
    finally:
        j.cleanup()


def reference(data, tmp_path: Path, name: str, steps: int, *, micro: int, interval: int = 1000,
              start: tuple[Path, int] | None = None, deadline: float = 300) -> list[dict]:
    """One process in this (the root) namespace; ``start``: resume from a copy of that checkpoint."""
    ref = tmp_path / name
    (ref / "checkpoints").mkdir(parents=True)
    if start is not None:
        ckpt = f"step_{start[1]:08d}"
        shutil.copytree(start[0] / "checkpoints" / ckpt, ref / "checkpoints" / ckpt)
        (ref / "checkpoints" / "latest").write_text(ckpt)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, "-m", "rlt_scale.cli.train", "configs/tiny.yaml",
                           *_overrides(data, ref, steps, interval=interval, micro=micro)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=deadline)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return step_records(ref)


def _wait_past_checkpoint(j: Job, run: Path, interval: int) -> None:
    """Until a checkpoint exists and training is one to interval/2 steps past it (a fault then loses steps)."""
    def ready():
        records = step_records(run)
        ckpt = _latest_step(run)
        return ckpt >= interval and bool(records) and 1 <= records[-1]["step"] - ckpt <= interval // 2

    j.until(ready, "a checkpoint and a step past it")


# ---------------------------------------------------------------------------------------------- equality


@pytest.mark.parametrize("layout", ["dp2", "tp2"])
def test_two_nodes_match_one_process(node, data, tmp_path, layout):
    steps = 4
    run = tmp_path / "run"
    # DP2: two ranks of MICRO samples each; TP2: both ranks see the same 2 x MICRO samples.
    micro, extra, tol = {"dp2": (MICRO, (), 1e-10), "tp2": (2 * MICRO, ("parallel.tp=2",), 1e-5)}[layout]
    t0 = time.time()
    with job(tmp_path / "logs", _overrides(data, run, steps, interval=1000, micro=micro, timeout_s=60,
                                           extra=extra)) as j:
        # The one-process reference runs meanwhile, here in the root namespace.
        ref = reference(data, tmp_path, "ref", steps, micro=2 * MICRO)
        state = j.wait()
        out = j.text()
        assert state == "COMPLETED", out[-4000:]
    elapsed = time.time() - t0
    assert f"job {j.id}: 2 node(s) [node[0-1]] x 1 process(es)" in out, out[-3000:]
    assert re.search(r"rendezvous node0:\d+", out), out[-3000:]
    # one rank per node, each logged under its own node
    assert len(j.rank_logs("node0")) == 1 and len(j.rank_logs("node1")) == 1, list(j.log_dir.rglob("*"))
    records = step_records(run)
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["consumed_samples"] for r in records] == [r["consumed_samples"] for r in ref]
    assert _rel([r["loss"] for r in records], [r["loss"] for r in ref]) <= tol
    meta = json.loads((run / "checkpoints" / f"step_{steps:08d}" / "meta.json").read_text())
    assert meta["world_size"] == 2
    assert meta["layout"]["tp"] == (2 if layout == "tp2" else 1)
    print(f"\n{layout} over node0+node1: losses {[round(r['loss'], 6) for r in records]}, max rel. diff "
          f"{_rel([r['loss'] for r in records], [r['loss'] for r in ref]):.1e} to one process; {elapsed:.0f} s")


# ---------------------------------------------------------------------------------------------- node loss


class Shrunk:
    """What test_node_loss left behind: the run directory, the job's output and the timings."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


NODE_LOSS_STEPS, NODE_LOSS_INTERVAL = 24, 6


@pytest.fixture(scope="module")
def shrunk(cluster, data, tmp_path_factory):
    """A two-node job (MIN_NODES=1) that loses node1 mid-run and finishes on node0.

    Shared by the node-loss test and the rejoin test, which starts from it.
    """
    tmp = tmp_path_factory.mktemp("node-loss")
    run, steps, interval = tmp / "run", NODE_LOSS_STEPS, NODE_LOSS_INTERVAL
    try:
        with job(tmp / "logs", _overrides(data, run, steps, interval=interval),
                 env={"MIN_NODES": "1", "RDZV_CONF": RDZV_CONF}) as j:
            _wait_past_checkpoint(j, run, interval)
            survivor = _workers(j.tag, "node0")
            assert len(survivor) == 1, "one trainer process should run on node0"
            before = len(step_records(run))
            killed = kill_node("node1")
            t_kill = time.time()
            down = _watch_down("node1")
            j.until(lambda: not survivor[0].is_running(), "node0's worker to notice the dead peer")
            t_detect = time.time()
            j.until(lambda: list(j.log_dir.glob("node0/*/attempt_1")), "the re-formed worker group on node0")
            t_reform = time.time()
            j.until(lambda: len(_segments(step_records(run)[before - 1:])) > 1, "the survivor's first step")
            t_step = time.time()
            state = j.wait()
            t_end = time.time()
            # Slurm's view: node1 stops answering and is set DOWN after SlurmdTimeout.
            down.join(timeout=max(1.0, j.deadline - time.time()))
            t_down = down.t_down
            text = j.text()
    finally:
        restored = _setup("--no-install")  # node1 back: its slurmd restarted, returned to service
    yield Shrunk(run=run, job=j, state=state, text=text, killed=killed, detect_s=t_detect - t_kill,
                 reform_s=t_reform - t_kill, step_s=t_step - t_kill, end_s=t_end - t_kill,
                 down_s=None if t_down is None else t_down - t_kill, restored=restored, tmp=tmp)


def test_node_loss_job_shrinks_to_survivor(shrunk, data):
    s = shrunk
    out = s.text
    assert s.state == "COMPLETED", out[-4000:]
    records = step_records(s.run)
    before, after = _segments(records)
    resumed_at = after[0]["step"] - 1
    lost = before[-1]["step"] - resumed_at
    assert resumed_at % NODE_LOSS_INTERVAL == 0 and resumed_at >= NODE_LOSS_INTERVAL and lost > 0
    assert f"resumed from {s.run / 'checkpoints' / f'step_{resumed_at:08d}'} at step {resumed_at}; " \
           f"{lost} step(s) logged after it were lost and are redone" in out, out[-4000:]
    assert "resharded from tp=1 pp=1 dp=2" in out and "to tp=1 pp=1 dp=1" in out
    # The global sample counter continues: 2 x MICRO per step at two nodes, MICRO per step on node0 alone.
    assert [r["consumed_samples"] for r in before] == [r["step"] * MICRO * 2 for r in before]
    assert [r["consumed_samples"] for r in after] == [
        resumed_at * MICRO * 2 + (r["step"] - resumed_at) * MICRO for r in after]
    assert after[-1]["step"] == NODE_LOSS_STEPS
    meta = json.loads((s.run / "checkpoints" / f"step_{NODE_LOSS_STEPS:08d}" / "meta.json").read_text())
    assert meta["world_size"] == 1
    # node0 alone trained exactly what one process resumed from that checkpoint trains.
    ref = reference(data, s.tmp, "ref", NODE_LOSS_STEPS, micro=MICRO, start=(s.run, resumed_at))
    assert [r["step"] for r in ref] == [r["step"] for r in after]
    assert [r["consumed_samples"] for r in ref] == [r["consumed_samples"] for r in after]
    assert [r["loss"] for r in ref] == [r["loss"] for r in after]
    assert s.down_s is not None, "slurmctld never set the dead node1 DOWN"
    print(f"\nnode loss: {s.killed} processes of node1 killed {before[-1]['step'] - resumed_at} step(s) after the "
          f"step-{resumed_at} checkpoint; node0's worker failed {s.detect_s:.1f} s later, the agents re-formed at "
          f"world size 1 after {s.reform_s:.1f} s, first step after {s.step_s:.1f} s, job {s.state} after "
          f"{s.end_s:.1f} s; Slurm set node1 DOWN after {s.down_s:.1f} s")


def test_node_rejoins_at_next_restart(shrunk, node, data, tmp_path):
    """node1 back (the setup script restarted its slurmd): the resubmitted job grows to two nodes."""
    run, start, steps = shrunk.run, NODE_LOSS_STEPS, NODE_LOSS_STEPS + 4
    assert shrunk.restored.returncode == 0, f"node1 did not come back: {shrunk.restored.stderr[-2000:]}"
    done = len(step_records(run))
    t0 = time.time()
    with job(tmp_path / "logs", _overrides(data, run, steps, interval=NODE_LOSS_INTERVAL),
             env={"MIN_NODES": "1", "RDZV_CONF": RDZV_CONF}) as j:
        ref = reference(data, tmp_path, "ref", steps, micro=2 * MICRO, start=(run, start))
        state = j.wait()
        out = j.text()
    elapsed = time.time() - t0
    assert state == "COMPLETED", out[-4000:]
    assert f"job {j.id}: 2 node(s) [node[0-1]]" in out
    assert f"resumed from {run / 'checkpoints' / f'step_{start:08d}'} at step {start}" in out
    assert "resharded from tp=1 pp=1 dp=1" in out and "to tp=1 pp=1 dp=2" in out
    after = step_records(run)[done:]
    assert [r["step"] for r in after] == list(range(start + 1, steps + 1))
    # consumed samples continue from the dp=1 checkpoint at 2 x MICRO per step
    start_samples = json.loads((run / "checkpoints" / f"step_{start:08d}" / "meta.json").read_text())[
        "state"]["data"]["consumed_samples"]
    assert [r["consumed_samples"] for r in after] == [start_samples + (r["step"] - start) * 2 * MICRO
                                                      for r in after]
    assert [r["consumed_samples"] for r in ref] == [r["consumed_samples"] for r in after]
    assert _rel([r["loss"] for r in after], [r["loss"] for r in ref]) <= 1e-10
    assert json.loads((run / "checkpoints" / f"step_{steps:08d}" / "meta.json").read_text())["world_size"] == 2
    print(f"\nrejoin: resubmitted job formed at 2 nodes, resumed dp=1 -> dp=2 at step {start} "
          f"(consumed {start_samples}); {elapsed:.0f} s")


# ---------------------------------------------------------------------------------------------- partition


def test_partition_reforms_without_lost_node_and_rerun_resumes(node, data, tmp_path):
    run, steps, interval = tmp_path / "run", 24, 6
    bound = TIMEOUT_S + READ_TIMEOUT_S + 20  # parallel.timeout_s + rendezvous timeout + slack
    with job(tmp_path / "logs", _overrides(data, run, steps, interval=interval),
             env={"MIN_NODES": "1", "RDZV_CONF": RDZV_CONF}) as j:
        _wait_past_checkpoint(j, run, interval)
        w0 = _workers(j.tag, "node0")
        assert len(w0) == 1 and len(_workers(j.tag, "node1")) == 1
        node1_procs = [p for p in _tagged(j.tag) if p.pid in _netns_pids("node1")]  # agent and worker
        set_link(1, up=False)
        t_cut = time.time()
        j.until(lambda: not w0[0].is_running(), "node0's worker to give up on node1")
        t_detect = time.time()
        while any(p.is_running() for p in node1_procs) and time.time() - t_cut < bound:
            time.sleep(0.2)
        node1_exit_s = time.time() - t_cut
        left = [p for p in node1_procs if p.is_running()]
        assert not left, f"node1's processes {left} still run {node1_exit_s:.0f} s after the cut"
        j.until(lambda: len(_segments(step_records(run))) > 1, "node0's first step alone")
        t_step = time.time()
        state = j.wait()
        out = j.text()
        node0_err = "\n".join(p.with_name("stderr.log").read_text(errors="replace")
                              for p in j.rank_logs("node0") if "attempt_0" in str(p))
    set_link(1, up=True)
    assert state == "COMPLETED", out[-4000:]
    # node0's rank failed on the lost peer: TCP gave up on data node1 never acknowledged (gloo names
    # node1's address), or, when node0 was only waiting to receive, after parallel.timeout_s.
    named = "10.199.42.11" in node0_err
    assert named or f"Timed out waiting {TIMEOUT_S * 1000}ms" in node0_err, node0_err[-3000:]
    segs = _segments(step_records(run))
    assert len(segs) == 2, segs
    resumed_at = segs[1][0]["step"] - 1
    lost = segs[0][-1]["step"] - resumed_at
    assert 0 < lost <= interval
    assert f"resumed from {run / 'checkpoints' / f'step_{resumed_at:08d}'} at step {resumed_at}; " \
           f"{lost} step(s) logged after it were lost and are redone" in out
    assert "to tp=1 pp=1 dp=1" in out
    assert segs[1][-1]["step"] == steps

    # The link back, the same command again on both nodes: resumes at the last checkpoint, nothing lost.
    assert _setup("--no-install").returncode == 0
    done = len(step_records(run))
    with job(tmp_path / "logs", _overrides(data, run, steps + 2, interval=interval),
             env={"MIN_NODES": "1", "RDZV_CONF": RDZV_CONF}) as again:
        state = again.wait()
        out = again.text()
    assert state == "COMPLETED", out[-4000:]
    assert f"job {again.id}: 2 node(s) [node[0-1]]" in out
    assert f"resumed from {run / 'checkpoints' / f'step_{steps:08d}'} at step {steps}" in out
    assert [r["step"] for r in step_records(run)[done:]] == [steps + 1, steps + 2]
    print(f"\npartition: node1's link cut {lost} step(s) after the step-{resumed_at} checkpoint; node0's worker "
          f"failed after {t_detect - t_cut:.1f} s ({'naming node1' if named else 'gloo timeout'}), every process "
          f"of the job on node1 had exited after {node1_exit_s:.1f} s (bound {bound} s), node0's first step alone after {t_step - t_cut:.1f} s")


# ---------------------------------------------------------------------------------------------- preemption


def test_requeue_checkpoints_on_every_node_and_resumes(node, data, tmp_path):
    # Enough steps after the requeue (at step 3) for Slurm's SIGTERM to arrive before the job ends on its own:
    # with 12 a CI run under load finished all of them first (a step of this config is ~0.2 s on a fast CPU).
    run, steps = tmp_path / "run", 100
    with job(tmp_path / "logs", _overrides(data, run, steps, interval=1000)) as j:
        j.until(lambda: len(step_records(run)) >= 3, "three steps")
        assert _slurm("scontrol", "requeue", j.id).returncode == 0
        t_requeue = time.time()
        # Rank 0's own log, not the job's output: torchrun's tee may stop copying the worker's last
        # lines to the output once the agent is shutting down (seen under load in CI).
        j.until(lambda: _latest_step(run) > 0 and any("SIGTERM received" in p.read_text(errors="replace")
                                                       for p in j.rank_logs("node0")), "the checkpoint")
        t_ckpt = time.time()
        # Restarts=1 as soon as Slurm has requeued it (the PENDING spell can be too short to see).
        j.until(lambda: "Restarts=1" in _slurm("scontrol", "show", "job", j.id).stdout, "the job to be requeued")
        stopped_at = _latest_step(run)
        # the first run's records (the second run may have started logging already); a redone step
        # would show up twice in the full list checked below
        n_stop = sum(r["step"] <= stopped_at for r in step_records(run))
        t_stop = time.time()
        # Slurm usually holds a requeued batch job back for about two minutes (Reason=BeginTime); release it
        # as soon as it is PENDING (it passes through COMPLETING and REQUEUED first).
        j.until(lambda: _job_state(j.id) in {"PENDING", "RUNNING"}, "the requeued job to be pending")
        begin = re.search(r"StartTime=(\S+)", _slurm("scontrol", "show", "job", j.id).stdout)
        if _job_state(j.id) == "PENDING":
            assert _slurm("scontrol", "update", f"JobId={j.id}", "StartTime=now").returncode == 0
        j.until(lambda: len(step_records(run)) > n_stop, "the requeued job's first step")
        t_step = time.time()
        state = j.wait()
        out = j.text()
        info = _slurm("scontrol", "show", "job", j.id).stdout
        rank0_log = "\n".join(p.read_text(errors="replace") for p in j.rank_logs("node0"))
    assert state == "COMPLETED", out[-4000:]
    assert "Restarts=1" in info, info
    # Both agents got the signal and passed it on; rank 0 (node0) reports the checkpoint ...
    assert out.count("Received 15 death signal, shutting down workers") >= 2, out[-4000:]
    assert f"SIGTERM received: checkpointing at step {stopped_at} and exiting" in rank0_log, rank0_log[-3000:]
    # ... which both ranks wrote, each its own shard: node1's rank was alive and checkpointed too.
    meta = json.loads((run / "checkpoints" / f"step_{stopped_at:08d}" / "meta.json").read_text())
    assert {"__0_0.distcp", "__1_0.distcp"} <= set(meta["files"]) and meta["world_size"] == 2, meta["files"]
    records = step_records(run)
    assert records[n_stop - 1]["step"] == stopped_at  # the last step logged was checkpointed: nothing to redo
    assert f"resumed from {run / 'checkpoints' / f'step_{stopped_at:08d}'} at step {stopped_at}\n" in out
    assert [r["step"] for r in records] == list(range(1, steps + 1))
    assert [r["consumed_samples"] for r in step_records(run)] == [r["step"] * 2 * MICRO for r in step_records(run)]
    assert json.loads((run / "checkpoints" / f"step_{steps:08d}" / "meta.json").read_text())["world_size"] == 2
    print(f"\nrequeue: both nodes checkpointed step {stopped_at} {t_ckpt - t_requeue:.1f} s after `scontrol requeue`, "
          f"the job left RUNNING after {t_stop - t_requeue:.1f} s, the requeued job's first step "
          f"{t_step - t_requeue:.1f} s after the requeue (released at once; Slurm's own StartTime was "
          f"{begin.group(1) if begin else '?'})")
