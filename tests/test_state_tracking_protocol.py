"""The research protocol kept honest: task generators against independent solvers, seed separation, the
answer-only loss mask, and a learning-rate choice that reads validation sets only."""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from rlt_scale.data import tasks
from rlt_scale.data.loader import StreamingLoader
from rlt_scale.data.config import DataConfig
from rlt_scale.errors import ConfigError
from rlt_scale.experiments import runs, task_sets, variant_sweeps
from rlt_scale.experiments import state_tracking as st
from rlt_scale.experiments.evaluate import ANSWER_TOKENS
from rlt_scale.experiments.restarts import Restarts, train_with_restarts
from rlt_scale.experiments.supervision import target_fn
from rlt_scale.training.bptt import next_token_targets


# ---------------------------------------------------------------- generators
def _compose(perms: list[tuple[int, ...]]) -> tuple[int, ...]:
    state = tuple(range(5))
    for p in perms:  # apply p after the state so far: (p o state)(i) = p[state[i]]
        state = tuple(p[state[i]] for i in range(5))
    return state


@pytest.mark.parametrize("task", ["s5", "s5_swaps"])
def test_s5_answers_are_the_composition(task):
    data = tasks.generate(task, 200, 9, seed=5)
    perms = list(itertools.permutations(range(5)))
    assert data.tokens.shape == (200, 9 + 3)
    for row, answer in zip(data.tokens, data.answers):
        inputs = [perms[t - tasks.PERMUTATION_BASE] for t in row[1:-2]]
        if task == "s5_swaps":
            assert all(sum(p[i] != i for i in range(5)) == 2 for p in inputs), "swaps only"
        assert perms[answer] == _compose(inputs)
        assert row[-1] == tasks.PERMUTATION_BASE + answer and row[-2] == ord("=")
    assert len(set(data.answers.tolist())) > 40  # the answers spread over S5 (60 reachable with swaps at odd L)
    assert set(ANSWER_TOKENS[task]) == set(range(tasks.PERMUTATION_BASE, tasks.PERMUTATION_BASE + 120))


def _evaluate(text: str) -> int:
    """An independent recursive-descent evaluator: brackets first, left to right mod 5, no precedence."""
    pos = 0

    def expr() -> int:
        nonlocal pos
        value = term()
        while pos < len(text) and text[pos] in "+-*":
            op, pos = text[pos], pos + 1
            rhs = term()
            value = {"+": value + rhs, "-": value - rhs, "*": value * rhs}[op] % 5
        return value

    def term() -> int:
        nonlocal pos
        if text[pos] == "(":
            pos += 1
            value = expr()
            assert text[pos] == ")"
            pos += 1
            return value
        pos += 1
        return int(text[pos - 1])

    value = expr()
    assert pos == len(text), "the whole expression parses"
    return value


@pytest.mark.parametrize("task, length", [("mod5", 7), ("mod5_brackets", 13), ("mod5_brackets", 32)])
def test_mod5_answers_match_an_independent_evaluator(task, length):
    data = tasks.generate(task, 300, length, seed=2)
    assert data.seq_len == task_sets.seq_len_of(task, length)
    for row, answer in zip(data.tokens, data.answers):
        text = "".join(map(chr, row[1:-2]))
        assert sum(c.isdigit() for c in text) == length + 1 and sum(c in "+-*" for c in text) == length
        if task == "mod5_brackets":
            assert text.count("(") == text.count(")") == length // 4
        else:
            assert "(" not in text
        assert _evaluate(text) == answer and row[-1] == ord("0") + answer
    assert set(data.answers.tolist()) == {0, 1, 2, 3, 4}
    if task == "mod5_brackets":
        depths = [max(itertools.accumulate((c == "(") - (c == ")") for c in "".join(map(chr, r[1:-2]))))
                  for r in data.tokens]
        assert max(depths) >= 2, "brackets nest"


@pytest.mark.parametrize("task", ["s5", "mod5", "mod5_brackets"])
def test_running_targets_end_in_the_answer_and_agree_with_prefixes(task):
    data = tasks.generate(task, 16, 8, seed=1)
    tokens = torch.as_tensor(data.tokens)
    targets, valid = target_fn(task, "running")(tokens)
    assert targets.shape == valid.shape == (16, tokens.shape[1] - 1)
    assert valid[:, -1].all() and (targets[:, -1] == tokens[:, -1]).all()
    if task == "mod5":  # the target at digit x_t is the value of the prefix x0 .. x_t
        for row in range(4):
            text = "".join(map(chr, data.tokens[row, 1:-2]))
            for i in range(0, len(text), 2):
                assert valid[row, 1 + i] and targets[row, 1 + i] == ord("0") + _evaluate(text[: i + 1])
                assert i + 1 >= len(text) or not valid[row, 2 + i]  # operators carry no target


def test_unknown_task_is_refused_by_name():
    with pytest.raises(Exception, match="task"):
        tasks.generate("s6", 1, 4, seed=0)


# ------------------------------------------------------------------- seeds
def _rows(path) -> set[bytes]:
    loader = StreamingLoader(DataConfig(path=str(path)), batch_size=64, path=str(path))
    out = set()
    for batch in loader.iter_epoch_once():
        for tokens, mask in zip(batch["tokens"], batch["loss_mask"]):
            if mask[-1]:
                out.add(tokens.numpy().tobytes())
    return out


def tiny_protocol(root) -> dict:
    proto = st.load_protocol()
    proto.update(data_root=str(root / "data"), val_samples=64, val_long_samples=64, eval_samples=128,
                 eval_samples_at={40: 32}, lr_sweep=[1e-3, 3e-3], selection_seeds=[0], supervision="final")
    proto["early_stopping"] = {"target": 0.99, "patience": 0, "min_delta": 0.0}
    proto["tasks"] = {"parity": {"train_length": 24, "train_samples": 512, "max_steps": 40,
                                 "val_lengths": [24, 40], "eval_lengths": [24, 40]}}
    return proto


def test_validation_and_test_sets_are_disjoint_from_training_and_each_other(tmp_path):
    proto = tiny_protocol(tmp_path)
    task_sets.prepare_data(proto, "parity", log=lambda *a: None)
    seeds = {proto["train_seed"], *(task_sets.val_seed(L) for L in (24, 40)), *(task_sets.test_seed(L) for L in (24, 40))}
    assert len(seeds) == 5
    train = _rows(task_sets.train_dir(proto, "parity")) | _rows(task_sets.train_dir(proto, "parity") / "eval")
    val = _rows(task_sets.val_dir(proto, "parity", 24) / "eval")
    test = _rows(task_sets.test_dir(proto, "parity", 24) / "eval")
    assert len(val) == 64 and len(test) == 128  # 2^24 programs: distinct seeds give disjoint sets
    assert not (train & val) and not (train & test) and not (val & test)
    assert len(_rows(task_sets.test_dir(proto, "parity", 40) / "eval")) == 32  # eval_samples_at cuts a long set


def test_a_later_test_round_has_fresh_programs_and_a_folder_of_its_own(tmp_path):
    """A recipe chosen after test figures were read is scored on round 1: new seeds, disjoint programs,
    round 0 untouched."""
    proto = tiny_protocol(tmp_path)
    task_sets.prepare_data(proto, "parity", log=lambda *a: None)
    later = dict(proto, test_round=1)
    task_sets.prepare_data(later, "parity", log=lambda *a: None)
    assert task_sets.test_dir(later, "parity", 24) != task_sets.test_dir(proto, "parity", 24)
    first, second = (_rows(task_sets.test_dir(p, "parity", 24) / "eval") for p in (proto, later))
    val = _rows(task_sets.val_dir(proto, "parity", 24) / "eval")
    assert len(second) == 128 and not (first & second) and not (val & second)
    seeds = {task_sets.test_seed(L, r) for L in (16, 2048, 9999) for r in range(task_sets.MAX_TEST_ROUNDS)}
    assert len(seeds) == 3 * task_sets.MAX_TEST_ROUNDS
    assert max(seeds) < min(task_sets.val_seed(L) for L in (0, 16, 2048))
    for bad in (-1, 100, 1.0, True):
        with pytest.raises(ValueError, match="^test_round: expected"):
            task_sets.test_dir(dict(proto, test_round=bad), "parity", 24)


def test_preparation_waits_for_another_process_preparing_the_same_data_root(tmp_path):
    """Two runs started together once wrote the same shards at once and crashed on each other's files: a
    second preparation waits on the data root's lock (flock: a second open file conflicts even in-process)
    and then finds the sets ready."""
    proto = tiny_protocol(tmp_path)
    done = threading.Event()
    with task_sets.data_lock(proto, "parity"):  # another process is preparing
        worker = threading.Thread(
            target=lambda: (task_sets.prepare_data(proto, "parity", log=lambda *a: None), done.set()))
        worker.start()
        worker.join(timeout=1.0)
        assert not done.is_set() and not task_sets.train_dir(proto, "parity").exists(), "it waits, writing nothing"
    worker.join(timeout=120)
    assert done.is_set() and (task_sets.train_dir(proto, "parity") / "index.json").exists()
    assert (task_sets.test_dir(proto, "parity", 40) / "eval" / "index.json").exists()


# ------------------------------------------------------- answer-only mask
def test_answer_only_loss_trains_exactly_the_answer_at_the_equals_position(tmp_path):
    proto = tiny_protocol(tmp_path)
    task_sets.prepare_data(proto, "parity", log=lambda *a: None)
    path = task_sets.train_dir(proto, "parity")
    batch = next(iter(StreamingLoader(DataConfig(path=str(path)), batch_size=32, path=str(path)).iter_epoch_once()))
    targets, valid = next_token_targets(batch)  # the objective of supervision "final"
    assert valid.sum(dim=1).tolist() == [1] * 32, "one target per program"
    assert valid[:, -1].all(), "at the last input position"
    assert (batch["tokens"][:, -2] == ord("=")).all(), "which holds the '='"
    bits = batch["tokens"][:, 1:-2] - ord("0")
    assert (targets[:, -1] == ord("0") + bits.sum(dim=1) % 2).all(), "and the target is the parity"
    assert target_fn("parity", "final") is None  # final supervision uses exactly these targets


# ------------------------------------------------------- mixed lengths
def test_mixed_lengths_pack_whole_programs_of_every_length_each_with_its_answer(tmp_path):
    """``mixed_lengths``: the training rows are whole programs of lengths 1..L, one document each, packed with
    no padding; the targets are exactly their answers, at their '=' positions; validation stays one program
    of length L per sample."""
    proto = tiny_protocol(tmp_path)
    proto["tasks"]["parity"]["mixed_lengths"] = True
    task_sets.prepare_data(proto, "parity", log=lambda *a: None)
    path = task_sets.train_dir(proto, "parity")
    assert path.name.endswith("-mix")
    batch = next(iter(StreamingLoader(DataConfig(path=str(path)), batch_size=32, path=str(path)).iter_epoch_once()))
    assert batch["tokens"].shape == (32, 2 * (24 + 3))
    targets, valid = next_token_targets(batch)  # the objective of supervision "final"
    lengths = []
    for row in range(32):
        tokens, docs = batch["tokens"][row], batch["doc_ids"][row]
        answers = []
        for doc in range(int(docs.max()) + 1):
            program = tokens[docs == doc]
            bits = program[1:-2] - ord("0")
            assert program[0] == tasks.BOS and program[-2] == ord("=") and ((bits == 0) | (bits == 1)).all()
            lengths.append(len(bits))
            answers.append(ord("0") + int(bits.sum()) % 2)
            assert program[-1] == answers[-1]
        assert targets[row][valid[row]].tolist() == answers
        assert (tokens[:-1][valid[row]] == ord("=")).all()
    assert min(lengths) >= 1 and max(lengths) <= 24 and len(set(lengths)) >= 20
    val = next(iter(StreamingLoader(DataConfig(path=str(path / "eval")), batch_size=8,
                                    path=str(path / "eval")).iter_epoch_once()))
    assert val["tokens"].shape == (8, 24 + 3) and next_token_targets(val)[1].sum() == 8
    with pytest.raises(ConfigError, match="packed programs need one of"):
        tasks.packed("mod5", 4, 8, 30, seed=0)
    with pytest.raises(ConfigError, match="length >= 6"):
        tasks.packed("parity", 4, 4, 30, seed=0)
    again = tasks.packed("parity", 16, 24, 54, seed=3)
    assert np.array_equal(again.tokens, tasks.packed("parity", 16, 24, 54, seed=3).tokens)


# ---------------------------------------------------------------- selection
def test_choose_lr_takes_the_best_mean_validation_score():
    recs = [{"lr": 1e-3, "selection_score": s} for s in (0.9, 0.5)] + [{"lr": 3e-3, "selection_score": 0.8}]
    assert st.choose_lr(recs) == 3e-3
    assert runs.lr_tag(3e-4) == "lr3e-4" and runs.run_key("parity", "gru", 1, lr=1e-3) == "parity-gru-lr1e-3-s1"


def test_the_sweep_selects_on_validation_and_tests_each_seed_once(tmp_path, monkeypatch):
    proto = tiny_protocol(tmp_path)
    task_sets.prepare_data(proto, "parity", log=lambda *a: None)
    tested = []
    real_test_one = runs.test_one

    def counting_test_one(proto_, task, net, rlt, log=print):
        tested.append(task)
        return real_test_one(proto_, task, net, rlt, log)

    monkeypatch.setattr(st, "test_one", counting_test_one)
    table = runs.Table(tmp_path / "out")
    args = st.build_parser().parse_args(["--set", "trainer.eval_interval=20"])
    st.run_row(proto, table, "parity", "gru", [0, 1], proto["lr_sweep"], args, log=lambda *a: None)
    select = [r for r in table.records if r["phase"] == "select"]
    rows = [r for r in table.records if r["phase"] == "test"]
    assert sorted(r["lr"] for r in select) == [1e-3, 3e-3] and all("acc" not in r for r in select)
    assert set(select[0]["val_acc"]) == {"24", "40"}
    assert len(tested) == 2 and sorted(r["seed"] for r in rows) == [0, 1]
    assert {r["lr"] for r in rows} == {st.choose_lr(select)}
    # seed 0 at the chosen lr is the selection run itself, not a retrained copy
    reused = next(r for r in select if r["lr"] == rows[0]["lr"])
    assert next(r for r in rows if r["seed"] == 0)["run_dir"] == reused["run_dir"]
    # a rerun resumes: nothing is trained or tested again
    st.run_row(proto, runs.Table(tmp_path / "out"), "parity", "gru", [0, 1], proto["lr_sweep"], args,
               log=lambda *a: None)
    assert len(tested) == 2
    assert "Learning-rate selection" in table.write_markdown()


def test_a_variant_sweep_selects_on_validation_and_tests_only_the_chosen_variant(tmp_path, monkeypatch):
    proto = tiny_protocol(tmp_path)
    proto["variant_sweeps"] = {"wd": {
        "task": "parity", "model": "gru", "lr": 3e-3, "val_lengths": [40], "protocol": ["tasks.parity.max_steps=30"],
        "variants": {"wd0": ["optimizer.weight_decay=0.0"],
                     "wd1": {"set": ["optimizer.weight_decay=0.1"], "protocol": ["tasks.parity.max_steps=20"]}}}}
    task_sets.prepare_data(proto, "parity", log=lambda *a: None)
    tested = []
    real_test_one = runs.test_one

    def counting_test_one(proto_, task, net, rlt, log=print):
        tested.append(task)
        return real_test_one(proto_, task, net, rlt, log)

    monkeypatch.setattr(variant_sweeps, "test_one", counting_test_one)
    table = runs.Table(tmp_path / "out")
    args = st.build_parser().parse_args(["--set", "trainer.eval_interval=20"])
    chosen = variant_sweeps.run_variant_sweep(proto, table, "wd", [0, 1], args, log=lambda *a: None)["gru"]
    select = [r for r in table.records if r["phase"] == "select"]
    rows = [r for r in table.records if r["phase"] == "test"]
    assert sorted(r["tag"] for r in select) == ["wd0", "wd1"] and all("acc" not in r for r in select)
    assert all(set(r["val_acc"]) == {"24", "40"} for r in select), "the sweep's own validation lengths"
    assert chosen == max(select, key=lambda r: r["selection_score"])["tag"]
    assert next(r for r in select if r["tag"] == "wd1")["max_steps"] == 20, "a variant's protocol override wins"
    assert next(r for r in select if r["tag"] == "wd0")["max_steps"] == 30, "over the sweep's"
    assert len(tested) == 2 and sorted(r["seed"] for r in rows) == [0, 1] and {r["tag"] for r in rows} == {chosen}
    assert all("optimizer.weight_decay" in " ".join(r["overrides"]) for r in rows)
    variant_sweeps.run_variant_sweep(proto, runs.Table(tmp_path / "out"), "wd", [0, 1], args, log=lambda *a: None)
    assert len(tested) == 2, "a rerun resumes"


def test_a_variant_sweep_chooses_on_recorded_scores_whose_weights_are_gone(tmp_path, monkeypatch):
    """Records carried from another results directory choose without retraining; the chosen row is then
    retrained to be tested, and that retrain equals the selection run (the pipeline is deterministic)."""
    proto = tiny_protocol(tmp_path)
    proto["variant_sweeps"] = {"wd": {"task": "parity", "model": "gru", "lr": 3e-3,
                                      "variants": {"wd0": ["optimizer.weight_decay=0.0"],
                                                   "wd1": ["optimizer.weight_decay=0.1"]}}}
    task_sets.prepare_data(proto, "parity", log=lambda *a: None)
    args = st.build_parser().parse_args(["--set", "trainer.eval_interval=20", "--select-only"])
    first = runs.Table(tmp_path / "first")
    variant_sweeps.run_variant_sweep(proto, first, "wd", [0], args, log=lambda *a: None)
    (tmp_path / "carried").mkdir()
    carried = runs.Table(tmp_path / "carried")
    for record in first.records:
        carried.add(dict(record, run_dir=str(tmp_path / "gone" / record["key"])))
    trained = []
    real_train_one = runs.train_one

    def counting_train_one(*a, **k):
        trained.append(k.get("tag"))
        return real_train_one(*a, **k)

    monkeypatch.setattr(runs, "train_one", counting_train_one)
    args = st.build_parser().parse_args(["--set", "trainer.eval_interval=20"])
    chosen = variant_sweeps.run_variant_sweep(proto, carried, "wd", [0], args, log=lambda *a: None)["gru"]
    assert chosen == max(first.records, key=lambda r: r["selection_score"])["tag"]
    assert trained == [chosen], "only the chosen row is trained again, to be tested"
    row = next(r for r in carried.records if r["phase"] == "test")
    selected = next(r for r in first.records if r["tag"] == chosen)
    assert row["best_step"] == selected["best_step"] and row["steps"] == selected["steps"]


def test_the_lr_sweep_retrains_a_recorded_selection_run_whose_weights_are_gone(tmp_path):
    """Unlike a variant sweep, the lr sweep tests its seed-0 row from the selection run's own weights, so a
    record without them is trained again rather than reused."""
    proto = tiny_protocol(tmp_path)
    task_sets.prepare_data(proto, "parity", log=lambda *a: None)
    args = st.build_parser().parse_args(["--set", "trainer.eval_interval=20", "--select-only"])
    first = runs.Table(tmp_path / "first")
    st.run_row(proto, first, "parity", "gru", [0], proto["lr_sweep"], args, log=lambda *a: None)
    (tmp_path / "carried").mkdir()
    carried = runs.Table(tmp_path / "carried")
    for record in first.records:
        carried.add(dict(record, run_dir=str(tmp_path / "gone" / record["key"])))
    args = st.build_parser().parse_args(["--set", "trainer.eval_interval=20"])
    st.run_row(proto, carried, "parity", "gru", [0], proto["lr_sweep"], args, log=lambda *a: None)
    select = [r for r in carried.records if r["phase"] == "select"]
    assert len(select) == 2 and all(Path(r["run_dir"]).is_relative_to(tmp_path / "carried") for r in select)
    assert [r["seed"] for r in carried.records if r["phase"] == "test"] == [0]


def test_a_variant_with_its_own_lr_trains_and_is_tested_at_it(tmp_path):
    proto = tiny_protocol(tmp_path)
    proto["variant_sweeps"] = {"lr": {
        "task": "parity", "model": "gru", "lr": 3e-3, "val_lengths": [40], "protocol": ["tasks.parity.max_steps=20"],
        "variants": {"peak3e-3": [], "peak1e-2": {"lr": 1e-2}}}}
    table = runs.Table(tmp_path / "out")
    args = st.build_parser().parse_args(["--set", "trainer.eval_interval=20"])
    chosen = variant_sweeps.run_variant_sweep(proto, table, "lr", [0, 1], args, log=lambda *a: None)["gru"]
    select = {r["tag"]: r for r in table.records if r["phase"] == "select"}
    assert select["peak3e-3"]["lr"] == 3e-3 and select["peak1e-2"]["lr"] == 1e-2
    assert "optimizer.lr=0.01" in select["peak1e-2"]["overrides"], "the variant's lr reaches the trainer"
    assert select["peak1e-2"]["key"] == "parity-gru-peak1e-2-lr1e-2-s0"
    rows = [r for r in table.records if r["phase"] == "test"]
    assert {r["lr"] for r in rows} == {select[chosen]["lr"]} and len(rows) == 2
    assert next(r for r in rows if r["seed"] == 0)["run_dir"] == select[chosen]["run_dir"], "seed 0 is reused"
    proto["variant_sweeps"]["lr"]["variants"]["typo"] = {"lrr": 1e-3}
    with pytest.raises(ValueError, match=r"variant_sweeps.typo: unknown key\(s\) \['lrr'\]"):
        variant_sweeps.sweep_variant(proto, proto["variant_sweeps"]["lr"], "typo")


# ----------------------------------------------------------------- restarts
def test_restarts_stop_at_the_target_and_keep_the_best_validation_score():
    scores = {0: 0.5, 1000: 0.9, 2000: 0.7, 3000: 1.0}
    trained = []

    def train(run_seed):
        trained.append(run_seed)
        return ({"seed": run_seed, "selection_score": scores[run_seed], "val_acc": {"8": scores[run_seed]},
                 "steps": 10, "train_time_s": 1.5}, f"net{run_seed}", True)

    record, net, _ = train_with_restarts(train, 0, Restarts(count=3, below=0.95), log=lambda *a: None)
    assert trained == [0, 1000, 2000], "at most `count` trainings"
    assert (record["seed"], record["trained_seed"], net) == (0, 1000, "net1000"), "the best, not the last"
    assert (record["steps"], record["train_time_s"]) == (30, 4.5), "the cost of every restart is counted"
    assert [t["seed"] for t in record["restarts"]] == [0, 1000, 2000]
    trained.clear()
    record, _, _ = train_with_restarts(train, 0, Restarts(count=3, below=0.9), log=lambda *a: None)
    assert trained == [0, 1000] and record["trained_seed"] == 1000, "no restart once the target is reached"
    trained.clear()
    assert train_with_restarts(train, 0, Restarts(), log=lambda *a: None)[0] == {
        "seed": 0, "selection_score": 0.5, "val_acc": {"8": 0.5}, "steps": 10, "train_time_s": 1.5}
    assert trained == [0], "one training, its record untouched, without restarts"
    for bad, key in (({"restarts": 0}, "restarts"), ({"restarts": 2.5}, "restarts"),
                     ({"restart_below": 1.5}, "restart_below"), ({"restart_below": 0}, "restart_below")):
        with pytest.raises(ValueError, match=f"^{key}: expected"):
            Restarts.from_protocol(bad)
    with pytest.raises(ValueError, match="table seeds in"):
        Restarts(count=2).seeds(1000)
    with pytest.raises(ValueError, match="^restart_score: expected"):
        Restarts.from_protocol({"restart_score": "max"})


def test_restarts_on_the_worst_validation_length_restart_what_the_mean_keeps():
    """Seed 0 holds at 128 and slips at 512: its mean passes 0.95 and its minimum does not, so ``min`` trains
    seed 1000, whose mean is lower and whose worst length is better, and keeps it."""
    val = {0: {"128": 1.0, "512": 0.92}, 1000: {"128": 0.97, "512": 0.96}, 2000: {"128": 1.0, "512": 1.0}}
    trained = []

    def train(run_seed):
        trained.append(run_seed)
        acc = val[run_seed]
        return ({"seed": run_seed, "selection_score": sum(acc.values()) / 2, "val_acc": acc, "steps": 1,
                 "train_time_s": 1.0}, None, True)

    assert train_with_restarts(train, 0, Restarts(3, 0.95), log=lambda *a: None)[0]["trained_seed"] == 0
    assert trained == [0], "the mean, 0.96, passes"
    trained.clear()
    record = train_with_restarts(train, 0, Restarts.from_protocol(
        {"restarts": 2, "restart_below": 0.95, "restart_score": "min"}), log=lambda *a: None)[0]
    assert trained == [0, 1000] and record["trained_seed"] == 1000, "the better minimum, not the better mean"


def test_a_sweep_with_restarts_validates_every_restart_and_tests_the_best(tmp_path):
    proto = tiny_protocol(tmp_path)
    proto["variant_sweeps"] = {"r": {"task": "parity", "model": "gru", "lr": 3e-3, "val_lengths": [40],
                                     "protocol": ["tasks.parity.max_steps=20", "restarts=2", "restart_below=1.0"],
                                     "variants": {"wd0": ["optimizer.weight_decay=0.0"]}}}
    table = runs.Table(tmp_path / "out")
    args = st.build_parser().parse_args(["--set", "trainer.eval_interval=10"])
    variant_sweeps.run_variant_sweep(proto, table, "r", [0, 1], args, log=lambda *a: None)
    rows = {r["seed"]: r for r in table.records if r["phase"] == "test"}
    select = next(r for r in table.records if r["phase"] == "select")
    assert select["key"] == "parity-gru-wd0-lr3e-3-s0" and rows[0]["run_dir"] == select["run_dir"]
    for seed, row in rows.items():
        # a 20-step GRU does not solve parity at 24 and 40 on validation, so both trainings run
        assert [t["seed"] for t in row["restarts"]] == [seed, seed + 1000], row["restarts"]
        best = max(row["restarts"], key=lambda t: t["selection_score"])
        assert row["trained_seed"] == best["seed"] and row["selection_score"] == best["selection_score"]
        assert set(row["val_acc"]) == {"24", "40"}, "a test-phase seed is validated when it restarts"
        assert f"trainer.seed={row['trained_seed']}" in row["overrides"] and Path(row["run_dir"], "best.pt").exists()
        assert row["steps"] == sum(t["steps"] for t in row["restarts"]) and "acc" in row
        assert row["machine"]["numpy"] == np.__version__ and row["machine"]["cpu"], "what it ran on"
        # the chosen restart's weights score its recorded validation accuracy again
        net = runs.load_best(proto, row, "parity")
        folder = task_sets.val_dir(proto, "parity", 40) / "eval"
        assert runs.accuracy(proto, "parity", runs.predictor(net, False), folder, 40) == row["val_acc"]["40"]


def test_a_variant_spells_its_change_for_rlt_and_baseline_configs_apart():
    proto = st.load_protocol()
    sweep = proto["variant_sweeps"]["parity_final_ew"]
    assert variant_sweeps.sweep_variant(proto, sweep, "fine_ew32")[0] == ["model.encoder_window=32"]
    assert variant_sweeps.sweep_variant(proto, sweep, "fine_ew32", baseline=True)[0] == ["baseline.encoder_window=32"]
    # its 'fine' variant is the table's own row (the same key, so the selection run is reused): same
    # overrides, same protocol
    table_row = variant_sweeps.sweep_variant(proto, proto["variant_sweeps"]["parity_final"], "fine")
    assert variant_sweeps.sweep_variant(proto, sweep, "fine") == table_row
    assert variant_sweeps.sweep_variant(proto, sweep, "fine", baseline=True) == table_row


def test_a_baseline_override_reaches_the_baseline_and_its_reload(tmp_path):
    proto = tiny_protocol(tmp_path)
    proto["tasks"]["parity"]["max_steps"] = 2
    task_sets.prepare_data(proto, "parity", log=lambda *a: None)
    record, net, rlt = runs.train_one(proto, "parity", "transformer", 0, tmp_path / "out", tag="w4",
                                      extra=["baseline.encoder_window=4"], log=lambda *a: None)
    assert not rlt and [b.window for b in net.blocks] == [4, 4]
    reloaded = runs.load_best(proto, record, "parity")  # rebuilt from the record's overrides
    assert [b.window for b in reloaded.blocks] == [4, 4]
    with pytest.raises(ConfigError, match="baseline.windw"):
        runs.train_one(proto, "parity", "transformer", 0, tmp_path / "out", tag="bad",
                       extra=["baseline.windw=4"], log=lambda *a: None)


def test_a_run_stopped_by_sigterm_is_not_recorded_as_finished(tmp_path, monkeypatch):
    """SIGTERM makes the trainer checkpoint and return early; the runner must not score and record that
    truncated run as if it had used its budget (it did, once: a 187-step 'budget' run)."""
    import os
    import signal

    from rlt_scale.experiments import curriculum

    proto = tiny_protocol(tmp_path)
    task_sets.prepare_data(proto, "parity", log=lambda *a: None)
    real_build = curriculum.build_trainer

    def sigterm(trainer, step, sums) -> bool:
        os.kill(os.getpid(), signal.SIGTERM)  # inside fit(), where the trainer's own handler is installed
        return False

    def build_and_signal(*a, **kw):
        trainer, cfg = real_build(*a, **kw)
        trainer.callbacks.append(sigterm)  # called at the first evaluation
        return trainer, cfg

    monkeypatch.setattr(curriculum, "build_trainer", build_and_signal)
    table = runs.Table(tmp_path / "out")
    args = st.build_parser().parse_args(["--set", "trainer.eval_interval=2"])
    with pytest.raises(curriculum.Preempted, match="stopped by a signal at step 2"):
        st.run_row(proto, table, "parity", "gru", [0], [3e-3], args, log=lambda *a: None)
    assert table.records == [] and not (tmp_path / "out" / "results.json").exists()


@pytest.mark.parametrize("model", ["gru", "rlt1_a1"])
def test_a_run_stopped_by_sigterm_resumes_where_it_stopped_and_ends_as_an_unbroken_run(tmp_path, monkeypatch, model):
    """Stopped once at the evaluation that ends its curriculum stage and once inside its last stage, a run
    resumed twice by the same call ends with the uninterrupted run's record (validation history, best
    step, steps per stage) and bit-identical best weights: the early stopper's state and kept weights
    travel in the checkpoint, and a finished stage is restored, not trained on."""
    import os
    import signal

    from rlt_scale.experiments import curriculum

    proto = tiny_protocol(tmp_path)
    # stage L=8 ends at its first evaluation (step 2); patience 8 lets the last stage stop at 18 at the soonest
    proto["tasks"]["parity"].update(curriculum=[8], curriculum_steps=12, curriculum_advance=0.0, max_steps=24)
    proto["early_stopping"] = {"target": 1.01, "patience": 8, "min_delta": 0.0}
    task_sets.prepare_data(proto, "parity", log=lambda *a: None)
    extra = ["trainer.eval_interval=2"] + (["model.d_model=32", "model.n_heads=2", "model.window=4"]
                                           if model != "gru" else [])
    quiet = lambda *a: None  # noqa: E731

    def train(out: Path):
        return runs.train_one(proto, "parity", model, 0, out, extra=extra, tag="t", lr=3e-3, log=quiet)

    unbroken, unbroken_net, _ = train(tmp_path / "unbroken")
    assert unbroken["stage_steps"][0] == (8, 2) and unbroken["stage_steps"][1][1] >= 18

    real_build = curriculum.build_trainer
    stop_at: dict = {}

    def build_and_signal(*a, **kw):
        trainer, cfg = real_build(*a, **kw)
        where = trainer.run_dir.name

        def sigterm(trainer, step, sums) -> bool:
            if stop_at.get(where) == step:
                os.kill(os.getpid(), signal.SIGTERM)  # the trainer's handler checkpoints at this step
            return False

        trainer.callbacks.append(sigterm)
        return trainer, cfg

    monkeypatch.setattr(curriculum, "build_trainer", build_and_signal)
    out = tmp_path / "stopped"
    run_dir = out / "runs" / runs.run_key("parity", model, 0, "t", "final", 3e-3)
    stop_at.update({"stage-L8": 2})
    with pytest.raises(curriculum.Preempted, match="at step 2 of stage L=8"):
        train(out)
    assert (run_dir / "stage-L8" / curriculum.FINISHED_FILE).exists()  # the signal came as the stage ended
    (run_dir / "stage-L8" / curriculum.FINISHED_FILE).unlink()  # as if the process had died before marking it
    stop_at.update({"stage-L8": None, run_dir.name: 10})
    with pytest.raises(curriculum.Preempted, match="at step 10 of stage L=24"):
        train(out)  # stage L=8 found ended in its checkpoint, and marked; the last stage stops at 10
    assert (run_dir / "stage-L8" / curriculum.FINISHED_FILE).exists()
    stop_at.clear()
    resumed, resumed_net, _ = train(out)  # stage L=8 restored again, L=24 resumes at 10

    assert resumed["resumed"] and not unbroken["resumed"]
    for field in ("steps", "stage_steps", "stage_lrs", "best_step", "best_val_acc", "val_history", "val_acc"):
        assert resumed[field] == unbroken[field], field
    assert len(unbroken["val_history"]) == unbroken["stage_steps"][1][1] // 2  # eval_interval 2: it saw every one
    for name, tensor in unbroken_net.state_dict().items():
        if isinstance(tensor, torch.Tensor):
            assert torch.equal(resumed_net.state_dict()[name], tensor), name
    assert not (run_dir / runs.UNFINISHED_FILE).exists()
    monkeypatch.setattr(curriculum, "build_trainer", real_build)
    again, _, _ = train(out)  # a finished run is not resumed: a rerun (--force) trains afresh
    assert not again["resumed"] and again["val_history"] == unbroken["val_history"]


def test_a_run_directory_of_another_recipe_is_emptied_not_resumed(tmp_path):
    """The unfinished mark names the recipe; a changed recipe (here its step budget) starts afresh."""
    recipe = {"key": "k", "stages": [[8, "d", 12, []]]}
    run_dir = tmp_path / "run"
    assert runs.open_run_dir(run_dir, recipe, log=lambda *a: None) is False
    (run_dir / "checkpoints").mkdir()
    assert runs.open_run_dir(run_dir, recipe, log=lambda *a: None) is True
    assert (run_dir / "checkpoints").exists()
    assert runs.open_run_dir(run_dir, {**recipe, "stages": [[8, "d", 24, []]]}, log=lambda *a: None) is False
    assert not (run_dir / "checkpoints").exists()


# ------------------------------------------------------------ the 2-hour table
def _recorded_choices(path: str) -> dict[tuple[str, str], float]:
    """(task, model) -> the lr of the recorded test rows of the running-state table (untagged rows)."""
    import json
    records = json.loads(Path(path).read_text())
    return {(r["task"], r["model"]): r["lr"] for r in records
            if r["phase"] == "test" and r["supervision"] == "running" and not r["tag"]}


def test_the_budget_table_trains_each_row_at_its_recorded_validation_choice_on_a_fresh_test_round():
    budget, whole = st.load_protocol(budget=True), st.load_protocol()
    st.check_rows(budget)
    assert "row_lr" not in whole and "row_variant" not in whole and whole.get("test_round", 0) == 0  # preset only
    round_two = _recorded_choices("docs/results/state_tracking-round2.json")
    for task in budget["run_tasks"]:
        for model in budget["run_models"]:
            lr = budget["row_lr"][task][model]
            assert lr in whole["lr_sweep"], (task, model)
            if task in ("parity", "five_state"):  # chosen by round two's equal lr sweep, on validation
                assert lr == round_two[(task, model)], (task, model)
    mod5 = whole["variant_sweeps"]["mod5_steps"]  # the 1,500-step rows, one lr for every model
    assert set(budget["row_lr"]["mod5"].values()) == {mod5["lr"]}
    assert f"tasks.mod5.max_steps={budget['tasks']['mod5']['max_steps']}" in mod5["variants"]["s1500"]["protocol"]
    # mod-5's encoder window: the variant each attention model chose on validation in the recorded sweep, which
    # trained at the budget's steps and lr
    window = whole["variant_sweeps"]["mod5_encoder_window"]
    assert f"tasks.mod5.max_steps={budget['tasks']['mod5']['max_steps']}" in window["protocol"]
    import json
    chosen = {r["model"]: f"{r['variant_sweep']}.{r['chosen_variant']}"
              for r in json.loads(Path("docs/results/state_tracking-round3-session13.json").read_text())
              if r["phase"] == "test" and r.get("variant_sweep") == "mod5_encoder_window"}
    assert budget["row_variant"] == {"mod5": chosen} and set(chosen) == set(window["models"])
    assert {budget["row_lr"]["mod5"][m] for m in chosen} == {window["lr"]}
    # scored on programs that no other recorded row has read (the budget table's own records excepted)
    import glob
    used = {r.get("test_round", 0) for f in glob.glob("docs/results/state_tracking-*.json") if "budget" not in f
            for r in json.loads(Path(f).read_text()) if r["phase"] == "test"}
    # ... and that no variant sweep is set to read (a later sweep may take a later round, never the budget's)
    declared = {int(o.split("=", 1)[1]) for sweep in whole["variant_sweeps"].values()
                for o in [*(sweep.get("protocol") or []),
                          *(x for v in sweep["variants"].values() if isinstance(v, dict) for x in v.get("protocol") or [])]
                if o.startswith("test_round=")}
    assert budget["test_round"] not in used | declared, sorted(used | declared)


def test_row_lr_is_checked_by_name_and_an_explicit_lr_list_wins():
    proto = st.load_protocol(budget=True)
    assert st.row_lrs(proto, "parity", "rlt0", [1e-3, 3e-3], explicit=False) == [3e-4]
    assert st.row_lrs(proto, "parity", "rlt0", [1e-3], explicit=True) == [1e-3]
    assert st.row_lrs(proto, "s5", "rlt0", [1e-3, 3e-3], explicit=False) == [1e-3, 3e-3]  # no fixed lr: the sweep
    proto["row_lr"]["parity"]["rlt9"] = 1e-3
    with pytest.raises(ValueError, match=r"row_lr\.parity\.rlt9: unknown model"):
        st.check_rows(proto)
    proto["row_lr"] = {"parity": {"gru": -1}}
    with pytest.raises(ValueError, match=r"row_lr\.parity\.gru: expected a positive learning rate"):
        st.check_rows(proto)
    proto["row_lr"] = {}
    for wrong in ("mod5_encoder_window.s9", "nosweep.s1500", "parity_encoder_window.ew32"):
        proto["row_variant"] = {"mod5": {"rlt0": wrong}}
        with pytest.raises(ValueError, match=r"row_variant\.mod5\.rlt0: expected SWEEP\.VARIANT of a mod5 sweep"):
            st.check_rows(proto)
    with pytest.raises(ValueError, match="exclude each other"):
        st.load_protocol(quick=True, budget=True)


def test_the_budget_command_trains_at_the_fixed_lr_without_a_sweep_and_scores_its_round(tmp_path):
    proto = tiny_protocol(tmp_path)
    proto["variant_sweeps"] = {"parity_width": {"task": "parity", "models": ["gru"], "lr": 3e-3, "variants": {
        "d24": {"set": ["model.d_model=24"], "baseline_set": ["baseline.d_model=24"], "protocol": ["test_round=7"]}}}}
    proto["budget"] = {"test_round": 1, "row_lr": {"parity": {"gru": 3e-3}}, "run_tasks": ["parity"],
                       "run_models": ["gru"], "run_sweeps": [], "row_variant": {"parity": {"gru": "parity_width.d24"}}}
    path = tmp_path / "protocol.yaml"
    from omegaconf import OmegaConf
    OmegaConf.save(OmegaConf.create(proto), path)
    out = tmp_path / "out"
    assert st.main(["--protocol", str(path), "--budget", "--seeds", "0", "--out", str(out),
                    "--set", "trainer.eval_interval=20"]) == 0
    records = runs.Table(out).records
    # the row variant's baseline overrides and name, not its protocol (the budget's round 1 holds)
    assert [(r["phase"], r["lr"], r["test_round"], r["key"]) for r in records] == [
        ("test", 3e-3, 1, "parity-gru-d24-s0")]
    assert "baseline.d_model=24" in records[0]["overrides"] and records[0]["parameters"] < 80560
    assert (tmp_path / "data" / "parity" / "test-L40-n32-r1").exists()  # round 1: a folder of its own
    # the whole protocol from the same file still sweeps (lr_sweep [1e-3, 3e-3]) and reads round 0
    assert st.main(["--protocol", str(path), "--seeds", "0", "--out", str(tmp_path / "whole"), "--tasks", "parity",
                    "--models", "gru", "--sweeps", "none", "--set", "trainer.eval_interval=20"]) == 0
    whole = runs.Table(tmp_path / "whole").records
    assert sorted(r["phase"] for r in whole) == ["select", "select", "test"] and whole[-1]["test_round"] == 0
