"""Training semantics (DESIGN.md section 2): chunked BPTT, checkpointing, truncation.

float64 throughout; 1e-10 for paths that must agree (see test_model_semantics).
"""

from __future__ import annotations

import pytest
import torch

from helpers import grads
from rlt_scale.model.layers import document_positions
from rlt_scale.training.bptt import BPTT, run_sequence, split_batch

TOL = 1e-10


def _batch(seed=0, batch=2, length=13, vocab=23):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, length + 1), generator=g)
    mask = torch.rand(batch, length + 1, generator=g) > 0.2  # SFT-like partial mask
    return tokens, mask


def _loss_and_grads(model, tokens, mask, bptt):
    model.zero_grad(set_to_none=True)
    out = run_sequence(model, tokens, loss_mask=mask, bptt=bptt)
    loss = out.loss_sum / out.n_targets
    loss.backward()
    return loss.detach(), grads(model)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("chunk", [1, 4, 5, 13])
def test_chunked_checkpointed_gradients_equal_unchunked(make_model, k, chunk):
    model = make_model(feedback_block=k)
    tokens, mask = _batch()
    ref_loss, ref = _loss_and_grads(model, tokens, mask, BPTT())
    for ckpt in (False, True):
        loss, got = _loss_and_grads(model, tokens, mask, BPTT(chunk_size=chunk, checkpoint=ckpt))
        assert abs(loss - ref_loss) <= TOL
        assert _max_diff(got, ref) <= TOL


def _hand_truncated_loss(model, tokens, mask, chunk, every, detach):
    """Reference truncated BPTT: one position at a time (K=1), with explicit
    detaches every ``chunk * every`` positions."""
    x, doc, targets, valid = split_batch(tokens, None, mask)
    pos = document_positions(doc)
    e, _ = model.encode(x, pos, doc)
    memory = model.build_memory(e, pos, doc)
    state = model.initial_state(x.shape[0], "cpu")
    visible = memory
    total = 0.0
    for t in range(x.shape[1]):
        if t and t % (chunk * every) == 0:
            state = state.detach(s="s" in detach, cache="cache" in detach)
            if "memory" in detach:
                visible = [m.detach_before(t) for m in memory]
        sl = slice(t, t + 1)
        z, state = model.decode(e[:, sl], pos[:, sl], doc[:, sl], visible, state, offset=t)
        ce = torch.nn.functional.cross_entropy(model.logits(z)[:, 0], targets[:, t], reduction="none")
        total = total + (ce * valid[:, t]).sum()
    return total / valid.sum()


@pytest.mark.parametrize("detach", [("s", "cache"), ("s",), ("s", "cache", "memory")])
@pytest.mark.parametrize("ckpt", [False, True])
def test_truncated_bptt_matches_hand_reference_and_differs_from_exact(make_model, detach, ckpt):
    model = make_model(feedback_block=1)
    tokens, mask = _batch(seed=1)
    chunk, every = 3, 2
    bptt = BPTT(chunk_size=chunk, checkpoint=ckpt, tbptt_chunks=every, detach=frozenset(detach))
    loss, got = _loss_and_grads(model, tokens, mask, bptt)

    model.zero_grad(set_to_none=True)
    ref_loss = _hand_truncated_loss(model, tokens, mask, chunk, every, set(detach))
    ref_loss.backward()
    ref = grads(model)
    assert abs(loss - ref_loss.detach()) <= TOL  # truncation never changes the forward
    assert _max_diff(got, ref) <= TOL

    _, exact = _loss_and_grads(model, tokens, mask, BPTT(chunk_size=chunk))
    assert _max_diff(got, exact) > 1e-8


def test_loss_mask_only_counts_masked_in_targets_but_state_sees_everything(make_model):
    model = make_model()
    tokens, _ = _batch(seed=2)
    mask = torch.zeros_like(tokens, dtype=torch.bool)
    mask[:, -1] = True  # only the final target counts (answer-at-the-end tasks)
    out = run_sequence(model, tokens, loss_mask=mask)
    assert out.n_targets.item() == tokens.shape[0]
    # Changing an early, masked-out token must still change the loss: the
    # state is updated on every token even where the target is masked.
    changed = tokens.clone()
    changed[:, 1] = (changed[:, 1] + 1) % 23
    assert abs(run_sequence(model, changed, loss_mask=mask).loss_sum - out.loss_sum) > 1e-8
    full = run_sequence(model, tokens, want_logits=True)
    ce = torch.nn.functional.cross_entropy(full.logits[:, -1], tokens[:, -1], reduction="sum")
    assert abs(out.loss_sum - ce) <= TOL


def test_bptt_description_says_when_truncated():
    assert "TRUNCATED" in BPTT(chunk_size=4, tbptt_chunks=2).describe()
    assert "exact BPTT" in BPTT(chunk_size=4).describe()


def test_segment_plan_cuts_packed_documents_chunks_and_truncation_once():
    from rlt_scale.model.layers import document_positions
    from rlt_scale.training.bptt import SegmentPlan

    # row 1 starts a document at position 4: a K=3 block cut there too
    doc = torch.tensor([[0] * 10, [0] * 4 + [1] * 6])
    plan = SegmentPlan.build(document_positions(doc), 3, BPTT(chunk_size=4, tbptt_chunks=2))
    assert plan.chunks == ((0, 4), (4, 8), (8, 10))
    assert plan.segments == ((0, 3), (3, 4), (4, 6), (6, 7), (7, 8), (8, 9), (9, 10))
    assert plan.chunk_of == (0, 0, 1, 1, 1, 2, 2)
    assert plan.truncated == (False, False, True)
    assert plan.chunk_segments(1) == [(0, 2), (2, 3), (3, 4)]
    assert [plan.chunk_first(t) for t in range(7)] == [0, 0, 2, 2, 2, 5, 5]
    assert [plan.starts_truncation(t) for t in range(7)] == [False] * 5 + [True, False]
    assert [plan.truncation_start(t) for t in range(7)] == [0] * 5 + [8, 8]
    # a chunk longer than the sample is one chunk; K=0 runs it whole
    assert SegmentPlan.build(document_positions(doc), 0, BPTT(chunk_size=64)).segments == ((0, 10),)
