"""GPU/NCCL readiness that can be shown on a CPU (issue #17, item 9).

* The gradient norm's all-reduce gets a tensor on the run's device even on a
  rank with nothing to count (NCCL rejects CPU tensors). The ``meta`` device
  stands in for CUDA: a tensor created without a device lands on the CPU.
* ``trainer.tf32`` sets torch's TF32 switches on CUDA only.
* Batches are pinned for CUDA only.
* The launch scripts export ``CUDA_DEVICE_MAX_CONNECTIONS=1`` unless it is set,
  and ``launch/slurm.sh`` runs one worker per GPU by default. The scripts run
  under bash with fake ``python``, ``srun``, ``scontrol`` and ``nvidia-smi``
  that print what they were given: nothing is trained, no torch is started.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from data_fixtures import config, write_numbered_dataset
from helpers import ROOT, tiny_overrides
from rlt_scale.config import config_to_dict, config_to_yaml, load_config
from rlt_scale.data.loader import StreamingLoader, pin_batches
from rlt_scale.errors import ConfigError
from rlt_scale.parallel import grad_norm
from rlt_scale.training import engine
from rlt_scale.training.trainer import Trainer, apply_tf32, tf32_setting

META = torch.device("meta")
BASH = shutil.which("bash")


# ------------------------------------------------------------------ gradient norm
def _meta_param(sharded: bool = False, grad: bool = False) -> torch.nn.Parameter:
    p = torch.nn.Parameter(torch.empty(3, device=META))
    if sharded:
        p.tensor_model_parallel = True
    if grad:
        p.grad = torch.empty(3, device=META)
    return p


@pytest.mark.parametrize("params", [
    [_meta_param(), _meta_param()],          # no gradients at all
    [_meta_param(grad=True)],                # only a replicated parameter: TP rank 0 counts it, not rank 1
], ids=["no-grads", "only-replicas"])
def test_norm_with_nothing_to_count_lives_on_the_parameters_device(params):
    norm = grad_norm.global_grad_norm(params, tp_rank=1, model_parallel_group=None)
    assert norm.device == META and norm.dtype == torch.float64


def test_norm_of_no_parameters_lives_on_the_given_device():
    assert grad_norm.global_grad_norm([], tp_rank=0, model_parallel_group=None, device=META).device == META


def test_the_all_reduce_gets_a_tensor_on_the_device(monkeypatch):
    """What NCCL would be handed: the zero of a rank without gradients, on the run's device."""
    reduced = []
    monkeypatch.setattr(grad_norm.dist, "get_world_size", lambda group: 2)
    monkeypatch.setattr(grad_norm.dist, "all_reduce", lambda t, group: reduced.append(t.device))
    grad_norm.global_grad_norm([], tp_rank=0, model_parallel_group=object(), device=META)
    assert reduced == [META]


def test_plain_sync_passes_the_context_device(monkeypatch):
    """PlainSync hands only parameters with gradients on, possibly none: the device must come from the context."""
    seen = {}
    monkeypatch.setattr(engine, "clip_grads", lambda params, clip, tp_rank, group, device: seen.update(
        params=params, device=device) or 0.0)
    ctx = SimpleNamespace(tp_rank=0, model_parallel_group=None, device=META)
    engine.PlainSync(torch.nn.Linear(2, 2), None, ctx, grad_clip=1.0).step(lr=0.1)
    assert seen == {"params": [], "device": META}


def test_clipping_on_cpu_is_unchanged():
    p = torch.nn.Parameter(torch.zeros(2))
    p.grad = torch.tensor([3.0, 4.0])
    assert grad_norm.clip_grads([p], 1.0, 0, None) == pytest.approx(5.0)
    assert torch.allclose(p.grad, torch.tensor([0.6, 0.8]), atol=1e-6)


# ------------------------------------------------------------------------- TF32
@pytest.fixture
def tf32_switches():
    """Restore torch's global TF32 switches after the test."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


@pytest.mark.parametrize("device, tf32, expected", [
    ("cuda", True, True), ("cuda:1", False, False), ("cpu", True, None), ("cpu", False, None), ("meta", True, None),
])
def test_tf32_is_decided_for_cuda_only(device, tf32, expected):
    assert tf32_setting(torch.device(device), tf32) is expected


@pytest.mark.parametrize("tf32", [True, False])
def test_tf32_on_cuda_sets_both_switches(tf32_switches, tf32):
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = not tf32, not tf32
    apply_tf32(torch.device("cuda", 0), tf32)  # the switches are plain globals: settable without a GPU
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (tf32, tf32)


def test_tf32_on_cpu_leaves_the_switches_alone(tf32_switches):
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    apply_tf32(torch.device("cpu"), True)
    apply_tf32(torch.device("cpu"), False)
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, True)


def test_tf32_config_key():
    cfg = load_config()
    assert cfg.trainer.tf32 is True
    assert "tf32: true" in config_to_yaml(cfg)
    off = load_config(overrides=["trainer.tf32=false"])
    assert off.trainer.tf32 is False and config_to_dict(off)["trainer"]["tf32"] is False
    with pytest.raises(ConfigError, match=r"^trainer\.tf32"):
        load_config(overrides=["trainer.tf32=sometimes"])


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_get_tf32_by_default(path):
    assert load_config(str(path)).trainer.tf32 is True


# ---------------------------------------------------------------- pinned batches
@pytest.mark.parametrize("device, pin", [("cpu", False), ("meta", False), ("cuda", True), ("cuda:3", True)])
def test_batches_are_pinned_for_cuda_only(device, pin):
    assert pin_batches(torch.device(device)) is pin


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("numbered")
    write_numbered_dataset(path)
    return path


@pytest.mark.parametrize("pin", [False, True])
def test_loader_pins_every_tensor_of_every_batch_when_asked(dataset, monkeypatch, pin):
    """Pinning needs CUDA, so ``Tensor.pin_memory`` is replaced by a marker; training and eval batches alike."""
    def fake_pin(tensor):
        out = tensor.clone()
        out.fake_pinned = True
        return out

    monkeypatch.setattr(torch.Tensor, "pin_memory", fake_pin)
    loader = StreamingLoader(config(dataset), batch_size=4, pin_memory=pin)
    train = next(iter(loader))
    evals = list(loader.iter_epoch_once())  # the last one is padded
    for batch in [train, *evals]:
        assert sorted(batch) == ["doc_ids", "loss_mask", "tokens"]
        assert all(getattr(t, "fake_pinned", False) is pin for t in batch.values())


def test_cpu_trainer_neither_pins_nor_touches_tf32(ctx, parity_data, tmp_path, tf32_switches):
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
    cfg = load_config(overrides=tiny_overrides(parity_data, tmp_path / "run", **{
        "data.eval_path": parity_data / "eval", "trainer.tf32": "true"}))
    trainer = Trainer(cfg, ctx)
    assert trainer.device.type == "cpu"
    assert trainer.loader.pin_memory is False and trainer.eval_loader.pin_memory is False
    assert (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32) == (False, True)


# ---------------------------------------------------------------- launch scripts
def _fake(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text("#!/usr/bin/env bash\n" + body + "\n")
    path.chmod(0o755)


def _nvidia_smi(bin_dir: Path, gpus: int, status: int = 0) -> None:
    lines = "".join(f"echo 'GPU {i}: NVIDIA H200 (UUID: GPU-{i})'; echo '  MIG 1g.18gb Device 0: (UUID: MIG-{i})'; "
                    for i in range(gpus))
    _fake(bin_dir, "nvidia-smi", f"[[ $1 == -L ]] || exit 2; {lines}exit {status}")


def _env(path: str, **extra) -> dict:
    """A clean environment: nothing of the caller's SLURM_*, NPROC_PER_NODE or CUDA_* leaks in."""
    return {"PATH": path, "HOME": os.environ.get("HOME", "/tmp"), **extra}


def _nproc(path: str, **extra) -> str:
    """``nproc_per_node`` from launch/gpus-per-node.sh, under slurm.sh's strict mode."""
    proc = subprocess.run([BASH, "-c", "set -euo pipefail; source launch/gpus-per-node.sh; nproc_per_node"],
                          cwd=ROOT, env=_env(path, **extra), capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip()


def test_nproc_defaults_to_slurms_gpu_count(tmp_path):
    _nvidia_smi(tmp_path, 2)
    assert _nproc(f"{tmp_path}:/usr/bin:/bin", SLURM_GPUS_ON_NODE="4") == "4"


def test_nproc_else_counts_nvidia_smi_gpus(tmp_path):
    _nvidia_smi(tmp_path, 2)  # the MIG lines under each GPU are not counted
    assert _nproc(f"{tmp_path}:/usr/bin:/bin") == "2"
    assert _nproc(f"{tmp_path}:/usr/bin:/bin", SLURM_GPUS_ON_NODE="") == "2"


@pytest.mark.parametrize("case", ["no-nvidia-smi", "no-gpus", "broken-driver"])
def test_nproc_without_gpus_is_one(tmp_path, case):
    if case == "no-gpus":
        _nvidia_smi(tmp_path, 0)
    elif case == "broken-driver":
        _fake(tmp_path, "nvidia-smi", "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    path = str(tmp_path) if case == "no-nvidia-smi" else f"{tmp_path}:/usr/bin:/bin"  # no grep needed then
    assert _nproc(path) == "1"


def test_explicit_nproc_wins(tmp_path):
    _nvidia_smi(tmp_path, 2)
    assert _nproc(f"{tmp_path}:/usr/bin:/bin", NPROC_PER_NODE="3", SLURM_GPUS_ON_NODE="4") == "3"


def _slurm_agent_command(tmp_path: Path, **extra) -> str:
    """What launch/slurm.sh hands srun, printed by a fake srun (with the exported variables it would pass on)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    _fake(bin_dir, "scontrol", "echo node0")
    _fake(bin_dir, "srun", 'echo "NPROC_PER_NODE=$NPROC_PER_NODE '
                           'CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS $*"')
    env = _env(f"{bin_dir}:/usr/bin:/bin", SLURM_JOB_ID="7", SLURM_NNODES="1", SLURM_JOB_NODELIST="node0",
               SLURM_JOB_NAME="rlt", RLT_ROOT=str(ROOT), LOG_ROOT=str(tmp_path / "logs"), **extra)
    # sbatch runs a copy from its spool directory: the helper must be found through RLT_ROOT, not $0.
    script = shutil.copy(ROOT / "launch" / "slurm.sh", tmp_path / "slurm_script")
    proc = subprocess.run([BASH, script, "configs/tiny.yaml"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.strip().splitlines()[-1]


@pytest.mark.parametrize("extra, nproc", [({"SLURM_GPUS_ON_NODE": "4"}, "4"),
                                          ({"SLURM_GPUS_ON_NODE": "4", "NPROC_PER_NODE": "3"}, "3")])
def test_slurm_script_runs_one_worker_per_gpu(tmp_path, extra, nproc):
    line = _slurm_agent_command(tmp_path, **extra)
    assert line.startswith(f"NPROC_PER_NODE={nproc} ") and f"--nproc-per-node={nproc} " in line


@pytest.mark.parametrize("script", ["launch/torchrun.sh", "launch/deepspeed.sh", "launch/slurm.sh"])
@pytest.mark.parametrize("preset, expected", [(None, "1"), ("8", "8")])
def test_launchers_export_one_cuda_connection_unless_set(tmp_path, script, preset, expected):
    extra = {} if preset is None else {"CUDA_DEVICE_MAX_CONNECTIONS": preset}
    if script == "launch/slurm.sh":
        line = _slurm_agent_command(tmp_path, **extra)
    else:  # both exec $PYTHON -m rlt_scale.launcher ...: a fake python prints what it would see
        _fake(tmp_path, "python", 'echo "CUDA_DEVICE_MAX_CONNECTIONS=$CUDA_DEVICE_MAX_CONNECTIONS"')
        proc = subprocess.run([BASH, script, "configs/tiny.yaml"], cwd=ROOT, capture_output=True, text=True,
                              env=_env("/usr/bin:/bin", PYTHON=str(tmp_path / "python"), **extra), timeout=30)
        assert proc.returncode == 0, proc.stderr
        line = proc.stdout.strip()
    assert f"CUDA_DEVICE_MAX_CONNECTIONS={expected}" in line.split()
