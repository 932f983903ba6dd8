"""The Jacobi decoder (model.decoder_solver=jacobi, docs/JACOBI.md) against the sequential walk.

float64 throughout. Where the solver runs to the exact fixed point (tolerance
0, a budget of at least one sweep per feedback block) it computes the same
function as the sequential decoder and its implicit gradient is the same
gradient, so they agree to rounding: 1e-10, as everywhere two paths must
agree (test_model_semantics). With a tolerance, the bound is stated where it
is tested.
"""

from __future__ import annotations

import pytest
import torch

from helpers import grads, layout_overrides, merge_pipeline_stages, torchrun
from rlt_scale.config import Config, ModelConfig, ParallelConfig, load_config
from rlt_scale.errors import ConfigError
from rlt_scale.model.layers import document_positions
from rlt_scale.model.rlt import feedback_segments
from rlt_scale.training import jacobi
from rlt_scale.training.bptt import BPTT, run_sequence

TOL = 1e-10
LENGTH = 13


@pytest.fixture(autouse=True)
def fresh_reporting(monkeypatch):
    """Every test starts with no solver statistics and its own budget of fall-back warnings."""
    jacobi.STATS.drain()
    monkeypatch.setattr(jacobi, "_warned", 0)


def _batch(seed=0, batch=2, length=LENGTH, vocab=23, packed=True):
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab, (batch, length + 1), generator=g)
    mask = torch.rand(batch, length + 1, generator=g) > 0.2
    doc = None
    if packed:  # row 0 packs two documents, the second starting inside a K=3 block and a chunk
        doc = torch.zeros_like(tokens)
        doc[0, 5:] = 1
    return tokens, doc, mask


def _run(model, tokens, doc, mask, bptt, solver="sequential", tol=0.0, sweeps=LENGTH):
    """(loss, logits or None, gradients) of one batch under ``solver``."""
    model.cfg.decoder_solver, model.cfg.jacobi_tol, model.cfg.jacobi_max_sweeps = solver, tol, sweeps
    model.zero_grad(set_to_none=True)
    out = run_sequence(model, tokens, doc, mask, bptt, want_logits=True)
    loss = out.loss_sum / out.n_targets
    loss.backward()
    return loss.detach(), out.logits, grads(model)


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _relative(a: dict, b: dict) -> float:
    """Norm of the difference of all gradients over the norm of ``b``'s."""
    flat = lambda g: torch.cat([g[k].flatten() for k in sorted(g)])  # noqa: E731
    return ((flat(a) - flat(b)).norm() / flat(b).norm()).item()


LAYOUTS = {"whole": BPTT(), "chunks": BPTT(chunk_size=5), "chunks-ckpt": BPTT(chunk_size=5, checkpoint=True)}


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("tie", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_exact_sweeps_equal_the_sequential_decoder(make_model, k, tie, layout):
    """Enough sweeps (one per position) reach the fixed point exactly: logits, loss and
    every gradient equal the sequential walk's, for blocks, packed documents and chunks."""
    model = make_model(feedback_block=k, tie_layers=tie)
    tokens, doc, mask = _batch()
    bptt = LAYOUTS[layout]
    ref_loss, ref_logits, ref = _run(model, tokens, doc, mask, bptt)
    loss, logits, got = _run(model, tokens, doc, mask, bptt, "jacobi")
    assert abs(loss - ref_loss) <= TOL
    if not bptt.checkpoint:
        assert (logits - ref_logits).abs().max().item() <= TOL
    assert _max_diff(got, ref) <= TOL
    stats = jacobi.STATS.drain()
    assert stats["jacobi_fallbacks"] == stats["jacobi_adjoint_fallbacks"] == 0
    assert stats["jacobi_residual"] == stats["jacobi_adjoint_residual"] == 0.0


@pytest.mark.parametrize("detach", [("s", "cache"), ("s", "cache", "memory")])
def test_truncated_bptt_follows_the_same_rules(make_model, detach):
    model = make_model(feedback_block=3)
    tokens, doc, mask = _batch(seed=1)
    bptt = BPTT(chunk_size=4, tbptt_chunks=1, detach=frozenset(detach))
    ref_loss, _, ref = _run(model, tokens, doc, mask, bptt)
    loss, _, got = _run(model, tokens, doc, mask, bptt, "jacobi")
    assert abs(loss - ref_loss) <= TOL
    assert _max_diff(got, ref) <= TOL


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("tol", [1e-4, 1e-6])
def test_tolerance_bounds_the_gradient_error(make_model, k, tol):
    """Stopped at ``tol``: residuals reported <= tol, and relative errors of loss and gradient <= tol.

    Why that bound. The solver stops when the last sweep moved every
    position's feedback by at most ``tol`` (relative), and the adjoint
    likewise. For a map that contracts by rho per sweep, the distance left
    to the fixed point is at most rho / (1 - rho) times that last step, so
    at most ``tol`` when rho <= 1/2; the test checks rho <= 1/2 on the
    residuals it saw. The loss and the gradient are smooth in the feedback
    and linear in the adjoint, so relative errors of ``tol`` there give
    relative errors of order ``tol`` in them (measured here: 0.01-0.1 tol).
    Shown on 3 seeds, random init with alpha = 0.1 (the default).
    """
    for seed in range(3):
        model = make_model(seed=seed, feedback_block=k, feedback_scale=0.1)
        tokens, doc, mask = _batch(seed=seed, batch=4, length=40)
        ref_loss, _, ref = _run(model, tokens, doc, mask, BPTT(), sweeps=40)
        loss, _, got = _run(model, tokens, doc, mask, BPTT(), "jacobi", tol=tol, sweeps=40)
        stats = jacobi.STATS.drain()
        assert stats["jacobi_fallbacks"] == stats["jacobi_adjoint_fallbacks"] == 0
        assert stats["jacobi_residual"] <= tol and stats["jacobi_adjoint_residual"] <= tol
        assert stats["jacobi_sweeps_max"] < 40 / k  # it stopped early: the bound is not trivially met
        assert abs(loss - ref_loss) <= tol * abs(ref_loss)
        assert _relative(got, ref) <= tol
        trace = _residuals(model, tokens[:, :-1], doc[:, :-1], tol)
        assert max(b / a for a, b in zip(trace[1:], trace[2:])) <= 0.5  # rho, after the first guess


def _residuals(model, x, doc, tol) -> list[float]:
    """The largest residual of every forward sweep over ``x`` until ``tol``."""
    pos = document_positions(doc)
    trace = []
    with torch.no_grad():
        e, _ = model.encode(x, pos, doc)
        span = jacobi.Span(model, e, pos, doc, model.build_memory(e, pos, doc), model.initial_state(len(x), "cpu"),
                           0, feedback_segments(pos, model.cfg.feedback_block))
        jacobi.sweep(span, tol, x.shape[1], trace)
    return trace


def _sequential_and_fallen_back(model, capsys, forward_sweeps, adjoint_sweeps=None):
    tokens, doc, mask = _batch()
    bptt = BPTT(chunk_size=7)
    ref_loss, ref_logits, ref = _run(model, tokens, doc, mask, bptt)
    model.cfg.decoder_solver, model.cfg.jacobi_tol, model.cfg.jacobi_max_sweeps = "jacobi", 1e-12, forward_sweeps
    model.zero_grad(set_to_none=True)
    out = run_sequence(model, tokens, doc, mask, bptt, want_logits=True)
    if adjoint_sweeps is not None:  # the adjoint reads its budget when backward runs
        model.cfg.jacobi_max_sweeps = adjoint_sweeps
    (out.loss_sum / out.n_targets).backward()
    assert abs(out.loss_sum / out.n_targets - ref_loss) <= TOL
    assert (out.logits - ref_logits).abs().max().item() <= TOL
    assert _max_diff(grads(model), ref) <= TOL
    return jacobi.STATS.drain(), capsys.readouterr().out


@pytest.mark.parametrize("k", [1, 3])
def test_no_convergence_falls_back_to_the_sequential_result_and_says_so(make_model, capsys, k):
    """alpha = 1: far from contractive; 2 sweeps leave most positions unsolved."""
    model = make_model(feedback_block=k, feedback_scale=1.0)
    stats, log = _sequential_and_fallen_back(model, capsys, forward_sweeps=2)
    assert stats["jacobi_fallbacks"] == 2  # both chunks
    assert stats["jacobi_residual"] <= 1e-12  # what was kept
    assert log.count("warning: jacobi decoder: positions") == 2
    assert "sequential decoder from position" in log


def test_adjoint_out_of_budget_falls_back_to_autograd_and_says_so(make_model, capsys):
    model = make_model(feedback_block=1, feedback_scale=0.5)
    stats, log = _sequential_and_fallen_back(model, capsys, forward_sweeps=LENGTH, adjoint_sweeps=2)
    assert stats["jacobi_fallbacks"] == 0 and stats["jacobi_adjoint_fallbacks"] == 2
    assert "warning: jacobi decoder: adjoint of positions" in log and "sequential autograd before" in log


def test_no_feedback_has_nothing_to_solve(make_model):
    """K=0: the sequential walk is already one parallel pass; the Jacobi setting changes nothing."""
    model = make_model(feedback_block=0)
    tokens, doc, mask = _batch()
    ref_loss, _, ref = _run(model, tokens, doc, mask, BPTT(chunk_size=5))
    loss, _, got = _run(model, tokens, doc, mask, BPTT(chunk_size=5), "jacobi")
    assert loss == ref_loss and _max_diff(got, ref) == 0
    assert jacobi.STATS.drain() == {}


def test_evaluation_runs_without_autograd(make_model):
    model = make_model(feedback_block=1)
    tokens, doc, mask = _batch()
    with torch.no_grad():
        ref = run_sequence(model, tokens, doc, mask, BPTT(chunk_size=5), want_logits=True)
        model.cfg.decoder_solver, model.cfg.jacobi_tol = "jacobi", 0.0
        got = run_sequence(model, tokens, doc, mask, BPTT(chunk_size=5), want_logits=True)
    assert (got.logits - ref.logits).abs().max().item() <= TOL
    assert "jacobi_adjoint_sweeps" not in jacobi.STATS.drain()


@pytest.mark.parametrize("key, value, message", [
    ("decoder_solver", "newton", "model.decoder_solver"),
    ("jacobi_tol", -1e-6, "model.jacobi_tol"),
    ("jacobi_max_sweeps", 0, "model.jacobi_max_sweeps"),
])
def test_config_errors_name_the_key(key, value, message):
    with pytest.raises(ConfigError, match=message):
        ModelConfig(**{key: value}).validate()


def test_pipeline_parallelism_is_refused_naming_both_keys():
    cfg = Config(model=ModelConfig(decoder_solver="jacobi"), parallel=ParallelConfig(pp=2))
    with pytest.raises(ConfigError, match=r"model\.decoder_solver.*parallel\.pp=2"):
        cfg.validate()
    with pytest.raises(ConfigError, match="model.jacobi_tol"):
        load_config(None, ["model.jacobi_tol=nan"])


def test_trainer_logs_sweeps_and_residuals(parity_data, tmp_path, ctx):
    from helpers import step_records, tiny_overrides
    from rlt_scale.training.trainer import Trainer

    cfg = load_config(None, tiny_overrides(parity_data, tmp_path, **{
        "trainer.max_steps": 2, "model.decoder_solver": "jacobi", "model.jacobi_tol": 1e-5}))
    Trainer(cfg, ctx).fit()
    for record in step_records(tmp_path):
        assert record["jacobi_sweeps"] >= 1 and record["jacobi_adjoint_sweeps"] >= 1
        assert record["jacobi_residual"] <= 1e-5 and record["jacobi_adjoint_residual"] <= 1e-5
        assert record["jacobi_fallbacks"] == 0


@pytest.mark.slow
def test_tensor_parallel_jacobi_equals_one_sequential_process(tmp_path, layout_data):
    """TP=2 splits the decoder's heads and FFN under the solver as under the walk: same losses,
    norms and gradients as one sequential process, to the TP tolerance of test_parallel_layouts
    (megatron's vocab-parallel cross-entropy computes in float32: 1e-5 relative).

    Two sweeps per chunk of 4 cannot finish it: every chunk keeps a converged head (implicit
    gradient) and falls back for the rest, so both paths run under TP, and the warnings show
    that the solver did run. The ranks agree on every decision (the residual is all-reduced).
    """
    schedule = ["model.feedback_block=1", "trainer.chunk_size=4", "trainer.activation_checkpointing=chunk"]
    solver = ["model.decoder_solver=jacobi", "model.jacobi_tol=0", "model.jacobi_max_sweeps=2"]

    def run(name, nproc, extra):
        out = tmp_path / f"{name}.pt"
        proc = torchrun("tests/workers/layout_step.py", nproc,
                        [str(out)] + layout_overrides(layout_data, tmp_path / name, 4, "float64", schedule + extra))
        stages = [torch.load(f, weights_only=True) for f in sorted(tmp_path.glob(f"{name}.pt.stage*"))]
        return merge_pipeline_stages(stages, agree=("losses", "norms")), proc.stdout

    (ref, _), (got, log) = run("ref", 1, []), run("tp2", 2, ["parallel.tp=2"] + solver)
    assert "sequential decoder from position 2" in log
    for a, b in zip(got["losses"] + got["norms"], ref["losses"] + ref["norms"]):
        assert abs(a - b) <= 1e-5 * abs(b)
    for name, g in ref["grads"].items():
        assert ((got["grads"][name] - g).abs().max() / g.abs().max().clamp(min=1e-30)).item() <= 1e-5, name
    assert got["tp_replicas_agree"]


def test_a_nan_residual_is_not_converged():
    """NaN compares false both ways, so it must become an infinite residual: not converged, above tol
    (the fall-back starts there), and visible in the logged maximum."""
    old = torch.zeros(2, 3, 4, dtype=torch.float64)
    new = torch.ones(2, 3, 4, dtype=torch.float64)
    new[1, 1, 2] = float("nan")
    r = jacobi.residual(new, old)
    assert r[1] == float("inf") and not bool(r.max() <= 1e-6)
    assert (r > 1e-6).nonzero().flatten().tolist() == [0, 1, 2]
    assert max(0.5, float(r.max())) == float("inf")
