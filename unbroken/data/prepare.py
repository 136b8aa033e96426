"""``prepare_data``: corpus -> tokenizer -> train/val token memmaps, cached.

Invariants:

- Everything built lives under one cache directory (argument, else
  ``$UNBROKEN_CACHE_DIR``, else ``~/.cache/unbroken``), keyed by content
  fingerprints: a changed corpus, ``max_bytes``, ``val_fraction`` or
  ``vocab_size`` builds new files and never reuses stale ones.
- Safe under concurrency: many processes may call ``prepare_data`` on the same
  cache at once. Each takes an exclusive ``fcntl.flock`` on
  ``<cache_dir>/.lock`` (with a timeout) to look up or build the caches, so
  exactly one builds and the others then reuse its files (a lookup holds the
  lock for milliseconds: fingerprints are computed before taking it). Files
  are written atomically, so no reader sees a partial file even without the
  lock.
- The result is the same on every process and every run for the same inputs
  (:attr:`PreparedData.fingerprint` identifies the token streams exactly).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from unbroken.data.corpus import (
    TextCorpus,
    _read_sidecar,
    check_val_fraction,
    is_token_file,
    open_text_corpus,
    open_token_file,
)
from unbroken.data.blend import Blend, parse_blend
from unbroken.data.hf_dataset import DatasetTextColumn, is_dataset_source, open_dataset_source
from unbroken.data.pretrained import PretrainedTokenizer
from unbroken.data.shard_writer import DEFAULT_SHARD_TOKENS, write_shards
from unbroken.data.shards import ShardedTokens, is_shard_directory, open_shard_directory
from unbroken.data.token_cache import load_or_build_token_cache, token_dtype_for
from unbroken.data.tokenizer import check_vocab_size, load_or_train_tokenizer

logger = logging.getLogger(__name__)

Stream = np.ndarray | ShardedTokens
CACHE_DIR_ENV = "UNBROKEN_CACHE_DIR"
DEFAULT_CACHE_DIR = Path("~/.cache/unbroken")
LOCK_TIMEOUT_S = 600.0
_LOCK_POLL_S = 0.1


@dataclass(frozen=True)
class PreparedData:
    """Token streams ready for the samplers.

    Attributes:
        train: training tokens, 1-D read-only (memmap; over many shards, a ShardedTokens).
        val: validation tokens, 1-D read-only (may be empty).
        vocab_size: the model's vocabulary size; every token is below it.
        tokenizer_path: the tokenizer JSON (None for pre-tokenized sources).
        fingerprint: sha256 identifying exactly these train/val streams.
        source: ``"stdlib"`` or the resolved path of the source.
    """

    train: np.ndarray | ShardedTokens | Blend
    val: np.ndarray | ShardedTokens | Blend
    vocab_size: int
    tokenizer_path: str | None
    fingerprint: str
    source: str


def default_cache_dir() -> Path:
    """``$UNBROKEN_CACHE_DIR`` if set, else ``~/.cache/unbroken``."""
    env = os.environ.get(CACHE_DIR_ENV)
    return Path(env).expanduser() if env else DEFAULT_CACHE_DIR.expanduser()


@contextlib.contextmanager
def cache_lock(cache_dir: str | os.PathLike[str], timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Hold an exclusive ``flock`` on ``<cache_dir>/.lock``.

    The kernel drops the lock when its holder dies, so a crashed builder never
    blocks the others.

    Raises:
        TimeoutError: the lock was not acquired within ``timeout_s`` seconds.
    """
    path = Path(cache_dir) / ".lock"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as e:
                if e.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"could not lock {path} within {timeout_s:.0f} s: another process is "
                                       "still preparing data there; wait for it, or use another cache dir "
                                       f"(${CACHE_DIR_ENV})") from None
                time.sleep(_LOCK_POLL_S)
        try:
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
    finally:
        os.close(fd)


def _streams_fingerprint(train: np.ndarray | ShardedTokens, val: np.ndarray | ShardedTokens, *parts: str) -> str:
    h = hashlib.sha256("\0".join(parts).encode())
    h.update(f"{train.dtype.name}:{len(train)}:{val.dtype.name}:{len(val)}".encode())
    return h.hexdigest()


def _prepare_tokens_file(source: str, *, vocab_size: int, val_fraction: float, token_dtype: str | None,
                         max_bytes: int | None) -> PreparedData:
    if max_bytes is not None:
        raise ValueError(f"max_bytes={max_bytes} applies to text sources only, not the token file {source}")
    token_file = open_token_file(source, dtype=token_dtype, vocab_size=vocab_size)
    train, val = token_file.split(val_fraction)
    fp = _streams_fingerprint(train, val, token_file.fingerprint, repr(val_fraction))
    logger.info("using pre-tokenized %s: %d train / %d val tokens", source, len(train), len(val))
    return PreparedData(train=train, val=val, vocab_size=token_file.vocab_size, tokenizer_path=None,
                        fingerprint=fp, source=str(token_file.path.resolve()))


def _prepare_shards(source: str, *, vocab_size: int, val_fraction: float, token_dtype: str | None,
                    max_bytes: int | None) -> PreparedData:
    if max_bytes is not None:
        raise ValueError(f"max_bytes={max_bytes} applies to text sources only, not the shard directory {source}")
    tokens, vocab, shards_fp = open_shard_directory(source, dtype=token_dtype, vocab_size=vocab_size)
    cut = len(tokens) - int(len(tokens) * val_fraction)  # the tail of the stream is validation, as for one file
    train, val = tokens[:cut], tokens[cut:]
    assert isinstance(train, ShardedTokens) and isinstance(val, ShardedTokens)
    fp = _streams_fingerprint(train, val, shards_fp, repr(val_fraction))
    logger.info("using %d pre-tokenized shards in %s: %d train / %d val tokens", len(tokens.parts), source,
                len(train), len(val))
    return PreparedData(train=train, val=val, vocab_size=vocab, tokenizer_path=None, fingerprint=fp,
                        source=str(Path(source).resolve()))


def _prepare_dataset(source: str, *, vocab_size: int, val_fraction: float, cache_dir: str | os.PathLike[str] | None,
                     max_bytes: int | None, pretrained: PretrainedTokenizer | None) -> PreparedData:
    if max_bytes is not None:
        raise ValueError(f"max_bytes={max_bytes} applies to text directories only, not the dataset {source}")
    held, ds_fp, resolved = open_dataset_source(source, vocab_size=vocab_size)
    if isinstance(held, DatasetTextColumn):
        tokens, vocab_size, ds_fp = _tokenize_dataset(held, pretrained, cache_dir)
    else:
        tokens = held
    cut = len(tokens) - int(len(tokens) * val_fraction)  # the tail is validation, as for a shard directory
    train, val = tokens[:cut], tokens[cut:]
    assert isinstance(train, ShardedTokens) and isinstance(val, ShardedTokens)
    fp = _streams_fingerprint(train, val, ds_fp, repr(val_fraction))
    logger.info("using the dataset %s: %d train / %d val tokens", resolved, len(train), len(val))
    return PreparedData(train=train, val=val, vocab_size=vocab_size,
                        tokenizer_path=str(pretrained.path) if pretrained is not None else None, fingerprint=fp,
                        source=resolved)


def _tokenize_dataset(text: DatasetTextColumn, pretrained: PretrainedTokenizer | None,
                      cache_dir: str | os.PathLike[str] | None) -> tuple[ShardedTokens, int, str]:
    """A dataset's text column tokenized once into a shard directory of the cache (resumable), then opened."""
    if pretrained is None:
        raise ValueError(f"{text.description}: column {text.column!r} holds text; name the tokenizer to encode it "
                         "with (data.tokenizer=/path/to/tokenizer.json), or tokenize it into shards first "
                         "(unbroken prepare-data)")
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    key = hashlib.sha256(f"{text.fingerprint()}\0{pretrained.sha256}".encode()).hexdigest()[:16]
    with cache_lock(cache):
        write_shards(text, pretrained, cache / f"hf-{key}", shard_tokens=DEFAULT_SHARD_TOKENS)
    return open_shard_directory(cache / f"hf-{key}", dtype=None, vocab_size=pretrained.vocab_size)


def _prepare_blend(spec: dict[str, float], *, vocab_size: int, val_fraction: float, token_dtype: str | None,
                   max_bytes: int | None) -> PreparedData:
    parts = []
    for path in spec:
        if not (is_token_file(path) or is_shard_directory(path)):
            raise ValueError(f"blend source {path}: not a .bin/.npy token file or a shard directory; a blend "
                             "mixes pre-tokenized sources (tokenize text into shards first, docs/data.md)")
        prepare = _prepare_tokens_file if is_token_file(path) else _prepare_shards
        parts.append(prepare(path, vocab_size=vocab_size, val_fraction=val_fraction, token_dtype=token_dtype,
                             max_bytes=max_bytes))
    weights, names = list(spec.values()), [p.source for p in parts]
    # A source is one file or one shard directory, never itself a blend.
    train = Blend([cast(Stream, p.train) for p in parts], weights, names)
    val = Blend([cast(Stream, p.val) for p in parts], weights, names)
    fp = hashlib.sha256(json.dumps([[p.fingerprint, w] for p, w in zip(parts, weights)]).encode()).hexdigest()
    return PreparedData(train=train, val=val, vocab_size=max(p.vocab_size for p in parts), tokenizer_path=None,
                        fingerprint=fp, source=json.dumps(dict(zip(names, weights))))


def _split_text(corpus: TextCorpus, val_fraction: float) -> tuple[TextCorpus, TextCorpus]:
    train_corpus, val_corpus = corpus.split(val_fraction)
    if len(train_corpus) == 0:
        raise ValueError(f"{corpus.source}: all {len(corpus)} documents fell into the validation split at "
                         f"val_fraction={val_fraction}; lower it or add documents")
    if len(val_corpus) == 0 and val_fraction > 0:
        logger.warning("%s: no document fell into the validation split at val_fraction=%s",
                       corpus.source, val_fraction)
    # Hash the files now, outside the lock, so waiting processes do not queue behind each other's reads.
    train_corpus.fingerprint()
    val_corpus.fingerprint()
    return train_corpus, val_corpus


def _prepare_text(train_corpus: TextCorpus, val_corpus: TextCorpus, *, vocab_size: int, cache_dir: Path,
                  token_dtype: str | None,
                  pretrained: PretrainedTokenizer | None) -> tuple[np.ndarray, np.ndarray, str, str]:
    tokenizer = pretrained or load_or_train_tokenizer(train_corpus, vocab_size=vocab_size, cache_dir=cache_dir)
    common: dict[str, Any] = dict(cache_dir=cache_dir, vocab_size=vocab_size, token_dtype=token_dtype)
    train = load_or_build_token_cache(train_corpus, tokenizer, split="train", **common)
    val = load_or_build_token_cache(val_corpus, tokenizer, split="val", **common)
    assert tokenizer.path is not None
    fp = _streams_fingerprint(train, val, train_corpus.fingerprint(), val_corpus.fingerprint(),
                              tokenizer.sha256, str(vocab_size))
    return train, val, str(tokenizer.path), fp


def stated_vocab_size(*, source: str, vocab_size: int, tokenizer: str | None) -> int:
    """The vocabulary ``prepare_data`` gives these arguments, found without reading or tokenizing the data:
    the tokenizer's size, else what a token file's sidecar or a shard directory's ``vocab.json`` states (the
    largest of a blend's), else ``vocab_size``.

    Raises:
        ValueError: the tokenizer, a sidecar or the blend cannot be read (names it).
    """
    if tokenizer:
        return PretrainedTokenizer(tokenizer).vocab_size
    blend = parse_blend(source)
    paths = list(blend) if blend is not None else [source]
    stated = []
    for path in paths:
        side = Path(path) / "vocab" if is_shard_directory(path) else Path(path) if is_token_file(path) else None
        meta = _read_sidecar(side) if side is not None else {}
        stated.append(int(meta.get("vocab_size", vocab_size)))
    return max(stated)


def prepare_data(
    *,
    source: str = "stdlib",
    vocab_size: int = 4096,
    val_fraction: float = 0.05,
    cache_dir: str | os.PathLike[str] | None = None,
    token_dtype: str | None = None,
    max_bytes: int | None = None,
    tokenizer: str | None = None,
) -> PreparedData:
    """Build or reuse the tokenizer and the train/val token caches of a corpus.

    Args:
        source: ``"stdlib"``, a directory of ``*.txt`` files, a
            pre-tokenized ``.bin``/``.npy`` file (see :mod:`unbroken.data.corpus`),
            or a directory of such shards and Megatron ``.bin``/``.idx`` pairs
            (:mod:`unbroken.data.shards`; the tail of their concatenation is validation),
            or a JSON object ``{path: weight}`` of such sources blended by weight
            (:mod:`unbroken.data.blend`; each source's tail is its validation), or a Hugging
            Face dataset saved with ``save_to_disk``, ``DIR`` or ``DIR#COLUMN``
            (:mod:`unbroken.data.hf_dataset`; the tail of its stream is validation).
        vocab_size: tokenizer size for text sources; for a token file, its
            vocabulary size unless its sidecar states one.
        val_fraction: share held out for validation, in ``[0, 1)`` (by
            document-name hash for text, the tail of a token file).
        cache_dir: where to cache; default ``$UNBROKEN_CACHE_DIR`` or
            ``~/.cache/unbroken``.
        token_dtype: ``"uint16"``/``"uint32"``: the dtype of a ``.bin`` token
            file without sidecar, or the storage dtype of a text source's cache
            (default: the smallest that holds ``vocab_size``).
        max_bytes: keep only the first text documents (by name) up to this many
            bytes, for quick tests and benchmarks.
        tokenizer: a ``tokenizer.json`` or a local Hugging Face model directory
            holding one (:mod:`unbroken.data.pretrained`): text is tokenized
            with it instead of a trained BPE, and the vocabulary size is its
            size (``vocab_size`` is then ignored, for token files too).

    Returns:
        The prepared streams; text sources map cached files read-only.

    Raises:
        ValueError: bad arguments or a bad source (the message names it).
        TimeoutError: another process held the cache lock too long.
    """
    check_val_fraction(val_fraction)
    pretrained = PretrainedTokenizer(tokenizer) if tokenizer else None
    if pretrained is not None:
        vocab_size = pretrained.vocab_size
    blend = parse_blend(source)
    if blend is not None:
        return _prepare_blend(blend, vocab_size=vocab_size, val_fraction=val_fraction, token_dtype=token_dtype,
                              max_bytes=max_bytes)
    if is_dataset_source(source):
        return _prepare_dataset(source, vocab_size=vocab_size, val_fraction=val_fraction, cache_dir=cache_dir,
                                max_bytes=max_bytes, pretrained=pretrained)
    if is_token_file(source):
        return _prepare_tokens_file(source, vocab_size=vocab_size, val_fraction=val_fraction,
                                    token_dtype=token_dtype, max_bytes=max_bytes)
    if is_shard_directory(source):
        return _prepare_shards(source, vocab_size=vocab_size, val_fraction=val_fraction,
                               token_dtype=token_dtype, max_bytes=max_bytes)
    if pretrained is None:
        check_vocab_size(vocab_size)
    token_dtype_for(vocab_size, token_dtype)  # reject a bad dtype before any work
    start = time.perf_counter()
    corpus = open_text_corpus(source)
    if max_bytes is not None:
        corpus = corpus.truncate(max_bytes)
    cache = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    train_corpus, val_corpus = _split_text(corpus, val_fraction)
    with cache_lock(cache):
        train, val, tokenizer_path, fp = _prepare_text(train_corpus, val_corpus, vocab_size=vocab_size,
                                                       cache_dir=cache, token_dtype=token_dtype,
                                                       pretrained=pretrained)
    logger.info("data ready in %.1f s: %s, %d train / %d val tokens, vocab %d",
                time.perf_counter() - start, corpus.source, len(train), len(val), vocab_size)
    resolved = source if source == "stdlib" else str(Path(source).resolve())
    return PreparedData(train=train, val=val, vocab_size=vocab_size, tokenizer_path=tokenizer_path,
                        fingerprint=fp, source=resolved)
