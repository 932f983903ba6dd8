"""The research-check pipeline: evaluation, baselines, early stopping, and one tiny RLT that learns parity."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from rlt_scale.data import tasks
from rlt_scale.data.prepare import prepare_task
from rlt_scale.data.tasks import transition_table
from rlt_scale.experiments import report, runs, task_sets
from rlt_scale.experiments import state_tracking as st
from rlt_scale.experiments.baselines import BaselineConfig, build_baseline, count_parameters
from rlt_scale.experiments.curriculum import curriculum_options
from rlt_scale.experiments.early_stopping import EarlyStopper
from rlt_scale.experiments.evaluate import (
    ANSWER_TOKENS,
    batches_of,
    evaluate_accuracy,
    evaluate_path,
    predictions,
)
from rlt_scale.experiments.supervision import target_fn

V = 260


def _one_hot(ids: torch.Tensor) -> torch.Tensor:
    logits = torch.full((len(ids), V), -1.0)
    logits[torch.arange(len(ids)), ids] = 1.0
    return logits


def _answers(path) -> np.ndarray:
    return np.concatenate([b["tokens"][b["loss_mask"][:, -1], -1].numpy() for b in batches_of(str(path), 64)])


@pytest.fixture(scope="module")
def sets(tmp_path_factory):
    root = tmp_path_factory.mktemp("sets")
    prepare_task("parity", root / "parity", num_samples=8, length=12, seed=3, eval_samples=301)
    prepare_task("five_state", root / "five", num_samples=8, length=9, seed=4, eval_samples=250)
    return root


# --------------------------------------------------------------- evaluation
def test_perfect_parity_predictor_scores_one(sets):
    def perfect(tokens, doc, mask):  # computes the parity from the body, never reads the answer
        bits = tokens[:, 1:-2] - ord("0")
        return _one_hot(ord("0") + bits.sum(dim=1) % 2)

    acc = evaluate_path(perfect, str(sets / "parity" / "eval"), ANSWER_TOKENS["parity"], batch_size=64)
    assert acc.total == 301  # 301 = 4 * 64 + 45: the padding rows of the last batch are not counted
    assert acc.accuracy == 1.0


def test_perfect_five_state_predictor_scores_one(sets):
    table = torch.as_tensor(transition_table(0))

    def perfect(tokens, doc, mask):
        state = torch.zeros(len(tokens), dtype=torch.long)
        for t in range(1, tokens.shape[1] - 2):
            state = table[tokens[:, t] - ord("a"), state]
        return _one_hot(ord("0") + state)

    assert evaluate_path(perfect, str(sets / "five" / "eval"), ANSWER_TOKENS["five_state"]).accuracy == 1.0


@pytest.mark.parametrize("task, folder, answer", [("parity", "parity", "0"), ("parity", "parity", "1"),
                                                  ("five_state", "five", "3")])
def test_constant_predictor_scores_the_class_frequency(sets, task, folder, answer):
    def constant(tokens, doc, mask):
        return _one_hot(torch.full((len(tokens),), ord(answer)))

    path = sets / folder / "eval"
    freq = float(np.mean(_answers(path) == ord(answer)))
    assert 0.0 < freq < 1.0
    assert evaluate_path(constant, str(path), ANSWER_TOKENS[task], batch_size=32).accuracy == pytest.approx(freq)


def test_predictions_are_restricted_to_answer_tokens():
    logits = torch.zeros(2, V)
    logits[:, 7] = 10.0  # not an answer token
    logits[0, ord("1")] = 1.0
    logits[1, ord("0")] = 1.0
    assert predictions(logits, ANSWER_TOKENS["parity"]).tolist() == [ord("1"), ord("0")]
    assert predictions(logits).tolist() == [7, 7]


def test_max_samples_limits_the_count(sets):
    acc = evaluate_accuracy(lambda t, d, m: _one_hot(t[:, -1]), batches_of(str(sets / "parity" / "eval"), 64),
                            ANSWER_TOKENS["parity"], max_samples=100)
    assert (acc.total, acc.accuracy) == (100, 1.0)


# -------------------------------------------------------------- supervision
@pytest.mark.parametrize("task", ["parity", "five_state", "addition"])
def test_running_targets_end_in_the_answer(task):
    taskset = tasks.generate(task, 64, 7, seed=5)
    tokens = torch.as_tensor(taskset.tokens)
    targets, valid = target_fn(task, "running")(tokens)
    assert targets.shape == valid.shape == (64, taskset.seq_len)
    assert not valid[:, 0].any()  # BOS: no state yet
    assert valid[:, -1].all() and torch.equal(targets[:, -1], tokens[:, -1])  # '=' keeps the answer
    last_op = valid[0, :-1].nonzero().max()  # after the last operation the state is the answer
    assert torch.equal(targets[:, last_op], tokens[:, -1])
    if task == "addition":
        assert valid[0, 1:-1].tolist() == [False, True] * 7  # a carry is known after both bits
    else:
        assert valid[:, 1:].all()
    assert target_fn(task, "final") is None


def test_running_parity_targets_are_prefix_parities():
    tokens = torch.tensor([[256, *map(ord, "0110100"), ord("="), ord("1")]])
    targets, _ = target_fn("parity", "running")(tokens)
    assert "".join(map(chr, targets[0, 1:-1].tolist())) == "0100111"


# ------------------------------------------------------- baselines, stopping
@pytest.mark.parametrize("path", ["configs/experiments/transformer.yaml", "configs/experiments/gru.yaml"])
def test_baselines_are_parameter_matched_and_causal(path):
    from omegaconf import OmegaConf

    bcfg = BaselineConfig(**OmegaConf.to_container(OmegaConf.load(path))["baseline"])
    torch.manual_seed(0)
    model = build_baseline(bcfg)
    assert abs(count_parameters(model) - 79_320) / 79_320 < 0.05  # RLT-1's unique parameters
    tokens = torch.randint(0, 259, (3, 11))
    logits = model(tokens)
    assert logits.shape == (3, 11, V)
    changed = tokens.clone()
    changed[:, 7] = (changed[:, 7] + 1) % 259
    assert torch.allclose(model(changed)[:, :7], logits[:, :7], atol=1e-6)  # no position sees the future
    assert model.forward_flops(34) > 0


@pytest.mark.parametrize("kind", ["transformer", "gru"])
def test_a_baseline_computes_each_packed_document_as_if_alone(kind):
    """Rows of packed programs (``mixed_lengths``): with document ids, every program's logits equal those of
    the program alone, in float64 to 1e-12 (summation order only: a packed row tiles its attention and
    steps its GRU differently); without them the row is one sequence, and the later programs differ."""
    torch.manual_seed(0)
    model = build_baseline(BaselineConfig(kind=kind, n_layers=2)).double()
    lengths = [5, 1, 9, 3]
    programs = [torch.randint(0, 259, (2, n)) for n in lengths]
    row = torch.cat(programs, dim=1)
    doc = torch.cat([torch.full((2, n), i) for i, n in enumerate(lengths)], dim=1)
    packed, at = model(row, doc), 0
    for program in programs:
        alone = model(program)
        assert torch.allclose(packed[:, at:at + program.shape[1]], alone, rtol=0, atol=1e-12), kind
        at += program.shape[1]
    assert torch.equal(model(row, torch.zeros_like(doc)), model(row))  # one document: the plain forward
    assert not torch.allclose(model(row)[:, 5:], packed[:, 5:], atol=1e-6)


def test_the_training_loss_hands_a_baseline_the_document_ids_of_packed_programs():
    """``sequence_sums`` (the loss of every step and evaluation) on a batch of packed programs equals the sum
    of each program's loss alone, with as many targets and right answers: the answer-only loss of
    ``mixed_lengths`` rows (the model in float64; the loss is summed in float32, as every loss is, so the
    two sums of about 50 agree to 1e-6 relative)."""
    from rlt_scale.data.tasks import packed
    from rlt_scale.training.bptt import BPTT
    from rlt_scale.training.engine import Objective, sequence_sums

    torch.manual_seed(0)
    model = build_baseline(BaselineConfig(kind="gru", n_layers=2)).double()
    rows = packed("parity", 3, 8, 22, seed=1)
    batch = {"tokens": torch.as_tensor(rows.tokens), "doc_ids": torch.as_tensor(rows.doc_ids),
             "loss_mask": torch.as_tensor(rows.masks)}
    objective = Objective(answer_tokens=ANSWER_TOKENS["parity"])
    loss, targets, correct = (x.detach() for x in sequence_sums(model, batch, objective, BPTT(), count_correct=True))
    alone = [0.0, 0, 0]
    for r in range(3):
        for d in range(int(rows.doc_ids[r].max()) + 1):
            keep = rows.doc_ids[r] == d
            one = {"tokens": torch.as_tensor(rows.tokens[r][keep])[None],
                   "loss_mask": torch.as_tensor(rows.masks[r][keep])[None]}
            sums = sequence_sums(model, one, objective, BPTT(), count_correct=True)
            alone = [a + float(x.detach()) for a, x in zip(alone, sums)]
    assert int(targets) == alone[1] == int(rows.masks.sum()) and int(correct) == alone[2]
    assert float(loss) == pytest.approx(alone[0], rel=1e-6, abs=0)


def test_the_transformer_window_limits_how_far_back_a_position_sees():
    from rlt_scale.errors import ConfigError

    torch.manual_seed(0)
    full = build_baseline(BaselineConfig(n_layers=2))
    windowed = build_baseline(BaselineConfig(n_layers=2, encoder_window=3))
    wide = build_baseline(BaselineConfig(n_layers=2, encoder_window=12))
    windowed.load_state_dict(full.state_dict())
    wide.load_state_dict(full.state_dict())
    tokens = torch.randint(0, 259, (2, 12))
    changed = tokens.clone()
    changed[:, 2] = (changed[:, 2] + 1) % 259
    # two blocks of a 3-token window (itself and 2 back): position t reads t-4 .. t
    moved = (windowed(changed) - windowed(tokens)).abs().amax(dim=(0, 2))
    assert (moved[2:7] > 1e-6).all() and (moved[7:] == 0).all(), moved
    assert ((full(changed) - full(tokens)).abs().amax(dim=(0, 2))[7:] > 1e-6).all()
    assert torch.equal(wide(tokens), full(tokens))  # a window as long as the input is full attention
    d = 48
    assert full.forward_flops(12) - windowed.forward_flops(12) == 2 * 4 * d * sum(t + 1 - 3 for t in range(3, 12))
    assert wide.forward_flops(12) == full.forward_flops(12)
    with pytest.raises(ConfigError, match="baseline.encoder_window"):
        BaselineConfig(kind="gru", encoder_window=3).validate()


def test_early_stopper_keeps_the_best_weights_and_stops():
    net = torch.nn.Linear(2, 1)
    stopper = EarlyStopper(target=0.99, patience=2, min_delta=0.0)
    assert not stopper.update(10, 0.6, net)
    best = net.weight.detach().clone()
    with torch.no_grad():
        net.weight.add_(1.0)
    assert not stopper.update(20, 0.5, net)
    assert stopper.update(30, 0.55, net)  # two evaluations without gain
    stopper.restore(net)
    assert torch.equal(net.weight, best) and stopper.best_step == 10
    assert EarlyStopper(target=0.9).update(5, 0.95, net)  # solved


def test_markdown_table_reports_mean_min_max():
    recs = [{"key": f"parity-rlt1-s{s}", "task": "parity", "model": "rlt1", "tag": "", "seed": s, "parameters": 79320,
             "train_length": 32, "steps": 100, "train_time_s": 1.0, "forward_flops_per_example": 2e6,
             "acc": {"16": a, "32": a}} for s, a in [(0, 0.5), (1, 1.0), (2, 0.75)]]
    table = report.markdown_table(recs)
    assert "75.0 [50.0, 100.0]" in table and "16: ~100, 32: ~100, 64: ~82, 128: 60.8" in table
    assert "| answer |" in table  # records without a supervision field are the data's own (final) targets
    assert "test round" not in table
    later = report.markdown_table([dict(r, test_round=1, tag="t") for r in recs])
    assert "RLT-1 `t` (test round 1)" in later, "a row scored on fresh test programs says so"


def test_published_points_are_drawn_once_per_model_beside_its_first_row_tagged_or_not():
    from rlt_scale.experiments.report import published_lines

    groups = {("mod5", "rlt1_a1", "s1500_ew64", "running"): [], ("mod5", "rlt1_a1", "", "running"): [],
              ("mod5", "gru", "", "running"): [], ("parity", "rlt0", "", "final"): []}
    assert published_lines("mod5", groups) == {("mod5", "rlt1_a1", "s1500_ew64", "running"): ([256], [20.0])}
    assert published_lines("parity", groups) == {("parity", "rlt0", "", "final"): ([16, 32, 64, 128],
                                                                                   [98.0, 59.0, 49.0, 50.0])}


def test_a_run_that_overrides_alpha_is_labelled_with_its_own():
    from rlt_scale.experiments.report import model_label

    assert model_label("rlt1_a1", {"overrides": ["trainer.seed=0"]}) == "RLT-1, alpha=1"
    assert model_label("rlt1_a1", {"overrides": ["model.feedback_scale=0.1"]}) == "RLT-1, alpha=0.1"
    assert model_label("rlt0", {"overrides": ["model.feedback_scale=0.5"]}) == "RLT-0 (no feedback), alpha=0.5"


# ------------------------------------------------- the pipeline, end to end
# The table's recipe, shrunk: RLT-1 with feedback scale 1 and the running-state loss
# (docs/RESULTS.md). At the framework's defaults (alpha 0.1, answer-only loss) RLT-1
# sits on the parity plateau for thousands of steps. This tiny model reaches >= 98%
# validation accuracy on 8-bit parity within 150-250 steps for seeds 0-2 (measured:
# 95.7-99.8% test accuracy at 8 bits); the test allows 400 steps and asserts >= 80%.
TINY_RLT = ["model.d_model=32", "model.n_heads=2", "model.window=4", "model.feedback_scale=1.0",
            "trainer.micro_batch_size=32", "trainer.eval_interval=50", "optimizer.lr=3e-3",
            "optimizer.min_lr=3e-3", "optimizer.warmup_steps=20"]


def tiny_protocol(root, **task) -> dict:
    proto = st.load_protocol()
    proto.update(data_root=str(root / "data"), val_samples=256, eval_samples=512, supervision="running")
    proto["early_stopping"] = {"target": 0.98, "patience": 0, "min_delta": 0.0}
    proto["tasks"] = {"parity": {"train_length": 8, "train_samples": 4000, "max_steps": 400, "eval_lengths": [8, 16],
                                 **task}}
    return proto


def test_tiny_rlt_learns_parity_through_the_pipeline(tmp_path):
    """One tiny seed of RLT-1 on 8-bit parity: clearly above chance (50%) at the training length."""
    proto = tiny_protocol(tmp_path)
    task_sets.prepare_data(proto, "parity")
    record = runs.run_one(proto, "parity", "rlt1", seed=0, out=tmp_path / "out", extra=TINY_RLT)
    assert record["acc"]["8"] >= 0.8, record
    assert record["steps"] <= 400 and record["best_val_acc"] >= 0.8
    assert 0.0 <= record["acc"]["16"] <= 1.0  # a longer test length runs through the same path
    runs.save_results(tmp_path / "out" / "results.json", [record])
    assert json.loads((tmp_path / "out" / "results.json").read_text())[0]["key"] == "parity-rlt1-running-s0"
    assert "RLT-1" in report.markdown_table([record])


def test_curriculum_trains_short_programs_first(tmp_path):
    """A GRU through a 2 -> 4 -> 8 curriculum: one stage per length, weights carried from stage to stage."""
    proto = tiny_protocol(tmp_path, curriculum=[2, 4], curriculum_steps=60, curriculum_advance=0.9, max_steps=200)
    task_sets.prepare_data(proto, "parity")
    record = runs.run_one(proto, "parity", "gru", seed=0, out=tmp_path / "out", supervision="final",
                          extra=["trainer.eval_interval=20"])
    assert [length for length, _ in record["stage_steps"]] == [2, 4, 8]
    assert all(0 < steps <= 60 for _, steps in record["stage_steps"][:2])
    assert record["steps"] == sum(steps for _, steps in record["stage_steps"])
    assert (tmp_path / "out" / "runs" / "parity-gru-s0" / "stage-L2" / "val.jsonl").exists()
    # The GRU learns 8-bit parity from the answer alone here: 100% for seeds 0-2 (measured).
    assert record["acc"]["8"] >= 0.8, record


def test_curriculum_entry_check_skips_a_stage_the_model_already_solves(tmp_path):
    """With ``curriculum_entry_check`` a stage that receives a model scores it first (step 0) and is skipped
    when that meets its target. ``curriculum_advance=0`` makes every score meet it: the first stage (no model
    received) trains to its first evaluation, the second trains 0 steps; without the check it trains too."""
    steps = {}
    for check in (True, False):
        proto = tiny_protocol(tmp_path / str(check), curriculum=[2, 4], curriculum_steps=80, curriculum_advance=0.0,
                              max_steps=40, curriculum_entry_check=check)
        task_sets.prepare_data(proto, "parity")
        record = runs.run_one(proto, "parity", "gru", seed=0, out=tmp_path / str(check) / "out", supervision="final",
                              extra=["trainer.eval_interval=20"])
        steps[check] = record["stage_steps"]
        first_val = json.loads((tmp_path / str(check) / "out" / "runs" / "parity-gru-s0" / "stage-L4" / "val.jsonl")
                               .read_text().splitlines()[0])
        assert first_val["step"] == (0 if check else 20) and first_val["stop"], first_val
        assert (record["val_history"][0][0] == 0) == check  # the last stage scored its model before training
    assert steps[True][:2] == [(2, 20), (4, 0)] and steps[True][2][1] > 0, steps
    assert steps[False][:2] == [(2, 20), (4, 20)], steps


def test_curriculum_carry_best_hands_on_the_best_weights_not_the_last(tmp_path):
    """``curriculum_carry_best``: the next stage receives the weights of the stage's best evaluation. Here the
    curriculum stage and the last stage train on the same 16-bit set (at lr 0.03: a noisy run), so the last
    stage's entry score (step 0) is the score of the weights it received: the curriculum stage's best with the
    key, its last without."""
    got = {}
    for carry in (True, False):
        root = tmp_path / str(carry)
        proto = tiny_protocol(root, train_length=16, eval_lengths=[16], curriculum=[16], curriculum_steps=100,
                              curriculum_advance=1.1, max_steps=10, curriculum_entry_check=True,
                              curriculum_carry_best=carry)
        task_sets.prepare_data(proto, "parity")
        record = runs.run_one(proto, "parity", "gru", seed=0, out=root / "out", supervision="final",
                              extra=["trainer.eval_interval=10", "optimizer.lr=0.03", "optimizer.warmup_steps=1"])
        stage = [json.loads(line)["val_acc"] for line in
                 (root / "out" / "runs" / "parity-gru-s0" / "stage-L16" / "val.jsonl").read_text().splitlines()]
        got[carry] = (record["val_history"][0], max(stage), stage[-1])
    (step, entry), best, last = got[True]
    assert step == 0 and entry == best and best > last, got  # the run's best and last differ: the test can fail
    (step, entry), best, last = got[False]
    assert step == 0 and entry == last, got


def test_curriculum_near_solved_stage_trains_at_a_smaller_step(tmp_path):
    """``curriculum_near_solved``: a stage whose entry score reaches it without meeting its target trains at
    ``curriculum_near_solved_lr_scale`` of its learning rate. At 0.0 every entry counts, at 1.01 none does;
    the first stage has no entry score and keeps its own."""
    got = {}
    for at in (0.0, 1.01):
        root = tmp_path / str(at)
        proto = tiny_protocol(root, curriculum=[4], curriculum_steps=20, curriculum_advance=1.1, max_steps=20,
                              curriculum_entry_check=True, curriculum_near_solved=at,
                              curriculum_near_solved_lr_scale=0.25)
        task_sets.prepare_data(proto, "parity")
        record = runs.run_one(proto, "parity", "gru", seed=0, out=root / "out", supervision="final",
                              extra=["trainer.eval_interval=10", "optimizer.lr=0.02"])
        got[at] = record
    assert got[1.01]["stage_lrs"] == [(4, 0.02), (8, 0.02)]
    assert got[0.0]["stage_lrs"] == [(4, 0.02), (8, pytest.approx(0.005, rel=1e-12))]
    assert got[0.0]["val_history"][0] == got[1.01]["val_history"][0]  # the same entry ...
    assert got[0.0]["val_history"][1:] != got[1.01]["val_history"][1:]  # ... trained differently
    with pytest.raises(ValueError, match="curriculum_near_solved needs curriculum_entry_check"):
        curriculum_options({"curriculum_near_solved": 0.9})


def test_curriculum_steps_may_give_each_stage_its_own_budget(tmp_path):
    """``curriculum_steps: [30, 10]``: stage 2 runs its 30 steps, stage 4 its 10 (neither can reach an advance
    of 1.1), then the training length under early stopping; a list of the wrong length is refused by key."""
    proto = tiny_protocol(tmp_path, curriculum=[2, 4], curriculum_steps=[30, 10], curriculum_advance=1.1,
                          max_steps=20)
    task_sets.prepare_data(proto, "parity")
    record = runs.run_one(proto, "parity", "gru", seed=0, out=tmp_path / "out", supervision="final",
                          extra=["trainer.eval_interval=10"])
    assert [tuple(s) for s in record["stage_steps"][:2]] == [(2, 30), (4, 10)]
    assert record["stage_steps"][2][0] == 8 and 0 < record["stage_steps"][2][1] <= 20
    for bad in ([30], [30, 0], "30"):
        with pytest.raises(ValueError, match=r"^tasks\.parity\.curriculum_steps: expected"):
            runs.build_stages(tiny_protocol(tmp_path, curriculum=[2, 4], curriculum_steps=bad), "parity", 0, 20)


def test_stage_ablation_replays_a_run_exactly_to_a_stage_and_varies_only_that_stage(tmp_path):
    """``stage_ablation`` replays a recorded curriculum run to the entry of its last stage: the replay's stage
    steps, the entry score and the as-run stage's validation scores equal the record's. Two earlier stages,
    the first of which hands on its best weights, not its last (``curriculum_carry_best``), as the table's
    runs did. A variant (fresh AdamW moments) starts from the same entry score and then trains differently."""
    from rlt_scale.experiments import stage_ablation as ab

    proto = tiny_protocol(tmp_path, curriculum=[4, 6], curriculum_steps=40, curriculum_advance=1.1, max_steps=40,
                          curriculum_entry_check=True, curriculum_carry_best=True)
    task_sets.prepare_data(proto, "parity")
    record = runs.run_one(proto, "parity", "rlt1", seed=0, out=tmp_path / "out", supervision="running",
                          extra=[*TINY_RLT, "trainer.eval_interval=10", "optimizer.warmup_steps=5",
                                 "optimizer.lr=0.01"])
    first = [json.loads(line)["val_acc"] for line in
             (tmp_path / "out" / "runs" / "parity-rlt1-running-s0" / "stage-L4" / "val.jsonl").read_text().splitlines()]
    assert max(first) > first[-1], first  # its best is not its last: a replay that hands on the last differs
    entry, stages, index, common = ab.replay_to_entry(proto, record, 8, tmp_path / "ablation", log=lambda *a: None)
    assert index == 2 and [list(s) for s in entry.stage_steps] == [list(s) for s in record["stage_steps"][:2]]
    variants = {name: ab.run_variant(name, proto, record, entry, stages, index, common, steps=20, every=10,
                                 work=tmp_path / "ablation", log=lambda *a: None)
            for name in ("as_run", "fresh_moments")}
    as_run = {h["step"]: h["val_acc"] for h in variants["as_run"]["history"]}
    assert sorted(as_run) == [0, 10, 20] and len(variants["as_run"]["train"]) == 20
    assert [step for step, _ in record["val_history"] if step in as_run] == [0, 10, 20]
    assert [as_run[step] for step, _ in record["val_history"] if step in as_run] == \
           [acc for step, acc in record["val_history"] if step in as_run], (as_run, record["val_history"])
    fresh = variants["fresh_moments"]
    assert fresh["history"][0]["val_acc"] == as_run[0] and fresh["history"][0]["distance"] == 0.0
    assert fresh["train"][0]["loss"] == variants["as_run"]["train"][0]["loss"], "the same entry weights and batch"
    assert fresh["train"][-1]["loss"] != variants["as_run"]["train"][-1]["loss"], "and another optimizer state"
    with pytest.raises(SystemExit, match="stage 4: not a later stage"):
        ab.replay_to_entry(proto, record, 4, tmp_path / "ablation", log=lambda *a: None)


def test_every_stage_ablation_variant_spells_real_config_keys():
    from rlt_scale.config import load_config
    from rlt_scale.experiments import stage_ablation as ab

    for name, spec in ab.VARIANTS.items():
        load_config("configs/experiments/rlt1-alpha1.yaml", spec.get("set", []))  # an unknown key raises
        assert set(spec) <= {"set", "group", "fresh", "lr_scale"}, name
    scaled = ab._scaled_lr(["optimizer.lr=0.003", "optimizer.min_lr=0.0003", "optimizer.lr=0.001"], 0.1)
    assert [o.split("=")[0] for o in scaled] == ["optimizer.lr", "optimizer.min_lr"]  # the last setting of each
    assert [float(o.split("=")[1]) for o in scaled] == pytest.approx([1e-4, 3e-5], rel=1e-12)


def test_feedback_probe_reloads_the_record_and_switches_only_the_feedback_off(tmp_path):
    """``feedback_probe`` scores a recorded run's best weights as the run scored them (the record's validation
    accuracies, exactly), and with the feedback off: the scores of the same weights with the merge's
    projection zeroed, an independent way to make ``u = e``. This tiny RLT-1 learns 8-bit parity through its
    recurrence (running-state loss), so without feedback it falls to chance."""
    from rlt_scale.experiments import feedback_probe as fp

    proto = tiny_protocol(tmp_path, val_lengths=[16])
    task_sets.prepare_data(proto, "parity")
    record, _, _ = runs.train_one(proto, "parity", "rlt1", seed=0, out=tmp_path / "out", supervision="running",
                                  extra=TINY_RLT)
    result = fp.probe(proto, record, [8, 16], log=lambda *a: None)
    assert result["as_trained"] == record["val_acc"] and result["feedback_scale"] == 1.0
    net = runs.load_best(proto, record, "parity")
    with torch.no_grad():
        net.merge.proj.weight.zero_()
    predict = runs.predictor(net, rlt=True)
    for length in (8, 16):
        folder = fp.validation_folder(proto, "parity", length)
        assert result["feedback_off"][str(length)] == runs.accuracy(proto, "parity", predict, folder, length)
    assert result["as_trained"]["8"] >= 0.8 and result["feedback_off"]["8"] <= 0.65, result
    assert fp.probe(proto, record, [8], log=lambda *a: None)["as_trained"]["8"] == record["val_acc"]["8"]
    longer = fp.validation_folder(proto, "parity", 12, log=lambda *a: None)  # not a selection length yet
    assert longer == task_sets.val_dir(proto, "parity", 12) / "eval" and (longer / "index.json").exists()
