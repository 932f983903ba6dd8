"""Parameter-matched baselines of the state-tracking table, and their training loop.

* :class:`CausalTransformer` - a standard causal (pre-norm, rotary) Transformer:
  token embedding, ``n_layers`` of the RLT's own :class:`~rlt_scale.model.blocks.EncoderBlock`
  (imported, not copied: the same attention, SwiGLU, norms and init), a final
  RMSNorm and a linear readout. This is "the RLT's encoder alone with a readout",
  with untied, separately trained blocks and no recurrence.
* :class:`GRUBaseline` - token embedding, ``torch.nn.GRU``, RMSNorm, linear readout.

Both map ``tokens [B, T]`` to logits ``[B, T, V]`` (position t predicts token
t+1), like the RLT's teacher-forced forward.

:class:`BaselineTrainer` trains them on exactly what the RLT's
:class:`~rlt_scale.training.trainer.Trainer` sees: the same
:class:`~rlt_scale.data.loader.StreamingLoader` stream (``data:`` section),
the same AdamW groups (:func:`~rlt_scale.training.optim.build_optimizer`),
the same warmup + cosine schedule (:func:`~rlt_scale.training.optim.lr_at`),
the same loss (mean cross-entropy over loss-masked targets), gradient
clipping, and the same early-stopping hook. The ``model:`` section of the
run config is ignored; the baseline's shape is a :class:`BaselineConfig`.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
from torch import nn

from rlt_scale.config import Config, ModelConfig, ParallelConfig, config_to_yaml
from rlt_scale.data.loader import StreamingLoader
from rlt_scale.errors import ConfigError
from rlt_scale.experiments.supervision import TargetFn, masked_cross_entropy
from rlt_scale.model.blocks import EncoderBlock
from rlt_scale.model.layers import RMSNorm, Rotary
from rlt_scale.training.bptt import count_valid_targets, valid_targets
from rlt_scale.model.state import KV
from rlt_scale.model.tp import TensorParallel
from rlt_scale.training.optim import build_optimizer, lr_at

BASELINE_KINDS = ("transformer", "gru")


@dataclass
class BaselineConfig:
    """Shape of a baseline (the ``baseline:`` section of an experiment YAML)."""

    kind: str = "transformer"
    """'transformer' (causal encoder + readout) or 'gru'."""
    vocab_size: int = 260
    """Embedding/readout size; must cover the data's tokenizer (259 for the byte tokenizer)."""
    d_model: int = 48
    """Width (Transformer residual width; GRU embedding and hidden size)."""
    n_layers: int = 2
    """Transformer blocks or stacked GRU layers."""
    n_heads: int = 4
    """Transformer attention heads."""
    ffn_hidden_size: int = 0
    """Transformer SwiGLU width; 0 picks 8/3 * d rounded up to a multiple of 64 (as the RLT)."""
    rope_theta: float = 10000.0
    norm_eps: float = 1e-6
    init_std: float = 0.02

    def validate(self) -> "BaselineConfig":
        if self.kind not in BASELINE_KINDS:
            raise ConfigError("baseline.kind", f"expected one of {list(BASELINE_KINDS)}, got {self.kind!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"baseline.{name}", f"expected > 0, got {getattr(self, name)}")
        if self.kind == "transformer":
            self.model_config()  # checks heads/width through the RLT's own rules
        return self

    def model_config(self) -> ModelConfig:
        """The RLT ``ModelConfig`` whose encoder blocks the Transformer reuses."""
        cfg = ModelConfig(
            vocab_size=self.vocab_size, d_model=self.d_model, n_heads=self.n_heads, n_enc_layers=self.n_layers,
            n_dec_layers=self.n_layers, ffn_hidden_size=self.ffn_hidden_size, rope_theta=self.rope_theta,
            norm_eps=self.norm_eps, init_std=self.init_std, tie_layers=False,
        )
        try:
            cfg.validate()
        except ConfigError as err:
            raise ConfigError(str(err.args[0]).replace("model.", "baseline.") if err.args else "baseline",
                              str(err)) from None
        return cfg


class CausalTransformer(nn.Module):
    """Embedding, ``n_layers`` causal rotary :class:`EncoderBlock` s, RMSNorm, readout."""

    def __init__(self, cfg: BaselineConfig, tp: TensorParallel):
        super().__init__()
        self.cfg = cfg
        self.mcfg = cfg.model_config()
        self.tp = tp
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        nn.init.normal_(self.embed.weight, std=cfg.init_std)
        self.blocks = nn.ModuleList(EncoderBlock(self.mcfg, tp) for _ in range(cfg.n_layers))
        self.norm_out = RMSNorm(cfg.d_model, cfg.norm_eps, tp.dtype)
        self.readout = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        nn.init.normal_(self.readout.weight, std=cfg.init_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        pos = torch.arange(t, device=tokens.device).expand(b, t)
        doc = torch.zeros_like(pos)
        rope = Rotary.at(pos, self.mcfg.head_dim, self.mcfg.rope_theta, self.tp.dtype)
        x = self.embed(tokens)
        for block in self.blocks:
            empty = KV.empty(b, self.mcfg.n_heads, self.mcfg.head_dim, self.tp.dtype, tokens.device)
            x, _ = block(x, rope, pos, doc, empty)
        return self.readout(self.norm_out(x))

    def forward_flops(self, seq_len: int) -> int:
        """Matmul FLOPs of one forward pass over one sample of ``seq_len`` tokens (useful causal attention)."""
        d, f, v = self.cfg.d_model, self.mcfg.ffn_size, self.cfg.vocab_size
        per_token = self.cfg.n_layers * 2 * (3 * d * d + d * d + 3 * d * f) + 2 * d * v
        attention = self.cfg.n_layers * 4 * d * (seq_len * (seq_len + 1) // 2)
        return seq_len * per_token + attention


class GRUBaseline(nn.Module):
    """Embedding, ``torch.nn.GRU`` (``n_layers`` stacked, hidden ``d_model``), RMSNorm, readout."""

    def __init__(self, cfg: BaselineConfig):
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.gru = nn.GRU(cfg.d_model, cfg.d_model, num_layers=cfg.n_layers, batch_first=True)
        self.norm_out = RMSNorm(cfg.d_model, cfg.norm_eps, torch.float32)
        self.readout = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        # The embedding keeps torch's N(0, 1) init: the GRU has no input norm, and inputs of
        # std init_std would barely move its gates (it then sits at chance on parity).
        nn.init.normal_(self.readout.weight, std=cfg.init_std)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h, _ = self.gru(self.embed(tokens))
        return self.readout(self.norm_out(h))

    def forward_flops(self, seq_len: int) -> int:
        d, v = self.cfg.d_model, self.cfg.vocab_size
        per_token = self.cfg.n_layers * 2 * 3 * (d * d + d * d) + 2 * d * v
        return seq_len * per_token


def build_baseline(cfg: BaselineConfig, tp_group=None) -> nn.Module:
    cfg.validate()
    if cfg.kind == "gru":
        return GRUBaseline(cfg)
    if tp_group is None:
        from rlt_scale.distributed import init_distributed

        tp_group = init_distributed(ParallelConfig(), "cpu").tp_group
    tp = TensorParallel.build(tp_group, "float32", cfg.init_std, cfg.n_layers)
    return CausalTransformer(cfg, tp)


def count_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


EvalHook = Callable[[int, nn.Module], tuple[Optional[float], bool]]
"""``hook(step, model) -> (validation loss or None, stop?)``, called every ``trainer.eval_interval`` steps."""


@dataclass
class BaselineSummary:
    steps: int
    first_loss: Optional[float]
    last_loss: Optional[float]
    tokens_per_s: float
    parameters: int


class BaselineTrainer:
    """The RLT trainer's loop for a baseline: same data stream, AdamW groups, schedule, loss and clipping.

    Single process, no checkpoint resume (runs are short); the final weights are
    saved to ``checkpoint.dir/baseline.pt`` and the metrics to ``metrics.jsonl``.
    """

    def __init__(self, bcfg: BaselineConfig, cfg: Config, eval_hook: Optional[EvalHook] = None,
                 targets: Optional[TargetFn] = None):
        self.bcfg, self.cfg, self.eval_hook = bcfg.validate(), cfg, eval_hook
        self.targets = targets  # None: the data's own next-token targets (supervision.py)
        t = cfg.trainer
        if t.threads:
            torch.set_num_threads(t.threads)
        torch.set_flush_denormal(True)
        torch.manual_seed(t.seed)
        self.device = torch.device("cpu" if t.device in ("auto", "cpu") and not torch.cuda.is_available()
                                   or t.device == "cpu" else "cuda")
        self.run_dir = Path(cfg.checkpoint.dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.loader = StreamingLoader(cfg.data, batch_size=t.micro_batch_size)
        if self.loader.vocab_size > bcfg.vocab_size:
            raise ConfigError("baseline.vocab_size",
                              f"data at {cfg.data.path} uses {self.loader.vocab_size} token ids, model has {bcfg.vocab_size}")
        self.model = build_baseline(bcfg).to(self.device)
        self.optimizer = build_optimizer(self.model, cfg.optimizer)
        self.step = 0

    def loss_sum(self, batch: dict) -> tuple[torch.Tensor, int]:
        tokens = batch["tokens"].to(self.device)
        mask = batch["loss_mask"].to(self.device).bool()
        doc = batch["doc_ids"].to(self.device)
        if self.targets is None:
            targets, valid = tokens[:, 1:], valid_targets(tokens, doc, mask)
        else:
            targets, valid = self.targets(tokens)
        logits = self.model(tokens[:, :-1])
        return masked_cross_entropy(logits, targets, valid), int(valid.sum())

    def fit(self) -> BaselineSummary:
        cfg, t = self.cfg, self.cfg.trainer
        print(f"== baseline {self.bcfg.kind} ==\n{json.dumps(asdict(self.bcfg))}\n" + config_to_yaml(cfg), flush=True)
        print(f"parameters: {count_parameters(self.model):,}", flush=True)
        (self.run_dir / "config.yaml").write_text(config_to_yaml(cfg))
        (self.run_dir / "baseline.json").write_text(json.dumps(asdict(self.bcfg), indent=1))
        metrics = open(self.run_dir / "metrics.jsonl", "w")
        batches = iter(self.loader)
        losses: list[float] = []
        tokens_per_step = t.micro_batch_size * t.grad_accum_steps * self.loader.seq_len
        run_time = 0.0
        while self.step < t.max_steps:
            start = time.perf_counter()
            self.model.train()
            lr = lr_at(self.step, cfg.optimizer, t.max_steps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            step_batches = [next(batches) for _ in range(t.grad_accum_steps)]
            if self.targets is None:
                n_targets = sum(count_valid_targets(b) for b in step_batches)
            else:
                n_targets = sum(int(self.targets(b["tokens"])[1].sum()) for b in step_batches)
            self.optimizer.zero_grad(set_to_none=True)
            total = 0.0
            for batch in step_batches:
                loss_sum, _ = self.loss_sum(batch)
                loss = loss_sum / max(n_targets, 1)
                loss.backward()
                total += loss.item()
            clip = cfg.optimizer.grad_clip
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else float("inf"))
            self.optimizer.step()
            self.step += 1
            losses.append(total)
            run_time += time.perf_counter() - start
            if self.step % t.log_interval == 0 or self.step == 1 or self.step == t.max_steps:
                rec = {"step": self.step, "loss": total, "lr": lr, "grad_norm": float(norm)}
                metrics.write(json.dumps(rec) + "\n")
                print(f"step {self.step:>6}/{t.max_steps}  loss {total:.4f}  lr {lr:.2e}  grad-norm {float(norm):.3f}",
                      flush=True)
            if self.eval_hook is not None and t.eval_interval and self.step % t.eval_interval == 0:
                eval_loss, stop = self.eval_hook(self.step, self.model)
                if eval_loss is not None:
                    metrics.write(json.dumps({"step": self.step, "eval_loss": eval_loss}) + "\n")
                if stop:
                    break
        metrics.close()
        torch.save(self.model.state_dict(), self.run_dir / "baseline.pt")
        return BaselineSummary(
            steps=self.step, first_loss=losses[0] if losses else None, last_loss=losses[-1] if losses else None,
            tokens_per_s=self.step * tokens_per_step / run_time if run_time else 0.0,
            parameters=count_parameters(self.model),
        )
