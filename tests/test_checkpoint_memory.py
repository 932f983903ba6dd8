"""A checkpoint save adds no copy of the model or optimizer to memory (issue #17, item 3).

* The non-ZeRO path hands ``dcp.save`` the live weights and AdamW moments:
  every tensor shares its storage with the parameter or optimizer state.
* ZeRO's moments are written as each rank's pieces of them
  (:class:`RowMajorPieces`): :func:`row_major_boxes` splits a flat range of a
  row-major tensor into contiguous boxes, and a tensor written as such
  pieces loads back exactly, into a plain tensor of the global shape.
* ``Trainer.save`` frees the gradients before DCP writes.

The multi-process ZeRO round trips (tests/test_zero.py, tests/test_reshard.py)
check the pieces against DeepSpeed's real partitions.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed.checkpoint as dcp

from helpers import tiny_overrides
from rlt_scale.config import load_config
from rlt_scale.training.sharded_state import ModelOptimizerState, RowMajorPieces, row_major_boxes
from rlt_scale.training.trainer import Trainer


def _stepped(make_model):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    optimizer.step()
    return model, optimizer


def test_saved_tensors_are_the_live_weights_and_moments(ctx, make_model):
    model, optimizer = _stepped(make_model)
    state = ModelOptimizerState(model, optimizer, ctx).sharded_state_dict()
    params = dict(model.named_parameters())
    buffers = {k: v for k, v in model.named_buffers()}
    for name, tensor in state.items():
        kind, rest = name.split(".", 1)
        if kind == "model":
            live = params.get(rest, buffers.get(rest))
            assert tensor.data_ptr() == live.data_ptr(), name
        elif kind == "optimizer" and not rest.endswith(".step"):
            param_name, key = rest.rsplit(".", 1)
            assert tensor.data_ptr() == optimizer.state[params[param_name]][key].data_ptr(), name
    assert any(k.startswith("model.") for k in state) and any(k.endswith(".exp_avg_sq") for k in state)


def test_unstepped_optimizer_saves_zeros_without_allocating_them(ctx, make_model, tmp_path):
    model = make_model()
    optimizer = torch.optim.AdamW(model.parameters())
    state = ModelOptimizerState(model, optimizer, ctx)
    saved = state.sharded_state_dict()
    moments = [v for k, v in saved.items() if k.endswith("exp_avg")]
    assert moments and all(0 in m.stride() or m.numel() <= 1 for m in moments)  # broadcast views, no storage
    dcp.save(saved, checkpoint_id=str(tmp_path))
    targets = {k: torch.full_like(v, 7.0) for k, v in state.load_targets().items()}
    dcp.load(targets, checkpoint_id=str(tmp_path))
    for key, value in targets.items():
        if key.startswith("optimizer."):
            assert torch.count_nonzero(value) == 0, key


@pytest.mark.parametrize("shape", [(7,), (3, 5), (2, 3, 4), (4, 1, 3, 2)])
def test_row_major_boxes_tile_any_range_in_order(shape):
    numel = math.prod(shape)
    flat = torch.arange(numel).reshape(shape)
    for start in range(numel):
        for stop in range(start + 1, numel + 1):
            boxes = row_major_boxes(shape, start, stop)
            assert len(boxes) <= 2 * len(shape) - 1
            got = torch.cat([flat[tuple(slice(o, o + s) for o, s in zip(offs, sizes))].flatten()
                             for offs, sizes in boxes])
            assert torch.equal(got, torch.arange(start, stop)), (shape, start, stop)


def test_pieces_of_flat_fragments_save_and_load_as_the_global_tensor(tmp_path):
    """ZeRO-like fragments (uneven flat ranges of each TP shard) written as pieces read back exactly.

    The global tensor is split into two TP shards along dim 1, and each shard's
    row-major elements into three DP fragments at other points; one process
    writes every piece, as the ranks of a job would between them.
    """
    full = torch.randn(6, 4, 3)
    splits = {0: (0, 7, 30, 36), 1: (0, 19, 20, 36)}  # per TP rank: fragment boundaries
    pieces = []
    for tp_rank, bounds in splits.items():
        shard = full[:, 2 * tp_rank:2 * tp_rank + 2, :].contiguous()
        for start, stop in zip(bounds, bounds[1:]):
            fragment = shard.flatten()[start:stop].clone()
            pieces += RowMajorPieces.from_fragment(fragment, start, shard.shape, full.shape,
                                                   (0, 2 * tp_rank, 0)).pieces()
    dcp.save({"x": RowMajorPieces(full.shape, pieces, full.dtype, full.device)}, checkpoint_id=str(tmp_path))
    target = {"x": torch.zeros_like(full)}
    dcp.load(target, checkpoint_id=str(tmp_path))
    assert torch.equal(target["x"], full)


def test_pieces_are_views_not_copies():
    fragment = torch.arange(10.0)
    pieces = RowMajorPieces.from_fragment(fragment, 3, (4, 5), (4, 5), (0, 0))
    for _, piece in pieces.pieces():
        assert piece.untyped_storage().data_ptr() == fragment.untyped_storage().data_ptr()
    with pytest.raises(TypeError):  # not a tensor to compute with
        torch.add(pieces, 1)


def test_trainer_frees_gradients_before_writing(parity_data, tmp_path, ctx, monkeypatch):
    trainer = Trainer(load_config(None, tiny_overrides(parity_data, tmp_path / "run")), ctx)
    batches = iter(trainer.loader)
    trainer.train_step([trainer._to_device(next(batches))])
    trainer.step = 1
    assert any(p.grad is not None for p in trainer.model.parameters())
    seen = []
    real_save = dcp.save

    def save(state_dict, **kwargs):
        seen.append([n for n, p in trainer.model.named_parameters() if p.grad is not None])
        return real_save(state_dict, **kwargs)

    monkeypatch.setattr(dcp, "save", save)
    trainer.save()
    assert seen == [[]], f"gradients still allocated while saving: {seen}"
