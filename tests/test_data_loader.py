"""The global order: exact per epoch, independent of DP size and workers, resumable across DP sizes."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from data_fixtures import UNEVEN_SHARDS, config, numbered_tokens, positions_of, take, write_numbered_dataset
from rlt_scale.data.loader import StreamingLoader
from rlt_scale.data.order import epoch_order, rank_segments, within_shard_order
from rlt_scale.errors import DataError

N = sum(UNEVEN_SHARDS)  # 45 samples per epoch


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    path = tmp_path_factory.mktemp("numbered")
    write_numbered_dataset(path)
    return path


def global_stream(dataset, n_steps: int, *, batch_size: int, dp_size: int, workers: int = 0, state=None, **cfg):
    """Run ``dp_size`` simulated ranks in lock step; return the positions of each global batch, rank 0 first."""
    loaders = [StreamingLoader(config(dataset, num_workers=workers, **cfg), batch_size=batch_size,
                               dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
    for loader in loaders:
        if state is not None:
            loader.load_state_dict(state)
    iterators = [iter(loader) for loader in loaders]
    steps = [sum((positions_of(next(it)) for it in iterators), []) for _ in range(n_steps)]
    assert len({loader.consumed_samples for loader in loaders}) == 1
    return steps, loaders[0].state_dict()


def test_reference_order_is_a_seeded_shard_permutation(dataset):
    """Single rank, no workers: epoch e is the shard permutation of (seed, e), samples in stored order."""
    steps, _ = global_stream(dataset, 15, batch_size=6, dp_size=1, seed=7)
    flat = sum(steps, [])
    offsets = np.cumsum((0,) + UNEVEN_SHARDS)
    for epoch in (0, 1):
        expected = [offsets[s] + i for s, i in epoch_order(UNEVEN_SHARDS, seed=7, epoch=epoch)]
        assert flat[epoch * N:(epoch + 1) * N] == expected
        assert sorted(expected) == list(range(N))
    assert flat[:N] != flat[N:2 * N], "each epoch re-permutes the shards"


@pytest.mark.parametrize("dp_size", [2, 3])
def test_dp_ranks_with_workers_see_every_sample_once_in_the_single_rank_order(dataset, dp_size):
    batch = 4
    steps_needed = -(-2 * N // (batch * dp_size))  # two epochs
    single, _ = global_stream(dataset, steps_needed, batch_size=batch * dp_size, dp_size=1)
    split, _ = global_stream(dataset, steps_needed, batch_size=batch, dp_size=dp_size, workers=2)
    assert split == single
    flat = sum(split, [])
    assert sorted(flat[:N]) == list(range(N)) and sorted(flat[N:2 * N]) == list(range(N))


def test_batches_carry_tokens_doc_ids_and_mask_exactly(dataset):
    loader = StreamingLoader(config(dataset), batch_size=5)
    batch = next(iter(loader))
    assert batch["tokens"].dtype == torch.int64 and batch["doc_ids"].dtype == torch.int64
    assert batch["loss_mask"].dtype == torch.bool and batch["tokens"].shape == (5, 16)
    for row, position in enumerate(positions_of(batch)):
        np.testing.assert_array_equal(batch["tokens"][row].numpy(), numbered_tokens(position))
        two_docs = position % 3 == 0
        assert batch["doc_ids"][row].tolist() == [0] * 7 + [int(two_docs)] * 9
        assert batch["loss_mask"][row].tolist() == [not two_docs] * 7 + [True] * 9
    assert (loader.vocab_size, loader.seq_len, loader.samples_per_epoch) == (259, 15, N)


@pytest.mark.parametrize("new_dp, new_workers", [(3, 2), (1, 0)])
def test_resume_at_another_dp_size_continues_the_same_stream(dataset, new_dp, new_workers):
    batch = 4
    reference = sum(global_stream(dataset, 40, batch_size=3, dp_size=1)[0], [])
    first, state = global_stream(dataset, 5, batch_size=batch, dp_size=2, workers=2)  # 40 samples
    assert state["consumed_samples"] == 40
    rest, after = global_stream(dataset, 6, batch_size=batch, dp_size=new_dp, workers=new_workers,
                                state={"consumed_samples": state["consumed_samples"]})
    resumed = sum(first, []) + sum(rest, [])
    assert resumed == reference[:len(resumed)]  # crosses the epoch boundary at 45
    assert after["consumed_samples"] == 40 + 6 * batch * new_dp


def test_shuffle_window_is_seeded_and_stays_inside_windows(dataset):
    flat = sum(global_stream(dataset, 12, batch_size=5, dp_size=1, shuffle_window=4, seed=3)[0], [])
    again = sum(global_stream(dataset, 12, batch_size=5, dp_size=1, shuffle_window=4, seed=3)[0], [])
    assert flat == again
    assert flat[:N] != sum(global_stream(dataset, 9, batch_size=5, dp_size=1, seed=3)[0], [])
    order = within_shard_order(13, seed=3, epoch=0, shard=1, window=4)
    assert sorted(order) == list(range(13)) and list(order) != list(range(13))
    for start in range(0, 13, 4):
        assert sorted(order[start:start + 4]) == list(range(start, min(start + 4, 13)))


def test_eval_pass_reads_each_sample_once_with_equal_batch_counts(dataset):
    per_rank = []
    for rank in range(3):
        loader = StreamingLoader(config(dataset, num_workers=2), batch_size=4, dp_rank=rank, dp_size=3)
        per_rank.append([positions_of(b) for b in loader.iter_epoch_once()])
        assert loader.consumed_samples == 0
    assert [len(b) for b in per_rank] == [4, 4, 4]  # ceil(45 / 12)
    seen = [p for step in zip(*per_rank) for batch in step for p in batch]
    assert sorted(p for p in seen if p >= 0) == list(range(N))
    assert seen.count(-1) == 4 * 12 - N  # padding rows fill the last global batch
    offsets = np.cumsum((0,) + UNEVEN_SHARDS)
    assert [p for p in seen if p >= 0] == [offsets[s] + i for s, i in epoch_order(UNEVEN_SHARDS, 1234, 0)]


def test_pipe_urls_give_the_same_batches(dataset):
    local = sum(global_stream(dataset, 6, batch_size=4, dp_size=2)[0], [])
    piped = sum(global_stream(dataset, 6, batch_size=4, dp_size=2, workers=2, url="pipe:cat {path}/{name}")[0], [])
    assert piped == local


def test_dp_rank_comes_from_the_process_group_not_the_environment(dataset, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "3")  # what torchrun sets for a TP/PP rank; must be ignored
    monkeypatch.setenv("WORLD_SIZE", "4")
    created = not dist.is_initialized()  # another test may already have set up a one-process world
    if created:
        dist.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
    try:
        group = dist.new_group([dist.get_rank()])
        loader = StreamingLoader.for_process_group(config(dataset), batch_size=4, group=group)
        assert (loader.dp_rank, loader.dp_size) == (0, 1)
    finally:
        if created:
            dist.destroy_process_group()
    assert os.environ["RANK"] == "3"


def test_state_from_other_data_is_refused(dataset):
    loader = StreamingLoader(config(dataset), batch_size=4)
    with pytest.raises(DataError, match="samples_per_epoch=99"):
        loader.load_state_dict({"consumed_samples": 8, "samples_per_epoch": 99, "seed": 1234})
    loader.load_state_dict({"consumed_samples": 8})
    assert positions_of(next(iter(loader)))[0] == sum(global_stream(dataset, 3, batch_size=4, dp_size=1)[0], [])[8]


@settings(max_examples=60, deadline=None)
@given(counts=st.lists(st.integers(1, 9), min_size=1, max_size=6), batch=st.integers(1, 5),
       dp=st.integers(1, 4), start=st.integers(0, 60), length=st.integers(1, 80))
def test_rank_segments_partition_any_stretch_of_the_global_order(counts, batch, dp, start, length):
    """Pure planning, no I/O: interleaving the ranks' plans batch by batch rebuilds the global order."""
    total = sum(counts)
    stop = start + length
    global_order = np.concatenate([epoch_order(counts, 5, e, window=3) for e in range(stop // total + 1)])
    per_rank = []
    for rank in range(dp):
        parts = [np.stack([np.full(len(seg.local), seg.shard), seg.local], 1)
                 for seg in rank_segments(counts, seed=5, window=3, start=start, batch_size=batch,
                                          dp_rank=rank, dp_size=dp, stop=stop)]
        per_rank.append(np.concatenate(parts) if parts else np.zeros((0, 2), dtype=np.int64))
    rebuilt = []
    for step in range(-(-length // (batch * dp))):
        for rank in range(dp):
            rebuilt.extend(map(tuple, per_rank[rank][step * batch:(step + 1) * batch]))
    assert rebuilt == list(map(tuple, global_order[start:stop]))
