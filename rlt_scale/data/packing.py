"""Pack variable-length documents into fixed-length samples.

Documents are concatenated into one token stream, each followed by EOS, and
the stream is cut into samples of ``seq_len + 1`` tokens that overlap by one
token: sample ``k`` covers stream positions ``k*seq_len .. k*seq_len + seq_len``.
The trainer predicts ``tokens[1:]`` from ``tokens[:-1]``, so with the overlap
every token after the very first is a prediction target exactly once.

Per token the packer also keeps

* ``doc_ids``: the index of the token's document *inside the sample*
  (0 for the document the sample starts in, then 1, 2, ...), which is what the
  model needs to reset its recurrent state and attention at a document start;
* ``loss_mask``: whether the token is a prediction target (all True for plain
  text; for SFT only the response and its EOS).

The stream's tail is padded to a full sample with PAD tokens that are masked
out and form a document of their own, so no text is dropped.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np


@dataclass
class PackedSample:
    tokens: np.ndarray
    """``[seq_len + 1]`` token ids."""
    doc_ids: np.ndarray
    """``[seq_len + 1]`` int64, 0 for the first document in the sample, +1 at each document start."""
    loss_mask: np.ndarray
    """``[seq_len + 1]`` bool, True where the token counts as a prediction target."""


class Packer:
    """Turns a stream of documents into PackedSamples; feed with :meth:`add`, end with :meth:`finish`."""

    def __init__(self, seq_len: int, eos_id: int, pad_id: int):
        if seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {seq_len}")
        self.seq_len, self.eos_id, self.pad_id = seq_len, eos_id, pad_id
        self._parts: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        self._length = 0
        self._next_doc = 0

    def add(self, tokens: np.ndarray, loss_mask: np.ndarray | None = None) -> Iterator[PackedSample]:
        """Append one document (EOS is added here) and yield every sample it completes."""
        tokens = np.append(np.asarray(tokens, dtype=np.int64), self.eos_id)
        mask = np.ones(len(tokens), dtype=bool)
        if loss_mask is not None:
            mask[:-1] = loss_mask  # the EOS stays a target: the model must learn where a document ends
        docs = np.full(len(tokens), self._next_doc, dtype=np.int64)
        self._next_doc += 1
        self._parts.append((tokens, docs, mask))
        self._length += len(tokens)
        if self._length > self.seq_len:
            yield from self._cut()

    def finish(self) -> Iterator[PackedSample]:
        """Pad the remaining tokens (if any besides the overlap token) to one last sample."""
        if self._length > 1:
            pad = self.seq_len + 1 - self._length
            self._parts.append((np.full(pad, self.pad_id, dtype=np.int64),
                                np.full(pad, self._next_doc, dtype=np.int64), np.zeros(pad, dtype=bool)))
            self._length += pad
            yield from self._cut()
        self._parts, self._length = [], 0

    def _cut(self) -> Iterator[PackedSample]:
        tokens, docs, mask = (np.concatenate(column) for column in zip(*self._parts))
        n_samples = (len(tokens) - 1) // self.seq_len
        for k in range(n_samples):
            window = slice(k * self.seq_len, k * self.seq_len + self.seq_len + 1)
            sample_docs = docs[window]
            yield PackedSample(tokens[window], sample_docs - sample_docs[0], mask[window])
        rest = n_samples * self.seq_len  # the last sample's final token starts the next sample
        self._parts = [(tokens[rest:], docs[rest:], mask[rest:])]
        self._length = len(tokens) - rest
