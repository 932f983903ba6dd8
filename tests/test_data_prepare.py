"""Preparation: sources, tokenizers and packing round-trip to the original text."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from rlt_scale.data.index import read_index
from rlt_scale.data.packing import Packer
from rlt_scale.data.prepare import DOCUMENTS_FILE, main, prepare_text
from rlt_scale.data.shards import ShardReader
from rlt_scale.data.sources import jsonl_source, sft_source, text_source
from rlt_scale.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer
from rlt_scale.errors import ConfigError, DataError


def stored_stream(path: Path) -> dict[str, np.ndarray]:
    """The dataset's token stream in stored order, undoing the one-token overlap of consecutive samples."""
    index = read_index(path)
    reader = ShardReader(index)
    parts = [reader.read(i, np.arange(s.samples)) for i, s in enumerate(index.shards)]
    rows = {k: np.concatenate([p[k] for p in parts]).astype(np.int64 if k != "loss_mask" else bool)
            for k in ("tokens", "doc_ids", "loss_mask")}
    stream = {k: np.concatenate([v[0], v[1:, 1:].reshape(-1)]) for k, v in rows.items()}
    stream["rows"] = rows
    return stream


def split_documents(tokens: np.ndarray, eos: int, pad: int) -> list[np.ndarray]:
    tokens = tokens[tokens != pad]
    ends = np.flatnonzero(tokens == eos)
    assert len(ends) and ends[-1] == len(tokens) - 1, "every document, the last included, ends with EOS"
    starts = np.concatenate([[0], ends[:-1] + 1])
    return [tokens[start:end] for start, end in zip(starts, ends)]


def test_stdlib_set_round_trips_to_the_source_files(tmp_path):
    out = tmp_path / "stdlib"
    assert main(["--source", "stdlib", "--out", str(out), "--seq-len", "64", "--max-docs", "12",
                 "--eval-fraction", "0.3", "--seed", "1", "--quiet"]) == 0
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    tok = load_tokenizer(out)  # the index says "byte"
    assert isinstance(tok, ByteTokenizer)
    total_docs = 0
    for split in (out, out / "eval"):
        names = (split / DOCUMENTS_FILE).read_text().splitlines()
        stream = stored_stream(split)
        documents = split_documents(stream["tokens"], tok.eos_id, tok.pad_id)
        assert len(documents) == len(names) > 0
        for name, doc in zip(names, documents):
            assert tok.decode(doc.tolist()) == (stdlib / name).read_bytes().decode("utf-8")
        # inside a sample, the document id steps up exactly after each EOS, and padding is never a target
        for tokens, docs, mask in zip(*(stream["rows"][k] for k in ("tokens", "doc_ids", "loss_mask"))):
            assert (np.diff(docs) == (tokens[:-1] == tok.eos_id)).all()
            assert (mask == (tokens != tok.pad_id)).all()
        total_docs += len(names)
    assert total_docs == 12
    assert read_index(out).meta["documents"] + read_index(out / "eval").meta["documents"] == 12


def test_packer_overlaps_one_token_and_pads_the_tail():
    packer = Packer(seq_len=4, eos_id=9, pad_id=8)
    samples = list(packer.add(np.array([1, 2, 3]))) + list(packer.add(np.array([4, 5, 6, 7]))) + list(packer.finish())
    assert [s.tokens.tolist() for s in samples] == [[1, 2, 3, 9, 4], [4, 5, 6, 7, 9]]
    assert [s.doc_ids.tolist() for s in samples] == [[0, 0, 0, 0, 1], [0, 0, 0, 0, 0]]
    tail = list(Packer(4, 9, 8).add(np.array([1, 2]))) or None
    packer = Packer(seq_len=4, eos_id=9, pad_id=8)
    list(packer.add(np.array([1, 2])))
    (last,) = packer.finish()
    assert tail is None and last.tokens.tolist() == [1, 2, 9, 8, 8]
    assert last.loss_mask.tolist() == [True, True, True, False, False] and last.doc_ids.tolist() == [0, 0, 0, 1, 1]


def test_sft_masks_exactly_the_responses(tmp_path):
    records = [{"prompt": f"Q{i}: what is {i}+{i}?", "response": f" {2 * i}."} for i in range(40)]
    (tmp_path / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    prepare_text(sft_source([str(tmp_path / "chat.jsonl")]), tmp_path / "sft", seq_len=32)
    stream = stored_stream(tmp_path / "sft")
    tok = ByteTokenizer()
    targets = stream["tokens"][stream["loss_mask"]]
    expected = b"".join(r["response"].encode() + bytes([0]) for r in records)  # response, then EOS
    assert [t if t != tok.eos_id else 0 for t in targets.tolist()] == list(expected)
    documents = split_documents(stream["tokens"], tok.eos_id, tok.pad_id)
    assert [tok.decode(d.tolist()) for d in documents] == [r["prompt"] + r["response"] for r in records]


def test_jsonl_with_a_trained_bpe_round_trips(tmp_path):
    pytest.importorskip("tokenizers")
    texts = [f"def function_{i}(x):\n    return x * {i} + {i % 7}  # ünïcode {i}\n" for i in range(60)]
    (tmp_path / "code.jsonl").write_text("".join(json.dumps({"body": t, "id": i}) + "\n" for i, t in enumerate(texts)))
    index = prepare_text(jsonl_source([str(tmp_path / "code.jsonl")], text_field="body"), tmp_path / "bpe",
                         seq_len=16, train_bpe_vocab=320, eval_fraction=0.2)["train"]
    tok = load_tokenizer(tmp_path / "bpe")
    assert isinstance(tok, HFTokenizer) and index.tokenizer == str(tmp_path / "bpe" / "tokenizer.json")
    assert json.loads((tmp_path / "bpe" / "index.json").read_text())["tokenizer"] == "tokenizer.json"
    assert isinstance(load_tokenizer(read_index(tmp_path / "bpe" / "eval").tokenizer), HFTokenizer)
    assert index.vocab_size == tok.vocab_size <= 320
    assert len(tok.encode(texts[0])) < len(texts[0].encode()) / 2, "the BPE learned merges"
    for split in (tmp_path / "bpe", tmp_path / "bpe" / "eval"):
        lines = [int(name.rsplit(":", 1)[1]) for name in (split / DOCUMENTS_FILE).read_text().splitlines()]
        documents = split_documents(stored_stream(split)["tokens"], tok.eos_id, tok.pad_id)
        assert [tok.decode(d.tolist()) for d in documents] == [texts[line - 1] for line in lines]
        assert 0 < len(lines) < len(texts)


def test_text_glob_source(tmp_path):
    for i in range(3):
        (tmp_path / f"doc{i}.txt").write_text(f"document {i}\r\nsecond line\n")
    index = prepare_text(text_source([str(tmp_path / "*.txt")]), tmp_path / "out", seq_len=8)["train"]
    tok = ByteTokenizer()
    documents = split_documents(stored_stream(tmp_path / "out")["tokens"], tok.eos_id, tok.pad_id)
    assert [tok.decode(d.tolist()) for d in documents] == [f"document {i}\r\nsecond line\n" for i in range(3)]
    assert index.meta["source"] == {"kind": "text", "inputs": [str(tmp_path / "*.txt")]}


def test_source_errors_name_the_file_and_line(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"text": "fine"}\n{"txt": "typo"}\n')
    with pytest.raises(DataError, match=r"bad\.jsonl:2: field 'text' is missing"):
        prepare_text(jsonl_source([str(tmp_path / "bad.jsonl")]), tmp_path / "out")
    with pytest.raises(ConfigError, match="matches no file"):
        text_source([str(tmp_path / "*.md")])
    assert main(["--source", "text", "--inputs", str(tmp_path / "*.md"), "--out", str(tmp_path / "o")]) == 2


def test_byte_tokenizer():
    tok = ByteTokenizer()
    ids = tok.encode("héllo ✓")
    assert len(ids) == len("héllo ✓".encode()) and max(ids) < 256
    assert tok.decode([tok.bos_id, *ids, tok.eos_id, tok.pad_id]) == "héllo ✓"
    assert (tok.vocab_size, tok.bos_id, tok.eos_id, tok.pad_id) == (259, 256, 257, 258)
