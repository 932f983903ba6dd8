"""A checkpoint saved at one TP x PP x DP x ZeRO layout resumes at another as if training had not moved.

Each case trains 3 steps at layout A under torchrun with the real trainer
(tests/workers/checkpoint_run.py: ``Trainer.fit``, checkpoint at step 2 and
at the end); A's step 3 is the reference for "continuing at layout A". The
step-2 checkpoint is then copied into a fresh run directory, and layout B
resumes it the way ``rlt-train`` does (from ``latest``) and trains step 3.
Both layouts see the same global batches (micro-batch x accumulation x DP
is kept equal). Compared: step 3's loss, and every parameter after it
(full size, TP gathered, all pipeline stages), relative to each tensor's
largest entry. Gradient clipping is active (grad_clip 0.5, norms ~3), so
the global norm over the new layout's shards must be right too.

Tolerances, and why:

* float64, no TP on either side (PP2 -> PP1, DP2 -> DP3): 1e-10. The loaded
  state is bit-identical; layouts differ only in the summation order of
  float64 sums (~1e-16 per op). Measured: loss 0, parameters <= 1.4e-16.
* float64 with TP2 on one side (TP2xPP2 <-> TP1xPP1): loss 1e-7, parameters
  1e-6. megatron's vocab-parallel cross-entropy computes in float32 (TP1 uses
  F.cross_entropy in float64), so step 3 carries fp32 rounding of the token
  losses (~6e-8 each, averaged) into the loss and the gradient; Adam divides
  each entry by its own running magnitude, so an entry whose gradient is near
  that noise moves by more than the noise. Measured: loss 2.8e-9 / 2.4e-9,
  parameters 3.4e-9 / 3.2e-9.
* ZeRO-1 -> ZeRO-2 (fp32, DeepSpeed keeps fp32 master weights): loss 1e-6,
  parameters 1e-5: the same state, one step of fp32 reductions in another
  order (stage 2 reduces per micro-batch into partitions). Measured: loss 0,
  parameters 7.0e-8.
* ZeRO-1 -> ZeRO-1 and TP2xPP2 -> TP2xPP2 (same layout): exact equality,
  the resume contract (RNG included).

A semantic error (a wrong shard, a shard from the wrong rank, lost optimizer
moments, a wrong step count for Adam's bias correction) moves the loss or
parameters by 1e-3 or more.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

from helpers import layout_overrides, torchrun

pytestmark = pytest.mark.slow

F64, F32 = "float64", "float32"
LAYOUTS = {  # name: (processes, micro-batch per rank, dtype, overrides)
    "tp1": (1, 4, F64, []),
    "tp2pp2": (4, 4, F64, ["parallel.tp=2", "parallel.pp=2"]),
    "pp2": (2, 4, F64, ["parallel.pp=2"]),
    "dp2": (2, 3, F64, []),
    "dp3": (3, 2, F64, []),
    "zero1": (2, 2, F32, ["parallel.zero_stage=1"]),
    "zero2": (2, 2, F32, ["parallel.zero_stage=2"]),
}
CASES = {  # (A, B): (loss tolerance, parameter tolerance); 0 = bit-identical
    ("tp2pp2", "tp1"): (1e-7, 1e-6),
    ("tp1", "tp2pp2"): (1e-7, 1e-6),
    ("pp2", "tp1"): (1e-10, 1e-10),
    ("dp2", "dp3"): (1e-10, 1e-10),
    ("zero1", "zero2"): (1e-6, 1e-5),
    ("zero1", "zero1"): (0, 0),
    ("tp2pp2", "tp2pp2"): (0, 0),
}
SAVED_STEP = 2


@pytest.fixture(scope="module")
def data(layout_data):
    return layout_data


def _launch(layout: str, run_dir: Path, data: Path) -> tuple[dict, str]:
    """Run ``Trainer.fit`` at ``layout`` to step 3; (losses of this launch + full parameters, stdout)."""
    nproc, micro, dtype, extra = LAYOUTS[layout]
    out = run_dir.parent / f"{run_dir.name}.pt"
    proc = torchrun("tests/workers/checkpoint_run.py", nproc, [str(out)] + layout_overrides(
        data, run_dir, micro, dtype, extra + [f"checkpoint.interval={SAVED_STEP}"]), timeout=300)
    results = {"params": {}}
    for stage_file in sorted(run_dir.parent.glob(f"{run_dir.name}.pt.stage*")):
        stage = torch.load(stage_file, weights_only=True)
        results["params"].update(stage["params"])  # a memory replica appears on two stages, equal
        if stage_file.name.endswith("stage0"):
            results["losses"] = stage["losses"]
    return results, proc.stdout


@pytest.fixture(scope="module")
def layout_a(tmp_path_factory, data):
    """The uninterrupted 3-step run at a layout (cached: several cases start from the same one)."""
    cache = {}

    def get(layout):
        if layout not in cache:
            run_dir = tmp_path_factory.mktemp(f"a-{layout}") / "run"
            cache[layout] = (run_dir, _launch(layout, run_dir, data)[0])
        return cache[layout]

    return get


def _geometry(layout: str) -> tuple[int, int, int]:
    """(tp, pp, dp) of a layout: what the per-rank RNG state is bound to."""
    nproc, _, _, extra = LAYOUTS[layout]
    sizes = {k: int(v) for k, v in (o.removeprefix("parallel.").split("=") for o in extra) if k in ("tp", "pp")}
    tp, pp = sizes.get("tp", 1), sizes.get("pp", 1)
    return tp, pp, nproc // (tp * pp)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


@pytest.mark.parametrize("a,b", list(CASES), ids=[f"{a}-to-{b}" for a, b in CASES])
def test_resume_at_another_layout_matches_continuing(tmp_path, data, layout_a, a, b):
    loss_tol, param_tol = CASES[a, b]
    a_dir, ref = layout_a(a)
    assert ref["losses"] and len(ref["losses"]) == 3
    run_dir = tmp_path / "run"
    saved = f"step_{SAVED_STEP:08d}"
    shutil.copytree(a_dir / "checkpoints" / saved, run_dir / "checkpoints" / saved)
    (run_dir / "checkpoints" / "latest").write_text(saved)

    got, stdout = _launch(b, run_dir, data)
    assert f"at step {SAVED_STEP}" in stdout
    assert ("resharded from" in stdout) == (_geometry(a) != _geometry(b))
    assert len(got["losses"]) == 1  # only step 3 was trained here
    loss_err = abs(got["losses"][0] - ref["losses"][2]) / abs(ref["losses"][2])
    assert got["params"].keys() == ref["params"].keys()
    param_err = {name: _rel(got["params"][name], ref["params"][name]) for name in ref["params"]}
    worst = max(param_err, key=param_err.get)
    print(f"{a} -> {b}: loss rel err {loss_err:.2e}, worst parameter {worst} rel err {param_err[worst]:.2e}")
    if loss_tol == 0:
        assert got["losses"][0] == ref["losses"][2]
        assert all(torch.equal(got["params"][n], ref["params"][n]) for n in ref["params"])
    else:
        assert loss_err <= loss_tol
        assert param_err[worst] <= param_tol, worst
