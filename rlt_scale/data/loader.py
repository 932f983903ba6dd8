"""The streaming loader: batches in a global order that survives any change of DP size or worker count.

How it stays exact (see :mod:`rlt_scale.data.order` for the order itself):

* the main process plans, from the index alone, which samples of which shard
  this rank needs, shard by shard (a :class:`Segment`);
* segments are read either in the training process (``num_workers=0``) or by a
  ``torch.utils.data.DataLoader`` whose workers each read whole segments; the
  DataLoader hands results back in the order the plan asked for them, so the
  batches are identical for every worker count, and no shard is read twice by
  one rank;
* the main process concatenates the segments and cuts batches of
  ``batch_size`` rows. It counts ``consumed_samples`` globally (``GB`` per
  batch), which is the whole resumable state.

Every DP rank reads the shards its samples are in; with the shard-sequential
order that is every shard, and the rank keeps its ``1/dp_size`` of the samples.

With ``data.verify: start`` (the default) the constructor first checks the size
and SHA-256 of this rank's ``1/dp_size`` of the shards (shard ``i`` on rank
``i % dp_size``), so a corrupt shard stops the run before the first batch.
"""

from __future__ import annotations

import math
import warnings
from typing import Iterable, Iterator

import numpy as np
import torch

from rlt_scale.data.config import DataConfig
from rlt_scale.data.index import DatasetIndex, read_index
from rlt_scale.data.order import Segment, rank_segments
from rlt_scale.data.shards import ShardReader, SkippedDataWarning, padding_rows, shards_of_rank, verify_shards
from rlt_scale.errors import ConfigError, DataError

Batch = dict[str, torch.Tensor]


def pin_batches(device: torch.device) -> bool:
    """Whether batches bound for ``device`` should be cut into page-locked host memory.

    Only a CUDA copy gains from it: from pinned memory ``.to(device, non_blocking=True)``
    is an asynchronous DMA that overlaps the step, from pageable memory it is staged and
    synchronous. On CPU pinning is useless, and without CUDA it is an error.
    """
    return device.type == "cuda"


def _keep(segment_result: dict) -> dict:
    """DataLoader collate function: leave the worker's numpy arrays as they are."""
    return segment_result


class StreamingLoader:
    """Batches of one DP rank: ``tokens`` / ``doc_ids`` int64 and ``loss_mask`` bool, each ``[batch_size, seq_len + 1]``.

    Iterating yields training batches forever (epoch after epoch, shards
    re-permuted each epoch), starting at ``consumed_samples``. Global batch ``i``
    of an iteration covers global positions ``[start + i*GB, start + (i+1)*GB)``
    with ``GB = batch_size * dp_size``; rank ``r`` gets the ``r``-th slice.
    Each yielded batch adds ``GB`` to ``consumed_samples``, so keep one training
    iterator per loader. :meth:`iter_epoch_once` reads an evaluation set exactly once.
    ``pin_memory=True`` (for a CUDA run, :func:`pin_batches`) hands out batches in
    page-locked memory, so the copy to the GPU can be asynchronous.
    """

    def __init__(self, cfg: DataConfig, *, batch_size: int, dp_rank: int = 0, dp_size: int = 1,
                 path: str | None = None, pin_memory: bool = False):
        cfg.validate()
        if batch_size < 1:
            raise ConfigError("trainer.micro_batch_size", f"expected >= 1, got {batch_size}")
        if not 0 <= dp_rank < dp_size:
            raise ConfigError("parallel", f"expected 0 <= dp_rank < dp_size, got rank {dp_rank} of {dp_size}")
        self.cfg, self.batch_size, self.dp_rank, self.dp_size = cfg, batch_size, dp_rank, dp_size
        self.pin_memory = pin_memory
        """Batches come in pinned host memory (see :func:`pin_batches`)."""
        self.index: DatasetIndex = read_index(path or cfg.path, cfg.url)
        self._reader = ShardReader(self.index, on_error=cfg.on_error, verify_checksums=cfg.verify_checksums)
        self._counts = [s.samples for s in self.index.shards]
        self.consumed_samples = 0
        """Global samples (all DP ranks together) handed to the trainer so far: the resumable position."""
        self.skipped_samples = 0
        """This rank's samples replaced by padding under ``on_error: skip``."""
        if cfg.verify_checksums and cfg.verify == "start":
            self.verify()

    def verify(self) -> None:
        """Check this rank's share of the shards (``i % dp_size == dp_rank``) against the index now.

        Raises :class:`DataError` naming the first bad shard file, with the
        expected and actual size or SHA-256; under ``on_error: skip`` warns
        (:class:`SkippedDataWarning`) for each bad one instead, and its samples
        become padding rows when read. The constructor calls this for ``data.verify: start``.
        """
        mine = shards_of_rank(len(self.index.shards), self.dp_rank, self.dp_size)
        for message in verify_shards(self.index, mine, on_error=self.cfg.on_error, progress=self.dp_rank == 0):
            warnings.warn(f"{message} (found at start-up; its samples will be replaced by padding rows)",
                          SkippedDataWarning, stacklevel=3)

    @classmethod
    def for_process_group(cls, cfg: DataConfig, *, batch_size: int, group=None, path: str | None = None):
        """Take DP rank and size from a torch.distributed process group (e.g. megatron's data-parallel group).

        Never from ``RANK``/``WORLD_SIZE``: under tensor or pipeline parallelism
        those count every process, while ranks of one TP/PP group must get the same samples.
        """
        import torch.distributed as dist

        return cls(cfg, batch_size=batch_size, dp_rank=dist.get_rank(group), dp_size=dist.get_world_size(group),
                   path=path)

    # -- what the trainer asks about ------------------------------------------------
    @property
    def vocab_size(self) -> int:
        return self.index.vocab_size

    @property
    def seq_len(self) -> int:
        return self.index.seq_len

    @property
    def samples_per_epoch(self) -> int:
        return self.index.num_samples

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.dp_size

    @property
    def epoch(self) -> int:
        return self.consumed_samples // self.samples_per_epoch

    # -- resumable state ---------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "samples_per_epoch": self.samples_per_epoch,
                "seed": self.cfg.seed}

    def load_state_dict(self, state: dict) -> None:
        """Continue after ``state["consumed_samples"]`` samples; call before iterating."""
        for key, ours in (("samples_per_epoch", self.samples_per_epoch), ("seed", self.cfg.seed)):
            if key in state and int(state[key]) != ours:
                raise DataError(f"{self.index.path}: the checkpoint was taken with {key}={state[key]}, this run has "
                                f"{ours}; the global order would not continue. To start this data from its "
                                "beginning load {'consumed_samples': 0}.")
        consumed = int(state["consumed_samples"])
        if consumed < 0:
            raise DataError(f"consumed_samples must be >= 0, got {consumed}")
        self.consumed_samples = consumed

    # -- iteration ---------------------------------------------------------------------
    def __iter__(self) -> Iterator[Batch]:
        segments = self._segments(start=self.consumed_samples, stop=None)
        for batch in self._batches(segments, pad_last=False):
            self.consumed_samples += self.global_batch_size
            yield batch

    def iter_epoch_once(self) -> Iterator[Batch]:
        """One pass over epoch 0 for evaluation; ``consumed_samples`` is left alone.

        Every rank yields ``ceil(samples_per_epoch / GB)`` batches of full size,
        so collectives stay matched; rows past the end of the data are padding
        with ``loss_mask`` all False.
        """
        total = math.ceil(self.samples_per_epoch / self.global_batch_size)
        produced = 0
        for batch in self._batches(self._segments(start=0, stop=self.samples_per_epoch), pad_last=True):
            produced += 1
            yield batch
        for _ in range(total - produced):
            yield self._to_batch(padding_rows(self.batch_size, self.seq_len + 1))

    def _segments(self, start: int, stop: int | None) -> Iterator[Segment]:
        return rank_segments(self._counts, seed=self.cfg.seed, window=self.cfg.shuffle_window, start=start,
                             batch_size=self.batch_size, dp_rank=self.dp_rank, dp_size=self.dp_size, stop=stop)

    def _read(self, segments: Iterable[Segment]) -> Iterator[dict]:
        """Segment results in plan order, read here or by DataLoader workers."""
        if self.cfg.num_workers == 0:
            yield from (self._reader[segment] for segment in segments)
            return
        workers = iter(torch.utils.data.DataLoader(
            self._reader, sampler=segments, batch_size=None, collate_fn=_keep, num_workers=self.cfg.num_workers,
            prefetch_factor=self.cfg.prefetch_factor, timeout=self.cfg.timeout_s))
        try:
            yield from workers
        finally:
            # Stop the workers now. Left to the garbage collector (an exception's
            # traceback keeps the DataLoader iterator alive in a reference cycle),
            # its queues may be finalized first and the shutdown waits 5 s per worker.
            workers._shutdown_workers()

    def _batches(self, segments: Iterable[Segment], pad_last: bool) -> Iterator[Batch]:
        """Cut the concatenated segments into batches; only a leftover of < batch_size rows is ever copied."""
        keys = ("tokens", "doc_ids", "loss_mask")
        rows = padding_rows(0, self.seq_len + 1)
        for part in self._read(segments):
            self._report(part)
            rows = {k: np.concatenate([rows[k], part[k]]) for k in keys}
            start = 0
            while len(rows["tokens"]) - start >= self.batch_size:
                yield self._to_batch({k: v[start:start + self.batch_size] for k, v in rows.items()})
                start += self.batch_size
            rows = {k: v[start:] for k, v in rows.items()}
        if pad_last and len(rows["tokens"]):
            filler = padding_rows(self.batch_size - len(rows["tokens"]), self.seq_len + 1)
            yield self._to_batch({k: np.concatenate([rows[k], filler[k]]) for k in keys})

    def _report(self, part: dict) -> None:
        self.skipped_samples += part["skipped"]
        for message in part["problems"]:
            warnings.warn(f"{message} ({part['skipped']} samples of this shard replaced by padding rows)",
                          SkippedDataWarning, stacklevel=3)

    def _to_batch(self, rows: dict[str, np.ndarray]) -> Batch:
        batch = {"tokens": torch.from_numpy(rows["tokens"].astype(np.int64)),
                 "doc_ids": torch.from_numpy(rows["doc_ids"].astype(np.int64)),
                 "loss_mask": torch.from_numpy(np.ascontiguousarray(rows["loss_mask"], dtype=bool))}
        # Pinned here, in the main process: the DataLoader's own pin_memory would
        # see only the workers' numpy arrays, which it leaves alone.
        if self.pin_memory:
            batch = {k: v.pin_memory() for k, v in batch.items()}
        return batch
