"""The dataset index: what a prepared dataset holds, and how its files are opened.

``index.json`` sits next to the shards. It records everything the loader needs
without opening a shard: per-shard sample counts (so the global order is
computed from the index alone, which is what makes resuming exact), byte sizes
and SHA-256 checksums (so a truncated or corrupt shard is caught before any of
its samples is used), and the tokenizer, vocabulary size and ``seq_len``.

Sample keys are the sample's position in the dataset (``%010d``), so a shard's
first key follows from the counts of the shards before it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rlt_scale.errors import DataError

INDEX_NAME = "index.json"
FORMAT = "rlt-scale-shards/1"
LOCAL_URL = "{path}/{name}"


@dataclass(frozen=True)
class ShardInfo:
    """One tar shard as recorded at preparation time."""

    name: str
    """File name, relative to the dataset directory."""
    samples: int
    bytes: int
    sha256: str


@dataclass
class DatasetIndex:
    """Contents of ``index.json``; ``path`` and ``url`` say where it was read from."""

    seq_len: int
    """Each sample holds ``seq_len + 1`` tokens (inputs are ``[:-1]``, targets ``[1:]``)."""
    vocab_size: int
    tokenizer: str
    """``"byte"`` or a tokenizers JSON file, ready for ``load_tokenizer``: ``index.json`` stores the
    file name inside the dataset directory and :func:`read_index` turns it into a path."""
    shards: list[ShardInfo]
    token_dtype: str = "uint16"
    meta: dict[str, Any] = field(default_factory=dict)
    """Free-form provenance: the source, task parameters, document count."""
    format: str = FORMAT
    path: str = ""
    url: str = LOCAL_URL

    @property
    def num_samples(self) -> int:
        return sum(s.samples for s in self.shards)

    @property
    def shard_offsets(self) -> np.ndarray:
        """Dataset position of each shard's first sample (length ``len(shards) + 1``)."""
        return np.concatenate([[0], np.cumsum([s.samples for s in self.shards])]).astype(np.int64)

    def shard_url(self, shard: int) -> str:
        return shard_url(self.url, self.path, self.shards[shard].name)

    def to_json(self) -> str:
        record = asdict(self)
        for transient in ("path", "url"):
            record.pop(transient)
        if record["tokenizer"] != "byte":
            record["tokenizer"] = Path(record["tokenizer"]).name
        return json.dumps(record, indent=1)


def sample_key(position: int) -> str:
    """The ``__key__`` of the sample at this position of the dataset."""
    return f"{position:010d}"


def shard_url(template: str, path: str, name: str) -> str:
    return template.format(path=str(path).rstrip("/"), name=name)


def read_url(url: str) -> bytes:
    """Read a whole local file or webdataset URL (``pipe:``, ``http:`` ...) into memory.

    A failing command or a missing file raises DataError naming the URL, so a
    broken object-store command never looks like an empty shard.
    """
    from webdataset.gopen import gopen  # importing webdataset imports torch: keep it off module import

    try:
        stream = gopen(url, "rb")
        try:
            return stream.read()
        finally:
            stream.close()
    except Exception as exc:  # OSError, a pipe's non-zero exit, ...
        raise DataError(f"{url}: cannot read ({type(exc).__name__}: {exc})") from exc


def read_index(path: str | Path, url: str = LOCAL_URL) -> DatasetIndex:
    """Read ``index.json`` of the dataset at ``path`` (a directory, or the index file itself)."""
    path = str(path)
    if path.endswith(INDEX_NAME):
        path = path[: -len(INDEX_NAME)].rstrip("/") or "."
    location = shard_url(url, path, INDEX_NAME)
    if url == LOCAL_URL and not Path(location).is_file():
        raise DataError(f"{location}: no dataset index; prepare one with rlt-prepare --out {path}")
    try:
        record = json.loads(read_url(location))
        shards = [ShardInfo(**s) for s in record.pop("shards")]
        index = DatasetIndex(shards=shards, **record, path=path, url=url)
    except (ValueError, TypeError, KeyError) as exc:
        raise DataError(f"{location}: not a valid dataset index ({exc})") from exc
    if index.tokenizer != "byte":
        index.tokenizer = str(Path(path) / index.tokenizer)
    if index.format != FORMAT:
        raise DataError(f"{location}: format {index.format!r}, this loader reads {FORMAT!r}")
    if not index.shards or index.num_samples == 0:
        raise DataError(f"{location}: the dataset holds no samples")
    return index


def write_index(index: DatasetIndex, directory: str | Path) -> Path:
    out = Path(directory) / INDEX_NAME
    tmp = out.with_suffix(".tmp")
    tmp.write_text(index.to_json())
    tmp.replace(out)  # atomic: a reader never sees half an index
    return out


def file_sha256(path: str | Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()
