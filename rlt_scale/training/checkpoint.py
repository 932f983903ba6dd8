"""Atomic, self-describing checkpoints of everything a run must restore.

Layout of ``<dir>/checkpoints``::

    step_00000100/rank_00000.pt   each rank's own state (model shard, optimizer, RNG, ...)
    step_00000100/meta.json       step, world size, config; written last
    latest                        name of the newest *complete* checkpoint

Every rank writes its file in parallel into ``step_N.tmp``; after a barrier
rank 0 writes ``meta.json``, publishes the directory by renaming it, and
replaces ``latest`` atomically. A crash at any moment leaves the previous
checkpoint loadable; leftover ``.tmp`` directories are reported and ignored.
Loading uses ``weights_only=True``: a checkpoint can never execute code.

These files load back into the same layout; resharding into another
TP x PP x DP layout is the job of the distributed checkpoint format that
replaces the per-rank files behind this same interface.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Optional, Protocol

import torch
import torch.distributed as dist

FORMAT_VERSION = 1


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


def _barrier(world_size: int) -> None:
    if world_size > 1:
        dist.barrier()


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep: int = 2, rank: int = 0, world_size: int = 1):
        self.root = Path(run_dir) / "checkpoints"
        self.keep, self.rank, self.world_size = keep, rank, world_size

    @staticmethod
    def _name(step: int) -> str:
        return f"step_{step:08d}"

    def _file(self, directory: Path, rank: Optional[int] = None) -> Path:
        return directory / f"rank_{self.rank if rank is None else rank:05d}.pt"

    def incomplete(self) -> list[Path]:
        return sorted(self.root.glob("*.tmp")) if self.root.exists() else []

    def latest(self) -> Optional[Path]:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / "meta.json").exists() else None

    def save(self, step: int, objects: dict[str, Stateful], extra: Optional[dict] = None) -> Path:
        final = self.root / self._name(step)
        tmp = self.root / (self._name(step) + ".tmp")
        if self.rank == 0:
            self.root.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
        _barrier(self.world_size)
        payload = {name: obj.state_dict() for name, obj in objects.items()}
        with open(self._file(tmp), "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        _barrier(self.world_size)
        if self.rank == 0:
            meta = {"step": step, "format_version": FORMAT_VERSION, "world_size": self.world_size, **(extra or {})}
            (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
            if final.exists():
                shutil.rmtree(final)
            os.replace(tmp, final)
            pointer_tmp = self.root / "latest.tmp-pointer"
            pointer_tmp.write_text(final.name)
            os.replace(pointer_tmp, self.root / "latest")
            self._prune()
        _barrier(self.world_size)
        return final

    @staticmethod
    def read_meta(path: Path) -> dict:
        return json.loads((path / "meta.json").read_text())

    def read_payload(self, path: Path, rank: Optional[int] = None) -> dict:
        return torch.load(self._file(path, rank), map_location="cpu", weights_only=True)

    def load(self, path: Path, objects: dict[str, Stateful]) -> dict:
        """Restore every object from this rank's file in ``path``; returns the metadata."""
        meta = self.read_meta(path)
        if meta["world_size"] != self.world_size:
            raise ValueError(
                f"{path} was saved by {meta['world_size']} ranks, this job has {self.world_size}; "
                "loading into another layout needs the reshardable checkpoint format"
            )
        payload = self.read_payload(path)
        missing = set(objects) - set(payload)
        if missing:
            raise KeyError(f"{self._file(path)} lacks {sorted(missing)}")
        for name, obj in objects.items():
            obj.load_state_dict(payload[name])
        return meta

    def _prune(self) -> None:
        done = sorted(p for p in self.root.glob("step_*") if not p.name.endswith(".tmp"))
        for old in done[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


class RNGState:
    """The generators a resumed run needs to continue identically."""

    def state_dict(self) -> dict:
        state = {"torch": torch.get_rng_state()}
        if torch.cuda.is_available():
            state["cuda"] = torch.cuda.get_rng_state()
        return state

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["torch"])
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state(state["cuda"])
