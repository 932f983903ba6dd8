"""Read and check the samples of one shard.

A shard is read whole into memory, its size and SHA-256 are checked against
the index, and only then are its samples parsed (webdataset's layout: tar
members ``KEY.SUFFIX`` grouped by key). So a truncated or corrupt shard fails
before any of its samples reaches the model. Each sample is checked too (key in sequence, ``seq_len + 1`` tokens,
ids inside the vocabulary, well-formed document ids and loss mask), because a
checksum only proves that the file is what the producer wrote.

Every problem names the shard file and, where there is one, the sample key.
With ``on_error="raise"`` the first problem raises :class:`DataError`; with
``"skip"`` each sample that cannot be delivered is replaced by a padding row
(token 0, document 0, loss mask all False), counted, and described in the
result's ``problems`` for the loader to warn about. Padding instead of dropping
keeps every rank's batches aligned with the global order.

:func:`fetch_shard` is the one place a shard's bytes are fetched and checked
against the index; the read path here and the start-up pass
(:func:`verify_shards`, ``data.verify: start``) both call it.
"""

from __future__ import annotations

import hashlib
import io
import sys
import tarfile
from typing import Iterable, Iterator

import numpy as np

from rlt_scale.data.index import DatasetIndex, read_url, sample_key
from rlt_scale.data.order import Segment
from rlt_scale.errors import DataError


class SkippedDataWarning(UserWarning):
    """A bad shard or sample was skipped because ``data.on_error`` is ``"skip"``."""


class ShardError(DataError):
    """A whole shard cannot be used: unreadable, or its size or SHA-256 is not what the index records.

    ``where`` names the shard file and its URL, ``detail`` says what is wrong
    (expected and actual values); the message is ``"{where}: {detail}"``.
    """

    def __init__(self, where: str, detail: str):
        super().__init__(f"{where}: {detail}")
        self.where, self.detail = where, detail


def shard_where(index: DatasetIndex, shard: int) -> str:
    """How messages name a shard: ``shard NAME (URL)``."""
    return f"shard {index.shards[shard].name} ({index.shard_url(shard)})"


def check_shard_bytes(index: DatasetIndex, shard: int, data: bytes) -> None:
    """Raise :class:`ShardError` unless ``data`` has the size and SHA-256 the index records for ``shard``."""
    info = index.shards[shard]
    if len(data) != info.bytes:
        raise ShardError(shard_where(index, shard),
                         f"{len(data)} bytes, the index says {info.bytes} (truncated or replaced)")
    digest = hashlib.sha256(data).hexdigest()
    if digest != info.sha256:
        raise ShardError(shard_where(index, shard), f"SHA-256 {digest[:16]}... does not match the index "
                                                    f"({info.sha256[:16]}...): the shard is corrupt")


def fetch_shard(index: DatasetIndex, shard: int, *, verify: bool = True) -> bytes:
    """The bytes of shard number ``shard`` read through the index's URL template, checked when ``verify``.

    Raises :class:`ShardError` when the shard cannot be read or (``verify``) fails the check.
    """
    try:
        data = read_url(index.shard_url(shard))
    except DataError as exc:
        raise ShardError(shard_where(index, shard), f"cannot read ({exc.__cause__})") from exc
    if verify:
        check_shard_bytes(index, shard, data)
    return data


def shards_of_rank(num_shards: int, dp_rank: int, dp_size: int) -> range:
    """The shards DP rank ``dp_rank`` checks at start-up: ``dp_rank, dp_rank + dp_size, ...``."""
    return range(dp_rank, num_shards, dp_size)


_VERIFIED: set[tuple[str, int, str]] = set()
"""(URL, bytes, sha256) of the shards that passed :func:`verify_shards` in this process."""


def verify_shards(index: DatasetIndex, shards: Iterable[int], *, on_error: str = "raise",
                  progress: bool = True) -> list[str]:
    """Fetch and check each of ``shards`` against the index before any of its samples is used.

    With ``on_error="raise"`` the first bad shard raises :class:`ShardError`
    (naming the file, expected and actual size or checksum); with ``"skip"``
    the messages of the bad shards are returned. A shard this process already
    verified at the same URL, size and checksum (the eval set's loader is
    rebuilt at every evaluation) is not fetched again. ``progress`` shows a bar
    (bytes and shards) on stderr when it is a terminal and the pass takes over
    a second.
    """
    from tqdm import tqdm

    todo = [s for s in shards if _verified_key(index, s) not in _VERIFIED]
    problems: list[str] = []
    total = sum(index.shards[s].bytes for s in todo)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"verify {index.path}", file=sys.stderr, delay=1.0,
              disable=None if progress else True) as bar:
        for done, shard in enumerate(todo, 1):
            try:
                fetch_shard(index, shard)
            except ShardError as exc:
                if on_error == "raise":
                    raise
                problems.append(str(exc))
            else:
                _VERIFIED.add(_verified_key(index, shard))
            bar.set_postfix_str(f"{done}/{len(todo)} shards", refresh=False)
            bar.update(index.shards[shard].bytes)
    return problems


def _verified_key(index: DatasetIndex, shard: int) -> tuple[str, int, str]:
    info = index.shards[shard]
    return index.shard_url(shard), info.bytes, info.sha256


def padding_rows(rows: int, width: int, token_dtype: str | np.dtype = np.int64) -> dict[str, np.ndarray]:
    """Rows that contribute nothing to the loss: stand-ins for skipped samples and the end of an eval pass.

    Arrays stay in the compact stored dtypes until the loader builds a batch,
    which keeps what a worker sends to the training process small.
    """
    return {"tokens": np.zeros((rows, width), dtype=token_dtype), "doc_ids": np.zeros((rows, width), dtype=np.int32),
            "loss_mask": np.zeros((rows, width), dtype=bool)}


def iter_tar_samples(data: bytes) -> Iterator[tuple[str, dict[str, bytes]]]:
    """(key, {suffix: bytes}) for each sample of a tar held in memory, in stored order.

    A sample is yielded as soon as the next sample's first header is read, before
    that member's data, so when the stream breaks, every sample before the broken
    one has been delivered and the break is attributed to the right key. Keys and
    suffixes are split the webdataset way (at the first dot of the file name).
    """
    from webdataset.tariterators import base_plus_ext

    stream = tarfile.open(fileobj=io.BytesIO(data), mode="r|*")
    key, members = None, {}
    for member in stream:
        if not member.isreg():
            continue
        prefix, suffix = base_plus_ext(member.name)
        if prefix != key:
            if key is not None:
                yield key, members
            key, members = prefix, {}
        members[suffix] = stream.extractfile(member).read()
        stream.members = []  # streaming: do not keep every header
    if key is not None:
        yield key, members


_NPY_HEADERS: dict[bytes, tuple[np.dtype, tuple[int, ...]]] = {}


def load_npy(raw: bytes) -> np.ndarray:
    """``np.load`` of a 1-d ``.npy`` member, remembering parsed headers.

    numpy parses every header with ``ast.literal_eval`` (~0.2 ms, half the cost
    of reading a sample), but all samples of a dataset share a handful of
    headers, so each distinct header is parsed once and the data viewed directly.
    """
    if raw[:6] != b"\x93NUMPY" or len(raw) < 12:
        raise ValueError("missing the .npy magic string")
    start = 10 + int.from_bytes(raw[8:10], "little") if raw[6] == 1 else 12 + int.from_bytes(raw[8:12], "little")
    known = _NPY_HEADERS.get(raw[:start])
    if known is None:
        array = np.load(io.BytesIO(raw), allow_pickle=False)
        if array.ndim == 1 and len(_NPY_HEADERS) < 256:
            _NPY_HEADERS[raw[:start]] = (array.dtype, array.shape)
        return array
    dtype, shape = known
    if len(raw) - start != dtype.itemsize * shape[0]:
        raise ValueError(f"{len(raw) - start} data bytes for {shape[0]} items of {dtype}")
    return np.frombuffer(raw, dtype=dtype, offset=start)


class ShardReader:
    """Delivers the samples a :class:`Segment` asks for; usable as a map-style DataLoader dataset.

    ``reader[segment]`` returns ``{"tokens", "doc_ids", "loss_mask"}`` arrays of
    shape ``[len(segment.local), seq_len + 1]`` plus ``"skipped"`` (count) and
    ``"problems"`` (messages).
    """

    def __init__(self, index: DatasetIndex, *, on_error: str = "raise", verify_checksums: bool = True):
        self.index, self.on_error, self.verify_checksums = index, on_error, verify_checksums
        self.width = index.seq_len + 1
        self._offsets = index.shard_offsets

    def __getitem__(self, segment: Segment) -> dict:
        return self.read(segment.shard, segment.local)

    def read(self, shard: int, local: np.ndarray) -> dict:
        """The samples at indices ``local`` of shard number ``shard``, in that order."""
        out = padding_rows(len(local), self.width, self.index.token_dtype)
        filled = np.zeros(len(local), dtype=bool)
        problems: list[str] = []
        info = self.index.shards[shard]
        where = shard_where(self.index, shard)

        def problem(message: str) -> None:
            if self.on_error == "raise":
                raise DataError(f"{where}: {message}")
            problems.append(f"{where}: {message}")

        data = self._fetch(shard, problem)
        if data is not None:
            slot_of = {int(i): slot for slot, i in enumerate(local)}
            self._parse(data, int(self._offsets[shard]), info.samples, slot_of, out, filled, problem)
        skipped = int((~filled).sum())
        out.update(skipped=skipped, problems=problems)
        return out

    def _fetch(self, shard: int, problem) -> bytes | None:
        """The shard's bytes, or None after reporting why they cannot be used."""
        try:
            return fetch_shard(self.index, shard, verify=self.verify_checksums)
        except ShardError as exc:
            detail = exc.detail
        problem(detail)  # outside the except block: under "raise" one error, not a chained pair
        return None

    def _parse(self, data: bytes, first: int, expected_count: int, slot_of: dict[int, int],
               out: dict[str, np.ndarray], filled: np.ndarray, problem) -> None:
        """Walk every sample (to check keys and count), decoding those this rank asked for."""
        count = 0
        try:
            for position, (key, members) in enumerate(iter_tar_samples(data)):
                expected = sample_key(first + position)
                if key != expected:
                    problem(f"sample {position} has key {key!r}, expected {expected!r}: the shard is out of order")
                    return
                count = position + 1
                slot = slot_of.get(position)
                if slot is not None:
                    filled[slot] = self._decode(key, members, out, slot, problem)
        except DataError:
            raise
        except Exception as exc:  # tarfile.ReadError and friends
            problem(f"tar stream breaks at sample key {sample_key(first + count)!r} after {count} of "
                    f"{expected_count} samples: truncated or corrupt ({type(exc).__name__}: {exc})")
            return
        if count != expected_count:
            detail = (f"first missing key {sample_key(first + count)!r}" if count < expected_count
                      else "it has extra samples")
            problem(f"holds {count} samples, the index says {expected_count} ({detail}): truncated or corrupt")

    def _decode(self, key: str, members: dict[str, bytes], out: dict[str, np.ndarray], slot: int, problem) -> bool:
        """Check one sample and copy it into row ``slot`` of ``out``; False after reporting a problem."""
        def bad(message: str) -> bool:
            problem(f"sample key {key!r}: {message}")
            return False

        if "tokens.npy" not in members:
            return bad(f"no tokens.npy (members: {sorted(members)})")
        arrays = {}
        for name in ("tokens", "doc_ids", "loss_mask"):
            if name + ".npy" in members:
                try:
                    arrays[name] = load_npy(members[name + ".npy"])
                except Exception as exc:
                    return bad(f"{name}.npy is not a valid .npy array ({exc})")
        for name, array in arrays.items():
            if array.shape != (self.width,):
                return bad(f"{name} has shape {array.shape}, expected ({self.width},) = seq_len + 1")
        tokens = arrays["tokens"]
        if tokens.dtype.kind not in "iu":
            return bad(f"tokens have dtype {tokens.dtype}, expected integers")
        low, high = int(tokens.min()), int(tokens.max())
        if low < 0 or high >= self.index.vocab_size:
            return bad(f"token id {high if high >= self.index.vocab_size else low} outside the vocabulary "
                       f"[0, {self.index.vocab_size})")
        doc_ids = arrays.get("doc_ids")
        if doc_ids is not None and (doc_ids.dtype.kind not in "iu" or doc_ids[0] != 0
                                    or not np.isin(np.diff(doc_ids), (0, 1)).all()):
            return bad("doc_ids must start at 0 and grow by 0 or 1 per token")
        mask = arrays.get("loss_mask")
        if mask is not None and mask.dtype != np.bool_:
            return bad(f"loss_mask has dtype {mask.dtype}, expected bool")
        out["tokens"][slot] = tokens
        if doc_ids is not None:
            out["doc_ids"][slot] = doc_ids
        out["loss_mask"][slot] = True if mask is None else mask
        return True
