"""Training one model of the table, in one stage or through a length curriculum.

A *stage* trains on one prepared training set (one program length) until its
early stopper says stop. Without a curriculum there is one stage, at the task's
training length. With ``curriculum: [4, 8, 16]`` in the task's protocol, the
model first trains on 4-operation programs until validation accuracy at 4
reaches ``curriculum_advance`` (or ``curriculum_steps`` run out), then on 8,
then 16, and finally at the training length under the protocol's own early
stopping. Every stage is the ordinary ``rlt-train`` ``Trainer`` (for a baseline
with the baseline as its model) on its own data and run directory, with the
early stopper as its evaluation callback; the weights and the AdamW moments carry over from one stage to
the next, and the learning-rate schedule (warmup + cosine) restarts per stage.
Stages after the first may take overrides of their own (``curriculum_overrides``):
restarting at the full peak learning rate can throw a model that has just
learned the task at a shorter length off again (docs/RESULTS.md).

With ``entry_check`` a stage that receives a model first scores it on its own
validation split (logged as step 0, and a candidate for the best weights) and
is skipped when that already meets its stopper's target. Why: under the
answer-only loss a model that has solved 16 operations can already solve 24
and 32, and training it further at a near-zero loss can blow it up (a
five-state run went from loss 0.003 to 2.9 in 50 steps and never recovered;
docs/RESULTS.md); a length the model already solves is not trained on.
With ``carry_best`` a stage hands on its best validated weights, not its last:
a stage whose training wrecks the model (a seed went from 98.4% to 47% at 24
operations within 50 steps) then costs its steps but not what was learned.
With ``near_solved`` (an entry score, e.g. 0.9) a stage whose entry score
reaches it without meeting its target trains at ``near_solved_lr_scale`` of
its learning rate (peak and floor). Why: the blow-up above is exploding
gradients through the recurrence, set off by the stage's step size; from the
same entry state a tenth of that step holds or finishes the model
(``stage_ablation``, docs/RESULTS.md).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlt_scale.config import load_config
from rlt_scale.errors import ConfigError
from rlt_scale.experiments.baselines import BaselineConfig, build_baseline
from rlt_scale.experiments.early_stopping import EarlyStopper
from rlt_scale.experiments.supervision import TargetFn, as_objective_targets
from rlt_scale.training.bptt import next_token_targets
from rlt_scale.training.checkpoint_files import write_text_durably
from rlt_scale.training.engine import Objective
from rlt_scale.training.trainer import Trainer



def is_baseline(config_path: str) -> bool:
    """A baseline's YAML has a ``baseline:`` section; anything else is an rlt-train config of an RLT variant."""
    return "baseline" in (OmegaConf.load(config_path) or {})


def flatten(tree: dict, prefix: str = "") -> list[str]:
    """A nested config dict as dotted ``key=value`` overrides."""
    out = []
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.extend(flatten(value, name + "."))
        else:
            out.append(f"{name}={json.dumps(value) if isinstance(value, (list, bool)) or value is None else value}")
    return out


@dataclass
class Stage:
    length: int
    """Program length of this stage's training set."""
    data: Path
    """The prepared training set (its validation split is ``data/eval``)."""
    max_steps: int
    stopper: EarlyStopper
    overrides: tuple[str, ...] = ()
    """Config overrides of this stage only (e.g. a lower learning rate once the model has started learning)."""


@dataclass
class Trained:
    model: object
    """The trained network (its weights are the last stage's last step; the caller restores the best)."""
    cfg: object
    """The last stage's config (an rlt-train ``Config``)."""
    steps: int
    """Optimizer steps over all stages."""
    stage_steps: list[tuple[int, int]]
    """``(length, steps)`` per stage."""
    trainer: Trainer
    """The last stage's trainer: its optimizer holds the AdamW moments a next stage would carry on."""
    stage_lrs: list[tuple[int, float]]
    """``(length, peak learning rate)`` per stage, as trained (``near_solved`` may have lowered one)."""


class Preempted(RuntimeError):
    """A stage's trainer stopped on SIGTERM/SIGUSR1 (it checkpointed and returned early): the run is
    unfinished, so it must not be scored or recorded as if it had used its budget."""


def baseline_config(section: dict, overrides: list[str]) -> BaselineConfig:
    """A YAML ``baseline:`` section with dotted ``baseline.key=value`` overrides; unknown keys are errors."""
    try:
        merged = OmegaConf.merge(OmegaConf.structured(BaselineConfig), section,
                                 OmegaConf.from_dotlist(overrides).get("baseline", {}))
    except OmegaConfBaseException as err:  # as load_config does for the trainer's config
        key = getattr(err, "full_key", None)
        raise ConfigError(f"baseline.{key}" if key else "baseline", str(err).splitlines()[0]) from None
    return BaselineConfig(**OmegaConf.to_container(merged))


def build_trainer(config_path: str, overrides: list[str], stopper: EarlyStopper, answers, proto: dict,
                  run_dir: Path, targets: Optional[TargetFn], log: Callable = print):
    """The trainer of one stage, stopping on ``stopper``: an RLT variant, or a baseline as the model.

    Evaluation covers the whole validation split (``proto['val_samples']``) in micro-batches.
    """
    baseline = None
    if is_baseline(config_path):
        raw = OmegaConf.to_container(OmegaConf.load(config_path), resolve=True)
        own = [o for o in overrides if o.startswith("baseline.")]  # the baseline: section's, not the trainer's
        baseline = baseline_config(raw.pop("baseline"), own)
        cfg = load_config(None, flatten(raw) + [o for o in overrides if o not in own])
    else:
        cfg = load_config(config_path, overrides)
    cfg.trainer.eval_batches = -(-proto["val_samples"] // cfg.trainer.micro_batch_size)
    objective = Objective(targets=as_objective_targets(targets) if targets else next_token_targets,
                          answer_tokens=tuple(answers))
    callbacks = [stopper.callback(run_dir / "val.jsonl", log)]
    model = None
    if baseline is not None:
        torch.manual_seed(cfg.trainer.seed)
        model = build_baseline(baseline)
    trainer = Trainer(cfg, model=model, objective=objective, callbacks=callbacks)
    trainer.checkpoint_also(stopper.checkpointed(trainer.model, trainer.ctx.rank))
    return trainer, cfg


def stage_overrides(stage: Stage, stage_dir: Path, common: list[str]) -> list[str]:
    """The trainer overrides of one stage: its data, run directory and budget, the run's, then its own."""
    return [f"data.path={stage.data}", f"data.eval_path={stage.data / 'eval'}", f"checkpoint.dir={stage_dir}",
            "checkpoint.resume=true", f"trainer.max_steps={stage.max_steps}", *common, *stage.overrides]


@dataclass(frozen=True)
class NearSolved:
    """A smaller step for a stage whose carried-in model already nearly solves it (see the module docstring)."""
    at: float
    """Entry validation accuracy from which the stage counts as nearly solved."""
    lr_scale: float = 0.1
    """Share of the stage's learning rate (peak and floor) it then trains at."""

    def overrides(self, cfg) -> list[str]:
        return [f"optimizer.lr={cfg.optimizer.lr * self.lr_scale}",
                f"optimizer.min_lr={cfg.optimizer.min_lr * self.lr_scale}"]


def curriculum_options(spec: dict) -> dict:
    """``train_stages``' keyword options from a task's protocol (``curriculum_entry_check``, ...)."""
    entry_check = bool(spec.get("curriculum_entry_check", False))
    near = spec.get("curriculum_near_solved")
    if near is not None and not entry_check:
        raise ValueError("curriculum_near_solved needs curriculum_entry_check: true (it acts on the entry score)")
    return dict(entry_check=entry_check, carry_best=bool(spec.get("curriculum_carry_best", False)),
                near_solved=None if near is None else
                NearSolved(float(near), float(spec.get("curriculum_near_solved_lr_scale", 0.1))))


def _score_on_entry(trainer: Trainer) -> tuple[float, bool]:
    """Score the carried-in model on the stage's validation split as step 0: (accuracy, its stopper says stop)."""
    sums = trainer.evaluate_sums()
    return sums.accuracy, any([callback(trainer, 0, sums) for callback in trainer.callbacks])


FINISHED_FILE = "stage-finished.json"
"""Written into a stage's directory when its training ends: the overrides it trained with and its steps."""


def train_stages(config_path: str, stages: list[Stage], run_dir: Path, common: list[str], answers,
                 proto: dict, targets: Optional[TargetFn], log: Callable = print, entry_check: bool = False,
                 carry_best: bool = False, near_solved: Optional[NearSolved] = None) -> Trained:
    """Train through ``stages`` in order (the last one is the training length); ``common`` are shared overrides.

    ``entry_check``: a stage after the first scores the model it receives before training and is skipped
    (0 steps) when that meets its stopper's target. ``carry_best``: a stage before the last hands on the
    weights of its best evaluation (the AdamW moments stay the last step's). ``near_solved``: a stage whose
    entry score reaches ``near_solved.at`` (needs ``entry_check``) trains at a share of its learning rate.
    See the module docstring.

    Resuming (``run_dir`` kept from an unfinished run of the same recipe): a stage an earlier process
    finished is restored from its last checkpoint, which holds its early stopper too, not trained again;
    an interrupted stage resumes from its newest checkpoint. Either way the run continues exactly.
    """
    previous = None
    stage_steps: list[tuple[int, int]] = []
    stage_lrs: list[tuple[int, float]] = []
    for i, stage in enumerate(stages):
        last = i == len(stages) - 1
        stage_dir = run_dir if last else run_dir / f"stage-L{stage.length}"
        stage_dir.mkdir(parents=True, exist_ok=True)
        if len(stages) > 1:
            log(f"-- stage {i + 1}/{len(stages)}: length {stage.length}, up to {stage.max_steps} steps "
                f"{' '.join(stage.overrides)}")
        finished = _read_finished(stage_dir)
        if finished is not None:
            trainer, cfg = build_trainer(config_path, finished["overrides"], stage.stopper, answers, proto,
                                         stage_dir, targets, log)
            trainer.maybe_resume()
            if trainer.resumed_from is None or trainer.step != finished["steps"]:
                raise RuntimeError(f"{stage_dir}: {FINISHED_FILE} says the stage ended at step {finished['steps']}, "
                                   f"but its newest checkpoint is {trainer.resumed_from} (step {trainer.step})")
            log(f"-- stage {i + 1}/{len(stages)}: finished by an earlier process at step {trainer.step}, restored")
            steps = trainer.step
        else:
            trainer, cfg, steps = _train_stage(config_path, stage, stage_dir, common, previous, answers, proto,
                                               targets, log, f"{i + 1}/{len(stages)}", entry_check, near_solved)
        stage_lrs.append((stage.length, cfg.optimizer.lr))
        stage_steps.append((stage.length, steps))
        if carry_best and not last:
            stage.stopper.restore(trainer.model)
        previous = trainer
    return Trained(previous.model, cfg, sum(s for _, s in stage_steps), stage_steps, previous, stage_lrs)


def _train_stage(config_path: str, stage: Stage, stage_dir: Path, common: list[str], previous: Optional[Trainer],
                 answers, proto: dict, targets: Optional[TargetFn], log: Callable, name: str, entry_check: bool,
                 near_solved: Optional[NearSolved]):
    """One stage from the model ``previous`` hands on: (its trainer, config, steps trained)."""
    overrides = stage_overrides(stage, stage_dir, common)
    trainer, cfg = build_trainer(config_path, overrides, stage.stopper, answers, proto, stage_dir, targets, log)
    if previous is not None:
        _carry_over(previous, trainer)
    entry, solved = _score_on_entry(trainer) if previous is not None and entry_check else (None, False)
    if solved:
        log(f"-- stage {name}: solved on entry, not trained")
        return trainer, cfg, 0
    if near_solved is not None and entry is not None and entry >= near_solved.at:
        # the stage's schedule is its config's: rebuild it at the smaller step (the entry stays logged)
        overrides = overrides + near_solved.overrides(cfg)
        trainer, cfg = build_trainer(config_path, overrides, stage.stopper, answers, proto, stage_dir, targets, log)
        _carry_over(previous, trainer)
        log(f"-- stage {name}: nearly solved on entry ({entry:.4f}), lr {cfg.optimizer.lr:.3g}")
    if _ended_in_checkpoint(trainer, stage):  # its process died after the last save, before marking it
        trainer.maybe_resume()
        _mark_finished(stage_dir, overrides, trainer.step)
        return trainer, cfg, trainer.step
    summary = trainer.fit()  # resumes from the stage's newest checkpoint, if an earlier process left one
    # A signal can arrive at the very evaluation that ends the stage: finished all the same, and marked so,
    # or the resumed stage would train on past its end.
    if not summary.preempted or stage.stopper.stopped_early or summary.steps >= stage.max_steps:
        _mark_finished(stage_dir, overrides, summary.steps)
    if summary.preempted:
        raise Preempted(f"{stage_dir}: stopped by a signal at step {summary.steps} of stage L={stage.length}")
    return trainer, cfg, summary.steps


def _ended_in_checkpoint(trainer: Trainer, stage: Stage) -> bool:
    """Whether the stage's newest checkpoint is its end: its budget spent, or its early stopper done."""
    latest = trainer.checkpoints.latest()
    if latest is None:
        return False
    meta = trainer.checkpoints.read_meta(latest)
    return meta["step"] >= stage.max_steps or meta["state"][EarlyStopper.STATE_NAME]["stopped_early"]


def _mark_finished(stage_dir: Path, overrides: list[str], steps: int) -> None:
    write_text_durably(stage_dir / FINISHED_FILE, json.dumps({"overrides": overrides, "steps": steps}, indent=1))


def _read_finished(stage_dir: Path) -> Optional[dict]:
    path = stage_dir / FINISHED_FILE
    return json.loads(path.read_text()) if path.exists() else None


def _carry_over(previous: Trainer, trainer: Trainer) -> None:
    """The weights and AdamW moments a stage receives from the one before."""
    trainer.model.load_state_dict(previous.model.state_dict())
    trainer.optimizer.load_state_dict(previous.optimizer.state_dict())
