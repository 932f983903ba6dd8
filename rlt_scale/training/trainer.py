"""The training loop: data, learning rate, logging, checkpoints, evaluation, on any layout.

One optimizer step = ``grad_accum_steps`` micro-batches. The loss is the mean
cross-entropy over every valid target of the step on all data-parallel ranks.
How the layout computes and applies the gradients (one process, TP x DP, the
ring pipeline, ZeRO) is the engine's business (:mod:`rlt_scale.training.engine`);
what is trained is the :class:`~rlt_scale.training.engine.Objective` plug-in.
``rlt-train``, the state-tracking experiments and their baselines all run
this one loop.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence

import torch

from rlt_scale.config import Config, config_to_dict, config_to_yaml
from rlt_scale.data.loader import StreamingLoader, pin_batches
from rlt_scale.distributed import ParallelContext, init_distributed
from rlt_scale.errors import CheckpointError, ConfigError
from rlt_scale.parallel.data_parallel import dp_sum
from rlt_scale.training.checkpoint import CheckpointManager
from rlt_scale.training.engine import LossSums, Objective, build_engine, rank_model
from rlt_scale.training.metrics import MetricsLogger
from rlt_scale.training.optim import LRSchedule, build_optimizer
from rlt_scale.training.preemption import PreemptionFlag
from rlt_scale.training.sharded_state import ModelOptimizerState, RNGState
from rlt_scale.training.summary import TrainSummary

EvalCallback = Callable[["Trainer", int, LossSums], bool]
"""``callback(trainer, step, sums) -> stop?``: called on every rank after each evaluation with
the global sums (the same everywhere), so every rank takes the same decision."""


def tf32_setting(device: torch.device, tf32: bool) -> Optional[bool]:
    """What to set torch's TF32 switches to for a run on ``device`` (``trainer.tf32``); None: leave them.

    TF32 exists only on CUDA; elsewhere the switches mean nothing and stay as they are.
    """
    return tf32 if device.type == "cuda" else None


def apply_tf32(device: torch.device, tf32: bool) -> None:
    """Let (or forbid) float32 matmuls and cuDNN convolutions use TF32 tensor cores, on CUDA only.

    Set both ways: torch's defaults differ (matmul off, cuDNN on), and ``tf32: false`` means full float32 everywhere.
    """
    setting = tf32_setting(device, tf32)
    if setting is not None:
        torch.backends.cuda.matmul.allow_tf32 = setting
        torch.backends.cudnn.allow_tf32 = setting


class Trainer:
    """The loop. ``model`` (optional) is a prebuilt single-stage model (the experiments'
    baselines); ``objective`` what is trained; ``callbacks`` see every evaluation and may stop the run.
    """

    def __init__(self, cfg: Config, ctx: Optional[ParallelContext] = None, *, model: Optional[torch.nn.Module] = None,
                 objective: Objective = Objective(), callbacks: Sequence[EvalCallback] = ()):
        self.cfg = cfg
        self.objective, self.callbacks = objective, list(callbacks)
        # Evaluation always scores the data's own targets (the answer, for a task).
        self.eval_objective = Objective(answer_tokens=objective.answer_tokens)
        self.ctx = ctx or init_distributed(cfg.parallel, cfg.trainer.device)
        self.device = self.ctx.device
        self.run_dir = Path(cfg.checkpoint.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        torch.manual_seed(cfg.trainer.seed)
        if cfg.trainer.threads:
            torch.set_num_threads(cfg.trainer.threads)
        if self.device.type == "cpu":
            # Denormal floats (tiny activations/gradients early in training)
            # run ~2x slower on x86 CPUs; flushing them to zero is standard.
            torch.set_flush_denormal(True)
        apply_tf32(self.device, cfg.trainer.tf32)

        t = cfg.trainer
        # Batches for a GPU come pinned, so _to_device's non_blocking copy is asynchronous.
        pin = pin_batches(self.device)
        self.loader = StreamingLoader(cfg.data, batch_size=t.micro_batch_size, dp_rank=self.ctx.dp_rank,
                                      dp_size=self.ctx.dp, pin_memory=pin)
        # The eval set is opened (and checked) now, not at the first evaluation hours in.
        self.eval_loader: Optional[StreamingLoader] = None
        if cfg.data.eval_path:
            self.eval_loader = StreamingLoader(cfg.data, batch_size=t.micro_batch_size, dp_rank=self.ctx.dp_rank,
                                               dp_size=self.ctx.dp, path=cfg.data.eval_path, pin_memory=pin)
        for loader in (self.loader, self.eval_loader):
            if loader is not None and loader.vocab_size > cfg.model.vocab_size:
                raise ConfigError("model.vocab_size", f"data at {loader.index.path} uses {loader.vocab_size} token ids, "
                                                      f"model has {cfg.model.vocab_size}")
        stage = None
        if model is None:
            model, stage = rank_model(cfg.model, self.ctx)
        self.model = model.to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.engine = build_engine(cfg, self.ctx, self.model, self.optimizer, self._autocast, stage)
        self.bptt = self.engine.bptt
        self.lr_schedule = LRSchedule(self.optimizer, cfg.optimizer, t.max_steps)
        self.rng = RNGState(self.ctx)
        self.model_state = ModelOptimizerState(self.model, self.optimizer, self.ctx, self.engine.zero)
        layout = {"tp": self.ctx.tp, "pp": self.ctx.pp, "dp": self.ctx.dp, "zero_stage": cfg.parallel.zero_stage}
        self.checkpoints = CheckpointManager(self.run_dir, keep=cfg.checkpoint.keep, rank=self.ctx.rank,
                                             world_size=self.ctx.world_size, layout=layout,
                                             on_corrupt=cfg.checkpoint.on_corrupt)
        self.step = 0
        self.resumed_from: Optional[Path] = None
        self.wandb_id: Optional[str] = None
        self.extra_state: dict = {}

    # -------------------------------------------------------------- plumbing
    def stateful(self) -> dict:
        """What a checkpoint holds: model + optimizer and RNG sharded, schedule and data position global,
        and what :meth:`checkpoint_also` added."""
        return {"model_and_optimizer": self.model_state, "rng": self.rng,
                "lr_schedule": self.lr_schedule, "data": self.loader, **self.extra_state}

    def checkpoint_also(self, objects: dict) -> None:
        """Save and restore ``objects`` (name -> a global or sharded stateful, see
        :mod:`~rlt_scale.training.checkpoint`) with every checkpoint: the state of a callback, say.
        Layout-bound ones make a resume on another layout an error, as nothing can reseed them."""
        clash = set(objects) & set(self.stateful())
        if clash:
            raise ValueError(f"checkpoint_also: {sorted(clash)} already name checkpointed state")
        self.extra_state.update(objects)

    def _autocast(self):
        if self.cfg.trainer.precision == "bf16":
            return torch.autocast(self.device.type, dtype=torch.bfloat16)
        return contextlib.nullcontext()

    def _to_device(self, batch: dict) -> dict:
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    def announce(self) -> None:
        if not self.ctx.is_logging_rank:
            return
        counts = self.model.parameter_counts()  # every trained model has it (baselines too)
        print("== effective config ==\n" + config_to_yaml(self.cfg), flush=True)
        print(f"parameters: {counts['unique']:,} unique, {counts['applied']:,} applied "
              f"(tied layers counted per use)", flush=True)
        print(f"recurrence: {self.bptt.describe()}", flush=True)
        print(f"data: {self.loader.samples_per_epoch:,} samples/epoch of {self.loader.seq_len + 1} tokens "
              f"from {self.cfg.data.path}", flush=True)

    def maybe_resume(self) -> None:
        """Resume from the newest loadable checkpoint, or start a fresh run that overwrites nothing."""
        for leftover in self.checkpoints.incomplete() if self.ctx.is_logging_rank else []:
            print(f"warning: ignoring incomplete checkpoint {leftover}", flush=True)
        meta = None
        if self.cfg.checkpoint.resume:
            meta = self.checkpoints.resume(self.stateful(), run_model_config=config_to_dict(self.cfg)["model"])
        if meta is None:
            self.checkpoints.start_fresh(move_aside=self.cfg.checkpoint.move_aside)
            return
        latest = self.resumed_from = Path(meta["path"])
        self.step = int(meta["step"])
        self.wandb_id = meta.get("wandb_run_id")
        if meta["resharded"]:  # per-rank RNG rows belong to the old layout's ranks
            bound = sorted(name for name, obj in self.extra_state.items() if getattr(obj, "layout_bound", False))
            if bound:
                old = meta["layout"]
                raise CheckpointError(f"{latest}: {', '.join(bound)} belong to the layout that saved them (tp="
                                      f"{old['tp']} pp={old['pp']} dp={old['dp']} zero={old['zero_stage']}); "
                                      "resume this run on that layout")
            self.rng.reseed(self.cfg.trainer.seed, self.step)
        if self.ctx.is_logging_rank:
            lost = self._last_logged_step() - self.step
            note = f"; {lost} step(s) logged after it were lost and are redone" if lost > 0 else ""
            print(f"resumed from {latest} at step {self.step}{note}", flush=True)
            if meta["resharded"]:
                old = meta["layout"]
                print(f"resharded from tp={old['tp']} pp={old['pp']} dp={old['dp']} zero={old['zero_stage']} to "
                      f"tp={self.ctx.tp} pp={self.ctx.pp} dp={self.ctx.dp} zero={self.cfg.parallel.zero_stage}; "
                      f"RNG reseeded from (trainer.seed, step, rank)", flush=True)

    def _last_logged_step(self) -> int:
        """The newest step in metrics.jsonl. A line cut short by a crash mid-write is skipped, not fatal."""
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return 0
        steps = []
        for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
            try:
                steps.append(int(json.loads(line).get("step", 0)))
            except (ValueError, AttributeError, TypeError):
                if line.strip() and self.ctx.is_logging_rank:
                    print(f"warning: {path}:{number} is not a JSON record (cut short by a crash?); ignored",
                          flush=True)
        return max(steps, default=0)

    def save(self) -> Path:
        """Checkpoint the current step (collective). Called between optimizer steps.

        The last step's gradients are spent by then -- its norm is already a
        float, evaluation runs without gradients and the next step's
        ``forward_backward`` starts by clearing them -- so they are freed
        first: the save's writer buffers then reuse their memory instead of
        adding to it. (Under ZeRO DeepSpeed has freed them already.)
        """
        self.model.zero_grad(set_to_none=True)
        extra = {"config": config_to_dict(self.cfg), "wandb_run_id": self.wandb_id,
                 "consumed_samples": self.loader.state_dict()["consumed_samples"]}
        return self.checkpoints.save(self.step, self.stateful(), extra)

    # ------------------------------------------------------------ the work
    def forward_backward(self, batches: list[dict]) -> float:
        """Accumulate the gradient of the step's mean loss over this rank's ``batches``; returns that loss."""
        return self.engine.forward_backward(batches, self.objective)

    def optimizer_step(self) -> float:
        """Clip by the global norm over all shards, step, advance the LR schedule; returns the norm."""
        norm = self.engine.step(self.lr_schedule.apply())
        self.lr_schedule.advance()
        return norm

    def train_step(self, batches: list[dict]) -> tuple[float, float]:
        """One optimizer step over this rank's ``batches``; returns (loss, grad norm)."""
        loss = self.forward_backward(batches)
        return loss, self.optimizer_step()

    def evaluate_sums(self) -> Optional[LossSums]:
        """Loss (and right answers, for a task) over ``trainer.eval_batches`` of the eval set, all ranks."""
        if self.eval_loader is None:
            return None
        t = self.cfg.trainer
        batches = [self._to_device(b) for _, b in zip(range(t.eval_batches), self.eval_loader.iter_epoch_once())]
        return self.engine.forward_loss(batches, self.eval_objective)

    def evaluate(self) -> Optional[float]:
        """The mean eval loss, or None without an eval set."""
        sums = self.evaluate_sums()
        return None if sums is None else sums.mean_loss

    def flops_per_token(self) -> Optional[tuple[float, float]]:
        """(model, hardware) FLOPs per trained token of the whole model, when MFU is asked for."""
        if self.cfg.logging.peak_tflops is None:
            return None
        from rlt_scale.profiling.flops import analytic_flops
        from rlt_scale.profiling.workload import Workload

        t = self.cfg.trainer
        work = Workload(batch=t.micro_batch_size, seq_len=self.loader.seq_len, chunk_size=t.chunk_size,
                        checkpoint=self.bptt.checkpoint)
        report = analytic_flops(self.cfg.model, work)
        return report.model_flops / work.tokens, report.hardware_flops / work.tokens

    def fit(self) -> TrainSummary:
        cfg, t = self.cfg, self.cfg.trainer
        self.announce()
        self.maybe_resume()
        if self.step >= t.max_steps:
            return self._already_complete()
        logger = MetricsLogger(cfg.logging, self.run_dir, config_to_dict(cfg), self.ctx.is_logging_rank, self.wandb_id)
        self.wandb_id = logger.run_id
        if self.step:  # resumed: the metrics stream records where it picked up
            logger.log({"step": self.step, "note": "resumed",
                        "lost_steps": max(self._last_logged_step() - self.step, 0)})
        if self.ctx.is_logging_rank:
            (self.run_dir / "config.yaml").write_text(config_to_yaml(cfg))
        if self.bptt.tbptt_chunks:
            logger.log({"step": self.step, "note": "gradient truncated"}, f"NOTE: {self.bptt.describe()}")

        batches: Iterator[dict] = iter(self.loader)
        tokens_per_step = t.micro_batch_size * t.grad_accum_steps * self.loader.seq_len * self.ctx.dp
        flops = self.flops_per_token()
        peak = (cfg.logging.peak_tflops or 0) * 1e12 * self.ctx.world_size  # every device of the job
        losses, eval_loss, ckpt = [], None, None
        preemption = PreemptionFlag().install()
        window_start, window_tokens, run_tokens, run_time = time.perf_counter(), 0, 0, 0.0
        while self.step < t.max_steps:
            step_start = time.perf_counter()
            step_batches = [self._to_device(next(batches)) for _ in range(t.grad_accum_steps)]
            loss, norm = self.train_step(step_batches)
            self.step += 1
            losses.append(loss)
            window_tokens += tokens_per_step
            run_tokens += tokens_per_step
            run_time += time.perf_counter() - step_start
            if self.step % t.log_interval == 0 or self.step == t.max_steps or self.step == 1:
                elapsed = time.perf_counter() - window_start
                record = {
                    "step": self.step, "loss": loss, "lr": self.optimizer.param_groups[0]["lr"], "grad_norm": norm,
                    "tokens_per_s": window_tokens / elapsed, "consumed_samples": self.loader.state_dict()["consumed_samples"],
                    "skipped_samples": self._skipped_samples(),
                }
                if flops is not None:
                    record["mfu"] = record["tokens_per_s"] * flops[0] / peak
                    record["hfu"] = record["tokens_per_s"] * flops[1] / peak
                record.update(self.engine.metrics())
                logger.log(record, f"step {self.step:>6}/{t.max_steps}  loss {loss:.4f}  lr {record['lr']:.2e}  "
                                   f"grad-norm {norm:.3f}  tokens/s {record['tokens_per_s']:,.0f}")
                window_start, window_tokens = time.perf_counter(), 0
            stop = False
            if t.eval_interval and self.step % t.eval_interval == 0:
                sums = self.evaluate_sums()
                if sums is not None:
                    eval_loss = sums.mean_loss
                    record = {"step": self.step, "eval_loss": eval_loss}
                    if self.eval_objective.answer_tokens is not None:
                        record["eval_accuracy"] = sums.accuracy
                    logger.log(record, f"step {self.step:>6}  eval loss {eval_loss:.4f}")
                    stop = any([callback(self, self.step, sums) for callback in self.callbacks])
            if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                ckpt = self.save()
            if signal_name := preemption.agreed(self.ctx.world_size, self.device):
                logger.log({"step": self.step, "note": "preempted"},
                           f"{signal_name} received: checkpointing at step {self.step} and exiting")
                break
            if stop:
                logger.log({"step": self.step, "note": "stopped by a callback"})
                break
        if ckpt is None or not str(ckpt).endswith(f"{self.step:08d}"):
            ckpt = self.save()
        preemption.uninstall()
        logger.close()
        return TrainSummary(
            steps=self.step,
            first_loss=losses[0] if losses else None,
            last_loss=losses[-1] if losses else None,
            tokens_per_s=run_tokens / run_time if run_time else 0.0,
            checkpoint=str(ckpt),
            max_steps=t.max_steps,
            eval_loss=eval_loss,
            losses=losses,
            preempted=preemption.requested,
            skipped_samples=self._skipped_samples(),
        )

    def _skipped_samples(self) -> int:
        """Samples of the whole job replaced by padding so far (``data.on_error: skip``); collective over DP."""
        return int(dp_sum(torch.tensor([float(self.loader.skipped_samples)], dtype=torch.float64), self.ctx)[0])

    def _already_complete(self) -> TrainSummary:
        """A resumed run that has nothing left to do: say so rather than train zero steps (or save again)."""
        return TrainSummary(steps=self.step, first_loss=None, last_loss=None, tokens_per_s=0.0,
                            checkpoint=str(self.resumed_from), max_steps=self.cfg.trainer.max_steps, already_complete=True)
