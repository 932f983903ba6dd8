"""Where the state-tracking protocol's data sets live, which generator seed each one has, and their
one-time preparation.

Every set has a seed of its own: training ``train_seed`` (with its early-stopping
split), validation :func:`val_seed` at ``val_lengths`` (every choice), test
:func:`test_seed` at ``eval_lengths`` (scored once per row; a later
``test_round`` draws fresh programs for a recipe chosen after earlier test
figures were read). Processes that share a data root prepare it one at a time
(:func:`data_lock`).
"""

from __future__ import annotations

import contextlib
import fcntl
import shutil
import time
from pathlib import Path
from typing import Optional

from rlt_scale.data.prepare import prepare_task
from rlt_scale.data.tasks import MIN_PACKED_LENGTH


def _ready(path: Path) -> bool:
    return (path / "index.json").exists()


def train_dir(proto: dict, task: str, length: Optional[int] = None) -> Path:
    """Training set of ``task`` at ``length`` (default the training length; others are curriculum stages)."""
    spec = proto["tasks"][task]
    length = length or spec["train_length"]
    mix = "-mix" if packed_row_tokens(spec, length) else ""
    return Path(proto["data_root"]) / task / f"train-L{length}-n{spec['train_samples']}-s{proto['train_seed']}{mix}"


def packed_row_tokens(spec: dict, length: int) -> int:
    """With the task's ``mixed_lengths``, a training set of ``length`` >= 6 holds rows of ``2 * (length + 3)``
    tokens of packed programs of lengths 1..length (:func:`rlt_scale.data.tasks.packed`); else 0."""
    return 2 * (length + 3) if spec.get("mixed_lengths") and length >= MIN_PACKED_LENGTH else 0


def eval_samples(proto: dict, length: int, task: Optional[str] = None) -> int:
    """Test programs at ``length``: ``eval_samples``, or fewer for the long lengths of ``eval_samples_at``.

    Evaluating the RLT costs O(T^2) per program (every position reads the
    memory), so a 2048-operation test set is cut to keep the table's budget.
    A task's own ``eval_samples_at`` (long-token tasks: mod 5) comes first.
    """
    own = (proto["tasks"].get(task, {}).get("eval_samples_at") or {}) if task else {}
    return int(own.get(length, (proto.get("eval_samples_at") or {}).get(length, proto["eval_samples"])))


def test_dir(proto: dict, task: str, length: int) -> Path:
    """The test programs of ``length`` are in ``test_dir/eval`` (addition buckets: ``test_dir/eval-carry-CC``);
    a later ``test_round``'s sets in a folder of their own (``-rN``)."""
    round_ = test_round(proto)
    return Path(proto["data_root"]) / task / (f"test-L{length}-n{eval_samples(proto, length, task)}"
                                              + (f"-r{round_}" if round_ else ""))


def test_round(proto: dict) -> int:
    """The protocol's ``test_round`` (default 0): which generation of test sets a row is scored on.

    A test set is scored once per row; a new recipe chosen after its rows' test
    figures were read is scored on a later round, programs no earlier choice has seen.
    """
    round_ = proto.get("test_round", 0)
    if isinstance(round_, bool) or not isinstance(round_, int) or not 0 <= round_ < MAX_TEST_ROUNDS:
        raise ValueError(f"test_round: expected an integer in [0, {MAX_TEST_ROUNDS}), got {round_!r}")
    return round_


def val_samples(proto: dict, length: int) -> int:
    """Validation programs at ``length``: ``val_long_samples``, or fewer for the lengths of ``val_samples_at``."""
    return int((proto.get("val_samples_at") or {}).get(length, proto["val_long_samples"]))


def val_dir(proto: dict, task: str, length: int) -> Path:
    """The validation programs of ``length`` (for selection) are in ``val_dir/eval``."""
    return Path(proto["data_root"]) / task / f"val-L{length}-n{val_samples(proto, length)}"


MAX_TEST_ROUNDS, TEST_ROUND_STRIDE = 100, 10_000


def test_seed(length: int, round_: int = 0) -> int:
    """Test sets use generator seeds of their own, never used for training or validation: round ``r`` of
    length ``L`` is ``1_000_003 + 10_000 r + L``, below every validation seed for r < 100 and L < 10,000."""
    if not 0 <= length < TEST_ROUND_STRIDE or not 0 <= round_ < MAX_TEST_ROUNDS:
        raise ValueError(f"test sets: length {length} and round {round_} must be in [0, {TEST_ROUND_STRIDE}) "
                         f"and [0, {MAX_TEST_ROUNDS})")
    return 1_000_003 + TEST_ROUND_STRIDE * round_ + length


def val_seed(length: int) -> int:
    """Validation sets (every selection and probe) use seeds apart from the test and training seeds."""
    return 2_000_003 + length


def prepare_set(task: str, out: Path, length: int, seed: int, samples: int, buckets=None, log=print) -> None:
    """One evaluation set: ``samples`` programs of ``length`` from generator ``seed`` in ``out/eval`` (and the
    addition ``buckets`` of carry chains in ``out/eval-carry-CC``), unless already there."""
    names = ["eval"] + [f"eval-carry-{c:02d}" for c in (buckets or [])]
    if all(_ready(out / n) for n in names):
        return
    start = time.perf_counter()
    shutil.rmtree(out, ignore_errors=True)
    prepare_task(task, out, 1, length, seed, eval_samples=samples, eval_length=length, carry_buckets=buckets)
    log(f"prepared {out} ({samples} programs, seed {seed}) in {time.perf_counter() - start:.1f}s")


@contextlib.contextmanager
def file_lock(path: Path):
    """Hold an exclusive flock on ``path`` (created with its folder): one process at a time, across processes
    (and across open files within one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def data_lock(proto: dict, task: str):
    """``DATA_ROOT/TASK/.prepare.lock``: processes that share a data root prepare its sets one at a time
    (two writing one set clobber each other's shards), and a waiting one finds the sets ready."""
    return file_lock(Path(proto["data_root"]) / task / ".prepare.lock")


def prepare_data(proto: dict, task: str, log=print) -> None:
    """Prepare (once) the training sets (curriculum stages included), the validation sets and the test sets."""
    with data_lock(proto, task):
        _prepare_all(proto, task, log)


def _prepare_all(proto: dict, task: str, log) -> None:
    spec = proto["tasks"][task]
    for length in [*spec.get("curriculum", []), spec["train_length"]]:
        out = train_dir(proto, task, length)
        if _ready(out) and _ready(out / "eval"):
            continue
        start = time.perf_counter()
        shutil.rmtree(out, ignore_errors=True)
        prepare_task(task, out, spec["train_samples"], length, proto["train_seed"],
                     eval_samples=proto["val_samples"], carry_buckets=[],
                     packed_row_tokens=packed_row_tokens(spec, length))
        log(f"prepared {out} ({spec['train_samples']} + {proto['val_samples']} val) in {time.perf_counter() - start:.1f}s")
    for length in spec.get("val_lengths", []):
        prepare_set(task, val_dir(proto, task, length), length, val_seed(length), val_samples(proto, length), log=log)
    buckets = spec.get("carry_buckets", []) if task == "addition" else []
    for length in spec["eval_lengths"]:
        prepare_set(task, test_dir(proto, task, length), length, test_seed(length, test_round(proto)),
                 eval_samples(proto, length, task), [c for c in buckets if c <= length] or None, log=log)


def seq_len_of(task: str, length: int) -> int:
    """Input positions of one program of ``length`` operations (the format of rlt_scale.data.tasks)."""
    if task == "addition":
        return 2 * length + 2
    if task == "mod5":
        return 2 * length + 3
    if task == "mod5_brackets":
        return 2 * length + 3 + 2 * (length // 4)
    return length + 2
