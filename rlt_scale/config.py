"""The one typed configuration of rlt-scale.

Every run is described by a :class:`Config`: a tree of dataclasses with a
docstring under each field. ``load_config`` builds it from a YAML file in
``configs/`` merged with dotted ``key=value`` overrides through omegaconf in
struct mode, so an unknown key or a value of the wrong type is an error that
names the key. Cross-field rules live in one place, :meth:`Config.validate`,
and every violation raises :class:`~rlt_scale.errors.ConfigError` naming the
offending key.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields
from typing import Optional

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from rlt_scale.data.config import DataConfig
from rlt_scale.errors import ConfigError


def _choice(key: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(key, f"expected one of {list(allowed)}, got {value!r}")


def _finite_floats(prefix: str, section) -> None:
    """NaN or infinity in any float field fails here, naming the key, not later inside torch."""
    for f in fields(section):
        value = getattr(section, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}.{f.name}", f"expected a finite number, got {value}")


def _positive(key: str, value, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(key, f"expected {'>= 0' if allow_zero else '> 0'}, got {value}")


@dataclass
class ModelConfig:
    """Shape of the Recurrent Looped Transformer (see DESIGN.md section 1)."""

    EXECUTION_KEYS = ("decoder_solver", "decoder_wgrad_block", "decoder_step", "decoder_compile",
                      "decoder_compile_cache", "jacobi_tol", "jacobi_max_sweeps")
    """Keys that choose how the decoder is computed, not what the model is: a checkpoint
    resumes under other values of them (checkpoint.py compares the rest)."""

    vocab_size: int = 260
    """Vocabulary size V of the embedding and readout; must cover the data's tokenizer."""
    d_model: int = 64
    """Residual width d."""
    n_heads: int = 4
    """Attention heads h (encoder self-, decoder window- and cross-attention)."""
    n_enc_layers: int = 2
    """Encoder depth L_E."""
    n_dec_layers: int = 2
    """Decoder depth L_D."""
    ffn_hidden_size: int = 0
    """SwiGLU hidden width; 0 picks 8/3 * d rounded up to a multiple of 64."""
    window: int = 8
    """Decoder sliding window W; counts the current token (W=1: no cache)."""
    encoder_window: int = 0
    """Encoder self-attention window (counts the current token); 0 = full causal attention. Set it to at
    least the training sequence length and training is unchanged, while at longer inputs each position
    attends over as many entries as in training (full attention dilutes with length: parity, docs/RESULTS.md)."""
    memory_groups: int = 1
    """Encoder memory groups G: 1 shares one memory, L_D gives each layer its own."""
    feedback_block: int = 1
    """Feedback granularity K: 1 = RLT-1 token recurrence, K>1 = RLT-2 blocks, 0 = no feedback."""
    feedback_scale: float = 0.1
    """Merge scale alpha in u_t = e_t + alpha * g * (Ws r)."""
    learn_feedback_scale: bool = False
    """Make alpha a trained parameter instead of a constant."""
    tie_layers: bool = True
    """Share attention and FFN weights of encoder layer l and decoder layer l (needs L_E == L_D)."""
    rope_theta: float = 10000.0
    """Rotary position base."""
    norm_eps: float = 1e-6
    """RMSNorm epsilon."""
    init_std: float = 0.02
    """Std of the normal init; output projections are scaled by 1/sqrt(2 * applied depth)."""
    params_dtype: str = "float32"
    """Parameter dtype: float32, float64 (equivalence tests) or bfloat16."""
    decoder_solver: str = "sequential"
    """How the decoder's recurrence is solved (same function either way, docs/JACOBI.md):
    ``sequential`` walks the positions in order; ``jacobi`` runs all positions of a chunk
    in parallel sweeps until the feedback is a fixed point, with an implicit (adjoint)
    gradient, and falls back to ``sequential`` where it does not converge."""
    decoder_wgrad_block: int = 64
    """Positions per deferred weight-gradient GEMM of the sequential decoder
    (``rlt_scale/model/deferred.py``): backward forms each decoder weight's gradient once
    per block of this many positions, as one GEMM, instead of once per position, and keeps
    less per position. 0: autograd's own per-position gradients. Same numbers either way."""
    decoder_step: str = "layers"
    """How the sequential decoder walks a training chunk where its weight gradients are deferred:
    ``layers`` runs each layer at each position as its own modules (a dozen autograd nodes);
    ``fused`` runs the whole chunk as one autograd node (``rlt_scale/model/walk.py``) that calls
    one step function per position -- the merge, every layer and the carry, forward and
    backward, with the same shapes at every position (``rlt_scale/model/fused.py``), the unit
    that ``decoder_compile`` compiles and CUDA graphs capture -- and forms the weight and
    memory gradients once per ``decoder_wgrad_block`` positions. Same numbers either way;
    needs ``decoder_wgrad_block > 0``. It serves one process's walk over whole chunks, in
    training and without gradients (evaluation, a prompt's prefill); the pipeline ring
    (``parallel.pp > 1``), the Jacobi solver's sweeps and generation's token-by-token
    steps run the layers."""
    decoder_compile: str = "none"
    """Compile the fused step with ``torch.compile``: ``none``, ``default`` (inductor, with its
    C++ wrapper), or ``reduce-overhead`` (CUDA graphs on CUDA). Compiled code is cached under
    ``decoder_compile_cache`` across runs; the first training step compiles (about a minute
    on a CPU)."""
    decoder_compile_cache: str = ".cache/inductor"
    """Directory of the persistent compile cache (inductor's FX-graph cache), relative to the
    working directory unless absolute; it sets ``TORCHINDUCTOR_CACHE_DIR`` when the step is
    first compiled. Empty leaves that variable, or torch's default under /tmp."""
    jacobi_tol: float = 1e-6
    """Jacobi: stop when every position's feedback moved by at most this much relative to
    its norm in the last sweep (and the adjoint likewise); 0 runs to the exact solution."""
    jacobi_max_sweeps: int = 32
    """Jacobi: sweeps per chunk (forward; the adjoint gets as many) before falling back to
    the sequential decoder from the first position not yet within jacobi_tol."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_size(self) -> int:
        if self.ffn_hidden_size:
            return self.ffn_hidden_size
        return 64 * math.ceil(8 * self.d_model / 3 / 64)

    def memory_group_of(self, layer: int) -> int:
        """Decoder layer -> memory group: contiguous runs of layers share a group."""
        return layer * self.memory_groups // self.n_dec_layers

    def validate(self) -> None:
        for name in ("vocab_size", "d_model", "n_heads", "n_enc_layers", "n_dec_layers", "window"):
            _positive(f"model.{name}", getattr(self, name))
        _positive("model.feedback_block", self.feedback_block, allow_zero=True)
        _positive("model.encoder_window", self.encoder_window, allow_zero=True)
        _positive("model.ffn_hidden_size", self.ffn_hidden_size, allow_zero=True)
        if self.d_model % self.n_heads:
            raise ConfigError("model.n_heads", f"must divide model.d_model={self.d_model}, got {self.n_heads}")
        if self.head_dim % 2:
            raise ConfigError("model.n_heads", f"head dim d_model/n_heads={self.head_dim} must be even for rotary")
        if not 1 <= self.memory_groups <= self.n_dec_layers:
            raise ConfigError(
                "model.memory_groups", f"expected 1..n_dec_layers={self.n_dec_layers}, got {self.memory_groups}"
            )
        if self.tie_layers and self.n_enc_layers != self.n_dec_layers:
            raise ConfigError(
                "model.tie_layers",
                f"needs n_enc_layers == n_dec_layers, got {self.n_enc_layers} and {self.n_dec_layers}",
            )
        _choice("model.params_dtype", self.params_dtype, ("float32", "float64", "bfloat16"))
        _choice("model.decoder_solver", self.decoder_solver, ("sequential", "jacobi"))
        _positive("model.jacobi_tol", self.jacobi_tol, allow_zero=True)
        _positive("model.jacobi_max_sweeps", self.jacobi_max_sweeps)
        _positive("model.decoder_wgrad_block", self.decoder_wgrad_block, allow_zero=True)
        _choice("model.decoder_step", self.decoder_step, ("layers", "fused"))
        _choice("model.decoder_compile", self.decoder_compile, ("none", "default", "reduce-overhead"))
        if self.decoder_step == "fused" and not self.decoder_wgrad_block:
            raise ConfigError("model.decoder_step", "fused forms weight gradients per block of positions: needs "
                              "model.decoder_wgrad_block > 0, got 0")
        if self.decoder_compile != "none" and self.decoder_step != "fused":
            raise ConfigError("model.decoder_compile", f"compiles the fused step: needs "
                              f"model.decoder_step=fused, got {self.decoder_step!r}")


@dataclass
class ParallelConfig:
    """Process layout: world = tp x pp x dp (DESIGN.md section 3)."""

    tp: int = 1
    """Tensor-parallel size (splits heads, FFN, memory projections, vocabulary)."""
    pp: int = 1
    """Pipeline-parallel size (stages of layers; the decoder runs as a ring)."""
    dp: int = 0
    """Data-parallel size; 0 infers world_size / (tp * pp)."""
    zero_stage: int = 0
    """DeepSpeed ZeRO stage 1 or 2 for the data-parallel optimizer (0 = plain data parallelism)."""
    backend: str = "auto"
    """torch.distributed backend: auto (nccl on CUDA, else gloo), gloo or nccl."""
    timeout_s: int = 600
    """Process-group timeout: a mismatched collective fails after this many seconds."""

    def validate(self) -> None:
        _positive("parallel.tp", self.tp)
        _positive("parallel.pp", self.pp)
        _positive("parallel.dp", self.dp, allow_zero=True)
        _positive("parallel.timeout_s", self.timeout_s)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ConfigError("parallel.zero_stage", f"expected 0, 1, 2 or 3, got {self.zero_stage}")
        _choice("parallel.backend", self.backend, ("auto", "gloo", "nccl"))


@dataclass
class OptimizerConfig:
    """AdamW with linear warmup and cosine decay."""

    lr: float = 3e-3
    """Peak learning rate, reached after warmup."""
    min_lr: float = 3e-4
    """Learning rate at the end of the cosine decay."""
    warmup_steps: int = 20
    """Linear warmup steps from 0 to lr."""
    decay_steps: int = 0
    """Cosine decay length in steps after warmup; 0 uses trainer.max_steps."""
    weight_decay: float = 0.1
    """Decoupled weight decay; never applied to 1-D parameters (norms, biases, s_*)."""
    beta1: float = 0.9
    """Adam beta1."""
    beta2: float = 0.95
    """Adam beta2."""
    eps: float = 1e-8
    """Adam epsilon."""
    grad_clip: float = 1.0
    """Clip the global gradient norm to this value; 0 disables clipping."""

    def validate(self) -> None:
        _positive("optimizer.lr", self.lr)
        _positive("optimizer.min_lr", self.min_lr, allow_zero=True)
        if self.min_lr > self.lr:
            raise ConfigError("optimizer.min_lr", f"must not exceed optimizer.lr={self.lr}, got {self.min_lr}")
        _positive("optimizer.warmup_steps", self.warmup_steps, allow_zero=True)
        _positive("optimizer.decay_steps", self.decay_steps, allow_zero=True)
        _positive("optimizer.weight_decay", self.weight_decay, allow_zero=True)
        _positive("optimizer.grad_clip", self.grad_clip, allow_zero=True)
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optimizer.{name}", f"expected in [0, 1), got {getattr(self, name)}")


@dataclass
class TrainerConfig:
    """The training loop and the recurrence schedule (DESIGN.md section 2)."""

    max_steps: int = 200
    """Optimizer steps to run."""
    micro_batch_size: int = 8
    """Samples per micro-batch on each data-parallel rank."""
    grad_accum_steps: int = 1
    """Micro-batches accumulated per optimizer step."""
    decoder_sequences: int = 0
    """Sequences that advance through the decoder together in one pass (PP=1); 0 = one micro-batch.
    The decoder reads every weight once per position for however many sequences run together, so a
    larger value buys throughput on a bandwidth-bound GPU (``rlt-profile`` tabulates the bound) at
    the price of that many sequences' activations at once. Consecutive micro-batches of the step
    are joined: a multiple of micro_batch_size that divides micro_batch_size * grad_accum_steps.
    The loss and gradients are the same (sums over the same targets). With parallel.pp > 1 the
    ring's circulating micro-batches play this part: leave it 0."""
    chunk_size: int = 0
    """Decoder chunk length C; 0 runs the whole sample as one chunk."""
    activation_checkpointing: str = "none"
    """'none' keeps all activations; 'chunk' keeps only the decoder state at chunk boundaries; 'full'
    is 'chunk' plus every encoder layer recomputed in backward (keeps only each layer's input)."""
    tbptt_chunks: int = 0
    """Truncated BPTT: detach the carried state every N chunks; 0 = exact (full) BPTT."""
    tbptt_detach: list[str] = field(default_factory=lambda: ["s", "cache"])
    """What truncation detaches: any of 's' (feedback), 'cache' (window caches), 'memory' (earlier chunks')."""
    precision: str = "fp32"
    """Compute precision: fp32, bf16 (autocast) or fp64 (parameters must be float64)."""
    device: str = "auto"
    """'auto' (cuda when available), 'cpu' or 'cuda'."""
    tf32: bool = True
    """On CUDA, let float32 matmuls and cuDNN convolutions use TF32 tensor cores (10-bit mantissa,
    several times faster on A100/H100): every matmul under fp32 precision, those outside autocast
    under bf16. false keeps them in full float32 (tight equivalence checks on a GPU). Ignored on CPU."""
    seed: int = 0
    """Seed for initialization and sampling."""
    threads: int = 0
    """CPU threads for torch ops; 0 keeps torch's default. Small models run fastest on 1."""
    log_interval: int = 10
    """Print and log metrics every N steps."""
    eval_interval: int = 100
    """Evaluate on data.eval_path every N steps (0 disables)."""
    eval_batches: int = 8
    """Micro-batches per evaluation."""

    def validate(self) -> None:
        for name in ("max_steps", "micro_batch_size", "grad_accum_steps", "log_interval"):
            _positive(f"trainer.{name}", getattr(self, name))
        for name in ("chunk_size", "tbptt_chunks", "eval_interval", "eval_batches", "threads"):
            _positive(f"trainer.{name}", getattr(self, name), allow_zero=True)
        _choice("trainer.activation_checkpointing", self.activation_checkpointing, ("none", "chunk", "full"))
        _choice("trainer.precision", self.precision, ("fp32", "bf16", "fp64"))
        _choice("trainer.device", self.device, ("auto", "cpu", "cuda"))
        for part in self.tbptt_detach:
            _choice("trainer.tbptt_detach", part, ("s", "cache", "memory"))
        if self.tbptt_chunks and not self.tbptt_detach:
            raise ConfigError("trainer.tbptt_detach", "tbptt_chunks > 0 but nothing is detached")


@dataclass
class CheckpointConfig:
    """Where and how often the run saves itself."""

    dir: str = "runs/tiny"
    """Output directory: checkpoints, metrics.jsonl and the effective config."""
    interval: int = 100
    """Save every N steps (and always at the end); 0 saves only at the end."""
    keep: int = 2
    """Keep the newest N checkpoints."""
    resume: bool = True
    """Resume from the newest loadable checkpoint in dir when there is one. The one the
    ``latest`` pointer names comes first; a missing or unreadable pointer is reported
    and the directory scanned instead."""
    on_corrupt: str = "fallback"
    """A checkpoint that fails to load on resume (incomplete, corrupt, checksum mismatch):
    ``fallback`` warns and resumes from the next older one; ``refuse`` stops with the error."""
    move_aside: bool = False
    """A fresh run (``resume: false``, or nothing loadable) in a dir that holds checkpoints is
    refused, so that it cannot overwrite them; true moves them, with the old metrics, to
    ``<dir>/previous/<time>/`` instead."""

    def validate(self) -> None:
        if not self.dir:
            raise ConfigError("checkpoint.dir", "expected a directory path")
        _positive("checkpoint.interval", self.interval, allow_zero=True)
        _positive("checkpoint.keep", self.keep)
        _choice("checkpoint.on_corrupt", self.on_corrupt, ("fallback", "refuse"))


@dataclass
class LoggingConfig:
    """Console, JSONL and wandb logging."""

    wandb_mode: str = "offline"
    """wandb mode: offline (default, no network), online, or disabled."""
    project: str = "rlt-scale"
    """wandb project name."""
    run_name: Optional[str] = None
    """wandb run name; None lets wandb pick one."""
    peak_tflops: Optional[float] = None
    """Dense peak TFLOP/s of ONE device in the training precision (e.g. 989 for an H100 in bf16).
    When set, every logged step carries MFU and HFU from the analytic cost model
    (docs/PERFORMANCE.md); None logs neither. ``rlt-profile`` can measure a peak."""

    def validate(self) -> None:
        _choice("logging.wandb_mode", self.wandb_mode, ("offline", "online", "disabled"))
        if self.peak_tflops is not None and not self.peak_tflops > 0:
            raise ConfigError("logging.peak_tflops", f"expected a positive TFLOP/s figure or null, got {self.peak_tflops}")


@dataclass
class Config:
    """A complete run description."""

    model: ModelConfig = field(default_factory=ModelConfig)
    """The network."""
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    """The process layout."""
    data: DataConfig = field(default_factory=DataConfig)
    """The training (and evaluation) data stream."""
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    """AdamW and its schedule."""
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    """The loop and the recurrence schedule."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Saving and resuming."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Metrics sinks."""

    def validate(self) -> "Config":
        """Check every section, then the rules that span sections."""
        for name in ("model", "parallel", "data", "optimizer", "trainer", "checkpoint", "logging"):
            section = getattr(self, name)
            _finite_floats(name, section)
            section.validate()
        if self.trainer.precision == "fp64" and self.model.params_dtype != "float64":
            raise ConfigError("trainer.precision", "fp64 needs model.params_dtype=float64")
        if self.trainer.precision == "bf16" and self.model.params_dtype == "float64":
            raise ConfigError("trainer.precision", "bf16 autocast with float64 parameters makes no sense")
        t = self.trainer
        if t.decoder_sequences:
            per_step = t.micro_batch_size * t.grad_accum_steps
            if t.decoder_sequences % t.micro_batch_size or per_step % t.decoder_sequences:
                raise ConfigError("trainer.decoder_sequences",
                                  f"must be a multiple of trainer.micro_batch_size={t.micro_batch_size} that divides "
                                  f"micro_batch_size * grad_accum_steps={per_step}, got {t.decoder_sequences}")
            if self.parallel.pp > 1:
                raise ConfigError("trainer.decoder_sequences", f"parallel.pp={self.parallel.pp} runs the decoder "
                                  "as a ring whose micro-batches circulate together already: leave it 0")
        if self.trainer.tbptt_chunks and not self.trainer.chunk_size:
            raise ConfigError("trainer.tbptt_chunks", "truncation counts chunks: set trainer.chunk_size > 0")
        if self.trainer.activation_checkpointing != "none" and not self.trainer.chunk_size:
            raise ConfigError("trainer.activation_checkpointing",
                              f"'{self.trainer.activation_checkpointing}' needs trainer.chunk_size > 0")
        for name in ("n_heads", "vocab_size"):
            if getattr(self.model, name) % self.parallel.tp:
                raise ConfigError(f"model.{name}", f"must be divisible by parallel.tp={self.parallel.tp}")
        if self.model.ffn_size % self.parallel.tp:
            raise ConfigError("model.ffn_hidden_size", f"must be divisible by parallel.tp={self.parallel.tp}")
        if self.model.decoder_solver == "jacobi" and self.parallel.pp > 1:
            raise ConfigError("model.decoder_solver", f"'jacobi' runs in one pipeline stage; parallel.pp={self.parallel.pp} "
                                                      "runs the decoder as a ring: use decoder_solver=sequential")
        for name in ("n_enc_layers", "n_dec_layers"):
            if getattr(self.model, name) % self.parallel.pp:
                raise ConfigError("parallel.pp", f"must divide model.{name}={getattr(self.model, name)}")
        if self.parallel.zero_stage == 3:
            raise ConfigError("parallel.zero_stage", "ZeRO-3 is not supported; use 1 or 2 (or 0 for plain DDP)")
        if self.parallel.zero_stage and self.model.params_dtype != "float32":
            raise ConfigError("model.params_dtype", "DeepSpeed ZeRO-1/2 keeps fp32 master weights: use float32")
        return self


def load_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> Config:
    """Build a validated :class:`Config` from a YAML file plus ``key=value`` overrides.

    Unknown keys and wrong types raise :class:`ConfigError` naming the key.
    """
    schema = OmegaConf.structured(Config)
    OmegaConf.set_struct(schema, True)
    try:
        layers = [schema]
        if path:
            layers.append(_load_yaml(path))
        if overrides:
            for item in overrides:
                if "=" not in item:
                    raise ConfigError(item, "overrides are written key=value")
            layers.append(OmegaConf.from_dotlist(list(overrides)))
        merged = OmegaConf.merge(*layers)
        cfg: Config = OmegaConf.to_object(merged)  # type: ignore[assignment]
    except OmegaConfBaseException as err:
        key = getattr(err, "full_key", None) or "config"
        raise ConfigError(str(key), str(err).splitlines()[0]) from None
    return cfg.validate()


def _load_yaml(path: str):
    """The YAML file at ``path``; a syntax error is one line naming file, line and column."""
    import yaml

    try:
        return OmegaConf.load(path)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        problem = getattr(err, "problem", None) or str(err).splitlines()[0]
        raise ConfigError(str(path), f"YAML syntax error at {where}: {problem}") from None


def config_to_yaml(cfg: Config) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def config_to_dict(cfg: Config) -> dict:
    return OmegaConf.to_container(OmegaConf.structured(cfg))  # type: ignore[return-value]
