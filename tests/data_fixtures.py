"""Helpers for the data tests: tiny datasets whose samples say which sample they are."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path
from typing import Callable

import numpy as np

from rlt_scale.data.config import DataConfig
from rlt_scale.data.index import DatasetIndex, ShardInfo, file_sha256, read_index, write_index
from rlt_scale.data.writer import DatasetWriter

SEQ_LEN = 15
VOCAB = 259
UNEVEN_SHARDS = (7, 13, 5, 11, 9)  # 45 samples: batches straddle shard boundaries


def numbered_tokens(position: int, seq_len: int = SEQ_LEN) -> np.ndarray:
    """Tokens of the sample at dataset position ``position``: the position in the first two ids, then a ramp."""
    tokens = (np.arange(seq_len + 1) + position) % 256
    tokens[0], tokens[1] = position // 256, position % 256
    return tokens


def write_numbered_dataset(out: Path, shard_sizes=UNEVEN_SHARDS, seq_len: int = SEQ_LEN) -> DatasetIndex:
    """A dataset with the given shard sizes; every third sample holds two documents and a partial loss mask."""
    writer = DatasetWriter(out, seq_len=seq_len, vocab_size=VOCAB)
    position = 0
    for size in shard_sizes:
        for _ in range(size):
            doc_ids = np.zeros(seq_len + 1, dtype=np.int64)
            mask = np.ones(seq_len + 1, dtype=bool)
            if position % 3 == 0:
                doc_ids[seq_len // 2:] = 1
                mask[: seq_len // 2] = False
            writer.write(numbered_tokens(position, seq_len), doc_ids, mask)
            position += 1
        writer.start_new_shard()
    return writer.close()


def positions_of(batch) -> list[int]:
    """The dataset position of each row; -1 for padding rows (loss mask all False, tokens 0)."""
    tokens, mask = batch["tokens"].numpy(), batch["loss_mask"].numpy()
    return [int(t[0]) * 256 + int(t[1]) if m.any() else -1 for t, m in zip(tokens, mask)]


def config(path: Path, **overrides) -> DataConfig:
    return DataConfig(path=str(path), **overrides)


def take(iterator, n: int) -> list:
    return [next(iterator) for _ in range(n)]


def rewrite_shard(dataset: Path, shard: int, mutate: Callable[[str, str, bytes], bytes | None]) -> None:
    """Rewrite one shard member by member through ``mutate(key, suffix, data)`` (None drops the member) and
    re-record its size and checksum: a producer that wrote bad data with a valid index."""
    index = read_index(dataset)
    info = index.shards[shard]
    path = dataset / info.name
    members = []
    with tarfile.open(path) as tar:
        for member in tar.getmembers():
            key, suffix = member.name.split(".", 1)
            data = mutate(key, suffix, tar.extractfile(member).read())
            if data is not None:
                members.append((member.name, data))
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for name, data in members:
            entry = tarfile.TarInfo(name)
            entry.size = len(data)
            tar.addfile(entry, io.BytesIO(data))
    index.shards[shard] = ShardInfo(info.name, info.samples, path.stat().st_size, file_sha256(path))
    write_index(index, dataset)


def npy(array: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()
