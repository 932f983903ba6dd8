"""``data.verify``: a corrupt shard is found when the loader is built, not when it is first read."""

from __future__ import annotations

import pytest

from data_fixtures import config, positions_of, write_numbered_dataset
from rlt_scale.config import load_config
from rlt_scale.data import shards as shards_module
from rlt_scale.data.config import DataConfig
from rlt_scale.data.loader import StreamingLoader
from rlt_scale.data.order import shard_order
from rlt_scale.data.shards import SkippedDataWarning
from rlt_scale.errors import ConfigError, DataError

SHARDS = (6, 6, 6, 6, 6)
NAMES = [f"shard-{i:06d}.tar" for i in range(len(SHARDS))]
SHA_MISMATCH = r"SHA-256 [0-9a-f]{16}\.\.\. does not match the index \([0-9a-f]{16}\.\.\.\): the shard is corrupt"


@pytest.fixture
def dataset(tmp_path):
    write_numbered_dataset(tmp_path / "d", SHARDS)
    return tmp_path / "d"


def flip_byte(path, at: int = 2000) -> None:
    """Corrupt a shard without changing its size: only the checksum can tell."""
    data = bytearray(path.read_bytes())
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))


def last_read_shard(seed: int = DataConfig.seed) -> int:
    """The shard that epoch 0 reads last: a corrupt one is far from the first batch."""
    return int(shard_order(len(SHARDS), seed, 0)[-1])


def test_start_finds_a_corrupt_shard_when_the_loader_is_built(dataset):
    bad = last_read_shard()
    assert bad != int(shard_order(len(SHARDS), DataConfig.seed, 0)[0])
    flip_byte(dataset / NAMES[bad])
    with pytest.raises(DataError, match=rf"shard {NAMES[bad]} \(.*{NAMES[bad]}\): {SHA_MISMATCH}"):
        StreamingLoader(config(dataset), batch_size=4)  # verify: start is the default


@pytest.mark.parametrize("workers", [0, 2])
def test_start_finds_a_truncated_shard_with_sizes(dataset, workers):
    path = dataset / NAMES[3]
    path.write_bytes(path.read_bytes()[:5000])
    with pytest.raises(DataError, match=rf"{NAMES[3]}.*: 5000 bytes, the index says \d+ \(truncated"):
        StreamingLoader(config(dataset, verify="start", num_workers=workers), batch_size=4)


def test_lazy_builds_and_fails_when_the_shard_is_read(dataset):
    bad = last_read_shard()
    flip_byte(dataset / NAMES[bad])
    loader = StreamingLoader(config(dataset, verify="lazy"), batch_size=4)
    seen = []
    with pytest.raises(DataError, match=rf"{NAMES[bad]}.*{SHA_MISMATCH}"):
        for batch in loader.iter_epoch_once():
            seen += positions_of(batch)
    assert len(seen) >= 4 * 6  # the four good shards were delivered before the bad one was read


def test_verify_checksums_false_turns_both_checks_off(dataset):
    flip_byte(dataset / NAMES[1])  # a flipped token byte still decodes: nothing notices
    loader = StreamingLoader(config(dataset, verify="start", verify_checksums=False), batch_size=6)
    assert len(list(loader.iter_epoch_once())) == 5


def test_skip_mode_warns_at_start_and_pads_when_read(dataset):
    flip_byte(dataset / NAMES[2])
    with pytest.warns(SkippedDataWarning, match=rf"{NAMES[2]}.*{SHA_MISMATCH}.*found at start-up"):
        loader = StreamingLoader(config(dataset, on_error="skip"), batch_size=6)
    with pytest.warns(SkippedDataWarning, match=NAMES[2]):
        seen = [p for batch in loader.iter_epoch_once() for p in positions_of(batch)]
    assert loader.skipped_samples == 6
    assert sorted(p for p in seen if p >= 0) == [p for p in range(30) if not 12 <= p < 18]


@pytest.mark.parametrize("dp_size", [1, 2, 3, 4, 7])
def test_dp_ranks_split_the_check_and_cover_every_shard_once(dataset, monkeypatch, dp_size):
    fetched: list[tuple[int, str]] = []
    rank = 0
    real_read_url = shards_module.read_url

    def counting_read_url(url):
        fetched.append((rank, url.rsplit("/", 1)[-1]))
        return real_read_url(url)

    monkeypatch.setattr(shards_module, "read_url", counting_read_url)
    monkeypatch.setattr(shards_module, "_VERIFIED", set())  # as if each rank were its own process
    for rank in range(dp_size):
        StreamingLoader(config(dataset), batch_size=2, dp_rank=rank, dp_size=dp_size)
    assert sorted(name for _, name in fetched) == NAMES  # every shard exactly once
    for r in range(dp_size):
        assert [name for owner, name in fetched if owner == r] == NAMES[r::dp_size]  # shard i on rank i % dp_size


def test_only_the_rank_that_checks_a_bad_shard_raises(dataset):
    flip_byte(dataset / NAMES[4])
    for rank in (0, 2):
        StreamingLoader(config(dataset), batch_size=2, dp_rank=rank, dp_size=3)
    with pytest.raises(DataError, match=NAMES[4]):
        StreamingLoader(config(dataset), batch_size=2, dp_rank=1, dp_size=3)


def test_a_rebuilt_loader_does_not_hash_again(dataset, monkeypatch):
    """The trainer builds the eval loader at every evaluation: its shards are checked once per process."""
    fetched = []
    real_read_url = shards_module.read_url
    monkeypatch.setattr(shards_module, "read_url", lambda url: fetched.append(url) or real_read_url(url))
    monkeypatch.setattr(shards_module, "_VERIFIED", set())
    for _ in range(3):
        StreamingLoader(config(dataset), batch_size=2)
    assert len(fetched) == len(SHARDS)


def test_no_progress_bar_when_stderr_is_not_a_terminal(dataset, capsys):
    StreamingLoader(config(dataset), batch_size=2)
    assert capsys.readouterr().err == ""


def test_bad_verify_value_names_the_key(dataset):
    with pytest.raises(ConfigError, match=r"^data\.verify: expected one of \('start', 'lazy'\), got 'always'"):
        DataConfig(verify="always").validate()
    with pytest.raises(ConfigError, match=r"^data\.verify"):
        StreamingLoader(config(dataset, verify="eager"), batch_size=2)
    with pytest.raises(ConfigError) as err:
        load_config(None, ["data.verify=off"])
    assert err.value.key == "data.verify"
    assert load_config(None, ["data.verify=lazy"]).data.verify == "lazy"
