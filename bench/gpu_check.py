"""The checks that need a GPU (issues #13 and #17), in one run of a few minutes.

    bash bench/gpu_check.sh                  # on a CUDA machine; writes bench/results/gpu_check.json
    .venv/bin/python bench/gpu_check.py --smoke --device cpu    # the same code, tiny, on a CPU (CI-sized)

Each check prints one line and records its figures; a check that fails
records its error and the others still run (exit status 1 if any failed).

* ``bf16_step``   one bf16-autocast training step of the tiny and the d=512
  configs on the device; its loss equals the float32 loss of the same
  weights and tokens computed on the CPU within ``BF16_REL`` (bf16 keeps 8
  significant bits: ~0.4% per rounding, and a loss sums many roundings).
* ``throughput``  tokens/s and MFU (analytic model FLOPs against a named
  peak) of whole optimizer steps: the layer-by-layer decoder in fp32 (TF32)
  and bf16; the fused decoder step eager, compiled, and captured as CUDA
  graphs (``decoder_compile=reduce-overhead``) in bf16.
* ``memory``      the peak allocated memory of one step against the cost
  model's per-rank total (rlt_scale.profiling.memory).
* ``generation``  sampling on the device with a device-side generator, and
  prefill logits against teacher forcing.
* ``checkpoint``  a save/load round trip of model + AdamW state through DCP:
  what the save adds to peak memory, and that every tensor comes back.
* ``attention``   the mask-free attention at T=16384 (single and packed
  documents), forward and backward: peak memory against one T x T mask.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
import traceback
from pathlib import Path

from common import machine, model_config, write_results

import torch
import torch.distributed.checkpoint as dcp

from rlt_scale.model.attention import document_attention
from rlt_scale.model.layers import document_positions
from rlt_scale.profiling.flops import analytic_flops
from rlt_scale.profiling.memory import analytic_memory
from rlt_scale.profiling.workload import Workload, make_model, make_tokens, train_step
from rlt_scale.training.bptt import run_sequence

BF16_REL = 2e-2
"""bf16 loss vs CPU fp32 loss, relative."""
PEAK_TFLOPS = {"cuda": 989.0, "cpu": 0.05}
"""Dense bf16 peak named for MFU: H100/H200 SXM datasheet (989 TFLOP/s); a nominal figure on CPU."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _peak_reset(device: torch.device) -> int:
    if device.type != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_allocated()


def _peak_since(device: torch.device, base: int) -> int | None:
    if device.type != "cuda":
        return None
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def _configs(smoke: bool) -> dict:
    """name: (model overrides, workload)."""
    if smoke:
        return {"tiny": ((), Workload(2, 16, chunk_size=8)),
                "d512": (("d_model=64", "n_heads=4"), Workload(2, 16, chunk_size=8))}
    return {"tiny": ((), Workload(32, 128, chunk_size=64)),
            "d512": (("d_model=512", "n_heads=8"), Workload(8, 128, chunk_size=64))}


def check_bf16_step(device, smoke):
    out = {}
    for name, (overrides, work) in _configs(smoke).items():
        cfg, _ = model_config("tiny", overrides)
        tokens = make_tokens(cfg, work)
        cpu = make_model(cfg, seed=0, device="cpu")
        with torch.no_grad():
            ref = run_sequence(cpu, tokens, bptt=work.bptt())
            ref_loss = float(ref.loss_sum / ref.n_targets)
        model = make_model(cfg, seed=0, device=device.type)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            got = run_sequence(model, tokens.to(device), bptt=work.bptt())
            loss = got.loss_sum / got.n_targets
        loss.backward()
        finite = all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        rel = abs(float(loss.detach()) - ref_loss) / ref_loss
        out[name] = {"cpu_fp32_loss": ref_loss, "bf16_loss": float(loss.detach()), "rel": rel, "grads_finite": bool(finite)}
        assert rel <= BF16_REL and finite, f"{name}: {out[name]}"
    return out


STEPS = {  # decoder step variant: model overrides (rlt_scale/model/fused.py)
    "layers": ("decoder_step=layers",),
    "fused": ("decoder_step=fused",),
    "compiled": ("decoder_step=fused", "decoder_compile=default"),
    "cuda_graph": ("decoder_step=fused", "decoder_compile=reduce-overhead"),
}


def check_throughput(device, smoke):
    """Whole optimizer steps: the layer-by-layer decoder in fp32 (TF32) and bf16, then the fused step
    eager, compiled and (on CUDA) captured as CUDA graphs in bf16. The first step of a compiled
    variant compiles; its time is reported as ``first_step_s``. Smoke mode skips compiling."""
    out = {}
    steps = 2 if smoke else 5
    for name, (overrides, work) in _configs(smoke).items():
        flops = None
        for variant, step_overrides in STEPS.items():
            if smoke and any(o.startswith("decoder_compile") for o in step_overrides):
                continue  # compiling takes minutes on a CPU: the smoke run checks the script, not compile
            cfg, _ = model_config("tiny", overrides + step_overrides)
            flops = flops or analytic_flops(cfg, work)
            model = make_model(cfg, seed=0, device=device.type)
            optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
            tokens = make_tokens(cfg, work, device=device)
            for precision in ("fp32", "bf16") if variant == "layers" else ("bf16",):
                ctx = torch.autocast(device.type, dtype=torch.bfloat16, enabled=precision == "bf16")
                with ctx:
                    start = time.perf_counter()
                    train_step(model, optimizer, tokens, work)  # warm-up (and compile)
                    _sync(device)
                    first = time.perf_counter() - start
                    start = time.perf_counter()
                    for _ in range(steps):
                        train_step(model, optimizer, tokens, work)
                    _sync(device)
                step_s = (time.perf_counter() - start) / steps
                mfu = flops.model_flops / step_s / (PEAK_TFLOPS[device.type] * 1e12)
                out[f"{name}/{variant}/{precision}"] = {"step_s": step_s, "first_step_s": first,
                                                        "tokens_per_s": work.tokens / step_s, "mfu": mfu}
    return out


def check_memory(device, smoke):
    out = {}
    for name, (overrides, work) in _configs(smoke).items():
        cfg, _ = model_config("tiny", overrides)
        model = make_model(cfg, seed=0, device=device.type)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        tokens = make_tokens(cfg, work, device=device)
        train_step(model, optimizer, tokens, work)  # optimizer state exists from here on
        base = _peak_reset(device)
        train_step(model, optimizer, tokens, work)
        peak = _peak_since(device, base)
        rank = analytic_memory(cfg, work).ranks[0]
        acts = rank.activations_ckpt if work.checkpoint else rank.activations
        model_acts = acts + rank.grads  # above the step's start: params and AdamW state already exist
        out[name] = {"measured_step_peak_bytes": peak, "model_activations_plus_grads_bytes": model_acts,
                     "ratio": peak / model_acts if peak else None}
    return out


def check_generation(device, smoke):
    from rlt_scale.generation import Generator, SamplingConfig

    cfg, _ = model_config("tiny")
    model = make_model(cfg, seed=0, device=device.type).eval()
    prompt = make_tokens(cfg, Workload(1, 16 if smoke else 64), device=device)[:, :-1]
    gen = Generator(model)
    logits, _ = gen.prefill(prompt)
    with torch.no_grad():
        teacher = model(prompt)
    gap = float((logits - teacher).abs().max())
    n = 16 if smoke else 512
    rng = torch.Generator(device=device).manual_seed(0)
    _sync(device)
    start = time.perf_counter()
    tokens, _ = gen.generate(prompt, n, SamplingConfig(1.0, 0, 0.9), generator=rng, check_every=64)
    _sync(device)
    seconds = time.perf_counter() - start
    assert tokens.shape == (1, n) and tokens.device.type == device.type
    assert gap <= 1e-3, gap
    return {"prefill_vs_teacher_max_abs": gap, "new_tokens": n, "tokens_per_s": n / seconds}


def check_checkpoint(device, smoke):
    from rlt_scale.distributed import init_distributed
    from rlt_scale.config import ParallelConfig
    from rlt_scale.training.sharded_state import ModelOptimizerState

    cfg, _ = model_config("tiny" if smoke else "mid")
    ctx = init_distributed(ParallelConfig(), device=device.type)
    model = make_model(cfg, seed=0, device=device.type)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    for p in model.parameters():
        p.grad = torch.full_like(p, 1e-3)
    optimizer.step()
    model.zero_grad(set_to_none=True)
    state = ModelOptimizerState(model, optimizer, ctx)
    largest = max(p.numel() * p.element_size() for p in model.parameters())
    total = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    root = tempfile.mkdtemp(prefix="gpu-check-ckpt-")
    try:
        base = _peak_reset(device)
        start = time.perf_counter()
        dcp.save(state.sharded_state_dict(), checkpoint_id=root)
        save_s = time.perf_counter() - start
        added = _peak_since(device, base)
        saved = {k: v.detach().clone() for k, v in state.sharded_state_dict().items()}
        targets = state.load_targets()
        dcp.load(targets, checkpoint_id=root)
        same = all(torch.equal(targets[k].to(saved[k].device), saved[k]) for k in saved)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    assert same, "a tensor did not come back equal"
    if added is not None:
        assert added <= largest + 64 * 2**20, (added, largest)
    return {"model_and_moments_bytes": total, "largest_tensor_bytes": largest, "save_added_peak_bytes": added,
            "save_s": save_s, "round_trip_equal": same}


def check_attention(device, smoke):
    length = 512 if smoke else 16384
    heads, head_dim = (2, 16) if smoke else (8, 64)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    out = {}
    for layout in ("single", "packed"):
        doc = (torch.arange(length, device=device) // (length // 8 if layout == "packed" else length))[None]
        pos = document_positions(doc)
        q, k, v = (torch.randn(1, heads, length, head_dim, device=device, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        base = _peak_reset(device)
        _sync(device)
        start = time.perf_counter()
        document_attention(q, k, v, pos, doc, pos, doc).float().square().sum().backward()
        _sync(device)
        seconds = time.perf_counter() - start
        peak = _peak_since(device, base)
        mask = length * length * 4  # one float32 mask of the sample, as SDPA would keep it
        out[layout] = {"T": length, "fwd_bwd_s": seconds, "peak_bytes": peak, "one_float_mask_bytes": mask}
        if peak is not None:
            assert peak < mask, out[layout]
    return out


CHECKS = {"bf16_step": check_bf16_step, "throughput": check_throughput, "memory": check_memory,
          "generation": check_generation, "checkpoint": check_checkpoint, "attention": check_attention}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--smoke", action="store_true", help="tiny sizes: checks the script itself, on any device")
    p.add_argument("--only", nargs="+", choices=sorted(CHECKS))
    p.add_argument("--out", help="results file (default bench/results/gpu_check.json, or gpu_check_smoke.json)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    results, failed = {"machine": machine(), "device": str(device), "smoke": args.smoke}, []
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name()
    for name in args.only or CHECKS:
        start = time.perf_counter()
        try:
            results[name] = CHECKS[name](device, args.smoke)
            status = "ok"
        except Exception as err:  # every check reports; one failure does not hide the others
            results[name] = {"error": f"{type(err).__name__}: {err}", "traceback": traceback.format_exc()}
            failed.append(name)
            status = f"FAILED: {type(err).__name__}: {err}"
        print(f"{name:11s} {time.perf_counter() - start:7.1f}s  {status}", flush=True)
        print("   ", json.dumps({k: v for k, v in results[name].items() if k != "traceback"}, default=str)[:600],
              flush=True)
    if args.out:
        path = Path(args.out)
        path.write_text(json.dumps(results, indent=2, default=str))
    else:
        path = write_results("gpu_check_smoke" if args.smoke else "gpu_check", results)
    print(f"wrote {path}; {len(failed)} of {len(args.only or CHECKS)} checks failed {failed or ''}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
