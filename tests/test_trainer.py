"""The trainer end to end on a tiny prepared dataset: logging, checkpoints,
bit-exact resume, generation from the checkpoint, and the CLI."""

from __future__ import annotations

import json

import pytest
import torch

from helpers import tiny_overrides
from rlt_scale.config import load_config
from rlt_scale.cli.generate import load_for_inference, main as generate_main
from rlt_scale.cli.train import main as train_main
from rlt_scale.training.checkpoint import CheckpointManager
from rlt_scale.training.trainer import Trainer


def _config(data, run_dir, **extra):
    return load_config(None, tiny_overrides(data, run_dir, **{
        "data.eval_path": f"{data}/eval", "trainer.grad_accum_steps": 2, "trainer.chunk_size": 4,
        "trainer.activation_checkpointing": "chunk", "trainer.eval_interval": 2, "trainer.eval_batches": 2,
        "optimizer.warmup_steps": 2, "checkpoint.interval": 2, **extra}))


def _params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items() if isinstance(v, torch.Tensor)}


def test_resume_continues_bit_for_bit(parity_data, tmp_path, ctx):
    straight = Trainer(_config(parity_data, tmp_path / "a", **{"trainer.max_steps": 4}), ctx)
    full = straight.fit()

    first = Trainer(_config(parity_data, tmp_path / "b", **{"trainer.max_steps": 2}), ctx)
    first.fit()
    resumed = Trainer(_config(parity_data, tmp_path / "b", **{"trainer.max_steps": 4}), ctx)
    rest = resumed.fit()

    assert rest.losses == full.losses[2:]  # exact float equality, not a tolerance
    a, b = _params(straight.model), _params(resumed.model)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert resumed.loader.state_dict()["consumed_samples"] == straight.loader.state_dict()["consumed_samples"] == 32

    records = [json.loads(line) for line in (tmp_path / "a" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4]
    assert {"loss", "lr", "grad_norm", "tokens_per_s", "consumed_samples"} <= steps[0].keys()
    assert any("eval_loss" in r for r in records)


def test_added_state_is_checkpointed_and_a_layout_bound_part_refuses_another_layout(parity_data, tmp_path, ctx):
    """``checkpoint_also``: an early stopper's counters and kept weights come back on resume; a checkpoint
    that claims another layout is refused by name rather than resumed without the per-rank weights."""
    from rlt_scale.errors import CheckpointError
    from rlt_scale.experiments.early_stopping import EarlyStopper

    def trainer(max_steps: int, stopper: EarlyStopper) -> Trainer:
        t = Trainer(_config(parity_data, tmp_path / "run", **{"trainer.max_steps": max_steps}), ctx,
                    callbacks=[stopper.callback()])
        t.checkpoint_also(stopper.checkpointed(t.model, t.ctx.rank))
        return t

    saved = EarlyStopper(target=2.0, patience=0)
    trainer(4, saved).fit()
    assert len(saved.history) == 2  # evaluations at steps 2 and 4
    restored = EarlyStopper(target=2.0, patience=0)
    trainer(4, restored).maybe_resume()
    assert restored.state_dict() == saved.state_dict()
    assert all(torch.equal(restored.best_state[k], v) for k, v in saved.best_state.items()
               if isinstance(v, torch.Tensor))
    with pytest.raises(ValueError, match="already name"):
        trainer(4, EarlyStopper()).checkpoint_also({"rng": object()})

    meta_path = tmp_path / "run" / "checkpoints" / "step_00000004" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta["layout"]["dp"] = 2  # as if a two-rank job had saved it
    meta_path.write_text(json.dumps(meta))
    with pytest.raises(CheckpointError, match=r"early_stopping_weights belong to the layout .*dp=2"):
        trainer(6, EarlyStopper()).maybe_resume()


def test_checkpoints_are_atomic_pruned_and_loadable(parity_data, tmp_path, ctx):
    run = tmp_path / "run"
    Trainer(_config(parity_data, run, **{"trainer.max_steps": 6, "checkpoint.keep": 2}), ctx).fit()
    manager = CheckpointManager(run)
    kept = sorted(p.name for p in (run / "checkpoints").glob("step_*"))
    assert kept == ["step_00000004", "step_00000006"]
    assert manager.latest().name == "step_00000006"
    # A crash mid-save leaves a .tmp directory: it is ignored, latest still loads.
    (run / "checkpoints" / "step_00000008.tmp").mkdir()
    assert manager.latest().name == "step_00000006"
    model, cfg = load_for_inference(str(run))
    assert cfg.model.d_model == 16 and sum(p.numel() for p in model.parameters()) > 0


def test_generate_cli_samples_from_checkpoint(parity_data, tmp_path, ctx, capsys):
    run = tmp_path / "run"
    Trainer(_config(parity_data, run, **{"trainer.max_steps": 2}), ctx).fit()
    assert generate_main([str(run), "--prompt", "01", "--max-new-tokens", "5", "--json", "--tokenizer", "byte"]) == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert 1 <= len(out["tokens"]) <= 5 and len(out["logprobs"]) == len(out["tokens"])
    assert all(lp <= 0 for lp in out["logprobs"])


def test_train_cli_reports_bad_config_with_key(capsys):
    assert train_main(["configs/tiny.yaml", "model.n_heads=5"]) == 2
    assert "model.n_heads" in capsys.readouterr().err


def test_vocab_smaller_than_data_is_refused(parity_data, tmp_path, ctx):
    with pytest.raises(Exception, match="model.vocab_size"):
        Trainer(_config(parity_data, tmp_path / "v", **{"model.vocab_size": 8}), ctx)
