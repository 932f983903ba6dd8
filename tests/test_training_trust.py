"""The loss counts the right targets, bad configs fail in one line, the run reports what it skipped
(issue #11, items 7, 8, 10 and 11)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from helpers import tiny_overrides
from rlt_scale.config import load_config
from rlt_scale.errors import ConfigError, DataError
from rlt_scale.training.bptt import run_sequence, valid_targets
from rlt_scale.cli.train import main as train_main
from rlt_scale.training.trainer import Trainer


def _overrides(data, run_dir, **extra) -> list[str]:
    return tiny_overrides(data, run_dir, **{"model.params_dtype": "float64", "trainer.precision": "fp64",
                                            "trainer.micro_batch_size": 3, "trainer.max_steps": 2, **extra})


def _packed_batch(seed: int = 0) -> dict:
    """Three samples of 12 tokens: packed documents (doc ids change mid-row) and some masked targets."""
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 260, (3, 13), generator=g)
    doc_ids = torch.tensor([[0] * 5 + [1] * 8, [0] * 13, [0] * 3 + [1] * 4 + [2] * 6])
    loss_mask = torch.ones(3, 13, dtype=torch.bool)
    loss_mask[1, 9:] = False
    loss_mask[2, 4] = False
    return {"tokens": tokens, "doc_ids": doc_ids, "loss_mask": loss_mask}


def test_training_loss_is_the_mean_over_valid_targets_and_equals_the_eval_loss(parity_data, tmp_path, ctx):
    trainer = Trainer(load_config(None, _overrides(parity_data, tmp_path / "run")), ctx)
    batch = _packed_batch()
    valid = valid_targets(batch["tokens"], batch["doc_ids"], batch["loss_mask"])
    # 12 targets a row; row 0 loses 1 (a document start), row 1 four (masked), row 2 three (two starts, one mask)
    assert int(valid.sum()) == 36 - 1 - 4 - 3 < int(batch["loss_mask"][:, 1:].sum())

    with torch.no_grad():
        logits = run_sequence(trainer.model, batch["tokens"], batch["doc_ids"], batch["loss_mask"],
                              want_logits=True).logits
    per_target = F.cross_entropy(logits.flatten(0, 1), batch["tokens"][:, 1:].flatten(), reduction="none")
    expected = float(per_target[valid.flatten()].sum()) / int(valid.sum())

    train_loss = trainer.forward_backward([batch])
    sums = trainer.engine.forward_loss([batch])
    eval_sum, eval_count = sums.loss, sums.targets
    # float64 throughout: the three are the same sum in a different order (rounding ~1e-16 per op)
    assert math.isclose(train_loss, expected, rel_tol=1e-12)
    assert math.isclose(train_loss, eval_sum / eval_count, rel_tol=1e-12)
    assert eval_count == int(valid.sum())


def test_baseline_training_loss_is_the_mean_over_the_same_valid_targets(parity_data, tmp_path, ctx):
    from rlt_scale.experiments.baselines import BaselineConfig, build_baseline

    cfg = load_config(None, _overrides(parity_data, tmp_path / "base", **{
        "model.params_dtype": "float32", "trainer.precision": "fp32"}))
    model = build_baseline(BaselineConfig(kind="gru", vocab_size=260, d_model=16, n_layers=1))
    trainer = Trainer(cfg, ctx, model=model)  # the same loop and engine as the RLT
    batch = _packed_batch(1)
    valid = valid_targets(batch["tokens"], batch["doc_ids"], batch["loss_mask"])
    assert int(valid.sum()) == 28
    with torch.no_grad():  # the loss hands the baseline the documents, which it computes each alone
        logits = model(batch["tokens"][:, :-1], batch["doc_ids"][:, :-1])
        per_target = F.cross_entropy(logits.flatten(0, 1), batch["tokens"][:, 1:].flatten(), reduction="none")
    expected = float(per_target[valid.flatten()].sum()) / 28
    assert math.isclose(trainer.forward_backward([batch]), expected, rel_tol=1e-6)  # float32 sums


def test_yaml_syntax_error_is_one_line_naming_file_line_and_column(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  d_model: 64\n   n_heads: 4\n")
    assert train_main([str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "Traceback" not in err
    assert err.startswith(f"rlt-train: error: {bad}: YAML syntax error at line 3, column 11")


@pytest.mark.parametrize("override", ["optimizer.lr=nan", "optimizer.grad_clip=inf", "data.timeout_s=-inf",
                                      "logging.peak_tflops=nan"])
def test_non_finite_floats_are_rejected_naming_the_key(override):
    key = override.split("=")[0]
    with pytest.raises(ConfigError, match=f"^{key}: expected a finite number"):
        load_config("configs/tiny.yaml", [override])


def test_skipped_samples_are_counted_in_metrics_and_summary(tmp_path, ctx):
    from data_fixtures import UNEVEN_SHARDS, rewrite_shard, write_numbered_dataset

    data = tmp_path / "data"
    write_numbered_dataset(data)
    for shard in range(len(UNEVEN_SHARDS)):  # the first sample of every shard: the first row read is bad
        first = []
        rewrite_shard(data, shard, lambda key, suffix, raw: b"garbage" if suffix == "tokens.npy" and
                      (first.append(key) or first[0] == key) else raw)
    run = tmp_path / "run"
    cfg = load_config(None, _overrides(data, run, **{"data.on_error": "skip", "trainer.max_steps": 3}))
    with pytest.warns(UserWarning):
        summary = Trainer(cfg, ctx).fit()
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    counted = [r["skipped_samples"] for r in records if "loss" in r]
    assert counted[0] >= 1 and counted == sorted(counted)  # a running total
    assert summary.skipped_samples == counted[-1]
    assert f"skipped samples  {summary.skipped_samples} " in str(summary)


@pytest.mark.slow
def test_torchrun_prints_one_summary_with_global_figures(parity_data, tmp_path):
    from helpers import tiny_run_overrides, torchrun

    run = tmp_path / "run"
    proc = torchrun("rlt_scale/cli/train.py", 2, ["configs/tiny.yaml"] + tiny_run_overrides(parity_data, run, 2),
                    timeout=300)
    out = proc.stdout + proc.stderr
    assert out.count("== training summary ==") == 1, out[-3000:]
    assert out.count("tokens/s  ") == 1


def test_missing_eval_set_fails_at_start_not_at_the_first_evaluation(parity_data, tmp_path, ctx):
    cfg = load_config(None, _overrides(parity_data, tmp_path / "run", **{
        "data.eval_path": tmp_path / "no-such-eval"}))
    with pytest.raises((DataError, FileNotFoundError), match="no-such-eval"):
        Trainer(cfg, ctx)


def test_metrics_line_cut_short_by_a_crash_does_not_stop_the_resume(parity_data, tmp_path, ctx, capsys):
    run = tmp_path / "run"
    Trainer(load_config(None, _overrides(parity_data, run, **{"checkpoint.interval": 2})), ctx).fit()
    with open(run / "metrics.jsonl", "a") as f:
        f.write('{"step": 3, "loss": 2.')  # the crash hit mid-write
    resumed = Trainer(load_config(None, _overrides(parity_data, run, **{"trainer.max_steps": 3})), ctx)
    summary = resumed.fit()
    assert summary.steps == 3 and len(summary.losses) == 1
    assert "metrics.jsonl:" in capsys.readouterr().out
