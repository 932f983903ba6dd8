"""Which positions of a task program are trained: the final answer only, or the running state too.

A task sample is ``[BOS] op_1 ... op_L '=' answer`` (:mod:`rlt_scale.data.tasks`)
and its loss mask covers only the answer: the model is told the final state and
nothing else (``final`` supervision, the data's own targets). For parity this is
the hard version of the task: the gradient toward the answer is an L-th order
effect of the bits, and models sit at chance for a long time (docs/RESULTS.md).

``running`` supervision also trains, at the input position of every operation,
the state reached after that operation (parity: the parity of the prefix;
five-state: the state; addition: the carry out of the bits read so far, at the
``b_i`` positions only, since a carry is only known once both bits are read;
S5: the composed permutation so far; mod-5 arithmetic: the value of the
expression read so far at each digit, and with brackets the running value of
the innermost open level at each digit or ``')'`` that ends a term).
The targets are a pure function of the program, computed here from the tokens,
so the prepared shards stay as they are. The answer position keeps its
ordinary target, and evaluation stays final-state accuracy at that position.
It is a training choice, applied to every model alike when chosen.

Input position ``i`` (0-based, of ``tokens[:, :-1]``) holds ``op_i`` for
``1 <= i <= L`` and ``'='`` at ``L + 1``; its logits predict the target below.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from rlt_scale.data.tasks import OPERATORS, PERMUTATION_BASE, apply_operator, composition_table, transition_table

SUPERVISIONS = ("final", "running")

TargetFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""``targets(tokens [B, T+1]) -> (target ids [B, T], valid [B, T] bool)``, aligned with the model's logits."""


def _with_answer(body_targets: torch.Tensor, body_valid: torch.Tensor, tokens: torch.Tensor):
    """Place the body targets at input positions 1..L and the answer at the '=' position."""
    b, t = tokens.shape[0], tokens.shape[1] - 1
    targets = torch.zeros(b, t, dtype=torch.long, device=tokens.device)
    valid = torch.zeros(b, t, dtype=torch.bool, device=tokens.device)
    targets[:, 1:-1], valid[:, 1:-1] = body_targets, body_valid
    targets[:, -1], valid[:, -1] = tokens[:, -1], True
    return targets, valid


def parity_targets(tokens: torch.Tensor):
    bits = tokens[:, 1:-2] - ord("0")
    prefix = torch.cumsum(bits, dim=1) % 2
    return _with_answer(ord("0") + prefix, torch.ones_like(bits, dtype=torch.bool), tokens)


def five_state_targets(tokens: torch.Tensor, table_seed: int = 0):
    table = torch.as_tensor(transition_table(table_seed), device=tokens.device)
    actions = tokens[:, 1:-2] - ord("a")
    state = torch.zeros(len(tokens), dtype=torch.long, device=tokens.device)
    states = []
    for t in range(actions.shape[1]):
        state = table[actions[:, t], state]
        states.append(state)
    return _with_answer(ord("0") + torch.stack(states, dim=1), torch.ones_like(actions, dtype=torch.bool), tokens)


def addition_targets(tokens: torch.Tensor):
    body = tokens[:, 1:-2] - ord("0")
    a, b = body[:, 0::2], body[:, 1::2]
    carry = torch.zeros(len(tokens), dtype=torch.long, device=tokens.device)
    targets = torch.zeros_like(body)
    valid = torch.zeros_like(body, dtype=torch.bool)
    for i in range(a.shape[1]):
        carry = (a[:, i] + b[:, i] + carry) >> 1
        targets[:, 2 * i + 1], valid[:, 2 * i + 1] = carry, True  # known once b_i is read
    return _with_answer(ord("0") + targets, valid, tokens)


def s5_targets(tokens: torch.Tensor):
    table = torch.as_tensor(composition_table(), device=tokens.device)
    inputs = tokens[:, 1:-2] - PERMUTATION_BASE
    state = torch.zeros(len(tokens), dtype=torch.long, device=tokens.device)  # the identity
    states = []
    for t in range(inputs.shape[1]):
        state = table[inputs[:, t], state]
        states.append(state)
    return _with_answer(PERMUTATION_BASE + torch.stack(states, dim=1), torch.ones_like(inputs, dtype=torch.bool),
                        tokens)


def mod5_targets(tokens: torch.Tensor):
    """At each ``x_t`` (body positions 0, 2, 4, ...) the left-to-right value of ``x0 o1 .. x_t``."""
    body = tokens[:, 1:-2]
    digits = body[:, 0::2] - ord("0")
    ops = torch.zeros_like(body[:, 1::2])
    for i, c in enumerate(OPERATORS):
        ops[body[:, 1::2] == ord(c)] = i
    value = digits[:, 0]
    targets, valid = torch.zeros_like(body), torch.zeros_like(body, dtype=torch.bool)
    targets[:, 0], valid[:, 0] = value, True
    for t in range(ops.shape[1]):
        value = apply_operator(value, ops[:, t], digits[:, t + 1])
        targets[:, 2 * t + 2], valid[:, 2 * t + 2] = value, True
    return _with_answer(ord("0") + targets, valid, tokens)


def mod5_brackets_targets(tokens: torch.Tensor):
    """A stack machine per row: at each term's end (digit or ')'), the running value of its level."""
    body = tokens[:, 1:-2].tolist()
    targets = torch.zeros(tokens.shape[0], tokens.shape[1] - 3, dtype=torch.long)
    valid = torch.zeros_like(targets, dtype=torch.bool)
    for row, seq in enumerate(body):
        stack: list[list] = [[None, None]]  # per open level: [value so far, pending operator]
        for i, tok in enumerate(seq):
            ch = chr(tok)
            if ch == "(":
                stack.append([None, None])
                continue
            if ch in OPERATORS:
                stack[-1][1] = OPERATORS.index(ch)
                continue
            term = stack.pop()[0] if ch == ")" else int(ch)
            level = stack[-1]
            level[0] = term if level[0] is None else apply_operator(level[0], level[1], term)
            targets[row, i], valid[row, i] = level[0], True
    return _with_answer(ord("0") + targets.to(tokens.device), valid.to(tokens.device), tokens)


_RUNNING = {"parity": parity_targets, "five_state": five_state_targets, "addition": addition_targets,
            "s5": s5_targets, "s5_swaps": s5_targets, "mod5": mod5_targets, "mod5_brackets": mod5_brackets_targets}


def as_objective_targets(fn: TargetFn):
    """A token-level target function as the training loop's plug-in: ``batch -> (targets, valid)``."""
    return lambda batch: fn(batch["tokens"])


def target_fn(task: str, supervision: str) -> Optional[TargetFn]:
    """The running-state target function of ``task``, or None for the data's own (final answer) targets."""
    if supervision not in SUPERVISIONS:
        raise ValueError(f"supervision must be one of {SUPERVISIONS}, got {supervision!r}")
    return None if supervision == "final" else _RUNNING[task]
