"""Checkpoint safety in one process: refusing another model's checkpoint, naming corrupt files,
never running pickled code, and the safetensors export used by rlt-generate."""

from __future__ import annotations

import json
import os
import pickle

import pytest
import torch

from helpers import tiny_overrides
from rlt_scale.config import load_config
from rlt_scale.errors import CheckpointError, ConfigError
from rlt_scale.export import load_export, main as export_main
from rlt_scale.cli.generate import load_for_inference, main as generate_main
from rlt_scale.cli.train import main as train_main
from rlt_scale.training.checkpoint import CheckpointManager
from rlt_scale.training.trainer import Trainer


def _overrides(data, run_dir, **extra):
    return tiny_overrides(data, run_dir, **{"checkpoint.interval": 2, "checkpoint.keep": 3, **extra})


@pytest.fixture(scope="module")
def trained(parity_data, tmp_path_factory, ctx):
    """A run with checkpoints at steps 2 and 4, and its final trainer."""
    run = tmp_path_factory.mktemp("trained") / "run"
    trainer = Trainer(load_config(None, _overrides(parity_data, run)), ctx)
    trainer.fit()
    return run, trainer


def _copy_run(run, tmp_path):
    import shutil

    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


def test_layout_and_state_are_recorded(trained):
    run, _ = trained
    meta = json.loads((run / "checkpoints" / "step_00000004" / "meta.json").read_text())
    assert meta["format_version"] == 2 and meta["step"] == 4
    assert meta["layout"] == {"tp": 1, "pp": 1, "dp": 1, "zero_stage": 0}
    assert meta["consumed_samples"] == meta["state"]["data"]["consumed_samples"] == 16
    assert meta["state"]["lr_schedule"] == {"step_count": 4}
    assert meta["config"]["model"]["d_model"] == 16


def test_another_model_config_is_refused_with_a_diff(trained, parity_data, tmp_path, ctx, capsys):
    run = _copy_run(trained[0], tmp_path)
    cfg = load_config(None, _overrides(parity_data, run, **{"model.d_model": 32, "model.window": 5}))
    with pytest.raises(ConfigError) as err:
        Trainer(cfg, ctx).maybe_resume()
    assert "model.d_model: checkpoint 16, run 32" in str(err.value)
    assert "model.window: checkpoint 4, run 5" in str(err.value)
    # and rlt-train reports it as a configuration error
    assert train_main(["configs/tiny.yaml"] + _overrides(parity_data, run, **{"model.d_model": 32})) == 2
    assert "model.d_model: checkpoint 16, run 32" in capsys.readouterr().err


def test_a_checkpoint_resumes_under_another_way_of_running_the_decoder(trained, parity_data, tmp_path, ctx):
    """decoder_step, decoder_compile, the weight-gradient block and the solver choose how the decoder is
    computed, not what the model is: a run may switch them and resume; a real difference is still refused."""
    run = _copy_run(trained[0], tmp_path)
    how = {"model.decoder_step": "fused", "model.decoder_wgrad_block": 3, "model.decoder_solver": "jacobi"}
    trainer = Trainer(load_config(None, _overrides(parity_data, run, **how)), ctx)
    trainer.maybe_resume()
    assert trainer.step == 4
    with pytest.raises(ConfigError, match="model.window: checkpoint 4, run 5"):
        Trainer(load_config(None, _overrides(parity_data, run, **how, **{"model.window": 5})), ctx).maybe_resume()


def _state_file(run, step=4):
    return sorted((run / "checkpoints" / f"step_{step:08d}" / "state").glob("*.distcp"))[0]


def _load(run, trainer):
    manager = CheckpointManager(run)
    return manager.load(manager.latest(), trainer.stateful())


def test_truncated_shard_is_named(trained, tmp_path):
    run = _copy_run(trained[0], tmp_path)
    shard = _state_file(run)
    shard.write_bytes(shard.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=f"{shard.name} is truncated"):
        _load(run, trained[1])


def test_garbled_shard_is_named(trained, tmp_path):
    run = _copy_run(trained[0], tmp_path)
    shard = _state_file(run)
    data = bytearray(shard.read_bytes())
    data[: len(data) // 2] = os.urandom(len(data) // 2)  # same size, garbage
    shard.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=f"{shard.name} is corrupt"):
        _load(run, trained[1])


def test_broken_latest_falls_back_or_names_the_older_complete_checkpoint(trained, tmp_path, capsys):
    run = _copy_run(trained[0], tmp_path)
    (run / "checkpoints" / "step_00000004" / "meta.json").unlink()
    assert CheckpointManager(run).latest().name == "step_00000002"  # on_corrupt=fallback, the default
    assert "skipping step_00000004" in capsys.readouterr().out
    with pytest.raises(CheckpointError, match="newest older complete checkpoint is step_00000002"):
        CheckpointManager(run, on_corrupt="refuse").latest()
    (run / "checkpoints" / "step_00000002" / "meta.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="step_00000002/meta.json is corrupt"):
        CheckpointManager(run).read_meta(run / "checkpoints" / "step_00000002")


class _Exploit:
    """A pickle that would run a shell command when unpickled by plain ``pickle.load``."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_checkpoint_index_cannot_run_code(trained, tmp_path):
    run = _copy_run(trained[0], tmp_path)
    marker = tmp_path / "pwned"
    index = run / "checkpoints" / "step_00000004" / "state" / ".metadata"
    index.write_bytes(pickle.dumps(_Exploit(marker)))
    with pytest.raises(CheckpointError, match="refusing to load global posix.system"):
        _load(run, trained[1])
    assert not marker.exists()


def test_export_is_one_safetensors_file_that_generate_reads(trained, tmp_path, capsys):
    run, trainer = trained
    out = tmp_path / "export"
    assert export_main([str(run), "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.yaml", "model.safetensors"]
    model, cfg = load_export(out)
    assert cfg.model.d_model == 16
    trained_params = dict(trainer.model.named_parameters())
    for name, param in model.named_parameters():
        assert torch.equal(param, trained_params[name]), name
    # the run directory (the sharded checkpoint, resharded to one process) gives the same model
    from_run, _ = load_for_inference(str(run))
    assert all(torch.equal(a, b) for a, b in zip(from_run.parameters(), model.parameters()))
    capsys.readouterr()
    assert generate_main([str(out), "--prompt", "01", "--max-new-tokens", "4", "--json", "--tokenizer", "byte"]) == 0
    sample = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 1 <= len(sample["tokens"]) <= 4
