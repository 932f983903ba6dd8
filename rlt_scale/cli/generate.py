"""``rlt-generate RUN_DIR --prompt TEXT``: sample from a trained RLT.

Loads the newest checkpoint of a run (or ``--checkpoint``), saved by any
TP x PP x DP layout, or a directory written by ``rlt-export`` (model.safetensors
+ config.yaml); prefills the prompt and samples. The text is streamed to stdout
as it is sampled, and a summary with the mean behaviour log-probability of the
sampled tokens goes to stderr; ``--json`` prints one JSON object at the end instead.

* An empty prompt (``--prompt ""``) starts a new document: the prompt is the
  tokenizer's EOS token alone. Prepared text puts EOS after every document
  (rlt_scale/data/packing.py) and never uses BOS, so "EOS, then a document" is
  how the model saw document starts in training.
* Prompt bytes that are not UTF-8 (the shell's ``$'ab\\xff'``, which Python
  hands over surrogate-escaped) are fed to the byte tokenizer as the raw bytes;
  they are echoed as U+FFFD. A BPE tokenizer encodes text only and such a
  prompt is an error.
* ``--max-new-tokens 0`` loads the model and prints only the prompt.
* ``--device`` (default ``auto``: CUDA when available, else the CPU) is where
  the model is loaded and sampling runs; the seeded random generator lives
  there too, so a seed gives the CPU's samples on the CPU and the GPU's on a GPU.
* Text is streamed in pieces of ``--stream-every`` tokens (default 16): the
  host reads the sampled tokens back from the device only that often, and
  looks for EOS then. Tokens sampled after EOS are discarded, so the text does
  not depend on ``--stream-every``; 1 prints token by token, at the cost of
  waiting for the device at every token.
* Bad options, a missing or unreadable run/export directory and a prompt the
  model cannot take are reported as one ``rlt-generate: error: ...`` line on
  stderr with exit status 2.
"""

from __future__ import annotations

import argparse
import codecs
import json
import math
import sys
from pathlib import Path

import torch

from rlt_scale.data.tokenizer import ByteTokenizer, load_tokenizer
from rlt_scale.errors import CheckpointError, ConfigError
from rlt_scale.export import WEIGHTS_FILE, load_checkpoint_model, load_export
from rlt_scale.generation import Generator, SamplingConfig

PROG = "rlt-generate"


def load_for_inference(path: str, checkpoint: str | None = None, device: str = "cpu"):
    """(model, config) from an ``rlt-export`` directory, or a run directory's newest (or given) checkpoint."""
    root = Path(path)
    if not root.is_dir():
        what = "is not a directory" if root.exists() else "does not exist"
        raise FileNotFoundError(f"{path} {what} (expected a run directory or an rlt-export directory)")
    if (root / WEIGHTS_FILE).exists():
        if checkpoint is not None:
            raise ValueError(f"--checkpoint selects a checkpoint of a run directory, but {path} is an rlt-export "
                             f"directory ({WEIGHTS_FILE}), which holds exactly one model")
        return load_export(root, device)
    try:
        model, cfg, _ = load_checkpoint_model(root, checkpoint, device)
    except FileNotFoundError as err:
        if checkpoint is not None:
            raise
        raise FileNotFoundError(f"{err}, and {path} has no {WEIGHTS_FILE} (it is neither a run directory with a "
                                f"checkpoint nor an rlt-export directory)") from None
    return model, cfg


# ---------------------------------------------------------------- option types
def _number(kind, name: str, ok, expected: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
        if not ok(value):
            raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}")
        return value

    parse.__name__ = name
    return parse


_max_new_tokens = _number(int, "max_new_tokens", lambda v: v >= 0, "an integer >= 0")
_temperature = _number(float, "temperature", lambda v: math.isfinite(v) and v >= 0, "a number >= 0 (0: greedy)")
_top_k = _number(int, "top_k", lambda v: v >= 0, "an integer >= 0 (0: all tokens)")
_top_p = _number(float, "top_p", lambda v: 0 < v <= 1, "a number in (0, 1] (1: all tokens)")
_stream_every = _number(int, "stream_every", lambda v: v >= 1, "an integer >= 1")
DEVICES = ("auto", "cpu", "cuda")


def _device(name: str) -> str:
    """``auto``: CUDA when available, else the CPU."""
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return name


# ---------------------------------------------------------------- prompt and text
class PromptError(ValueError):
    """The prompt cannot be given to this tokenizer or model."""


def encode_prompt(tokenizer, prompt: str) -> tuple[list[int], str]:
    """(token ids, the prompt as it is echoed).

    Undecodable bytes of a command-line argument arrive as lone surrogates
    (``surrogateescape``); the byte tokenizer gets the original bytes back. An
    empty prompt is the EOS token alone (see the module docstring).
    """
    if prompt == "":
        return [tokenizer.eos_id], ""
    try:
        data = prompt.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError as err:
        raise PromptError(f"--prompt has a character that is neither text nor an escaped byte "
                          f"({prompt[err.start]!r} at {err.start})") from None
    text = data.decode("utf-8", errors="replace")
    if isinstance(tokenizer, ByteTokenizer):
        return list(data), text
    if text != prompt:
        bad = next(i for i, c in enumerate(prompt) if "\udc80" <= c <= "\udcff")
        raise PromptError(f"--prompt is not valid UTF-8 (byte 0x{ord(prompt[bad]) - 0xdc00:02x} at character {bad}); "
                          f"the tokenizer {tokenizer.name} encodes text only (the byte tokenizer takes raw bytes)")
    return tokenizer.encode(prompt), text


class TextStream:
    """Turns sampled ids into text as they arrive; the pieces join to ``tokenizer.decode(ids)``.

    The byte tokenizer goes through an incremental UTF-8 decoder, so a
    multi-byte character is printed once all its bytes are there. Other
    tokenizers re-decode the ids so far and print what was added, holding back
    a trailing U+FFFD (a character whose bytes are split across tokens).
    """

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.emitted = ""
        self._utf8 = (codecs.getincrementaldecoder("utf-8")(errors="replace")
                      if isinstance(tokenizer, ByteTokenizer) else None)

    def push(self, token_id: int) -> str:
        self.ids.append(token_id)
        if self._utf8 is not None:
            return self._utf8.decode(bytes([token_id])) if 0 <= token_id < 256 else ""
        text = self.tokenizer.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        return self._advance(text)

    def finish(self) -> str:
        if self._utf8 is not None:
            return self._utf8.decode(b"", final=True)
        return self._advance(self.tokenizer.decode(self.ids))

    def _advance(self, text: str) -> str:
        if not text.startswith(self.emitted):  # the decoder rewrote earlier text; it was already printed
            return ""
        new, self.emitted = text[len(self.emitted):], text
        return new


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n")[0])
    p.add_argument("run_dir", help="a run directory, or an rlt-export output directory")
    p.add_argument("--prompt", required=True,
                   help='the text to continue; "" starts a new document (the prompt is EOS alone)')
    p.add_argument("--checkpoint", default=None,
                   help="a checkpoint directory instead of the run's newest (run directories only)")
    p.add_argument("--tokenizer", default=None, help="default: the one recorded in the training data's index")
    p.add_argument("--max-new-tokens", type=_max_new_tokens, default=64,
                   help="stop after this many tokens, or at EOS (0: print the prompt only)")
    p.add_argument("--temperature", type=_temperature, default=0.8, help="0: greedy")
    p.add_argument("--top-k", type=_top_k, default=0, help="keep the k most likely tokens (0: all)")
    p.add_argument("--top-p", type=_top_p, default=1.0, help="keep the smallest set reaching probability p")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", choices=DEVICES, default="auto",
                   help="where to load the model and sample (default: auto, i.e. cuda if available, else cpu)")
    p.add_argument("--stream-every", type=_stream_every, default=16, metavar="N",
                   help="print the text, and check for EOS, every N tokens: each check waits for the device "
                        "(default: 16; 1: token by token)")
    p.add_argument("--json", action="store_true", help="print one JSON object at the end instead of streaming")
    args = p.parse_args(argv)
    if args.checkpoint is not None and (Path(args.run_dir) / WEIGHTS_FILE).exists():
        p.error(f"--checkpoint selects a checkpoint of a run directory, but {args.run_dir} is an rlt-export "
                f"directory ({WEIGHTS_FILE}), which holds exactly one model")
    device = _device(args.device)
    if device == "cuda" and not torch.cuda.is_available():
        p.error("argument --device: cuda was asked for, but no CUDA device is available")

    try:
        model, cfg = load_for_inference(args.run_dir, args.checkpoint, device)
        tokenizer = load_tokenizer(args.tokenizer or _data_tokenizer(cfg.data.path))
        ids, prompt_text = encode_prompt(tokenizer, args.prompt)
        if max(ids) >= cfg.model.vocab_size:
            raise PromptError(f"the prompt encodes to token id {max(ids)}, outside the model's vocabulary of "
                              f"{cfg.model.vocab_size}: is --tokenizer the one the model was trained with?")
    except (CheckpointError, ConfigError, PromptError, OSError) as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2

    device = next(model.parameters()).device  # "cuda" resolved to the process's GPU
    prompt = torch.tensor([ids], dtype=torch.long, device=device)
    sampling = SamplingConfig(args.temperature, args.top_k, args.top_p)
    gen = torch.Generator(device=device).manual_seed(args.seed)
    on_tokens = None
    if not args.json:
        stream = TextStream(tokenizer)
        _write(prompt_text)

        def on_tokens(tokens: torch.Tensor, logprobs: torch.Tensor) -> None:
            _write("".join(stream.push(token) for token in tokens[0].tolist()))

    tokens, logprobs = Generator(model).generate(prompt, args.max_new_tokens, sampling, gen,
                                                 stop_token=tokenizer.eos_id, on_tokens=on_tokens,
                                                 check_every=args.stream_every)
    new = tokens[0].tolist()
    if args.json:
        print(json.dumps({"prompt": prompt_text, "tokens": new, "text": tokenizer.decode(new),
                          "logprobs": logprobs[0].tolist()}))
    else:
        _write(stream.finish() + "\n")
        mean = f", mean behaviour log-prob {logprobs.mean().item():.3f}" if new else ""
        print(f"-- {len(new)} tokens{mean}", file=sys.stderr)
    return 0


def _write(text: str) -> None:
    if text:
        sys.stdout.write(text)
        sys.stdout.flush()


def _data_tokenizer(path: str) -> str:
    try:
        from rlt_scale.data.index import read_index

        return read_index(path).tokenizer
    except Exception:  # the data may live elsewhere at inference time
        return "byte"


if __name__ == "__main__":
    sys.exit(main())
