"""Training reads nothing back to the host per decoder position (issue #17, item 2).

On a GPU every ``float(tensor)``, ``.item()``, ``nonzero`` and ``tolist``
waits until all queued kernels have run. One such read per position (per
token at K=1) stalls the device at every token, and in the ring pipeline
stalls the whole ring. On CPU they cost nothing, so ``tests/host_syncs.py``
counts them: each path is counted at T and at 2T tokens, and the counts
must be equal (nothing per position) and small.
"""

from __future__ import annotations

import json

import pytest
import torch

from helpers import torchrun
from host_syncs import count_host_syncs
from rlt_scale.training.bptt import BPTT, run_sequence
from rlt_scale.training.engine import LocalEngine, PlainSync


def _batch(tokens: int, seed: int) -> dict:
    """2 rows of ``tokens`` inputs; row 1 packs two documents; a few targets are masked."""
    g = torch.Generator().manual_seed(seed)
    doc = torch.zeros(2, tokens + 1, dtype=torch.long)
    doc[1, tokens // 2:] = 1
    return {"tokens": torch.randint(0, 23, (2, tokens + 1), generator=g), "doc_ids": doc,
            "loss_mask": torch.rand(2, tokens + 1, generator=g) > 0.2}


SCHEDULES = {  # name: (K, BPTT); chunks of 4 positions, so 2T also means twice the chunks
    "K1": (1, BPTT()),
    "K1-chunks-ckpt": (1, BPTT(chunk_size=4, checkpoint=True)),
    "K3-chunks-ckpt": (3, BPTT(chunk_size=4, checkpoint=True)),
    "K3-tbptt": (3, BPTT(chunk_size=4, tbptt_chunks=1)),
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_run_sequence_reads_the_host_once_per_batch_at_most(make_model, schedule):
    """Forward and backward of one batch. The encoder reads its attention tiling once per batch
    (``tolist``: one plan for every layer, see model/attention.py); K>1 also reads its block starts
    once per batch (``nonzero`` + ``tolist``), not once per chunk, which grew with T."""
    k, bptt = SCHEDULES[schedule]
    model = make_model(feedback_block=k)
    counts = []
    for tokens in (12, 24):
        batch = _batch(tokens, seed=tokens)
        with count_host_syncs() as counter:
            out = run_sequence(model, batch["tokens"], batch["doc_ids"], batch["loss_mask"], bptt)
            (out.loss_sum / out.n_targets).backward()
        counts.append(dict(counter.counts))
    assert counts[0] == counts[1]
    assert sum(counts[0].values()) == (1 if k == 1 else 3), counts[0]


def test_local_engine_step_reads_the_host_per_micro_batch_not_per_position(ctx, make_model):
    """A PP=1 training step (LocalEngine, M=2 micro-batches, K=1 in chunks): the same count at T and 2T.

    Per micro-batch the engine reads its target count and its loss, and the encoder its attention
    tiling; per step the two DP sums.
    """
    model = make_model(feedback_block=1)
    engine = LocalEngine(model, ctx, PlainSync(model, None, ctx, grad_clip=1.0), BPTT(chunk_size=4))
    counts = []
    for tokens in (12, 24):
        batches = [_batch(tokens, seed=tokens + i) for i in range(2)]
        with count_host_syncs() as counter:
            engine.forward_backward(batches)
        counts.append(dict(counter.counts))
    assert counts[0] == counts[1]
    assert sum(counts[0].values()) <= 2 * 3 + 2, counts[0]


@pytest.mark.slow
def test_ring_step_reads_the_host_once(tmp_path):
    """The ring pipeline at PP=2 (M=2, K=1, chunks of 3): every stage's ``forward_backward`` makes one
    host read per step (the summed loss) plus one per micro-batch's encoder pass (its attention
    tiling), at T and at 2T; it used to read every segment's loss."""
    out = tmp_path / "syncs.pt"
    spec = {"micro": [2], "tokens": 6, "feedback_block": 1, "chunk": 3, "count_syncs": True}
    torchrun("tests/workers/ring_strict.py", 2, [str(out), json.dumps(spec)], timeout=300)
    for stage in (0, 1):
        syncs = torch.load(f"{out}.stage{stage}", weights_only=True)["syncs"]
        assert syncs[6] == syncs[12], (stage, syncs)
        assert sum(syncs[6].values()) == 1 + 2, (stage, syncs)


@pytest.mark.slow
def test_ring_reads_out_once_per_chunk(tmp_path):
    """Issue #17, item 6: the ring's last stage runs the readout and loss once per chunk (as one
    process does), not once per segment: M=2 micro-batches of T tokens in chunks of 3, K=1, so
    2 * T/3 readouts per step, where once per segment would be 2 * T."""
    out = tmp_path / "readouts.pt"
    spec = {"micro": [2], "tokens": 6, "feedback_block": 1, "chunk": 3, "count_readouts": True}
    torchrun("tests/workers/ring_strict.py", 2, [str(out), json.dumps(spec)], timeout=300)
    readouts = torch.load(f"{out}.stage1", weights_only=True)["readouts"]
    assert readouts == {6: 2 * 2, 12: 2 * 4}, readouts
