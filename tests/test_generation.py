"""Generation: the stream state saves and restores exactly; sampling filters are right;
the caches are written in place and the host reads the device only every few tokens."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from host_syncs import count_host_syncs
from rlt_scale.generation import Generator, GrowingKV, SamplingConfig, StreamState
from rlt_scale.model.state import KV


def test_stream_state_round_trips_through_a_file(make_model):
    model = make_model(feedback_block=3)
    gen = Generator(model)
    tokens = torch.randint(0, 23, (2, 12), generator=torch.Generator().manual_seed(0))
    _, state = gen.prefill(tokens[:, :5], capacity=8)  # the steps below outgrow it
    saved = state.state_dict()
    assert saved["encoder.0.k"].untyped_storage().nbytes() == saved["encoder.0.k"].nbytes  # no empty slots
    buffer = io.BytesIO()
    torch.save(saved, buffer)
    buffer.seek(0)
    restored = StreamState.from_state_dict(torch.load(buffer, weights_only=True))
    for t in range(5, 12):
        a, state = gen.step(tokens[:, t], state)
        b, restored = gen.step(tokens[:, t], restored)
        assert torch.equal(a, b)
    # and the continued stream equals teacher forcing
    assert (a - model(tokens)[:, -1]).abs().max() <= 1e-10


def test_sampling_filters_and_behaviour_logprobs():
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]]).repeat(4000, 1)
    gen = torch.Generator().manual_seed(0)
    tok, lp = Generator.sample(logits, SamplingConfig(temperature=1.0, top_k=2), gen)
    assert set(tok.tolist()) == {0, 1}
    expected = torch.log_softmax(torch.tensor([2.0, 1.0]), -1)
    assert torch.allclose(lp, expected[tok], atol=1e-6)
    assert abs((tok == 0).float().mean() - expected[0].exp()) < 0.03
    # top-p 0.5: token 0 alone has p=0.61 >= 0.5, so it is the whole support
    tok, lp = Generator.sample(logits, SamplingConfig(top_p=0.5), gen)
    assert set(tok.tolist()) == {0} and torch.allclose(lp, torch.zeros_like(lp))
    tok, _ = Generator.sample(logits[:1], SamplingConfig(temperature=0.0))
    assert tok.item() == 0


def test_generate_consumes_each_sampled_token_once(make_model):
    model = make_model()
    gen = Generator(model)
    prompt = torch.randint(0, 23, (1, 4), generator=torch.Generator().manual_seed(1))
    new, logprobs = gen.generate(prompt, 6, SamplingConfig(temperature=1.0), torch.Generator().manual_seed(2))
    full = torch.cat([prompt, new], 1)
    # Re-scoring the whole sequence teacher-forced gives the same behaviour log-probs.
    rescored = torch.log_softmax(model(full)[:, 3:-1].float(), -1).gather(-1, new[..., None])[..., 0]
    assert torch.allclose(rescored, logprobs, atol=1e-5)


# ------------------------------------------------------------------ issue #17: in place, no per-token host reads
def _concatenating_generate(model, prompt, max_new_tokens, cfg, generator, stop_token=None):
    """The generation loop before issue #17, as the reference.

    Every step concatenates the encoder's whole past and the whole memory,
    and the stop token is read on the host at every token. Returns (tokens,
    log-probs, the logits each token was sampled from).
    """
    batch, length = prompt.shape
    pos = torch.arange(length).expand(batch, length)
    e, encoder = model.encode(prompt, pos, torch.zeros_like(pos))
    memory = model.build_memory(e, pos, torch.zeros_like(pos))
    z, decoder = model.decode(e, pos, torch.zeros_like(pos), memory, model.initial_state(batch, "cpu"))
    logits = [model.logits(z)[:, -1]]
    tokens, logprobs = [], []
    for t in range(max_new_tokens):
        token, logprob = Generator.sample(logits[-1], cfg, generator)
        tokens.append(token)
        logprobs.append(logprob)
        if stop_token is not None and bool((token == stop_token).all()):
            break
        pos = torch.full((batch, 1), length + t)
        e, encoder = model.encode(token[:, None], pos, torch.zeros_like(pos), past=encoder)
        memory = [old.cat(new) for old, new in zip(memory, model.build_memory(e, pos, torch.zeros_like(pos)))]
        z, decoder = model.decode(e, pos, torch.zeros_like(pos), memory, decoder, offset=length + t)
        logits.append(model.logits(z)[:, 0])
    return torch.stack(tokens, 1), torch.stack(logprobs, 1), logits[:len(tokens)]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "sampled"])
@pytest.mark.parametrize("k", [1, 3])
def test_generate_equals_the_concatenating_loop(make_model, temperature, k):
    model = make_model(feedback_block=k)
    prompt = torch.randint(0, 23, (2, 5), generator=torch.Generator().manual_seed(4))
    cfg = SamplingConfig(temperature=temperature)
    with torch.no_grad():
        want, want_lp, want_logits = _concatenating_generate(model, prompt, 20, cfg, torch.Generator().manual_seed(5))
    got, got_lp = Generator(model).generate(prompt, 20, cfg, torch.Generator().manual_seed(5), check_every=3)
    assert torch.equal(got, want) and torch.equal(got_lp, want_lp)
    # the logits each token was drawn from, through prefill and the in-place steps: the same bits
    gen = Generator(model)
    logits, state = gen.prefill(prompt, capacity=25)
    stepped = [logits[:, -1]]
    for t in range(19):
        logits, state = gen.step(want[:, t], state)
        stepped.append(logits)
    assert all(torch.equal(a, b) for a, b in zip(stepped, want_logits))


def test_a_stop_ends_the_output_whatever_check_every_is(make_model):
    model = make_model()
    prompt = torch.randint(0, 23, (1, 3), generator=torch.Generator().manual_seed(6))
    cfg = SamplingConfig(temperature=1.0)
    free, _, _ = _concatenating_generate(model, prompt, 30, cfg, torch.Generator().manual_seed(7))
    stop = int(free[0, 9])
    first = free[0].tolist().index(stop)  # the output ends at the first stop token, kept
    want, want_lp, _ = _concatenating_generate(model, prompt, 30, cfg, torch.Generator().manual_seed(7), stop)
    assert want.shape[1] == first + 1
    for every in (1, 4, first + 1, 16, 100):
        pieces = []
        got, got_lp = Generator(model).generate(prompt, 30, cfg, torch.Generator().manual_seed(7), stop,
                                                on_tokens=lambda t, lp: pieces.append((t, lp)), check_every=every)
        assert torch.equal(got, want) and torch.equal(got_lp, want_lp), every
        # on_tokens saw the same tokens, in pieces of `every` (the last one cut at the stop)
        assert [p[0].shape[1] for p in pieces] == [every] * (first // every) + [first % every + 1], every
        assert torch.equal(torch.cat([p[0] for p in pieces], 1), want)
        assert torch.equal(torch.cat([p[1] for p in pieces], 1), want_lp)


def test_growing_kv_appends_in_place_and_grows_past_its_capacity():
    def entries(start, n):
        k = torch.arange(start, start + n, dtype=torch.float64).view(1, 1, n, 1).expand(2, 3, n, 4)
        pos = torch.arange(start, start + n).expand(2, n)
        return KV(k, -k, pos, torch.zeros_like(pos))

    store = GrowingKV(entries(0, 3), capacity=5)
    buffer = store.k
    assert store.cat(entries(3, 2)).k.data_ptr() == buffer.data_ptr() and len(store) == 5  # written in place
    store.append(entries(5, 1))  # full: the room doubles
    assert store.capacity == 10 and len(store) == 6
    want = entries(0, 6)
    assert all(torch.equal(getattr(store.view(), f), getattr(want, f)) for f in ("k", "v", "pos", "doc"))


class _CopiedBytes(TorchDispatchMode):
    """Bytes written by the operations that only move data (concatenations, copies, clones)."""

    COPIES = ("cat", "stack", "copy_", "clone", "_to_copy")

    def __init__(self):
        super().__init__()
        self.total = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if name in self.COPIES:
            written = args[0] if name == "copy_" else out  # copy_ writes into its first argument
            self.total += written.numel() * written.element_size()
        return out


@pytest.mark.parametrize("k", [1, 3])
def test_copying_per_token_does_not_grow_with_the_stream(make_model, k):
    """Bytes copied for tokens n..2n and for 2n..3n are the same: O(1) per token, not O(T)."""
    model = make_model(feedback_block=k)
    prompt = torch.randint(0, 23, (1, 4), generator=torch.Generator().manual_seed(8))
    n = 24
    copied = []
    for length in (n, 2 * n, 3 * n):
        with _CopiedBytes() as count:
            Generator(model).generate(prompt, length, SamplingConfig(temperature=0.0))
        copied.append(count.total)
    per_token = [(copied[1] - copied[0]) / n, (copied[2] - copied[1]) / n]
    assert per_token[0] == per_token[1], per_token


@pytest.mark.parametrize("k", [1, 3])
def test_generation_reads_the_device_once_per_check_not_per_token(make_model, k):
    model = make_model(feedback_block=k)
    prompt = torch.randint(0, 23, (2, 4), generator=torch.Generator().manual_seed(9))
    cfg = SamplingConfig(temperature=1.0)
    n, every = 40, 16
    free, _ = Generator(model).generate(prompt, 2 * n, cfg, torch.Generator().manual_seed(1))
    # a stop token that never ends this generation: no step where both streams sample it
    agreed = free[0][free[0] == free[1]]
    stop = next(token for token in range(23) if token not in agreed)
    syncs = {}
    for stop_token in (None, stop):
        for length in (n, 2 * n):
            with count_host_syncs() as count:
                out, _ = Generator(model).generate(prompt, length, cfg, torch.Generator().manual_seed(1),
                                                   stop_token, check_every=every)
            assert out.shape == (2, length)
            syncs[stop_token, length] = count.total
    assert syncs[None, 2 * n] == syncs[None, n]  # nothing per token
    assert syncs[stop, 2 * n] - syncs[stop, n] <= math.ceil(n / every), syncs  # one read per check
