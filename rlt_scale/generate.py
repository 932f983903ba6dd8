"""``rlt-generate RUN_DIR --prompt TEXT``: sample from a trained RLT.

Loads the newest checkpoint of a run (or ``--checkpoint``), saved by any
TP x PP x DP layout, or a directory written by ``rlt-export`` (model.safetensors
+ config.yaml); prefills the prompt and samples; prints the text and the behaviour log-probabilities of
the sampled tokens (``--json`` for machine-readable output).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from rlt_scale.data.tokenizer import load_tokenizer
from rlt_scale.export import WEIGHTS_FILE, load_checkpoint_model, load_export
from rlt_scale.generation import Generator, SamplingConfig


def load_for_inference(path: str, checkpoint: str | None = None, device: str = "cpu"):
    """(model, config) from an ``rlt-export`` directory, or a run directory's newest (or given) checkpoint."""
    if (Path(path) / WEIGHTS_FILE).exists():
        return load_export(path, device)
    model, cfg, _ = load_checkpoint_model(path, checkpoint, device)
    return model, cfg


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="rlt-generate", description=__doc__.split("\n")[0])
    p.add_argument("run_dir", help="a run directory, or an rlt-export output directory")
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
