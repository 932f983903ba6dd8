"""Shared fixtures: a one-process world (megatron's layers need process groups),
a factory for tiny float64 models, and the tiny parity datasets the trainer
tests share (made once per session; helpers live in ``helpers.py``)."""

from __future__ import annotations

import pytest
import torch

from rlt_scale.config import ModelConfig, ParallelConfig
from rlt_scale.distributed import init_distributed
from helpers import parity_dataset
from rlt_scale.model import build_model


@pytest.fixture(scope="session")
def ctx():
    # The tests' models are tiny: one thread avoids OpenMP spin-waits that make
    # small matmuls several times slower on a 2-core machine under load.
    torch.set_num_threads(1)
    return init_distributed(ParallelConfig(timeout_s=90), device="cpu")


@pytest.fixture
def make_model(ctx):
    """``make_model(**overrides)`` -> a seeded float64 RLT with tiny defaults."""

    def make(seed: int = 0, **overrides):
        fields = dict(
            vocab_size=23, d_model=16, n_heads=2, n_enc_layers=2, n_dec_layers=2, window=3,
            memory_groups=1, feedback_block=1, feedback_scale=0.5, tie_layers=True,
            params_dtype="float64", ffn_hidden_size=24,
        )
        fields.update(overrides)
        cfg = ModelConfig(**fields)
        cfg.validate()
        torch.manual_seed(seed)
        return build_model(cfg, ctx.tp_group)

    return make


@pytest.fixture(scope="session")
def parity_data(tmp_path_factory):
    """64 training programs of 8 bits, 16 for evaluation (``<dir>/eval``): the in-process trainer tests' data."""
    return parity_dataset(tmp_path_factory.mktemp("parity"), 64, 8, eval_samples=16)


@pytest.fixture(scope="session")
def layout_data(tmp_path_factory):
    """96 programs of 9 bits, 16 for evaluation: what the multi-process layout, ZeRO and resharding tests train."""
    return parity_dataset(tmp_path_factory.mktemp("layout-parity"), 96, 9, eval_samples=16)
