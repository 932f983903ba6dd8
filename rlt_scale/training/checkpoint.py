"""Atomic, sharded, reshardable checkpoints of everything a run must restore (docs/CHECKPOINTS.md).

Layout of ``<run dir>/checkpoints``::

    step_00000100/state/      torch.distributed.checkpoint: every rank writes its own
                              shards in parallel; any TP x PP x DP layout reads them
    step_00000100/meta.json   format version, step, layout, consumed samples, config and
                              the small global state (schedule, data position); written last
    latest                    name of the newest *complete* checkpoint

Objects to save come in two kinds:

* *sharded* (``sharded_state_dict()``, ``load_targets()``,
  ``load_sharded_state_dict(loaded)``): tensors and ``DTensor``s named as in
  the single-process model, written by every rank into ``state/``; see
  :mod:`rlt_scale.training.sharded_state`. One marked ``layout_bound``
  (the per-rank RNG) is restored only into the layout that saved it, and
  otherwise told to ``reseed(seed, step)``.
* *global* (``state_dict()`` / ``load_state_dict(state)``): small, identical on
  every rank, JSON-serialisable; rank 0 writes it into ``meta.json``.

Saving: every rank writes into ``step_N.tmp/state``; after that collective,
rank 0 writes ``meta.json``, publishes the directory by renaming it and then
replaces ``latest`` atomically. A crash at any moment leaves the previous
checkpoint loadable; leftover ``.tmp`` directories are ignored and reported.

Loading never unpickles code: see :mod:`rlt_scale.training.checkpoint_files`.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional, Protocol

import torch.distributed as dist

from rlt_scale.errors import CheckpointError, ConfigError
from rlt_scale.training.checkpoint_files import describe_load_failure, verify_state_files, write_text_durably

FORMAT_VERSION = 2
STATE_DIR = "state"
META_FILE = "meta.json"
FAULT_ENV = "RLT_CHECKPOINT_FAULT"
"""Test-only fault injection: ``during_shards`` (the last rank dies before writing its
shards), ``after_shards`` (rank 0 dies after every shard is written, before
``meta.json``) or ``before_pointer`` (rank 0 dies after publishing the directory,
before updating ``latest``). Exit status 1, like a crash."""


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class ShardedStateful(Protocol):
    def sharded_state_dict(self) -> dict: ...

    def load_targets(self) -> dict: ...

    def load_sharded_state_dict(self, loaded: dict) -> None: ...


def _is_sharded(obj) -> bool:
    return hasattr(obj, "sharded_state_dict")


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


def _fault(point: str, rank: int, world_size: int) -> None:
    wanted = os.environ.get(FAULT_ENV)
    dying_rank = world_size - 1 if point == "during_shards" else 0
    if wanted == point and rank == dying_rank:
        print(f"{FAULT_ENV}={point}: rank {rank} exits now (test-only crash)", flush=True)
        os._exit(1)


def config_diff(saved: dict, run: dict, prefix: str) -> list[str]:
    """``prefix.key: checkpoint A, run B`` for every key whose value differs (nested dicts recursed)."""
    lines = []
    for key in sorted(set(saved) | set(run)):
        a, b = saved.get(key, "<absent>"), run.get(key, "<absent>")
        if isinstance(a, dict) and isinstance(b, dict):
            lines += config_diff(a, b, f"{prefix}.{key}")
        elif a != b:
            lines.append(f"{prefix}.{key}: checkpoint {a!r}, run {b!r}")
    return lines


class CheckpointManager:
    """Save, find and load the checkpoints of one run directory.

    ``layout`` is this job's ``{"tp", "pp", "dp", "zero_stage"}``; ``rank`` and
    ``world_size`` its place in it (tp * pp * dp ranks).
    """

    def __init__(self, run_dir: str | Path, keep: int = 2, rank: int = 0, world_size: int = 1,
                 layout: Optional[dict] = None):
        self.root = Path(run_dir) / "checkpoints"
        self.keep, self.rank, self.world_size = keep, rank, world_size
        self.layout = layout or {"tp": 1, "pp": 1, "dp": world_size, "zero_stage": 0}

    @staticmethod
    def _name(step: int) -> str:
        return f"step_{step:08d}"

    # ------------------------------------------------------------ finding
    def incomplete(self) -> list[Path]:
        return sorted(self.root.glob("*.tmp")) if self.root.exists() else []

    def complete(self) -> list[Path]:
        """Published checkpoint directories that have a meta.json, oldest first."""
        if not self.root.exists():
            return []
        return sorted(p for p in self.root.glob("step_*") if not p.name.endswith(".tmp") and (p / META_FILE).exists())

    def latest(self) -> Optional[Path]:
        """The checkpoint ``latest`` names; None when there is no pointer.

        A pointer to a missing or incomplete directory is an error that names the
        older complete checkpoints, rather than a silent fall-back to one of them.
        """
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        if not (path / META_FILE).exists():
            raise CheckpointError(f"{pointer} names {path.name}, which has no {META_FILE} (deleted or corrupt); "
                                  f"{self._older_hint(path)}")
        return path

    def _older_hint(self, broken: Path) -> str:
        older = [p.name for p in self.complete() if p.name < broken.name]
        if not older:
            return "no older complete checkpoint exists; move the checkpoints directory away to start afresh"
        return (f"the newest older complete checkpoint is {older[-1]}: write that name into "
                f"{self.root / 'latest'} to resume from it")

    @staticmethod
    def read_meta(path: Path) -> dict:
        file = Path(path) / META_FILE
        try:
            meta = json.loads(file.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing: {path} is not a complete checkpoint") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{file} is corrupt (not JSON: {err})") from None
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(f"{file}: checkpoint format version {version}, this code reads version "
                                  f"{FORMAT_VERSION}")
        return meta

    # ------------------------------------------------------------ saving
    def save(self, step: int, objects: dict, extra: Optional[dict] = None) -> Path:
        """Write every object; collective over all ranks. ``extra`` goes into meta.json."""
        import torch.distributed.checkpoint as dcp

        final = self.root / self._name(step)
        tmp = self.root / (self._name(step) + ".tmp")
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / STATE_DIR).mkdir(parents=True)
        _barrier(self.world_size)
        sharded = {}
        for obj in objects.values():
            if _is_sharded(obj):
                sharded.update(obj.sharded_state_dict())
        global_state = {name: obj.state_dict() for name, obj in objects.items() if not _is_sharded(obj)}
        _fault("during_shards", self.rank, self.world_size)
        dcp.save(sharded, checkpoint_id=str(tmp / STATE_DIR))  # every rank its shards, in parallel
        _fault("after_shards", self.rank, self.world_size)
        if self.rank == 0:
            meta = {"format_version": FORMAT_VERSION, "step": step, "layout": self.layout,
                    "world_size": self.world_size, "state": global_state, **(extra or {})}
            write_text_durably(tmp / META_FILE, json.dumps(meta, indent=1))
            self._publish(tmp, final)
            _fault("before_pointer", self.rank, self.world_size)
            write_text_durably(self.root / "latest", final.name)
            self._prune()
        _barrier(self.world_size)
        return final

    def _publish(self, tmp: Path, final: Path) -> None:
        if final.exists():  # re-saving a step: set the old copy aside first (.tmp = ignored if we crash)
            aside = final.with_name(final.name + ".old.tmp")
            shutil.rmtree(aside, ignore_errors=True)
            os.replace(final, aside)
            os.replace(tmp, final)
            shutil.rmtree(aside)
        else:
            os.replace(tmp, final)

    def _prune(self) -> None:
        for old in self.complete()[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------ loading
    def check_model_config(self, path: Path, meta: dict, run_model: dict) -> None:
        """Refuse a checkpoint of another model, listing every differing key."""
        saved = (meta.get("config") or {}).get("model")
        if saved is None:
            raise CheckpointError(f"{path / META_FILE} records no model config")
        diff = config_diff(saved, run_model, "model")
        if diff:
            raise ConfigError("model", f"the checkpoint {path} holds another model than this run's config:\n  "
                              + "\n  ".join(diff))

    def same_layout(self, meta: dict) -> bool:
        saved = meta["layout"]
        return all(saved.get(k) == self.layout.get(k) for k in ("tp", "pp", "dp"))

    def load(self, path: Path, objects: dict, run_model_config: Optional[dict] = None) -> dict:
        """Restore every object from the checkpoint at ``path`` (collective); returns its metadata.

        ``meta["resharded"]`` is True when it was saved by another TP x PP x DP
        layout; layout-bound objects were then not restored.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        path = Path(path)
        meta = self.read_meta(path)
        if run_model_config is not None:
            self.check_model_config(path, meta, run_model_config)
        same = self.same_layout(meta)
        state_dir = path / STATE_DIR
        verify_state_files(state_dir)
        loaded = {}
        for obj in objects.values():
            if _is_sharded(obj) and (same or not getattr(obj, "layout_bound", False)):
                loaded.update(obj.load_targets())
        try:
            dcp.load(loaded, checkpoint_id=str(state_dir))  # in place, each rank the slices it needs
        except (Exception, CheckpointException) as err:  # DCP's (a BaseException) gathers every rank's failure
            raise CheckpointError(f"{state_dir}: cannot load the sharded state ({describe_load_failure(state_dir, err)})"
                                  ) from err
        for name, obj in objects.items():
            if not _is_sharded(obj):
                if name not in meta["state"]:
                    raise CheckpointError(f"{path / META_FILE} has no state for {name!r}")
                obj.load_state_dict(meta["state"][name])
            elif same or not getattr(obj, "layout_bound", False):
                obj.load_sharded_state_dict(loaded)
        return {**meta, "resharded": not same}
