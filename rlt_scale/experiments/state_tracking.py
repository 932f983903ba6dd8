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
   (seed :func:`~rlt_scale.experiments.task_sets.val_seed`), used for every choice; **test sets** at
   ``eval_lengths`` (seed :func:`~rlt_scale.experiments.task_sets.test_seed`), scored once per row; a recipe
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

**Variant sweeps** (``variant_sweeps`` of the protocol, :mod:`~rlt_scale.experiments.variant_sweeps`)
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
resumes; the run that was interrupted (SIGTERM, or a crash after a checkpoint)
continues from its checkpoints, exactly, when the same command meets it again.

Where the code is: the data sets and their seeds in
:mod:`~rlt_scale.experiments.task_sets`, one run and the results table in
:mod:`~rlt_scale.experiments.runs`, variant sweeps in
:mod:`~rlt_scale.experiments.variant_sweeps`, tables and plots in
:mod:`~rlt_scale.experiments.report`; this module holds the protocol's
rows (learning-rate selection, then the test) and the command line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch
from omegaconf import OmegaConf

from rlt_scale.experiments.curriculum import Preempted, is_baseline
from rlt_scale.experiments.report import plot_accuracy
from rlt_scale.experiments.runs import Table, load_best, run_key, test_one, train_seed
from rlt_scale.experiments.supervision import SUPERVISIONS
from rlt_scale.experiments.task_sets import prepare_data
from rlt_scale.experiments.variant_sweeps import run_variant_sweep, variant_config_set

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
    return variant_config_set(proto["variant_sweeps"][sweep], variant, is_baseline(proto["models"][model])), variant


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
        print(f"preempted: {err}. That run is not recorded yet; the finished ones are in {table.path}. The "
              "same command skips those and resumes that run from its checkpoint.", file=sys.stderr, flush=True)
        return 128 + 15
    print(f"\ntotal wall time {time.perf_counter() - started:.0f}s; results in {table.path}\n", flush=True)
    print(table.write_markdown(), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
