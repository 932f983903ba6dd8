"""Synthetic tasks: the stored answer equals an independent computation from the stored input."""

from __future__ import annotations

import pytest

from data_fixtures import config
from rlt_scale.data.index import read_index
from rlt_scale.data.loader import StreamingLoader
from rlt_scale.data.prepare import default_carry_buckets, prepare_task
from rlt_scale.data.tasks import transition_table
from rlt_scale.errors import ConfigError

BOS = 256


def read_rows(path) -> list[tuple[str, str, list[bool], list[int]]]:
    """Every sample of a prepared task through the loader: (body text, answer char, loss mask, doc ids)."""
    loader = StreamingLoader(config(path), batch_size=64)
    rows = []
    for batch in loader.iter_epoch_once():
        for tokens, mask, docs in zip(batch["tokens"].tolist(), batch["loss_mask"].tolist(), batch["doc_ids"].tolist()):
            if any(mask):
                assert tokens[0] == BOS and tokens[-2] == ord("=")
                rows.append(("".join(map(chr, tokens[1:-2])), chr(tokens[-1]), mask, docs))
    assert len(rows) == loader.samples_per_epoch
    return rows


def check_format(rows, length: int) -> None:
    for body, _, mask, docs in rows:
        assert len(body) == length
        assert mask == [False] * (len(mask) - 1) + [True], "only the answer is a target"
        assert set(docs) == {0}


def test_parity(tmp_path):
    prepare_task("parity", tmp_path, num_samples=300, length=12, seed=3, eval_samples=40, eval_length=20)
    assert read_index(tmp_path).seq_len == 14 and read_index(tmp_path / "eval").seq_len == 22
    for split, length in ((tmp_path, 12), (tmp_path / "eval", 20)):
        rows = read_rows(split)
        check_format(rows, length)
        assert all(answer == str(body.count("1") % 2) for body, answer, _, _ in rows)
        assert {answer for _, answer, _, _ in rows} == {"0", "1"}


def test_five_state(tmp_path):
    prepare_task("five_state", tmp_path, num_samples=300, length=9, seed=4, eval_samples=30, table_seed=2)
    table = read_index(tmp_path).meta["table"]  # table[action][state] -> next state
    assert table == transition_table(2).tolist() and table != transition_table(0).tolist()
    assert all(sorted(row) == [0, 1, 2, 3, 4] for row in table), "every action permutes the states"
    rows = read_rows(tmp_path)
    check_format(rows, 9)
    for body, answer, _, _ in rows:
        state = 0
        for action in body:
            state = table["abcde".index(action)][state]
        assert answer == str(state)
    assert {answer for _, answer, _, _ in rows} == set("01234")


def parse_addition(body: str) -> tuple[list[int], list[int]]:
    bits = [int(c) for c in body]
    return bits[0::2], bits[1::2]  # least significant bit first


def carry_out(a: list[int], b: list[int]) -> int:
    as_int = lambda bits: sum(bit << i for i, bit in enumerate(bits))
    return (as_int(a) + as_int(b)) >> len(a)


def test_addition_answers(tmp_path):
    prepare_task("addition", tmp_path, num_samples=300, length=10, seed=5, eval_samples=0)
    assert read_index(tmp_path).seq_len == 22
    rows = read_rows(tmp_path)
    check_format(rows, 20)
    assert all(answer == str(carry_out(*parse_addition(body))) for body, answer, _, _ in rows)
    assert {answer for _, answer, _, _ in rows} == {"0", "1"}


def test_addition_carry_chain_buckets(tmp_path):
    length = 12
    written = prepare_task("addition", tmp_path, num_samples=50, length=8, seed=6, eval_samples=60,
                           eval_length=length, carry_buckets=[1, 3, 12])
    assert sorted(written) == ["eval", "eval-carry-01", "eval-carry-03", "eval-carry-12", "train"]
    for chain in (1, 3, 12):
        rows = read_rows(tmp_path / f"eval-carry-{chain:02d}")
        assert read_index(tmp_path / f"eval-carry-{chain:02d}").meta["carry_chain"] == chain
        answers = [answer for _, answer, _, _ in rows]
        assert 15 <= answers.count("1") <= 45, "answers are balanced"
        for body, answer, _, _ in rows:
            a, b = parse_addition(body)
            assert answer == str(carry_out(a, b))
            decider = length - chain
            # the top chain - 1 positions propagate, so the carry out is decided `chain` positions down ...
            assert all(a[i] != b[i] for i in range(decider + 1, length)) and a[decider] == b[decider]
            # ... and for a carry out of 1 the carry really travels that far: it was generated there
            if answer == "1":
                origin, carry = None, 0
                for i in range(length):
                    if a[i] + b[i] + carry >= 2:
                        origin = origin if (a[i] != b[i]) else i
                        carry = 1
                    else:
                        carry = 0
                assert length - origin == chain
            # bits below the decider never matter; flipping the decider's pair always does
            flipped_low = [1 - x for x in a[:decider]] + a[decider:]
            assert carry_out(flipped_low, b) == carry_out(a, b)
            other = 1 - a[decider]
            assert carry_out(a[:decider] + [other] + a[decider + 1:], b[:decider] + [other] + b[decider + 1:]) != int(answer)


def test_default_buckets_cover_powers_of_two_and_the_length():
    assert default_carry_buckets(12) == [1, 2, 4, 8, 12]
    assert default_carry_buckets(16) == [1, 2, 4, 8, 16]


def test_same_seed_gives_byte_identical_shards(tmp_path):
    first = prepare_task("parity", tmp_path / "a", num_samples=100, length=8, seed=9, eval_samples=0)["train"]
    again = prepare_task("parity", tmp_path / "b", num_samples=100, length=8, seed=9, eval_samples=0)["train"]
    other = prepare_task("parity", tmp_path / "c", num_samples=100, length=8, seed=10, eval_samples=0)["train"]
    assert [s.sha256 for s in first.shards] == [s.sha256 for s in again.shards]
    assert [s.sha256 for s in first.shards] != [s.sha256 for s in other.shards]


def test_bucket_outside_the_operand_length_is_refused(tmp_path):
    with pytest.raises(ConfigError, match="carry_chain"):
        prepare_task("addition", tmp_path, num_samples=10, length=4, seed=0, carry_buckets=[5])
