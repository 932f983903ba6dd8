"""The state-tracking table: RLT-1, RLT-2, RLT-0, a causal Transformer and a GRU on synthetic state tracking.

Usage::

    python -m rlt_scale.experiments.state_tracking                      # the whole protocol, 3 seeds
    python -m rlt_scale.experiments.state_tracking --tasks parity --models rlt1_a1,gru --seeds 0
    python -m rlt_scale.experiments.state_tracking --tasks parity --supervision final   # answer-only loss
    python -m rlt_scale.experiments.state_tracking --lrs 1e-3           # no sweep: one learning rate
    python -m rlt_scale.experiments.state_tracking --quick              # smoke run of the pipeline, minutes
    python -m rlt_scale.experiments.state_tracking --budget             # the 2-hour table (rows cut: see the YAML)
    python -m rlt_scale.experiments.state_tracking --tasks parity --models rlt1 --seeds 0 \\
        --set model.window=16 --tag w16                                 # a variant (RLT configs only)
    python -m rlt_scale.experiments.state_tracking --table-only         # rewrite results.md (+ plots)
    python -m rlt_scale.experiments.state_tracking --tasks parity --models none \
        --sweeps parity_encoder_window                                  # a variant sweep only (below)

The protocol of one table row (task, model, supervision, tag):

1. **Data** (prepared once, reused; every set has a generator seed of its own):
   the training set at the training length, seed ``train_seed``, with its
   validation split (``OUT/eval``, for early stopping) and, for a curriculum,
   the same at each stage's length; **validation sets** at ``val_lengths``
   (seed :func:`val_seed`), used for every choice; **test sets** at
   ``eval_lengths`` (seed :func:`test_seed`), scored once per row; a recipe
   chosen after test figures were read is scored on a later ``test_round``.
2. **Selection.** Every model gets the same sweep: each learning rate of
   ``lr_sweep`` is trained on each of ``selection_seeds`` (the best weights by
   early stopping kept), then scored on the validation sets only. The learning
   rate with the highest mean validation accuracy (over the training-length
   split and ``val_lengths``, then over the selection seeds) is the row's.
3. **Test.** Each seed of the row is trained at the chosen learning rate (the
   selection runs are reused, not retrained) and scored on the test sets.

With ``restarts`` in the protocol, a seed whose validation score stays below
``restart_below`` trains again from another seed and keeps its best training
on validation (:mod:`~rlt_scale.experiments.restarts`), in selection and test
alike.

**Variant sweeps** (``variant_sweeps`` of the protocol, :func:`run_variant_sweep`)
choose between config or protocol variants of a row the same way (validation
only, then one test per seed of the chosen variant's row); ``run_sweeps`` are
part of the whole protocol's run.

Every run goes through the ordinary ``rlt-train`` loop
(:class:`~rlt_scale.training.trainer.Trainer`, the YAML in
``configs/experiments/`` plus the overrides stored in each record); the loss
covers the answer only or the running state too (``supervision``); a
curriculum trains shorter programs first. Runs are appended to
``OUT/results.json`` as they finish (``"phase": "select"`` for a sweep run,
``"test"`` for a table run) and ``OUT/results.md`` is rewritten each time; a
run already there is skipped (``--force`` reruns it), so an interrupted table
resumes. Tables and plots: :mod:`rlt_scale.experiments.report`.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import fcntl
import json
import shutil
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from rlt_scale.data.prepare import prepare_task
from rlt_scale.data.tasks import MIN_PACKED_LENGTH
from rlt_scale.experiments.curriculum import (Preempted, Stage, build_trainer, curriculum_options, is_baseline,
                                              train_stages)
from rlt_scale.experiments.early_stopping import EarlyStopper
from rlt_scale.experiments.evaluate import ANSWER_TOKENS, evaluate_path, module_predictor, rlt_predictor
from rlt_scale.experiments.report import markdown_table, plot_accuracy, selection_table
from rlt_scale.experiments.restarts import Restarts, train_with_restarts
from rlt_scale.experiments.supervision import SUPERVISIONS, target_fn
from rlt_scale.profiling.machine import environment

DEFAULT_PROTOCOL = "configs/experiments/state_tracking.yaml"
DEFAULT_OUT = "runs/experiments/state_tracking"


# ------------------------------------------------------------------ protocol
PRESETS = ("quick", "budget")


def load_protocol(path: str = DEFAULT_PROTOCOL, quick: bool = False, overrides: Optional[list[str]] = None,
                  budget: bool = False) -> dict:
    """The protocol YAML, one preset part merged in (``quick``: a smoke run; ``budget``: the 2-hour table),
    then dotted ``key=value`` ``overrides``."""
    if quick and budget:
        raise ValueError("the quick and budget presets exclude each other")
    proto = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    parts = {name: proto.pop(name, {}) or {} for name in PRESETS}
    preset = parts["quick"] if quick else parts["budget"] if budget else {}
    for key, value in preset.items():
        if key == "tasks":
            for task, fields in value.items():
                proto["tasks"].setdefault(task, {}).update(fields)
        else:
            proto[key] = value
    if overrides:
        merged = OmegaConf.merge(OmegaConf.create(proto), OmegaConf.from_dotlist(list(overrides)))
        proto = OmegaConf.to_container(merged, resolve=True)
    return proto


# ---------------------------------------------------------------------- data
def _ready(path: Path) -> bool:
    return (path / "index.json").exists()


def train_dir(proto: dict, task: str, length: Optional[int] = None) -> Path:
    """Training set of ``task`` at ``length`` (default the training length; others are curriculum stages)."""
    spec = proto["tasks"][task]
    length = length or spec["train_length"]
    mix = "-mix" if packed_row_tokens(spec, length) else ""
    return Path(proto["data_root"]) / task / f"train-L{length}-n{spec['train_samples']}-s{proto['train_seed']}{mix}"


def packed_row_tokens(spec: dict, length: int) -> int:
    """With the task's ``mixed_lengths``, a training set of ``length`` >= 6 holds rows of ``2 * (length + 3)``
    tokens of packed programs of lengths 1..length (:func:`rlt_scale.data.tasks.packed`); else 0."""
    return 2 * (length + 3) if spec.get("mixed_lengths") and length >= MIN_PACKED_LENGTH else 0


def eval_samples(proto: dict, length: int, task: Optional[str] = None) -> int:
    """Test programs at ``length``: ``eval_samples``, or fewer for the long lengths of ``eval_samples_at``.

    Evaluating the RLT costs O(T^2) per program (every position reads the
    memory), so a 2048-operation test set is cut to keep the table's budget.
    A task's own ``eval_samples_at`` (long-token tasks: mod 5) comes first.
    """
    own = (proto["tasks"].get(task, {}).get("eval_samples_at") or {}) if task else {}
    return int(own.get(length, (proto.get("eval_samples_at") or {}).get(length, proto["eval_samples"])))


def test_dir(proto: dict, task: str, length: int) -> Path:
    """The test programs of ``length`` are in ``test_dir/eval`` (addition buckets: ``test_dir/eval-carry-CC``);
    a later ``test_round``'s sets in a folder of their own (``-rN``)."""
    round_ = test_round(proto)
    return Path(proto["data_root"]) / task / (f"test-L{length}-n{eval_samples(proto, length, task)}"
                                              + (f"-r{round_}" if round_ else ""))


def test_round(proto: dict) -> int:
    """The protocol's ``test_round`` (default 0): which generation of test sets a row is scored on.

    A test set is scored once per row; a new recipe chosen after its rows' test
    figures were read is scored on a later round, programs no earlier choice has seen.
    """
    round_ = proto.get("test_round", 0)
    if isinstance(round_, bool) or not isinstance(round_, int) or not 0 <= round_ < MAX_TEST_ROUNDS:
        raise ValueError(f"test_round: expected an integer in [0, {MAX_TEST_ROUNDS}), got {round_!r}")
    return round_


def val_samples(proto: dict, length: int) -> int:
    """Validation programs at ``length``: ``val_long_samples``, or fewer for the lengths of ``val_samples_at``."""
    return int((proto.get("val_samples_at") or {}).get(length, proto["val_long_samples"]))


def val_dir(proto: dict, task: str, length: int) -> Path:
    """The validation programs of ``length`` (for selection) are in ``val_dir/eval``."""
    return Path(proto["data_root"]) / task / f"val-L{length}-n{val_samples(proto, length)}"


MAX_TEST_ROUNDS, TEST_ROUND_STRIDE = 100, 10_000


def test_seed(length: int, round_: int = 0) -> int:
    """Test sets use generator seeds of their own, never used for training or validation: round ``r`` of
    length ``L`` is ``1_000_003 + 10_000 r + L``, below every validation seed for r < 100 and L < 10,000."""
    if not 0 <= length < TEST_ROUND_STRIDE or not 0 <= round_ < MAX_TEST_ROUNDS:
        raise ValueError(f"test sets: length {length} and round {round_} must be in [0, {TEST_ROUND_STRIDE}) "
                         f"and [0, {MAX_TEST_ROUNDS})")
    return 1_000_003 + TEST_ROUND_STRIDE * round_ + length


def val_seed(length: int) -> int:
    """Validation sets (every selection and probe) use seeds apart from the test and training seeds."""
    return 2_000_003 + length


def _prepare(task: str, out: Path, length: int, seed: int, samples: int, buckets=None, log=print) -> None:
    names = ["eval"] + [f"eval-carry-{c:02d}" for c in (buckets or [])]
    if all(_ready(out / n) for n in names):
        return
    start = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    prepare_task(task, out, 1, length, seed, eval_samples=samples, eval_length=length, carry_buckets=buckets)
    log(f"prepared {out} ({samples} programs, seed {seed}) in {time.perf_counter() - start:.1f}s")


@contextlib.contextmanager
def file_lock(path: Path):
    """Hold an exclusive flock on ``path`` (created with its folder): one process at a time, across processes
    (and across open files within one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def data_lock(proto: dict, task: str):
    """``DATA_ROOT/TASK/.prepare.lock``: processes that share a data root prepare its sets one at a time
    (two writing one set clobber each other's shards), and a waiting one finds the sets ready."""
    return file_lock(Path(proto["data_root"]) / task / ".prepare.lock")


def prepare_data(proto: dict, task: str, log=print) -> None:
    """Prepare (once) the training sets (curriculum stages included), the validation sets and the test sets."""
    with data_lock(proto, task):
        _prepare_data(proto, task, log)


def _prepare_data(proto: dict, task: str, log) -> None:
    spec = proto["tasks"][task]
    for length in [*spec.get("curriculum", []), spec["train_length"]]:
        out = train_dir(proto, task, length)
        if _ready(out) and _ready(out / "eval"):
            continue
        start = time.perf_counter()
        shutil.rmtree(out, ignore_errors=True)
        prepare_task(task, out, spec["train_samples"], length, proto["train_seed"],
                     eval_samples=proto["val_samples"], carry_buckets=[],
                     packed_row_tokens=packed_row_tokens(spec, length))
        log(f"prepared {out} ({spec['train_samples']} + {proto['val_samples']} val) in {time.perf_counter() - start:.1f}s")
    for length in spec.get("val_lengths", []):
        _prepare(task, val_dir(proto, task, length), length, val_seed(length), val_samples(proto, length), log=log)
    buckets = spec.get("carry_buckets", []) if task == "addition" else []
    for length in spec["eval_lengths"]:
        _prepare(task, test_dir(proto, task, length), length, test_seed(length, test_round(proto)),
                 eval_samples(proto, length, task), [c for c in buckets if c <= length] or None, log=log)


# ------------------------------------------------------------------- FLOPs
def rlt_forward_flops(model_cfg, seq_len: int) -> Optional[int]:
    """Useful forward matmul FLOPs of one sample, from the profiling tool's cost model (None if unavailable)."""
    try:
        from rlt_scale.profiling.flops import analytic_flops
        from rlt_scale.profiling.workload import Workload

        return int(analytic_flops(model_cfg, Workload(batch=1, seq_len=seq_len)).total().model)
    except Exception:  # the profiling package is optional here
        return None


def seq_len_of(task: str, length: int) -> int:
    """Input positions of one program of ``length`` operations (the format of rlt_scale.data.tasks)."""
    if task == "addition":
        return 2 * length + 2
    if task == "mod5":
        return 2 * length + 3
    if task == "mod5_brackets":
        return 2 * length + 3 + 2 * (length // 4)
    return length + 2


# --------------------------------------------------------------------- runs
def lr_tag(lr: float) -> str:
    """``3e-4`` -> ``lr3e-4``: the learning rate's part of a sweep run's key."""
    mantissa, exponent = f"{lr:.0e}".split("e")
    return f"lr{mantissa}e{int(exponent)}"


def run_key(task: str, model: str, seed: int, tag: str = "", supervision: str = "final",
            lr: Optional[float] = None) -> str:
    """``task-model[-tag][-running][-lrX]-sSEED``: final-answer supervision, the data's own, adds nothing."""
    parts = [task, model] + ([tag] if tag else []) + (["running"] if supervision != "final" else [])
    return "-".join(parts + ([lr_tag(lr)] if lr is not None else []) + [f"s{seed}"])


def lr_overrides(proto: dict, lr: Optional[float]) -> tuple[list[str], list[str]]:
    """Overrides of the first stage and of the later curriculum stages for peak learning rate ``lr``.

    The cosine floor is a tenth of the peak; later stages restart at
    ``curriculum_lr_scale`` of it (a restart at the full peak throws a model
    that has just learned a shorter length off again, docs/RESULTS.md).
    """
    if lr is None:
        return [], []
    later = lr * proto.get("curriculum_lr_scale", 1.0)
    return ([f"optimizer.lr={lr}", f"optimizer.min_lr={lr / 10}"],
            [f"optimizer.lr={later}", f"optimizer.min_lr={later / 10}"])


def _predictor(net, rlt: bool):
    return rlt_predictor(net) if rlt else module_predictor(net)


def eval_batch(proto: dict, seq_len: int) -> int:
    """Evaluation micro-batch: ``eval_batch_size``, fewer for long programs (``eval_batch_tokens`` per batch)."""
    return max(1, min(proto["eval_batch_size"], proto.get("eval_batch_tokens", 1 << 30) // seq_len))


def _accuracy(proto: dict, task: str, predict, folder: Path, length: int) -> float:
    return evaluate_path(predict, str(folder), ANSWER_TOKENS[task], eval_batch(proto, seq_len_of(task, length))).accuracy


def curriculum_steps(spec: dict, task: str, default: int) -> list[int]:
    """Each curriculum stage's step budget: ``curriculum_steps`` is one number for every stage or a list, one per stage.

    Why a list: the first, shortest stage is where a seed may sit at chance for thousands of steps before it
    learns (S5's composition table at 4 operations, docs/RESULTS.md section 2), while the later stages,
    given a model that has learned it, advance within hundreds.
    """
    curriculum = spec.get("curriculum", [])
    steps = spec.get("curriculum_steps", default)
    if isinstance(steps, int):
        return [steps] * len(curriculum)
    if not isinstance(steps, (list, tuple)) or len(steps) != len(curriculum) \
            or not all(isinstance(n, int) and n > 0 for n in steps):
        raise ValueError(f"tasks.{task}.curriculum_steps: expected a positive integer or a list of one per "
                         f"curriculum stage ({len(curriculum)}: {list(curriculum)}), got {steps!r}")
    return list(steps)


def build_stages(proto: dict, task: str, seed: int, max_steps: int, lr: Optional[float] = None,
                 extra: Optional[list[str]] = None) -> tuple[list[str], list[Stage]]:
    """A run's overrides shared by every stage, and its stages: the task's curriculum, then its training length.

    Every stage after the first takes the later-stage learning rate, the task's ``curriculum_overrides`` and
    ``extra`` (``extra`` comes last everywhere and wins). The last stage stops on the protocol's
    early stopping, the others on ``curriculum_advance``.
    """
    spec = proto["tasks"][task]
    first_lr, later_lr = lr_overrides(proto, lr)
    common = [f"trainer.seed={seed}", f"data.seed={seed}"] + first_lr + list(extra or [])
    es = proto["early_stopping"]
    stopper = EarlyStopper(target=es["target"], patience=es["patience"], min_delta=es.get("min_delta", 0.0))
    later = (*later_lr, *spec.get("curriculum_overrides", []), *(extra or []))
    curriculum = spec.get("curriculum", [])
    stages = [Stage(length, train_dir(proto, task, length), steps,
                    EarlyStopper(target=spec.get("curriculum_advance", es["target"]), patience=0), later if i else ())
              for i, (length, steps) in enumerate(zip(curriculum, curriculum_steps(spec, task, max_steps)))]
    stages.append(Stage(spec["train_length"], train_dir(proto, task), max_steps, stopper, later if stages else ()))
    return common, stages


def train_one(proto: dict, task: str, model: str, seed: int, out: Path, steps: Optional[int] = None,
              extra: Optional[list[str]] = None, tag: str = "", log=print, supervision: Optional[str] = None,
              lr: Optional[float] = None, validate: bool = True) -> tuple[dict, torch.nn.Module, bool]:
    """Train one (task, model, seed[, lr]), keep its best weights (``best.pt``) and score the validation sets.

    Returns the record (no test figures), the network with its best weights
    restored, and whether it is an RLT. ``lr`` overrides the config's peak
    learning rate (a sweep point); ``extra`` overrides come last and win.
    """
    spec = proto["tasks"][task]
    supervision = supervision or proto.get("supervision", "final")
    targets = target_fn(task, supervision)
    key = run_key(task, model, seed, tag, supervision, lr)
    run_dir = out / "runs" / key
    shutil.rmtree(run_dir, ignore_errors=True)
    max_steps = steps or spec["max_steps"]
    common, stages = build_stages(proto, task, seed, max_steps, lr, extra)
    stopper, later = stages[-1].stopper, stages[-1].overrides
    config_path = proto["models"][model]
    log(f"== {key}: {config_path} {' '.join(common)} (supervision: {supervision}; stages: "
        f"{', '.join(f'L={st.length} up to {st.max_steps} steps' for st in stages)})")
    seq_len = seq_len_of(task, spec["train_length"])
    start = time.perf_counter()
    rlt = not is_baseline(config_path)
    trained = train_stages(config_path, stages, run_dir, common, ANSWER_TOKENS[task], proto, targets, log,
                           **curriculum_options(spec))
    net = trained.model
    if rlt:
        counts = net.parameter_counts()
        params, applied = counts["unique"], counts["applied"]
        flops = rlt_forward_flops(trained.cfg.model, seq_len)
    else:
        params = applied = sum(p.numel() for p in net.parameters())
        flops = int(net.forward_flops(seq_len))
    train_time = time.perf_counter() - start
    stopper.restore(net)
    torch.save(net.state_dict(), run_dir / "best.pt")
    val_acc = {str(spec["train_length"]): stopper.best_acc}
    if validate:
        predict = _predictor(net, rlt)
        for length in spec.get("val_lengths", []):
            val_acc[str(length)] = _accuracy(proto, task, predict, val_dir(proto, task, length) / "eval", length)
    record = {
        "key": key, "task": task, "model": model, "tag": tag, "seed": seed, "lr": lr,
        "config": config_path, "overrides": common, "later_stage_overrides": list(later) if stages[:-1] else [],
        "train_data": str(train_dir(proto, task)), "supervision": supervision,
        "curriculum": spec.get("curriculum", []), "stage_steps": trained.stage_steps, "stage_lrs": trained.stage_lrs,
        "parameters": params, "applied_parameters": applied,
        "train_length": spec["train_length"], "seq_len": seq_len, "forward_flops_per_example": flops,
        "max_steps": max_steps, "steps": trained.steps, "stopped_early": stopper.stopped_early,
        "best_step": stopper.best_step, "best_val_acc": stopper.best_acc, "val_history": stopper.history,
        "val_acc": val_acc, "selection_score": statistics.mean(val_acc.values()),
        "train_time_s": round(train_time, 1), "run_dir": str(run_dir),
        "machine": environment(),  # a run reproduces on the same CPU and numpy only (docs/RESULTS.md)
    }
    log(f"== {key}: {trained.steps} steps ({'early stop' if stopper.stopped_early else 'budget'}), best val "
        f"{stopper.best_acc:.4f} at {stopper.best_step}, train {train_time:.0f}s; validation "
        + " ".join(f"L={L}:{a:.4f}" for L, a in val_acc.items()))
    return record, net, rlt


def train_seed(proto: dict, task: str, model: str, seed: int, out: Path, log=print, validate: bool = True,
               **kw) -> tuple[dict, torch.nn.Module, bool]:
    """:func:`train_one` for table seed ``seed``, restarted while its validation score is below the protocol's
    ``restart_below`` (at most ``restarts`` trainings; :mod:`~rlt_scale.experiments.restarts`).

    With restarts every training is scored on the validation sets (they choose), whatever ``validate`` says;
    the record's key is the table seed's.
    """
    restarts = Restarts.from_protocol(proto)
    validate = validate or restarts.count > 1
    record, net, rlt = train_with_restarts(
        lambda run_seed: train_one(proto, task, model, run_seed, out, log=log, validate=validate, **kw),
        seed, restarts, log)
    record["key"] = run_key(task, model, seed, kw.get("tag", ""), record["supervision"], kw.get("lr"))
    return record, net, rlt


def test_one(proto: dict, task: str, net: torch.nn.Module, rlt: bool, log=print) -> dict:
    """Score the test sets (final-state accuracy at every ``eval_lengths``; addition: per carry chain)."""
    spec = proto["tasks"][task]
    predict = _predictor(net, rlt)
    start = time.perf_counter()
    acc: dict[str, float] = {}
    carry: dict[str, dict[str, float]] = {}
    for length in spec["eval_lengths"]:
        folder = test_dir(proto, task, length)
        acc[str(length)] = _accuracy(proto, task, predict, folder / "eval", length)
        line = f"  test L={length}: {acc[str(length)]:.4f}"
        if task == "addition":
            carry[str(length)] = {str(c): _accuracy(proto, task, predict, folder / f"eval-carry-{c:02d}", length)
                                  for c in spec.get("carry_buckets", []) if (folder / f"eval-carry-{c:02d}").exists()}
            line += "  carry " + " ".join(f"{c}:{a:.3f}" for c, a in carry[str(length)].items())
        log(line)
    result = {"acc": acc, "test_round": test_round(proto), "eval_time_s": round(time.perf_counter() - start, 1)}
    if carry:
        result["carry_acc"] = carry
    return result


def run_one(proto: dict, task: str, model: str, seed: int, out: Path, steps: Optional[int] = None,
            extra: Optional[list[str]] = None, tag: str = "", log=print, supervision: Optional[str] = None,
            lr: Optional[float] = None) -> dict:
    """Train one run and score it on the test sets at once: a table row's run whose recipe is already fixed."""
    record, net, rlt = train_one(proto, task, model, seed, out, steps, extra, tag, log, supervision, lr,
                                 validate=False)
    record.update(test_one(proto, task, net, rlt, log), phase="test", key=run_key(task, model, seed, tag,
                                                                                  record["supervision"]))
    return record


def load_best(proto: dict, record: dict, task: str) -> torch.nn.Module:
    """The network of a finished run with its best weights (``best.pt``), built as the run built it."""
    stopper = EarlyStopper()
    overrides = [f"data.path={train_dir(proto, task)}", f"data.eval_path={train_dir(proto, task) / 'eval'}",
                 f"checkpoint.dir={record['run_dir']}/reload", "trainer.max_steps=1", *record["overrides"]]
    trainer, _ = build_trainer(record["config"], overrides, stopper, ANSWER_TOKENS[task], proto,
                               Path(record["run_dir"]), None)
    trainer.model.load_state_dict(torch.load(Path(record["run_dir"]) / "best.pt", weights_only=True))
    return trainer.model


def row_lrs(proto: dict, task: str, model: str, lrs: list[Optional[float]], explicit: bool) -> list[Optional[float]]:
    """The learning rates a row sweeps: ``lrs``, or the one its protocol fixes in ``row_lr[task][model]``
    (a choice made on validation by an earlier sweep, e.g. the 2-hour table's) unless ``--lrs`` was given."""
    fixed = (proto.get("row_lr") or {}).get(task, {}).get(model)
    return [float(fixed)] if fixed is not None and not explicit else lrs


def row_variant(proto: dict, task: str, model: str) -> tuple[list[str], str]:
    """A row's fixed variant: its model overrides and its tag, or ``([], "")``.

    ``row_variant[task][model]`` names ``SWEEP.VARIANT`` of ``variant_sweeps``:
    a choice made on validation by that sweep (e.g. the 2-hour table's mod-5
    encoder window). The row takes the variant's model overrides (``set``, or
    ``baseline_set`` for a baseline) and its name as tag, not its protocol
    overrides: the protocol that runs the row (its steps, test round) holds.
    """
    name = (proto.get("row_variant") or {}).get(task, {}).get(model)
    if name is None:
        return [], ""
    sweep, variant = name.split(".", 1)
    return _variant_config_set(proto["variant_sweeps"][sweep], variant, is_baseline(proto["models"][model])), variant


def check_rows(proto: dict) -> None:
    """``row_lr`` and ``row_variant`` name only the protocol's tasks and models; each lr is positive, each
    variant one of ``variant_sweeps`` for the same task."""
    for field in ("row_lr", "row_variant"):
        for task, per_model in (proto.get(field) or {}).items():
            if task not in proto["tasks"]:
                raise ValueError(f"{field}.{task}: unknown task; the protocol has {list(proto['tasks'])}")
            for model, value in per_model.items():
                if model not in proto["models"]:
                    raise ValueError(f"{field}.{task}.{model}: unknown model; the protocol has {list(proto['models'])}")
                if field == "row_lr" and (isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0):
                    raise ValueError(f"row_lr.{task}.{model}: expected a positive learning rate, got {value!r}")
                if field == "row_variant":
                    sweep, _, variant = str(value).partition(".")
                    spec = (proto.get("variant_sweeps") or {}).get(sweep)
                    if spec is None or variant not in spec["variants"] or spec["task"] != task:
                        raise ValueError(f"row_variant.{task}.{model}: expected SWEEP.VARIANT of a {task} sweep in "
                                         f"variant_sweeps, got {value!r}")


def choose_lr(selection: list[dict]) -> float:
    """The learning rate of the highest mean selection score over the selection seeds (ties: the first swept)."""
    by_lr: dict[float, list[float]] = {}
    for r in selection:
        by_lr.setdefault(r["lr"], []).append(r["selection_score"])
    return max(by_lr, key=lambda lr: statistics.mean(by_lr[lr]))


# ------------------------------------------------------------------ results
def load_results(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


def save_results(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=1))
    tmp.replace(path)


# ---------------------------------------------------------------------- CLI
def _csv(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlt_scale.experiments.state_tracking",
                                description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", help="comma-separated tasks of the protocol (default: its run_tasks)")
    p.add_argument("--models", help="comma-separated names of the protocol's models (default: its run_models; "
                                   "'none': only the variant sweeps)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated run seeds (initialization and data order)")
    p.add_argument("--lrs", help="comma-separated peak learning rates to sweep (default: the protocol's lr_sweep); "
                                 "one value: no selection")
    p.add_argument("--steps", type=int, help="max optimizer steps per run (default: the protocol's per task)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"results directory (default {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: short lengths, small data, few steps (default out {DEFAULT_OUT}-quick)")
    p.add_argument("--budget", action="store_true",
                   help="the 2-hour table: the protocol's budget part (rows cut, learning rates fixed; see the "
                        f"YAML) (default out {DEFAULT_OUT}-budget)")
    p.add_argument("--protocol", default=DEFAULT_PROTOCOL)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every run (e.g. model.window=16); use with --tag")
    p.add_argument("--tag", default="", help="name of a variant; part of the run key and the table row")
    p.add_argument("--protocol-set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a protocol key, e.g. tasks.five_state.curriculum=[] (use with --tag)")
    p.add_argument("--select-only", action="store_true",
                   help="a probe: run the sweep and score the validation sets, never the test sets")
    p.add_argument("--supervision", choices=SUPERVISIONS,
                   help="training targets: the final answer only, or the running state after every operation too "
                        "(default: the protocol's); evaluation is final-state accuracy either way")
    p.add_argument("--sweeps", help="comma-separated variant_sweeps of the protocol to run (default: its run_sweeps "
                                    "whose task is run); 'none' runs none")
    p.add_argument("--sweep-models", help="comma-separated: run the variant sweeps for these of their models only")
    p.add_argument("--force", action="store_true", help="rerun runs already in results.json")
    p.add_argument("--table-only", action="store_true", help="only rewrite results.md and the plots from results.json")
    p.add_argument("--plots", help="directory for the accuracy-vs-length PNGs (default OUT/plots)")
    return p


class Table:
    """``results.json`` and ``results.md`` of one output directory, rewritten after every run."""

    def __init__(self, out: Path):
        self.out, self.path = out, out / "results.json"
        self.records = load_results(self.path)

    def find(self, key: str) -> Optional[dict]:
        return next((r for r in self.records if r["key"] == key), None)

    def add(self, record: dict) -> None:
        """Append ``record``; a lock makes runs of several processes into one directory safe."""
        with file_lock(self.out / ".results.lock"):
            self.records = [r for r in load_results(self.path) if r["key"] != record["key"]] + [record]
            save_results(self.path, self.records)
            self.write_markdown()

    def write_markdown(self) -> str:
        text = markdown_table(self.records)
        sel = selection_table(self.records)
        if sel:
            text += "\nLearning-rate selection (validation sets only):\n\n" + sel
        (self.out / "results.md").write_text(text)
        return text


def run_row(proto: dict, table: Table, task: str, model: str, seeds: list[int], lrs: list[Optional[float]],
            args, log) -> None:
    """Selection over ``lrs`` on the selection seeds (validation only), then every seed at the chosen one, tested."""
    supervision = args.supervision or proto.get("supervision", "final")
    variant_set, variant = row_variant(proto, task, model)
    tag = "-".join(t for t in (args.tag, variant) if t)
    run = dict(steps=args.steps, extra=[*args.set, *variant_set], tag=tag, log=log, supervision=supervision)
    chosen = lrs[0]
    nets: dict[tuple, tuple] = {}
    if len(lrs) > 1 or args.select_only:
        selection = []
        for lr in lrs:
            for seed in proto.get("selection_seeds", [0]):
                key = run_key(task, model, seed, tag, supervision, lr)
                record = table.find(key)
                if record is None or args.force or not (Path(record["run_dir"]) / "best.pt").exists():
                    record, net, rlt = train_seed(proto, task, model, seed, table.out, lr=lr, **run)
                    record.update(phase="select", quick=args.quick)
                    table.add(record)
                    nets[(lr, seed)] = (net, rlt)
                selection.append(record)
        chosen = choose_lr(selection)
        log(f"== {task}/{model}: lr {chosen:g} chosen on validation "
            + " ".join(f"{r['lr']:g}/s{r['seed']}:{r['selection_score']:.4f}" for r in selection))
    if args.select_only:
        return
    for seed in seeds:
        key = run_key(task, model, seed, tag, supervision)
        if table.find(key) is not None and not args.force:
            log(f"skip {key}: already in {table.path}")
            continue
        reused = table.find(run_key(task, model, seed, tag, supervision, chosen)) if len(lrs) > 1 else None
        if reused is not None:
            net, rlt = nets.get((chosen, seed)) or (load_best(proto, reused, task), not is_baseline(reused["config"]))
            record = dict(reused)
        else:
            record, net, rlt = train_seed(proto, task, model, seed, table.out, lr=chosen, validate=False, **run)
        record.update(test_one(proto, task, net, rlt, log), key=key, phase="test", quick=args.quick,
                      lr=chosen, swept_lrs=[lr for lr in lrs if lr is not None])
        table.add(record)


VARIANT_KEYS = {"set", "baseline_set", "protocol", "lr"}


def _variant_config_set(sweep: dict, variant: str, baseline: bool) -> list[str]:
    """A variant's config overrides: a plain list, or its ``set`` (``baseline_set`` for a baseline model)."""
    spec = sweep["variants"][variant]
    return list((spec.get("baseline_set" if baseline else "set") if isinstance(spec, dict) else spec) or [])


def _sweep_variant(proto: dict, sweep: dict, variant: str, baseline: bool = False) -> tuple[list[str], list[str], dict]:
    """One variant of ``sweep``: its config overrides, its protocol overrides and the protocol they give.

    A variant is a list of config overrides, or ``{set: [...], baseline_set: [...], protocol: [...]}``:
    a baseline model (``baseline``) takes ``baseline_set`` instead of ``set`` (the same change spelled
    for its ``baseline:`` section). Its protocol overrides are the sweep's ``protocol`` then the
    variant's own (the variant's win); the protocol also takes the sweep's ``val_lengths``.
    """
    spec = sweep["variants"][variant]
    unknown = set(spec) - VARIANT_KEYS if isinstance(spec, dict) else set()
    if unknown:
        raise ValueError(f"variant_sweeps.{variant}: unknown key(s) {sorted(unknown)}; a variant may have {sorted(VARIANT_KEYS)}")
    config_set = _variant_config_set(sweep, variant, baseline)
    overrides = [*(sweep.get("protocol") or []), *((spec.get("protocol") or []) if isinstance(spec, dict) else [])]
    sproto = copy.deepcopy(proto)
    if "val_lengths" in sweep:
        sproto["tasks"][sweep["task"]]["val_lengths"] = list(sweep["val_lengths"])
    if overrides:
        merged = OmegaConf.merge(OmegaConf.create(sproto), OmegaConf.from_dotlist(overrides))
        sproto = OmegaConf.to_container(merged, resolve=True)
    return config_set, overrides, sproto


def _variant_lr(sweep: dict, variant: str) -> Optional[float]:
    """A variant's own peak learning rate (``{lr: ...}``: a learning-rate sweep spelled as variants), else the sweep's."""
    spec = sweep["variants"][variant]
    return float(spec["lr"]) if isinstance(spec, dict) and spec.get("lr") is not None else sweep.get("lr")


def run_variant_sweep(proto: dict, table: Table, name: str, seeds: list[int], args, log) -> dict[str, str]:
    """Choose one of the variants of ``variant_sweeps[name]`` on validation, then test the chosen one.

    A sweep names ``task``, ``model`` (or ``models``: each gets the same
    variants and chooses its own), ``lr`` (one peak learning rate for every
    variant, unless the variant names its own), optionally ``supervision``,
    ``val_lengths`` and ``protocol`` (protocol overrides shared by every
    variant), and ``variants``: name -> config overrides, or ``{set: [...],
    baseline_set: [...], protocol: [...], lr: ...}``.
    Like the learning-rate sweep, on the variants instead: each variant is
    trained on the ``selection_seeds`` at the sweep's learning rate and scored
    on the validation sets only (``val_lengths`` of the sweep, e.g. a long
    validation length the table's own sweep does not read); the variant of the
    highest mean selection score becomes a table row, tagged with its name,
    whose seeds are trained (the selection runs reused) and tested once.
    Returns the chosen variant's name per model.
    """
    sweep = proto["variant_sweeps"][name]
    models = sweep.get("models") or [sweep["model"]]
    if getattr(args, "sweep_models", None):
        models = [m for m in models if m in _csv(args.sweep_models)]
    return {model: _sweep_model(proto, table, name, sweep, model, seeds, args, log) for model in models}


def _sweep_model(proto: dict, table: Table, name: str, sweep: dict, model: str, seeds: list[int], args, log) -> str:
    task = sweep["task"]
    supervision = sweep.get("supervision") or args.supervision or proto.get("supervision", "final")
    run = dict(steps=args.steps, log=log, supervision=supervision)
    scores: dict[str, list[float]] = {}
    baseline = is_baseline(proto["models"][model])
    for variant in sweep["variants"]:
        config_set, protocol_set, sproto = _sweep_variant(proto, sweep, variant, baseline)
        lr = _variant_lr(sweep, variant)
        prepare_data(sproto, task, log)
        for seed in sproto.get("selection_seeds", [0]):
            key = run_key(task, model, seed, variant, supervision, lr)
            record = table.find(key)
            # A recorded score is enough to choose: a key names one run in every sweep. Weights are needed only
            # to test, and the test below retrains a run whose best.pt is gone. That retrain equals the recorded
            # run on the same code, numpy and CPU; across machines rounding may differ and a chaotic run with it
            # (docs/RESULTS.md, section 3): start a fresh results directory to compare within one machine.
            if record is None or args.force:
                record, _, _ = train_seed(sproto, task, model, seed, table.out, extra=[*args.set, *config_set],
                                          tag=variant, lr=lr, **run)
                record.update(phase="select", quick=args.quick, variant_sweep=name,
                              protocol_overrides=protocol_set)
                table.add(record)
            scores.setdefault(variant, []).append(record["selection_score"])
    chosen = max(scores, key=lambda v: statistics.mean(scores[v]))
    log(f"== sweep {name}, {model}: variant {chosen} chosen on validation "
        + " ".join(f"{v}:{statistics.mean(sc):.4f}" for v, sc in scores.items()))
    if args.select_only:
        return chosen
    config_set, protocol_set, sproto = _sweep_variant(proto, sweep, chosen, baseline)
    lr = _variant_lr(sweep, chosen)
    for seed in seeds:
        key = run_key(task, model, seed, chosen, supervision)
        if table.find(key) is not None and not args.force:
            log(f"skip {key}: already in {table.path}")
            continue
        reused = table.find(run_key(task, model, seed, chosen, supervision, lr))
        if reused is not None and (Path(reused["run_dir"]) / "best.pt").exists():
            net, rlt = load_best(sproto, reused, task), not is_baseline(reused["config"])
            record = dict(reused)
        else:
            record, net, rlt = train_seed(sproto, task, model, seed, table.out, extra=[*args.set, *config_set],
                                          tag=chosen, validate=False, lr=lr, **run)
        record.update(test_one(sproto, task, net, rlt, log), key=key, phase="test", quick=args.quick,
                      variant_sweep=name, chosen_variant=chosen,
                      protocol_overrides=protocol_set,
                      variant_scores={v: statistics.mean(sc) for v, sc in scores.items()})
        table.add(record)
    return chosen


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    if args.quick and args.budget:
        print("--quick and --budget exclude each other", file=sys.stderr)
        return 2
    preset = "quick" if args.quick else "budget" if args.budget else ""
    out = Path(args.out + (f"-{preset}" if preset and args.out == DEFAULT_OUT else ""))
    out.mkdir(parents=True, exist_ok=True)
    table = Table(out)
    plots = Path(args.plots) if args.plots else out / "plots"
    if args.table_only:
        print(table.write_markdown())
        if table.records:
            print("plots:", *plot_accuracy(table.records, plots))
        return 0
    proto = load_protocol(args.protocol, args.quick, args.protocol_set, budget=args.budget)
    tasks = _csv(args.tasks) if args.tasks else proto.get("run_tasks", list(proto["tasks"]))
    seeds = [int(s) for s in _csv(args.seeds)]
    models = ([] if args.models == "none" else _csv(args.models)) if args.models else proto.get("run_models", list(proto["models"]))
    lrs: list[Optional[float]] = [float(x) for x in _csv(args.lrs)] if args.lrs else proto.get("lr_sweep") or [None]
    if args.select_only and lrs == [None]:
        print("--select-only needs learning rates to compare: the protocol's lr_sweep or --lrs", file=sys.stderr)
        return 2
    for name, chosen, known in (("task", tasks, proto["tasks"]), ("model", models, proto["models"])):
        for item in chosen:
            if item not in known:
                print(f"unknown {name} {item!r}; the protocol {args.protocol} has {list(known)}", file=sys.stderr)
                return 2
    known_sweeps = proto.get("variant_sweeps") or {}
    if args.sweeps:
        sweeps = [] if args.sweeps == "none" else _csv(args.sweeps)
    else:
        sweeps = [n for n in proto.get("run_sweeps", []) if known_sweeps[n]["task"] in tasks]
        if args.supervision:  # a sweep fixes its own supervision; run only those that match
            sweeps = [n for n in sweeps if known_sweeps[n].get("supervision", proto.get("supervision")) == args.supervision]
    for name in sweeps:
        if name not in known_sweeps:
            print(f"unknown sweep {name!r}; the protocol {args.protocol} has {list(known_sweeps)}", file=sys.stderr)
            return 2
    try:
        check_rows(proto)
    except ValueError as err:
        print(f"{args.protocol}: {err}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    started = time.perf_counter()
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    try:
        for task in tasks:
            prepare_data(proto, task, log)
            for model in models:
                run_row(proto, table, task, model, seeds, row_lrs(proto, task, model, lrs, bool(args.lrs)), args, log)
        for name in sweeps:
            run_variant_sweep(proto, table, name, seeds, args, log)
    except Preempted as err:
        print(f"preempted: {err}. That run is not recorded; the finished ones are in {table.path}, and the "
              "same command resumes from them.", file=sys.stderr, flush=True)
        return 128 + 15
    print(f"\ntotal wall time {time.perf_counter() - started:.0f}s; results in {table.path}\n", flush=True)
    print(table.write_markdown(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
