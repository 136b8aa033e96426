"""Reading an etcd key's history: what the job wrote there before another writer forged or deleted it.

etcd keeps every revision of a key until it is compacted, and a value sealed by
the job opens only at the place in the key's history it was written at
(:mod:`unbroken.store.seal`). Two uses:

- a counter (a worker's heartbeat or progress) found holding a forged value, or
  gone, is read back to its newest authentic value (:func:`last_authentic`,
  :func:`last_before_gone`), so a writer rewriting or deleting it faster than
  the worker beats cannot hide the beats;
- a decision key (``gen``, ``outcome/<g>``) found gone or forged is brought back
  (:func:`restore`) with the newest decision the job wrote there, never another:
  the value is written into a new creation of the key, marked ``RESTORED``, and
  every reader checks a restored value against the key's history before acting
  on it (:func:`restored_value`), so a restore that raced a later decision (its
  value older than what the history holds) is read as absent and replaced.

A decision key's values grow (``gen``: a generation; ``outcome/<g>``:
``"<step>:<outcome>"``, by step): every plain value was written by a
compare-and-set from the one before it, so the newest decision is the largest
value from the newest plain one on (:func:`newest_decision`).

Invariant: a restored value that opens for a reader is the largest value the
job wrote at its key before that creation of the key; where the history needed
is compacted or longer than ``SCAN_REVISIONS``, nothing is restored (readers wait,
and the job stops after ``fault.store_timeout_s`` naming the key).
"""

from __future__ import annotations

import base64
import logging
from typing import Any, Protocol

from unbroken.store.etcd_client import RequestRefused
from unbroken.store.seal import Sealer

__all__ = ["HISTORY_READS", "RESTORED", "SCAN_REVISIONS", "last_authentic", "last_before_gone", "newest_decision",
           "restore", "restored_value"]

logger = logging.getLogger(__name__)

HISTORY_READS = 16
"""A counter read holding a value this launch did not write is read back through its history this many values
at most (only then: one more round trip each) for the newest value that is (:func:`last_authentic`)."""
RESTORED = b"\x00restored\x00"
"""Leads the payload of a decision key brought back after another writer deleted or forged it."""
SCAN_REVISIONS = 8192
"""A decision key's history is read back this many store revisions at most (a key gone that long, with no
member bringing it back, is lost: the job waits, then stops naming it)."""
SCAN_BATCH = 128
"""Revisions read per transaction (etcd's default ``--max-txn-ops``)."""
CHECKED = 4096
"""At most this many keys' restored creations are remembered as checked by a client."""


class EtcdBackend(Protocol):
    """What this module uses of :class:`~unbroken.store.etcd_backend.EtcdBackend` (which imports it)."""

    sealer: Sealer
    restores_checked: dict[str, tuple[int, int]]

    @property
    def revision(self) -> int: ...
    def first_revision(self) -> int: ...
    def call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]: ...
    def prefixed(self, key: str) -> str: ...
    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: list[dict[str, Any]]) -> tuple[bool, list[dict[str, Any]]]: ...
    @staticmethod
    def kv_of(response: dict[str, Any]) -> dict[str, Any] | None: ...
    def read_many(self, keys: list[str]) -> list[dict[str, Any] | None]: ...
    def open_value(self, key: str, kv: dict[str, Any] | None) -> bytes | None: ...
    def write_sealed(self, key: str, kv: dict[str, Any] | None, payload: bytes, lease: str = "",
               also: list[dict[str, Any]] | None = None,
               guards: list[dict[str, Any]] | None = None) -> tuple[bool | None, dict[str, Any] | None]: ...


def _place(kv: dict[str, Any]) -> tuple[int, int]:
    return int(kv.get("create_revision", 0)), int(kv.get("version", 0))


def _value(kv: dict[str, Any]) -> bytes:
    return base64.b64decode(kv["value"]) if kv.get("value") else b""


def last_authentic(backend: EtcdBackend, key: str, kv: dict[str, Any]) -> bytes | None:
    """The newest authentic value of ``key`` before its current one (not authentic), read back through the
    key's history (at most ``HISTORY_READS`` values; None past that, or where etcd compacted it): a writer
    that overwrites a live worker's counters faster than it beats cannot hide its beats from a reader, and
    the history holds nothing newer that this launch did not write."""
    revision = int(kv["mod_revision"]) - 1
    for _ in range(HISTORY_READS):
        try:
            old = (backend.call("kv/range", {"key": backend.prefixed(key), "revision": str(revision)}).get("kvs")
                   or [None])[0]
        except RequestRefused:
            return None  # compacted
        if old is None or revision <= 0:
            return None
        if _place(old) < backend.sealer.seen.get(key, (0, 0)):
            return None  # older than what this reader already saw there: nothing newer was authentic
        value = backend.open_value(key, old)
        if value is not None:
            return value
        revision = int(old["mod_revision"]) - 1
    return None


def last_before_gone(backend: EtcdBackend, key: str) -> bytes | None:
    """The newest authentic value of counter ``key``, found gone, in its last ``SCAN_BATCH`` revisions of history
    (one round trip): a writer deleting a live worker's counters after every beat cannot hide the beats, while
    a dead worker's counters, expired with its lease, show only its last beat again. None if the history holds
    none that recent (or it is compacted)."""
    top = backend.revision
    batch = range(top, max(backend.first_revision(), top - SCAN_BATCH), -1)
    try:
        _, responses = backend.txn([], [{"request_range": {"key": backend.prefixed(key), "revision": str(r)}}
                                         for r in batch], [])
    except RequestRefused:
        return None  # compacted
    for kv in (backend.kv_of(r) for r in responses):
        if kv is None:
            continue
        value = backend.sealer.verify(key, _value(kv), _place(kv)[1], _place(kv)[0])
        if value is not None:
            return value if _place(kv) >= backend.sealer.seen.get(key, (0, 0)) else None
    return None


def _order(value: bytes) -> int:
    """A decision's place in its key's sequence: the generation, or the step of ``"<step>:<outcome>"``."""
    return int(value.partition(b":")[0])


def newest_decision(backend: EtcdBackend, key: str, top: int) -> bytes | None:
    """The newest decision the job wrote at ``key`` up to store revision ``top`` (its payload, unmarked): the
    largest authentic value from the newest plain one (not restored) on, read back through the key's history
    down to the launch's first revision. None if there is none, or the history needed is compacted or longer
    than ``SCAN_REVISIONS``."""
    floor, best, places = backend.first_revision(), None, set()
    revision = top
    while revision > floor:
        if top - revision >= SCAN_REVISIONS:
            return None
        batch = range(revision, max(floor, revision - SCAN_BATCH), -1)
        try:
            _, responses = backend.txn([], [{"request_range": {"key": backend.prefixed(key), "revision": str(r)}}
                                             for r in batch], [])
        except RequestRefused:
            return None  # compacted
        for kv in (backend.kv_of(r) for r in responses):
            if kv is None or _place(kv) in places:
                continue
            places.add(_place(kv))
            value = backend.sealer.verify(key, _value(kv), _place(kv)[1], _place(kv)[0])
            if value is None:
                continue  # another writer's
            restored = value.startswith(RESTORED)
            value = value[len(RESTORED):] if restored else value
            best = value if best is None or _order(value) > _order(best) else best
            if not restored:
                return best  # a plain decision was written over the one before it: nothing older is newer
        revision -= len(batch)
    return best


def restored_value(backend: EtcdBackend, key: str, kv: dict[str, Any], value: bytes) -> bytes | None:
    """The payload of a restored ``value`` (authentic, at ``kv``) if it is the newest decision the job wrote at
    ``key`` before it; None (read as absent) if the history holds a newer one (a restore that raced a later
    decision) or cannot be read."""
    payload = value[len(RESTORED):]
    place = _place(kv)
    if backend.restores_checked.get(key) == place:
        return payload
    # Read back from just before this value was written: a restore into a new creation of the key, or over a
    # forged value of the creation that still holds the job's earlier values.
    if newest_decision(backend, key, int(kv["mod_revision"]) - 1) != payload:
        logger.warning("store key %r was brought back with %r, not the newest decision written there before: "
                       "ignored (it is brought back again)", key, payload.decode(errors="replace"))
        return None
    if len(backend.restores_checked) >= CHECKED:
        backend.restores_checked.clear()
    backend.restores_checked[key] = place
    return payload


def restore(backend: EtcdBackend, key: str) -> bool:
    """Bring decision key ``key`` back if it is gone or holds a value this launch did not write: the newest
    decision its history holds, written into the key as it was read (a new creation, sealed for it, or over the
    forged value). True if it holds an authentic value now (restored by this call or by another writer)."""
    kv = backend.read_many([key])[0]
    if backend.open_value(key, kv) is not None:
        return True
    value = newest_decision(backend, key, backend.revision)
    if value is None:
        return False
    ok, _ = backend.write_sealed(key, kv, RESTORED + value)
    if ok:
        logger.warning("store key %r was deleted or overwritten by another writer: brought back with %r, the "
                       "newest decision written there", key, value.decode(errors="replace"))
    return backend.open_value(key, backend.read_many([key])[0]) is not None
