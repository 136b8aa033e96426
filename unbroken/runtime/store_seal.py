"""Every value of the embedded store is authenticated with the job's secret: what another client writes is
never acted on.

``TCPStore`` has no authentication: anyone who reaches its port can list its
keys (and so learn the job's namespace) and write any key. Every value the job
writes is therefore sealed: ``payload + nonce + tag``, the nonce 16 random hex
digits (two writes of one payload differ, so a compare-and-set's answer tells
whose write landed), the tag the first 32 hex digits of HMAC-SHA256 over the
key, the payload and the nonce, keyed by a key derived from the job's secret.
A value whose tag does not verify is logged once per key and read as absent;
where the job must write that key, the forged value is first replaced by the
empty value (a tombstone, also read as absent) by compare-and-set, so an
attacker's write can delay the job (as any client that floods the store can),
never steer it.

Counters (heartbeats, progress, deaths, joins) are sealed values too, added to
by compare-and-set (a swap on the value this client last saw: one round trip
when nobody else wrote since, else a second with the value the failed swap
answered), and
the rendezvous of the job's process groups go through :class:`SealedStore`, a
``torch.distributed.Store`` that seals what gloo or NCCL write (their peers'
addresses, NCCL's unique id). What this does not cover: gloo's and NCCL's own
traffic is unauthenticated in PyTorch (run them on an isolated network), and
a replayed authentic value of the same key (keys are written once per view
generation, and generations only grow).
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import secrets
import time
from datetime import timedelta

import torch.distributed as dist

__all__ = ["SealedStore", "Sealer"]

logger = logging.getLogger(__name__)

NONCE_LEN = 16
TAG_LEN = 32
POLL_S = 0.01
"""How often a read that found a forged or tombstoned value looks again for an authentic one."""


class Sealer:
    """Seals and opens the values of one job (module docstring)."""

    def __init__(self, secret: str) -> None:
        self._key = hashlib.sha256(b"unbroken-store-seal\0" + secret.encode()).digest()
        self._warned: set[str] = set()

    def seal(self, key: str, payload: str | bytes) -> bytes:
        data = payload.encode() if isinstance(payload, str) else bytes(payload)
        nonce = secrets.token_hex(NONCE_LEN // 2).encode()
        return data + nonce + self._tag(key, data, nonce)

    def open(self, key: str, raw: bytes | None) -> bytes | None:
        """The payload of an authentic value; None for a missing key, a tombstone or a forged value."""
        if not raw:
            return None
        if len(raw) >= NONCE_LEN + TAG_LEN:
            data, nonce, tag = raw[:-NONCE_LEN - TAG_LEN], raw[-NONCE_LEN - TAG_LEN:-TAG_LEN], raw[-TAG_LEN:]
            if hmac.compare_digest(tag, self._tag(key, data, nonce)):
                return data
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("store key %r holds a value not written by this job (no valid seal): ignored", key)
        return None

    def _tag(self, key: str, data: bytes, nonce: bytes) -> bytes:
        mac = hmac.new(self._key, key.encode() + b"\0" + nonce + b"\0" + data, hashlib.sha256)
        return mac.hexdigest()[:TAG_LEN].encode()


class SealedStore(dist.Store):
    """A ``torch.distributed.Store`` over ``inner`` (a prefix of the job's store) whose values are sealed under
    ``prefix`` + key: the rendezvous store of a process group (gloo and NCCL call it from C++)."""

    def __init__(self, inner: dist.Store, prefix: str, sealer: Sealer, timeout_s: float) -> None:
        super().__init__()
        self.inner, self.prefix, self.sealer, self.timeout_s = inner, prefix, sealer, timeout_s

    def set(self, key: str, value: str | bytes) -> None:
        self.inner.set(key, self.sealer.seal(self.prefix + key, value))

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        while True:
            raw = self.inner.get(key)  # waits until the key exists
            value = self.sealer.open(self.prefix + key, raw)
            if value is not None:
                return value
            if raw:
                self.inner.compare_set(key, raw, b"")  # a forged value: tombstone it (only if still the same)
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"no value written by this job for key {self.prefix + key!r} "
                                          f"within {self.timeout_s:.0f} s")
            time.sleep(POLL_S)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        limit = self.timeout_s if timeout is None else timeout.total_seconds()
        deadline = time.monotonic() + limit
        for key in keys:
            while True:
                self.inner.wait([key], timedelta(seconds=max(0.001, deadline - time.monotonic())))
                raw = self.inner.get(key)
                if self.sealer.open(self.prefix + key, raw) is not None:
                    break
                if raw:
                    self.inner.compare_set(key, raw, b"")
                if time.monotonic() > deadline:
                    raise dist.DistStoreError(f"no value written by this job for key {self.prefix + key!r} "
                                              f"within {limit:.0f} s")
                time.sleep(POLL_S)

    def check(self, keys: list[str]) -> bool:
        if not self.inner.check(keys):
            return False
        return all(self.sealer.open(self.prefix + k, self.inner.get(k)) is not None for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return [self.get(k) for k in keys]

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        for k, v in zip(keys, values):
            self.set(k, v)

    def add(self, key: str, amount: int) -> int:
        return add_sealed(self.inner, self.prefix + key, key, amount, self.sealer)[0]

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return compare_set_sealed(self.inner, self.prefix + key, key, expected, desired, self.sealer)[0]

    def delete_key(self, key: str) -> bool:
        return self.inner.delete_key(key)

    def num_keys(self) -> int:
        return self.inner.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.timeout_s = timeout.total_seconds()


PROBE = b"\0unbroken-probe"
"""Never a sealed value: ``compare_set(key, PROBE, PROBE)`` reads a key in one round trip, without waiting for it
(``TCPStore`` answers the current value, or echoes ``PROBE`` for a missing key)."""


def present(store: dist.Store, key: str) -> bytes | None:
    """The key's raw value, None if missing: one round trip (``check`` then ``get`` would be two)."""
    raw = store.compare_set(key, PROBE, PROBE)
    return None if raw == PROBE else raw


def compare_set_sealed(store: dist.Store, name: str, key: str, expected: str | bytes, desired: str | bytes,
                       sealer: Sealer, hint: bytes | None = None) -> tuple[bytes, bytes | None]:
    """``TCPStore.compare_set`` on sealed values (``name``: the key the seal covers, ``key``: the store's).

    ``hint``: the raw value this client last saw there; if it holds ``expected``, the swap is tried on it at
    once (one round trip when nobody wrote since; a failed swap answers the current value, so no read is
    lost either). Returns the key's payload afterwards (``desired`` when it was swapped in; the current
    payload otherwise; ``expected`` echoed for a missing key with a non-empty ``expected``, as ``TCPStore``
    does) and the raw value it read or wrote (the next call's hint)."""
    want = expected.encode() if isinstance(expected, str) else bytes(expected)
    raw = hint if hint and want and sealer.open(name, hint) == want else present(store, key)
    while True:
        current = sealer.open(name, raw)
        if current is None and raw:  # forged: tombstone it, then decide again
            store.compare_set(key, raw, b"")
            raw = present(store, key)
            continue
        if current is None and want:
            return want, None
        if current is not None and current != want:
            return current, raw
        sealed = sealer.seal(name, desired)
        got = store.compare_set(key, raw if raw else b"", sealed)
        if got == sealed:
            return sealer.open(name, sealed) or b"", sealed
        # Someone else wrote since the read: the swap answered the current value (or echoed ours: missing).
        raw = None if raw and got == raw else got


def add_sealed(store: dist.Store, name: str, key: str, amount: int, sealer: Sealer, known: int = 0,
               hint: bytes | None = None) -> tuple[int, bytes | None]:
    """A sealed counter: read, then compare-and-set the sum (retried on a lost race); a missing, tombstoned
    or forged value counts as ``known`` (the last value this client saw: a forged value cannot set a worker's
    heartbeat back). ``hint`` (an add, not a read): the raw value this client last saw there, tried as the
    current one (a counter only its owner adds to, a heartbeat, costs one round trip). Returns the value and
    the raw one read or written (the next call's hint)."""
    raw = hint if hint and amount else present(store, key)
    while True:
        current = sealer.open(name, raw)
        value = int(current) if current is not None else known
        if amount == 0 and current is not None:
            return value, raw
        sealed = sealer.seal(name, str(value + amount))
        got = store.compare_set(key, raw if raw else b"", sealed)
        if got == sealed:
            return value + amount, sealed
        raw = None if raw and got == raw else got
