"""Token caches: one split of a text corpus, encoded once, memory-mapped after.

Invariants:

- Layout: the split's documents encoded in name order and concatenated with
  the end-of-text id *between* documents, stored as raw little-endian
  ``uint16`` (vocabulary <= 65536) or ``uint32`` in ``<name>.bin``.
- The JSON sidecar ``<name>.bin.json`` (dtype, count, vocab_size, tokenizer
  sha256, corpus fingerprint, split) is written *after* the ``.bin``; both
  writes are atomic, so a cache exists exactly when its sidecar does.
- The file name carries the split, the corpus fingerprint, the tokenizer
  hash, the vocabulary size and the dtype, so a changed corpus or tokenizer
  never reuses stale tokens.
- Read back with ``np.memmap`` read-only; nothing is ever unpickled.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import numpy as np

from unbroken.data._atomic import atomic_write_bytes, atomic_writer
from unbroken.data.corpus import TOKEN_DTYPES, TextCorpus, sidecar_path
from unbroken.data.pretrained import PretrainedTokenizer
from unbroken.data.tokenizer import BPETokenizer

logger = logging.getLogger(__name__)

_ENCODE_BATCH_DOCS = 256  # bounds memory on large corpora, still parallel enough


def token_dtype_for(vocab_size: int, requested: str | None = None) -> np.dtype:
    """The storage dtype for ``vocab_size`` ids: ``requested`` or the smallest fitting.

    Raises:
        ValueError: ``requested`` is unsupported or too small for ``vocab_size``.
    """
    if requested is None:
        requested = "uint16" if vocab_size <= 2**16 else "uint32"
    if requested not in TOKEN_DTYPES:
        raise ValueError(f"token_dtype {requested!r} not supported; accepted: {', '.join(TOKEN_DTYPES)}")
    dtype = np.dtype(requested).newbyteorder("<")
    if vocab_size > np.iinfo(dtype).max + 1:
        raise ValueError(f"token_dtype {requested!r} cannot hold vocab_size {vocab_size}; use 'uint32'")
    return dtype


def token_cache_path(cache_dir: str | os.PathLike[str], *, split: str, fingerprint: str,
                     tokenizer_sha256: str, vocab_size: int, dtype: np.dtype) -> Path:
    """Where the tokens of one split encoded by one tokenizer are cached."""
    name = f"tokens-{split}-{fingerprint[:16]}-{tokenizer_sha256[:16]}-v{vocab_size}-{np.dtype(dtype).name}.bin"
    return Path(cache_dir) / name


def _map(path: Path, dtype: np.dtype, count: int) -> np.ndarray:
    if count == 0:  # mmap cannot map an empty file
        return np.empty(0, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=(count,))


def open_token_cache(path: str | os.PathLike[str], *, expect: dict[str, object] | None = None) -> np.ndarray | None:
    """Map a complete token cache read-only, or return None if it is absent or stale.

    Args:
        path: the ``.bin`` file.
        expect: sidecar fields that must match (e.g. the tokenizer hash).
    """
    path = Path(path)
    side = sidecar_path(path)
    if not side.exists() or not path.exists():
        return None
    try:
        meta = json.loads(side.read_text())
        dtype = np.dtype(str(meta["dtype"])).newbyteorder("<")
        count = int(meta["count"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        logger.warning("%s: unreadable sidecar (%s); rebuilding", side, e)
        return None
    if path.stat().st_size != count * dtype.itemsize:
        logger.warning("%s: size %d does not match %d tokens; rebuilding", path, path.stat().st_size, count)
        return None
    for key, value in (expect or {}).items():
        if meta.get(key) != value:
            logger.warning("%s: sidecar %s=%r, expected %r; rebuilding", side, key, meta.get(key), value)
            return None
    return _map(path, dtype, count)


def build_token_cache(
    corpus: TextCorpus,
    tokenizer: BPETokenizer | PretrainedTokenizer,
    path: str | os.PathLike[str],
    *,
    split: str,
    vocab_size: int,
    token_dtype: str | None = None,
) -> np.ndarray:
    """Encode every document of ``corpus`` and write the cache at ``path``.

    Args:
        corpus: one split of a text corpus.
        tokenizer: the tokenizer to encode with.
        path: the ``.bin`` file to write (its sidecar goes next to it).
        split: ``"train"`` or ``"val"``, recorded in the sidecar.
        vocab_size: the model's vocabulary size (decides the dtype).
        token_dtype: force ``"uint16"``/``"uint32"`` instead of the smallest fit.

    Returns:
        The cache, memory-mapped read-only.
    """
    path = Path(path)
    dtype = token_dtype_for(vocab_size, token_dtype)
    if tokenizer.vocab_size > vocab_size:
        raise ValueError(f"tokenizer {tokenizer.path} has {tokenizer.vocab_size} ids > vocab_size {vocab_size}")
    eot = np.array([tokenizer.eot_id], dtype=dtype)
    count = 0
    with atomic_writer(path) as f:
        docs = corpus.documents
        for start in range(0, len(docs), _ENCODE_BATCH_DOCS):
            chunk = docs[start:start + _ENCODE_BATCH_DOCS]
            for i, ids in enumerate(tokenizer.encode_batch([corpus.read(d) for d in chunk])):
                if start + i > 0:
                    f.write(eot.tobytes())
                    count += 1
                f.write(np.asarray(ids, dtype=dtype).tobytes())
                count += len(ids)
    meta = {
        "dtype": dtype.name,
        "count": count,
        "vocab_size": vocab_size,
        "tokenizer_sha256": tokenizer.sha256,
        "corpus_fingerprint": corpus.fingerprint(),
        "split": split,
        "documents": len(corpus),
    }
    atomic_write_bytes(sidecar_path(path), json.dumps(meta, indent=1).encode())
    logger.info("built token cache %s: %d %s tokens from %d documents", path, count, split, len(corpus))
    return _map(path, dtype, count)


def load_or_build_token_cache(
    corpus: TextCorpus,
    tokenizer: BPETokenizer | PretrainedTokenizer,
    *,
    cache_dir: str | os.PathLike[str],
    split: str,
    vocab_size: int,
    token_dtype: str | None = None,
) -> np.ndarray:
    """Reuse the cache of (``corpus``, ``tokenizer``) if complete, else build it."""
    dtype = token_dtype_for(vocab_size, token_dtype)
    path = token_cache_path(cache_dir, split=split, fingerprint=corpus.fingerprint(),
                            tokenizer_sha256=tokenizer.sha256, vocab_size=vocab_size, dtype=dtype)
    expect = {"tokenizer_sha256": tokenizer.sha256, "corpus_fingerprint": corpus.fingerprint(),
              "split": split, "vocab_size": vocab_size, "dtype": dtype.name}
    tokens = open_token_cache(path, expect=expect)
    if tokens is not None:
        logger.info("reusing token cache %s (%d tokens)", path, len(tokens))
        return tokens
    return build_token_cache(corpus, tokenizer, path, split=split, vocab_size=vocab_size,
                             token_dtype=token_dtype)
