"""Data subsystem: preparation (``rlt-prepare``) and the resumable streaming loader.

Modules, in the order data flows through them:

* :mod:`~rlt_scale.data.sources`, :mod:`~rlt_scale.data.tasks` produce documents or synthetic samples;
* :mod:`~rlt_scale.data.tokenizer` turns text into ids;
* :mod:`~rlt_scale.data.packing` packs documents into samples of ``seq_len + 1`` tokens;
* :mod:`~rlt_scale.data.writer` writes webdataset shards and :mod:`~rlt_scale.data.index` the index;
* :mod:`~rlt_scale.data.order` computes the global sample order from the index;
* :mod:`~rlt_scale.data.shards` reads and checks shards; :mod:`~rlt_scale.data.loader` makes batches.

See docs/DATA.md.
"""

from rlt_scale.data.config import DataConfig
from rlt_scale.data.index import DatasetIndex, ShardInfo, read_index
from rlt_scale.data.tokenizer import ByteTokenizer, HFTokenizer, load_tokenizer

__all__ = ["DataConfig", "DatasetIndex", "ShardInfo", "read_index", "ByteTokenizer", "HFTokenizer",
           "load_tokenizer", "StreamingLoader", "prepare_text", "prepare_task"]


def __getattr__(name: str):
    """Import the torch-heavy loader and the CLI module only when asked for.

    (Importing ``prepare`` here eagerly would also make ``python -m
    rlt_scale.data.prepare`` warn that the module was already imported.)
    """
    if name == "StreamingLoader":
        from rlt_scale.data.loader import StreamingLoader
        return StreamingLoader
    if name in ("prepare_text", "prepare_task"):
        from rlt_scale.data import prepare
        return getattr(prepare, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
