"""The ring pipeline under NCCL's point-to-point rules, checked on CPU (issue #17, item 1).

NCCL does not buffer sends, and one rank's operations towards one peer run
in order: a ring that queues sends ahead of the receive its peer waits on
deadlocks on GPUs, while gloo, which buffers sends on the host, hides it.
At PP=2 the previous and the next stage are the same rank, so the ring
that sent each micro-batch's first input up front deadlocked there with
M >= 2. ``tests/strict_p2p.py`` is a test double with NCCL's rules (see its
docstring); the first test checks the double against that behaviour, the
second runs the ring under it.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import torchrun

pytestmark = pytest.mark.slow


def test_strict_double_deadlocks_where_nccl_does(tmp_path):
    """Two ranks that each isend and then recv from the other: gloo completes, NCCL (and the double)
    deadlock; the same operations as one batch_isend_irecv group per rank complete under the double."""
    out = tmp_path / "check.pt"
    torchrun("tests/workers/strict_p2p_check.py", 2, [str(out)], timeout=120)
    for rank in (0, 1):
        got = torch.load(f"{out}.rank{rank}", weights_only=True)
        assert got == {"gloo": "ok", "strict_unbatched": "deadlock", "strict_batched": "ok"}, (rank, got)


SPECS = {  # PP: what else varies (K, chunks, checkpointing); M = 1, 2, 4 each time
    2: {"tokens": 5, "feedback_block": 1, "chunk": 3},
    4: {"tokens": 6, "feedback_block": 2, "chunk": 4, "checkpoint": True},
}


@pytest.mark.parametrize("pp", sorted(SPECS))
def test_ring_runs_under_nccl_point_to_point_rules(tmp_path, pp):
    """Forward, backward and evaluation of the ring complete at M = 1, 2, 4 micro-batches under the
    strict double (a wait that does not complete in 30 s is a deadlock) and equal one process (float64)."""
    out = tmp_path / "ring.pt"
    spec = {**SPECS[pp], "micro": [1, 2, 4], "strict": True, "strict_timeout": 30}
    proc = torchrun("tests/workers/ring_strict.py", pp, [str(out), json.dumps(spec)], timeout=300, check=False)
    progress = [line for line in proc.stdout.splitlines() if line.startswith("rank ")]
    assert proc.returncode == 0, "\n".join(progress[-2 * pp:]) + "\n" + proc.stderr[-3000:]
    for stage in range(pp):
        runs = torch.load(f"{out}.stage{stage}", weights_only=True)["runs"]
        assert sorted(runs) == [1, 2, 4]
        for m, run in runs.items():
            assert abs(run["loss"] - run["ref_loss"]) <= 1e-12 * run["ref_loss"], (stage, m)
            assert abs(run["eval_loss"] - run["ref_loss"]) <= 1e-12 * run["ref_loss"], (stage, m)
            assert run["eval_targets"] == run["ref_targets"] > 0, (stage, m)
            assert run["grads"] == run["params"] > 0, (stage, m)  # every parameter of the stage was reached
            assert run["grad_rel"] <= 1e-10, (stage, m)
