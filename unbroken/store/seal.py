"""Seals of the values a job keeps on a shared store (etcd): a value another writer put there is never acted on.

On an etcd cluster whoever holds a client certificate of its CA (or reaches a
plain ``etcd://`` port) can read and write any key, so every value the job
writes there is sealed::

    payload | version (8, little endian) | created (8, little endian) | tag (16)
    tag = HMAC-SHA256(launch key, key | version | created | payload)[:16]

The launch key is derived from the job's secret and the launch's id
(:func:`launch_key`): a value of another launch of the job (an earlier one,
with the same ``UNBROKEN_JOB_SECRET``) or of another job never verifies.
``version`` and ``created`` are the key's etcd version and creation revision
once the value is written: a value is authentic only at the very place in the
key's history it was sealed for. Written again at the same key, it has a later
version; written into the key after a delete (a new creation, which restarts
the version at 1), it has a later creation revision: so no replay of a recorded
value, not even of a key's first one, is ever read, by any reader, whatever it
saw before. A write that creates a key cannot know its creation revision
beforehand: the writer seals it for the revision after the newest it has seen
and, when another write came first, writes the value again at version 2 sealed
for the revision it got (:meth:`EtcdBackend._write`); meanwhile the key holds
a value nobody reads, like a forged one. A reader also rejects a key whose
(creation revision, version) is older than one it already saw there, so a key
cannot be rolled back behind its back (a check the seal alone already makes:
etcd never shows a key at a (creation, version) it left, so a reader's
records are bounded, ``SEEN_KEYS``, and forgetting them loses nothing).

What is not sealed cannot be stopped here: a writer with access can delete
keys, or overwrite them, which no reader then accepts: the job waits (a
deleted heartbeat is silence, judged like any other; a deleted decision key is
brought back from its etcd history, and a deleted view, items or rendezvous
key read from there, :mod:`unbroken.store.etcd_history`), and
stops once ``fault.store_timeout_s`` has passed with the message naming the
key; it never acts on what that writer put there. An etcd user per job (role-based access on
the job's prefix) closes that, as docs/design.md says.

Invariant: :meth:`Sealer.open` returns a payload only if its tag verifies under this launch's key, its sealed
version and creation revision are the key's, and the key is not older than this reader has seen it.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import struct
import time

from unbroken.store.wire import store_key

__all__ = ["BAD_REPORT_S", "Sealer", "launch_key", "pointer_key"]

logger = logging.getLogger(__name__)

TAG = 16
VERSION = 8
CREATED = 8
SEEN_KEYS = 4096
"""At most this many keys' newest (creation revision, version) are remembered by a reader."""
PENDING_S = 1.0
"""A first value sealed for an earlier creation revision is counted as bad only once it stayed this long
(its writer lost the race of its guess and writes it again within one round trip)."""
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

    def seal(self, key: str, payload: str | bytes, version: int, created: int) -> bytes:
        """``payload`` sealed for ``key`` at etcd ``version`` of the key created at revision ``created``."""
        data = payload.encode() if isinstance(payload, str) else bytes(payload)
        place = struct.pack("<QQ", version, created)
        return data + place + self._tag(key, place, data)

    def _tag(self, key: str, place: bytes, data: bytes) -> bytes:
        return hmac.new(self.key, key.encode() + b"\0" + place + b"\0" + data, hashlib.sha256).digest()[:TAG]

    def open(self, key: str, raw: bytes, version: int, created: int) -> bytes | None:
        """The payload of the value etcd holds at ``key`` (its ``version`` and ``create_revision``), or None."""
        why, pending = None, False
        head = VERSION + CREATED + TAG
        if len(raw) < head:
            why = "not a sealed value"
        else:
            data, place, tag = raw[:-head], raw[-head:-TAG], raw[-TAG:]
            sealed_version, sealed_created = struct.unpack("<QQ", place)
            if not hmac.compare_digest(tag, self._tag(key, place, data)):
                why = "no valid seal of this launch"
            elif sealed_version != version:
                why = f"sealed for version {sealed_version}, found at version {version} (written again)"
            elif sealed_created != created:
                why = (f"sealed for the key created at revision {sealed_created}, found in the key created at "
                       f"{created} (deleted and written again, or a create being written again)")
                # A first value sealed for an earlier creation may be a create whose writer's guess of the
                # revision lost a race (it writes the value again at once): reported only if it stays.
                pending = version == 1 and sealed_created < created
            elif (created, version) < self.seen.get(key, (0, 0)):
                why = f"older than what this process saw there ({self.seen[key]} > {(created, version)})"
        if why is not None:
            self._bad(key, why, pending)
            return None
        self.accepted(key, created, version)
        self.bad_since.pop(key, None)
        return data

    def verify(self, key: str, raw: bytes, version: int, created: int) -> bytes | None:
        """The payload of ``raw`` if it is authentic at ``key``'s ``version`` of the creation ``created``, else
        None; records nothing (a read of the key's history, not of its present)."""
        head = VERSION + CREATED + TAG
        if len(raw) < head:
            return None
        data, place, tag = raw[:-head], raw[-head:-TAG], raw[-TAG:]
        if not hmac.compare_digest(tag, self._tag(key, place, data)):
            return None
        return data if struct.unpack("<QQ", place) == (version, created) else None

    def accepted(self, key: str, created: int, version: int) -> None:
        """Remember that ``key`` was read or written at (``created``, ``version``); bounded (module docstring)."""
        if len(self.seen) >= SEEN_KEYS and key not in self.seen:
            # Old generations' keys. Forgetting them loses nothing: a sealed value opens only at the one
            # (creation, version) of the key's history it was written at, which etcd never shows again.
            self.seen.clear()
        self.seen[key] = max(self.seen.get(key, (0, 0)), (created, version))

    def _bad(self, key: str, why: str, pending: bool = False) -> None:
        if len(self.bad_since) >= SEEN_KEYS and key not in self.bad_since:
            self.bad_since.clear()  # bounded: a key's store-timeout clock may restart (a delay, never a value)
            self.bad.clear()
        since = self.bad_since.setdefault(key, time.monotonic())
        if pending and time.monotonic() - since < PENDING_S:
            return  # a create whose writer is writing it again (open): not counted unless it stays
        self.bad[key] = self.bad.get(key, 0) + 1
        if self.bad[key] == 1:
            logger.warning("store key %r holds a value not written by this launch of the job (%s): ignored; "
                           "someone else with write access to the store wrote it", key, why)

    def forget(self, key: str) -> None:
        """The key was deleted by this process: a new one starts afresh."""
        self.seen.pop(key, None)
