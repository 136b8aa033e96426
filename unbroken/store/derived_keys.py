"""Keys derived from a job's secret, one per purpose, so that no two uses share a key and none is the secret.

Invariant: ``derive_key(secret, purpose)`` is ``sha256(purpose + b"\\0" + secret)``; a purpose names one use
(the store's connections, snapshot seals, the compile cache) and is never reused for another.
"""

from __future__ import annotations

import hashlib

__all__ = ["derive_key"]


def derive_key(secret: str, purpose: bytes) -> bytes:
    """The 32-byte key of ``purpose`` under the job's ``secret``."""
    return hashlib.sha256(purpose + b"\0" + secret.encode()).digest()
