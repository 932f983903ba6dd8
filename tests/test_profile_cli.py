"""``rlt-profile`` / ``tools/profile_layers.py``: tables, JSON and chart, analytic and measured."""

from __future__ import annotations

import json

import pytest

from rlt_scale.profiling.cli import main
from rlt_scale.profiling.peak import measure_peak

SMALL = ["model.vocab_size=32", "model.d_model=16", "model.n_heads=2", "model.ffn_hidden_size=24",
         "model.window=3", "model.feedback_block=1"]


def test_analytic_run_writes_json_and_png(tmp_path, capsys):
    out_json, out_png = tmp_path / "p.json", tmp_path / "p.png"
    pytest.importorskip("matplotlib")
    assert main(SMALL + ["--seq-len", "32", "--batch", "2", "--chunk", "8", "--checkpoint",
                         "--tp", "2", "--pp", "2", "--dp", "4", "--zero", "1",
                         "--json", str(out_json), "--png", str(out_png)]) == 0
    text = capsys.readouterr().out
    assert "decoder.1" in text and "ZeRO-1" in text
    data = json.loads(out_json.read_text())
    assert data["workload"] == {"batch": 2, "seq_len": 32, "chunk_size": 8, "checkpoint": True,
                                "recompute_encoder": False}
    assert len(data["memory"]["ranks"]) == 2 and data["layout"]["tp"] == 2
    assert data["flops"]["hardware_flops"] > data["flops"]["model_flops"] > 0  # masks + recomputation
    assert data["flops_per_tp_rank"]["hardware_flops"] < data["flops"]["hardware_flops"]
    assert out_png.stat().st_size > 10_000


def test_measured_run_prints_analytic_beside_measured(tmp_path, capsys):
    out_json = tmp_path / "m.json"
    assert main(SMALL + ["--seq-len", "12", "--batch", "2", "--measure", "--steps", "1", "--threads", "1",
                         "--json", str(out_json), "--no-png"]) == 0
    text = capsys.readouterr().out
    assert "+0.00%" in text and "MFU" in text
    data = json.loads(out_json.read_text())
    assert data["measured"]["counted_total"] == data["flops"]["hardware_flops"]
    assert data["peak"]["flops_per_s"] > 0 and data["utilisation"]["mfu"] > 0


def test_peak_is_a_dense_matmul_on_these_threads():
    peak = measure_peak(size=256, repeats=2)
    assert peak.flops_per_s >= max(peak.samples) and "matmul" in peak.source and peak.threads > 0
