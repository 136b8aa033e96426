"""Reading an etcd key's history: what the job wrote there before another writer forged or deleted it.

etcd keeps every revision of a key until it is compacted, and a value sealed by
the job opens only at the place in the key's history it was written at
(:mod:`unbroken.store.seal`). Three uses:

- a counter (a worker's heartbeat or progress) found holding a forged value, or
  gone, is read back to its newest authentic value (:func:`last_authentic`,
  :func:`last_before_gone`), so a writer rewriting or deleting it faster than
  the worker beats cannot hide the beats;
- a decision key (``gen``, ``outcome/<g>``) found gone or forged is brought back
  (:func:`restore`) with the newest decision the job wrote there, never another:
  the value is written into a new creation of the key, marked ``RESTORED``, and
  every reader checks a restored value against the key's history before acting
  on it (:func:`restored_value`), so a restore that raced a later decision (its
  value older than what the history holds) is read as absent and replaced;
- a key the job writes but never deletes itself while it is read (``WRITE_ONCE``:
  a view, a member's items, a process group's rendezvous) found gone or forged
  by a waiting read for ``WRITTEN_GRACE_S`` is read from its history
  (:func:`fill_written`, :func:`last_written`): the newest value the job wrote
  there, the one the key would hold had nobody else written it. Nothing is
  written back (a copy written back could land over a newer value its writer
  wrote meanwhile and another writer deleted): each reader reads the history.

A decision key's values grow (``gen``: a generation; ``outcome/<g>``:
``"<step>:<outcome>"``, by step): every plain value was written by a
compare-and-set from the one before it, so the newest decision is the largest
value from the newest plain one on (:func:`newest_decision`).

Invariant: a restored value that opens for a reader is the largest value the
job wrote at its key before that creation of the key; a write-once key's value
read from its history is the newest the job wrote there (never one of a
generation ``pruned`` covers: the job deleted those itself); where the history
needed is compacted or longer than ``SCAN_REVISIONS``, nothing is restored nor
read (readers wait, and the job stops after the store timeout naming the key).
"""

from __future__ import annotations

import base64
import logging
import time
from typing import Any, Protocol

from unbroken.store.etcd_client import RequestRefused
from unbroken.store.seal import Sealer

__all__ = ["HISTORY_READS", "RESTORED", "SCAN_REVISIONS", "WRITE_ONCE", "fill_written", "last_authentic",
           "last_before_gone", "last_written", "newest_decision", "restore", "restored_value", "sealed_at"]

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
"""At most this many keys' restored creations are remembered as checked by a client (and as many write-once
keys' waits and history reads)."""
WRITE_ONCE = ("view/", "items/", "pg/")
"""Keys whose value a reader may take from their history once they are found gone or forged: each holds, at
any time, the value its one writer wrote there last, and the job deletes it only by pruning its generation.

- ``view/<g>``: created by a proposal only while ``gen`` is below ``g`` (``create_unless_moved``, or
  ``publish_initial``), and read once ``gen`` says ``g``: nothing creates it any more, so the newest creation
  is the view that won;
- ``items/<g>/<w>``: written by member ``w`` only, at each attempt of a step that begins with an exchange in
  view ``g`` (``[step, items]``: the newest is the one its reader would find had nobody deleted it);
- ``pg/<g><name>/...``: a process group's rendezvous, written by gloo and NCCL through ``set`` (each rank its
  addresses, rank 0 NCCL's unique id), never added to (counters: no key of these prefixes is one)."""
WRITTEN_GRACE_S = 0.5
"""A waiting read reads a write-once key's history once the key was found gone or forged this long (a key not
yet written costs nothing more until then) ..."""
WRITTEN_EVERY_S = 1.0
"""... and then at most once per this many seconds while its history holds nothing (once it held a value, the
next read looks again at once: only the revisions since the last look, one round trip)."""


class EtcdBackend(Protocol):
    """What this module uses of :class:`~unbroken.store.etcd_backend.EtcdBackend` (which imports it)."""

    sealer: Sealer
    restores_checked: dict[str, tuple[int, int]]
    written: dict[str, tuple[float, int, bytes | None, tuple[int, int]]]

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
    def peek(self, keys: list[str]) -> list[bytes | None]: ...
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


def sealed_at(backend: EtcdBackend, key: str, revision: int) -> bool:
    """Whether the value written at ``key`` in store ``revision`` is authentic there (True where the history is
    compacted: nothing to put right any more)."""
    try:
        kv = (backend.call("kv/range", {"key": backend.prefixed(key), "revision": str(revision)}).get("kvs")
              or [None])[0]
    except RequestRefused:
        return True
    return kv is not None and backend.sealer.verify(key, _value(kv), _place(kv)[1], _place(kv)[0]) is not None


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


def _generation(key: str) -> int:
    """The view generation of write-once ``key`` (``view/<g>``, ``items/<g>/<w>``, ``pg/<g><name>/...``)."""
    part = key.split("/")[1] if "/" in key else ""
    digits = part[:len(part) - len(part.lstrip("0123456789"))]
    return int(digits) if digits else -1


def fill_written(backend: EtcdBackend, keys: list[str], values: list[bytes | None]) -> list[bytes | None]:
    """``values`` (a read of ``keys``: None for a key gone or forged), with each write-once key's (``WRITE_ONCE``)
    that was found so for ``WRITTEN_GRACE_S`` read from its history (:func:`last_written`), at most once per
    ``WRITTEN_EVERY_S`` while that finds nothing; the waiting reads (``get``, ``multi_get``, ``wait``,
    ``check``) go through it, so another writer's delete of such a key is a delay of the grace, never a stop."""
    now, out = time.monotonic(), list(values)
    for i, (key, value) in enumerate(zip(keys, values)):
        if value is not None or not key.startswith(WRITE_ONCE):
            backend.written.pop(key, None)
            continue
        if len(backend.written) >= CHECKED and key not in backend.written:
            backend.written.clear()
        due, scanned, found, place = backend.written.setdefault(key, (now + WRITTEN_GRACE_S, 0, None, (0, 0)))
        if now < due:
            continue
        out[i] = last_written(backend, key)
        if out[i] is not None and found is None:
            logger.warning("store key %r was deleted or overwritten by another writer: read from its etcd history "
                           "(the value the job wrote there)", key)
        due, scanned, found, place = backend.written[key]
        backend.written[key] = (now if out[i] is not None else now + WRITTEN_EVERY_S, scanned, found, place)
    return out


def last_written(backend: EtcdBackend, key: str) -> bytes | None:
    """The newest value the job wrote at write-once ``key``, read back through its history (each revision since
    the launch's first, ``SCAN_BATCH`` per round trip, at most ``SCAN_REVISIONS`` back from the newest; a
    later read of the same key reads only the revisions since the last one). A value opens only at the place
    it was sealed for, so another writer's creation of the key never does. None if the history holds none (or
    it is compacted), or if ``pruned`` covers the key's generation (the job deleted it itself)."""
    if 0 <= _generation(key) < int(backend.peek(["pruned"])[0] or 0):
        return None
    top = backend.revision
    _, scanned, found, place = backend.written.get(key, (0.0, 0, None, (0, 0)))
    if top - SCAN_REVISIONS > scanned:
        found, place = None, (0, 0)  # what an earlier read found may be older than what was not read since
    floor, revision = max(backend.first_revision(), top - SCAN_REVISIONS, scanned), top
    places: set[tuple[int, int]] = set()
    while revision > floor:
        batch = range(revision, max(floor, revision - SCAN_BATCH), -1)
        try:
            _, responses = backend.txn([], [{"request_range": {"key": backend.prefixed(key), "revision": str(r)}}
                                             for r in batch], [])
        except RequestRefused:
            break  # compacted: nothing older can be read
        newest = _newest_authentic(backend, key, [backend.kv_of(r) for r in responses], places)
        if newest is not None:
            found, place = newest
            revision = floor
        else:
            revision -= len(batch)
    else:
        scanned = top  # nothing newer than ``found`` up to here: a later read starts from this revision
    if key in backend.written:
        backend.written[key] = (backend.written[key][0], scanned, found, place)
    return found if found is not None and place >= backend.sealer.seen.get(key, (0, 0)) else None


def _newest_authentic(backend: EtcdBackend, key: str, kvs: list[dict[str, Any] | None],
                      places: set[tuple[int, int]]) -> tuple[bytes, tuple[int, int]] | None:
    """The first value of ``kvs`` (newest first) the job wrote at ``key``, and its place; ``places``: read."""
    for kv in kvs:
        if kv is None or _place(kv) in places:
            continue
        places.add(_place(kv))
        value = backend.sealer.verify(key, _value(kv), _place(kv)[1], _place(kv)[0])
        if value is not None:
            return value, _place(kv)
    return None
