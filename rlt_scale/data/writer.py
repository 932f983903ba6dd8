"""Write packed samples as webdataset tar shards plus ``index.json``.

A sample is stored as up to three ``.npy`` members under one key:
``tokens.npy`` (always), ``doc_ids.npy`` (only when the sample holds more
than one document) and ``loss_mask.npy`` (only when some token is not a
target). The loader fills in the defaults (all zeros, all True), which keeps
the shards of plain single-document text small: tar spends 512 bytes of
header plus padding on every member.
"""

from __future__ import annotations

import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from rlt_scale.data.index import DatasetIndex, ShardInfo, file_sha256, read_index, sample_key, write_index
from rlt_scale.data.tokenizer import BYTE_TOKENIZER
from rlt_scale.errors import DataError

SHARD_PATTERN = "shard-%06d.tar"
DEFAULT_SHARD_BYTES = 8_000_000


def token_dtype(vocab_size: int) -> np.dtype:
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)


def tar_member_bytes(array: np.ndarray) -> int:
    """Bytes an array takes in a tar as ``.npy``: a 512-byte header, then the data padded to 512."""
    npy_size = 128 + array.nbytes  # the .npy header of a 1-d array is 128 bytes
    return 512 + -(-npy_size // 512) * 512


class DatasetWriter:
    """Collects samples of one dataset (one split) into shards of about ``shard_bytes`` on disk.

    webdataset's ShardWriter writes the tar files; the writer starts a new
    shard itself once the file reaches ``shard_bytes``, because ShardWriter's own
    limit counts only the arrays, under half of the file for short samples. Shards
    are written with a fixed mtime, so preparing the same data twice gives
    byte-identical shards and checksums.
    """

    def __init__(self, out_dir: str | Path, *, seq_len: int, vocab_size: int, tokenizer: str = BYTE_TOKENIZER,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, meta: dict[str, Any] | None = None):
        from webdataset import ShardWriter  # imports torch; only preparation needs it

        self.out = Path(out_dir)
        self.out.mkdir(parents=True, exist_ok=True)
        for stale in [*self.out.glob("shard-*.tar"), self.out / "index.json"]:
            stale.unlink(missing_ok=True)  # never mix shards of an earlier run into the index
        self.seq_len, self.vocab_size = seq_len, vocab_size
        self.dtype = token_dtype(vocab_size)
        self.tokenizer = self._store_tokenizer(tokenizer)
        self.meta = dict(meta or {})
        self.count = 0
        self.shard_bytes = shard_bytes
        self._bytes_in_shard = 0
        self._per_shard: Counter[str] = Counter()
        self._writer = ShardWriter(str(self.out / SHARD_PATTERN), maxcount=2**62, maxsize=float("inf"),
                                   verbose=0, mtime=0)

    def _store_tokenizer(self, tokenizer: str) -> str:
        """Copy a tokenizer file into the dataset so the dataset alone is enough to decode it."""
        if tokenizer == BYTE_TOKENIZER:
            return tokenizer
        source = Path(tokenizer)
        if source.resolve() != (self.out / "tokenizer.json").resolve():
            shutil.copyfile(source, self.out / "tokenizer.json")
        return "tokenizer.json"

    def write(self, tokens: np.ndarray, doc_ids: np.ndarray | None = None, loss_mask: np.ndarray | None = None) -> None:
        """Add one sample of ``seq_len + 1`` tokens; a wrong length or id is a bug in the producer."""
        key = sample_key(self.count)
        if len(tokens) != self.seq_len + 1:
            raise DataError(f"sample {key}: {len(tokens)} tokens, expected seq_len + 1 = {self.seq_len + 1}")
        if tokens.min() < 0 or tokens.max() >= self.vocab_size:
            raise DataError(f"sample {key}: token id {int(tokens.max())} outside the vocabulary of {self.vocab_size}")
        sample = {"__key__": key, "tokens.npy": np.ascontiguousarray(tokens, dtype=self.dtype)}
        if doc_ids is not None and doc_ids.any():
            sample["doc_ids.npy"] = np.ascontiguousarray(doc_ids, dtype=np.int32)
        if loss_mask is not None and not loss_mask.all():
            sample["loss_mask.npy"] = np.ascontiguousarray(loss_mask, dtype=bool)
        if self._bytes_in_shard >= self.shard_bytes:
            self.start_new_shard()
        self._writer.write(sample)
        self._bytes_in_shard += sum(tar_member_bytes(v) for k, v in sample.items() if k != "__key__")
        self._per_shard[self._writer.fname] += 1
        self.count += 1

    def start_new_shard(self) -> None:
        """Close the current shard; the next sample opens a new one (no-op while the current one is empty)."""
        if self._per_shard[self._writer.fname]:
            self._writer.next_stream()
            self._bytes_in_shard = 0

    def close(self) -> DatasetIndex:
        """Finish the last shard, checksum every shard and write the index."""
        self._writer.close()
        if self.count == 0:
            raise DataError(f"{self.out}: no samples were produced; the source is empty or shorter than one sample")
        shards = []
        for fname, samples in self._per_shard.items():  # insertion order = shard order
            path = Path(fname)
            shards.append(ShardInfo(name=path.name, samples=samples, bytes=path.stat().st_size,
                                    sha256=file_sha256(path)))
        index = DatasetIndex(seq_len=self.seq_len, vocab_size=self.vocab_size, tokenizer=self.tokenizer,
                             shards=shards, token_dtype=self.dtype.name, meta=self.meta)
        write_index(index, self.out)
        return read_index(self.out)  # exactly what a loader will see
