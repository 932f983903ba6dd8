"""Parameter-matched baselines of the state-tracking table, and their training loop.

* :class:`CausalTransformer` - a standard causal (pre-norm, rotary) Transformer:
  token embedding, ``n_layers`` of the RLT's own :class:`~rlt_scale.model.blocks.EncoderBlock`
  (imported, not copied: the same attention, SwiGLU, norms and init), a final
  RMSNorm and a linear readout. This is "the RLT's encoder alone with a readout",
  with untied, separately trained blocks and no recurrence.
* :class:`GRUBaseline` - token embedding, ``torch.nn.GRU``, RMSNorm, linear readout.

Both map ``tokens [B, T]`` to logits ``[B, T, V]`` (position t predicts token
t+1), like the RLT's teacher-forced forward. Given document ids ``doc [B, T]``
(rows of packed programs), each document is computed as if alone: the
Transformer's positions restart and its attention stays inside the document,
the GRU's state restarts from zero.

:func:`build_baseline` makes one; the experiments hand it to the RLT's own
:class:`~rlt_scale.training.trainer.Trainer` (``Trainer(cfg, model=...)``),
so a baseline trains on exactly what the RLT sees: the same data stream, AdamW
groups, learning-rate schedule, loss, clipping, checkpoints and early-stopping
callback. The ``model:`` section of the run config is ignored; the baseline's
shape is a :class:`BaselineConfig`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from rlt_scale.config import ModelConfig, ParallelConfig
from rlt_scale.errors import ConfigError
from rlt_scale.model.blocks import EncoderBlock
from rlt_scale.model.layers import RMSNorm, Rotary, document_positions
from rlt_scale.model.state import KV
from rlt_scale.model.tp import TensorParallel
from rlt_scale.profiling.flops import causal_pairs

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
    encoder_window: int = 0
    """Transformer only: each token attends to itself and the ``encoder_window - 1`` tokens before it
    (the RLT's ``model.encoder_window``, through the same blocks); 0 = full causal attention."""
    rope_theta: float = 10000.0
    """Rotary base."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Standard deviation of the normal init of embedding, readout and (Transformer) block weights."""

    def validate(self) -> "BaselineConfig":
        if self.kind not in BASELINE_KINDS:
            raise ConfigError("baseline.kind", f"expected one of {list(BASELINE_KINDS)}, got {self.kind!r}")
        for name in ("vocab_size", "d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"baseline.{name}", f"expected > 0, got {getattr(self, name)}")
        if self.encoder_window < 0 or (self.encoder_window and self.kind != "transformer"):
            raise ConfigError("baseline.encoder_window", f"expected 0, or > 0 with kind 'transformer'; got "
                              f"{self.encoder_window} with kind {self.kind!r}")
        if self.kind == "transformer":
            self.model_config()  # checks heads/width through the RLT's own rules
        return self

    def model_config(self) -> ModelConfig:
        """The RLT ``ModelConfig`` whose encoder blocks the Transformer reuses."""
        cfg = ModelConfig(
            vocab_size=self.vocab_size, d_model=self.d_model, n_heads=self.n_heads, n_enc_layers=self.n_layers,
            n_dec_layers=self.n_layers, ffn_hidden_size=self.ffn_hidden_size, rope_theta=self.rope_theta,
            norm_eps=self.norm_eps, init_std=self.init_std, tie_layers=False, encoder_window=self.encoder_window,
        )
        try:
            cfg.validate()
        except ConfigError as err:
            raise ConfigError(str(err.args[0]).replace("model.", "baseline.") if err.args else "baseline",
                              str(err)) from None
        return cfg


class _Counted:
    """``parameter_counts()`` as the RLT has it (a baseline ties nothing: applied = unique)."""

    def parameter_counts(self) -> dict[str, int]:
        n = count_parameters(self)
        return {"unique": n, "applied": n}


class CausalTransformer(_Counted, nn.Module):
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

    def forward(self, tokens: torch.Tensor, doc: Optional[torch.Tensor] = None) -> torch.Tensor:
        b, t = tokens.shape
        if doc is None:
            pos = torch.arange(t, device=tokens.device).expand(b, t)
            doc = torch.zeros_like(pos)
        else:
            pos = document_positions(doc)
        rope = Rotary.at(pos, self.mcfg.head_dim, self.mcfg.rope_theta, self.tp.dtype)
        x = self.embed(tokens)
        for block in self.blocks:
            empty = KV.empty(b, self.mcfg.n_heads, self.mcfg.head_dim, self.tp.dtype, tokens.device)
            x, _ = block(x, rope, pos, doc, empty)
        return self.readout(self.norm_out(x))

    def forward_flops(self, seq_len: int) -> int:
        """Matmul FLOPs of one forward pass over one sample of ``seq_len`` tokens (useful causal attention:
        the (query, key) pairs the causal mask, and the window if any, let through)."""
        d, f, v = self.cfg.d_model, self.mcfg.ffn_size, self.cfg.vocab_size
        per_token = self.cfg.n_layers * 2 * (3 * d * d + d * d + 3 * d * f) + 2 * d * v
        attention = self.cfg.n_layers * 4 * d * causal_pairs(seq_len, self.cfg.encoder_window or None)
        return seq_len * per_token + attention


class GRUBaseline(_Counted, nn.Module):
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

    def forward(self, tokens: torch.Tensor, doc: Optional[torch.Tensor] = None) -> torch.Tensor:
        x = self.embed(tokens)
        if doc is None or bool((doc == doc[:, :1]).all()):
            h, _ = self.gru(x)
        else:  # packed documents: one step at a time, the state zeroed (torch's initial state) where one starts
            state, outs = None, []
            for t in range(x.shape[1]):
                if state is not None:
                    state = state * (doc[:, t] == doc[:, t - 1]).to(state.dtype)[None, :, None]
                out, state = self.gru(x[:, t:t + 1], state)
                outs.append(out)
            h = torch.cat(outs, dim=1)
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

