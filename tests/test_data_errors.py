"""Bad data: each kind of damage gives an error naming shard and key, or a counted, warned skip."""

from __future__ import annotations

import io
import tarfile

import numpy as np
import pytest

from data_fixtures import config, npy, positions_of, rewrite_shard, write_numbered_dataset
from rlt_scale.data.config import DataConfig
from rlt_scale.data.index import read_index
from rlt_scale.data.loader import StreamingLoader
from rlt_scale.data.shards import SkippedDataWarning
from rlt_scale.errors import ConfigError, DataError

SHARDS = (6, 6, 6)  # shard-000001.tar holds keys 0000000006 .. 0000000011


@pytest.fixture
def dataset(tmp_path):
    write_numbered_dataset(tmp_path / "d", SHARDS)
    return tmp_path / "d"


def read_all(path, workers: int = 0, **cfg) -> list[int]:
    """One evaluation pass in dataset order (shuffle-free: one rank reads the whole epoch)."""
    loader = StreamingLoader(config(path, num_workers=workers, **cfg), batch_size=4)
    return [p for batch in loader.iter_epoch_once() for p in positions_of(batch)]


def truncate(path, keep_bytes: int) -> None:
    data = path.read_bytes()
    path.write_bytes(data[:keep_bytes])


@pytest.mark.parametrize("verify", ["start", "lazy"])  # lazy: the error comes from the worker that reads it
@pytest.mark.parametrize("workers", [0, 2])
def test_truncated_shard_fails_the_size_check(dataset, workers, verify):
    truncate(dataset / "shard-000001.tar", 5000)
    with pytest.raises(DataError, match=r"shard-000001\.tar.*5000 bytes, the index says \d+ \(truncated"):
        read_all(dataset, workers, verify=verify)


def test_truncated_shard_without_checksums_names_the_key_where_it_breaks(dataset):
    path = dataset / "shard-000001.tar"
    with tarfile.open(path) as tar:
        cut = tar.getmember("0000000009.doc_ids.npy").offset_data + 10
    truncate(path, cut)
    with pytest.raises(DataError, match=r"shard-000001\.tar.*tar stream breaks at sample key '0000000009' after 3 of 6"):
        read_all(dataset, verify_checksums=False)


@pytest.mark.parametrize("verify", ["start", "lazy"])
def test_corrupt_shard_fails_the_checksum(dataset, verify):
    path = dataset / "shard-000002.tar"
    data = bytearray(path.read_bytes())
    data[2000] ^= 0xFF  # one flipped byte in a token payload: in-vocabulary garbage without the checksum
    path.write_bytes(bytes(data))
    with pytest.raises(DataError, match=r"shard-000002\.tar.*SHA-256 .* does not match"):
        read_all(dataset, verify=verify)


def test_corrupt_npy_header_names_the_sample(dataset):
    def damage(key, suffix, data):
        return b"garbage" + data[7:] if (key, suffix) == ("0000000004", "tokens.npy") else data

    rewrite_shard(dataset, 0, damage)
    with pytest.raises(DataError, match=r"shard-000000\.tar.*sample key '0000000004': tokens\.npy is not a valid"):
        read_all(dataset)


def test_token_outside_the_vocabulary(dataset):
    def damage(key, suffix, data):
        if (key, suffix) != ("0000000007", "tokens.npy"):
            return data
        tokens = np.load(io.BytesIO(data)).astype(np.uint16)
        tokens[5] = 300
        return npy(tokens)

    rewrite_shard(dataset, 1, damage)
    with pytest.raises(DataError, match=r"shard-000001\.tar.*sample key '0000000007': token id 300 outside the "
                                        r"vocabulary \[0, 259\)"):
        read_all(dataset, workers=2)


@pytest.mark.parametrize("field, key, bad", [("tokens", "0000000013", np.arange(15, dtype=np.uint16)),
                                             ("doc_ids", "0000000012", np.zeros(17, np.int32)),
                                             ("loss_mask", "0000000012", np.ones(3, bool))])
def test_wrong_sample_length(dataset, field, key, bad):
    rewrite_shard(dataset, 2, lambda k, suffix, data: npy(bad) if (k, suffix) == (key, f"{field}.npy") else data)
    with pytest.raises(DataError, match=rf"shard-000002\.tar.*sample key '{key}': {field} has shape "
                                        rf"\({len(bad)},\), expected \(16,\)"):
        read_all(dataset)


def test_missing_sample_is_caught_by_the_count(dataset):
    rewrite_shard(dataset, 1, lambda key, suffix, data: None if key == "0000000011" else data)
    with pytest.raises(DataError, match=r"shard-000001\.tar.*holds 5 samples, the index says 6 \(first missing key "
                                        r"'0000000011'\)"):
        read_all(dataset)


def test_failing_pipe_command_is_an_error_not_a_hang(dataset):
    with pytest.raises(DataError, match=r"shard-000000\.tar.*cannot read"):
        read_all(dataset, url="pipe:test {name} = index.json && cat {path}/{name}")  # shards: exit 1, no bytes


def test_skip_mode_warns_counts_and_keeps_alignment(dataset):
    truncate(dataset / "shard-000001.tar", 5000)  # the whole shard (6 samples) is unusable

    def damage(key, suffix, data):  # plus one bad sample in another shard
        return npy(np.full(16, 999, np.uint16)) if (key, suffix) == ("0000000014", "tokens.npy") else data

    rewrite_shard(dataset, 2, damage)
    with pytest.warns(SkippedDataWarning) as caught:  # at start-up (data.verify: start) and again when read
        loader = StreamingLoader(config(dataset, on_error="skip"), batch_size=4)
        seen = [p for batch in loader.iter_epoch_once() for p in positions_of(batch)]
    messages = " | ".join(str(w.message) for w in caught)
    assert "shard-000001.tar" in messages and "sample key '0000000014': token id 999" in messages
    assert loader.skipped_samples == 7
    assert len(seen) == 20 and seen.count(-1) == 7 + 2  # 7 skipped, 2 pad the last batch of 18 samples
    good = sorted(p for p in seen if p >= 0)
    assert good == [p for p in range(18) if not 6 <= p < 12 and p != 14]


def test_skip_rows_keep_the_training_stream_aligned(dataset):
    truncate(dataset / "shard-000000.tar", 100)
    loader = StreamingLoader(config(dataset, on_error="skip"), batch_size=4, dp_rank=1, dp_size=2)
    with pytest.warns(SkippedDataWarning):
        it = iter(loader)
        batches = [positions_of(next(it)) for _ in range(5)]
    assert loader.consumed_samples == 40 and all(len(b) == 4 for b in batches)
    with pytest.warns(SkippedDataWarning):
        reference = StreamingLoader(config(dataset, on_error="skip"), batch_size=8)  # checks shard 0 at start-up
        ref_it = iter(reference)
        ref = [positions_of(next(ref_it))[4:] for _ in range(5)]
    assert batches == ref  # rank 1 holds the second half of each global batch, pads where shard 0 was
    assert -1 in sum(batches, [])


def test_config_validation_names_the_key():
    with pytest.raises(ConfigError, match=r"^data\.on_error: expected one of"):
        DataConfig(on_error="ignore").validate()
    with pytest.raises(ConfigError, match=r"^data\.num_workers"):
        DataConfig(num_workers=-1).validate()
    with pytest.raises(ConfigError, match=r"^data\.verify: expected one of"):
        DataConfig(verify="off").validate()
    with pytest.raises(ConfigError, match=r"^data\.url"):
        DataConfig(url="s3://bucket/x.tar").validate()
    DataConfig().validate()


def test_missing_index_says_how_to_prepare(tmp_path):
    with pytest.raises(DataError, match="rlt-prepare --out"):
        read_index(tmp_path / "nothing")
