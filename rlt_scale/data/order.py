"""The global sample order, computed from the index alone.

The order of an epoch is a pure function of ``(seed, epoch)`` and the
per-shard sample counts:

1. the shards are permuted with a generator seeded by ``(seed, epoch)``;
2. inside a shard the samples keep their stored order, or, with a shuffle
   window ``w``, are permuted inside consecutive blocks of ``w`` samples with a
   generator seeded by ``(seed, epoch, shard)``;
3. epochs follow each other, so global position ``g`` is position
   ``g % N`` of epoch ``g // N`` (``N`` samples per epoch).

Nothing here depends on the number of ranks or workers. Data parallelism only
decides *which* positions a rank takes: global batch ``i`` is positions
``[start + i*GB, start + (i+1)*GB)`` with ``GB = batch_size * dp_size`` and
``start`` the samples consumed when iteration began; DP rank ``r`` takes the
``r``-th run of ``batch_size`` positions of each global batch. Resuming at a
different DP size therefore continues exactly where the last run stopped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Sequence

import numpy as np


@dataclass(frozen=True)
class Segment:
    """The samples one rank reads from one shard in one epoch, in the order it must deliver them."""

    epoch: int
    shard: int
    local: np.ndarray
    """Sample indices inside the shard (0-based), in delivery order."""


def shard_order(num_shards: int, seed: int, epoch: int) -> np.ndarray:
    """The shards of an epoch in reading order."""
    return np.random.default_rng([seed, epoch]).permutation(num_shards)


def within_shard_order(num_samples: int, seed: int, epoch: int, shard: int, window: int) -> np.ndarray:
    """Sample indices of one shard in reading order: stored order, or shuffled inside windows."""
    if window <= 1:
        return np.arange(num_samples)
    keys = np.random.default_rng([seed, epoch, shard, 1]).random(num_samples)
    blocks = np.arange(num_samples) // window
    return np.lexsort((keys, blocks))  # sort by block, then by random key inside the block


def epoch_order(counts: Sequence[int], seed: int, epoch: int, window: int = 0) -> np.ndarray:
    """``[N, 2]`` array of (shard, index inside shard) for every position of the epoch."""
    parts = [np.stack([np.full(counts[s], s), within_shard_order(counts[s], seed, epoch, s, window)], axis=1)
             for s in shard_order(len(counts), seed, epoch)]
    return np.concatenate(parts).astype(np.int64)


def rank_segments(counts: Sequence[int], *, seed: int, window: int, start: int, batch_size: int,
                  dp_rank: int, dp_size: int, stop: int | None = None) -> Iterator[Segment]:
    """This rank's samples from global position ``start`` to ``stop`` (exclusive; None: forever), shard by shard."""
    per_epoch = int(sum(counts))
    global_batch = batch_size * dp_size
    epoch = start // per_epoch
    while stop is None or epoch * per_epoch < stop:
        base = epoch * per_epoch  # global position of the next shard's first sample
        for shard in shard_order(len(counts), seed, epoch):
            n = int(counts[shard])
            positions = np.arange(base, base + n)
            base += n
            if n == 0 or positions[-1] < start:
                continue
            if stop is not None and positions[0] >= stop:
                return
            mine = (positions >= start) & ((positions - start) % global_batch // batch_size == dp_rank)
            if stop is not None:
                mine &= positions < stop
            if mine.any():
                order = within_shard_order(n, seed, epoch, int(shard), window)
                yield Segment(epoch, int(shard), order[mine])
        epoch += 1
