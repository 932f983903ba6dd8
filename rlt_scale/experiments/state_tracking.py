"""The state-tracking table: RLT-1, RLT-0, a causal Transformer and a GRU on parity, five-state and addition.

Usage::

    python -m rlt_scale.experiments.state_tracking                      # everything in the protocol, 3 seeds
    python -m rlt_scale.experiments.state_tracking --tasks parity --models rlt1_a1,rlt0,transformer,gru --seeds 0
    python -m rlt_scale.experiments.state_tracking --tasks parity --supervision final   # answer-only loss
    python -m rlt_scale.experiments.state_tracking --quick              # smoke run of the pipeline, minutes
    python -m rlt_scale.experiments.state_tracking --tasks parity --models rlt1 --seeds 0 \\
        --set model.window=16 --tag w16                                 # a variant (RLT configs only)
    python -m rlt_scale.experiments.state_tracking --table-only         # rewrite results.md from results.json

What one run is:

1. data (prepared once, reused): the training set of the task at its training
   length with a validation split (``OUT/eval``), the same at each length of the
   task's ``curriculum`` if it has one, and per evaluated length a test
   set of ``eval_samples`` fresh programs from an independent seed (addition:
   plus one set per carry chain), all webdataset shards written by
   :func:`rlt_scale.data.prepare.prepare_task`;
2. training: every model through the ordinary ``rlt-train`` loop
   (:class:`~rlt_scale.training.trainer.Trainer` on the YAML in
   ``configs/experiments/`` plus the overrides printed in the log and stored in
   the results; a baseline is handed to it as the model); each stops early on
   validation accuracy and keeps the best weights.
   The loss covers the answer only, or the running state too (``supervision``,
   :mod:`~rlt_scale.experiments.supervision`); a curriculum trains shorter
   programs first (:mod:`~rlt_scale.experiments.curriculum`);
3. test: final-state accuracy (argmax over the answer tokens) at every length.

Runs are appended to ``OUT/results.json`` as they finish and the markdown table
``OUT/results.md`` is rewritten each time; a run already in the results is
skipped (``--force`` reruns it), so an interrupted table resumes.
"""

from __future__ import annotations

import argparse
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
from rlt_scale.experiments.early_stopping import EarlyStopper
from rlt_scale.experiments.evaluate import ANSWER_TOKENS, evaluate_path, module_predictor, rlt_predictor
from rlt_scale.experiments.curriculum import Stage, is_baseline, train_stages
from rlt_scale.experiments.supervision import SUPERVISIONS, target_fn

DEFAULT_PROTOCOL = "configs/experiments/state_tracking.yaml"
DEFAULT_OUT = "runs/experiments/state_tracking"
MODEL_LABELS = {"rlt1": "RLT-1", "rlt1_a1": "RLT-1, alpha=1", "rlt0": "RLT-0 (no feedback)",
                "transformer": "Transformer", "gru": "GRU"}
SUPERVISION_LABELS = {"final": "answer", "running": "every state"}
TASK_LABELS = {"parity": "parity", "five_state": "five-state", "addition": "addition"}

PUBLISHED: dict[str, dict[str, dict[int, str]]] = {
    "parity": {
        "rlt1": {16: "~100", 32: "~100", 64: "~82", 128: "60.8"},
        "rlt0": {16: "~98", 32: "~59", 64: "~49", 128: "~50"},
        "transformer": {16: "~98", 32: "~72", 64: "~50", 128: "~48"},
        "gru": {128: "100"},
    },
    "five_state": {
        "rlt1": {16: "~100", 32: "~100", 64: "~49", 128: "20.7"},
        "rlt0": {16: "~50", 32: "~23", 64: "~20", 128: "~20"},
        "transformer": {16: "~54", 32: "~24", 64: "~20", 128: "~21"},
        "gru": {128: "99.97"},
    },
}
"""The published proof of concept (~79K parameters, 3 seeds, trained at 32 operations), accuracy in %."""
PUBLISHED_AS = {"rlt1_a1": "rlt1"}
"""Our variants shown next to a published row: RLT-1 with alpha=1 is the RLT of the published table."""


# ------------------------------------------------------------------ protocol
def load_protocol(path: str = DEFAULT_PROTOCOL, quick: bool = False) -> dict:
    proto = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    quick_part = proto.pop("quick", {}) or {}
    if quick:
        for key, value in quick_part.items():
            if key == "tasks":
                for task, fields in value.items():
                    proto["tasks"].setdefault(task, {}).update(fields)
            else:
                proto[key] = value
    return proto


# ---------------------------------------------------------------------- data
def _ready(path: Path) -> bool:
    return (path / "index.json").exists()


def train_dir(proto: dict, task: str, length: Optional[int] = None) -> Path:
    """Training set of ``task`` at ``length`` (default the training length; others are curriculum stages)."""
    spec = proto["tasks"][task]
    length = length or spec["train_length"]
    return Path(proto["data_root"]) / task / f"train-L{length}-n{spec['train_samples']}-s{proto['train_seed']}"


def test_dir(proto: dict, task: str, length: int) -> Path:
    """The test programs of ``length`` are in ``test_dir/eval`` (addition buckets: ``test_dir/eval-carry-CC``)."""
    return Path(proto["data_root"]) / task / f"test-L{length}-n{proto['eval_samples']}"


def test_seed(length: int) -> int:
    """Test sets use generator seeds of their own (the training set uses ``train_seed``, 0 by default)."""
    return 1_000_003 + length


def prepare_data(proto: dict, task: str, log=print) -> None:
    """Prepare (once) the training/validation sets (curriculum stages included) and the test sets of ``task``."""
    spec = proto["tasks"][task]
    for length in [*spec.get("curriculum", []), spec["train_length"]]:
        out = train_dir(proto, task, length)
        if _ready(out) and _ready(out / "eval"):
            continue
        start = time.perf_counter()
        shutil.rmtree(out, ignore_errors=True)
        prepare_task(task, out, spec["train_samples"], length, proto["train_seed"],
                     eval_samples=proto["val_samples"], carry_buckets=[])
        log(f"prepared {out} ({spec['train_samples']} + {proto['val_samples']} val) in {time.perf_counter() - start:.1f}s")
    buckets = [c for c in spec.get("carry_buckets", [])] if task == "addition" else None
    for length in spec["eval_lengths"]:
        out = test_dir(proto, task, length)
        names = ["eval"] + [f"eval-carry-{c:02d}" for c in (buckets or []) if c <= length]
        if all(_ready(out / n) for n in names):
            continue
        start = time.perf_counter()
        shutil.rmtree(out, ignore_errors=True)
        prepare_task(task, out, 1, length, test_seed(length), eval_samples=proto["eval_samples"], eval_length=length,
                     carry_buckets=[c for c in (buckets or []) if c <= length] or None)
        log(f"prepared {out} ({proto['eval_samples']} test programs) in {time.perf_counter() - start:.1f}s")


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
def run_key(task: str, model: str, seed: int, tag: str = "", supervision: str = "final") -> str:
    """``task-model[-tag][-running]-sSEED``: final-answer supervision, the data's own, adds nothing."""
    return f"{task}-{model}{'-' + tag if tag else ''}{'-' + supervision if supervision != 'final' else ''}-s{seed}"


def run_one(proto: dict, task: str, model: str, seed: int, out: Path, steps: Optional[int] = None,
            extra: Optional[list[str]] = None, tag: str = "", log=print, supervision: Optional[str] = None) -> dict:
    """Train one (task, model, seed), restore its best validation weights and test it at every length.

    ``supervision`` ('final' or 'running', default the protocol's) picks the
    training targets (:mod:`rlt_scale.experiments.supervision`); every model
    of a table gets the same.
    """
    spec = proto["tasks"][task]
    supervision = supervision or proto.get("supervision", "final")
    targets = target_fn(task, supervision)
    key = run_key(task, model, seed, tag, supervision)
    run_dir = out / "runs" / key
    shutil.rmtree(run_dir, ignore_errors=True)
    max_steps = steps or spec["max_steps"]
    common = [f"trainer.seed={seed}", f"data.seed={seed}"] + list(extra or [])
    es = proto["early_stopping"]
    stopper = EarlyStopper(target=es["target"], patience=es["patience"], min_delta=es.get("min_delta", 0.0))
    later = tuple(spec.get("curriculum_overrides", []))  # for every stage after the first
    stages = [Stage(length, train_dir(proto, task, length), spec.get("curriculum_steps", max_steps),
                    EarlyStopper(target=spec.get("curriculum_advance", es["target"]), patience=0), later if i else ())
              for i, length in enumerate(spec.get("curriculum", []))]
    stages.append(Stage(spec["train_length"], train_dir(proto, task), max_steps, stopper, later if stages else ()))
    answers = ANSWER_TOKENS[task]
    config_path = proto["models"][model]
    log(f"== {key}: {config_path} {' '.join(common)} (supervision: {supervision}; stages: "
        f"{', '.join(f'L={st.length} up to {st.max_steps} steps' for st in stages)})")
    seq_len = spec["train_length"] * (2 if task == "addition" else 1) + 2
    start = time.perf_counter()
    rlt = not is_baseline(config_path)
    trained = train_stages(config_path, stages, run_dir, common, answers, proto, targets, log)
    net = trained.model
    if rlt:
        counts = net.parameter_counts()
        params, applied = counts["unique"], counts["applied"]
        flops = rlt_forward_flops(trained.cfg.model, seq_len)
    else:
        params = applied = sum(p.numel() for p in net.parameters())
        flops = int(net.forward_flops(seq_len))
    steps_run = trained.steps
    train_time = time.perf_counter() - start
    stopper.restore(net)
    predict = rlt_predictor(net) if rlt else module_predictor(net)

    start = time.perf_counter()
    acc: dict[str, float] = {}
    carry: dict[str, dict[str, float]] = {}
    for length in spec["eval_lengths"]:
        folder = test_dir(proto, task, length)
        acc[str(length)] = evaluate_path(predict, str(folder / "eval"), answers, proto["eval_batch_size"]).accuracy
        line = f"  test L={length}: {acc[str(length)]:.4f}"
        if task == "addition":
            carry[str(length)] = {}
            for c in spec.get("carry_buckets", []):
                if (folder / f"eval-carry-{c:02d}").exists():
                    carry[str(length)][str(c)] = evaluate_path(predict, str(folder / f"eval-carry-{c:02d}"), answers,
                                                               proto["eval_batch_size"]).accuracy
            line += "  carry " + " ".join(f"{c}:{a:.3f}" for c, a in carry[str(length)].items())
        log(line)
    eval_time = time.perf_counter() - start
    record = {
        "key": key, "task": task, "model": model, "tag": tag, "seed": seed,
        "config": config_path, "overrides": common, "train_data": str(train_dir(proto, task)),
        "supervision": supervision, "curriculum": spec.get("curriculum", []), "stage_steps": trained.stage_steps,
        "parameters": params, "applied_parameters": applied,
        "train_length": spec["train_length"], "seq_len": seq_len, "forward_flops_per_example": flops,
        "max_steps": max_steps, "steps": steps_run, "stopped_early": stopper.stopped_early,
        "best_step": stopper.best_step, "best_val_acc": stopper.best_acc, "val_history": stopper.history,
        "train_time_s": round(train_time, 1), "eval_time_s": round(eval_time, 1), "acc": acc,
    }
    if carry:
        record["carry_acc"] = carry
    log(f"== {record['key']}: {steps_run} steps ({'early stop' if stopper.stopped_early else 'budget'}), "
        f"best val {stopper.best_acc:.4f} at {stopper.best_step}, train {train_time:.0f}s, test {eval_time:.0f}s")
    return record


# ------------------------------------------------------------------ results
def load_results(path: Path) -> list[dict]:
    return json.loads(path.read_text()) if path.exists() else []


def save_results(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(records, indent=1))
    tmp.replace(path)


def _cell(values: list[float]) -> str:
    if not values:
        return ""
    pct = [100 * v for v in values]
    if len(pct) == 1:
        return f"{pct[0]:.1f}"
    return f"{statistics.mean(pct):.1f} [{min(pct):.1f}, {max(pct):.1f}]"


def _groups(records: list[dict]) -> dict[tuple[str, str, str, str], list[dict]]:
    groups: dict[tuple[str, str, str, str], list[dict]] = {}
    task_order = list(TASK_LABELS)
    model_order = list(MODEL_LABELS)
    for r in sorted(records, key=lambda r: (task_order.index(r["task"]) if r["task"] in task_order else 99,
                                            r.get("supervision", "final"), r.get("tag", ""),
                                            model_order.index(r["model"]) if r["model"] in model_order else 99,
                                            r["seed"])):
        groups.setdefault((r["task"], r["model"], r.get("tag", ""), r.get("supervision", "final")), []).append(r)
    return groups


def markdown_table(records: list[dict]) -> str:
    """Accuracy (%) at each test length: mean [min, max] over seeds, next to the published numbers."""
    lengths = sorted({int(L) for r in records for L in r["acc"]})
    head = ["task", "model", "loss on", "params", "seeds", "steps run", *[f"{L}" for L in lengths],
            "published " + "/".join(str(L) for L in (16, 32, 64, 128)), "fwd MFLOPs/example", "train s"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (task, model, tag, supervision), rs in _groups(records).items():
        label = MODEL_LABELS.get(model, model) + (f" `{tag}`" if tag else "")
        pub = PUBLISHED.get(task, {}).get(PUBLISHED_AS.get(model, model), {})
        comparable = not tag and rs[0]["train_length"] == 32 and not rs[0].get("quick")
        pub_cell = " / ".join(pub.get(L, "-") for L in (16, 32, 64, 128)) if pub and comparable else ""
        flops = rs[0].get("forward_flops_per_example")
        steps = sorted(r["steps"] for r in rs)
        row = [TASK_LABELS.get(task, task) + f" (train {rs[0]['train_length']})", label,
               SUPERVISION_LABELS[supervision],
               f"{rs[0]['parameters']:,}",
               ",".join(str(r["seed"]) for r in rs), "/".join(str(s) for s in steps),
               *[_cell([r["acc"][str(L)] for r in rs if str(L) in r["acc"]]) for L in lengths],
               pub_cell, f"{flops / 1e6:.2f}" if flops else "?", f"{sum(r['train_time_s'] for r in rs):.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    carry = [r for r in records if r.get("carry_acc")]
    if carry:
        lines += ["", "Addition: accuracy (%) by carry chain (mean [min, max] over seeds).", ""]
        cols = sorted({(int(L), int(c)) for r in carry for L, d in r["carry_acc"].items() for c in d})
        head = ["model", "loss on", *[f"L={L} chain {c}" for L, c in cols]]
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        for (task, model, tag, supervision), rs in _groups(carry).items():
            row = [MODEL_LABELS.get(model, model) + (f" `{tag}`" if tag else ""), SUPERVISION_LABELS[supervision],
                   *[_cell([r["carry_acc"][str(L)][str(c)] for r in rs if str(c) in r["carry_acc"].get(str(L), {})])
                     for L, c in cols]]
            lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


# ---------------------------------------------------------------------- CLI
def _csv(text: str) -> list[str]:
    return [t for t in text.split(",") if t]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m rlt_scale.experiments.state_tracking",
                                description=__doc__.split("\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default="parity,five_state,addition", help="comma-separated: parity,five_state,addition")
    p.add_argument("--models", help="comma-separated names of the protocol's models (default: its run_models)")
    p.add_argument("--seeds", default="0,1,2", help="comma-separated run seeds (initialization and data order)")
    p.add_argument("--steps", type=int, help="max optimizer steps per run (default: the protocol's per task)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"results directory (default {DEFAULT_OUT})")
    p.add_argument("--quick", action="store_true",
                   help=f"smoke run: short lengths, small data, few steps (default out {DEFAULT_OUT}-quick)")
    p.add_argument("--protocol", default=DEFAULT_PROTOCOL)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra config override for every run (e.g. model.window=16); use with --tag")
    p.add_argument("--tag", default="", help="name of a variant; part of the run key and the table row")
    p.add_argument("--supervision", choices=SUPERVISIONS,
                   help="training targets: the final answer only, or the running state after every operation too "
                        "(default: the protocol's); evaluation is final-state accuracy either way")
    p.add_argument("--force", action="store_true", help="rerun runs already in results.json")
    p.add_argument("--table-only", action="store_true", help="only rewrite results.md from results.json")
    return p


def main(argv: Optional[list[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out + ("-quick" if args.quick and args.out == DEFAULT_OUT else ""))
    results_path = out / "results.json"
    records = load_results(results_path)
    if args.table_only:
        (out / "results.md").write_text(markdown_table(records))
        print(markdown_table(records))
        return 0
    proto = load_protocol(args.protocol, args.quick)
    tasks, seeds = _csv(args.tasks), [int(s) for s in _csv(args.seeds)]
    models = _csv(args.models) if args.models else proto.get("run_models", list(proto["models"]))
    for task in tasks:
        if task not in proto["tasks"]:
            print(f"unknown task {task!r}; the protocol has {list(proto['tasks'])}", file=sys.stderr)
            return 2
    for model in models:
        if model not in proto["models"]:
            print(f"unknown model {model!r}; the protocol has {list(proto['models'])}", file=sys.stderr)
            return 2
    torch.set_num_threads(1)
    out.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    for task in tasks:
        prepare_data(proto, task)
        for seed in seeds:
            for model in models:
                key = run_key(task, model, seed, args.tag, args.supervision or proto.get("supervision", "final"))
                if any(r["key"] == key for r in records) and not args.force:
                    print(f"skip {key}: already in {results_path}", flush=True)
                    continue
                record = run_one(proto, task, model, seed, out, args.steps, args.set, args.tag,
                                 log=lambda *a: print(*a, flush=True), supervision=args.supervision)
                record["quick"] = args.quick
                records = [r for r in load_results(results_path) if r["key"] != key] + [record]
                save_results(results_path, records)
                (out / "results.md").write_text(markdown_table(records))
    print(f"\ntotal wall time {time.perf_counter() - started:.0f}s; results in {results_path}\n", flush=True)
    print(markdown_table(records), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
