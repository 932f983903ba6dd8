"""Synthetic state-tracking tasks: parity, five-state, addition, the S5 word problem, arithmetic mod 5.

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

``s5``          body: ``L`` permutations of 5 elements, one token each; answer: their composition
                (the permutation reached from the identity applying them left to right), one of
                120 tokens. A permutation's token is ``128 + `` its index in lexicographic order
                (``PERMUTATIONS``), so inputs and answers share one vocabulary. Chance: 1/120.
``s5_swaps``    the same with only the 10 transpositions as inputs (the "swaps" variant): every
                input swaps two elements. ``seq_len = L + 2`` for both.
``mod5``        body: ``x0 o1 x1 ... oL xL``, digits ``'0'..'4'`` and operators ``'+' '-' '*'``, with
                ``L`` operators; answer: the value evaluated **left to right** mod 5 (no precedence:
                the running value is the state, each ``o x`` pair an action on it).
                ``seq_len = 2L + 3``.
``mod5_brackets``  the same grammar with round brackets: ``expr := term (op term)*``, ``term :=
                digit | '(' expr ')'``; a bracket is evaluated first, each level left to right.
                Exactly ``L // 4`` bracket pairs, placed by :func:`_bracketed` (random nesting), so
                every sample has ``seq_len = 2L + 3 + 2 * (L // 4)``.

S5 and arithmetic mod 5 follow the usual definitions of these tasks (the S5
word problem of the state-tracking literature; modular arithmetic with and
without brackets of the Chomsky-hierarchy benchmarks), in this token format;
"length" is always the number of operations (permutations, operators).

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

import itertools
from dataclasses import dataclass, field

import numpy as np

from rlt_scale.data.tokenizer import ByteTokenizer
from rlt_scale.errors import ConfigError

BOS = ByteTokenizer.bos_id
EQUALS = ord("=")
NUM_STATES = 5
NUM_ACTIONS = 5
TASKS = ("parity", "five_state", "addition", "s5", "s5_swaps", "mod5", "mod5_brackets")
PERMUTATIONS = np.array(list(itertools.permutations(range(5))), dtype=np.int64)
"""``[120, 5]``: the elements of S5 in lexicographic order; row 0 is the identity."""
PERMUTATION_BASE = 128
"""Token id of permutation 0; permutation ``i`` is token ``128 + i`` (bytes above ASCII)."""
OPERATORS = "+-*"


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
    doc_ids: np.ndarray | None = None
    """``[n, seq_len + 1]`` document of each token, for rows of packed programs (:func:`packed`); else None."""
    masks: np.ndarray | None = None
    """``[n, seq_len + 1]`` the answer tokens of each row of packed programs; else None (:attr:`loss_mask`)."""

    @property
    def seq_len(self) -> int:
        return self.tokens.shape[1] - 1

    @property
    def loss_mask(self) -> np.ndarray:
        """``[seq_len + 1]`` bool: the answer is the only target (rows of packed programs: see ``masks``)."""
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


def _permutation_index() -> dict[tuple[int, ...], int]:
    return {tuple(p): i for i, p in enumerate(PERMUTATIONS.tolist())}


def composition_table() -> np.ndarray:
    """``table[a, b]`` is the index of ``PERMUTATIONS[a]`` applied after ``PERMUTATIONS[b]`` (``a ∘ b``)."""
    index = _permutation_index()
    return np.array([[index[tuple(pa[pb])] for pb in PERMUTATIONS] for pa in PERMUTATIONS], dtype=np.int64)


def swap_indices() -> np.ndarray:
    """Indices (into ``PERMUTATIONS``) of the 10 transpositions."""
    moved = (PERMUTATIONS != np.arange(5)).sum(axis=1)
    return np.flatnonzero(moved == 2)


def s5(num_samples: int, length: int, seed: int, swaps_only: bool = False) -> TaskSet:
    """Uniform random permutations (or transpositions); the answer is their composition."""
    _check(num_samples, length)
    alphabet = swap_indices() if swaps_only else np.arange(len(PERMUTATIONS))
    inputs = alphabet[np.random.default_rng(seed).integers(0, len(alphabet), size=(num_samples, length))]
    table = composition_table()
    state = np.zeros(num_samples, dtype=np.int64)  # the identity
    for t in range(length):
        state = table[inputs[:, t], state]
    name = "s5_swaps" if swaps_only else "s5"
    return TaskSet(_assemble(PERMUTATION_BASE + inputs, PERMUTATION_BASE + state), state,
                   {"task": name, "length": length, "seed": seed, "order": "left_to_right",
                    "token_base": PERMUTATION_BASE})


def apply_operator(value, op, digit):
    """``value op digit`` mod 5 for operator indices ``op`` into ``OPERATORS``: ints, numpy or torch alike."""
    return ((value + digit) * (op == 0) + (value - digit) * (op == 1) + (value * digit) * (op == 2)) % 5


def _fold(values: list[int], ops: list[int]) -> int:
    value = values[0]
    for op, digit in zip(ops, values[1:]):
        value = apply_operator(value, op, digit)
    return value


def _bracketed(digits: list[int], ops: list[int], pairs: int, rng: np.random.Generator) -> tuple[list[int], int]:
    """Tokens and value of one expression with exactly ``pairs`` random bracket pairs.

    The sequence starts as ``L + 1`` units (digits) joined by operators; each
    step wraps a random run of 2-4 adjacent units into one bracketed unit, so
    later brackets may enclose earlier ones (random nesting depth).
    """
    units = [([ord("0") + d], d) for d in digits]
    ops = list(ops)
    for left in range(pairs, 0, -1):
        longest = min(4, len(units) - left + 1)  # leave enough units for the remaining pairs
        run = int(rng.integers(2, longest + 1))
        i = int(rng.integers(0, len(units) - run + 1))
        group, inner = units[i:i + run], ops[i:i + run - 1]
        tokens = [ord("(")] + group[0][0]
        for op, (toks, _) in zip(inner, group[1:]):
            tokens += [ord(OPERATORS[op])] + toks
        units[i:i + run] = [(tokens + [ord(")")], _fold([v for _, v in group], inner))]
        del ops[i:i + run - 1]
    out = units[0][0]
    for op, (toks, _) in zip(ops, units[1:]):
        out = out + [ord(OPERATORS[op])] + toks
    return out, _fold([v for _, v in units], ops)


def mod5(num_samples: int, length: int, seed: int, brackets: bool = False) -> TaskSet:
    """Random digits and operators mod 5, evaluated left to right (brackets first when ``brackets``)."""
    _check(num_samples, length)
    rng = np.random.default_rng(seed)
    digits = rng.integers(0, 5, size=(num_samples, length + 1))
    ops = rng.integers(0, len(OPERATORS), size=(num_samples, length))
    if brackets:
        rows = [_bracketed(d, o, length // 4, rng) for d, o in zip(digits.tolist(), ops.tolist())]
        body = np.array([r[0] for r in rows], dtype=np.int64)
        answers = np.array([r[1] for r in rows], dtype=np.int64)
    else:
        answers = digits[:, 0].copy()
        for t in range(length):
            answers = apply_operator(answers, ops[:, t], digits[:, t + 1])
        body = np.empty((num_samples, 2 * length + 1), dtype=np.int64)
        body[:, 0::2] = ord("0") + digits
        body[:, 1::2] = np.array([ord(c) for c in OPERATORS])[ops]
    name = "mod5_brackets" if brackets else "mod5"
    meta = {"task": name, "length": length, "seed": seed, "order": "left_to_right"}
    if brackets:
        meta["bracket_pairs"] = length // 4
    return TaskSet(_assemble(body, ord("0") + answers), answers, meta)


def generate(task: str, num_samples: int, length: int, seed: int, **options) -> TaskSet:
    """Dispatch by name: ``generate("five_state", 1000, 32, seed=0, table_seed=0)``."""
    generators = {"parity": parity, "five_state": five_state, "addition": addition, "s5": s5,
                  "s5_swaps": lambda n, L, seed: s5(n, L, seed, swaps_only=True), "mod5": mod5,
                  "mod5_brackets": lambda n, L, seed: mod5(n, L, seed, brackets=True)}
    if task not in generators:
        raise ConfigError("task", f"expected one of {TASKS}, got {task!r}")
    return generators[task](num_samples, length, seed, **options)


PACKABLE = ("parity", "five_state", "s5", "s5_swaps")
"""Tasks whose program of ``l`` operations is ``l + 3`` tokens (``[BOS] body '=' answer``): :func:`packed` fills
rows of them exactly."""
MIN_PACKED_LENGTH = 6
"""The shortest ``max_length`` :func:`packed` takes: its exact fill needs room to move a program's length."""


def packed(task: str, num_rows: int, max_length: int, row_tokens: int, seed: int, **options) -> TaskSet:
    """Rows of ``row_tokens`` tokens, each a run of whole programs of ``task`` with lengths drawn from
    ``1..max_length``, one document each; every program's answer is a target.

    Why: trained at one length, a model can learn the answer as a function of that length (parity's RLT-1
    answers 32-operation programs from its memory, not its recurrence; docs/RESULTS.md). Programs of every
    length up to ``max_length`` in one batch leave no single length to fit. Each length is drawn uniformly;
    a row's last program takes the room that is left, and a draw that would leave 1-3 tokens (too few for a
    program) is moved by that many, so rows hold no padding. ``answers`` is each row's last answer.
    """
    if task not in PACKABLE:
        raise ConfigError("task", f"packed programs need one of {PACKABLE}, got {task!r}")
    if max_length < MIN_PACKED_LENGTH:
        raise ConfigError("length", f"packed programs need a length >= {MIN_PACKED_LENGTH}, got {max_length}")
    if row_tokens < max_length + 3:
        raise ConfigError("row_tokens", f"expected >= length + 3 = {max_length + 3}, got {row_tokens}")
    _check(num_rows, max_length)
    rng = np.random.default_rng([seed, 7])
    layout: list[list[int]] = []  # per row: the lengths of its programs, in order
    for _ in range(num_rows):
        lengths, room = [], row_tokens
        while room:
            length = min(int(rng.integers(1, max_length + 1)), room - 3)
            rest = room - length - 3
            if 0 < rest < 4:  # too little left for a program: grow this one, or shrink it to leave room for one
                length = length + rest if length + rest <= max_length else length - (4 - rest)
            lengths.append(length)
            room -= length + 3
        layout.append(lengths)
    # every program of one length comes from one call of the generator, seeded per length
    needed = np.bincount([length for row in layout for length in row], minlength=max_length + 1)
    programs = {length: generate(task, int(count), length, int(np.random.SeedSequence([seed, 8, length])
                                                                 .generate_state(1)[0]), **options)
                for length, count in enumerate(needed) if count}
    taken = dict.fromkeys(programs, 0)
    tokens = np.empty((num_rows, row_tokens), dtype=np.int64)
    docs = np.empty_like(tokens)
    masks = np.zeros(tokens.shape, dtype=bool)
    answers = np.empty(num_rows, dtype=np.int64)
    for r, lengths in enumerate(layout):
        at = 0
        for doc, length in enumerate(lengths):
            program = programs[length].tokens[taken[length]]
            answers[r] = programs[length].answers[taken[length]]
            taken[length] += 1
            tokens[r, at:at + length + 3], docs[r, at:at + length + 3] = program, doc
            masks[r, at + length + 2] = True
            at += length + 3
    meta = {"task": task, "packed": True, "max_length": max_length, "row_tokens": row_tokens, "seed": seed,
            "programs": int(needed.sum()), "length_counts": needed.tolist(), **options}
    return TaskSet(tokens, answers, meta, doc_ids=docs, masks=masks)
