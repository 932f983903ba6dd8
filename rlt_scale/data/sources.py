"""Document sources for preparation: text files, JSONL, SFT JSONL and the Python standard library.

A source is re-iterable (training a BPE reads it once, packing a second time)
and yields :class:`Document` objects in a deterministic order. Every error
names the file (and line) at fault.
"""

from __future__ import annotations

import glob
import hashlib
import json
import sysconfig
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

from rlt_scale.errors import ConfigError, DataError

STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idlelib", "__pycache__"})
"""Left out of the stdlib corpus: installed third-party code and the test suites
(large, repetitive, and some are deliberately not valid UTF-8)."""


@dataclass(frozen=True)
class Document:
    """One document. Plain text has ``prompt is None``; SFT pairs keep prompt and response apart."""

    name: str
    """Where it came from: a path, ``file.jsonl:LINE``, or a path inside the stdlib."""
    text: str = ""
    prompt: str | None = None
    response: str | None = None

    @property
    def size(self) -> int:
        """UTF-8 bytes of text (or prompt plus response): what ``max_bytes`` bounds."""
        return sum(len(part.encode("utf-8")) for part in (self.text, self.prompt or "", self.response or ""))


class Source:
    """A re-iterable, bounded stream of documents."""

    def __init__(self, produce: Callable[[], Iterator[Document]], description: dict,
                 max_bytes: int | None = None, max_docs: int | None = None):
        self._produce, self.description = produce, description
        self.max_bytes, self.max_docs = max_bytes, max_docs

    def __iter__(self) -> Iterator[Document]:
        """Yield documents until ``max_docs`` or until the text read reaches ``max_bytes``."""
        total = 0
        for count, doc in enumerate(self._produce()):
            if self.max_docs is not None and count >= self.max_docs:
                return
            if self.max_bytes is not None and total >= self.max_bytes:
                return
            total += doc.size
            yield doc


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def stdlib_files() -> list[Path]:
    """The stdlib's ``.py`` files (tests and third-party packages excluded), relative to :func:`stdlib_root`.

    They are ordered by a hash of their path, so any size bound takes a mix of
    modules rather than the alphabetical head, and the order is the same on every
    machine with the same Python version.
    """
    root = stdlib_root()
    files = [p.relative_to(root) for p in root.rglob("*.py")
             if not STDLIB_SKIP_DIRS.intersection(p.relative_to(root).parts)]
    if not files:
        raise DataError(f"{root}: no Python source files found (is the standard library installed?)")
    return sorted(files, key=lambda p: hashlib.blake2b(p.as_posix().encode(), digest_size=8).digest())


def _read_text(path: Path, name: str | None = None) -> str:
    try:
        return path.read_bytes().decode("utf-8")  # bytes, not read_text: keep '\r\n' exactly
    except UnicodeDecodeError as exc:
        raise DataError(f"{name or path}: not UTF-8 text ({exc})") from exc
    except OSError as exc:
        raise DataError(f"{name or path}: cannot read ({exc})") from exc


def stdlib_source(max_bytes: int | None = None, max_docs: int | None = None) -> Source:
    """The Python standard library's own source files: real text that needs no download."""
    root = stdlib_root()

    def produce() -> Iterator[Document]:
        for rel in stdlib_files():
            yield Document(name=rel.as_posix(), text=_read_text(root / rel))

    return Source(produce, {"kind": "stdlib", "root": str(root)}, max_bytes, max_docs)


def expand_inputs(patterns: Sequence[str]) -> list[Path]:
    """Expand file names and globs (``**`` allowed) in the given order; each pattern must match."""
    if not patterns:
        raise ConfigError("inputs", "expected at least one file or glob")
    files: list[Path] = []
    for pattern in patterns:
        matched = sorted(glob.glob(pattern, recursive=True))
        matched = [m for m in matched if Path(m).is_file()]
        if not matched:
            raise ConfigError("inputs", f"{pattern!r} matches no file")
        files.extend(Path(m) for m in matched)
    return files


def text_source(patterns: Sequence[str], max_bytes: int | None = None, max_docs: int | None = None) -> Source:
    """One document per UTF-8 text file."""
    files = expand_inputs(patterns)

    def produce() -> Iterator[Document]:
        for path in files:
            yield Document(name=str(path), text=_read_text(path))

    return Source(produce, {"kind": "text", "inputs": list(patterns)}, max_bytes, max_docs)


def _jsonl_records(files: Iterable[Path]) -> Iterator[tuple[str, dict]]:
    for path in files:
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                name = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{name}: invalid JSON ({exc})") from exc
                if not isinstance(record, dict):
                    raise DataError(f"{name}: expected a JSON object, got {type(record).__name__}")
                yield name, record


def _field(record: dict, field: str, name: str) -> str:
    value = record.get(field)
    if not isinstance(value, str):
        raise DataError(f"{name}: field {field!r} is missing or not a string (keys: {sorted(record)})")
    return value


def jsonl_source(patterns: Sequence[str], text_field: str = "text",
                 max_bytes: int | None = None, max_docs: int | None = None) -> Source:
    """One document per JSONL line, taken from ``text_field``."""
    files = expand_inputs(patterns)

    def produce() -> Iterator[Document]:
        for name, record in _jsonl_records(files):
            yield Document(name=name, text=_field(record, text_field, name))

    return Source(produce, {"kind": "jsonl", "inputs": list(patterns), "text_field": text_field},
                  max_bytes, max_docs)


def sft_source(patterns: Sequence[str], prompt_field: str = "prompt", response_field: str = "response",
               max_bytes: int | None = None, max_docs: int | None = None) -> Source:
    """One prompt/response pair per JSONL line; only the response becomes a training target."""
    files = expand_inputs(patterns)

    def produce() -> Iterator[Document]:
        for name, record in _jsonl_records(files):
            yield Document(name=name, prompt=_field(record, prompt_field, name),
                           response=_field(record, response_field, name))

    return Source(produce, {"kind": "sft", "inputs": list(patterns), "prompt_field": prompt_field,
                            "response_field": response_field}, max_bytes, max_docs)
