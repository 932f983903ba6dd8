"""``model.encoder_window``: the encoder's causal attention limited to the last ``W_E`` positions.

A config-selectable variant (docs/RESULTS.md, "Parity at 2048"). Checked in
float64 at 1e-10, the tolerance of tests/test_model_semantics.py (two code
paths of one function differ by ~1e-15 per op; a semantic difference shows
at ~1e-3 with these weights).
"""

from __future__ import annotations

import pytest
import torch

from rlt_scale.errors import ConfigError
from rlt_scale.config import ModelConfig
from rlt_scale.generation import Generator
from rlt_scale.training.bptt import BPTT, run_sequence

TOL = 1e-10


def _tokens(seed=1, shape=(2, 13)):
    return torch.randint(0, 23, shape, generator=torch.Generator().manual_seed(seed))


def test_a_window_as_long_as_the_sequence_is_full_attention(make_model):
    """Training at T <= W_E is unchanged: logits and every gradient equal those of full attention."""
    tokens = _tokens(shape=(2, 14))
    full, windowed = make_model(seed=3), make_model(seed=3, encoder_window=13)  # 13 input positions
    outs = []
    for model in (full, windowed):
        logits = model(tokens[:, :-1])
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten()).backward()
        outs.append((logits, {n: p.grad for n, p in model.named_parameters()}))
    assert (outs[0][0] - outs[1][0]).abs().max() <= TOL
    for name, grad in outs[0][1].items():
        assert (grad - outs[1][1][name]).abs().max() <= TOL, name


@pytest.mark.parametrize("w", [1, 3])
def test_encoder_output_reaches_exactly_its_receptive_field(make_model, w):
    """With L_E=2 layers, position t depends on tokens t-2(W_E-1) .. t, and on nothing earlier."""
    model = make_model(encoder_window=w)
    tokens = _tokens(shape=(1, 14))
    pos = torch.arange(14)[None]
    doc = torch.zeros_like(tokens)
    base, _ = model.encode(tokens, pos, doc)
    t, reach = 13, 2 * (w - 1)
    for j in range(14):
        changed = tokens.clone()
        changed[0, j] = (changed[0, j] + 1) % 23
        moved = (model.encode(changed, pos, doc)[0][0, t] - base[0, t]).abs().max().item()
        if t - reach <= j <= t:
            assert moved > 1e-6, (j, moved)
        else:
            assert moved <= TOL, (j, moved)


@pytest.mark.parametrize("k", [1, 3])
def test_windowed_encoder_prefill_then_decode_equals_teacher_forcing(make_model, k):
    model = make_model(feedback_block=k, encoder_window=4)
    tokens = _tokens()
    teacher = model(tokens)
    gen = Generator(model)
    logits, state = gen.prefill(tokens[:, :6])
    stepped = [logits]
    for t in range(6, tokens.shape[1]):
        step_logits, state = gen.step(tokens[:, t], state)
        stepped.append(step_logits[:, None])
    assert (torch.cat(stepped, dim=1) - teacher).abs().max() <= TOL


def test_windowed_encoder_chunked_equals_one_chunk(make_model):
    model = make_model(encoder_window=4)
    tokens = _tokens(shape=(2, 14))
    one = run_sequence(model, tokens, bptt=BPTT(), want_logits=True)
    chunked = run_sequence(model, tokens, bptt=BPTT(chunk_size=5), want_logits=True)
    assert (one.logits - chunked.logits).abs().max() <= TOL
    assert abs(one.loss_sum.item() - chunked.loss_sum.item()) <= TOL


def test_a_negative_encoder_window_is_refused_by_name():
    with pytest.raises(ConfigError, match="model.encoder_window"):
        ModelConfig(encoder_window=-1).validate()
