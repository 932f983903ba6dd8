"""Checkpoints never lose work (issue #11, items 1-6 and 12).

One process, a tiny model on parity data. Each test damages a run directory
the way a user, a disk or another run would, and checks that the next start
resumes from the newest intact checkpoint (saying so), refuses with an error
that names the file and the way out, or overwrites nothing it did not write.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from helpers import tiny_overrides
from rlt_scale.config import load_config
from rlt_scale.errors import CheckpointError
from rlt_scale.cli.train import main as train_main
from rlt_scale.training.checkpoint import CheckpointManager
from rlt_scale.training.checkpoint_files import file_digest
from rlt_scale.training.trainer import Trainer


def _overrides(data, run_dir, **extra) -> list[str]:
    return tiny_overrides(data, run_dir, **{"trainer.max_steps": 6, "checkpoint.interval": 2, "checkpoint.keep": 3,
                                            **extra})


def _trainer(data, run_dir, ctx, **extra) -> Trainer:
    return Trainer(load_config(None, _overrides(data, run_dir, **extra)), ctx)


@pytest.fixture(scope="module")
def six_steps(parity_data, tmp_path_factory, ctx):
    """A run with checkpoints at steps 2, 4 and 6."""
    run = tmp_path_factory.mktemp("six") / "run"
    _trainer(parity_data, run, ctx).fit()
    return run


def _copy(run: Path, tmp_path: Path) -> Path:
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def _ckpt(run: Path, step: int) -> Path:
    return run / "checkpoints" / f"step_{step:08d}"


def _fingerprint(path: Path) -> dict[str, str]:
    return {str(f.relative_to(path)): file_digest(f) for f in sorted(path.rglob("*")) if f.is_file()}


def _params(model) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


# ------------------------------------------------------------------ 1. the pointer
@pytest.mark.parametrize("damage", ["deleted", "garbage", "names_missing_dir"])
def test_lost_latest_pointer_resumes_from_newest_checkpoint_found_by_scanning(
        six_steps, parity_data, tmp_path, ctx, capsys, damage):
    run = _copy(six_steps, tmp_path)
    pointer = run / "checkpoints" / "latest"
    if damage == "deleted":
        pointer.unlink()
    elif damage == "garbage":
        pointer.write_bytes(b"\xff\xfe\x00junk")
    else:
        pointer.write_text("step_00000042")
    before = {step: _fingerprint(_ckpt(run, step)) for step in (2, 4, 6)}
    trainer = _trainer(parity_data, run, ctx, **{"trainer.max_steps": 7})
    trainer.maybe_resume()
    out = capsys.readouterr().out
    assert trainer.step == 6
    assert "found 3 checkpoint(s)" in out and "by scanning" in out
    assert f"resumed from {_ckpt(run, 6)} at step 6" in out
    assert {step: _fingerprint(_ckpt(run, step)) for step in (2, 4, 6)} == before  # nothing rewritten


# ------------------------------------------------------------------ 2. another run's directory
def test_fresh_start_in_a_directory_with_checkpoints_is_refused(six_steps, parity_data, tmp_path, ctx, capsys):
    run = _copy(six_steps, tmp_path)
    before = _fingerprint(run / "checkpoints")
    with pytest.raises(CheckpointError) as err:
        _trainer(parity_data, run, ctx, **{"checkpoint.resume": False}).fit()
    message = str(err.value)
    assert str(run / "checkpoints") in message and "checkpoint.dir" in message and "checkpoint.move_aside" in message
    assert _fingerprint(run / "checkpoints") == before
    # and through the CLI: one line, exit status 2
    assert train_main(["configs/tiny.yaml"] + _overrides(parity_data, run, **{"checkpoint.resume": False})) == 2
    assert "checkpoint.move_aside" in capsys.readouterr().err
    assert _fingerprint(run / "checkpoints") == before


def test_move_aside_keeps_the_old_run_and_the_new_run_keeps_its_saves(six_steps, parity_data, tmp_path, ctx):
    run = _copy(six_steps, tmp_path)
    before = _fingerprint(run / "checkpoints")
    _trainer(parity_data, run, ctx, **{"checkpoint.resume": False, "checkpoint.move_aside": True,
                                       "trainer.max_steps": 4}).fit()
    (aside,) = (run / "previous").iterdir()
    assert _fingerprint(aside / "checkpoints") == before  # the old run, untouched
    manager = CheckpointManager(run)
    assert [p.name for p in manager.complete()] == ["step_00000002", "step_00000004"]
    assert manager.latest().name == "step_00000004"
    run_ids = {manager.read_meta(p)["run_id"] for p in manager.complete()}
    assert len(run_ids) == 1 and run_ids != {manager.read_meta(_ckpt(aside, 6))["run_id"]}


def test_pruning_only_removes_older_checkpoints_of_the_same_run(six_steps, parity_data, tmp_path, ctx):
    run = _copy(six_steps, tmp_path)
    foreign_meta = json.loads((_ckpt(run, 6) / "meta.json").read_text())
    trainer = _trainer(parity_data, run, ctx, **{"trainer.max_steps": 10, "checkpoint.keep": 2})
    trainer.maybe_resume()
    assert trainer.step == 6
    # plant another run's checkpoints: one newer than ours, one at a step we will save
    for step in (8, 12):
        shutil.copytree(_ckpt(run, 6), _ckpt(run, step))
        (_ckpt(run, step) / "meta.json").write_text(json.dumps({**foreign_meta, "step": step, "run_id": "other"}))
    planted = {step: _fingerprint(_ckpt(run, step)) for step in (8, 12)}
    trainer.fit()
    manager = CheckpointManager(run)
    names = sorted(p.name for p in (run / "checkpoints").iterdir())
    assert _fingerprint(_ckpt(run, 12)) == planted[12]  # newer, another run's: never pruned
    (superseded,) = [n for n in names if n.startswith("step_00000008.superseded-")]
    assert _fingerprint(run / "checkpoints" / superseded) == planted[8]  # not overwritten: set aside
    ours = [p.name for p in manager.complete() if manager.read_meta(p).get("run_id") == trainer.checkpoints.run_id]
    assert ours == ["step_00000008", "step_00000010"]  # keep=2 of this run
    assert manager.latest().name == "step_00000010"


# ------------------------------------------------------------------ 3. a garbled payload
def _garble_middle(file: Path, nbytes: int = 4096) -> None:
    data = bytearray(file.read_bytes())
    mid = len(data) // 2 - nbytes // 2
    assert mid >= 0, f"{file} is smaller than {nbytes} bytes"
    for i in range(mid, mid + nbytes):
        data[i] ^= 0x5A
    file.write_bytes(bytes(data))


def _largest_shard(path: Path) -> Path:
    return max((path / "state").glob("*.distcp"), key=lambda f: f.stat().st_size)


def test_garbled_payload_is_caught_by_its_checksum_and_resume_falls_back(six_steps, parity_data, tmp_path, ctx,
                                                                        capsys):
    run = _copy(six_steps, tmp_path)
    shard = _largest_shard(_ckpt(run, 6))
    size = shard.stat().st_size
    _garble_middle(shard)
    assert shard.stat().st_size == size

    refused = _trainer(parity_data, run, ctx, **{"checkpoint.on_corrupt": "refuse"})
    with pytest.raises(CheckpointError, match=f"{shard.name} is corrupt: its content checksum"):
        refused.maybe_resume()

    fallen = _trainer(parity_data, run, ctx, **{"trainer.max_steps": 6})
    fallen.maybe_resume()
    out = capsys.readouterr().out
    assert fallen.step == 4
    assert f"cannot resume from step_00000006: {shard}" in out and "falling back to step_00000004" in out
    clean = _trainer(parity_data, _copy(six_steps, tmp_path / "clean"), ctx)
    clean.checkpoints.load(_ckpt(clean.run_dir, 4), clean.stateful())
    a, b = _params(fallen.model), _params(clean.model)
    assert all(torch.equal(a[k], b[k]) for k in a)  # the fallback is the intact step 4, bit for bit


def test_every_checkpoint_corrupt_refuses_instead_of_starting_afresh(six_steps, parity_data, tmp_path, ctx):
    run = _copy(six_steps, tmp_path)
    for step in (2, 4, 6):
        _garble_middle(_largest_shard(_ckpt(run, step)), nbytes=512)
    with pytest.raises(CheckpointError, match="no checkpoint in .* can be loaded") as err:
        _trainer(parity_data, run, ctx).maybe_resume()
    assert all(f"step_0000000{s}: " in str(err.value) for s in (2, 4, 6))


# ------------------------------------------------------------------ 4. meta.json's step
def test_meta_step_that_disagrees_with_its_directory_is_refused(six_steps, tmp_path):
    run = _copy(six_steps, tmp_path)
    meta_file = _ckpt(run, 6) / "meta.json"
    meta_file.write_text(json.dumps({**json.loads(meta_file.read_text()), "step": 5}))
    with pytest.raises(CheckpointError, match="records step 5 in the directory of step 6"):
        CheckpointManager(run).read_meta(_ckpt(run, 6))
    assert CheckpointManager(run).latest().name == "step_00000004"  # and resume falls back past it


# ------------------------------------------------------------------ 5. a full disk
@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (needs root, as on the development machines and in CI)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs to fill (needs root): {done.stderr.strip()}")
    yield mount
    subprocess.run(["umount", "-l", str(mount)], check=False)


def _fill(directory: Path) -> None:
    with open(directory / "filler", "wb") as f:
        try:
            while True:
                f.write(b"\0" * 65536)
                f.flush()
        except OSError:
            pass


def test_full_disk_says_so_and_the_previous_checkpoint_stays_loadable(parity_data, small_disk, ctx):
    run = small_disk / "run"
    trainer = _trainer(parity_data, run, ctx, **{"trainer.max_steps": 2})
    trainer.fit()
    _fill(small_disk)
    trainer.step = 4
    with pytest.raises(CheckpointError) as err:
        trainer.save()
    assert str(err.value) == (f"no space left on device while saving step 4 to {run / 'checkpoints'}; "
                              f"the previous checkpoint (step_00000002) is intact")
    assert not (run / "checkpoints" / "step_00000004.tmp").exists()  # the partial copy is gone
    manager = CheckpointManager(run)
    assert manager.latest().name == "step_00000002"
    manager.load(manager.latest(), trainer.stateful())


# ------------------------------------------------------------------ 6. torch's advice is never repeated
def test_garbled_header_of_an_unchecksummed_checkpoint_is_called_corrupt(six_steps, parity_data, tmp_path, ctx):
    run = _copy(six_steps, tmp_path)
    meta_file = _ckpt(run, 6) / "meta.json"
    meta = json.loads(meta_file.read_text())
    del meta["files"]  # as written before checksums were recorded
    meta_file.write_text(json.dumps(meta))
    shard = _largest_shard(_ckpt(run, 6))
    data = bytearray(shard.read_bytes())
    data[:64] = os.urandom(64)  # the zip header of the first tensor
    shard.write_bytes(bytes(data))
    trainer = _trainer(parity_data, run, ctx)
    with pytest.raises(CheckpointError) as err:
        CheckpointManager(run).load(_ckpt(run, 6), trainer.stateful())
    assert f"{shard} is corrupt" in str(err.value)
    assert "weights_only" not in str(err.value)


# ------------------------------------------------------------------ 12. nothing left to do
def test_rerun_of_a_complete_run_says_so_and_saves_nothing(six_steps, parity_data, tmp_path, ctx, capsys):
    run = _copy(six_steps, tmp_path)
    before = _fingerprint(run / "checkpoints")
    assert train_main(["configs/tiny.yaml"] + _overrides(parity_data, run)) == 0
    out = capsys.readouterr().out
    assert "nothing to do: the run is already complete at step 6 (trainer.max_steps=6)" in out
    assert "checkpoint.move_aside=true" in out and "loss start/end" not in out
    assert _fingerprint(run / "checkpoints") == before
