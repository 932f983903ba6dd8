"""Final-state accuracy on a prepared synthetic task set.

Every task sample is ``[BOS] body... '=' answer`` and the answer (the last
token) is the only target (docs/DATA.md). A *predictor* maps a batch of
samples ``tokens [B, T+1]`` (with ``doc_ids`` and ``loss_mask``) to the
logits ``[B, V]`` of the position that predicts the last token, i.e. the
teacher-forced logits at input position ``T-1`` (the ``'='``). The answer is
never an input to that position, so teacher forcing is exact here.

The prediction is the argmax over the task's *answer tokens* (``'0'/'1'``
for parity and addition, ``'0'..'4'`` for five-state and mod-5 arithmetic, the
120 permutation tokens for S5): chance is then exactly 1/2, 1/5 and 1/120. Pass ``answer_tokens=None`` to take the argmax over the whole
vocabulary instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Optional, Sequence

import torch

from rlt_scale.data.config import DataConfig
from rlt_scale.data.loader import StreamingLoader
from rlt_scale.data.tasks import PERMUTATION_BASE, PERMUTATIONS
from rlt_scale.model.rlt import answer_predictions
from rlt_scale.training.bptt import BPTT, run_sequence

Predictor = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
"""``predict(tokens, doc_ids, loss_mask) -> logits [B, V]`` of the answer-predicting position."""

ANSWER_TOKENS = {
    "parity": tuple(ord(c) for c in "01"),
    "addition": tuple(ord(c) for c in "01"),
    "five_state": tuple(ord(c) for c in "01234"),
    "s5": tuple(range(PERMUTATION_BASE, PERMUTATION_BASE + len(PERMUTATIONS))),
    "s5_swaps": tuple(range(PERMUTATION_BASE, PERMUTATION_BASE + len(PERMUTATIONS))),
    "mod5": tuple(ord(c) for c in "01234"),
    "mod5_brackets": tuple(ord(c) for c in "01234"),
}
"""Token ids of the possible answers of each task."""


@dataclass
class Accuracy:
    correct: int
    total: int

    @property
    def accuracy(self) -> float:
        return self.correct / self.total if self.total else float("nan")

    def __add__(self, other: "Accuracy") -> "Accuracy":
        return Accuracy(self.correct + other.correct, self.total + other.total)


def predictions(logits: torch.Tensor, answer_tokens: Optional[Sequence[int]] = None) -> torch.Tensor:
    """Predicted token id per row of ``logits [B, V]``, restricted to ``answer_tokens`` when given."""
    if answer_tokens is None:
        return logits.argmax(dim=-1)
    return answer_predictions(logits, answer_tokens)


def batch_accuracy(predict: Predictor, batch: dict, answer_tokens: Optional[Sequence[int]] = None) -> Accuracy:
    """Accuracy on one batch; padding rows (no target at the last position) are skipped."""
    tokens, doc, mask = batch["tokens"], batch["doc_ids"], batch["loss_mask"]
    real = mask[:, -1].bool()
    if not bool(real.any()):
        return Accuracy(0, 0)
    tokens, doc, mask = tokens[real], doc[real], mask[real]
    logits = predict(tokens, doc, mask)
    if logits.dim() != 2 or logits.shape[0] != tokens.shape[0]:
        raise ValueError(f"a predictor returns logits [B, V] of the last position, got {tuple(logits.shape)}")
    pred = predictions(logits, answer_tokens)
    return Accuracy(int((pred == tokens[:, -1].to(pred.device)).sum()), int(tokens.shape[0]))


def batches_of(path: str, batch_size: int = 256) -> Iterable[dict]:
    """Every sample of the prepared set at ``path`` once, through the ordinary streaming loader."""
    loader = StreamingLoader(DataConfig(path=str(path)), batch_size=batch_size, path=str(path))
    return loader.iter_epoch_once()


@torch.no_grad()
def evaluate_accuracy(predict: Predictor, batches: Iterable[dict], answer_tokens: Optional[Sequence[int]] = None,
                      max_samples: Optional[int] = None) -> Accuracy:
    """Final-state accuracy of ``predict`` over ``batches`` (at most ``max_samples`` samples)."""
    total = Accuracy(0, 0)
    for batch in batches:
        if max_samples is not None and total.total >= max_samples:
            break
        if max_samples is not None:
            batch = {k: v[: max_samples - total.total] for k, v in batch.items()}
        total = total + batch_accuracy(predict, batch, answer_tokens)
    return total


def evaluate_path(predict: Predictor, path: str, answer_tokens: Optional[Sequence[int]] = None,
                  batch_size: int = 256, max_samples: Optional[int] = None) -> Accuracy:
    return evaluate_accuracy(predict, batches_of(path, batch_size), answer_tokens, max_samples)


def rlt_predictor(model, bptt: BPTT = BPTT(), device: Optional[torch.device] = None) -> Predictor:
    """The RLT's teacher-forced logits at the answer-predicting position (``run_sequence``, position T-1)."""
    device = device or next(model.parameters()).device

    def predict(tokens, doc, mask):
        model.eval()
        out = run_sequence(model, tokens.to(device), doc.to(device), mask.to(device), bptt, want_logits=True)
        return out.logits[:, -1].float()

    return predict


def module_predictor(model: torch.nn.Module, device: Optional[torch.device] = None) -> Predictor:
    """For a baseline whose ``forward(tokens [B, T])`` returns logits ``[B, T, V]``."""
    device = device or next(model.parameters()).device

    def predict(tokens, doc, mask):
        model.eval()
        return model(tokens[:, :-1].to(device))[:, -1].float()

    return predict
