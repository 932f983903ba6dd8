"""Deferred weight gradients (rlt_scale.model.deferred) against autograd's per-position ones, in float64.

``model.decoder_wgrad_block=0`` runs every decoder projection as the layer's
own modules, so autograd forms each weight gradient at each position: the
plain implementation the tapes replace. Blocks of 1, 2 and 5 positions cut
segments, documents and chunks at every place; logits, the loss and every
parameter's gradient must agree to 1e-10 (float64 rounds at ~1e-16 per op and
the two only sum the same terms in another order; a dropped or doubled
position shows up at ~1e-3 with these weights).
"""

from __future__ import annotations

import gc

import pytest
import torch

from helpers import assert_same_grads, loss_logits_grads
from rlt_scale.training.bptt import BPTT, run_sequence
from test_window_keys import _batch

TOL = 1e-10


def _run(model, tokens, doc, block: int, bptt: BPTT = BPTT()):
    model.cfg.decoder_wgrad_block = block
    return loss_logits_grads(model, tokens, doc, bptt)


CASES = [
    dict(feedback_block=1, window=3),
    dict(feedback_block=3, window=3),
    dict(feedback_block=1, window=1),
    dict(feedback_block=1, window=40),  # W > T
    dict(feedback_block=3, window=40, tie_layers=False, memory_groups=2),
]


@pytest.mark.parametrize("block", [1, 2, 5])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "K{feedback_block}-W{window}-tied{}".format(
    c.get("tie_layers", True), **c))
def test_deferred_weight_gradients_equal_per_position_ones(make_model, case, block):
    model = make_model(**case)
    tokens, doc = _batch(13, packed=True)
    ref_loss, ref_logits, ref = _run(model, tokens, doc, block=0)
    loss, logits, got = _run(model, tokens, doc, block=block)
    assert abs(float(loss - ref_loss)) <= TOL
    assert (logits - ref_logits).abs().max() <= TOL
    assert_same_grads(got, ref, TOL)
    # the decoder's own weights are reached (a deferred gradient that never arrived would be None)
    assert all(ref[n].abs().max() > 0 for n in ref if n.startswith("decoder.")), "a zero decoder gradient"


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_deferred_blocks_across_checkpointed_chunks(make_model, k, ckpt):
    """Chunks of 4 with chunk checkpointing: the recomputed buffers serve the original blocks' GEMMs."""
    model = make_model(feedback_block=k, window=3)
    tokens, doc = _batch(13, packed=True, seed=1)
    bptt = BPTT(chunk_size=4, checkpoint=ckpt)
    ref_loss, _, ref = _run(model, tokens, doc, block=0, bptt=bptt)
    loss, _, got = _run(model, tokens, doc, block=3, bptt=bptt)
    assert abs(float(loss - ref_loss)) <= TOL
    assert_same_grads(got, ref, TOL)


def test_truncated_bptt_with_deferred_blocks(make_model):
    """Detached chunks (truncated BPTT) still give each chunk's blocks their own GEMMs."""
    model = make_model(feedback_block=1, window=3)
    tokens, doc = _batch(13, packed=False, seed=2)
    bptt = BPTT(chunk_size=4, tbptt_chunks=1, detach=frozenset({"s", "cache"}))
    _, _, ref = _run(model, tokens, doc, block=0, bptt=bptt)
    _, _, got = _run(model, tokens, doc, block=2, bptt=bptt)
    assert_same_grads(got, ref, TOL)


def test_backward_frees_every_block_gradient_buffer(make_model):
    """Each block's output-gradient buffers go once its GEMMs ran, while the graph still lives."""
    from rlt_scale.model.deferred import _Block

    model = make_model(feedback_block=1, window=3, decoder_wgrad_block=2)
    tokens, doc = _batch(13, packed=True, seed=4)
    out = run_sequence(model, tokens, doc, bptt=BPTT(chunk_size=4))
    loss = out.loss_sum / out.n_targets
    loss.backward()
    gc.collect()
    blocks = [o for o in gc.get_objects() if isinstance(o, _Block)]
    assert all(not b.dy and not b.dnormed and b.x is None for b in blocks)
    assert loss.grad_fn is not None


def test_bf16_autocast_matches_the_per_position_path(make_model):
    """Under bf16 autocast the tapes cast each weight once and compute in bf16 as autograd's path does:
    the two agree to bf16 rounding (rel 2e-2 on gradients: bf16 has 8 mantissa bits and the sums
    run in another order), and both stay close to the fp32 gradient."""
    model = make_model(feedback_block=1, window=3, params_dtype="float32")
    tokens, doc = _batch(13, packed=True, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, _, ref = _run(model, tokens, doc, block=0)
        loss, _, got = _run(model, tokens, doc, block=4)
    assert abs(float(loss - ref_loss)) <= 2e-2 * abs(float(ref_loss))
    for name in ref:
        scale = ref[name].abs().max()
        assert got[name].dtype == ref[name].dtype == torch.float32
        assert (got[name] - ref[name]).abs().max() <= 2e-2 * scale + 1e-6, name


def test_validate_rejects_a_negative_block(make_model):
    from rlt_scale.errors import ConfigError

    with pytest.raises(ConfigError, match="model.decoder_wgrad_block"):
        make_model(decoder_wgrad_block=-1)
