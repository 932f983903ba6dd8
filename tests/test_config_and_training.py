"""Config errors name the key; shipped configs load; training really learns."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rlt_scale.config import ModelConfig, load_config
from rlt_scale.errors import ConfigError
from rlt_scale.model import build_model
from rlt_scale.training.bptt import BPTT, run_sequence
from rlt_scale.training.optim import build_optimizer, lr_at
from rlt_scale.config import OptimizerConfig

CONFIGS = sorted(Path(__file__).resolve().parent.parent.joinpath("configs").glob("*.yaml"))


@pytest.mark.parametrize("overrides, key", [
    (["model.not_a_field=3"], "model.not_a_field"),
    (["nonsense.section=1"], "nonsense"),
    (["model.d_model=wide"], "model.d_model"),
    (["model.n_enc_layers=3", "model.n_dec_layers=2"], "model.tie_layers"),
    (["model.d_model=66", "model.n_heads=4"], "model.n_heads"),
    (["model.memory_groups=5"], "model.memory_groups"),
    (["trainer.tbptt_chunks=2", "trainer.chunk_size=0"], "trainer.tbptt_chunks"),
    (["trainer.activation_checkpointing=everything"], "trainer.activation_checkpointing"),
    (["trainer.tbptt_detach=[s,weights]", "trainer.chunk_size=4", "trainer.tbptt_chunks=1"], "trainer.tbptt_detach"),
    (["trainer.precision=fp64"], "trainer.precision"),
    (["optimizer.min_lr=1.0"], "optimizer.min_lr"),
    (["parallel.tp=3"], "model.n_heads"),
    (["data.on_error=ignore"], "data.on_error"),
    (["model.window=0"], "model.window"),
    (["parallel.pp=3"], "parallel.pp"),
    (["parallel.zero_stage=3"], "parallel.zero_stage"),
    (["parallel.zero_stage=1", "model.params_dtype=float64"], "model.params_dtype"),
    (["trainer.activation_checkpointing=chunk"], "trainer.activation_checkpointing"),
])
def test_bad_config_names_the_key(overrides, key):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert err.value.key == key, str(err.value)
    assert str(err.value).startswith(key)


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_load_and_validate(path):
    cfg = load_config(str(path))
    assert cfg.model.d_model % cfg.model.n_heads == 0


def test_yaml_and_overrides_merge(tmp_path):
    yaml = tmp_path / "c.yaml"
    yaml.write_text("model:\n  d_model: 32\n  n_heads: 2\ntrainer:\n  max_steps: 7\n")
    cfg = load_config(str(yaml), ["trainer.max_steps=9", "model.feedback_block=4"])
    assert (cfg.model.d_model, cfg.model.n_heads, cfg.trainer.max_steps, cfg.model.feedback_block) == (32, 2, 9, 4)


def test_lr_schedule_warms_up_then_decays_to_min():
    cfg = OptimizerConfig(lr=1.0, min_lr=0.1, warmup_steps=4)
    lrs = [lr_at(s, cfg, 20) for s in range(20)]
    assert lrs[:4] == [0.25, 0.5, 0.75, 1.0]
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:]))
    assert abs(lr_at(20, cfg, 20) - 0.1) < 1e-12


def test_weight_decay_spares_vectors(ctx):
    model = build_model(ModelConfig(vocab_size=20, d_model=16, n_heads=2), ctx.tp_group)
    decay, no_decay = build_optimizer(model, OptimizerConfig()).param_groups
    assert all(p.dim() >= 2 for p in decay["params"]) and decay["weight_decay"] > 0
    assert all(p.dim() < 2 for p in no_decay["params"]) and no_decay["weight_decay"] == 0
    assert any(p is model.merge.initial_state for p in no_decay["params"])


@pytest.mark.parametrize("k", [1, 4])
def test_tiny_model_memorises_a_fixed_batch(ctx, k):
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=32, d_model=32, n_heads=4, window=4, feedback_block=k), ctx.tp_group)
    opt = build_optimizer(model, OptimizerConfig(lr=1e-2, weight_decay=0.0))
    tokens = torch.randint(0, 32, (4, 13), generator=torch.Generator().manual_seed(1))
    losses = []
    for _ in range(40):
        opt.zero_grad()
        out = run_sequence(model, tokens, bptt=BPTT(chunk_size=6, checkpoint=True))
        loss = out.loss_sum / out.n_targets
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] > 3.0  # ~ln(32) = 3.47 at init
    assert losses[-1] < 0.1 * losses[0], losses[::10]  # measured: 3.48 -> 0.005


def test_bf16_autocast_step_tracks_fp32(ctx):
    torch.manual_seed(0)
    model = build_model(ModelConfig(vocab_size=32, d_model=32, n_heads=4, window=4), ctx.tp_group)
    tokens = torch.randint(0, 32, (2, 13), generator=torch.Generator().manual_seed(1))
    fp32 = run_sequence(model, tokens, bptt=BPTT(chunk_size=4))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        bf16 = run_sequence(model, tokens, bptt=BPTT(chunk_size=4, checkpoint=True))
    (bf16.loss_sum / bf16.n_targets).backward()
    assert abs(bf16.loss_sum.item() - fp32.loss_sum.item()) / fp32.loss_sum.item() < 0.02  # bf16 has ~3 digits
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
