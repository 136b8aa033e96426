"""Corpora: where the training text (or pre-tokenized tokens) comes from.

Sources, selected by a string:

- ``"stdlib"``: the ``.py`` sources of the running interpreter's standard
  library (no download), without ``site-packages``/``dist-packages``, test
  packages (path parts ``test``, ``tests``, ``idle_test``) and empty files.
  To use a directory that happens to be called ``stdlib``, write ``./stdlib``.
- a directory: every ``*.txt`` file below it (recursive).
- a ``.bin`` file (raw little-endian uint16/uint32 tokens) or a ``.npy`` file
  (uint16/uint32) of pre-tokenized tokens.
- a directory of such files and Megatron ``.bin``/``.idx`` pairs, read as one
  stream (:mod:`unbroken.data.shards`).

Invariants:

- Text documents are named by their path relative to the source root, with
  ``/`` separators, and kept sorted by name, so the corpus is the same on every
  machine whatever the file system's listing order.
- The train/validation split is a pure function of a document's *name*:
  document ``n`` is validation iff ``int(sha1(n)[:8], 16) / 2**32 <
  val_fraction``. Adding or removing other documents never moves a document
  between splits.
- Pre-tokenized files have no document names, so they are split by position:
  the last ``floor(len * val_fraction)`` tokens are validation (the boundary may
  cut through a document).
- The fingerprint changes whenever a name, a size or a content byte changes;
  it keys every cache built from the corpus.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import sysconfig
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

logger = logging.getLogger(__name__)

STDLIB_SOURCE = "stdlib"
TOKEN_FILE_SUFFIXES = (".bin", ".npy")
TOKEN_DTYPES = ("uint16", "uint32")
_EXCLUDED_STDLIB_PARTS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test"})
_ACCEPTED = (
    f"accepted sources: {STDLIB_SOURCE!r}, a directory containing *.txt files, "
    "or a pre-tokenized .bin/.npy file of uint16/uint32 tokens"
)
_FINGERPRINT_TAG = b"unbroken-corpus-v1\0"
CHECK_CHUNK = 1 << 24  # tokens read at a time by the vocabulary check


@dataclass(frozen=True)
class Document:
    """One text document: its stable name, where it lives, its size in bytes."""

    name: str
    path: Path
    size: int


@dataclass
class TextCorpus:
    """An ordered collection of text documents.

    Args:
        documents: the documents, sorted by name, names unique.
        source: a human-readable description of where they came from.

    Raises:
        ValueError: the documents are not sorted or repeat a name.
    """

    documents: Sequence[Document]
    source: str
    _fingerprint: str | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        names = [d.name for d in self.documents]
        if names != sorted(names) or len(set(names)) != len(names):
            raise ValueError(f"{self.source}: documents must be sorted by name, without duplicates")

    def __len__(self) -> int:
        return len(self.documents)

    @property
    def names(self) -> list[str]:
        return [d.name for d in self.documents]

    @property
    def total_bytes(self) -> int:
        return sum(d.size for d in self.documents)

    def read(self, doc: Document) -> str:
        """Return the text of ``doc``.

        Raises:
            ValueError: the file is not valid UTF-8.
        """
        data = doc.path.read_bytes()
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"{doc.path}: not valid UTF-8 ({e}); convert the file to UTF-8") from e

    def texts(self) -> Iterator[str]:
        """Yield every document's text, in order."""
        for doc in self.documents:
            yield self.read(doc)

    def fingerprint(self) -> str:
        """sha256 hex digest over every document's name, size and content hash."""
        if self._fingerprint is None:
            h = hashlib.sha256(_FINGERPRINT_TAG)
            for doc in self.documents:
                content = hashlib.sha256(doc.path.read_bytes()).digest()
                h.update(doc.name.encode("utf-8") + b"\0" + str(doc.size).encode() + b"\0" + content)
            self._fingerprint = h.hexdigest()
        return self._fingerprint

    def truncate(self, max_bytes: int) -> TextCorpus:
        """The first documents whose sizes add up to at most ``max_bytes``.

        At least one document is always kept, so a tiny budget still gives a
        usable corpus.
        """
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        kept: list[Document] = []
        total = 0
        for doc in self.documents:
            if kept and total + doc.size > max_bytes:
                break
            kept.append(doc)
            total += doc.size
        return TextCorpus(kept, source=f"{self.source}[:{max_bytes} bytes]")

    def split(self, val_fraction: float) -> tuple[TextCorpus, TextCorpus]:
        """Split into (train, validation) by the hash of each document's name."""
        check_val_fraction(val_fraction)
        train = [d for d in self.documents if not is_validation(d.name, val_fraction)]
        val = [d for d in self.documents if is_validation(d.name, val_fraction)]
        return TextCorpus(train, source=f"{self.source}:train"), TextCorpus(val, source=f"{self.source}:val")


def check_val_fraction(val_fraction: float) -> None:
    """Raise ValueError unless ``0 <= val_fraction < 1``."""
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in [0, 1), got {val_fraction!r}")


def is_validation(name: str, val_fraction: float) -> bool:
    """True iff the document called ``name`` belongs to the validation split."""
    digest = hashlib.sha1(name.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) / 2**32 < val_fraction


def stdlib_root() -> Path:
    """The standard library directory of the running interpreter."""
    return Path(sysconfig.get_paths()["stdlib"])


def open_stdlib_corpus() -> TextCorpus:
    """The embedded default corpus: the interpreter's standard library sources."""
    root = stdlib_root()
    docs = []
    # os.walk, pruning the excluded directories as it goes: site-packages alone may hold most of the tree.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if d not in _EXCLUDED_STDLIB_PARTS]
        for name in filenames:
            if not name.endswith(".py"):
                continue
            path = Path(dirpath, name)
            try:
                st = path.stat()
            except OSError:  # a dangling link
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:  # empty __init__.py files add only EOT tokens
                continue
            docs.append(Document(path.relative_to(root).as_posix(), path, st.st_size))
    if not docs:
        raise ValueError(f"{root}: no standard library .py sources found; {_ACCEPTED}")
    docs.sort(key=lambda d: d.name)
    return TextCorpus(docs, source=f"stdlib:{root}")


def open_text_directory(root: str | os.PathLike[str]) -> TextCorpus:
    """Every ``*.txt`` file below ``root`` (recursive), named by relative path.

    Raises:
        ValueError: no ``.txt`` file below ``root``, or an empty one.
    """
    root = Path(root)
    docs = []
    for path in root.rglob("*.txt"):
        if not path.is_file():
            continue
        size = path.stat().st_size
        if size == 0:
            raise ValueError(f"{path}: empty file; every *.txt document must contain text (remove it)")
        docs.append(Document(path.relative_to(root).as_posix(), path, size))
    if not docs:
        raise ValueError(f"{root}: directory contains no *.txt files; {_ACCEPTED}")
    docs.sort(key=lambda d: d.name)
    return TextCorpus(docs, source=str(root))


def is_token_file(source: str | os.PathLike[str]) -> bool:
    """True iff ``source`` names a pre-tokenized file (by suffix)."""
    return str(source) != STDLIB_SOURCE and Path(source).suffix in TOKEN_FILE_SUFFIXES


def open_text_corpus(source: str | os.PathLike[str]) -> TextCorpus:
    """Open ``"stdlib"`` or a directory of ``*.txt`` files.

    Raises:
        ValueError: the path is missing or is not a directory.
    """
    if str(source) == STDLIB_SOURCE:
        return open_stdlib_corpus()
    path = Path(source)
    if not path.exists():
        raise ValueError(f"{path}: no such file or directory; {_ACCEPTED}")
    if not path.is_dir():
        raise ValueError(f"{path}: not a text corpus directory (suffix {path.suffix!r}); {_ACCEPTED}")
    return open_text_directory(path)


@dataclass(frozen=True)
class TokenFile:
    """A pre-tokenized file, memory-mapped read-only.

    Attributes:
        path: the file.
        tokens: 1-D uint16/uint32 array (read-only memmap).
        vocab_size: every token is ``< vocab_size`` (checked on open).
        fingerprint: sha256 over the file's bytes, dtype and vocabulary size.
    """

    path: Path
    tokens: np.ndarray
    vocab_size: int
    fingerprint: str

    def split(self, val_fraction: float) -> tuple[np.ndarray, np.ndarray]:
        """(train, val): the last ``floor(len * val_fraction)`` tokens are val."""
        check_val_fraction(val_fraction)
        n_val = int(len(self.tokens) * val_fraction)
        cut = len(self.tokens) - n_val
        return self.tokens[:cut], self.tokens[cut:]


def sidecar_path(path: str | os.PathLike[str]) -> Path:
    """``<file>.json``: metadata next to a token file."""
    return Path(f"{os.fspath(path)}.json")


def _read_sidecar(path: Path) -> dict:
    side = sidecar_path(path)
    if not side.exists():
        return {}
    try:
        meta = json.loads(side.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{side}: unreadable sidecar ({e}); expected JSON like "
                         '{"dtype": "uint16", "vocab_size": 4096}') from e
    if not isinstance(meta, dict):
        raise ValueError(f"{side}: sidecar must be a JSON object, got {type(meta).__name__}")
    return meta


def _check_dtype(dtype: object, where: str) -> np.dtype:
    if str(dtype) not in TOKEN_DTYPES:
        raise ValueError(f"{where}: token dtype {dtype!r} not supported; accepted: {', '.join(TOKEN_DTYPES)} "
                         "(store the ids as uint16 for a vocabulary of up to 65536, else uint32)")
    return np.dtype(str(dtype)).newbyteorder("<")


def _check_npy_length(path: Path) -> None:
    """Refuse a ``.npy`` file shorter than its header announces, naming the token offset where it ends."""
    with path.open("rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            if version[0] not in (1, 2):
                return  # version 3 (UTF-8 field names): never a token array; np.load decides
            read = np.lib.format.read_array_header_1_0 if version[0] == 1 else np.lib.format.read_array_header_2_0
            shape, _, dtype = read(f)
        except (ValueError, EOFError) as e:
            raise ValueError(f"{path}: not a .npy file ({e}); write shards with np.save") from None
        offset = f.tell()
    want = int(np.prod(shape)) * dtype.itemsize
    size = path.stat().st_size
    if size - offset < want:
        raise ValueError(f"{path}: truncated: its header announces {int(np.prod(shape))} {dtype.name} tokens "
                         f"({want} bytes from byte offset {offset}), the file ends at byte {size} (token offset "
                         f"{(size - offset) // dtype.itemsize}); write the shard again")


def _resolve_vocab(path: Path, meta: dict, vocab_size: int | None) -> int:
    stated = meta.get("vocab_size")
    if stated is not None:
        if vocab_size is not None and int(stated) != vocab_size:
            logger.warning("%s: sidecar vocab_size %d overrides the requested %d", path, stated, vocab_size)
        vocab_size = int(stated)
    if vocab_size is None:
        raise ValueError(f"{path}: vocabulary size unknown; pass vocab_size or write "
                         f'{sidecar_path(path)} with {{"vocab_size": N}}')
    if vocab_size < 1:
        raise ValueError(f"{path}: vocab_size must be >= 1, got {vocab_size}")
    return vocab_size


def _map_tokens(path: Path, meta: dict, dtype: str | None) -> np.ndarray:
    if path.suffix == ".npy":
        _check_npy_length(path)
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError as e:
            raise ValueError(f"{path}: not a plain .npy array ({e})") from e
        _check_dtype(arr.dtype.name, str(path))
        if arr.ndim != 1:
            raise ValueError(f"{path}: expected a 1-D token array, got shape {arr.shape}")
        return arr
    stated = meta.get("dtype")
    if dtype is not None and stated is not None and str(dtype) != str(stated):
        raise ValueError(f"{path}: dtype {dtype!r} contradicts the sidecar's {stated!r}")
    chosen = dtype if dtype is not None else stated
    if chosen is None:
        raise ValueError(f"{path}: token dtype unknown; pass token_dtype ('uint16' or 'uint32') or write "
                         f'{sidecar_path(path)} with {{"dtype": "uint16"}}')
    np_dtype = _check_dtype(chosen, str(path))
    size = path.stat().st_size
    if size % np_dtype.itemsize:
        raise ValueError(f"{path}: size {size} bytes is not a multiple of {np_dtype.itemsize} ({chosen})")
    if size == 0:
        raise ValueError(f"{path}: empty file; a token file needs at least one token")
    return np.memmap(path, dtype=np_dtype, mode="r")


def _chunked_max(tokens: np.ndarray) -> tuple[int, int]:
    """(max token, offset of its first occurrence), reading :data:`CHECK_CHUNK` tokens at a time."""
    best, where = -1, -1
    for a in range(0, len(tokens), CHECK_CHUNK):
        chunk = np.asarray(tokens[a:a + CHECK_CHUNK])
        m = int(chunk.max())
        if m > best:
            best, where = m, a + int(chunk.argmax())
    return best, where


def check_token_range(tokens: np.ndarray, vocab_size: int, where: Path, byte_base: int = 0) -> None:
    """Refuse a token ``>= vocab_size``, naming the file, the token's offset and its byte offset.

    Raises:
        ValueError: such a token exists (the message gives the first largest one).
    """
    top, offset = _chunked_max(tokens)
    if top >= vocab_size:
        byte = byte_base + offset * tokens.dtype.itemsize
        raise ValueError(f"{where}: max token {top} is >= vocab_size {vocab_size} (token offset {offset}, "
                         f"byte {byte}); state the right vocabulary size (> {top}) or re-tokenize the shard")


def open_token_file(
    path: str | os.PathLike[str], *, dtype: str | None = None, vocab_size: int | None = None
) -> TokenFile:
    """Memory-map a pre-tokenized ``.bin`` or ``.npy`` file and validate it.

    The dtype of a ``.bin`` file comes from ``dtype`` or the sidecar
    ``<file>.json`` (``{"dtype": "uint16", "vocab_size": N}``); the vocabulary
    size from the sidecar when it states one (a differing ``vocab_size`` is
    logged and ignored, since the sidecar describes the file), else from
    ``vocab_size``.

    Raises:
        ValueError: missing file, unknown suffix, unknown/unsupported dtype,
            unknown vocabulary size, empty file, or a token ``>= vocab_size``
            (the message gives its offset).
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"{path}: no such file; {_ACCEPTED}")
    if path.suffix not in TOKEN_FILE_SUFFIXES or not path.is_file():
        raise ValueError(f"{path}: not a pre-tokenized file; {_ACCEPTED}")
    meta = _read_sidecar(path)
    tokens = _map_tokens(path, meta, dtype)
    vocab = _resolve_vocab(path, meta, vocab_size)
    if len(tokens) == 0:
        raise ValueError(f"{path}: empty file; a token file needs at least one token")
    check_token_range(tokens, vocab, path, byte_base=int(getattr(tokens, "offset", 0)))
    h = hashlib.sha256(_FINGERPRINT_TAG + f"{tokens.dtype.name}:{vocab}\0".encode())
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return TokenFile(path=path, tokens=tokens, vocab_size=vocab, fingerprint=h.hexdigest())
