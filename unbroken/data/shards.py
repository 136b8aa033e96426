"""A corpus of many pre-tokenized shards, read as one virtual token stream.

A shard is a ``.npy`` array, a raw ``.bin`` (dtype from ``token_dtype`` or its
``<file>.json`` sidecar), or a Megatron indexed dataset: a ``.bin`` of tokens
beside an ``.idx`` read here with numpy alone. The ``.idx`` layout
(little-endian): magic ``MMIDIDX\\x00\\x00``, version ``u64 == 1``, dtype code
``u8``, sequence count ``u64``, document count ``u64``, then ``int32`` sizes
(tokens per sequence), ``int64`` pointers (byte offset of each sequence in the
``.bin``) and ``int64`` document indices.

Invariants:

- A directory's shards are its top-level token files sorted by name, so every
  machine sees the same stream; window ``w`` of the stream may cross a shard
  boundary (the stream is one concatenation, as if the shards were one file).
- Nothing bad starts a job: a shard that is truncated (size not a multiple of
  its dtype; a ``.npy`` shorter than its header says; a sequence an ``.idx``
  points to past the end of its ``.bin``), of a dtype other than uint16/uint32
  (``.npy``, raw ``.bin``) or Megatron's integer codes,
  whose stored dtype contradicts the declared ``token_dtype``, or that holds a
  token ``>= vocab_size`` is refused when it is opened, naming the file and the
  offset; so is a directory ``unbroken prepare-data`` has not finished. The
  token check reads every shard once, in chunks of
  :data:`CHECK_CHUNK` tokens (O(chunk) memory).
- The fingerprint covers each shard's name, dtype, length, size and
  modification time, not its bytes (hashing terabytes at every start is what
  it avoids): rewriting a shard in place with the same size and time goes
  unnoticed.
- :class:`ShardedTokens` holds one memmap per shard and their offsets: memory
  grows with the number of shards, never with their size.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from unbroken.data.corpus import (
    CHECK_CHUNK,
    TOKEN_DTYPES,
    _check_dtype,
    _chunked_max,
    _map_tokens,
    _read_sidecar,
    _resolve_vocab,
    check_token_range,
)

__all__ = ["CHECK_CHUNK", "MEGATRON_MAGIC", "ShardedTokens", "check_token_range", "is_shard_directory",
           "open_megatron", "open_shard_directory"]

MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
_MEGATRON_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
_SHARD_SUFFIXES = (".bin", ".npy")


class ShardedTokens:
    """1-D token stream over shards: ``len``, ``dtype``, a slice (another view) and integer-array indexing."""

    ndim = 1

    def __init__(self, parts: Sequence[np.ndarray]) -> None:
        if not parts:
            raise ValueError("a sharded corpus needs at least one shard")
        self.parts = list(parts)
        self.starts = np.concatenate([[0], np.cumsum([len(p) for p in self.parts])]).astype(np.int64)
        self.dtype = np.result_type(*[p.dtype for p in self.parts])

    def __len__(self) -> int:
        return int(self.starts[-1])

    def __getitem__(self, key: slice | np.ndarray) -> ShardedTokens | np.ndarray:
        if isinstance(key, slice):
            return self._slice(key)
        idx = np.asarray(key, dtype=np.int64)
        flat = idx.reshape(-1)
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= len(self)):
            raise IndexError(f"token index out of range [0, {len(self)})")
        shard = np.searchsorted(self.starts, flat, side="right") - 1
        out = np.empty(flat.size, dtype=self.dtype)
        for s in np.unique(shard):  # a window crosses at most a few shards
            mask = shard == s
            out[mask] = self.parts[int(s)][flat[mask] - self.starts[s]]
        return out.reshape(idx.shape)

    def read(self, start: int, stop: int) -> np.ndarray:
        """Tokens ``[start, stop)`` as one array (copied only when the range crosses shards)."""
        s = int(np.searchsorted(self.starts, start, side="right")) - 1
        lo = start - int(self.starts[s])
        if stop <= self.starts[s + 1]:
            return self.parts[s][lo:lo + stop - start]
        return np.asarray(self[np.arange(start, stop, dtype=np.int64)])

    def _slice(self, key: slice) -> ShardedTokens:
        start, stop, step = key.indices(len(self))
        if step != 1:
            raise ValueError(f"a sharded stream slices with step 1 only, got {key!r}")
        parts = []
        for part, a in zip(self.parts, self.starts[:-1].tolist()):
            lo, hi = max(start - a, 0), min(stop - a, len(part))
            if lo < hi:
                parts.append(part[lo:hi])
        return ShardedTokens(parts or [self.parts[0][:0]])

    def max(self) -> int:
        """The largest token (reads every shard in chunks)."""
        return max(int(_chunked_max(p)[0]) for p in self.parts)


def _read_idx(idx: Path) -> tuple[np.dtype, np.ndarray, np.ndarray]:
    with idx.open("rb") as f:
        head = f.read(34)
    if len(head) < 34 or head[:9] != MEGATRON_MAGIC:
        raise ValueError(f"{idx}: not a Megatron index (expected magic {MEGATRON_MAGIC!r} and a 34-byte header)")
    version = int.from_bytes(head[9:17], "little")
    code = head[17]
    if version != 1 or code not in _MEGATRON_DTYPES:
        raise ValueError(f"{idx}: Megatron index version {version} dtype code {code} not supported "
                         f"(version 1, integer codes {sorted(_MEGATRON_DTYPES)})")
    n_seq, n_doc = int.from_bytes(head[18:26], "little"), int.from_bytes(head[26:34], "little")
    need = 34 + 4 * n_seq + 8 * n_seq + 8 * n_doc
    if idx.stat().st_size < need:
        raise ValueError(f"{idx}: truncated: {idx.stat().st_size} bytes, the header announces {need}")
    sizes = np.memmap(idx, dtype="<i4", mode="r", offset=34, shape=(n_seq,)) if n_seq else np.zeros(0, "<i4")
    ptrs = np.memmap(idx, dtype="<i8", mode="r", offset=34 + 4 * n_seq, shape=(n_seq,)) if n_seq else np.zeros(0)
    return np.dtype(_MEGATRON_DTYPES[code]).newbyteorder("<"), np.asarray(sizes, np.int64), np.asarray(ptrs, np.int64)


def open_megatron(bin_path: Path, *, dtype: str | None) -> np.ndarray:
    """The tokens of a Megatron ``.bin``/``.idx`` pair, memory-mapped (its sequences laid end to end).

    Raises:
        ValueError: a bad or truncated index, a sequence past the end of the
            ``.bin`` or out of order, or a stored dtype other than ``dtype``.
    """
    idx = bin_path.with_suffix(".idx")
    np_dtype, sizes, ptrs = _read_idx(idx)
    if dtype is not None and np.dtype(dtype) != np_dtype:
        raise ValueError(f"{idx}: stores {np_dtype.name} tokens but token_dtype={dtype!r} was declared; "
                         f"drop data.token_dtype or set it to {np_dtype.name!r}")
    if not len(sizes):
        raise ValueError(f"{idx}: no sequences; a shard needs at least one token")
    size, item = bin_path.stat().st_size, np_dtype.itemsize
    ends = ptrs + sizes * item
    past = np.flatnonzero(ends > size)
    if past.size:
        i = int(past[0])
        raise ValueError(f"{idx}: sequence {i} at byte offset {int(ptrs[i])} ({int(sizes[i])} tokens) ends at "
                         f"byte {int(ends[i])}, past the end of {bin_path} ({size} bytes): the .bin is truncated")
    gaps = np.flatnonzero(ptrs[1:] != ends[:-1])
    if gaps.size or ptrs[0] % item:
        i = int(gaps[0]) + 1 if gaps.size else 0
        raise ValueError(f"{idx}: sequence {i} starts at byte offset {int(ptrs[i])}, not where the one before "
                         "ends; rebuild the index with Megatron's preprocess_data.py")
    return np.memmap(bin_path, dtype=np_dtype, mode="r", offset=int(ptrs[0]), shape=(int(sizes.sum()),))


def _shard_files(root: Path) -> list[Path]:
    return sorted(p for p in root.iterdir() if p.is_file() and p.suffix in _SHARD_SUFFIXES)


def is_shard_directory(source: str | os.PathLike[str]) -> bool:
    """True iff ``source`` is a directory holding ``.bin``/``.npy`` token files and no ``.txt`` at its top level."""
    path = Path(source)
    return (str(source) != "stdlib" and path.is_dir() and bool(_shard_files(path))
            and not any(path.glob("*.txt")))


def _open_shard(path: Path, dtype: str | None) -> np.ndarray:
    if path.suffix == ".bin" and path.with_suffix(".idx").exists():
        return open_megatron(path, dtype=dtype)
    tokens = _map_tokens(path, _read_sidecar(path), dtype)
    if path.suffix == ".npy" and dtype is not None and tokens.dtype != np.dtype(dtype):
        raise ValueError(f"{path}: stores {tokens.dtype.name} tokens but token_dtype={dtype!r} was declared; "
                         f"drop data.token_dtype or set it to {tokens.dtype.name!r}")
    return tokens


def _check_prepared(root: Path) -> None:
    """Refuse a directory ``unbroken prepare-data`` is still writing (its progress file says not done)."""
    progress = root / "prepare.json"
    if not progress.is_file():
        return
    try:
        state = json.loads(progress.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{progress}: unreadable ({e}); prepare {root} again") from None
    if not state.get("done"):
        raise ValueError(f"{root}: unbroken prepare-data has not finished it ({state.get('shards')} shards written, "
                         f"{state.get('documents')} documents read); run the same prepare-data command again to "
                         "finish it")


def open_shard_directory(root: str | os.PathLike[str], *, dtype: str | None,
                         vocab_size: int | None) -> tuple[ShardedTokens, int, str]:
    """(stream, vocabulary size, fingerprint) of every shard in ``root``, each validated.

    The vocabulary size is a sidecar's (``<shard>.json`` or ``<root>/vocab.json``:
    ``{"vocab_size": N}``) else ``vocab_size``; shards stating different ones are refused.

    Raises:
        ValueError: no shards, a bad shard (see the module docstring), or disagreeing vocabularies.
    """
    root = Path(root)
    _check_prepared(root)
    files = _shard_files(root)
    if not files:
        raise ValueError(f"{root}: no .bin/.npy shards; a shard directory holds pre-tokenized token files "
                         f"({', '.join(TOKEN_DTYPES)} .bin with a sidecar, .npy, or Megatron .bin/.idx pairs)")
    if dtype is not None:
        _check_dtype(dtype, str(root))
    shared = _read_sidecar(root / "vocab")
    vocab = _resolve_vocab(root, shared, vocab_size)
    parts, h = [], hashlib.sha256(f"unbroken-shards-v1\0{vocab}\0".encode())
    for path in files:
        tokens = _open_shard(path, dtype)
        stated = _read_sidecar(path).get("vocab_size")
        if stated is not None and int(stated) != vocab:
            raise ValueError(f"{path}: sidecar vocab_size {stated} differs from the corpus's {vocab}; "
                             f"every shard must share one vocabulary (state it in {root / 'vocab.json'})")
        check_token_range(tokens, vocab, path, byte_base=int(getattr(tokens, "offset", 0)))
        parts.append(tokens)
        st = path.stat()
        h.update(f"{path.name}\0{tokens.dtype.name}\0{len(tokens)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    return ShardedTokens(parts), vocab, h.hexdigest()
