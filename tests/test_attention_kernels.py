"""Attention without a T×T mask (:mod:`rlt_scale.model.attention`).

Two claims. Values: :func:`document_attention` is today's masked attention,
``attend(q, k, v, visibility(...))``, in output and in every gradient, for
single and packed documents, queries at an offset, windows, and tiles that
cut documents. Compared in float64 to 1e-12: both sides run the same SDPA
kernel over the same visible keys and differ only in the order of sums over
at most a few dozen terms, so anything above ~1e-15 would be a real error.
Memory: no tensor that the encoder's forward and backward create, or that
autograd saves, grows like T² (doubling T doubles the largest one; a mask
would quadruple it).
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rlt_scale.model import attention
from rlt_scale.model.attention import document_attention
from rlt_scale.model.layers import attend, document_positions, visibility

TOL = dict(rtol=0.0, atol=1e-12)


def _docs(lengths_per_row: list[list[int]]) -> torch.Tensor:
    """Document ids ``[B, T]`` from each row's document lengths."""
    return torch.tensor([sum(([i] * n for i, n in enumerate(row)), []) for row in lengths_per_row])


SINGLE = [[17], [17]]
PACKED = [[3, 9, 5], [10, 7]]  # documents end mid-tile and mid-row, differently per row
MANY = [[1, 1, 4, 2, 6, 3], [5, 1, 1, 1, 9]]  # one-token documents too


def _check(lengths, sq: int, window, tile: int, monkeypatch, single_document=False, seed=0):
    """document_attention against attend(visibility) for queries = the last ``sq`` of the keys."""
    monkeypatch.setattr(attention, "TILE", tile)
    doc = _docs(lengths)
    pos = document_positions(doc)
    b, sk = doc.shape
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(b, 3, n, 4, dtype=torch.float64, generator=g).requires_grad_() for n in (sq, sk, sk))
    q_pos, q_doc = pos[:, sk - sq:], doc[:, sk - sq:]

    out = document_attention(q, k, v, q_pos, q_doc, pos, doc, window, single_document=single_document)
    ref = attend(q, k, v, visibility(q_pos, q_doc, pos, doc, window))
    weights = torch.randn(ref.shape, dtype=torch.float64, generator=g)
    grads = torch.autograd.grad((out * weights).sum(), (q, k, v))
    ref_grads = torch.autograd.grad((ref * weights).sum(), (q, k, v))

    torch.testing.assert_close(out, ref, **TOL)
    for name, got, want in zip("qkv", grads, ref_grads):
        torch.testing.assert_close(got, want, **TOL, msg=lambda m: f"d{name}: {m}")
    assert ref_grads[2].abs().sum() > 0  # the comparison is not vacuous (dk is 0 for W=1: one key per query)


@pytest.mark.parametrize("lengths", [SINGLE, PACKED, MANY], ids=["single", "packed", "many"])
@pytest.mark.parametrize("sq", [17, 9, 1], ids=lambda s: f"sq{s}")
@pytest.mark.parametrize("window", [None, 1, 3, 100], ids=lambda w: f"W{w}")
@pytest.mark.parametrize("tile", [4, 5, 256])  # 17 keys: never a multiple of the tile
def test_equals_masked_attention(lengths, sq, window, tile, monkeypatch):
    _check(lengths, sq, window, tile, monkeypatch)


@pytest.mark.parametrize("sq", [17, 6])
@pytest.mark.parametrize("window", [None, 3])
def test_single_document_promise(sq, window, monkeypatch):
    """``single_document=True`` (no host read) gives the same numbers."""
    _check(SINGLE, sq, window, 4, monkeypatch, single_document=True)


def test_inputs_out_of_order_still_exact(monkeypatch):
    """Where the span bounds would be unsafe (ids that decrease, positions that skip),
    every tile reads every key: the rule still holds exactly."""
    monkeypatch.setattr(attention, "TILE", 4)
    g = torch.Generator().manual_seed(3)
    doc = torch.tensor([[2, 2, 2, 0, 0, 1, 1, 1, 1, 0, 0]])
    pos = torch.tensor([[0, 2, 5, 0, 1, 0, 1, 2, 3, 2, 3]])  # doc 0 comes back later: it sees its start
    q, k, v = (torch.randn(1, 2, 11, 4, dtype=torch.float64, generator=g) for _ in range(3))
    for window in (None, 2):
        mask = visibility(pos, doc, pos, doc, window)
        torch.testing.assert_close(document_attention(q, k, v, pos, doc, pos, doc, window), attend(q, k, v, mask),
                                   **TOL)


# ---------------------------------------------------------------- memory
class LargestTensor(TorchDispatchMode):
    """Tracks the largest output (in elements) of every op run under it."""

    def __init__(self):
        super().__init__()
        self.largest, self.op = 0, None

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and t.numel() > self.largest:
                self.largest, self.op = t.numel(), func
                self.shape = tuple(t.shape)
        return out


def _encoder_footprint(model, length: int, packed: bool) -> tuple[int, int]:
    """Largest tensor created, and largest saved for backward, in the encoder's forward + backward."""
    g = torch.Generator().manual_seed(length)
    tokens = torch.randint(0, model.cfg.vocab_size, (1, length), generator=g)
    doc = (torch.arange(length) // 300)[None] if packed else torch.zeros_like(tokens)  # documents of 300 tokens
    pos = document_positions(doc)
    saved = [0]

    def keep(t):
        saved[0] = max(saved[0], t.numel())
        return t

    with LargestTensor() as created, torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        e, _ = model.encode(tokens, pos, doc)
        e.square().sum().backward()
    return created.largest, saved[0]


@pytest.mark.parametrize("packed", [False, True], ids=["single", "packed"])
def test_encoder_memory_is_linear_in_length(make_model, packed):
    """Doubling T at most doubles the largest tensor (a T×T mask would quadruple it)."""
    model = make_model(feedback_block=0)
    (created_1k, saved_1k), (created_2k, saved_2k) = (_encoder_footprint(model, n, packed) for n in (1024, 2048))
    assert created_2k <= 2.1 * created_1k, (created_1k, created_2k)
    assert saved_2k <= 2.1 * saved_1k, (saved_1k, saved_2k)
    assert created_2k < 2048 * 2048 / 4  # nowhere near one mask of the sample


@pytest.mark.parametrize("window", [None, 8])
def test_tiled_memory_is_linear_in_length(window, monkeypatch):
    """The tiled path itself, packed documents: the largest tensor is a tile's mask."""
    monkeypatch.setattr(attention, "TILE", 64)
    largest = {}
    for length in (512, 1024):
        doc = (torch.arange(length) // 100)[None]
        pos = document_positions(doc)
        q, k, v = (torch.randn(1, 2, length, 4, requires_grad=True) for _ in range(3))
        with LargestTensor() as created:
            document_attention(q, k, v, pos, doc, pos, doc, window).sum().backward()
        largest[length] = created.largest
    assert largest[1024] <= 2.1 * largest[512], largest
