"""The fused decoder walk (rlt_scale.model.walk, .fused) against the layer-by-layer taped path, in float64.

``model.decoder_step=layers`` runs each decoder layer at each position as its
own modules on the weight tape; ``fused`` runs a whole chunk as one autograd
node: one step function per segment (merge, every layer, carry), backward
written out, the window read as a fixed span and the memory read whole, the
weight and memory gradients formed per block of positions. Logits, the loss
and every parameter's gradient must agree to 1e-10 (float64 rounds at ~1e-16
per op; the two sum the same terms in another order, and a dropped or
doubled term shows up at ~1e-3 with these weights).
"""

from __future__ import annotations

import os

import pytest
import torch

from helpers import assert_same_grads, loss_logits_grads
from rlt_scale.training.bptt import BPTT
from test_deferred_weights import CASES  # the same shapes: K, W vs T, tied or not
from test_window_keys import _batch

TOL = 1e-10


@pytest.fixture(autouse=True)
def poisoned_empty_tensors():
    """Uninitialised memory reads as NaN: a fixed span over a slot not yet written must not matter."""
    was = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(was[0])
    torch.utils.deterministic.fill_uninitialized_memory = was[1]


def _run(model, tokens, doc, step: str, bptt: BPTT = BPTT(), block: int = 3):
    model.cfg.decoder_step, model.cfg.decoder_wgrad_block = step, block
    return loss_logits_grads(model, tokens, doc, bptt)


@pytest.mark.parametrize("case", CASES, ids=lambda c: "K{feedback_block}-W{window}-tied{}".format(
    c.get("tie_layers", True), **c))
def test_fused_step_equals_the_layer_path(make_model, case):
    model = make_model(**case)
    tokens, doc = _batch(13, packed=True)
    ref_loss, ref_logits, ref = _run(model, tokens, doc, "layers")
    loss, logits, got = _run(model, tokens, doc, "fused")
    assert abs(float(loss - ref_loss)) <= TOL
    assert (logits - ref_logits).abs().max() <= TOL
    assert_same_grads(got, ref, TOL)
    assert all(ref[n].abs().max() > 0 for n in ref if n.startswith("decoder.")), "a zero decoder gradient"


@pytest.mark.parametrize("ckpt", [False, True])
@pytest.mark.parametrize("k", [1, 3])
def test_fused_step_across_checkpointed_chunks(make_model, k, ckpt):
    """Chunks of 4 carry caches and feedback; with checkpointing the recomputed stores serve backward."""
    model = make_model(feedback_block=k, window=3)
    tokens, doc = _batch(13, packed=True, seed=1)
    bptt = BPTT(chunk_size=4, checkpoint=ckpt)
    ref_loss, _, ref = _run(model, tokens, doc, "layers", bptt)
    loss, _, got = _run(model, tokens, doc, "fused", bptt)
    assert abs(float(loss - ref_loss)) <= TOL
    assert_same_grads(got, ref, TOL)


def test_fused_step_with_truncated_bptt(make_model):
    model = make_model(feedback_block=1, window=3)
    tokens, doc = _batch(13, packed=False, seed=2)
    bptt = BPTT(chunk_size=4, tbptt_chunks=1, detach=frozenset({"s", "cache"}))
    _, _, ref = _run(model, tokens, doc, "layers", bptt)
    _, _, got = _run(model, tokens, doc, "fused", bptt)
    assert_same_grads(got, ref, TOL)


@pytest.mark.parametrize("k", [1, 4])
def test_learned_feedback_scale_and_merge_gradients(make_model, k):
    """The merge's gradients are sums over segments (s*, its norm, a learned scale) and GEMMs over
    positions (gate, proj): with K=4 a segment's positions share one feedback."""
    model = make_model(feedback_block=k, window=3, learn_feedback_scale=True)
    tokens, doc = _batch(13, packed=True, seed=3)
    _, _, ref = _run(model, tokens, doc, "layers", BPTT(chunk_size=8))
    _, _, got = _run(model, tokens, doc, "fused", BPTT(chunk_size=8))
    assert_same_grads(got, ref, TOL)
    assert all(ref[n].abs().max() > 0 for n in ref if n.startswith("merge."))


@pytest.mark.parametrize("block", [1, 64])
def test_memory_and_weight_gradients_per_block_or_per_chunk(make_model, block):
    """A block of one position forms the memory's and the weights' gradients at every position; a
    block longer than the chunk forms them once per chunk: both equal the layer path."""
    model = make_model(feedback_block=1, window=3, memory_groups=2, tie_layers=False)
    tokens, doc = _batch(13, packed=True, seed=4)
    _, _, ref = _run(model, tokens, doc, "layers", BPTT(chunk_size=6), block=block)
    _, _, got = _run(model, tokens, doc, "fused", BPTT(chunk_size=6), block=block)
    assert_same_grads(got, ref, TOL)


def test_a_chunk_is_one_autograd_node(make_model):
    """The walk puts one node per chunk into the graph, and nothing per position: two chunks of 5 or
    two chunks of 10 positions build graphs of the same size (the layer path adds ~60 nodes a position)."""
    from rlt_scale.training.bptt import run_sequence

    def graph(model, length):
        tokens, doc = _batch(length, packed=False)
        out = run_sequence(model, tokens, doc, bptt=BPTT(chunk_size=length // 2))
        names, seen, stack = [], set(), [out.loss_sum.grad_fn]
        while stack:
            node = stack.pop()
            if node is not None and node not in seen:
                seen.add(node)
                names.append(type(node).__name__)
                stack.extend(n for n, _ in node.next_functions)
        return names

    model = make_model(feedback_block=1, window=3, decoder_step="fused", decoder_wgrad_block=3)
    short, long = graph(model, 10), graph(model, 20)
    assert short.count("_WalkBackward") == long.count("_WalkBackward") == 2
    assert len(short) == len(long)
    model.cfg.decoder_step = "layers"
    assert len(graph(model, 20)) - len(graph(model, 10)) > 10 * 20  # the check can fail


def test_bf16_autocast_matches_the_layer_path(make_model):
    """Under bf16 autocast the fused step casts as autocast does (weights once per chunk, matmuls and
    attention in bf16, norms and the residual stream in fp32): the two paths agree to bf16 rounding
    (rel 2e-2 on gradients: 8 mantissa bits, sums in another order)."""
    model = make_model(feedback_block=1, window=3, params_dtype="float32")
    tokens, doc = _batch(13, packed=True, seed=5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ref_loss, _, ref = _run(model, tokens, doc, "layers")
        loss, _, got = _run(model, tokens, doc, "fused")
    assert abs(float(loss - ref_loss)) <= 2e-2 * abs(float(ref_loss))
    for name in ref:
        assert got[name].dtype == torch.float32
        assert (got[name] - ref[name]).abs().max() <= 2e-2 * ref[name].abs().max() + 1e-6, name


@pytest.mark.parametrize("k", [1, 3])
def test_evaluation_and_prefill_run_the_walk_forward(make_model, k):
    """Without gradients the walk runs the same steps and keeps nothing for backward: the logits and
    the state it hands on (feedback and every window cache) equal the layer path's."""
    from rlt_scale.model.layers import document_positions

    model = make_model(feedback_block=k, window=3, decoder_step="fused", decoder_wgrad_block=3)
    tokens, doc = _batch(13, packed=True, seed=6)
    x, d = tokens[:, :-1], doc[:, :-1]
    pos = document_positions(d)
    out = {}
    with torch.no_grad():
        for step in ("fused", "layers"):
            model.cfg.decoder_step = step
            e, _ = model.encode(x, pos, d)
            z, state = model.decode(e, pos, d, model.build_memory(e, pos, d), model.initial_state(2, x.device))
            out[step] = (model.logits(z), state)
    (logits, state), (ref_logits, ref_state) = out["fused"], out["layers"]
    assert (logits - ref_logits).abs().max() <= TOL
    assert (state.s - ref_state.s).abs().max() <= TOL
    for cache, ref in zip(state.caches, ref_state.caches):
        assert torch.equal(cache.pos, ref.pos) and torch.equal(cache.doc, ref.doc)
        assert (cache.k - ref.k).abs().max() <= TOL and (cache.v - ref.v).abs().max() <= TOL


@pytest.mark.parametrize("overrides, key", [
    (dict(decoder_step="fused", decoder_wgrad_block=0), "model.decoder_step"),
    (dict(decoder_compile="default"), "model.decoder_compile"),
    (dict(decoder_step="fast"), "model.decoder_step"),
    (dict(decoder_step="fused", decoder_compile="max"), "model.decoder_compile"),
])
def test_validate_names_the_key(overrides, key):
    from rlt_scale.config import ModelConfig
    from rlt_scale.errors import ConfigError

    with pytest.raises(ConfigError, match=key):
        ModelConfig(**overrides).validate()


@pytest.mark.slow
def test_compiled_step_equals_eager_and_serves_every_position(make_model, tmp_path):
    """``decoder_compile=default``: the same numbers as the eager fused step (float64, 1e-12), from
    a few graphs that serve every position (a position is an index tensor, not a constant the
    trace would specialise on), all compiled in the first step; its cache is where the key says."""
    from torch._dynamo.utils import counters

    model = make_model(feedback_block=1, window=3, decoder_step="fused",
                       decoder_compile_cache=str(tmp_path / "inductor"))
    bptt = BPTT(chunk_size=8)
    tokens, doc = _batch(23, packed=True, seed=7)
    _, _, eager = _run(model, tokens, doc, "fused", bptt)
    model.cfg.decoder_compile = "default"
    before = counters["stats"]["unique_graphs"]
    loss, _, compiled = _run(model, tokens, doc, "fused", bptt)
    assert_same_grads(compiled, eager, 1e-12)
    graphs = counters["stats"]["unique_graphs"] - before
    assert 2 <= graphs <= 12, graphs  # 23 positions x 2 layers, forward and backward: 92 steps
    again, _, _ = _run(model, tokens, doc, "fused", bptt)
    assert counters["stats"]["unique_graphs"] - before == graphs, "a second step compiled again"
    assert torch.equal(again, loss)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    assert any((tmp_path / "inductor").rglob("*.py")), "nothing written to the compile cache"
