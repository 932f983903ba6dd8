"""Does a trained RLT answer through its recurrence? Score it with the feedback switched off.

An RLT-1 can reach a state-tracking answer two ways: through the recurrence
(the decoder's last output merged into its next input) or as a function of
the whole input read from the encoder's memory, as RLT-0 and the Transformer
must. Accuracy alone does not say which. This loads the best weights of
recorded runs and scores the validation sets twice, as trained and with the
feedback merge's scale set to 0 (``u = e``: no state crosses positions, the
model is then an RLT-0 with these weights). An answer learned through the
recurrence falls to chance without it; one learned from the memory does not.

    python -m rlt_scale.experiments.feedback_probe \\
        --keys parity-rlt1_a1-fine-lr3e-3-s0,five_state-rlt1_a1-fine_lr10_near90-lr3e-3-s0

Lengths: the record's training length (its early-stopping split), the
curriculum's stages (their validation splits) and the protocol's
``val_lengths``; ``--lengths`` picks any (a longer one scores the validation
set of that length, seeded apart from every test set). Only validation
programs are read, never a test set. Output: one JSON (``--out``).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Optional

import torch

from rlt_scale.experiments.runs import accuracy, load_best, predictor
from rlt_scale.experiments.stage_ablation import probe_records
from rlt_scale.experiments.state_tracking import DEFAULT_PROTOCOL
from rlt_scale.experiments.task_sets import prepare_set, train_dir, val_dir, val_samples, val_seed


def validation_folder(proto: dict, task: str, length: int, log=print) -> Path:
    """Validation programs of ``length``: a training set's split (training length, curriculum stage), else the
    validation set of that length (seed :func:`~rlt_scale.experiments.state_tracking.val_seed`, prepared here
    if no selection has used it yet)."""
    spec = proto["tasks"][task]
    if length in (spec["train_length"], *spec.get("curriculum", [])):
        return train_dir(proto, task, length) / "eval"
    folder = val_dir(proto, task, length)
    prepare_set(task, folder, length, val_seed(length), val_samples(proto, length), log=log)
    return folder / "eval"


def probe(proto: dict, record: dict, lengths: list[int], log=print) -> dict:
    """Validation accuracy of ``record``'s best weights at ``lengths``, as trained and with no feedback."""
    task = record["task"]
    net = load_best(proto, record, task)
    if getattr(net, "merge", None) is None:
        raise SystemExit(f"{record['key']}: the model has no feedback merge to switch off (RLT-0 or a baseline)")
    net.eval()
    predict = predictor(net, rlt=True)
    scale = net.merge.scale
    result = {"key": record["key"], "feedback_scale": float(scale), "as_trained": {}, "feedback_off": {}}
    for length in lengths:
        folder = validation_folder(proto, task, length, log)
        result["as_trained"][str(length)] = accuracy(proto, task, predict, folder, length)
        with torch.no_grad():
            saved = scale.detach().clone()
            scale.zero_()
            try:
                result["feedback_off"][str(length)] = accuracy(proto, task, predict, folder, length)
            finally:
                scale.copy_(saved)
        log(f"  {record['key']} L={length}: as trained {result['as_trained'][str(length)]:.4f}, "
            f"feedback off {result['feedback_off'][str(length)]:.4f}")
    return result


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results", default="runs/experiments/state_tracking-final/results.json")
    p.add_argument("--keys", required=True, help="comma-separated record keys of --results (RLT-1 or RLT-2 runs)")
    p.add_argument("--lengths", help="comma-separated lengths (default: training length, curriculum, val_lengths)")
    p.add_argument("--protocol", default=DEFAULT_PROTOCOL)
    p.add_argument("--out", default="runs/experiments/feedback_probe.json")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    log = lambda *a: print(*a, flush=True)  # noqa: E731

    def probe_one(proto: dict, record: dict) -> dict:
        spec = proto["tasks"][record["task"]]
        lengths = ([int(x) for x in args.lengths.split(",")] if args.lengths else
                   sorted({*spec.get("curriculum", []), spec["train_length"], *spec.get("val_lengths", [])}))
        return probe(proto, record, lengths, log)

    probe_records(Path(args.results), args.keys, args.protocol, Path(args.out), probe_one, log)
    return 0


if __name__ == "__main__":
    sys.exit(main())
