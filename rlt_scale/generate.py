"""``rlt-generate RUN_DIR --prompt TEXT``: sample from a trained RLT.

Loads the newest checkpoint of a run (or ``--checkpoint``), prefills the
prompt and samples; prints the text and the behaviour log-probabilities of
the sampled tokens (``--json`` for machine-readable output).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from rlt_scale.config import Config, ParallelConfig
from rlt_scale.data.tokenizer import load_tokenizer
from rlt_scale.distributed import init_distributed
from rlt_scale.generation import Generator, SamplingConfig
from rlt_scale.model import build_model
from rlt_scale.training.checkpoint import CheckpointManager


def load_for_inference(run_dir: str, checkpoint: str | None = None, device: str = "cpu"):
    """(model, config) from a run directory's newest checkpoint."""
    manager = CheckpointManager(run_dir)
    path = Path(checkpoint) if checkpoint else manager.latest()
    if path is None:
        raise FileNotFoundError(f"no complete checkpoint under {run_dir}/checkpoints")
    meta = manager.read_meta(path)
    if meta["world_size"] != 1:
        raise ValueError(f"{path} holds {meta['world_size']} rank shards; generation loads single-rank checkpoints")
    payload = manager.read_payload(path, rank=0)
    cfg: Config = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(Config), OmegaConf.create(meta["config"])))
    ctx = init_distributed(ParallelConfig(), device)
    model = build_model(cfg.model, ctx.tp_group).to(ctx.device)
    model.load_state_dict(payload["model"])
    model.eval()
    return model, cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlt-generate", description=__doc__.split("\n")[0])
    p.add_argument("run_dir")
    p.add_argument("--prompt", required=True)
    p.add_argument("--checkpoint", default=None, help="a checkpoint directory instead of the run's newest")
    p.add_argument("--tokenizer", default=None, help="default: the one recorded in the training data's index")
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.8)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    model, cfg = load_for_inference(args.run_dir, args.checkpoint)
    tokenizer = load_tokenizer(args.tokenizer or _data_tokenizer(cfg.data.path))
    prompt = torch.tensor([tokenizer.encode(args.prompt)], dtype=torch.long)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    gen = torch.Generator().manual_seed(args.seed)
    tokens, logprobs = Generator(model).generate(prompt, args.max_new_tokens, sampling, gen, stop_token=tokenizer.eos_id)
    ids = tokens[0].tolist()
    if args.json:
        print(json.dumps({"prompt": args.prompt, "tokens": ids, "text": tokenizer.decode(ids),
                          "logprobs": logprobs[0].tolist()}))
    else:
        print(args.prompt + tokenizer.decode(ids))
        print(f"-- {len(ids)} tokens, mean behaviour log-prob {logprobs.mean().item():.3f}", file=sys.stderr)
    return 0


def _data_tokenizer(path: str) -> str:
    try:
        from rlt_scale.data.index import read_index

        return read_index(path).tokenizer
    except Exception:  # the data may live elsewhere at inference time
        return "byte"


if __name__ == "__main__":
    sys.exit(main())
