"""Atomic file writes for the data caches.

Invariant: a cache file either does not exist under its final name or is
complete. Content goes to a temporary file in the same directory, is flushed
to disk, and is then renamed over the final name (``os.replace`` is atomic on
POSIX), so a concurrent reader never sees half a file.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO


@contextlib.contextmanager
def atomic_writer(path: str | os.PathLike[str]) -> Iterator[BinaryIO]:
    """Yield a binary file whose content replaces ``path`` only on success.

    Raises:
        Whatever the body raises; the temporary file is removed first.
    """
    final = Path(path)
    final.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{final.name}.", suffix=".tmp", dir=final.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_name, final)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise


def atomic_write_bytes(path: str | os.PathLike[str], data: bytes) -> None:
    """Write ``data`` to ``path`` atomically."""
    with atomic_writer(path) as f:
        f.write(data)
