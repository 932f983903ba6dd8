"""No O(T²) tensor in a training step (issue #17, item 5).

A T×T mask (or score matrix) at T=4096 is 67 MB per layer per sample in
float32, and it was what dominated memory once the decoder was checkpointed.
Here a whole training step -- encoder, memory, decoder walk, readout, loss,
forward and backward -- runs at T and at 2T on packed documents, and the
largest tensor any op creates may at most double (linear in T). A quadratic
tensor would quadruple. (The largest tensors left are a tile's scores,
``heads x TILE x span``: linear in the span.)
"""

from __future__ import annotations

import pytest
import torch

from rlt_scale.training.bptt import BPTT, run_sequence
from test_attention_kernels import LargestTensor


def _largest_in_step(model, length: int, bptt: BPTT) -> int:
    g = torch.Generator().manual_seed(length)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, length + 1), generator=g)
    doc = (torch.arange(length + 1) // 100)[None]  # documents of 100 tokens, cut by the tiles
    with LargestTensor() as created:
        out = run_sequence(model, tokens, doc, bptt=bptt)
        (out.loss_sum / out.n_targets).backward()
    model.zero_grad(set_to_none=True)
    return created.largest


CASES = {  # K, BPTT, the two lengths
    "K0": (0, BPTT(), (1024, 2048)),
    "K0-chunks": (0, BPTT(chunk_size=512, checkpoint=True), (1024, 2048)),
    "K16": (16, BPTT(chunk_size=512), (1024, 2048)),
    "K1": (1, BPTT(chunk_size=128, checkpoint=True), (256, 512)),  # sequential: shorter, same claim
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_training_step_memory_is_linear_in_length(make_model, name):
    k, bptt, (short, long) = CASES[name]
    model = make_model(feedback_block=k, window=8)
    small, large = (_largest_in_step(model, n, bptt) for n in (short, long))
    assert large <= 2.1 * small, (small, large)
    assert large < long * long, large  # nowhere near one mask of the sample
