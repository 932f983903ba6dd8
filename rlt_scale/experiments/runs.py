"""One run of the state-tracking protocol: train a (task, model, seed[, lr]) through its curriculum, keep
its best weights, score validation or test sets, and record it in the results table.

The run key (:func:`run_key`) names a run in every sweep, so a finished run is
found and reused, never retrained; :class:`Table` is the ``results.json`` and
``results.md`` of one output directory that every finished run is appended to.
"""

from __future__ import annotations

import json
import shutil
import statistics
import time
from pathlib import Path
from typing import Optional

import torch

from rlt_scale.data.index import file_sha256
from rlt_scale.experiments.curriculum import Stage, build_trainer, curriculum_options, is_baseline, train_stages
from rlt_scale.experiments.early_stopping import EarlyStopper
from rlt_scale.experiments.evaluate import ANSWER_TOKENS, evaluate_path, module_predictor, rlt_predictor
from rlt_scale.experiments.report import markdown_table, selection_table
from rlt_scale.experiments.restarts import Restarts, train_with_restarts
from rlt_scale.experiments.supervision import target_fn
from rlt_scale.experiments.task_sets import file_lock, seq_len_of, test_dir, test_round, train_dir, val_dir
from rlt_scale.profiling.machine import environment
from rlt_scale.training.checkpoint_files import write_text_durably


# ------------------------------------------------------------------- FLOPs
def rlt_forward_flops(model_cfg, seq_len: int) -> Optional[int]:
    """Useful forward matmul FLOPs of one sample, from the profiling tool's cost model (None if unavailable)."""
    try:
        from rlt_scale.profiling.flops import analytic_flops
        from rlt_scale.profiling.workload import Workload

        return int(analytic_flops(model_cfg, Workload(batch=1, seq_len=seq_len)).total().model)
    except Exception:  # the profiling package is optional here
        return None


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


def predictor(net, rlt: bool):
    return rlt_predictor(net) if rlt else module_predictor(net)


def eval_batch(proto: dict, seq_len: int) -> int:
    """Evaluation micro-batch: ``eval_batch_size``, fewer for long programs (``eval_batch_tokens`` per batch)."""
    return max(1, min(proto["eval_batch_size"], proto.get("eval_batch_tokens", 1 << 30) // seq_len))


def accuracy(proto: dict, task: str, predict, folder: Path, length: int) -> float:
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


UNFINISHED_FILE = "unfinished.json"
"""In a run directory while its run is unfinished: the run's recipe, which a rerun must match to resume it."""


def open_run_dir(run_dir: Path, recipe: dict, log=print) -> bool:
    """Keep ``run_dir`` when it holds an unfinished run of exactly ``recipe`` (it resumes: True); otherwise
    empty it and mark a new unfinished run there. :func:`train_one` removes the mark when the run is done."""
    recipe = json.loads(json.dumps(recipe, default=str))  # as it reads back from the file
    mark = run_dir / UNFINISHED_FILE
    if mark.exists() and json.loads(mark.read_text()) == recipe:
        log(f"== resuming the unfinished run in {run_dir}")
        return True
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    write_text_durably(mark, json.dumps(recipe, indent=1))
    return False


def train_one(proto: dict, task: str, model: str, seed: int, out: Path, steps: Optional[int] = None,
              extra: Optional[list[str]] = None, tag: str = "", log=print, supervision: Optional[str] = None,
              lr: Optional[float] = None, validate: bool = True) -> tuple[dict, torch.nn.Module, bool]:
    """Train one (task, model, seed[, lr]), keep its best weights (``best.pt``) and score the validation sets.

    Returns the record (no test figures), the network with its best weights
    restored, and whether it is an RLT. ``lr`` overrides the config's peak
    learning rate (a sweep point); ``extra`` overrides come last and win.
    A run stopped by a signal (:class:`~rlt_scale.experiments.curriculum.Preempted`) or a crash leaves its
    directory; the same call later resumes it from its checkpoints and ends exactly as it would have.
    """
    spec = proto["tasks"][task]
    supervision = supervision or proto.get("supervision", "final")
    targets = target_fn(task, supervision)
    key = run_key(task, model, seed, tag, supervision, lr)
    run_dir = out / "runs" / key
    max_steps = steps or spec["max_steps"]
    common, stages = build_stages(proto, task, seed, max_steps, lr, extra)
    stopper, later = stages[-1].stopper, stages[-1].overrides
    config_path = proto["models"][model]
    recipe = {"key": key, "config": config_path, "config_sha256": file_sha256(config_path),  # an edited YAML: a new run
              "overrides": common, "supervision": supervision, "val_samples": proto["val_samples"],
              "early_stopping": proto["early_stopping"], "options": curriculum_options(spec),
              "stages": [[st.length, str(st.data), st.max_steps, list(st.overrides), st.stopper.target,
                         st.stopper.patience, st.stopper.min_delta] for st in stages]}
    resumed = open_run_dir(run_dir, recipe, log)
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
        predict = predictor(net, rlt)
        for length in spec.get("val_lengths", []):
            val_acc[str(length)] = accuracy(proto, task, predict, val_dir(proto, task, length) / "eval", length)
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
        "train_time_s": round(train_time, 1), "resumed": resumed, "run_dir": str(run_dir),
        "machine": environment(),  # a run reproduces on the same CPU and numpy only (docs/RESULTS.md)
    }
    log(f"== {key}: {trained.steps} steps ({'early stop' if stopper.stopped_early else 'budget'}), best val "
        f"{stopper.best_acc:.4f} at {stopper.best_step}, train {train_time:.0f}s; validation "
        + " ".join(f"L={L}:{a:.4f}" for L, a in val_acc.items()))
    (run_dir / UNFINISHED_FILE).unlink()  # done: a rerun (--force, lost weights) starts afresh
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
    predict = predictor(net, rlt)
    start = time.perf_counter()
    acc: dict[str, float] = {}
    carry: dict[str, dict[str, float]] = {}
    for length in spec["eval_lengths"]:
        folder = test_dir(proto, task, length)
        acc[str(length)] = accuracy(proto, task, predict, folder / "eval", length)
        line = f"  test L={length}: {acc[str(length)]:.4f}"
        if task == "addition":
            carry[str(length)] = {str(c): accuracy(proto, task, predict, folder / f"eval-carry-{c:02d}", length)
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


# ------------------------------------------------------------------ results
def load_results(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


def save_results(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=1))
    tmp.replace(path)


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
