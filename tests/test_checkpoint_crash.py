"""A crash at any point of a multi-process save leaves the previous checkpoint as ``latest``.

Real torchrun jobs (DP2, gloo) and the test-only fault hook
``RLT_CHECKPOINT_FAULT`` (rlt_scale/training/checkpoint.py), which makes one
rank ``os._exit(1)`` at a chosen point of the save of step 4:

* ``during_shards`` -- the last rank dies before writing its shards while
  rank 0 is inside the collective save (rank 0 then fails the save with a
  message that the previous checkpoint is intact, and removes the partial copy);
* ``after_shards`` -- rank 0 dies after every shard is written, before
  ``meta.json``;
* ``before_pointer`` -- rank 0 dies after publishing ``step_00000004``, before
  updating ``latest``.

Then: ``latest`` still names step 2 and loads; rerunning the same command
reports any leftover ``.tmp`` directory, resumes from step 2, and redoes
steps 3 and 4 with bit-identical losses (same layout: exact resume).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from helpers import layout_overrides, torchrun
from rlt_scale.training.checkpoint import FAULT_ENV, CheckpointManager

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(layout_data):
    return layout_data


def _run(run_dir: Path, data: Path, steps: int, fault: str | None = None):
    args = [str(run_dir.parent / "out.pt")] + layout_overrides(
        data, run_dir, 2, "float64", [f"trainer.max_steps={steps}", "checkpoint.interval=2", "trainer.log_interval=1"])
    return torchrun("tests/workers/checkpoint_run.py", 2, args, timeout=300,
                    env={FAULT_ENV: fault} if fault else None, check=fault is None)


@pytest.fixture(scope="module")
def at_step_2(tmp_path_factory, data):
    """A run directory holding a complete step-2 checkpoint."""
    run_dir = tmp_path_factory.mktemp("base") / "run"
    _run(run_dir, data, 2)
    return run_dir


def _losses(run_dir: Path) -> dict[int, list[float]]:
    by_step: dict[int, list[float]] = {}
    for record in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()):
        if "loss" in record:
            by_step.setdefault(record["step"], []).append(record["loss"])
    return by_step


@pytest.mark.parametrize("fault", ["during_shards", "after_shards", "before_pointer"])
def test_crash_during_save_keeps_previous_checkpoint(tmp_path, data, at_step_2, fault):
    run_dir = tmp_path / "run"
    shutil.copytree(at_step_2, run_dir)
    crashed = _run(run_dir, data, 4, fault)
    assert crashed.returncode != 0
    assert f"{FAULT_ENV}={fault}" in crashed.stdout + crashed.stderr  # it died where we asked

    manager = CheckpointManager(run_dir)
    assert manager.latest().name == "step_00000002"  # the previous checkpoint is still the one
    if fault == "before_pointer":
        assert (run_dir / "checkpoints" / "step_00000004" / "meta.json").exists()
    elif fault == "during_shards":
        # rank 0 survives the collective's failure: it says so and removes its partial copy
        assert "saving step 4 to" in crashed.stderr and "previous checkpoint (step_00000002) is intact" in crashed.stderr
        assert manager.incomplete() == []
    else:
        assert [p.name for p in manager.incomplete()] == ["step_00000004.tmp"]

    rerun = _run(run_dir, data, 4)
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000002'} at step 2" in rerun.stdout
    if fault == "after_shards":
        assert "ignoring incomplete checkpoint" in rerun.stdout
    assert manager.latest().name == "step_00000004"
    losses = _losses(run_dir)  # steps 3 and 4 were logged by the crashed run and by the rerun
    assert len(losses[3]) == len(losses[4]) == 2
    assert losses[3][0] == losses[3][1] and losses[4][0] == losses[4][1]
