"""Variant sweeps: choose between config or protocol variants of a table row on validation, then test the
chosen variant once per seed (``variant_sweeps`` of the protocol YAML). :func:`run_variant_sweep` says what
a sweep names and how a variant is chosen.
"""

from __future__ import annotations

import copy
import statistics
from pathlib import Path
from typing import Optional

from omegaconf import OmegaConf

from rlt_scale.experiments.curriculum import is_baseline
from rlt_scale.experiments.runs import Table, load_best, run_key, test_one, train_seed
from rlt_scale.experiments.task_sets import prepare_data


VARIANT_KEYS = {"set", "baseline_set", "protocol", "lr"}


def variant_config_set(sweep: dict, variant: str, baseline: bool) -> list[str]:
    """A variant's config overrides: a plain list, or its ``set`` (``baseline_set`` for a baseline model)."""
    spec = sweep["variants"][variant]
    return list((spec.get("baseline_set" if baseline else "set") if isinstance(spec, dict) else spec) or [])


def sweep_variant(proto: dict, sweep: dict, variant: str, baseline: bool = False) -> tuple[list[str], list[str], dict]:
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
    config_set = variant_config_set(sweep, variant, baseline)
    overrides = [*(sweep.get("protocol") or []), *((spec.get("protocol") or []) if isinstance(spec, dict) else [])]
    sproto = copy.deepcopy(proto)
    if "val_lengths" in sweep:
        sproto["tasks"][sweep["task"]]["val_lengths"] = list(sweep["val_lengths"])
    if overrides:
        merged = OmegaConf.merge(OmegaConf.create(sproto), OmegaConf.from_dotlist(overrides))
        sproto = OmegaConf.to_container(merged, resolve=True)
    return config_set, overrides, sproto


def variant_lr(sweep: dict, variant: str) -> Optional[float]:
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
        models = [m for m in models if m in args.sweep_models.split(",")]
    return {model: _sweep_model(proto, table, name, sweep, model, seeds, args, log) for model in models}


def _sweep_model(proto: dict, table: Table, name: str, sweep: dict, model: str, seeds: list[int], args, log) -> str:
    task = sweep["task"]
    supervision = sweep.get("supervision") or args.supervision or proto.get("supervision", "final")
    run = dict(steps=args.steps, log=log, supervision=supervision)
    scores: dict[str, list[float]] = {}
    baseline = is_baseline(proto["models"][model])
    for variant in sweep["variants"]:
        config_set, protocol_set, sproto = sweep_variant(proto, sweep, variant, baseline)
        lr = variant_lr(sweep, variant)
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
    config_set, protocol_set, sproto = sweep_variant(proto, sweep, chosen, baseline)
    lr = variant_lr(sweep, chosen)
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
