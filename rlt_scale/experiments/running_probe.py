"""Where does a long program go wrong? Running-state accuracy by operation, on validation programs.

A model trained with the running loss (:mod:`rlt_scale.experiments.supervision`)
predicts the state after every operation, not only the answer. Final-state
accuracy at 128 operations says *that* a model fails there; the running
predictions say *where*: the first operation whose state is wrong. A model
that tracks the state but drifts with position fails late and at scattered
operations; one that learned a function of the training length fails right
after it. This loads the best weights of recorded runs and scores validation
programs (never a test set) at every running target:

    python -m rlt_scale.experiments.running_probe --results runs/experiments/m5ew/results.json \\
        --keys mod5-rlt1_a1-s1500-running-lr3e-3-s0 --lengths 128

Output (one JSON, ``--out``), per key and length: accuracy of the running
state in buckets of operations (``by_operation``), the final answer's
accuracy, the share of programs with no wrong state, and the quartiles of the
first wrong operation among those with one. Operation ``k`` is the state after
``k`` operations (``0``: the first digit or input read, where a task has one).
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Optional

import torch

from rlt_scale.experiments.curriculum import is_baseline
from rlt_scale.experiments.evaluate import ANSWER_TOKENS, batches_of
from rlt_scale.experiments.feedback_probe import validation_folder
from rlt_scale.experiments.runs import load_best
from rlt_scale.experiments.stage_ablation import probe_records
from rlt_scale.experiments.state_tracking import DEFAULT_PROTOCOL
from rlt_scale.experiments.supervision import target_fn
from rlt_scale.model.rlt import answer_predictions
from rlt_scale.training.bptt import run_sequence


def all_logits(net, rlt: bool):
    """``logits(tokens [B, T+1], doc_ids) -> [B, T, V]``: teacher-forced logits at every input position."""
    def logits(tokens, doc):
        net.eval()
        if rlt:
            return run_sequence(net, tokens, doc, torch.ones_like(tokens, dtype=torch.bool), want_logits=True).logits
        return net(tokens[:, :-1])
    return logits


def running_correct(logits: torch.Tensor, tokens: torch.Tensor, task: str) -> torch.Tensor:
    """``[B, S]`` bool: whether each running target (in program order, the answer last) is predicted right.

    Every program of a prepared set has one layout, so each row has the same ``S`` targets.
    """
    targets, valid = target_fn(task, "running")(tokens)
    if not bool((valid == valid[:1]).all()):
        raise ValueError("running_correct needs one program layout per batch (a prepared set of one length)")
    pred = answer_predictions(logits.float(), ANSWER_TOKENS[task])
    return (pred == targets)[:, valid[0]]


def summarise(correct: torch.Tensor, buckets: int = 8) -> dict:
    """Accuracy per bucket of operations, the answer's accuracy, and where the first wrong state falls.

    ``correct [N, S]``: the last column is the answer (the '=' position), the others the states after
    operations ``0 .. S-2`` (or ``1 .. S-1`` for tasks without an initial read; the index is what is reported).
    """
    states, n = correct[:, :-1], correct.shape[1] - 1
    edges = sorted({round(i * n / buckets) for i in range(buckets + 1)})
    by_op = {f"{a}-{b - 1}": float(states[:, a:b].double().mean()) for a, b in zip(edges, edges[1:])}
    wrong = ~states
    has_error = wrong.any(dim=1)
    first = wrong.float().argmax(dim=1)[has_error].tolist()
    quartiles = statistics.quantiles(first, n=4) if len(first) >= 2 else first
    return {"programs": int(correct.shape[0]), "states": n, "by_operation": by_op,
            "answer": float(correct[:, -1].double().mean()), "no_wrong_state": float((~has_error).double().mean()),
            "first_wrong_quartiles": [float(q) for q in quartiles]}


@torch.no_grad()
def probe(proto: dict, record: dict, lengths: list[int], batch_size: int = 64, log=print) -> dict:
    task = record["task"]
    net = load_best(proto, record, task)
    logits = all_logits(net, rlt=not is_baseline(record["config"]))
    result = {"key": record["key"], "lengths": {}}
    for length in lengths:
        rows = [running_correct(logits(b["tokens"], b["doc_ids"]), b["tokens"], task)
                for b in batches_of(str(validation_folder(proto, task, length, log)), batch_size)]
        result["lengths"][str(length)] = summary = summarise(torch.cat(rows))
        log(f"  {record['key']} L={length}: answer {summary['answer']:.4f}, no wrong state "
            f"{summary['no_wrong_state']:.4f}, first wrong (quartiles) {summary['first_wrong_quartiles']}, "
            f"by operation " + " ".join(f"{k}:{v:.3f}" for k, v in summary["by_operation"].items()))
    return result


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", required=True, help="results.json of a state-tracking run directory")
    p.add_argument("--keys", required=True, help="comma-separated record keys (runs trained with the running loss)")
    p.add_argument("--lengths", required=True, help="comma-separated lengths (validation programs)")
    p.add_argument("--protocol", default=DEFAULT_PROTOCOL)
    p.add_argument("--out", default="runs/experiments/running_probe.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    log = lambda *a: print(*a, flush=True)  # noqa: E731

    def probe_one(proto: dict, record: dict) -> dict:
        if record.get("supervision") != "running":
            raise SystemExit(f"{record['key']}: trained with supervision {record.get('supervision')!r}; the probe "
                             "reads running-state predictions, which only the running loss trains")
        return probe(proto, record, [int(x) for x in args.lengths.split(",")], log=log)

    probe_records(Path(args.results), args.keys, args.protocol, Path(args.out), probe_one, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
