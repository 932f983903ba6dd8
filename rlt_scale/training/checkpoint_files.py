"""Reading checkpoint files without trusting them; writing small files durably.

A checkpoint directory may be truncated by a crash, garbled on disk or
planted by someone else. Before ``torch.distributed.checkpoint`` (DCP) reads
a sharded state, every rank runs :func:`verify_state_files` on it, which
either passes or raises a :class:`CheckpointError` naming the bad file -- the
same on every rank, so no rank is left waiting in a collective.

No code from a checkpoint ever runs. DCP's files are:

* ``.metadata`` -- the index, a plain pickle that DCP reads with
  ``pickle.load``. It is first unpickled here by an allowlist unpickler that
  resolves only the index's own dataclasses, ``torch.Size``, dtypes and
  layouts; anything else (a ``__reduce__`` calling ``os.system``, say) is
  refused before DCP reads the file.
* ``__<rank>_<n>.distcp`` -- one ``torch.save`` blob per tensor slice, which
  DCP reads with ``torch.load(weights_only=True)``; their sizes are checked
  here against the index. rlt-scale saves tensors only: DCP would unpickle
  non-tensor values with ``weights_only=False``.
"""

from __future__ import annotations

import io
import os
import pickle
from pathlib import Path

import torch

from rlt_scale.errors import CheckpointError

INDEX_FILE = ".metadata"

# Every global a DCP index of tensors refers to (measured with torch 2.13): plain
# dataclasses and enums, torch.Size, dtypes, a lookup of a layout by name, and the
# path the checkpoint was written to (a PosixPath).
_ALLOWED_GLOBALS = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
        "TensorProperties", "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.distributed.checkpoint.planner": {"SavePlan", "WriteItem", "WriteItemType", "TensorWriteData"},
    "torch.serialization": {"_get_layout"},
    "torch": {"Size"},
    "pathlib": {"PosixPath", "PurePosixPath"},
}


def _is_dtype_name(module: str, name: str) -> bool:
    return module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)


class _IndexUnpickler(pickle.Unpickler):
    """Unpickles a DCP index; any other global is refused."""

    def find_class(self, module: str, name: str):
        if name in _ALLOWED_GLOBALS.get(module, ()) or _is_dtype_name(module, name):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to load global {module}.{name}")


def read_index(file: Path):
    """The DCP ``Metadata`` in ``file``, read with the allowlist unpickler."""
    try:
        with open(file, "rb") as f:
            return _IndexUnpickler(io.BytesIO(f.read())).load()
    except FileNotFoundError:
        raise CheckpointError(f"{file} is missing: the sharded state was not completely written") from None
    except Exception as err:  # truncated/garbled pickles raise many types
        raise CheckpointError(f"{file} is corrupt or not a checkpoint index ({type(err).__name__}: {err})") from None


def _slices(state_dir: Path) -> dict[str, list[tuple[int, int]]]:
    """Per data file: the (offset, length) of every tensor slice the index places in it."""
    out: dict[str, list[tuple[int, int]]] = {}
    for info in (read_index(state_dir / INDEX_FILE).storage_data or {}).values():
        out.setdefault(info.relative_path, []).append((info.offset, info.length))
    return out


def verify_state_files(state_dir: Path) -> None:
    """Raise :class:`CheckpointError` naming the first missing, unsafe or truncated file of ``state_dir``."""
    for name, slices in sorted(_slices(state_dir).items()):
        file = state_dir / name
        size = max(offset + length for offset, length in slices)
        if not file.exists():
            raise CheckpointError(f"{file} is missing: the sharded state was not completely written")
        if file.stat().st_size < size:
            raise CheckpointError(f"{file} is truncated: {file.stat().st_size} bytes, the index needs {size}")


def describe_load_failure(state_dir: Path, err: Exception) -> str:
    """After DCP failed to load ``state_dir``: the first data file whose slices do not load, else ``err``.

    Reads every slice again (``weights_only=True``); only run on the failure path.
    torch's own message for an unreadable blob advises retrying with
    ``weights_only=False``, which would run code from the file: it is never
    repeated here. The file is simply called corrupt.
    """
    for name, slices in sorted(_slices(state_dir).items()):
        data = (state_dir / name).read_bytes()
        for offset, length in slices:
            try:
                torch.load(io.BytesIO(data[offset:offset + length]), map_location="cpu", weights_only=True)
            except Exception as cause:
                return (f"{state_dir / name} is corrupt: the tensor data at byte {offset} cannot be read "
                        f"({type(cause).__name__})")
    first = [line for line in str(err).strip().splitlines() if "weights_only" not in line]
    return f"{type(err).__name__}: {first[0] if first else 'see the traceback above'}"


# ----------------------------------------------------------------- checksums
HASH_NAME = "xxh3_128"
"""Content checksum of every checkpoint file: xxHash's XXH3-128, several GB/s on one core."""

_READ_BLOCK = 8 << 20


def file_digest(path: Path) -> str:
    """The :data:`HASH_NAME` hex digest of the file at ``path``, read in blocks."""
    import xxhash

    digest = xxhash.xxh3_128()
    buffer = bytearray(_READ_BLOCK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])
    return digest.hexdigest()


def describe_files(state_dir: Path, names: list[str]) -> dict[str, dict]:
    """``{name: {"bytes": size, HASH_NAME: digest}}`` of the files ``names`` of ``state_dir``."""
    return {name: {"bytes": (state_dir / name).stat().st_size, HASH_NAME: file_digest(state_dir / name)}
            for name in names}


def checksum_problems(state_dir: Path, manifest: dict[str, dict], names: list[str]) -> list[str]:
    """One message per file of ``names`` that is missing or whose size or content differs from ``manifest``."""
    problems = []
    for name in names:
        file, want = state_dir / name, manifest[name]
        if not file.exists():
            problems.append(f"{file} is missing")
        elif file.stat().st_size != want["bytes"]:
            problems.append(f"{file} has {file.stat().st_size} bytes, {want['bytes']} were saved")
        elif file_digest(file) != want[HASH_NAME]:
            problems.append(f"{file} is corrupt: its content checksum ({HASH_NAME}) differs from the one recorded "
                            f"at save")
    return problems


def write_text_durably(path: Path, text: str) -> None:
    """Replace ``path`` by ``text`` atomically: write a sibling, fsync it, rename it over."""
    tmp = path.with_name(path.name + ".writing")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
