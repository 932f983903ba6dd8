"""Prefill and sampling with the same transition as training (DESIGN.md section 2).

Prefill runs the encoder over the prompt in one batch, builds the memory in
one pass, then recurs the decoder through every prompt token. Each new token
is then sampled from the current state and consumed exactly once: one
incremental encoder step (against the encoder's key cache), one memory entry,
one decoder step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from rlt_scale.model.rlt import RLT
from rlt_scale.model.state import KV, DecoderState


@dataclass
class StreamState:
    """Everything needed to continue one batch of streams."""

    encoder: list[KV]
    """Encoder keys/values of every past position, per encoder layer."""
    memory: list[KV]
    """Memory entries of every past position, per group."""
    decoder: DecoderState
    """H_t: the feedback s and the decoder window caches."""
    position: int
    """Index of the next position."""

    def state_dict(self) -> dict:
        """Plain tensors, saveable with ``torch.save`` and loadable with ``weights_only``."""
        out = {"position": torch.tensor(self.position)}
        for prefix, stores in (("encoder", self.encoder), ("memory", self.memory)):
            for i, kv in enumerate(stores):
                out.update({f"{prefix}.{i}.{f}": getattr(kv, f) for f in ("k", "v", "pos", "doc")})
        out.update({f"decoder.{k}": v for k, v in self.decoder.state_dict().items()})
        return out

    @classmethod
    def from_state_dict(cls, sd: dict) -> "StreamState":
        def stores(prefix):
            n = sum(1 for key in sd if key.startswith(prefix + ".") and key.endswith(".k"))
            return [KV(*(sd[f"{prefix}.{i}.{f}"] for f in ("k", "v", "pos", "doc"))) for i in range(n)]

        decoder = DecoderState.from_state_dict({k[len("decoder."):]: v for k, v in sd.items() if k.startswith("decoder.")})
        return cls(stores("encoder"), stores("memory"), decoder, int(sd["position"]))


@dataclass
class SamplingConfig:
    temperature: float = 1.0
    """0 picks the most likely token (greedy)."""
    top_k: int = 0
    """Keep the k most likely tokens (0: all)."""
    top_p: float = 1.0
    """Keep the smallest set whose probability reaches p (1.0: all)."""


class Generator:
    def __init__(self, model: RLT):
        self.model = model

    def _full_logits(self, logits: torch.Tensor) -> torch.Tensor:
        if self.model.tp.size > 1:
            return gather_from_tensor_model_parallel_region(logits)
        return logits

    def _positions(self, batch: int, start: int, length: int, device):
        pos = torch.arange(start, start + length, device=device).expand(batch, length)
        return pos, torch.zeros_like(pos)

    @torch.no_grad()
    def prefill(self, prompt: torch.Tensor) -> tuple[torch.Tensor, StreamState]:
        """Logits ``[B, P, V]`` for every prompt position, and the state after it."""
        model = self.model
        batch, length = prompt.shape
        pos, doc = self._positions(batch, 0, length, prompt.device)
        e, enc_keys = model.encode(prompt, pos, doc)
        memory = model.build_memory(e, pos, doc)
        z, dec = model.decode(e, pos, doc, memory, model.initial_state(batch, prompt.device))
        return self._full_logits(model.logits(z)), StreamState(enc_keys, memory, dec, length)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state: StreamState) -> tuple[torch.Tensor, StreamState]:
        """Consume one token per stream (``[B]``); logits ``[B, V]`` for the next."""
        model = self.model
        batch = tokens.shape[0]
        pos, doc = self._positions(batch, state.position, 1, tokens.device)
        e, enc_keys = model.encode(tokens[:, None], pos, doc, past=state.encoder)
        memory = [old.cat(new) for old, new in zip(state.memory, model.build_memory(e, pos, doc))]
        z, dec = model.decode(e, pos, doc, memory, state.decoder, offset=state.position)
        logits = self._full_logits(model.logits(z))[:, 0]
        return logits, StreamState(enc_keys, memory, dec, state.position + 1)

    @staticmethod
    def sample(logits: torch.Tensor, cfg: SamplingConfig, generator: Optional[torch.Generator] = None):
        """Sample one token per row; returns (tokens, behaviour log-probabilities).

        The log-probability is under the distribution actually sampled from
        (after temperature, top-k and top-p), which is what off-policy
        corrections need.
        """
        logits = logits.float()
        if cfg.temperature == 0:
            choice = logits.argmax(-1)
            return choice, torch.zeros(choice.shape, dtype=logits.dtype, device=logits.device)
        logits = logits / cfg.temperature
        if cfg.top_k:
            kth = logits.topk(min(cfg.top_k, logits.shape[-1]), dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        if cfg.top_p < 1.0:
            sorted_logits, order = logits.sort(dim=-1, descending=True)
            cumulative = sorted_logits.softmax(-1).cumsum(-1)
            drop = cumulative - sorted_logits.softmax(-1) >= cfg.top_p  # keep the token that crosses p
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        logprobs = logits.log_softmax(-1)
        choice = torch.multinomial(logprobs.exp(), 1, generator=generator).squeeze(-1)
        return choice, logprobs.gather(-1, choice[:, None]).squeeze(-1)

    @torch.no_grad()
    def generate(self, prompt: torch.Tensor, max_new_tokens: int, cfg: SamplingConfig = SamplingConfig(),
                 generator: Optional[torch.Generator] = None, stop_token: Optional[int] = None,
                 on_token: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None):
        """Sample continuations; returns (new tokens ``[B, N]``, their log-probs ``[B, N]``).

        ``on_token(token, logprob)`` (both ``[B]``), if given, is called once per
        sampled token as soon as it is sampled -- before the model consumes it --
        so a caller can stream the text. ``max_new_tokens=0`` returns ``[B, 0]``.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if max_new_tokens == 0:
            return (torch.empty((prompt.shape[0], 0), dtype=torch.long, device=prompt.device),
                    torch.empty((prompt.shape[0], 0), dtype=torch.float32, device=prompt.device))
        logits, state = self.prefill(prompt)
        next_logits = logits[:, -1]
        tokens, logprobs = [], []
        for _ in range(max_new_tokens):
            token, logprob = self.sample(next_logits, cfg, generator)
            tokens.append(token)
            logprobs.append(logprob)
            if on_token is not None:
                on_token(token, logprob)
            if stop_token is not None and bool((token == stop_token).all()):
                break
            next_logits, state = self.step(token, state)
        return torch.stack(tokens, 1), torch.stack(logprobs, 1)
