"""Prefill and sampling with the same transition as training (DESIGN.md section 2).

Prefill runs the encoder over the prompt in one batch, builds the memory in
one pass, then recurs the decoder through every prompt token. Each new token
is then sampled from the current state and consumed exactly once: one
incremental encoder step (against the encoder's key cache), one memory entry,
one decoder step.

Two costs stay constant per token however long a stream gets:

* **Copying.** The encoder's keys and the memory gain one entry per token.
  They live in :class:`GrowingKV` buffers sized for the whole stream, each
  entry is written once in place, and attention reads a view of the filled
  prefix. Concatenating the whole past at every token instead copies O(T)
  bytes per token, O(T^2) per stream.
* **Waiting.** No step reads a device value on the host, so on a GPU the host
  queues step after step without waiting for any of them.
  :meth:`Generator.generate` reads the sampled tokens back only once every
  ``check_every`` tokens, to look for the stop token and to stream them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
from megatron.core.tensor_parallel import gather_from_tensor_model_parallel_region

from rlt_scale.model.rlt import RLT
from rlt_scale.model.state import KV, DecoderState


class GrowingKV:
    """Keys/values of a stream's past in buffers with room to grow; new entries are written in place.

    The first ``len(self)`` of ``capacity`` slots are filled; :meth:`view` is
    a :class:`KV` over them (no copy). Appending beyond the capacity doubles
    it, so a stream that outgrows its plan still copies O(1) per entry on
    average.
    """

    def __init__(self, kv: KV, capacity: int = 0):
        self.length = 0
        self._allocate(kv, max(capacity, len(kv)))
        self.append(kv)

    def _allocate(self, like: KV, capacity: int) -> None:
        batch, heads, _, head_dim = like.k.shape
        self.k = like.k.new_empty(batch, heads, capacity, head_dim)
        self.v = like.v.new_empty(batch, heads, capacity, head_dim)
        self.pos = like.pos.new_empty(batch, capacity)
        self.doc = like.doc.new_empty(batch, capacity)

    def __len__(self) -> int:
        return self.length

    @property
    def capacity(self) -> int:
        return self.k.shape[2]

    def append(self, kv: KV) -> None:
        start, end = self.length, self.length + len(kv)
        if end > self.capacity:
            filled = self.view()
            self._allocate(filled, max(end, 2 * self.capacity))
            self.length = 0
            self.append(filled)
        self.k[:, :, start:end] = kv.k
        self.v[:, :, start:end] = kv.v
        self.pos[:, start:end] = kv.pos
        self.doc[:, start:end] = kv.doc
        self.length = end

    def view(self) -> KV:
        n = self.length
        return KV(self.k[:, :, :n], self.v[:, :, :n], self.pos[:, :n], self.doc[:, :n])

    def cat(self, new: KV) -> KV:
        """What ``KV.cat`` gives (this store, then ``new``), but by appending ``new`` in place.

        The encoder's attention forms its keys as ``past.cat(new)``, so a
        list of GrowingKVs passed as ``RLT.encode(..., past=...)`` takes each
        token's keys without copying the past. Unlike ``KV.cat`` this changes
        ``self``.
        """
        self.append(new)
        return self.view()


@dataclass
class StreamState:
    """Everything needed to continue one batch of streams."""

    encoder: list[GrowingKV]
    """Encoder keys/values of every past position, per encoder layer."""
    memory: list[GrowingKV]
    """Memory entries of every past position, per group."""
    decoder: DecoderState
    """H_t: the feedback s and the decoder window caches."""
    position: int
    """Index of the next position."""

    def state_dict(self) -> dict:
        """Plain tensors, saveable with ``torch.save`` and loadable with ``weights_only``."""
        out = {"position": torch.tensor(self.position)}
        for prefix, stores in (("encoder", self.encoder), ("memory", self.memory)):
            for i, store in enumerate(stores):
                kv = store.view()
                # cloned: torch.save writes a view's whole buffer, empty slots included
                out.update({f"{prefix}.{i}.{f}": getattr(kv, f).clone() for f in ("k", "v", "pos", "doc")})
        out.update({f"decoder.{k}": v for k, v in self.decoder.state_dict().items()})
        return out

    @classmethod
    def from_state_dict(cls, sd: dict) -> "StreamState":
        def stores(prefix):
            n = sum(1 for key in sd if key.startswith(prefix + ".") and key.endswith(".k"))
            return [GrowingKV(KV(*(sd[f"{prefix}.{i}.{f}"] for f in ("k", "v", "pos", "doc")))) for i in range(n)]

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
    def prefill(self, prompt: torch.Tensor, capacity: int = 0) -> tuple[torch.Tensor, StreamState]:
        """Logits ``[B, P, V]`` for every prompt position, and the state after it.

        ``capacity`` is the stream length to make room for (at least the
        prompt's); the state grows beyond it, at the cost of a copy each time
        its room doubles.
        """
        model = self.model
        batch, length = prompt.shape
        pos, doc = self._positions(batch, 0, length, prompt.device)
        e, enc_keys = model.encode(prompt, pos, doc)
        memory = model.build_memory(e, pos, doc)
        z, dec = model.decode(e, pos, doc, memory, model.initial_state(batch, prompt.device))
        room = max(capacity, length)
        state = StreamState([GrowingKV(kv, room) for kv in enc_keys], [GrowingKV(kv, room) for kv in memory],
                            dec, length)
        return self._full_logits(model.logits(z)), state

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, state: StreamState) -> tuple[torch.Tensor, StreamState]:
        """Consume one token per stream (``[B]``); logits ``[B, V]`` for the next.

        ``state`` is advanced in place (each key is written into it once,
        never copied again) and returned. Stepping one state two ways would
        overwrite one way with the other: to branch a stream, copy its state
        with ``StreamState.from_state_dict(state.state_dict())``.
        """
        model = self.model
        batch = tokens.shape[0]
        pos, doc = self._positions(batch, state.position, 1, tokens.device)
        e, _ = model.encode(tokens[:, None], pos, doc, past=state.encoder)  # appends via GrowingKV.cat
        if any(len(store) != state.position + 1 for store in state.encoder):
            raise RuntimeError("RLT.encode no longer extends its past with past.cat(new), which GrowingKV relies on")
        for store, new in zip(state.memory, model.build_memory(e, pos, doc)):
            store.append(new)
        # One position is one segment; saying so spares decode a segment search that reads the device.
        z, state.decoder = model.decode(e, pos, doc, [store.view() for store in state.memory], state.decoder,
                                        offset=state.position, segments=[(0, 1)])
        state.position += 1
        return self._full_logits(model.logits(z))[:, 0], state

    @staticmethod
    def sample(logits: torch.Tensor, cfg: SamplingConfig, generator: Optional[torch.Generator] = None):
        """Sample one token per row; returns (tokens, behaviour log-probabilities).

        The log-probability is under the distribution actually sampled from
        (after temperature, top-k and top-p), which is what off-policy
        corrections need. ``generator`` must live on the logits' device.
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
                 on_tokens: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
                 check_every: int = 16):
        """Sample continuations; returns (new tokens ``[B, N]``, their log-probs ``[B, N]``).

        Sampling ends after ``max_new_tokens``, or at the first step where
        every stream sampled ``stop_token`` (which is kept).

        The host reads the sampled tokens back once every ``check_every``
        tokens and after the last one; each read waits for the device, so
        between reads nothing does. At a read the stop token is looked for,
        and ``on_tokens(tokens, logprobs)`` (both ``[B, n]``: the tokens since
        the previous read), if given, is called, so a caller can stream text
        in pieces of ``check_every`` tokens (1: token by token). Tokens
        sampled after a stop, before the read that finds it, are discarded:
        what is returned and streamed does not depend on ``check_every``; only
        how far ``generator`` has advanced does.
        ``max_new_tokens=0`` returns ``[B, 0]``.
        """
        if max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")
        if check_every < 1:
            raise ValueError(f"check_every must be >= 1, got {check_every}")
        batch, device = prompt.shape[0], prompt.device
        tokens = torch.empty((batch, max_new_tokens), dtype=torch.long, device=device)
        logprobs = torch.empty((batch, max_new_tokens), dtype=torch.float32, device=device)
        if max_new_tokens == 0:
            return tokens, logprobs
        logits, state = self.prefill(prompt, capacity=prompt.shape[1] + max_new_tokens)
        next_logits, read = logits[:, -1], 0
        for t in range(max_new_tokens):
            token, logprob = self.sample(next_logits, cfg, generator)
            tokens[:, t], logprobs[:, t] = token, logprob
            if t + 1 == max_new_tokens or t + 1 - read == check_every:
                stop = _first_stop(tokens[:, read:t + 1], stop_token)
                end = t + 1 if stop is None else read + stop + 1
                if on_tokens is not None:
                    on_tokens(tokens[:, read:end], logprobs[:, read:end])
                if stop is not None:
                    return tokens[:, :end], logprobs[:, :end]
                read = end
            if t + 1 < max_new_tokens:  # the last token is returned, not consumed
                next_logits, state = self.step(token, state)
        return tokens, logprobs


def _first_stop(block: torch.Tensor, stop_token: Optional[int]) -> Optional[int]:
    """The first step of ``block`` ``[B, n]`` at which every stream sampled ``stop_token`` (one host read)."""
    if stop_token is None:
        return None
    every = (block == stop_token).all(0).tolist()
    return every.index(True) if True in every else None
