"""``rlt-prepare``: turn text, JSONL, SFT pairs, the Python stdlib or a synthetic task into shards.

Examples::

    rlt-prepare --source stdlib --out data/stdlib --seq-len 256
    rlt-prepare --source text --inputs 'corpus/**/*.txt' --out data/corpus --seq-len 1024
    rlt-prepare --source jsonl --inputs f.jsonl --text-field text --train-bpe 8192 --out data/f
    rlt-prepare --source sft --inputs chat.jsonl --prompt-field prompt --response-field response --out data/sft
    rlt-prepare --source addition --num-samples 100000 --length 16 --eval-length 24 --seed 0 --out data/add

Text sources write the training set to ``OUT`` and, with ``--eval-fraction``,
an evaluation set of held-out documents to ``OUT/eval``. Tasks write ``OUT``,
``OUT/eval`` and, for addition, one carry-chain bucket per ``OUT/eval-carry-CC``.
The same functions are available from Python: :func:`prepare_text` and
:func:`prepare_task`.
"""

from __future__ import annotations

import argparse
import hashlib
import sys
import time
from pathlib import Path
from typing import Sequence

import numpy as np
from tqdm import tqdm

from rlt_scale.data import sources, tasks
from rlt_scale.data.index import DatasetIndex
from rlt_scale.data.packing import Packer
from rlt_scale.data.tokenizer import BYTE_TOKENIZER, ByteTokenizer, load_tokenizer, train_bpe
from rlt_scale.data.writer import DEFAULT_SHARD_BYTES, DatasetWriter
from rlt_scale.errors import ConfigError, DataError

STDLIB_DEFAULT_MAX_BYTES = 4_000_000
"""About 16k samples of 256 tokens: ~2,000 steps of batch 8 per epoch, prepared in seconds."""
DOCUMENTS_FILE = "documents.txt"


def is_eval_document(name: str, seed: int, fraction: float) -> bool:
    """Held-out choice by a hash of the document name: stable, and independent of the other documents."""
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64 < fraction


def prepare_text(source: sources.Source, out: str | Path, *, seq_len: int = 256, tokenizer: str = BYTE_TOKENIZER,
                 train_bpe_vocab: int | None = None, eval_fraction: float = 0.0, seed: int = 0,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = False) -> dict[str, DatasetIndex]:
    """Tokenize, pack and shard the documents of ``source``; returns the index of each split written.

    Each document is followed by EOS. ``documents.txt`` next to each index lists
    the documents in packing order, so a dataset can be traced back to its text.
    """
    out = Path(out)
    if not 0.0 <= eval_fraction < 1.0:
        raise ConfigError("eval_fraction", f"expected 0 <= fraction < 1, got {eval_fraction}")
    if seq_len < 1:
        raise ConfigError("seq_len", f"expected >= 1, got {seq_len}")

    def split_of(doc: sources.Document) -> str:
        return "eval" if is_eval_document(doc.name, seed, eval_fraction) else "train"

    if train_bpe_vocab:
        out.mkdir(parents=True, exist_ok=True)
        texts = (d.text if d.prompt is None else d.prompt + d.response for d in source if split_of(d) == "train")
        tok = train_bpe(texts, train_bpe_vocab, out / "tokenizer.json")
        tokenizer = str(out / "tokenizer.json")
    else:
        tok = load_tokenizer(tokenizer)
    meta = {"source": source.description, "seed": seed, "eval_fraction": eval_fraction}
    writers: dict[str, DatasetWriter] = {}
    packers: dict[str, Packer] = {}
    names: dict[str, list[str]] = {"train": [], "eval": []}

    def write(split: str, samples) -> None:
        for sample in samples:
            writers[split].write(sample.tokens, sample.doc_ids, sample.loss_mask)

    bar = tqdm(total=source.max_bytes, unit="B", unit_scale=True, desc=f"prepare {out}", disable=not progress)
    for doc in source:
        split = split_of(doc)
        if split not in writers:  # created lazily: no empty eval set when no document is held out
            writers[split] = DatasetWriter(out if split == "train" else out / "eval", seq_len=seq_len,
                                           vocab_size=tok.vocab_size, tokenizer=tokenizer, shard_bytes=shard_bytes,
                                           meta={**meta, "split": split})
            packers[split] = Packer(seq_len, tok.eos_id, tok.pad_id)
        if doc.prompt is None:
            write(split, packers[split].add(tok.encode_array(doc.text)))
        else:
            prompt, response = tok.encode_array(doc.prompt), tok.encode_array(doc.response)
            mask = np.concatenate([np.zeros(len(prompt), dtype=bool), np.ones(len(response), dtype=bool)])
            write(split, packers[split].add(np.concatenate([prompt, response]), mask))
        names[split].append(doc.name)
        bar.update(doc.size)
    bar.close()
    if "train" not in writers:
        raise DataError(f"{out}: the source produced no training documents ({source.description})")
    indexes = {}
    for split, writer in writers.items():
        write(split, packers[split].finish())
        writer.meta["documents"] = len(names[split])
        indexes[split] = writer.close()
        (writer.out / DOCUMENTS_FILE).write_text("".join(n + "\n" for n in names[split]))
    return indexes


def _write_task(taskset: tasks.TaskSet, out: Path, split: str, shard_bytes: int, progress: bool) -> DatasetIndex:
    writer = DatasetWriter(out, seq_len=taskset.seq_len, vocab_size=ByteTokenizer.vocab_size,
                           shard_bytes=shard_bytes, meta={**taskset.meta, "split": split})
    mask = taskset.loss_mask
    for i, row in enumerate(tqdm(taskset.tokens, desc=f"prepare {out}", unit="sample", disable=not progress)):
        if taskset.doc_ids is None:
            writer.write(row, None, mask)
        else:
            writer.write(row, taskset.doc_ids[i], taskset.masks[i])
    return writer.close()


def default_carry_buckets(length: int) -> list[int]:
    """Chain lengths 1, 2, 4, ... up to ``length``, and ``length`` itself."""
    return sorted({2**k for k in range(length.bit_length()) if 2**k <= length} | {length})


def prepare_task(task: str, out: str | Path, num_samples: int, length: int, seed: int, *,
                 eval_samples: int | None = None, eval_length: int | None = None,
                 carry_buckets: Sequence[int] | None = None, table_seed: int = 0, packed_row_tokens: int = 0,
                 shard_bytes: int = DEFAULT_SHARD_BYTES, progress: bool = False) -> dict[str, DatasetIndex]:
    """Write a synthetic task (format in :mod:`rlt_scale.data.tasks`); returns the index of each split written.

    ``OUT`` holds ``num_samples`` training samples of ``length``; ``OUT/eval``
    ``eval_samples`` (default a tenth, 0 for none) at ``eval_length`` (default
    ``length``, longer tests length generalization); for addition, each carry
    chain ``c`` in ``carry_buckets`` gets ``OUT/eval-carry-{c:02d}`` with
    ``eval_samples`` samples of chain exactly ``c`` at ``eval_length``. Splits use
    independent seeds derived from ``seed``. With ``packed_row_tokens`` the
    training split holds ``num_samples`` rows of that many tokens of packed
    programs of lengths ``1..length`` (:func:`rlt_scale.data.tasks.packed`); the
    evaluation split stays one program of ``eval_length`` per sample.
    """
    out = Path(out)
    eval_samples = max(1, num_samples // 10) if eval_samples is None else eval_samples
    eval_length = eval_length or length
    options = {"table_seed": table_seed} if task == "five_state" else {}

    def split_seed(*salt: int) -> int:
        return int(np.random.SeedSequence([seed, *salt]).generate_state(1)[0])

    train = (tasks.packed(task, num_samples, length, packed_row_tokens, seed, **options) if packed_row_tokens
             else tasks.generate(task, num_samples, length, seed, **options))
    written = {"train": _write_task(train, out, "train", shard_bytes, progress)}
    if eval_samples > 0:
        written["eval"] = _write_task(tasks.generate(task, eval_samples, eval_length, split_seed(1), **options),
                                      out / "eval", "eval", shard_bytes, progress)
        if task == "addition":
            for chain in carry_buckets or default_carry_buckets(eval_length):
                bucket = tasks.addition(eval_samples, eval_length, split_seed(2, chain), carry_chain=chain)
                name = f"eval-carry-{chain:02d}"
                written[name] = _write_task(bucket, out / name, name, shard_bytes, progress)
    return written


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rlt-prepare", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", required=True, choices=("stdlib", "text", "jsonl", "sft", *tasks.TASKS))
    p.add_argument("--out", help="dataset directory (default data/<source>)")
    p.add_argument("--seed", type=int, default=0, help="task generator seed; eval split choice for text")
    p.add_argument("--shard-bytes", type=int, default=DEFAULT_SHARD_BYTES, help="target shard payload size")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    text = p.add_argument_group("text sources (stdlib, text, jsonl, sft)")
    text.add_argument("--inputs", nargs="+", default=[], help="files or globs ('**' recurses)")
    text.add_argument("--seq-len", type=int, default=256)
    text.add_argument("--text-field", default="text")
    text.add_argument("--prompt-field", default="prompt")
    text.add_argument("--response-field", default="response")
    text.add_argument("--tokenizer", default=BYTE_TOKENIZER, help="'byte' or a tokenizers JSON file")
    text.add_argument("--train-bpe", type=int, metavar="VOCAB", help="train a byte-level BPE of this size first")
    text.add_argument("--max-bytes", type=int, help=f"stop after this much text (stdlib default {STDLIB_DEFAULT_MAX_BYTES})")
    text.add_argument("--max-docs", type=int, help="stop after this many documents")
    text.add_argument("--eval-fraction", type=float, default=0.05, help="share of documents held out to OUT/eval")
    task = p.add_argument_group("synthetic tasks (" + ", ".join(tasks.TASKS) + ")")
    task.add_argument("--num-samples", type=int, default=10_000)
    task.add_argument("--length", type=int, default=16, help="operations per sample (bits, actions, permutations, operators; addition: operand bits)")
    task.add_argument("--eval-samples", type=int, help="per eval set (default num-samples/10; 0: none)")
    task.add_argument("--eval-length", type=int, help="length of the eval sets (default --length)")
    task.add_argument("--carry-buckets", help="addition: comma-separated chain lengths (default 1,2,4,..,L)")
    task.add_argument("--table-seed", type=int, default=0, help="five_state: seed of the fixed transition table")
    return p


def _source(args: argparse.Namespace) -> sources.Source:
    bounds = {"max_bytes": args.max_bytes, "max_docs": args.max_docs}
    if args.source == "stdlib":
        if args.max_bytes is None and args.max_docs is None:
            bounds["max_bytes"] = STDLIB_DEFAULT_MAX_BYTES
        return sources.stdlib_source(**bounds)
    if args.source == "text":
        return sources.text_source(args.inputs, **bounds)
    if args.source == "jsonl":
        return sources.jsonl_source(args.inputs, args.text_field, **bounds)
    return sources.sft_source(args.inputs, args.prompt_field, args.response_field, **bounds)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    out = Path(args.out or f"data/{args.source}")
    started = time.perf_counter()
    try:
        if args.source in tasks.TASKS:
            buckets = [int(c) for c in args.carry_buckets.split(",")] if args.carry_buckets else None
            written = prepare_task(args.source, out, args.num_samples, args.length, args.seed,
                                   eval_samples=args.eval_samples, eval_length=args.eval_length,
                                   carry_buckets=buckets, table_seed=args.table_seed,
                                   shard_bytes=args.shard_bytes, progress=not args.quiet)
        else:
            written = prepare_text(_source(args), out, seq_len=args.seq_len, tokenizer=args.tokenizer,
                                   train_bpe_vocab=args.train_bpe, eval_fraction=args.eval_fraction,
                                   seed=args.seed, shard_bytes=args.shard_bytes, progress=not args.quiet)
    except (ConfigError, DataError) as exc:
        print(f"rlt-prepare: error: {exc}", file=sys.stderr)
        return 2
    for split, index in written.items():
        print(f"{split:>14}: {index.path}  {index.num_samples} samples x {index.seq_len + 1} tokens, "
              f"{len(index.shards)} shards, vocab {index.vocab_size} ({index.tokenizer})")
    print(f"done in {time.perf_counter() - started:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
