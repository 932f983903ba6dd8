"""The running probe finds the first wrong state where it is, from logits at every position."""

import pytest
import torch

from rlt_scale.data.tasks import generate
from rlt_scale.experiments.running_probe import running_correct, summarise
from rlt_scale.experiments.supervision import target_fn


def _oracle_logits(tokens: torch.Tensor, task: str, vocab: int = 259) -> torch.Tensor:
    """Logits that put all mass on the running target at every target position (and on token 0 elsewhere)."""
    targets, _ = target_fn(task, "running")(tokens)
    return torch.nn.functional.one_hot(targets, vocab).double()


@pytest.mark.parametrize("task, states", [("mod5", 7), ("parity", 6), ("five_state", 6)])
def test_an_oracle_is_right_at_every_state_and_one_wrong_state_is_found_where_it_is(task, states):
    tokens = torch.as_tensor(generate(task, 16, 6, seed=3).tokens)
    logits = _oracle_logits(tokens, task)
    correct = running_correct(logits, tokens, task)
    assert correct.shape == (16, states + 1) and bool(correct.all())  # the states, then the answer
    # corrupt row 5's state after operation 3 (mod-5: its 4th digit position) and row 9's answer only
    targets, valid = target_fn(task, "running")(tokens)
    positions = valid[0].nonzero().flatten()
    for row, col in ((5, 3), (9, states)):
        p = positions[col]
        logits[row, p] = 0
        logits[row, p, ord("0") if int(targets[row, p]) != ord("0") else ord("1")] = 1
    summary = summarise(running_correct(logits, tokens, task), buckets=2)
    assert summary["states"] == states and summary["answer"] == 15 / 16
    assert summary["no_wrong_state"] == 15 / 16  # row 9's wrong answer is not a wrong state
    assert summary["first_wrong_quartiles"] == [3.0]
    for name, acc in summary["by_operation"].items():  # buckets "a-b" of states; row 5's error is in state 3's
        a, b = map(int, name.split("-"))
        assert acc == (1 - 1 / (16 * (b - a + 1)) if a <= 3 <= b else 1.0), name
    assert sum(b - a + 1 for a, b in (map(int, k.split("-")) for k in summary["by_operation"])) == states


def test_a_batch_of_mixed_layouts_is_refused():
    a = torch.as_tensor(generate("mod5_brackets", 8, 8, seed=1).tokens)
    with pytest.raises(ValueError, match="one program layout"):
        running_correct(_oracle_logits(a, "mod5_brackets"), a, "mod5_brackets")
