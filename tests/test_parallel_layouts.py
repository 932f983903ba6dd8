"""Every TP x DP layout trains the same model as one process (DESIGN.md section 3).

Each layout runs 3 optimizer steps of the real trainer under torchrun (gloo,
CPU, float64). Compared with the one-process run of the same data:
the loss of every step, every gradient of step 1 (TP shards gathered to full
shape) and every parameter after step 3.

Tolerances: data parallelism only changes the order of a sum: 1e-10
relative. Tensor parallelism also routes the loss through megatron's
vocab-parallel cross-entropy, which computes in float32: 1e-5 relative.
"""

from __future__ import annotations

import pytest
import torch

from launch import torchrun
from rlt_scale.data.prepare import prepare_task

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    out = tmp_path_factory.mktemp("parity")
    prepare_task("parity", out, num_samples=96, length=9, seed=0, eval_samples=0)
    return out


def _run(tmp_path, data, name, nproc, micro, extra):
    out = tmp_path / f"{name}.pt"
    overrides = [
        f"data.path={data}", f"checkpoint.dir={tmp_path / name}", "logging.wandb_mode=disabled",
        "model.d_model=16", "model.n_heads=4", "model.window=3", "model.vocab_size=260", "model.ffn_hidden_size=32",
        "model.params_dtype=float64", "model.feedback_scale=0.5", "trainer.precision=fp64",
        "trainer.max_steps=3", f"trainer.micro_batch_size={micro}", "trainer.grad_accum_steps=2",
        "trainer.eval_interval=0", "trainer.device=cpu", "checkpoint.interval=0", "parallel.timeout_s=60",
        "optimizer.grad_clip=0.5", "optimizer.warmup_steps=1",
    ] + extra
    torchrun("tests/workers/layout_step.py", nproc, [str(out)] + overrides)
    return torch.load(out, weights_only=True)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp(min=1e-30)).item()


LAYOUTS = {  # name: (processes, micro-batch per rank, overrides, tolerance)
    "tp2": (2, 4, ["parallel.tp=2"], 1e-5),
    "dp2": (2, 2, [], 1e-10),
    "tp2xdp2": (4, 2, ["parallel.tp=2"], 1e-5),
}
SCHEDULES = {
    "K1-ckpt": ["model.feedback_block=1", "trainer.chunk_size=4", "trainer.activation_checkpointing=chunk"],
    "K3-nockpt": ["model.feedback_block=3", "trainer.chunk_size=5"],
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    """One-process results per schedule, computed once for all layouts."""
    cache = {}

    def get(schedule):
        if schedule not in cache:
            cache[schedule] = _run(tmp_path_factory.mktemp("ref"), data, "ref", 1, 4, SCHEDULES[schedule])
        return cache[schedule]

    return get


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("layout", LAYOUTS)
def test_layout_matches_single_process(tmp_path, data, reference, layout, schedule):
    nproc, micro, extra, tol = LAYOUTS[layout]
    ref = reference(schedule)
    got = _run(tmp_path, data, layout, nproc, micro, SCHEDULES[schedule] + extra)
    for a, b in zip(got["losses"], ref["losses"]):
        assert abs(a - b) <= tol * abs(b)
    for a, b in zip(got["norms"], ref["norms"]):
        assert abs(a - b) <= tol * abs(b)
    assert got["grads"].keys() == ref["grads"].keys()
    for name in ref["grads"]:
        assert got["grads"][name].shape == ref["grads"][name].shape, name
        assert _rel(got["grads"][name], ref["grads"][name]) <= tol, name
        assert _rel(got["params"][name], ref["params"][name]) <= tol, name
    assert ref["norms"][0] > 0.5  # clipping was active, so the global norm had to be right
