"""The model's contract (DESIGN.md section 1), checked in float64.

Tolerances: 1e-10 wherever two code paths compute the same function (rounding
differences of float64 are ~1e-15 per op; 1e-10 leaves room for the sums over
a sequence while still failing on any real semantic difference, which shows
up at ~1e-3 with these weights).
"""

from __future__ import annotations

import itertools

import pytest
import torch

from rlt_scale.generation import Generator
from rlt_scale.model.layers import document_positions

TOL = 1e-10

CASES = [
    dict(feedback_block=k, tie_layers=tie, memory_groups=g)
    for k, tie, g in itertools.product((1, 3, 0), (True, False), (1, 2))
]


def _ids(case):
    return "K{feedback_block}-{tie}-G{memory_groups}".format(
        tie="tied" if case["tie_layers"] else "untied", **case
    )


@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_teacher_forced_equals_prefill_then_decode(make_model, case):
    model = make_model(**case)
    tokens = torch.randint(0, 23, (2, 13), generator=torch.Generator().manual_seed(1))
    teacher = model(tokens)
    prompt_len = 6  # the prompt/answer boundary falls inside a K=3 block
    gen = Generator(model)
    logits, state = gen.prefill(tokens[:, :prompt_len])
    stepped = [logits]
    for t in range(prompt_len, tokens.shape[1]):
        step_logits, state = gen.step(tokens[:, t], state)
        stepped.append(step_logits[:, None])
    stepped = torch.cat(stepped, dim=1)
    assert stepped.shape == teacher.shape
    assert (stepped - teacher).abs().max().item() <= TOL


@pytest.mark.parametrize("layers", [1, 2])
@pytest.mark.parametrize("window", [1, 2, 4])
def test_window_reaches_exactly_w_minus_1_back(make_model, layers, window):
    """Perturb one decoder input (not the memory, no feedback): only the
    window cache can carry it, and it reaches exactly layers*(W-1) positions
    ahead. A window holding W-2 or W entries would move that edge."""
    model = make_model(feedback_block=0, window=window, n_enc_layers=layers, n_dec_layers=layers)
    tokens = torch.randint(0, 23, (1, 16), generator=torch.Generator().manual_seed(2))
    doc = torch.zeros_like(tokens)
    pos = document_positions(doc)
    with torch.no_grad():
        e, _ = model.encode(tokens, pos, doc)
        memory = model.build_memory(e, pos, doc)
        z0, _ = model.decode(e, pos, doc, memory, model.initial_state(1, "cpu"))
        j = 3
        e2 = e.clone()
        e2[:, j] += 1.0
        z1, state = model.decode(e2, pos, doc, memory, model.initial_state(1, "cpu"))
    changed = (z1 - z0).abs().amax(-1)[0]
    reach = layers * (window - 1)
    for t in range(tokens.shape[1]):
        if j <= t <= j + reach:
            assert changed[t] > 1e-6, f"t={t} should see position {j}"
        else:
            assert changed[t] == 0, f"t={t} must not see position {j} (reach {reach})"
    assert all(len(c) == window - 1 for c in state.caches)


@pytest.mark.parametrize("k", [1, 3, 0])
def test_causality(make_model, k):
    model = make_model(feedback_block=k)
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 23, (2, 12), generator=g)
    with torch.no_grad():
        base = model(tokens)
        for t in (0, 4, 7):
            changed = tokens.clone()
            changed[:, t + 1:] = torch.randint(0, 23, changed[:, t + 1:].shape, generator=g)
            other = model(changed)
            assert (other[:, : t + 1] - base[:, : t + 1]).abs().max() <= 1e-12
            assert (other[:, t + 1:] - base[:, t + 1:]).abs().max() > 1e-6


@pytest.mark.parametrize("k", [1, 3, 0])
def test_packed_documents_equal_separate_runs(make_model, k):
    model = make_model(feedback_block=k)
    g = torch.Generator().manual_seed(4)
    first, second = torch.randint(0, 23, (1, 5), generator=g), torch.randint(0, 23, (1, 6), generator=g)
    solo = torch.randint(0, 23, (1, 11), generator=g)
    # Row 0 packs two documents (the second starts mid-block for K=3); row 1
    # is one document, so the two rows' blocks are misaligned.
    tokens = torch.cat([torch.cat([first, second], 1), solo], 0)
    doc_ids = torch.tensor([[0] * 5 + [1] * 6, [7] * 11])
    with torch.no_grad():
        packed = model(tokens, doc_ids)
        assert (packed[:1, :5] - model(first)).abs().max() <= TOL
        assert (packed[:1, 5:] - model(second)).abs().max() <= TOL
        assert (packed[1:] - model(solo)).abs().max() <= TOL


def test_tied_layers_share_storage_and_sum_gradients(make_model):
    tied = make_model(tie_layers=True)
    for enc, dec in zip(tied.encoder, tied.decoder):
        assert dec.attn is enc.attn and dec.ffn is enc.ffn
        assert dec.attn.qkv.weight.data_ptr() == enc.attn.qkv.weight.data_ptr()
    assert tied.decoder[0].norm_attn is not tied.encoder[0].norm_attn  # norms stay separate
    counts = tied.parameter_counts()
    shared = sum(p.numel() for b in tied.encoder for p in list(b.attn.parameters()) + list(b.ffn.parameters()))
    assert counts["applied"] - counts["unique"] == shared

    # An untied model holding the same numbers in separate encoder and decoder
    # copies: the tied gradient must be the sum of the two copies' gradients.
    untied = make_model(tie_layers=False)
    untied_sd = untied.state_dict()
    untied.load_state_dict({k: tied.state_dict()[k] for k in untied_sd})
    tokens = torch.randint(0, 23, (2, 9), generator=torch.Generator().manual_seed(5))
    for m in (tied, untied):
        torch.nn.functional.cross_entropy(m(tokens).flatten(0, 1), tokens.roll(-1, 1).flatten()).backward()
    for i, (enc, dec) in enumerate(zip(untied.encoder, untied.decoder)):
        for name in ("attn.qkv", "attn.out", "ffn.gate_up", "ffn.down"):
            owner, leaf = name.split(".")
            tied_grad = getattr(getattr(tied.encoder[i], owner), leaf).weight.grad
            parts = [getattr(getattr(m, owner), leaf).weight.grad for m in (enc, dec)]
            assert parts[0].abs().sum() > 0 and parts[1].abs().sum() > 0
            assert (tied_grad - parts[0] - parts[1]).abs().max() <= TOL


@pytest.mark.parametrize("k", [1, 3, 4])
def test_feedback_block_reads_previous_block_end(make_model, k):
    """Independent reference for RLT-1/RLT-2: walk positions one at a time and
    feed position t the output of the last position of the previous block
    (s_* in the first block), using the model's layers but our own bookkeeping."""
    model = make_model(feedback_block=k)
    tokens = torch.randint(0, 23, (2, 10), generator=torch.Generator().manual_seed(6))
    doc = torch.zeros_like(tokens)
    pos = document_positions(doc)
    with torch.no_grad():
        e, _ = model.encode(tokens, pos, doc)
        memory = model.build_memory(e, pos, doc)
        caches = model.initial_state(2, "cpu").caches
        outputs = []
        for t in range(tokens.shape[1]):
            block_start = (t // k) * k
            feedback = model.merge.initial_state.expand(2, -1) if block_start == 0 else outputs[block_start - 1]
            z = model.merge(e[:, t:t + 1], feedback)
            layers = range(len(model.decoder))
            z, new = model.decoder_layers(z, pos[:, t:t + 1], doc[:, t:t + 1], dict(enumerate(caches)),
                                          [m.first(t + 1) for m in memory], layers)
            caches = [new[i] for i in layers]
            outputs.append(z[:, 0])
        reference = model.logits(torch.stack(outputs, 1))
        assert (model(tokens) - reference).abs().max() <= TOL
