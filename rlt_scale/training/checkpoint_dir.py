"""Finding the checkpoints of a run directory, and starting a run there without harming them.

A run directory's ``checkpoints/`` holds published ``step_N`` directories,
leftover ``*.tmp`` ones of interrupted saves, and ``latest``, the name of the
newest complete one. :class:`CheckpointDirectory` reads all of that without
trusting it: a lost or garbled pointer is reported and the directories
scanned instead, a ``meta.json`` must parse and agree with its directory's
step, and a fresh run refuses a directory that already holds checkpoints.
Every ``meta.json`` records the ``run_id`` of the run that wrote it, so that
pruning (:mod:`rlt_scale.training.checkpoint`) removes only its own.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Optional

import torch.distributed as dist

from rlt_scale.errors import CheckpointError

FORMAT_VERSION = 2
META_FILE = "meta.json"
_STEP_DIR = re.compile(r"step_(\d+)")


def barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


class CheckpointDirectory:
    """The checkpoints of one run directory: finding them, reading their metadata, starting afresh.

    ``rank`` and ``world_size`` are this process's place in the job: rank 0
    alone prints and moves things; collectives keep the ranks in step.
    ``on_corrupt`` (``fallback`` or ``refuse``) is what :meth:`latest` does
    with a candidate whose ``meta.json`` cannot be read.
    ``run_id`` is None until :meth:`start_fresh` mints one or a resume adopts
    the loaded checkpoint's.
    """

    def __init__(self, run_dir: str | Path, rank: int = 0, world_size: int = 1, on_corrupt: str = "fallback"):
        self.run_dir = Path(run_dir)
        self.root = self.run_dir / "checkpoints"
        self.rank, self.world_size, self.on_corrupt = rank, world_size, on_corrupt
        self.run_id: Optional[str] = None

    @staticmethod
    def _name(step: int) -> str:
        return f"step_{step:08d}"

    @staticmethod
    def step_of(path: Path) -> Optional[int]:
        """N for a published directory ``step_N``; None for anything else (``.tmp``, set-aside copies)."""
        match = _STEP_DIR.fullmatch(Path(path).name)
        return int(match.group(1)) if match else None

    def _warn(self, message: str) -> None:
        if self.rank == 0:
            print(f"warning: {message}", flush=True)

    # ------------------------------------------------------------ finding
    def incomplete(self) -> list[Path]:
        return sorted(self.root.glob("*.tmp")) if self.root.exists() else []

    def published(self) -> list[Path]:
        """Every ``step_N`` directory, complete or not, oldest first."""
        if not self.root.exists():
            return []
        return sorted((p for p in self.root.iterdir() if self.step_of(p) is not None), key=self.step_of)

    def complete(self) -> list[Path]:
        """Published checkpoint directories that have a meta.json, oldest first."""
        return [p for p in self.published() if (p / META_FILE).exists()]

    def _pointer(self) -> tuple[Optional[Path], str]:
        """(the directory ``latest`` names, or None; why not, when None)."""
        pointer = self.root / "latest"
        try:
            name = pointer.read_text().strip()
        except FileNotFoundError:
            return None, f"{pointer} is missing"
        except (OSError, UnicodeDecodeError) as err:
            return None, f"{pointer} is unreadable ({err})"
        if self.step_of(Path(name)) is None:
            return None, f"{pointer} holds {name[:60]!r}, not a checkpoint name"
        if not (self.root / name).is_dir():
            return None, f"{pointer} names {name}, which does not exist"
        return self.root / name, ""

    def candidates(self) -> list[Path]:
        """Checkpoints to resume from, best first: the one ``latest`` names, then every other, newest first.

        A missing or unreadable pointer is reported, and the published
        directories are scanned instead. Whether a candidate is complete and
        intact is for :meth:`load` to find out.
        """
        target, why = self._pointer()
        scanned = self.published()[::-1]
        if target is None and scanned:
            self._warn(f"{why}; found {len(scanned)} checkpoint(s) in {self.root} by scanning, newest first")
        return ([target] if target else []) + [p for p in scanned if p != target]

    def latest(self) -> Optional[Path]:
        """The checkpoint to resume from without loading it: the first candidate with a readable meta.json.

        With ``on_corrupt="refuse"`` a pointer to a broken directory is an
        error naming the newest older complete checkpoint instead.
        """
        for path in self.candidates():
            try:
                self.read_meta(path)
                return path
            except CheckpointError as err:
                if self.on_corrupt == "refuse":
                    raise CheckpointError(f"{err}; {self._older_hint(path)}") from None
                self._warn(f"skipping {path.name}: {err}")
        return None

    def _older_hint(self, broken: Path) -> str:
        older = [p.name for p in self.complete() if self.step_of(p) < self.step_of(broken)]
        if not older:
            return "no older complete checkpoint exists"
        return (f"the newest older complete checkpoint is {older[-1]}: set checkpoint.on_corrupt=fallback "
                f"(the default) to resume from it")

    def read_meta(self, path: Path) -> dict:
        file = Path(path) / META_FILE
        try:
            meta = json.loads(file.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{file} is missing: {path} is not a complete checkpoint") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{file} is corrupt (not JSON: {err})") from None
        if not isinstance(meta, dict):
            raise CheckpointError(f"{file} is corrupt (a JSON {type(meta).__name__}, not an object)")
        version = meta.get("format_version")
        if version != FORMAT_VERSION:
            raise CheckpointError(f"{file}: checkpoint format version {version}, this code reads version "
                                  f"{FORMAT_VERSION}")
        named = self.step_of(Path(path))
        if named is not None and meta.get("step") != named:
            raise CheckpointError(f"{file} is corrupt: it records step {meta.get('step')!r} in the directory of "
                                  f"step {named}")
        return meta

    def _run_id_of(self, path: Path) -> Optional[str]:
        try:
            return json.loads((path / META_FILE).read_text()).get("run_id")
        except (OSError, ValueError, AttributeError):
            return None

    # ------------------------------------------------------------ starting
    def start_fresh(self, move_aside: bool = False) -> None:
        """Begin a new run here (collective). Refuses a directory that holds checkpoints, or moves them aside.

        A fresh run must never overwrite or prune what another run saved.
        """
        existing = self.published()
        barrier(self.world_size)  # every rank has looked before rank 0 moves anything
        if existing:
            if not move_aside:
                raise CheckpointError(
                    f"{self.root} holds checkpoints of an earlier run (newest {existing[-1].name}) and this run "
                    f"starts afresh (checkpoint.resume=false, or nothing to resume): it would overwrite them. Use "
                    f"a new checkpoint.dir, resume them with checkpoint.resume=true, or set "
                    f"checkpoint.move_aside=true to move them to {self.run_dir / 'previous'}/<time>/")
            if self.rank == 0:
                aside = self.run_dir / "previous" / time.strftime("%Y%m%d-%H%M%S")
                aside.mkdir(parents=True)
                for name in ("checkpoints", "metrics.jsonl", "config.yaml"):
                    if (self.run_dir / name).exists():
                        os.replace(self.run_dir / name, aside / name)
                print(f"moved the earlier run's checkpoints and metrics to {aside} (checkpoint.move_aside=true)",
                      flush=True)
            barrier(self.world_size)
        self.run_id = uuid.uuid4().hex
