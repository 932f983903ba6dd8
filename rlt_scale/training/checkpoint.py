"""Atomic, self-describing checkpoints of everything a run must restore.

Layout of ``<dir>/checkpoints``::

    step_00000100/state.pt   one file per checkpoint (model, optimizer, ...)
    latest                   name of the newest *complete* checkpoint

A checkpoint is written into ``step_N.tmp`` and published by renaming the
directory, then ``latest`` is replaced atomically; a crash at any moment
leaves the previous checkpoint loadable, and leftover ``.tmp`` directories
are reported and ignored. Loading uses ``weights_only=True``: a checkpoint
can never execute code.

This single-file format is the single-process foundation; the sharded,
reshardable format for multi-rank layouts replaces ``state.pt`` with per-rank
shards behind the same interface.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional, Protocol

import torch


class Stateful(Protocol):
    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class CheckpointManager:
    def __init__(self, run_dir: str | Path, keep: int = 2):
        self.root = Path(run_dir) / "checkpoints"
        self.keep = keep

    def _name(self, step: int) -> str:
        return f"step_{step:08d}"

    def incomplete(self) -> list[Path]:
        return sorted(self.root.glob("*.tmp")) if self.root.exists() else []

    def latest(self) -> Optional[Path]:
        pointer = self.root / "latest"
        if not pointer.exists():
            return None
        path = self.root / pointer.read_text().strip()
        return path if (path / "state.pt").exists() else None

    def save(self, step: int, objects: dict[str, Stateful], extra: Optional[dict] = None) -> Path:
        self.root.mkdir(parents=True, exist_ok=True)
        final = self.root / self._name(step)
        tmp = self.root / (self._name(step) + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        payload = {name: obj.state_dict() for name, obj in objects.items()}
        payload["meta"] = {"step": step, "format_version": 1, **(extra or {})}
        with open(tmp / "state.pt", "wb") as f:
            torch.save(payload, f)
            f.flush()
            os.fsync(f.fileno())
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        pointer_tmp = self.root / "latest.tmp-pointer"
        pointer_tmp.write_text(final.name)
        os.replace(pointer_tmp, self.root / "latest")
        self._prune()
        return final

    def load(self, path: Path, objects: dict[str, Stateful]) -> dict:
        """Restore every object from ``path``; returns the checkpoint's metadata."""
        payload = torch.load(path / "state.pt", map_location="cpu", weights_only=True)
        missing = set(objects) - set(payload)
        if missing:
            raise KeyError(f"{path}/state.pt lacks {sorted(missing)}")
        for name, obj in objects.items():
            obj.load_state_dict(payload[name])
        return payload["meta"]

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
