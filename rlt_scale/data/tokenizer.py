"""Tokenizers: a dependency-free byte tokenizer and a Hugging Face ``tokenizers`` wrapper.

Both expose the same small surface (``vocab_size``, ``encode``, ``decode``,
``bos_id``, ``eos_id``, ``pad_id``) so that preparation, training and
generation never care which one a dataset was built with. A prepared dataset
records its tokenizer in the index (``"byte"`` or a JSON file stored next to
the index), and :func:`load_tokenizer` accepts that dataset directory directly.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable, Protocol

import numpy as np

from rlt_scale.errors import ConfigError

BYTE_TOKENIZER = "byte"
SPECIAL_TOKENS = ("<bos>", "<eos>", "<pad>")
"""Names of the special tokens a trained BPE gets, in id order after the learned vocabulary."""


class Tokenizer(Protocol):
    """What the rest of rlt-scale needs from a tokenizer."""

    vocab_size: int
    bos_id: int
    eos_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_array(self, text: str) -> np.ndarray: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; BOS, EOS and PAD follow (256, 257, 258).

    Every text round-trips exactly, no file or download is needed, and the
    vocabulary is small enough for the tiny configs.
    """

    name = BYTE_TOKENIZER
    bos_id = 256
    eos_id = 257
    pad_id = 258
    vocab_size = 259

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_array(self, text: str) -> np.ndarray:
        """Fast path for preparation: the ids as a uint16 array without a Python list."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int]) -> str:
        """Decode, skipping special ids; invalid UTF-8 (a sample cut mid-character) becomes U+FFFD."""
        data = bytes(int(i) for i in ids if 0 <= int(i) < 256)
        return data.decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizers`` JSON file behind the same interface as ByteTokenizer.

    The EOS token is required (documents are separated with it); BOS and PAD
    fall back to EOS when the file does not define them.
    """

    _EOS_NAMES = ("<eos>", "</s>", "<|endoftext|>", "[SEP]")
    _BOS_NAMES = ("<bos>", "<s>", "<|startoftext|>", "[CLS]")
    _PAD_NAMES = ("<pad>", "[PAD]")

    def __init__(self, path: str | Path):
        try:
            from tokenizers import Tokenizer as _HF
        except ImportError as exc:  # the optional extra is missing
            raise ConfigError("tokenizer", "a tokenizer JSON file needs the 'tokenizers' package "
                              "(pip install 'rlt-scale[hf]')") from exc
        self.path = Path(path)
        self.name = self.path.name
        self._tok = _HF.from_file(str(self.path))
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        self.eos_id = self._find(self._EOS_NAMES)
        if self.eos_id is None:
            raise ConfigError("tokenizer", f"{self.path}: no EOS token (looked for {self._EOS_NAMES})")
        bos, pad = self._find(self._BOS_NAMES), self._find(self._PAD_NAMES)
        self.bos_id = self.eos_id if bos is None else bos
        self.pad_id = self.eos_id if pad is None else pad

    def _find(self, names: tuple[str, ...]) -> int | None:
        for name in names:
            token_id = self._tok.token_to_id(name)
            if token_id is not None:
                return token_id
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_array(self, text: str) -> np.ndarray:
        dtype = np.uint16 if self.vocab_size <= 1 << 16 else np.uint32
        return np.asarray(self.encode(text), dtype=dtype)

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def train_bpe(texts: Iterable[str], vocab_size: int, out_file: str | Path) -> HFTokenizer:
    """Train a byte-level BPE on ``texts`` and save it as a tokenizers JSON file.

    Byte-level pre-tokenization keeps every text encodable and makes decoding
    exact, like the byte tokenizer, but with a learned vocabulary of ``vocab_size``
    entries (the 256 bytes and the three specials included).
    """
    try:
        from tokenizers import Tokenizer as _HF, decoders, models, pre_tokenizers, trainers
    except ImportError as exc:
        raise ConfigError("tokenizer", "training a BPE needs the 'tokenizers' package "
                          "(pip install 'rlt-scale[hf]')") from exc
    if vocab_size < 256 + len(SPECIAL_TOKENS):
        raise ConfigError("train_bpe", f"expected a vocabulary of at least {256 + len(SPECIAL_TOKENS)}, got {vocab_size}")
    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(texts, trainer)
    tok.save(str(out_file))
    return HFTokenizer(out_file)


def load_tokenizer(name_or_path: str | Path = BYTE_TOKENIZER) -> ByteTokenizer | HFTokenizer:
    """Load ``"byte"``, a tokenizers JSON file, or the tokenizer recorded by a prepared dataset directory."""
    if str(name_or_path) == BYTE_TOKENIZER:
        return ByteTokenizer()
    path = Path(name_or_path)
    if path.is_dir():  # a prepared dataset: follow what its index records
        from rlt_scale.data.index import read_index

        return load_tokenizer(read_index(path).tokenizer)
    if not path.is_file():
        raise ConfigError("tokenizer", f"expected 'byte', a tokenizers JSON file or a dataset directory, got {str(path)!r}")
    return HFTokenizer(path)
