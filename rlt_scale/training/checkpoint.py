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
  every rank, JSON-serialisable; rank 0 writes it into ``meta.json``. Loading
  restores it after every sharded object.

Saving: every rank writes into ``step_N.tmp/state``; after that collective,
the ranks checksum the files between them, rank 0 writes ``meta.json`` (with
the checksums and the run id), publishes the directory by renaming it,
replaces ``latest`` atomically and prunes this run's older checkpoints. A
crash at any moment leaves the previous checkpoint loadable; leftover
``.tmp`` directories are ignored and reported. A failed save (a full disk)
removes its partial copy and says that the previous checkpoint is intact.

Loading verifies every file's checksum first, and never unpickles code: see
:mod:`rlt_scale.training.checkpoint_files`. Which checkpoint to load, and
whether a fresh run may start: :mod:`rlt_scale.training.checkpoint_dir`.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Optional, Protocol

import torch.distributed as dist

from rlt_scale.config import ModelConfig
from rlt_scale.errors import CheckpointError, ConfigError
from rlt_scale.training.checkpoint_dir import FORMAT_VERSION, META_FILE, CheckpointDirectory, barrier
from rlt_scale.training.checkpoint_files import (
    checksum_problems, describe_files, describe_load_failure, verify_state_files, write_text_durably)

STATE_DIR = "state"
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


def _broadcast(value, world_size: int):
    """Rank 0's ``value`` on every rank."""
    if world_size == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _merge_dicts(part: dict, world_size: int) -> dict:
    """The union of every rank's ``part``, on every rank."""
    if world_size == 1:
        return part
    parts = [None] * world_size
    dist.all_gather_object(parts, part)
    return {k: v for p in parts for k, v in p.items()}


def _rank_failures(err: BaseException) -> list[BaseException]:
    """The per-rank exceptions a DCP ``CheckpointException`` gathered; [] for any other error."""
    return [f[0] if isinstance(f, tuple) else f for f in getattr(err, "failures", {}).values()]


def _disk_full(err: BaseException, directory: Path) -> bool:
    """Whether a failed save ran out of space.

    torch's zip writer reports a full disk as ``unexpected pos`` without an
    errno, so besides ENOSPC anywhere in the chain, an almost full file
    system counts as the cause.
    """
    seen, todo = set(), [err]
    while todo:
        e = todo.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            return True
        todo += [e.__cause__, e.__context__, *_rank_failures(e)]
    if "No space left on device" in str(err):
        return True
    existing = next(p for p in (directory, *directory.parents) if p.exists())
    return shutil.disk_usage(existing).free < (1 << 20)


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

class CheckpointManager(CheckpointDirectory):
    """Save, find and load the checkpoints of one run directory.

    ``layout`` is this job's ``{"tp", "pp", "dp", "zero_stage"}``; ``rank`` and
    ``world_size`` its place in it (tp * pp * dp ranks). ``on_corrupt`` is
    ``checkpoint.on_corrupt``: what :meth:`resume` does with a checkpoint that
    fails to load (``fallback`` to the next older one, or ``refuse``).

    ``run_id`` names the run that writes here; it is recorded in every
    ``meta.json``, and pruning only ever removes older checkpoints of the same
    run. :meth:`resume` adopts the loaded checkpoint's id;
    :meth:`~CheckpointDirectory.start_fresh` mints a new one.
    """

    def __init__(self, run_dir: str | Path, keep: int = 2, rank: int = 0, world_size: int = 1,
                 layout: Optional[dict] = None, on_corrupt: str = "fallback"):
        super().__init__(run_dir, rank, world_size, on_corrupt)
        self.keep = keep
        self.layout = layout or {"tp": 1, "pp": 1, "dp": world_size, "zero_stage": 0}

    # ------------------------------------------------------------ saving
    def save(self, step: int, objects: dict, extra: Optional[dict] = None) -> Path:
        """Write every object; collective over all ranks. ``extra`` goes into meta.json.

        A failure while writing (a full disk, say) removes the partial copy and
        raises a :class:`CheckpointError` saying that the previous checkpoint is intact.
        """
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.api import CheckpointException

        self.run_id = self.run_id or uuid.uuid4().hex
        final = self.root / self._name(step)
        tmp = self.root / (self._name(step) + ".tmp")
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            (tmp / STATE_DIR).mkdir(parents=True)
        barrier(self.world_size)
        sharded = {}
        for obj in objects.values():
            if _is_sharded(obj):
                sharded.update(obj.sharded_state_dict())
        global_state = {name: obj.state_dict() for name, obj in objects.items() if not _is_sharded(obj)}
        _fault("during_shards", self.rank, self.world_size)
        try:
            dcp.save(sharded, checkpoint_id=str(tmp / STATE_DIR))  # every rank its shards, in parallel
            _fault("after_shards", self.rank, self.world_size)
            files = self._checksums(tmp / STATE_DIR)
            if self.rank == 0:
                meta = {"format_version": FORMAT_VERSION, "step": step, "run_id": self.run_id,
                        "layout": self.layout, "world_size": self.world_size, "state": global_state,
                        "files": files, **(extra or {})}
                write_text_durably(tmp / META_FILE, json.dumps(meta, indent=1))
        except (Exception, CheckpointException) as err:  # DCP's (a BaseException) gathers every rank's failure
            raise self._save_failed(step, tmp, err) from err
        if self.rank == 0:
            self._publish(tmp, final)
            _fault("before_pointer", self.rank, self.world_size)
            write_text_durably(self.root / "latest", final.name)
            self._prune(final)
        barrier(self.world_size)
        return final

    def _checksums(self, state_dir: Path) -> dict:
        """Content checksums of every file of ``state_dir`` (collective: the ranks split the files)."""
        names = sorted(p.name for p in state_dir.iterdir()) if self.rank == 0 else None
        names = _broadcast(names, self.world_size)
        return _merge_dicts(describe_files(state_dir, names[self.rank::self.world_size]), self.world_size)

    def _save_failed(self, step: int, tmp: Path, err: BaseException) -> CheckpointError:
        full = _disk_full(err, self.root)
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)  # frees the space the partial copy took
        target, _ = self._pointer()
        previous = f"the previous checkpoint ({target.name}) is intact" if target else "no earlier checkpoint exists"
        if full:
            return CheckpointError(f"no space left on device while saving step {step} to {self.root}; {previous}")
        cause = (_rank_failures(err) or [err])[0]
        first = (str(cause).strip().splitlines() or [""])[0][:300]
        return CheckpointError(f"saving step {step} to {self.root} failed ({type(cause).__name__}: {first}); "
                               f"{previous}")

    def _publish(self, tmp: Path, final: Path) -> None:
        if final.exists():
            if self._run_id_of(final) == self.run_id:  # re-saving a step of this run: replace it
                aside = final.with_name(final.name + ".old.tmp")  # .tmp = ignored if we crash
                shutil.rmtree(aside, ignore_errors=True)
                os.replace(final, aside)
                os.replace(tmp, final)
                shutil.rmtree(aside)
                return
            kept = final.with_name(f"{final.name}.superseded-{time.strftime('%Y%m%d-%H%M%S')}")
            self._warn(f"{final} was not written by this run: kept as {kept.name}")
            os.replace(final, kept)
        os.replace(tmp, final)

    def _prune(self, published: Path) -> None:
        """Remove this run's checkpoints older than ``published``, beyond the newest ``keep``."""
        step = self.step_of(published)
        ours = [p for p in self.complete() if self.step_of(p) < step and self._run_id_of(p) == self.run_id]
        for old in ours[: max(len(ours) - (self.keep - 1), 0)]:
            shutil.rmtree(old, ignore_errors=True)

    # ------------------------------------------------------------ loading
    def check_model_config(self, path: Path, meta: dict, run_model: dict) -> None:
        """Refuse a checkpoint of another model, listing every differing key.

        Keys that only choose how the decoder is computed
        (:attr:`ModelConfig.EXECUTION_KEYS`) may differ: the same weights, the same model.
        """
        saved = (meta.get("config") or {}).get("model")
        if saved is None:
            raise CheckpointError(f"{path / META_FILE} records no model config")
        how = set(ModelConfig.EXECUTION_KEYS)
        diff = config_diff({k: v for k, v in saved.items() if k not in how},
                           {k: v for k, v in run_model.items() if k not in how}, "model")
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
        self._verify_checksums(state_dir, meta)
        loaded = {}
        for obj in objects.values():
            if _is_sharded(obj) and (same or not getattr(obj, "layout_bound", False)):
                loaded.update(obj.load_targets())
        try:
            dcp.load(loaded, checkpoint_id=str(state_dir))  # in place, each rank the slices it needs
        except (Exception, CheckpointException) as err:  # DCP's (a BaseException) gathers every rank's failure
            raise CheckpointError(f"{state_dir}: cannot load the sharded state ({describe_load_failure(state_dir, err)})"
                                  ) from err
        for obj in objects.values():
            if _is_sharded(obj) and (same or not getattr(obj, "layout_bound", False)):
                obj.load_sharded_state_dict(loaded)
        # The global state last: an object saved in two parts (early stopping's counters and its kept
        # weights) can then settle its sharded part against its global one.
        for name, obj in objects.items():
            if not _is_sharded(obj):
                if name not in meta["state"]:
                    raise CheckpointError(f"{path / META_FILE} has no state for {name!r}")
                obj.load_state_dict(meta["state"][name])
        return {**meta, "resharded": not same}

    def _verify_checksums(self, state_dir: Path, meta: dict) -> None:
        """Compare every file with the checksum recorded at save (collective: the ranks split the files).

        Every rank raises the same error, naming each bad file, so none is left
        waiting in a later collective. Checkpoints written before checksums
        were recorded have no ``files`` entry and are only size-checked.
        """
        manifest = meta.get("files")
        if manifest is None:
            return
        names = sorted(manifest)
        problems = checksum_problems(state_dir, manifest, names[self.rank::self.world_size])
        problems = sorted(_merge_dicts({p: None for p in problems}, self.world_size))
        if problems:
            raise CheckpointError("; ".join(problems))

    def resume(self, objects: dict, run_model_config: Optional[dict] = None) -> Optional[dict]:
        """Load the best candidate (collective); its metadata, or None when there is no checkpoint at all.

        A candidate that fails to load (incomplete, corrupt, checksum mismatch)
        is skipped with a warning under ``on_corrupt="fallback"`` and the next
        older one is tried; under ``"refuse"`` its error is raised. A checkpoint
        of another model is always refused. When every candidate fails, the
        error lists them all: a run never silently starts afresh over them.
        """
        candidates = self.candidates()
        failures = []
        for i, path in enumerate(candidates):
            try:
                meta = self.load(path, objects, run_model_config)
            except CheckpointError as err:
                failures.append(f"{path.name}: {err}")
                if self.on_corrupt == "refuse":
                    raise CheckpointError(f"{err} (checkpoint.on_corrupt=refuse; "
                                          f"{self._older_hint(path)})") from None
                rest = candidates[i + 1:]
                self._warn(f"cannot resume from {path.name}: {err}; "
                           + (f"falling back to {rest[0].name}" if rest else "no older checkpoint is left"))
                continue
            self.run_id = meta.get("run_id") or uuid.uuid4().hex
            return {**meta, "path": str(path), "skipped": [p.name for p in candidates[:i]]}
        if failures:
            raise CheckpointError(f"no checkpoint in {self.root} can be loaded:\n  " + "\n  ".join(failures)
                                  + "\nmove the directory away (or set checkpoint.move_aside=true with "
                                    "checkpoint.resume=false) to start afresh")
        return None
