"""Explicit recurrent state: key/value stores and the decoder state H_t.

Everything the decoder carries from one position to the next lives here, as
plain tensors, so it can be carried across chunks, detached for truncated
BPTT, saved with a stream and restored (DESIGN.md section 1, "State").
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KV:
    """Rotated keys and values with the position and document of each entry.

    ``k``/``v`` are ``[B, h, N, hd]``; ``pos`` (document-relative position)
    and ``doc`` (document id) are ``[B, N]``. Masks are built from ``pos`` and
    ``doc`` alone, so an entry from another document is never visible.
    """

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    doc: torch.Tensor

    @classmethod
    def empty(cls, batch: int, heads: int, head_dim: int, dtype, device) -> "KV":
        kv = torch.zeros(batch, heads, 0, head_dim, dtype=dtype, device=device)
        idx = torch.zeros(batch, 0, dtype=torch.long, device=device)
        return cls(kv, kv.clone(), idx, idx.clone())

    def __len__(self) -> int:
        return self.k.shape[2]

    def cat(self, other: "KV") -> "KV":
        return KV(
            torch.cat([self.k, other.k], dim=2),
            torch.cat([self.v, other.v], dim=2),
            torch.cat([self.pos, other.pos], dim=1),
            torch.cat([self.doc, other.doc], dim=1),
        )

    def last(self, n: int) -> "KV":
        """The newest ``n`` entries (``n = 0`` gives an empty store)."""
        start = max(len(self) - n, 0)
        return KV(self.k[:, :, start:], self.v[:, :, start:], self.pos[:, start:], self.doc[:, start:])

    def first(self, n: int) -> "KV":
        return KV(self.k[:, :, :n], self.v[:, :, :n], self.pos[:, :n], self.doc[:, :n])

    def detach(self) -> "KV":
        return KV(self.k.detach(), self.v.detach(), self.pos, self.doc)

    def detach_before(self, n: int) -> "KV":
        """Stop gradients into entries ``[:n]`` (truncated BPTT of the memory)."""
        if n <= 0:
            return self
        k = torch.cat([self.k[:, :, :n].detach(), self.k[:, :, n:]], dim=2)
        v = torch.cat([self.v[:, :, :n].detach(), self.v[:, :, n:]], dim=2)
        return KV(k, v, self.pos, self.doc)


@dataclass
class DecoderState:
    """H_t = (s, C_t): the feedback vector and every decoder layer's window cache.

    ``s`` ``[B, d]`` is the feedback the *next* position merges in. With token
    recurrence (K=1) it is the last output s_t. With feedback blocks (K>1) it
    is the last output of the last *finished* block, which every position of
    the current block reads; it changes only at a block end. It is reset to
    the learned s_* at a document start.

    ``caches[l]`` holds at most W-1 entries of decoder layer ``l``'s window.
    """

    s: torch.Tensor
    caches: list[KV]

    def detach(self, s: bool = True, cache: bool = True) -> "DecoderState":
        return DecoderState(
            self.s.detach() if s else self.s,
            [c.detach() for c in self.caches] if cache else self.caches,
        )

    def state_dict(self) -> dict[str, torch.Tensor]:
        out = {"s": self.s}
        for i, c in enumerate(self.caches):
            out.update({f"cache.{i}.k": c.k, f"cache.{i}.v": c.v, f"cache.{i}.pos": c.pos, f"cache.{i}.doc": c.doc})
        return out

    @classmethod
    def from_state_dict(cls, sd: dict[str, torch.Tensor]) -> "DecoderState":
        n = sum(1 for key in sd if key.endswith(".k"))
        caches = [KV(sd[f"cache.{i}.k"], sd[f"cache.{i}.v"], sd[f"cache.{i}.pos"], sd[f"cache.{i}.doc"]) for i in range(n)]
        return cls(sd["s"], caches)
