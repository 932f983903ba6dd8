"""Why does a curriculum stage wreck a model that nearly solves it? An optimizer ablation of one stage.

Under the answer-only loss a model can enter a curriculum stage already close
to solving it and be thrown back to chance within 50 steps (five-state seed 1
of the table: 94.3% -> 19.7% validation at 32 operations; docs/RESULTS.md).
This replays one recorded run of the table up to the entry of one stage
(the same protocol, seed and overrides, meant to give the same weights and
AdamW moments; the replay's stage steps, and at the last stage the as-run
variant's validation scores, are checked against the record's), then trains
that stage from that same entry state once per *optimizer
variant*, scoring the validation split every ``--every`` steps and measuring
how far the weights moved.

    python -m rlt_scale.experiments.stage_ablation \\
        --key five_state-rlt1_a1-fine_lr10-s1 --stage 32 --steps 150

A variant changes one thing against the run as recorded (``as_run``):
``fresh_moments`` (AdamW's moments reset), ``lr_div10``, ``no_warmup``,
``eps1e-6``, ``beta2_0.999``, ``no_weight_decay``, ``no_clip``.
Output: one JSON with each variant's validation trajectory
(``--out``, default ``runs/experiments/stage_ablation/<key>-L<stage>.json``).
"""

from __future__ import annotations

import argparse
import copy
import json
import shutil
import sys
import time
from pathlib import Path
from typing import Optional

import torch

from rlt_scale.experiments.curriculum import build_trainer, curriculum_options, stage_overrides, train_stages
from rlt_scale.experiments.early_stopping import EarlyStopper, snapshot
from rlt_scale.experiments.evaluate import ANSWER_TOKENS
from rlt_scale.experiments.runs import build_stages, load_results, lr_overrides
from rlt_scale.experiments.state_tracking import DEFAULT_PROTOCOL, load_protocol
from rlt_scale.experiments.supervision import target_fn
from rlt_scale.experiments.variant_sweeps import sweep_variant

# name -> trainer overrides, AdamW param-group edits (applied after the carried state is loaded, which
# would otherwise bring back the recorded run's values), and whether the moments are reset.
VARIANTS: dict[str, dict] = {
    "as_run": {},
    "fresh_moments": {"fresh": True},
    "lr_div10": {"lr_scale": 0.1},
    "no_warmup": {"set": ["optimizer.warmup_steps=0"]},
    "eps1e-6": {"group": {"eps": 1e-6}},
    "beta2_0.999": {"group": {"betas": (0.9, 0.999)}},
    "no_weight_decay": {"group": {"weight_decay": 0.0}},
    "no_clip": {"set": ["optimizer.grad_clip=0"]},
}


def find_record(results: Path, key: str) -> dict:
    record = next((r for r in load_results(results) if r["key"] == key), None)
    if record is None:
        raise SystemExit(f"{results}: no record with key {key!r}")
    return record


def record_protocol(proto: dict, record: dict) -> dict:
    """The protocol the record was trained under: its variant sweep's (and variant's) protocol overrides."""
    sweep_name = record.get("variant_sweep")
    if not sweep_name:
        return proto
    sweep = proto["variant_sweeps"][sweep_name]
    return sweep_variant(proto, sweep, record["tag"])[2]


def probe_records(results: Path, keys: str, protocol: str, out: Path, probe_one, log=print) -> list[dict]:
    """``probe_one(proto, record)`` for each of the comma-separated ``keys`` of ``results``, under the protocol
    the record was trained with; the list is written to ``out`` after each key, so a long probe keeps its part."""
    found = []
    for key in keys.split(","):
        record = find_record(results, key)
        found.append(probe_one(record_protocol(load_protocol(protocol), record), record))
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(found, indent=1))
    log(f"results in {out}")
    return found


def _scaled_lr(overrides: list[str], scale: float) -> list[str]:
    """``optimizer.lr`` and ``min_lr`` of the last of ``overrides`` that set them, times ``scale``."""
    found = {}
    for o in overrides:
        name, _, value = o.partition("=")
        if name in ("optimizer.lr", "optimizer.min_lr"):
            found[name] = float(value)
    if "optimizer.lr" not in found:
        raise SystemExit("lr_scale: the stage's overrides set no optimizer.lr to scale")
    return [f"{name}={value * scale}" for name, value in found.items()]


def _distance(model: torch.nn.Module, start: dict[str, torch.Tensor]) -> float:
    """||theta - theta_entry|| / ||theta_entry|| over every parameter."""
    num = den = 0.0
    for name, p in model.state_dict().items():
        if isinstance(start.get(name), torch.Tensor) and start[name].is_floating_point():
            num += float((p - start[name]).pow(2).sum())
            den += float(start[name].pow(2).sum())
    return (num / max(den, 1e-30)) ** 0.5


def replay_to_entry(proto: dict, record: dict, stage_length: int, work: Path, log):
    """Train ``record``'s run through the stages before ``stage_length``; returns (trained, stages, index, common)."""
    task, seed = record["task"], record["seed"]
    # a record's overrides are its two seeds, its first stage's lr, then the extra ones: keep the extra ones
    extra = record["overrides"][2 + len(lr_overrides(proto, record.get("lr"))[0]):]
    common, stages = build_stages(proto, task, seed, record["max_steps"], record.get("lr"), extra)
    index = next((i for i, s in enumerate(stages) if s.length == stage_length), None)
    if not index:
        raise SystemExit(f"stage {stage_length}: not a later stage of {record['key']} "
                         f"(stages {[s.length for s in stages]})")
    if common != record["overrides"]:
        raise SystemExit(f"{record['key']}: the replay's overrides {common} are not the record's {record['overrides']}")
    spec = proto["tasks"][task]
    options = curriculum_options(spec)
    trained = train_stages(proto["models"][record["model"]], stages[:index], work / "replay", common,
                           ANSWER_TOKENS[task], proto, target_fn(task, record["supervision"]), log, **options)
    if options["carry_best"]:  # train_stages treats its last stage as final: hand on the best
        stages[index - 1].stopper.restore(trained.model)
    return trained, stages, index, common


def run_variant(name: str, proto: dict, record: dict, entry, stages, index: int, common: list[str],
                steps: int, every: int, work: Path, log) -> dict:
    """Train stage ``index`` from ``entry`` (weights and, unless the variant resets them, AdamW moments) for
    ``steps`` under variant ``name``; returns its validation history, per-step training records and summary."""
    spec, task = VARIANTS[name], record["task"]
    stage = stages[index]
    run_dir = work / name
    # the stage keeps its own max_steps (its cosine schedule); the measuring callback stops it after ``steps``
    overrides = stage_overrides(stage, run_dir, common) + [f"trainer.eval_interval={every}", "trainer.log_interval=1"]
    overrides += _scaled_lr(overrides, spec["lr_scale"]) if "lr_scale" in spec else []
    overrides += spec.get("set", [])
    history: list[dict] = []
    stopper = EarlyStopper(target=2.0, patience=0)  # never stops: every evaluation is recorded
    trainer, _ = build_trainer(proto["models"][record["model"]], overrides, stopper, ANSWER_TOKENS[task], proto,
                               run_dir, target_fn(task, record["supervision"]), log)
    trainer.model.load_state_dict(entry.model.state_dict())
    if not spec.get("fresh"):
        trainer.optimizer.load_state_dict(copy.deepcopy(entry.trainer.optimizer.state_dict()))
    for key, value in spec.get("group", {}).items():
        for group in trainer.optimizer.param_groups:
            if key != "weight_decay" or group["weight_decay"] > 0:
                group[key] = value
    start = snapshot(trainer.model)

    def measure(trainer_, step, sums):
        history.append({"step": step, "val_acc": sums.accuracy, "val_loss": sums.mean_loss,
                        "distance": _distance(trainer_.model, start)})
        return step >= steps

    trainer.callbacks.append(measure)
    sums = trainer.evaluate_sums()  # the entry score, as the curriculum's entry check takes it
    for callback in trainer.callbacks:
        callback(trainer, 0, sums)
    began = time.perf_counter()
    trainer.fit()
    train = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    log(f"== {name}: val " + " ".join(f"{h['step']}:{h['val_acc']:.3f}" for h in history))
    return {"variant": name, "overrides": overrides, "history": history,
            "train": [{k: r[k] for k in ("step", "loss", "lr", "grad_norm")} for r in train],
            "entry_acc": history[0]["val_acc"], "min_acc": min(h["val_acc"] for h in history),
            "final_acc": history[-1]["val_acc"], "train_time_s": round(time.perf_counter() - began, 1)}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="runs/experiments/state_tracking-final/results.json")
    p.add_argument("--key", required=True, help="the table run to replay (a record key of --results)")
    p.add_argument("--stage", type=int, required=True, help="program length of the stage to ablate")
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--every", type=int, default=10, help="validation every this many steps")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--protocol", default=DEFAULT_PROTOCOL)
    p.add_argument("--out", help="JSON output (default runs/experiments/stage_ablation/KEY-LSTAGE.json)")
    args = p.parse_args(argv)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        print(f"unknown variant(s) {unknown}; known: {list(VARIANTS)}", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    log = lambda *a: print(*a, flush=True)  # noqa: E731
    record = find_record(Path(args.results), args.key)
    proto = record_protocol(load_protocol(args.protocol), record)
    out = Path(args.out or f"runs/experiments/stage_ablation/{args.key}-L{args.stage}.json")
    work = out.with_suffix("")
    shutil.rmtree(work, ignore_errors=True)  # a rerun replays afresh (as train_one does its run directory)
    entry, stages, index, common = replay_to_entry(proto, record, args.stage, work, log)
    recorded = dict(record["stage_steps"])
    replayed = [list(s) for s in entry.stage_steps]
    result = {"key": args.key, "stage": args.stage, "steps": args.steps, "recorded_stage_steps": record["stage_steps"],
              "replayed_stage_steps": replayed, "faithful": replayed == record["stage_steps"][:index], "variants": []}
    if not result["faithful"]:
        log(f"WARNING: the replay's stage steps {replayed} differ from the record's {record['stage_steps']}")
    for name in args.variants.split(","):
        variant = run_variant(name, proto, record, entry, stages, index, common, args.steps, args.every, work, log)
        if name == "as_run" and index == len(stages) - 1:  # the record's own validation history of this stage
            seen = {h["step"]: h["val_acc"] for h in variant["history"]}
            pairs = [(acc, seen[step]) for step, acc in record["val_history"] if step in seen]
            result["as_run_matches_record"] = bool(pairs) and all(a == b for a, b in pairs)
            log(f"as_run against the record at {len(pairs)} evaluations: "
                f"{'identical' if result['as_run_matches_record'] else 'DIFFERENT'}")
        result["variants"].append(variant)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(result, indent=1))
    log(f"recorded steps at L={args.stage}: {recorded.get(args.stage)}; results in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
