"""A pipeline stage builds only its own parts, with exactly the single-process weights."""

from __future__ import annotations

import pytest
import torch

from rlt_scale.config import ModelConfig
from rlt_scale.model import build_model
from rlt_scale.parallel.stages import build_stage, is_pipeline_replica, plan_stage

CFG = dict(vocab_size=23, d_model=16, n_heads=2, n_enc_layers=4, n_dec_layers=4, window=3,
           feedback_block=2, params_dtype="float64", ffn_hidden_size=24)


@pytest.mark.parametrize("n_stages, groups", [(2, 1), (4, 1), (4, 2), (2, 4)])
def test_stages_hold_the_single_process_weights_and_nothing_else(ctx, n_stages, groups):
    cfg = ModelConfig(**CFG, memory_groups=groups)
    torch.manual_seed(7)
    full = dict(build_model(cfg, ctx.tp_group).named_parameters())
    seen: dict[str, int] = {}
    for stage in range(n_stages):
        plan = plan_stage(cfg, stage, n_stages)
        torch.manual_seed(7)
        params = dict(build_stage(cfg, ctx.tp_group, plan).named_parameters())
        for name, p in params.items():
            assert torch.equal(p, full[name]), name  # bit-identical, not merely close
            if not is_pipeline_replica(p):
                seen[name] = seen.get(name, 0) + 1
        layers = {int(n.split(".")[1]) for n in params if n.startswith(("encoder.", "decoder."))}
        assert layers == set(plan.encoder_layers)
        assert any(n.startswith("embed.") for n in params) == plan.first
        assert any(n.startswith("readout.") for n in params) == plan.last
    # every parameter lives on exactly one stage once replicas are discounted
    assert seen == {name: 1 for name in full}


def test_a_part_does_not_depend_on_which_other_parts_are_built(ctx):
    cfg = ModelConfig(**CFG)
    torch.manual_seed(3)
    alone = build_model(cfg, ctx.tp_group, parts=lambda name: name == "decoder.2" or name == "encoder.2")
    torch.manual_seed(3)
    full = build_model(cfg, ctx.tp_group)
    assert isinstance(alone.encoder[0], torch.nn.Identity) and alone.readout is None
    for (name, a), (_, b) in zip(alone.decoder[2].named_parameters(), full.decoder[2].named_parameters()):
        assert torch.equal(a, b), name
    torch.manual_seed(4)
    other_seed = build_model(cfg, ctx.tp_group)
    assert not torch.equal(other_seed.decoder[2].cross_q.weight, full.decoder[2].cross_q.weight)
