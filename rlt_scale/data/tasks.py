"""Synthetic state-tracking tasks: parity, five-state transitions and binary addition.

Each task is a seeded generator that returns every sample of a dataset as one
array. They share one token format, written with the byte tokenizer's ids so a
sample reads as text and the model's vocabulary is the usual 259::

    [BOS] body... '=' answer

* ``BOS`` is id 256, ``'='`` is the byte 61, every other token a printable ASCII byte;
* the answer is one token, the last of the sample, and is the only prediction
  target (``loss_mask`` is True only at the final position);
* every sample of a dataset has the same length, so ``seq_len = len(body) + 2``
  and there is no padding and one document per sample.

Tasks (``L`` is the length argument):

``parity``      body: ``L`` bits ``'0'/'1'``; answer ``'0'/'1'``: the number of ones mod 2.
                ``seq_len = L + 2``.
``five_state``  body: ``L`` actions ``'a'..'e'``; answer ``'0'..'4'``: the state reached from
                state 0 by applying the actions left to right through a fixed transition table.
                Each action permutes the five states (the table comes from ``table_seed``, the
                same for train and eval), so no action forgets the state and the answer depends
                on every action: a word problem over a group, not a counter. ``seq_len = L + 2``.
``addition``    body: two ``L``-bit numbers ``a`` and ``b``, interleaved least significant bit
                first: ``a0 b0 a1 b1 ... a(L-1) b(L-1)``; answer ``'0'/'1'``: the carry out of
                ``a + b`` (bit ``L`` of the sum). ``seq_len = 2L + 2``.

Carry chains (addition): reading down from the top bit, the carry out is decided
by the first position that is not a *propagate* (``a_i != b_i``): a *generate*
(``a_i = b_i = 1``) makes it 1, a *kill* (``a_i = b_i = 0``) makes it 0. The
**carry chain** of a sample is that number of positions, ``1 + `` the run of
propagates at the top (``L + 1`` when every position propagates: no carry
enters, the answer is 0). For a carry out of 1 it is exactly the length of the
carry chain that produces it; in general the model must carry information
across that many bit positions. Random operands have chain ``c`` with
probability ``2**-c``, so training sees few long chains; the evaluation
buckets (``addition(..., carry_chain=c)``) hold only chain ``c`` with answers
balanced 50/50, to test whether more recurrence fixes longer carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rlt_scale.data.tokenizer import ByteTokenizer
from rlt_scale.errors import ConfigError

BOS = ByteTokenizer.bos_id
EQUALS = ord("=")
NUM_STATES = 5
NUM_ACTIONS = 5
TASKS = ("parity", "five_state", "addition")


@dataclass
class TaskSet:
    """All samples of one synthetic dataset."""

    tokens: np.ndarray
    """``[n, seq_len + 1]`` int64 in the format above."""
    answers: np.ndarray
    """``[n]`` the answer as a number (parity bit, final state, carry out)."""
    meta: dict = field(default_factory=dict)
    """Task parameters, recorded in the dataset index."""
    carry_chains: np.ndarray | None = None
    """``[n]`` carry chain of each sample (addition only)."""

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1] - 1

    @property
    def loss_mask(self) -> np.ndarray:
        """``[seq_len + 1]`` bool: the answer is the only target."""
        mask = np.zeros(self.tokens.shape[1], dtype=bool)
        mask[-1] = True
        return mask


def _assemble(body: np.ndarray, answer_tokens: np.ndarray) -> np.ndarray:
    n = len(body)
    return np.concatenate([np.full((n, 1), BOS), body, np.full((n, 1), EQUALS), answer_tokens[:, None]],
                          axis=1).astype(np.int64)


def _check(num_samples: int, length: int) -> None:
    if num_samples < 1:
        raise ConfigError("num_samples", f"expected >= 1, got {num_samples}")
    if length < 1:
        raise ConfigError("length", f"expected >= 1, got {length}")


def parity(num_samples: int, length: int, seed: int) -> TaskSet:
    """Uniform random bit strings; the answer is their parity."""
    _check(num_samples, length)
    bits = np.random.default_rng(seed).integers(0, 2, size=(num_samples, length))
    answers = bits.sum(axis=1) % 2
    return TaskSet(_assemble(ord("0") + bits, ord("0") + answers), answers,
                   {"task": "parity", "length": length, "seed": seed})


def transition_table(table_seed: int = 0) -> np.ndarray:
    """``table[action, state]`` is the next state; each action is a random permutation of the states."""
    rng = np.random.default_rng([table_seed, 5])
    return np.stack([rng.permutation(NUM_STATES) for _ in range(NUM_ACTIONS)])


def five_state(num_samples: int, length: int, seed: int, table_seed: int = 0) -> TaskSet:
    """Uniform random action sequences from state 0; the answer is the final state."""
    _check(num_samples, length)
    table = transition_table(table_seed)
    actions = np.random.default_rng(seed).integers(0, NUM_ACTIONS, size=(num_samples, length))
    state = np.zeros(num_samples, dtype=np.int64)
    for t in range(length):
        state = table[actions[:, t], state]
    return TaskSet(_assemble(ord("a") + actions, ord("0") + state), state,
                   {"task": "five_state", "length": length, "seed": seed, "table_seed": table_seed,
                    "start_state": 0, "table": table.tolist()})


def carry_chains(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Carry chain of each row of the bit arrays ``a``, ``b`` (``[n, L]``, least significant bit first)."""
    propagate = a != b
    top_run = np.argmin(propagate[:, ::-1], axis=1)  # first non-propagate from the top
    top_run[propagate.all(axis=1)] = a.shape[1]
    return top_run + 1


def addition(num_samples: int, length: int, seed: int, carry_chain: int | None = None) -> TaskSet:
    """Random ``length``-bit operands; with ``carry_chain=c`` every sample has carry chain exactly ``c``.

    For a bucket the ``c - 1`` top positions are drawn as propagates, the position
    below them as a generate or a kill with equal probability (so answers are
    balanced), and the bits below that uniformly: they cannot change the answer.
    """
    _check(num_samples, length)
    rng = np.random.default_rng(seed)
    a = rng.integers(0, 2, size=(num_samples, length))
    b = rng.integers(0, 2, size=(num_samples, length))
    if carry_chain is not None:
        if not 1 <= carry_chain <= length:
            raise ConfigError("carry_chain", f"expected 1..{length} for {length}-bit operands, got {carry_chain}")
        top = length - carry_chain + 1
        b[:, top:] = 1 - a[:, top:]  # propagates
        decider = rng.integers(0, 2, size=num_samples)  # 1: generate, 0: kill
        a[:, top - 1] = b[:, top - 1] = decider
    carry = np.zeros(num_samples, dtype=np.int64)
    for i in range(length):
        carry = (a[:, i] + b[:, i] + carry) >> 1
    body = np.empty((num_samples, 2 * length), dtype=np.int64)
    body[:, 0::2], body[:, 1::2] = ord("0") + a, ord("0") + b
    meta = {"task": "addition", "length": length, "seed": seed, "bit_order": "lsb_first_interleaved"}
    if carry_chain is not None:
        meta["carry_chain"] = carry_chain
    return TaskSet(_assemble(body, ord("0") + carry), carry, meta, carry_chains(a, b))


def generate(task: str, num_samples: int, length: int, seed: int, **options) -> TaskSet:
    """Dispatch by name: ``generate("five_state", 1000, 32, seed=0, table_seed=0)``."""
    generators = {"parity": parity, "five_state": five_state, "addition": addition}
    if task not in generators:
        raise ConfigError("task", f"expected one of {TASKS}, got {task!r}")
    return generators[task](num_samples, length, seed, **options)
