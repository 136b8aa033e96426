"""``unbroken prepare-data``: text documents tokenized into a directory of token shards, resumable.

Layout of the directory written (what :mod:`unbroken.data.shards` reads):

- ``part-00000.npy``, ``part-00001.npy``, ...: ``uint16`` arrays (``uint32``
  when the vocabulary exceeds 65,536 ids), each exactly ``shard_tokens``
  tokens but the last. Their concatenation is the documents in input order,
  each followed by the tokenizer's end-of-text id (empty documents are
  skipped).
- ``vocab.json``: ``{"vocab_size", "eot_id", "tokenizer_sha256"}``, written
  last: the directory is complete when it exists.
- ``prepare.json``: the progress: the settings' fingerprint, the shards
  written, the document and the token offset inside it where the next shard
  begins, ``done``.

Invariants:

- Deterministic: the same documents, tokenizer and ``shard_tokens`` give the
  same bytes.
- Resumable: a shard is written atomically and then the progress (atomically);
  a run killed anywhere and run again continues after the last shard the
  progress records (a shard written after it is written again, identically),
  and ends with the bytes of an uninterrupted run.
- A directory prepared with other settings, or holding anything else, is
  refused, never mixed.
- Memory: one shard's buffer plus a batch of documents.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import numpy as np

from unbroken.data._atomic import atomic_write_bytes, atomic_writer
from unbroken.data.pretrained import PretrainedTokenizer
from unbroken.data.token_cache import token_dtype_for

__all__ = ["DEFAULT_SHARD_TOKENS", "PROGRESS_FILE", "Progress", "TextDocuments", "shard_name", "write_shards"]

logger = logging.getLogger(__name__)

DEFAULT_SHARD_TOKENS = 1 << 26
"""Tokens per shard unless told: 128 MiB of uint16 (256 MiB of uint32)."""
PROGRESS_FILE = "prepare.json"
VOCAB_FILE = "vocab.json"
_ENCODE_BATCH = 256  # documents encoded at once (the tokenizer's threads), bounding memory
_FORMAT = "unbroken-prepare-v1"


class TextDocuments(Protocol):
    """Documents in a fixed order, readable from any index (what a resumed run needs)."""

    description: str
    """Where they come from, for messages."""
    total: int | None
    """How many (None: not known before reading them all)."""

    def fingerprint(self) -> str:
        """Changes when a document may have changed (names, sizes and times of files; a dataset's fingerprint)."""
        ...

    def documents(self, start: int) -> Iterator[str]:
        """Document ``start`` and every one after it, in order."""
        ...


@dataclass(frozen=True)
class Progress:
    """Where a preparation stands: passed to ``on_progress`` after each batch and returned at the end."""

    documents: int
    """Documents read so far (all of them at the end)."""
    total: int | None
    """Documents in the input, when known."""
    tokens: int
    """Tokens in the shards written, and buffered for the next."""
    shards: int
    """Shards written."""
    done: bool = False


def shard_name(index: int) -> str:
    return f"part-{index:05d}.npy"


def _settings(docs: TextDocuments, tokenizer: PretrainedTokenizer, shard_tokens: int) -> dict[str, Any]:
    return {"format": _FORMAT, "input": docs.description, "input_fingerprint": docs.fingerprint(),
            "tokenizer_sha256": tokenizer.sha256, "vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id,
            "shard_tokens": shard_tokens}


def _start_state(out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    """The progress to continue from (a fresh one for a new directory).

    Raises:
        ValueError: ``out`` holds another preparation or other files (names what differs and the fix).
    """
    path = out / PROGRESS_FILE
    if out.exists() and not out.is_dir():
        raise ValueError(f"--out {out}: a file, not a directory; give a directory for the shards")
    if not path.is_file():
        if out.exists() and any(p for p in out.iterdir() if not _is_temp(p)):
            raise ValueError(f"--out {out}: not empty and not a directory unbroken prepare-data writes (no "
                             f"{PROGRESS_FILE}); give a new or empty directory")
        return {"settings": settings, "shards": 0, "document": 0, "offset": 0, "documents": 0, "tokens": 0,
                "done": False}
    try:
        state = json.loads(path.read_text())
        saved = state["settings"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ValueError(f"{path}: unreadable progress ({e}); remove {out} and prepare it again") from None
    differ = sorted(k for k in set(saved) | set(settings) if saved.get(k) != settings.get(k))
    if differ:
        raise ValueError(f"--out {out} was prepared with other settings ({', '.join(differ)} differ); run with the "
                         "same input, tokenizer and --shard-tokens to continue it, or give a new --out")
    return dict(state)


def _is_temp(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(".tmp")


def _write_shard(out: Path, index: int, tokens: np.ndarray) -> None:
    with atomic_writer(out / shard_name(index)) as f:
        np.save(f, tokens, allow_pickle=False)


def write_shards(docs: TextDocuments, tokenizer: PretrainedTokenizer, out: str | os.PathLike[str], *,
                 shard_tokens: int = DEFAULT_SHARD_TOKENS,
                 on_progress: Callable[[Progress], None] | None = None) -> Progress:
    """Tokenize ``docs`` into shards under ``out``, continuing a preparation a killed run left there.

    Args:
        docs: the documents (:class:`TextDocuments`; see :mod:`unbroken.data.text_inputs`).
        tokenizer: encodes them; its end-of-text id ends each document; its size is the vocabulary.
        out: the shard directory (created).
        shard_tokens: tokens per shard (the last may hold fewer).
        on_progress: called after each batch of documents and at the end.

    Returns:
        The final progress (``done``).

    Raises:
        ValueError: ``out`` holds something else or another preparation; no document holds text; a bad
            document (from ``docs``).
    """
    if shard_tokens < 1:
        raise ValueError(f"--shard-tokens {shard_tokens}: must be >= 1")
    out = Path(out)
    settings = _settings(docs, tokenizer, shard_tokens)
    state = _start_state(out, settings)
    out.mkdir(parents=True, exist_ok=True)
    for stale in [p for p in out.iterdir() if _is_temp(p)]:  # a killed run's unfinished write
        stale.unlink()
    shards = int(state["shards"])
    if state["done"]:
        return Progress(documents=int(state["documents"]), total=docs.total,
                        tokens=int(state["tokens"]), shards=shards, done=True)
    dtype = token_dtype_for(tokenizer.vocab_size)
    buf, fill = np.empty(shard_tokens, dtype=dtype), 0
    index, skip = int(state["document"]), int(state["offset"])
    eot = [tokenizer.eot_id]

    def save(next_document: int, offset: int) -> None:
        nonlocal shards
        _write_shard(out, shards, buf[:fill])
        shards += 1
        state.update(shards=shards, document=next_document, offset=offset, documents=next_document,
                     tokens=(shards - 1) * shard_tokens + fill)
        atomic_write_bytes(out / PROGRESS_FILE, json.dumps(state, indent=1).encode())

    for batch in _batches(docs.documents(index)):
        for ids in tokenizer.encode_batch(batch):
            if ids:
                ids = ids + eot
            pos, skip = skip, 0
            while pos < len(ids):
                take = min(shard_tokens - fill, len(ids) - pos)
                buf[fill:fill + take] = ids[pos:pos + take]
                fill, pos = fill + take, pos + take
                if fill == shard_tokens:
                    save(index + (pos == len(ids)), pos if pos < len(ids) else 0)
                    fill = 0
            index += 1
        if on_progress is not None:
            on_progress(Progress(documents=index, total=docs.total, tokens=shards * shard_tokens + fill,
                                 shards=shards))
    if fill:
        save(index, 0)
    if shards == 0:
        raise ValueError(f"{docs.description}: no document holds any text; nothing to prepare")
    state.update(done=True, documents=index)
    atomic_write_bytes(out / PROGRESS_FILE, json.dumps(state, indent=1).encode())
    vocab = {"vocab_size": tokenizer.vocab_size, "eot_id": tokenizer.eot_id, "tokenizer_sha256": tokenizer.sha256}
    atomic_write_bytes(out / VOCAB_FILE, json.dumps(vocab, indent=1).encode())
    final = Progress(documents=index, total=docs.total, tokens=int(state["tokens"]), shards=shards, done=True)
    if on_progress is not None:
        on_progress(final)
    logger.info("prepared %s: %d shards, %d tokens from %d documents", out, shards, final.tokens, index)
    return final


def _batches(documents: Iterator[str]) -> Iterator[list[str]]:
    batch: list[str] = []
    for text in documents:
        batch.append(text)
        if len(batch) == _ENCODE_BATCH:
            yield batch
            batch = []
    if batch:
        yield batch


def input_fingerprint(*parts: object) -> str:
    """sha256 over ``parts`` (their ``repr``), for :meth:`TextDocuments.fingerprint`."""
    return hashlib.sha256("\0".join(repr(p) for p in parts).encode()).hexdigest()
