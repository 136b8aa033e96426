"""A Hugging Face ``datasets`` dataset as ``data.source``: a directory written by ``save_to_disk``.

``data.source=DIR`` or ``DIR#COLUMN`` (a ``DatasetDict``: its ``train`` split).
The column is ``COLUMN``, else ``input_ids`` when the dataset has one, else
``text``:

- a column of token lists (``input_ids``): the rows are concatenated in index
  order into one token stream, read in place from the dataset's memory-mapped
  Arrow files (nothing copied; memory grows with the Arrow record batches,
  not with the tokens);
- a text column: tokenized once with ``data.tokenizer``, each row a document
  followed by the end-of-text id, into a shard directory in the cache
  (:mod:`unbroken.data.shard_writer`, resumable), keyed by the dataset's
  fingerprint and the tokenizer's hash.

Either way the job then reads one stream as from a shard directory: windows,
the keyed shuffle, the validation tail. ``datasets`` is an optional
dependency (``pip install unbroken[datasets]``), imported only here.

Invariant: a token id outside ``[0, vocab_size)`` is refused at start naming
the dataset, the column, the row and the token's offset.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from unbroken.data.corpus import CHECK_CHUNK
from unbroken.data.shard_writer import input_fingerprint
from unbroken.data.shards import ShardedTokens

__all__ = ["DatasetTextColumn", "is_dataset_source", "is_saved_dataset", "load_hub_dataset", "load_saved_dataset",
           "open_dataset_source", "require_datasets", "split_source"]

logger = logging.getLogger(__name__)

_ROWS_PER_READ = 1024
_SAVED_MARKERS = (("state.json", "dataset_info.json"), ("dataset_dict.json",))


def require_datasets() -> None:
    """Raise ValueError with the install line unless ``datasets`` is importable."""
    if importlib.util.find_spec("datasets") is None:
        raise ValueError("a Hugging Face dataset needs the datasets library: pip install 'unbroken[datasets]'")


def is_saved_dataset(path: str | os.PathLike[str]) -> bool:
    """True iff ``path`` is a directory ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk`` wrote."""
    p = Path(path)
    return p.is_dir() and any(all((p / m).is_file() for m in marks) for marks in _SAVED_MARKERS)


def split_source(source: str) -> tuple[str, str | None]:
    """``(directory, column or None)`` of ``DIR#COLUMN`` (``DIR`` alone: no column named)."""
    path, sep, column = source.rpartition("#")
    return (path, column or None) if sep and is_saved_dataset(path) else (source, None)


def is_dataset_source(source: str) -> bool:
    """True iff ``data.source`` names a saved dataset (``DIR`` or ``DIR#COLUMN``)."""
    return is_saved_dataset(split_source(source)[0])


def load_saved_dataset(path: str | os.PathLike[str], split: str = "train") -> Any:
    """The ``datasets.Dataset`` saved at ``path`` (a ``DatasetDict``'s ``split``), memory-mapped.

    Raises:
        ValueError: ``datasets`` is missing, or the ``DatasetDict`` has no such split (names those it has).
    """
    require_datasets()
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise ValueError(f"{path}: a DatasetDict without a {split!r} split (splits: {', '.join(ds)}); "
                             f"save the split to train on under {split!r}, or give its own directory")
        ds = ds[split]
    return ds


def load_hub_dataset(name: str, split: str) -> Any:
    """``datasets.load_dataset(name, split=split)`` (a Hub name or a local data directory; may download)."""
    require_datasets()
    import datasets

    return datasets.load_dataset(name, split=split)


def _column_of(ds: Any, column: str | None, where: str) -> str:
    names = list(ds.column_names)
    if column is None:
        column = "input_ids" if "input_ids" in names else "text"
    if column not in names:
        raise ValueError(f"data.source={where}: no column {column!r} (columns: {', '.join(names)}); name the "
                         f"token-list or text column as data.source={where}#COLUMN")
    return column


def _arrow_files(ds: Any) -> list[Path]:
    return [Path(f["filename"]) for f in getattr(ds, "cache_files", [])]


def _token_chunks(ds: Any, column: str, where: str) -> list[tuple[np.ndarray, int, Any]]:
    """The column's token lists, flattened, as zero-copy numpy views of the Arrow buffers: one
    ``(tokens, first row, list offsets)`` per record batch."""
    import pyarrow as pa

    col = ds.data.column(column)
    if not (pa.types.is_list(col.type) or pa.types.is_large_list(col.type)) \
            or not pa.types.is_integer(col.type.value_type):
        raise ValueError(f"data.source={where}: column {column!r} holds {col.type}, not lists of integer token ids "
                         f"nor text; give a token-list column (input_ids) or a text column")
    chunks, row = [], 0
    for chunk in col.chunks:
        values = chunk.flatten()
        if values.null_count:
            raise ValueError(f"data.source={where}: column {column!r} holds missing token ids (nulls); drop or "
                             "fill those rows")
        if len(values):
            chunks.append((values.to_numpy(zero_copy_only=True), row, chunk.offsets))
        row += len(chunk)
    return chunks


def _check_range(chunks: list[tuple[np.ndarray, int, Any]], column: str, vocab_size: int, where: str) -> None:
    """Refuse a token outside ``[0, vocab_size)``, naming its row and its offset in the column's stream."""
    base = 0
    for tokens, row0, offsets in chunks:
        for a in range(0, len(tokens), CHECK_CHUNK):
            part = tokens[a:a + CHECK_CHUNK]
            bad = np.flatnonzero((part >= vocab_size) | (part < 0))
            if bad.size:
                at = a + int(bad[0])
                starts = np.asarray(offsets, dtype=np.int64)
                row = row0 + int(np.searchsorted(starts - starts[0], at, side="right")) - 1
                raise ValueError(f"data.source={where}: column {column!r} holds token {int(part[bad[0]])} at row "
                                 f"{row} (token offset {base + at} of the column), outside [0, vocab_size="
                                 f"{vocab_size}); give the tokenizer the dataset was made with (data.tokenizer) or "
                                 "the right data.vocab_size")
        base += len(tokens)


def _fingerprint(ds: Any, column: str, vocab_size: int) -> str:
    h = hashlib.sha256(f"unbroken-hf-dataset-v1\0{column}\0{vocab_size}\0{len(ds)}\0".encode())
    for f in _arrow_files(ds):
        st = f.stat()
        h.update(f"{f.name}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    h.update(str(getattr(ds, "_fingerprint", "")).encode())
    return h.hexdigest()


class DatasetTextColumn:
    """The text column of a ``datasets.Dataset``, one document per row (:class:`~unbroken.data.shard_writer.TextDocuments`)."""

    def __init__(self, dataset: Any, column: str, description: str) -> None:
        if column not in dataset.column_names:
            raise ValueError(f"{description}: no column {column!r} (columns: {', '.join(dataset.column_names)}); "
                             "name the text column with --text-field")
        self.dataset, self.column, self.description = dataset.select_columns([column]), column, description
        self.total: int | None = len(dataset)

    def fingerprint(self) -> str:
        return input_fingerprint(self.column, len(self.dataset), getattr(self.dataset, "_fingerprint", None))

    def documents(self, start: int) -> Iterator[str]:
        for a in range(start, len(self.dataset), _ROWS_PER_READ):
            for i, text in enumerate(self.dataset[a:a + _ROWS_PER_READ][self.column]):
                if not isinstance(text, str):
                    raise ValueError(f"{self.description}: row {a + i} of column {self.column!r} is a "
                                     f"{type(text).__name__}, not text; name the text column with --text-field")
                yield text


def open_dataset_source(source: str, *, vocab_size: int) -> tuple[ShardedTokens | DatasetTextColumn, str, str]:
    """What ``data.source=DIR[#COLUMN]`` holds: ``(tokens or text, fingerprint, resolved source)``.

    A token-list column gives its stream (every id checked against ``vocab_size``), a text column its
    documents (:class:`DatasetTextColumn`, for :func:`~unbroken.data.shard_writer.write_shards`).

    Raises:
        ValueError: ``datasets`` missing, no such column, a column of another kind, a token id out of range.
    """
    import pyarrow as pa

    path, column = split_source(source)
    ds = load_saved_dataset(path)
    column = _column_of(ds, column, source)
    resolved = f"{Path(path).resolve()}#{column}"
    kind = ds.data.column(column).type
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        text = DatasetTextColumn(ds, column, f"data.source={source}")
        return text, text.fingerprint(), resolved
    chunks = _token_chunks(ds, column, source)
    if not chunks:
        raise ValueError(f"data.source={source}: column {column!r} holds no tokens")
    _check_range(chunks, column, vocab_size, source)
    logger.info("using %s: %d rows, %d tokens", resolved, len(ds), sum(len(c[0]) for c in chunks))
    return ShardedTokens([c[0] for c in chunks]), _fingerprint(ds, column, vocab_size), resolved
