"""What every logged step records: the metrics the issue names, MFU when a peak is known."""

from __future__ import annotations

import json

import pytest

from helpers import parity_dataset, tiny_overrides
from rlt_scale.config import load_config
from rlt_scale.errors import ConfigError
from rlt_scale.profiling.flops import analytic_flops
from rlt_scale.profiling.workload import Workload
from rlt_scale.training.trainer import Trainer


def test_records_carry_mfu_and_hfu_from_the_cost_model(tmp_path, ctx):
    data = parity_dataset(tmp_path / "parity", 32, 6)
    cfg = load_config(None, tiny_overrides(data, tmp_path / "run", **{
        "logging.peak_tflops": 0.001, "trainer.micro_batch_size": 2, "trainer.max_steps": 2,
        "trainer.chunk_size": 4, "trainer.activation_checkpointing": "chunk"}))
    trainer = Trainer(cfg, ctx)
    trainer.fit()
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    work = Workload(batch=2, seq_len=trainer.loader.seq_len, chunk_size=4, checkpoint=True)
    report = analytic_flops(cfg.model, work)
    for r in steps:
        assert {"step", "loss", "lr", "grad_norm", "tokens_per_s", "consumed_samples"} <= r.keys()
        assert r["mfu"] == pytest.approx(r["tokens_per_s"] * report.model_flops / work.tokens / 1e9, rel=1e-12)
        # checkpointing recomputes the decoder: hardware FLOPs exceed model FLOPs
        assert r["hfu"] > r["mfu"] > 0


def test_peak_must_be_positive():
    with pytest.raises(ConfigError, match="logging.peak_tflops"):
        load_config(None, ["logging.peak_tflops=0"])
