"""Keys written in place (rlt_scale.model.window) against the concatenating walk, in float64.

The reference walks every segment through ``RLT.decoder_layers``, which
concatenates each layer's cache with the segment's keys and lets autograd
differentiate the concatenations and slices: the plain, obviously right
implementation that the in-place stores replace. Logits and every gradient
(parameters, and the carried state between chunks) must agree to 1e-10:
float64 rounds at ~1e-16 per op, and the two paths only sum the same terms in
a different order, while any real difference (a slot read early, a gradient
dropped) shows up at ~1e-3 with these weights.
"""

from __future__ import annotations

import pytest
import torch

from helpers import grads
from rlt_scale.model.layers import document_positions
from rlt_scale.model.rlt import feedback_segments
from rlt_scale.training.bptt import BPTT, run_sequence

TOL = 1e-10


def _batch(length: int, packed: bool, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 23, (2, length + 1), generator=g)
    doc = torch.zeros_like(tokens)
    if packed:  # documents of different lengths, starting at different places in each row
        doc[0, 4:] = 1
        doc[0, 9:] = 2
        doc[1, 6:] = 1
    return tokens, doc


def _reference_loss(model, tokens, doc_ids):
    """Mean next-token loss of the concatenating walk, one segment at a time over the whole sample."""
    x, doc, targets = tokens[:, :-1], doc_ids[:, :-1], tokens[:, 1:]
    valid = doc_ids[:, 1:] == doc_ids[:, :-1]
    pos = document_positions(doc)
    e, _ = model.encode(x, pos, doc)
    memory = model.build_memory(e, pos, doc)
    state = model.initial_state(x.shape[0], x.device)
    s, caches, outputs = state.s, dict(enumerate(state.caches)), []
    layers = range(len(model.decoder))
    for a, b in feedback_segments(pos, model.cfg.feedback_block):
        u, feedback = model.feedback_in(e[:, a:b], pos[:, a:b], s)
        z, caches = model.decoder_layers(u, pos[:, a:b], doc[:, a:b], caches, [m.first(b) for m in memory], layers)
        s = model.carry(z, pos[:, a:b], feedback)
        outputs.append(z)
    z = torch.cat(outputs, 1)
    loss = model.segment_loss(z, targets, valid)
    return loss / valid.sum(), model.logits(z)


CASES = [
    dict(feedback_block=1, window=3),
    dict(feedback_block=3, window=3),
    dict(feedback_block=0, window=3),
    dict(feedback_block=1, window=1),
    dict(feedback_block=3, window=1),
    dict(feedback_block=1, window=40),   # W > T: the window is the whole prefix
    dict(feedback_block=3, window=40, tie_layers=False, memory_groups=2),
]


@pytest.mark.parametrize("packed", [False, True], ids=["one-doc", "packed"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "K{feedback_block}-W{window}".format(**c))
def test_in_place_walk_equals_concatenating_walk(make_model, case, packed):
    model = make_model(**case)
    tokens, doc = _batch(13, packed)
    ref_loss, ref_logits = _reference_loss(model, tokens, doc)
    ref_loss.backward()
    ref = grads(model)

    model.zero_grad(set_to_none=True)
    out = run_sequence(model, tokens, doc, want_logits=True)
    (out.loss_sum / out.n_targets).backward()
    assert (out.logits - ref_logits).abs().max() <= TOL
    got = grads(model)
    assert got.keys() == ref.keys()
    for name in ref:
        assert (got[name] - ref[name]).abs().max() <= TOL, name


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("window", [1, 3, 40])
@pytest.mark.parametrize("ckpt", [False, True])
def test_chunks_carry_window_gradients(make_model, k, window, ckpt):
    """Chunks of 4 (cutting documents and K=3 blocks): the carried caches pass gradients back exactly."""
    model = make_model(feedback_block=k, window=window)
    tokens, doc = _batch(13, packed=True, seed=1)
    ref_loss, _ = _reference_loss(model, tokens, doc)
    ref_loss.backward()
    ref = grads(model)

    model.zero_grad(set_to_none=True)
    out = run_sequence(model, tokens, doc, bptt=BPTT(chunk_size=4, checkpoint=ckpt))
    (out.loss_sum / out.n_targets).backward()
    got = grads(model)
    for name in ref:
        assert (got[name] - ref[name]).abs().max() <= TOL, name


def test_carried_cache_gradient_reaches_the_previous_chunk(make_model):
    """d(loss of chunk 2)/d(keys of chunk 1) flows only through the carried window: check it against the reference."""
    model = make_model(feedback_block=0, window=3)  # no feedback: the cache is the only path between chunks
    tokens, doc = _batch(8, packed=False, seed=2)
    x = tokens[:, :-1]
    pos = document_positions(doc[:, :-1])
    e, _ = model.encode(x, pos, doc[:, :-1])
    e = e.detach().requires_grad_()
    memory = [m.detach() for m in model.build_memory(e.detach(), pos, doc[:, :-1])]

    state = model.initial_state(2, "cpu")
    z1, state = model.decode(e[:, :4], pos[:, :4], doc[:, :4], memory, state, offset=0)
    z2, _ = model.decode(e[:, 4:], pos[:, 4:], doc[:, 4:], memory, state, offset=4)
    (g_chunked,) = torch.autograd.grad(z2.square().sum(), e)

    z_all, _ = model.decode(e, pos, doc[:, :-1], memory, model.initial_state(2, "cpu"))
    (g_whole,) = torch.autograd.grad(z_all[:, 4:].square().sum(), e)
    assert g_chunked[:, :4].abs().max() > 1e-6  # the earlier chunk is reached, through the cache alone
    assert (g_chunked - g_whole).abs().max() <= TOL


@pytest.mark.parametrize("case", [dict(feedback_block=0, window=3), dict(feedback_block=8, window=40),
                                  dict(feedback_block=0, window=1)],
                         ids=lambda c: "K{feedback_block}-W{window}".format(**c))
@pytest.mark.parametrize("chunk", [0, 7])
def test_tiled_reads_equal_the_concatenating_walk(make_model, case, chunk, monkeypatch):
    """Segments longer than a tile (K=0, long blocks) read the window and the memory in tiles of 3
    queries, cutting documents and chunks; the numbers are the reference's."""
    from rlt_scale.model import attention

    monkeypatch.setattr(attention, "TILE", 3)
    model = make_model(**case)
    tokens, doc = _batch(13, packed=True, seed=3)
    ref_loss, _ = _reference_loss(model, tokens, doc)
    ref_loss.backward()
    ref = grads(model)

    model.zero_grad(set_to_none=True)
    out = run_sequence(model, tokens, doc, bptt=BPTT(chunk_size=chunk))
    (out.loss_sum / out.n_targets).backward()
    assert abs(float(out.loss_sum / out.n_targets) - float(ref_loss)) <= TOL
    got = grads(model)
    for name in ref:
        assert (got[name] - ref[name]).abs().max() <= TOL, name


@pytest.mark.parametrize("ckpt", [False, True])
def test_backward_frees_every_store_gradient_while_the_graph_lives(make_model, ckpt):
    """Each chunk's stores hand their gradients on and drop them during backward, even though the
    loss (and so the graph, and every custom Function's ctx) is still alive: otherwise T/C chunks
    would keep T/C memory-sized buffers until the end of backward, O(T^2/C)."""
    import gc

    from rlt_scale.model.window import KeyStore

    model = make_model(feedback_block=1, window=3)
    tokens, doc = _batch(13, packed=True, seed=4)
    out = run_sequence(model, tokens, doc, bptt=BPTT(chunk_size=4, checkpoint=ckpt))
    loss = out.loss_sum / out.n_targets
    loss.backward()
    gc.collect()
    stores = [o for o in gc.get_objects() if isinstance(o, KeyStore)]
    assert all(s.grad_k is None and s.grad_v is None for s in stores), sum(s.grad_k is not None for s in stores)
    assert loss.grad_fn is not None  # the graph is still there
