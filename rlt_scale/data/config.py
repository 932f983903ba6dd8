"""Configuration of the data loader (the ``data:`` section of a run config).

Batch sizes are not here: the trainer owns ``micro_batch_size`` and passes it
to :class:`rlt_scale.data.loader.StreamingLoader`. Every field has plain types
so that omegaconf can build a structured config from this dataclass.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from rlt_scale.errors import ConfigError

ON_ERROR_CHOICES = ("raise", "skip")
VERIFY_CHOICES = ("start", "lazy")


@dataclass
class DataConfig:
    """Where the prepared data lives and how the loader walks it."""

    path: str = "data/stdlib"
    """Prepared dataset directory (holds ``index.json``), as written by ``rlt-prepare``."""

    eval_path: Optional[str] = None
    """Prepared evaluation set read once per evaluation; ``None`` disables evaluation.
    ``rlt-prepare`` writes it to ``<out>/eval`` when ``--eval-fraction`` is above 0."""

    url: str = "{path}/{name}"
    """How a dataset file is opened: a webdataset URL template where ``{path}`` is the
    dataset path above and ``{name}`` a file name (``index.json`` or a shard). The
    default reads local files; ``"pipe:aws s3 cp s3://bucket/{path}/{name} -"`` or
    ``"pipe:curl -s https://host/{path}/{name}"`` stream from an object store."""

    seed: int = 1234
    """Seed of the global sample order: shard permutation per epoch and the shuffle window."""

    shuffle_window: int = 0
    """Shuffle samples inside consecutive windows of this many samples of each shard
    (seeded per seed, epoch and shard); 0 keeps the stored order inside a shard."""

    num_workers: int = 0
    """DataLoader worker processes that read shards; 0 reads in the training process.
    The batches are the same for every value."""

    prefetch_factor: int = 2
    """Shards each worker reads ahead (ignored when ``num_workers`` is 0)."""

    timeout_s: float = 300.0
    """Seconds to wait for a worker to deliver a shard before failing instead of hanging."""

    on_error: str = "raise"
    """What a bad shard or sample does: ``"raise"`` stops with a DataError naming the shard
    and sample key; ``"skip"`` warns, counts it and puts a fully masked padding row in its
    place so that every rank stays aligned with the global order."""

    verify_checksums: bool = True
    """Check each shard's size and SHA-256 against the index before using any of its samples.
    The master switch: ``false`` turns off both checks that ``verify`` describes."""

    verify: str = "start"
    """When shards are first checked: ``"start"`` fetches and checks every shard of the dataset
    when the loader is built (so also the eval set, when its loader is built), before the first
    batch, with a progress bar (shards and MB) on stderr; a corrupt shard then stops the run at
    start-up instead of hours in. With several DP ranks, rank ``r`` checks shards
    ``r, r + dp_size, ...``, so each shard is hashed once per start and the rank that finds a bad
    one raises. ``"lazy"`` checks a shard only when it is read. In both modes every read is still
    checked, so the bytes used are the bytes checked. Under ``on_error: skip`` a bad shard found at
    start-up warns (SkippedDataWarning) and is padded when read."""

    def validate(self) -> None:
        """Raise ConfigError for the first field that cannot work."""
        if not self.path:
            raise ConfigError("data.path", "expected a prepared dataset directory, got an empty string")
        if "{name}" not in self.url:
            raise ConfigError("data.url", f"expected a template containing '{{name}}', got {self.url!r}")
        if self.seed < 0:
            raise ConfigError("data.seed", f"expected a non-negative integer, got {self.seed}")
        if self.shuffle_window < 0:
            raise ConfigError("data.shuffle_window", f"expected >= 0 (0 = no shuffle), got {self.shuffle_window}")
        if self.num_workers < 0:
            raise ConfigError("data.num_workers", f"expected >= 0, got {self.num_workers}")
        if self.prefetch_factor < 1:
            raise ConfigError("data.prefetch_factor", f"expected >= 1, got {self.prefetch_factor}")
        if not self.timeout_s > 0:
            raise ConfigError("data.timeout_s", f"expected a positive number of seconds, got {self.timeout_s}")
        if self.on_error not in ON_ERROR_CHOICES:
            raise ConfigError("data.on_error", f"expected one of {ON_ERROR_CHOICES}, got {self.on_error!r}")
        if self.verify not in VERIFY_CHOICES:
            raise ConfigError("data.verify", f"expected one of {VERIFY_CHOICES}, got {self.verify!r}")
