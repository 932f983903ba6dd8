"""Run the ring pipeline itself at PP = nproc; save, per stage, what must equal one process.

    torchrun --nproc-per-node PP tests/workers/ring_strict.py OUT_FILE SPEC_JSON

SPEC (JSON) keys: ``micro`` (micro-batch counts to run, in turn), ``tokens``
(T), ``feedback_block``, ``chunk`` (chunk size), ``checkpoint`` (chunk
activation checkpointing), ``strict`` (route point-to-point traffic through
``tests/strict_p2p.py``, NCCL's rules; ``strict_timeout`` seconds before a
wait counts as a deadlock) and ``count_syncs`` (also count host-syncing
operations in ``forward_backward`` at T and 2T tokens).

Every rank also runs the whole model in one process (the same weights:
each part of the model seeds its own initialisation) on the same float64
batches. Rank r writes OUT_FILE.stage<r>: per micro-batch count, the ring's
summed loss and the reference's, the largest relative difference of this
stage's gradients from the reference's, the evaluation loss and the
reference's; with ``count_syncs`` the syncing operations counted at T and 2T.
Progress lines go to stdout, so a deadlock names the run it happened in.
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/: strict_p2p, host_syncs


def _batches(m: int, tokens: int, seed: int) -> list[dict]:
    """``m`` micro-batches of 2 rows; row 1 packs two documents, and a few targets are masked."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(m):
        doc = torch.zeros(2, tokens + 1, dtype=torch.long)
        doc[1, tokens // 2:] = 1
        out.append({"tokens": torch.randint(0, 23, (2, tokens + 1), generator=g), "doc_ids": doc,
                    "loss_mask": torch.rand(2, tokens + 1, generator=g) > 0.2})
    return out


def _reference(model, batches, bptt):
    """Summed loss and gradients of sum(loss) / targets of ``batches`` in one process."""
    from rlt_scale.training.bptt import run_sequence

    model.zero_grad(set_to_none=True)
    outs = [run_sequence(model, b["tokens"], b["doc_ids"], b["loss_mask"], bptt) for b in batches]
    n_targets = float(sum(o.n_targets for o in outs))
    total = sum(o.loss_sum for o in outs)
    (total / n_targets).backward()
    return float(total.detach()), n_targets, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def main() -> None:
    out_file, spec = sys.argv[1], json.loads(sys.argv[2])
    from rlt_scale.config import ModelConfig, ParallelConfig
    from rlt_scale.distributed import init_distributed
    from rlt_scale.model import build_model
    from rlt_scale.parallel.pipeline import RingPipeline
    from rlt_scale.parallel.stages import build_stage, plan_stage
    from rlt_scale.training.bptt import BPTT

    torch.set_num_threads(1)
    ctx = init_distributed(ParallelConfig(pp=int(os.environ["WORLD_SIZE"]), timeout_s=120), "cpu")
    if spec.get("strict"):
        import strict_p2p

        strict_p2p.install(timeout=spec.get("strict_timeout", 30))
    layers = 4 if ctx.pp == 4 else 2
    cfg = ModelConfig(vocab_size=23, d_model=16, n_heads=2, n_enc_layers=layers, n_dec_layers=layers, window=3,
                      memory_groups=1, feedback_block=spec.get("feedback_block", 1), feedback_scale=0.5,
                      tie_layers=True, params_dtype="float64", ffn_hidden_size=24)
    cfg.validate()
    bptt = BPTT(chunk_size=spec.get("chunk", 0), checkpoint=spec.get("checkpoint", False))
    torch.manual_seed(0)
    whole = build_model(cfg, ctx.tp_group)
    torch.manual_seed(0)
    plan = plan_stage(cfg, ctx.pp_rank, ctx.pp)
    stage = build_stage(cfg, ctx.tp_group, plan)
    ring = RingPipeline(stage, plan, ctx, bptt)
    results = {"runs": {}, "syncs": {}}
    for m in spec["micro"]:
        print(f"rank {ctx.rank}: PP={ctx.pp} M={m} starts", flush=True)
        batches = _batches(m, spec["tokens"], seed=m)
        ref_loss, n_targets, ref_grads = _reference(whole, batches, bptt)
        stage.zero_grad(set_to_none=True)
        loss = ring.forward_backward(batches, n_targets)
        rel = max(((p.grad - ref_grads[n]).abs().max() / ref_grads[n].abs().max()).item()
                  for n, p in stage.named_parameters() if p.grad is not None)
        eval_loss, eval_targets, _ = ring.forward_loss(batches)
        results["runs"][m] = {"loss": loss, "ref_loss": ref_loss, "grad_rel": rel, "eval_loss": eval_loss,
                              "eval_targets": eval_targets, "ref_targets": n_targets,
                              "grads": sum(p.grad is not None for p in stage.parameters()),
                              "params": sum(1 for _ in stage.parameters())}
        print(f"rank {ctx.rank}: PP={ctx.pp} M={m} done", flush=True)
    if spec.get("count_readouts") and plan.last:  # readout calls of one training step, at T and 2T
        calls = []
        hook = stage.readout.register_forward_hook(lambda *_: calls.append(1))
        m = spec["micro"][-1]
        results["readouts"] = {}
        for tokens in (spec["tokens"], 2 * spec["tokens"]):
            calls.clear()
            ring.forward_backward(_batches(m, tokens, seed=tokens), 1.0)
            results["readouts"][tokens] = len(calls)
        hook.remove()
    elif spec.get("count_readouts"):
        m = spec["micro"][-1]
        for tokens in (spec["tokens"], 2 * spec["tokens"]):
            ring.forward_backward(_batches(m, tokens, seed=tokens), 1.0)
    if spec.get("count_syncs"):
        from host_syncs import count_host_syncs

        m = spec["micro"][-1]
        for tokens in (spec["tokens"], 2 * spec["tokens"]):
            batches = _batches(m, tokens, seed=tokens)
            with count_host_syncs() as counter:
                ring.forward_backward(batches, 1.0)
            results["syncs"][tokens] = dict(counter.counts)
    torch.save(results, f"{out_file}.stage{ctx.pp_rank}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
