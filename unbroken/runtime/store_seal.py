"""Seals of the values a job keeps on a shared store (etcd): a value another writer put there is never acted on.

On an etcd cluster whoever holds a client certificate of its CA (or reaches a
plain ``etcd://`` port) can read and write any key, so every value the job
writes there is sealed::

    payload | version (8, little endian) | tag (16)
    tag = HMAC-SHA256(launch key, key | version | payload)[:16]

The launch key is derived from the job's secret and the launch's id
(:func:`launch_key`): a value of another launch of the job (an earlier one,
with the same ``UNBROKEN_JOB_SECRET``) or of another job never verifies. The
version is the one etcd reports for the key once the value is written (every
write is a transaction guarded by the key's revision, so the writer knows it):
a sealed value written again, by anyone, has a later version than it was
sealed for, so a replay of a recorded value is rejected; and a reader rejects
a key whose (creation revision, version) is older than one it already saw
there, so a key cannot be rolled back to an older state behind its back.

What is not sealed cannot be stopped here: a writer with access can delete
keys (the job then waits, and stops once ``fault.store_timeout_s`` has passed
with the message naming the key) and can replay, into a key it deleted and
created again, the first value of that key; an etcd user per job (role-based
access on the job's prefix) closes that, as docs/design.md says.

Invariant: :meth:`Sealer.open` returns a payload only if its tag verifies under this launch's key, its sealed
version is the key's version, and the key is not older than this reader has seen it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import time

from unbroken.runtime.store_wire import store_key

__all__ = ["BAD_REPORT_S", "Sealer", "launch_key", "pointer_key"]

logger = logging.getLogger(__name__)

TAG = 16
VERSION = 8
BAD_REPORT_S = 0.0
"""A key whose values failed their seal is reported once; this is when (0: at the first)."""


def launch_key(secret: str, launch: str) -> bytes:
    """The key of one launch's seals."""
    return hmac.new(store_key(secret), b"seal\0" + launch.encode(), hashlib.sha256).digest()


def pointer_key(secret: str) -> bytes:
    """The key of the seal of the job's pointer to its current launch (launch-independent)."""
    return hmac.new(store_key(secret), b"launch-pointer", hashlib.sha256).digest()


class Sealer:
    """Seals and opens one launch's values (module docstring); counts and reports what fails."""

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.seen: dict[str, tuple[int, int]] = {}
        """Per key, the newest (creation revision, version) this reader accepted."""
        self.bad: dict[str, int] = {}
        """Per key, values that failed their seal or were older than seen (reported once per key)."""
        self.bad_since: dict[str, float] = {}
        """Per key, since when (monotonic) every read found a bad value there (cleared by a good one)."""

    def seal(self, key: str, payload: str | bytes, version: int) -> bytes:
        data = payload.encode() if isinstance(payload, str) else bytes(payload)
        v = struct.pack("<Q", version)
        return data + v + self._tag(key, v, data)

    def _tag(self, key: str, version: bytes, data: bytes) -> bytes:
        return hmac.new(self.key, key.encode() + b"\0" + version + b"\0" + data, hashlib.sha256).digest()[:TAG]

    def open(self, key: str, raw: bytes, version: int, created: int) -> bytes | None:
        """The payload of the value etcd holds at ``key`` (its ``version`` and ``create_revision``), or None."""
        why = None
        if len(raw) < VERSION + TAG:
            why = "not a sealed value"
        else:
            data, v, tag = raw[:-VERSION - TAG], raw[-VERSION - TAG:-TAG], raw[-TAG:]
            if not hmac.compare_digest(tag, self._tag(key, v, data)):
                why = "no valid seal of this launch"
            elif struct.unpack("<Q", v)[0] != version:
                why = f"sealed for version {struct.unpack('<Q', v)[0]}, found at version {version} (written again)"
            elif (created, version) < self.seen.get(key, (0, 0)):
                why = f"older than what this process saw there ({self.seen[key]} > {(created, version)})"
        if why is not None:
            self._bad(key, why)
            return None
        self.seen[key] = max(self.seen.get(key, (0, 0)), (created, version))
        self.bad_since.pop(key, None)
        return data

    def _bad(self, key: str, why: str) -> None:
        self.bad[key] = self.bad.get(key, 0) + 1
        self.bad_since.setdefault(key, time.monotonic())
        if self.bad[key] == 1:
            logger.warning("store key %r holds a value not written by this launch of the job (%s): ignored; "
                           "someone else with write access to the store wrote it", key, why)

    def forget(self, key: str) -> None:
        """The key was deleted by this process: a new one starts afresh."""
        self.seen.pop(key, None)
