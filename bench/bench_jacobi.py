"""The Jacobi decoder (model.decoder_solver=jacobi, docs/JACOBI.md): sweeps, gradient error, step time, H100 on paper.

    python bench/bench_jacobi.py sweeps --run /tmp/jt/seq            # sweeps to tol, tiny ckpts + random init
    python bench/bench_jacobi.py sweeps --mid --lengths 128 512      # the rlt-100m shape, random init
    python bench/bench_jacobi.py grads  --run /tmp/jt/seq            # loss/grad error against sequential
    python bench/bench_jacobi.py step   --run /tmp/jt/seq            # train-step wall time, interleaved
    python bench/bench_jacobi.py paper  --sweeps 4 3                 # rlt-48x48 on H100, arithmetic
    python bench/bench_jacobi.py curves --runs seq=/tmp/jt/seq jacobi=/tmp/jt/jac   # loss curves of two runs

One thread (``--threads 1``, the default) on a shared 2-core box. Sweep
counts are read from ``jacobi.STATS`` (what ``engine.metrics()`` logs as
``jacobi_sweeps`` / ``jacobi_adjoint_sweeps``), one forward + backward per
cell, the whole sample as one chunk unless ``--chunk`` says otherwise (so a
longer T is a longer fixed-point problem, not more chunks). Tokens: the tiny
model reads the stdlib eval split (its 128-token samples concatenated in file
order, as one document); the 100m shape reads random ids (it has no trained
tokenizer data here). Every result carries the 1-minute load average.
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import time
from pathlib import Path

import torch

from common import ROOT, machine, model_config, print_table, set_threads, warn_if_busy, write_results

from rlt_scale.config import OptimizerConfig, load_config
from rlt_scale.profiling.workload import Workload, make_model, make_tokens, train_step
from rlt_scale.training import jacobi
from rlt_scale.training.bptt import BPTT, run_sequence
from rlt_scale.training.optim import build_optimizer


def load1() -> float:
    return round(os.getloadavg()[0], 2)


def eval_tokens(batch: int, length: int, path: str = "data/stdlib/eval") -> torch.Tensor:
    """``[batch, length+1]`` ids of the eval split: its samples' first 128 tokens, concatenated in file order."""
    from rlt_scale.data.shards import iter_tar_samples, load_npy

    parts = []
    for shard in sorted((ROOT / path).glob("shard-*.tar")):
        for _, sample in iter_tar_samples(shard.read_bytes()):
            parts.append(torch.from_numpy(load_npy(sample["tokens.npy"]).astype("int64"))[:-1])
    flat = torch.cat(parts)
    need = batch * (length + 1)
    if flat.numel() < need:
        raise SystemExit(f"eval split has {flat.numel()} tokens, need {need}")
    return flat[:need].view(batch, length + 1)


def tiny_models(run: str | None, alphas=(0.1, 0.5, 1.0)) -> list[tuple[str, object]]:
    """(label, model): the run's checkpoints (step 0 = the trainer's seeded init), then random init per alpha."""
    from rlt_scale.export import load_checkpoint_model

    out = []
    base = load_config(str(ROOT / "configs/tiny.yaml")).model
    if run:
        out.append(("trained step 0 (init, a=0.1)", make_model(base, seed=0)))
        for ckpt in sorted((Path(run) / "checkpoints").glob("step_*")):
            model, _, _ = load_checkpoint_model(run, ckpt)
            out.append((f"trained step {int(ckpt.name.split('_')[1])} (a=0.1)", model))
    for a in alphas:
        cfg, _ = model_config("tiny", (f"feedback_scale={a}",))
        out.append((f"random init a={a}", make_model(cfg, seed=1)))
    return out


def solve_once(model, tokens, solver: str, tol: float, max_sweeps: int, chunk: int) -> dict:
    """One forward + backward; the solver's metrics (jacobi.STATS), loss and time."""
    model.cfg.decoder_solver, model.cfg.jacobi_tol, model.cfg.jacobi_max_sweeps = solver, tol, max_sweeps
    model.zero_grad(set_to_none=True)
    jacobi.STATS.drain()
    t0 = time.perf_counter()
    out = run_sequence(model, tokens, bptt=BPTT(chunk_size=chunk))
    loss = out.loss_sum / out.n_targets
    loss.backward()
    stats = jacobi.STATS.drain()
    stats.update(loss=float(loss.detach()), seconds=round(time.perf_counter() - t0, 2), load=load1())
    return stats


def cmd_sweeps(args) -> None:
    rows, results = [], []
    if args.mid:
        models = []
        for a in args.alphas:
            cfg, _ = model_config("mid", (f"feedback_scale={a}",))
            models.append((f"rlt-100m random init a={a}", make_model(cfg, seed=1)))
        tokens_for = lambda m, t: make_tokens(m.cfg, Workload(args.batch, t), seed=0)  # noqa: E731
    else:
        models = tiny_models(args.run, args.alphas)
        tokens_for = lambda m, t: eval_tokens(args.batch, t)  # noqa: E731
    for label, model in models:
        for length in args.lengths:
            tokens = tokens_for(model, length)
            for tol in args.tols:
                s = solve_once(model, tokens, "jacobi", tol, args.max_sweeps, args.chunk)
                cell = dict(model=label, T=length, tol=tol, batch=args.batch, chunk=args.chunk or length,
                            max_sweeps=args.max_sweeps, **s)
                results.append(cell)
                rows.append([label, length, f"{tol:g}", f"{s['jacobi_sweeps']:g}", s["jacobi_fallbacks"],
                             f"{s['jacobi_residual']:.1e}", f"{s['jacobi_adjoint_sweeps']:g}",
                             s["jacobi_adjoint_fallbacks"], f"{s['jacobi_adjoint_residual']:.1e}",
                             f"{s['seconds']:.1f}", f"{s['load']:.2f}"])
                print_table(["model", "T", "tol", "fwd sweeps", "fb", "residual", "adj sweeps", "fb", "residual",
                             "s", "load"], rows[-1:])
    info = machine()
    warn_if_busy(info)
    print_table(["model", "T", "tol", "fwd sweeps", "fb", "residual", "adj sweeps", "fb", "residual", "s", "load"],
                rows, f"Jacobi sweeps to tol (B={args.batch}, one chunk per sample unless --chunk)")
    write_results(args.out, {"machine": info, "args": vars(args), "results": results})


def _flat_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]).double()


def cmd_grads(args) -> None:
    """Loss and gradient of jacobi at each tol (and at tol=0, the exact fixed point) against sequential."""
    rows, results = [], []
    tokens = eval_tokens(args.batch, args.lengths[0])
    for label, model in tiny_models(args.run, args.alphas):
        ref = solve_once(model, tokens, "sequential", 0.0, 1, args.chunk)
        g_ref = _flat_grads(model)
        for tol in [*args.tols, 0.0]:
            s = solve_once(model, tokens, "jacobi", tol, args.max_sweeps, args.chunk)
            g = _flat_grads(model)
            rel_g = float((g - g_ref).norm() / g_ref.norm())
            rel_l = abs(s["loss"] - ref["loss"]) / abs(ref["loss"])
            results.append(dict(model=label, tol=tol, loss_seq=ref["loss"], loss_jacobi=s["loss"], rel_loss=rel_l,
                                rel_grad=rel_g, grad_norm=float(g_ref.norm()), **{k: v for k, v in s.items()
                                                                                   if k.startswith("jacobi")}))
            rows.append([label, f"{tol:g}", f"{rel_l:.1e}", f"{rel_g:.1e}", f"{float(g_ref.norm()):.3g}",
                         f"{s['jacobi_sweeps']:g}", f"{s['jacobi_adjoint_sweeps']:g}",
                         s["jacobi_fallbacks"] + s["jacobi_adjoint_fallbacks"], f"{s['load']:.2f}"])
    info = machine()
    print_table(["model", "tol", "|dloss|/loss", "|dgrad|/|grad|", "|grad|", "fwd sw", "adj sw", "fallbacks", "load"],
                rows, f"Jacobi against sequential, float32, B={args.batch} T={args.lengths[0]} chunk {args.chunk}")
    write_results(args.out, {"machine": info, "args": vars(args), "results": results})


def cmd_step(args) -> None:
    """Train-step wall time (forward, backward, clip, AdamW), sequential against jacobi, interleaved round by round."""
    from rlt_scale.export import load_checkpoint_model

    shapes = {"tiny d=64 (random init)": ("tiny", ())}
    if args.run:
        shapes["tiny d=64 (trained step 150)"] = ("ckpt", ())
    shapes["d=512 (tiny depth, random init)"] = ("tiny", ("d_model=512", "n_heads=8"))
    work = Workload(args.batch, args.lengths[0], chunk_size=args.chunk)
    variants = {}
    for name, (kind, over) in shapes.items():
        if kind == "ckpt":
            model, _, _ = load_checkpoint_model(args.run)
            model.train()
        else:
            cfg, _ = model_config("tiny", over)
            model = make_model(cfg, seed=1)
        tokens = eval_tokens(args.batch, args.lengths[0])
        opt = build_optimizer(model, OptimizerConfig())
        for group in opt.param_groups:  # lr 0: the weights (and so the sweep counts) stay put; the work is the same
            group["lr"] = 0.0
        for solver in ("sequential", "jacobi"):
            variants[(name, solver)] = (model, opt, tokens)
    times = {k: [] for k in variants}
    sweeps = {k: [] for k in variants}
    loads = []

    def step(key):
        model, opt, tokens = variants[key]
        model.cfg.decoder_solver, model.cfg.jacobi_tol, model.cfg.jacobi_max_sweeps = key[1], args.tols[0], \
            args.max_sweeps
        jacobi.STATS.drain()
        t0 = time.perf_counter()
        train_step(model, opt, tokens, work)
        dt = time.perf_counter() - t0
        return dt, jacobi.STATS.drain()

    for key in variants:  # warm-up
        step(key)
    for r in range(args.rounds):
        loads.append(load1())
        for key in variants:
            dts = []
            for _ in range(args.steps):
                dt, st = step(key)
                dts.append(dt)
                if st:
                    sweeps[key].append((st["jacobi_sweeps"], st["jacobi_adjoint_sweeps"]))
            times[key].append(statistics.median(dts))
        print(f"round {r + 1}/{args.rounds} load {loads[-1]}: " +
              ", ".join(f"{k[0]}/{k[1]} {1e3 * times[k][-1]:.0f}ms" for k in variants), flush=True)
    rows, results = [], []
    for name in shapes:
        seq, jac = times[(name, "sequential")], times[(name, "jacobi")]
        ratios = [j / s for j, s in zip(jac, seq)]
        sw = sweeps[(name, "jacobi")]
        fs, as_ = statistics.median(x for x, _ in sw), statistics.median(y for _, y in sw)
        results.append(dict(shape=name, sequential_ms=[1e3 * x for x in seq], jacobi_ms=[1e3 * x for x in jac],
                            ratio_per_round=ratios, median_ratio=statistics.median(ratios),
                            jacobi_sweeps=fs, jacobi_adjoint_sweeps=as_))
        rows.append([name, f"{1e3 * statistics.median(seq):.0f}", f"{1e3 * statistics.median(jac):.0f}",
                     f"{statistics.median(ratios):.2f}", f"{min(ratios):.2f}-{max(ratios):.2f}", f"{fs:g}/{as_:g}"])
    info = machine()
    warn_if_busy(info)
    print_table(["shape", "sequential ms", "jacobi ms", "jacobi/seq", "range", "sweeps fwd/adj"], rows,
                f"Train step, {work.describe()}, tol {args.tols[0]:g}, {args.rounds} rounds x {args.steps} steps, "
                f"loads {loads}")
    write_results(args.out, {"machine": info, "args": vars(args), "loads": loads, "results": results})


def cmd_paper(args) -> None:
    """rlt-48x48 on H100 from the project's cost model: the sequential decoder bound against Jacobi sweeps.

    Sequential: ``decoder_step_bound`` (bandwidth: every decoder step reads the rank's decoder weights for
    ``sequences`` tokens) and its FLOP bound (``analytic_flops``, 3 x useful forward per token, 40% MFU).
    Jacobi, per chunk of C positions of ``sequences`` sequences on one rank (jacobi needs PP=1, so TP=8 PP=1):
    decoder passes in units of one parallel forward (K=0-like) over all n*C positions:
    ``fwd_sweeps`` (no grad) + 1 (rebuild with autograd) + ``adj_sweeps`` (VJPs for input gradients, ~1 fwd each)
    + 2 (the final backward with weight gradients); encoder, memory and readout 3 x forward as before.
    Bytes: every pass reads the rank's bf16 decoder weights once; the weight gradients are read-modified-written
    once per chunk; the window and memory keys are loaded once per tile of ``--query-tile`` queries per pass
    (a fused attention kernel), not once per position as a sequential step must.
    """
    from rlt_scale.profiling.bandwidth import HBM_BYTES_PER_S, decoder_step_bound
    from rlt_scale.profiling.flops import analytic_flops
    from rlt_scale.profiling.memory import layer_params

    cfg = load_config(str(ROOT / "configs/rlt-48x48.yaml"))
    m, tp, pp, chunk = cfg.model, cfg.parallel.tp, cfg.parallel.pp, cfg.trainer.chunk_size
    T = args.lengths[0]
    bw = HBM_BYTES_PER_S[args.hbm]
    peak, mfu = 989e12, 0.4
    fs, as_ = args.sweeps
    report = analytic_flops(m, Workload(1, T))
    per_tok = report.model_flops / T
    dec_fwd = sum(c.model for name, c in report.by_layer().items()
                  if name.startswith("decoder.") or name == "merge") / T
    rest_fwd = report.total().model / T - dec_fwd
    params = layer_params(m, tp)
    dec_params = sum(n for name, n in params.items() if name.startswith("decoder.") or name == "merge")
    if m.tie_layers:  # as decoder_step_bound counts them: the tied attention/FFN once more
        dec_params += sum(n for name, n in params.items() if name.startswith("encoder.")) - 2 * m.d_model * m.n_enc_layers
    passes = fs + 1 + as_ + 2
    jac_fpt = dec_fwd * passes + 3 * rest_fwd
    out = dict(config="configs/rlt-48x48.yaml", T=T, chunk=chunk, tp=tp, pp=pp, jacobi_tp=tp, jacobi_pp=1,
               hbm=args.hbm, bandwidth=bw, peak=peak, mfu=mfu, fwd_sweeps=fs, adj_sweeps=as_,
               model_flops_per_token=per_tok, decoder_fwd_flops_per_token=dec_fwd, other_fwd_flops_per_token=rest_fwd,
               decoder_params_per_tp_rank=dec_params, decoder_passes=passes, jacobi_flops_per_token=jac_fpt,
               rows=[])
    print(f"model FLOPs/token (3 x useful fwd) {per_tok:.4g}; decoder+merge fwd {dec_fwd:.4g}, encoder+memory+readout"
          f" fwd {rest_fwd:.4g}; Jacobi {passes:g} decoder passes -> {jac_fpt:.4g} FLOPs/token "
          f"({jac_fpt / per_tok:.2f}x); decoder params per TP rank {dec_params:,}")
    rows = []
    for n in args.sequences:
        seq = {d: decoder_step_bound(m, T, n, tp, pp, bandwidth=bw, deferred_weight_grads=d) for d in (False, True)}
        flop_bound = seq[False].flop_tokens_per_s
        tokens = n * chunk
        t_flops = tokens * jac_fpt / tp / (mfu * peak)
        w_bytes = (fs + 1 + as_ + 1) * 2 * dec_params + 2 * 4 * dec_params
        # keys of one pass: per layer, the window (carried cache + chunk) and the memory up to the chunk end,
        # loaded once per tile of query rows (fused attention); the mean chunk starts at (T - C) / 2
        start = (T - chunk) / 2
        entries = min(m.window - 1, start) + chunk + start + chunk
        per_pass_keys = n * m.n_dec_layers * math.ceil(chunk / args.query_tile) * entries * 2 * (m.d_model // tp) * 2
        k_bytes = per_pass_keys * (fs + 1 + as_ + 2)
        t_bytes = (w_bytes + k_bytes) / bw
        jac = tokens / max(t_flops, t_bytes) / tp
        best_seq = min(max(seq[False].bandwidth_tokens_per_s, seq[True].bandwidth_tokens_per_s), flop_bound)
        out["rows"].append(dict(sequences=n, sequential_bandwidth=seq[False].bandwidth_tokens_per_s,
                                sequential_bandwidth_deferred=seq[True].bandwidth_tokens_per_s,
                                sequential_flop_bound=flop_bound, jacobi_chunk_flop_s=t_flops,
                                jacobi_chunk_weight_bytes=w_bytes, jacobi_chunk_key_bytes=k_bytes,
                                jacobi_chunk_byte_s=t_bytes, jacobi_tokens_per_s=jac,
                                jacobi_binds="FLOPs" if t_flops >= t_bytes else "bandwidth"))
        rows.append([n, f"{seq[False].bandwidth_tokens_per_s:,.0f}", f"{seq[True].bandwidth_tokens_per_s:,.0f}",
                     f"{flop_bound:,.0f}", f"{1e3 * t_flops:,.1f}", f"{w_bytes / 2**30:.1f}", f"{k_bytes / 2**30:.1f}",
                     f"{1e3 * t_bytes:,.1f}", f"{jac:,.0f}", f"{jac / best_seq:.1f}x"])
    print_table(["seq/step", "seq tok/s/GPU", "seq (deferred wgrad)", "seq FLOP bound", "jac FLOP ms/chunk",
                 "jac weights GiB", "jac keys GiB", "jac byte ms/chunk", "jac tok/s/GPU", "vs best seq"], rows,
                f"rlt-48x48, T={T}, chunk {chunk}, sequential TP={tp} PP={pp}, Jacobi TP={tp} PP=1; {args.hbm} "
                f"{bw / 1e12:.2f} TB/s, {mfu:.0%} of {peak / 1e12:.0f} TFLOP/s; sweeps fwd {fs:g} adj {as_:g}")
    write_results(args.out, out)


def cmd_curves(args) -> None:
    """Loss curves of finished runs (metrics.jsonl) against the first one: train and eval loss, step by step."""
    import json

    runs = {}
    for spec in args.runs:
        label, _, path = spec.partition("=")
        rows = [json.loads(line) for line in open(Path(path) / "metrics.jsonl")]
        runs[label] = rows
    ref_label = next(iter(runs))
    ref = {(r["step"], "eval" if "eval_loss" in r else "train"): r for r in runs[ref_label]}
    table_rows, out = [], {"reference": ref_label, "runs": {k: v for k, v in runs.items()}}
    for (step, kind), r in ref.items():
        key = "eval_loss" if kind == "eval" else "loss"
        row = [step, kind, f"{r[key]:.4f}"]
        for label, rows in list(runs.items())[1:]:
            other = next((x for x in rows if x["step"] == step and (key in x)), None)
            row.append(f"{other[key] - r[key]:+.5f}" if other else "-")
        table_rows.append(row)
    print_table(["step", "loss", ref_label, *[f"{k} - {ref_label}" for k in list(runs)[1:]]], table_rows,
                "Loss curves (metrics.jsonl)")
    write_results(args.out, out)


def cmd_trace(args) -> None:
    """The largest forward residual after every sweep (``jacobi.sweep``'s ``trace``), no tolerance, T=lengths[0]."""
    traces = []
    original = jacobi.sweep

    def traced(span, tol, max_sweeps, trace=None):
        traces.append([])
        return original(span, tol, max_sweeps, traces[-1])

    jacobi.sweep = traced
    results, rows = [], []
    try:
        tokens = eval_tokens(args.batch, args.lengths[0])
        for label, model in tiny_models(args.run, args.alphas):
            traces.clear()
            with torch.no_grad():
                solve_once_forward(model, tokens, args.max_sweeps)
            tr = traces[0]
            results.append(dict(model=label, T=args.lengths[0], residual_per_sweep=tr))
            rows.append([label, *[f"{tr[i - 1]:.1e}" if i <= len(tr) else "-" for i in (1, 2, 4, 8, 16, 32, 64)]])
    finally:
        jacobi.sweep = original
    print_table(["model", "sweep 1", "2", "4", "8", "16", "32", "64"], rows,
                f"Largest forward residual after n sweeps, B={args.batch}, T={args.lengths[0]} one chunk, tol 0")
    write_results(args.out, {"machine": machine(), "args": vars(args), "results": results})


def solve_once_forward(model, tokens, max_sweeps: int) -> None:
    model.cfg.decoder_solver, model.cfg.jacobi_tol, model.cfg.jacobi_max_sweeps = "jacobi", 0.0, max_sweeps
    jacobi.STATS.drain()
    run_sequence(model, tokens, bptt=BPTT())
    jacobi.STATS.drain()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("mode", choices=["sweeps", "grads", "step", "paper", "curves", "trace"])
    p.add_argument("--run", help="a run directory with checkpoints (the tiny model trained by rlt-train)")
    p.add_argument("--mid", action="store_true", help="sweeps of the rlt-100m shape (random init) instead of tiny")
    p.add_argument("--lengths", type=int, nargs="+", default=[128, 512, 2048])
    p.add_argument("--tols", type=float, nargs="+", default=[1e-4, 1e-6])
    p.add_argument("--alphas", type=float, nargs="+", default=[0.1, 0.5, 1.0])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--chunk", type=int, default=0, help="trainer.chunk_size (0: the whole sample as one chunk)")
    p.add_argument("--max-sweeps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=3, help="steps per variant per round (step mode)")
    p.add_argument("--sweeps", type=float, nargs=2, default=[4.0, 3.0], help="paper: forward, adjoint sweeps")
    p.add_argument("--sequences", type=int, nargs="+", default=[1, 8, 64])
    p.add_argument("--query-tile", type=int, default=128, help="paper: queries per key load in a parallel pass")
    p.add_argument("--hbm", default="h100", help="paper: h100, h200 or a100")
    p.add_argument("--runs", nargs="+", default=[], help="curves: label=run_dir ... (the first is the reference)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default="jacobi")
    args = p.parse_args()
    set_threads(args.threads)
    torch.set_flush_denormal(True)
    {"sweeps": cmd_sweeps, "grads": cmd_grads, "step": cmd_step, "paper": cmd_paper, "curves": cmd_curves, "trace": cmd_trace}[args.mode](args)


if __name__ == "__main__":
    main()
