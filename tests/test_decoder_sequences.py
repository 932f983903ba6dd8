"""``trainer.decoder_sequences``: several micro-batches advance through the decoder together (issue #13, item 5).

Joining micro-batches changes how many sequences share one weight read per
decoder position, not what is computed: the step's loss and every gradient
equal the one-micro-batch-at-a-time step in float64 (to 1e-12 relative: the
same sums over the same targets, in another order).
"""

from __future__ import annotations

import pytest
import torch

from helpers import grads
from rlt_scale.config import load_config
from rlt_scale.errors import ConfigError
from rlt_scale.training import bptt as bptt_module
from rlt_scale.training.bptt import BPTT
from rlt_scale.training.engine import LocalEngine, PlainSync, join_batches


def _batches(n: int, rows: int = 2, tokens: int = 9) -> list[dict]:
    g = torch.Generator().manual_seed(n)
    out = []
    for i in range(n):
        doc = torch.zeros(rows, tokens + 1, dtype=torch.long)
        doc[i % rows, tokens // 2:] = 1  # a packed row, in a different row each time
        out.append({"tokens": torch.randint(0, 23, (rows, tokens + 1), generator=g), "doc_ids": doc,
                    "loss_mask": torch.rand(rows, tokens + 1, generator=g) > 0.2})
    return out


@pytest.mark.parametrize("group", [2, 4])
def test_joined_micro_batches_give_the_same_step(ctx, make_model, monkeypatch, group):
    calls = []
    real = bptt_module.run_sequence

    def counting(model, tokens, *args, **kwargs):
        calls.append(tokens.shape[0])
        return real(model, tokens, *args, **kwargs)

    monkeypatch.setattr("rlt_scale.training.engine.run_sequence", counting)
    batches = _batches(4)
    results = {}
    for per_pass in (1, group):
        model = make_model(feedback_block=2)
        engine = LocalEngine(model, ctx, PlainSync(model, None, ctx, grad_clip=0.0), BPTT(chunk_size=4),
                             micro_per_pass=per_pass)
        calls.clear()
        loss = engine.forward_backward(batches)
        results[per_pass] = (loss, grads(model), list(calls))
    (loss_1, grads_1, calls_1), (loss_g, grads_g, calls_g) = results[1], results[group]
    assert calls_1 == [2] * 4 and calls_g == [2 * group] * (4 // group)  # sequences per decoder pass
    assert abs(loss_g - loss_1) <= 1e-12 * abs(loss_1)
    for name, g in grads_1.items():
        assert (grads_g[name] - g).abs().max() <= 1e-12 * g.abs().max(), name


def test_join_keeps_absent_keys_absent():
    batches = [{"tokens": torch.zeros(2, 3, dtype=torch.long), "doc_ids": None} for _ in range(4)]
    joined = join_batches(batches, 2)
    assert len(joined) == 2 and joined[0]["tokens"].shape == (4, 3) and joined[0]["doc_ids"] is None


@pytest.mark.parametrize("overrides,needle", [
    (["trainer.micro_batch_size=2", "trainer.grad_accum_steps=4", "trainer.decoder_sequences=3"], "multiple of"),
    (["trainer.micro_batch_size=2", "trainer.grad_accum_steps=4", "trainer.decoder_sequences=16"], "divides"),
    (["trainer.micro_batch_size=2", "trainer.grad_accum_steps=2", "trainer.decoder_sequences=4",
      "parallel.pp=2"], "ring"),
])
def test_bad_decoder_sequences_name_the_key(overrides, needle):
    with pytest.raises(ConfigError, match="trainer.decoder_sequences") as err:
        load_config("configs/tiny.yaml", overrides)
    assert needle in str(err.value)


def test_good_decoder_sequences_are_accepted():
    cfg = load_config("configs/tiny.yaml", ["trainer.micro_batch_size=2", "trainer.grad_accum_steps=4",
                                            "trainer.decoder_sequences=4"])
    assert cfg.trainer.decoder_sequences == 4
