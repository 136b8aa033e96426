"""The job store on an etcd v3 cluster: no single machine whose loss stops the job.

``--store etcd://HOST:PORT[,HOST:PORT...][/PREFIX]`` puts every key of the job
under ``PREFIX/<namespace>/`` (the namespace derived from the job's secret, as
with the embedded store) on an etcd cluster, reached through etcd's v3 JSON
gateway with :mod:`etcd3gw` (pure Python: no grpc or protobuf pins).

Operations, each one HTTP round trip in the common case:

- ``compare_set``: one etcd transaction (compare the value, or that the key is absent, then put; else read), with
  ``TCPStore``'s semantics: a missing key with a non-empty ``expected`` echoes ``expected`` and creates nothing;
- ``add``: a transaction guarded by the key's revision (read first, unless this client wrote the counter last: a
  worker's own heartbeat is one round trip; retried on a lost race); each adder also writes its own marker key in
  that transaction, so an add whose answer was lost (its member died or timed out mid-request) is recognised when
  sent again and never counted twice, nor lost (a create that landed unsealed is sealed, or made again);
- ``check`` / ``multi_get``: one transaction of reads;
- ``get`` / ``multi_get`` of a missing key wait for it (like ``TCPStore``) up to the operation timeout.

Leases: counters a client declares with :meth:`EtcdBackend.lease_keys` (a worker's heartbeat and progress) are
written under its lease, refreshed by its own adds once a third of the TTL has passed (one ``lease/keepalive``
request): when it stops, etcd deletes them by itself a TTL later. Every adder's markers go under its lease too (a
client that declared no counters takes one of ``MARKER_TTL_S``): a marker matters only while its add is being
retried, so the markers of the thousands of clients a long job sees come and go (one per worker, joiner or
standby incarnation on ``deaths``, ``joins`` and the beats) are deleted by etcd once their client is gone instead
of piling up.

Failover (:mod:`unbroken.store.etcd_client`): a client talks to one member (chosen by its pid, so the job's clients
are spread over the cluster); a member that refuses, resets or does not answer within ``REQUEST_TIMEOUT_S`` is left
for the next one, until the store timeout (``fault.store_timeout_s``: no quorum), saying so every ``WAIT_LOG_S``,
after which :class:`StoreUnavailable` (a ``torch.distributed.DistStoreError``, like a lost ``TCPStore``) is raised.
Every operation is safe to send again: puts, deletes and compare-and-sets are idempotent in their result, adds
carry their marker.

Process groups rendezvous on :class:`EtcdGroupStore`, a Python ``torch.distributed.Store`` over the same backend
(gloo and NCCL call its ``set``/``get``/``wait`` from C++), so the rendezvous survives a member's loss too
(:mod:`unbroken.store.etcd_group_store`). What another writer did to a key is read back through the key's
history (:mod:`unbroken.store.etcd_history`: a forged counter's newest authentic value; a deleted ``gen`` or
``outcome/<g>`` brought back with the newest decision written there; a view, items or rendezvous key gone or
forged, read there by a waiting read); the launch's namespace and the job's pointer to it are kept by
:mod:`unbroken.store.etcd_launch`.

Invariant: every key written is under the job's prefix and namespace.
"""

from __future__ import annotations

import base64
import itertools
import json
import logging
import math
import os
import secrets
import time
import uuid
from typing import Any

import torch.distributed as dist

from unbroken.store.etcd_client import (Cluster, RequestRefused, StoreUnavailable, check_transport, is_etcd,
                                           parse_etcd, tls_files)
from unbroken.store.backend import (ETCD_SCHEME, SECRET_ENV, UNSEEN, StoreAccessDenied, StoreBackend,
                                           _namespace)
from unbroken.store.etcd_group_store import EtcdGroupStore
from unbroken.store.etcd_launch import clear_launch, point_here, range_end, read_pointer
from unbroken.store.etcd_history import (RESTORED, fill_written, last_authentic, last_before_gone, restore,
                                         restored_value, sealed_at)
from unbroken.store.seal import Sealer, launch_key
from unbroken.store.wire import LAUNCH_ENV

__all__ = ["ETCD_SCHEME", "EtcdBackend", "EtcdGroupStore", "StoreUnavailable", "is_etcd", "parse_etcd"]

logger = logging.getLogger(__name__)

WAIT_POLL_S = (0.002, 0.05)
"""A ``get`` of a missing key reads again after this delay, doubling from the first to the second value.
Not a watch: etcd3gw's watches work through etcd 3.4's gateway (timeouts too) and wake ~5 ms after the put
against ~45 ms for this backoff (``unbroken bench store --parts watch``), but a job waits for a missing key
only in a new group's rendezvous (a few per view change, ~10 ms each), and each watch costs a streaming
connection and two threads, or 100 ms when the key changed before the watch began (etcd's catch-up loop)."""
KV_CACHE = 4096
"""At most this many keys' last read or written versions are remembered by a client."""
LEASE_REFRESH = 1 / 3
"""A client's lease is refreshed once this fraction of its TTL has passed since the last refresh."""
MARKER = "\x00add\x00"
"""An adder's marker key is the counter's key + this + the adder's id (sorted right after the counter)."""
MARKER_TTL_S = 30
"""The TTL of the lease a client that declared no leased counters takes for its markers: they vanish this
long after its last add (the lease is refreshed by its adds, like a worker's liveness lease)."""


def _b64(data: str | bytes) -> str:
    return base64.b64encode(data.encode() if isinstance(data, str) else data).decode()


def _unb64(data: str | None) -> bytes:
    return base64.b64decode(data) if data else b""


class EtcdBackend(StoreBackend):
    """The job's keys on etcd, under ``PREFIX/<namespace>/<launch>/``, every value sealed (module docstring)."""

    poll_s = 0.1
    """Each request is an HTTP round trip (1-3 ms, and a raft write for a put) and CPU on every member: loops
    that poll every few milliseconds (agents, launcher, a worker's detector during a collective) would keep
    the cluster busy for nothing, so they poll at most this often (hangs are judged over seconds anyway)."""

    def __init__(self, addr: str, secret: str, *, timeout_s: float, store_timeout_s: float | None = None,
                 launch: str | None = None, insecure: bool = False) -> None:
        endpoints, prefix = parse_etcd(addr)
        check_transport(addr, endpoints, insecure)
        self.addr, self.timeout_s, self.secret = addr, timeout_s, secret
        self.cluster = Cluster(endpoints, timeout_s if store_timeout_s is None else store_timeout_s,
                                tls_files(addr))
        self.root = f"{prefix}/{_namespace(secret)}"
        self.launch = launch or ""
        self.ns = f"{self.root}{self.launch}/"
        self.sealer = Sealer(launch_key(secret, self.launch))
        self._me = uuid.uuid4().hex[:12]
        self._seq = itertools.count(1)
        self.kvs: dict[str, dict[str, Any]] = {}  # key -> the kv this client last read or wrote there
        self._counted: dict[str, int] = {}  # counter -> the last authentic value this client saw (forged: this)
        self._leased: set[str] = set()  # keys written under this client's lease (lease_keys)
        self._lease_ttl, self._lease_id, self._lease_refreshed = MARKER_TTL_S, "", 0.0
        self.lease_round_trips = 0  # requests that granted or refreshed the lease (the benchmark counts them)
        self._revision = 0  # the newest store revision any answer reported
        self._first_revision = -1  # the revision the launch's first key (``job``) was created at, once read
        self.restores_checked: dict[str, tuple[int, int]] = {}  # key -> a restored creation found the newest
        self.written: dict[str, tuple[float, int, bytes | None, tuple[int, int]]] = {}  # fill_written's reads

    # -- plumbing ---------------------------------------------------------------

    @property
    def round_trips(self) -> int:
        """HTTP requests sent so far by this client (the benchmark's store operations)."""
        return self.cluster.round_trips

    def call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        out = self.cluster.call(path, payload)
        # The newest revision this client saw: a create is sealed for the next one (_write).
        self._revision = max(self._revision, int(out.get("header", {}).get("revision", 0) or 0))
        return out

    @property
    def revision(self) -> int:
        """The newest store revision an answer to this client reported."""
        return self._revision

    def first_revision(self) -> int:
        """The store revision before the launch's first key was created (its keys' history starts after it)."""
        if self._first_revision < 0:
            kv = self.read_many(["job"])[0]
            self._first_revision = int(kv["create_revision"]) - 1 if kv is not None else 0
        return self._first_revision

    def restore(self, key: str) -> bool:
        """Bring a decision key another writer deleted or forged back with the newest decision its history holds
        (:func:`unbroken.store.etcd_history.restore`); True if it holds an authentic value now."""
        return restore(self, key)

    def set_store_timeout(self, seconds: float) -> None:
        """Wait up to ``seconds`` for a quorum before an operation fails (``fault.store_timeout_s``)."""
        self.cluster.store_timeout_s = seconds

    def prefixed(self, key: str) -> str:
        return _b64(self.ns + key)

    def txn(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
             failure: list[dict[str, Any]]) -> tuple[bool, list[dict[str, Any]]]:
        ok, responses, _ = self.txn_rev(compare, success, failure)
        return ok, responses

    def txn_rev(self, compare: list[dict[str, Any]], success: list[dict[str, Any]],
                 failure: list[dict[str, Any]]) -> tuple[bool, list[dict[str, Any]], str]:
        """A transaction: (succeeded, responses, the store's revision after it)."""
        out = self.call("kv/txn", {"compare": compare, "success": success, "failure": failure})
        return bool(out.get("succeeded")), out.get("responses", []), str(out.get("header", {}).get("revision", "0"))

    def _read(self, key: str) -> dict[str, Any]:
        return {"request_range": {"key": self.prefixed(key)}}

    def _put(self, key: str, value: str | bytes, lease: str = "") -> dict[str, Any]:
        put = {"key": self.prefixed(key), "value": _b64(value)}
        return {"request_put": {**put, "lease": lease} if lease else put}

    @staticmethod
    def kv_of(response: dict[str, Any]) -> dict[str, Any] | None:
        kvs = response.get("response_range", {}).get("kvs")
        return kvs[0] if kvs else None

    def read_many(self, keys: list[str]) -> list[dict[str, Any] | None]:
        _, responses = self.txn([], [self._read(k) for k in keys], [])
        kvs = [self.kv_of(r) for r in responses]
        for k, kv in zip(keys, kvs):
            self._remember(k, kv)
        return kvs

    def _remember(self, key: str, kv: dict[str, Any] | None) -> None:
        if len(self.kvs) >= KV_CACHE:
            self.kvs.clear()  # old generations' keys: bounded, whatever the run's length
        if kv is None:
            self.kvs.pop(key, None)
        else:
            self.kvs[key] = kv

    def open_value(self, key: str, kv: dict[str, Any] | None) -> bytes | None:
        """The authentic payload of ``kv`` (None: absent, or a value this launch did not write there)."""
        if kv is None:
            return None
        value = self.sealer.open(key, _unb64(kv.get("value")), int(kv.get("version", 0)),
                                 int(kv.get("create_revision", 0)))
        if value is not None and value.startswith(RESTORED):  # a decision key brought back: checked first
            return restored_value(self, key, kv, value)
        return value

    def _guard(self, key: str, kv: dict[str, Any] | None) -> dict[str, Any]:
        """The transaction's compare: the key is still as ``kv`` (absent for None)."""
        if kv is None:
            return {"key": self.prefixed(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}
        return {"key": self.prefixed(key), "target": "MOD", "result": "EQUAL", "mod_revision": kv["mod_revision"]}

    def write_sealed(self, key: str, kv: dict[str, Any] | None, payload: bytes, lease: str = "",
               also: list[dict[str, Any]] | None = None,
               guards: list[dict[str, Any]] | None = None) -> tuple[bool | None, dict[str, Any] | None]:
        """Write ``payload`` sealed for the key's next version, if the key is still as ``kv``; returns whether it
        did and the key's kv now (the one written, or the one found).

        A create is sealed for the revision after the newest this client saw (it cannot know its own); when
        another write came first, the value is written again at version 2, sealed for the revision the create
        got (store_seal). If another writer replaced the key in between, returns None: nothing of this write
        stayed, but ``also`` was written. ``guards``: more compares the write needs."""
        version = int(kv.get("version", 0)) + 1 if kv is not None else 1
        created = int(kv["create_revision"]) if kv is not None else self._revision + 1
        sealed = self.sealer.seal(key, payload, version, created)
        ok, responses, revision = self.txn_rev([self._guard(key, kv), *(guards or [])],
                                                [self._put(key, sealed, lease), *(also or [])], [self._read(key)])
        if ok and kv is None and int(revision) != created:
            first = {"mod_revision": revision, "create_revision": revision, "version": "1"}
            created, version = int(revision), 2
            sealed = self.sealer.seal(key, payload, version, created)
            ok, responses, revision = self.txn_rev([self._guard(key, first)], [self._put(key, sealed, lease)],
                                                    [self._read(key)])
            found = None if ok else self.kv_of(responses[0])
            if found is not None and _unb64(found.get("value")) == sealed:
                ok, revision = True, found["mod_revision"]  # it landed; the answer was lost and sent again
            elif not ok:
                self._remember(key, found)
                return None, found
        if ok:
            now: dict[str, Any] | None = {"value": _b64(sealed), "mod_revision": revision,
                                          "create_revision": str(created), "version": str(version)}
            self.sealer.accepted(key, created, version)
        else:
            now = self.kv_of(responses[0])
        self._remember(key, now)
        return ok, now

    def wait_values(self, keys: list[str], timeout_s: float | None = None) -> list[bytes]:
        """The keys' authentic values, waiting for missing ones (like ``TCPStore``) up to the timeout; a key
        that holds only values this launch did not write for longer than the store timeout stops the job.
        A write-once key gone or forged is read from its history after a grace (:func:`fill_written`)."""
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        delay = WAIT_POLL_S[0]
        while True:
            values = fill_written(self, keys, self.peek(keys))
            if all(v is not None for v in values):
                return values  # type: ignore[return-value]
            self._check_forged(keys)
            if time.monotonic() > deadline:
                missing = [k for k, v in zip(keys, values) if v is None]
                raise StoreUnavailable(f"etcd keys {missing} did not appear within the timeout")
            time.sleep(delay)
            delay = min(2 * delay, WAIT_POLL_S[1])

    def _check_forged(self, keys: list[str]) -> None:
        """Raise once a key has held only values this launch did not write for ``fault.store_timeout_s``."""
        now = time.monotonic()
        for k in keys:
            since = self.sealer.bad_since.get(k)
            if since is not None and now - since > self.cluster.store_timeout_s:
                raise StoreUnavailable(
                    f"etcd key {self.ns + k!r} has held only values not written by this launch of the job for "
                    f"{now - since:.0f} s ({self.sealer.bad.get(k, 0)} read): another process with write access "
                    f"to the cluster writes the job's keys (a forged or replayed value); give the job an etcd user "
                    f"of its own on its prefix")

    # -- StoreBackend -----------------------------------------------------------

    def get(self, key: str) -> bytes:
        return self.wait_values([key])[0]

    def set(self, key: str, value: str | bytes) -> None:
        payload = value.encode() if isinstance(value, str) else bytes(value)
        kv = self.kvs.get(key) if key in self.kvs else self.read_many([key])[0]
        while not self.write_sealed(key, kv, payload)[0]:
            kv = self.kvs.get(key)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        """``TCPStore``'s compare-and-set on authentic values: a value this launch did not write counts as absent
        (and is replaced when ``expected`` is empty); a missing key with a non-empty ``expected`` echoes it."""
        desired_b = desired.encode() if isinstance(desired, str) else bytes(desired)
        expected_b = expected.encode() if isinstance(expected, str) else bytes(expected)
        kv = self.kvs.get(key) if key in self.kvs and self.open_value(key, self.kvs[key]) == expected_b \
            else self.read_many([key])[0]
        while True:
            current = self.open_value(key, kv)
            if current is None and expected_b:
                return expected_b
            if current is not None and current != expected_b:
                return current
            ok, kv = self.write_sealed(key, kv, desired_b)
            if ok:
                return desired_b

    def create_unless_moved(self, key: str, value: str, witness: str) -> bytes | None:
        """:meth:`StoreBackend.create_unless_moved` in one transaction: the create also compares ``witness``'s
        revision with the one this client last read (absent if it read none)."""
        guard = self._guard(witness, self.kvs.get(witness))  # taken first: the read below may empty the cache
        kv = self.read_many([key])[0]
        while (current := self.open_value(key, kv)) is None:
            before = None if kv is None else kv["mod_revision"]
            ok, kv = self.write_sealed(key, kv, value.encode(), guards=[guard])
            if ok:
                return value.encode()
            if (None if kv is None else kv["mod_revision"]) == before:
                return None  # the key is as it was: the witness moved
        return current

    def add(self, key: str, amount: int) -> int:
        """A sealed counter, read and written in one guarded transaction (one round trip when this client wrote
        it last: its own heartbeat); a value this launch did not write counts as the last one this client saw
        (a forged value cannot set a counter back)."""
        kv = self.kvs.get(key) if amount and key in self.kvs else self.read_many([key])[0]
        if amount == 0 and kv is not None:  # a read (a missing counter is created at 0, as TCPStore's add does)
            return self._count(key, kv)
        marker, leased = f"{key}{MARKER}{self._me}", key in self._leased
        while True:
            token = f"{self._me}:{next(self._seq)}"  # one per try: a lost create's marker is not this try's
            base = self._count(key, kv)
            lease = self._lease()  # the marker's, and the counter's if it is leased
            try:
                ok, kv = self.write_sealed(key, kv, str(base + amount).encode(), lease if leased else "",
                                           also=[self._put(marker, token, lease)])
            except RequestRefused:
                self._lease_id = ""  # it expired after its refresh (this process stood still): a new one
                kv = self.read_many([key])[0]
                continue
            landed = None if ok or ok is None else self._landed(marker, token)
            if landed is not None and sealed_at(self, key, landed):
                value = self.open_value(key, kv)
                return int(value) if value is not None else base + amount
            if landed is not None and kv is not None and int(kv["mod_revision"]) == landed:  # unsealed: seal it
                ok, kv = self.write_sealed(key, kv, str(base + amount).encode(), lease if leased else "")
            if ok:
                self._counted[key] = base + amount
                return base + amount

    def _count(self, key: str, kv: dict[str, Any] | None) -> int:
        """A counter's value: 0 when absent (never written, or its lease expired), the last value this client
        saw when it holds a value this launch did not write. A counter of this client's lease (its own heartbeat
        and progress) goes on from its last value when absent too: another writer deleting it must not send it
        back to values an observer already saw (a beat that repeats a value is no change)."""
        if kv is None:
            return self._counted.get(key, 0) if key in self._leased else 0
        value = self.open_value(key, kv)
        if value is None:
            return self._counted.get(key, 0)
        self._counted[key] = int(value)
        return int(value)

    def lease_keys(self, keys: list[str], ttl_s: float) -> None:
        """Write ``keys`` (counters this client adds to) under a lease of ``ttl_s`` seconds (whole, at least
        2), refreshed by this client's adds: once it stops, etcd deletes them ``ttl_s`` later by itself."""
        self._leased = set(keys)
        self._lease_ttl, self._lease_id = max(2, math.ceil(ttl_s)), ""

    def _lease(self) -> str:
        """This client's live lease: granted on first use, refreshed once ``LEASE_REFRESH`` of it has passed,
        granted anew if it expired (one round trip when due, none otherwise)."""
        now = time.monotonic()
        if self._lease_id and now - self._lease_refreshed > LEASE_REFRESH * self._lease_ttl:
            self.lease_round_trips += 1
            out = self.call("lease/keepalive", {"ID": self._lease_id}).get("result", {})
            self._lease_id = self._lease_id if int(out.get("TTL", 0)) > 0 else ""
            self._lease_refreshed = now
        if not self._lease_id:
            self.lease_round_trips += 1
            self._lease_id = str(self.call("lease/grant", {"TTL": self._lease_ttl})["ID"])
            self._lease_refreshed = now
            for key in self._leased:
                self.kvs.pop(key, None)  # gone with the old lease, if it expired: read them again
        return self._lease_id

    def get_present(self, keys: list[str]) -> list[bytes | None]:
        """Counters without waiting, each its newest authentic value: read back through the key's history where
        another writer forged or deleted it (:mod:`unbroken.store.etcd_history`); None for a missing one with
        no recent history (its lease expired long ago), :data:`UNSEEN` for one holding a value this launch did
        not write with none of its own behind (no observation: never read as a counter standing still)."""
        out: list[bytes | None] = []
        for k, kv in zip(keys, self.read_many(keys)):
            value = self.open_value(k, kv)
            if kv is None:
                value = last_before_gone(self, k)
            elif value is None:
                value = last_authentic(self, k, kv)
            out.append(value if value is not None or kv is None else UNSEEN)
        return out

    def _landed(self, marker: str, token: str) -> int | None:
        """The revision this try of an add committed at although its answer was lost (the resend found the key
        moved, and our marker holds the try's token); None if it did not commit. A create whose guess of its
        revision was wrong landed unsealed (:meth:`write_sealed`'s second write was never sent): every adder reads
        it as absent, so the add seals it where it stands, or adds again once another adder wrote over it."""
        _, responses = self.txn([], [self._read(marker)], [])
        kv = self.kv_of(responses[0])
        return int(kv["mod_revision"]) if kv is not None and _unb64(kv.get("value")).decode() == token else None

    def check(self, keys: list[str]) -> bool:  # polled as a wait: a write-once key read as wait_values does
        return all(v is not None for v in fill_written(self, keys, self.peek(keys)))

    def peek(self, keys: list[str]) -> list[bytes | None]:
        """Authentic values, None for a missing (or foreign) one: one transaction of reads."""
        return [self.open_value(k, kv) for k, kv in zip(keys, self.read_many(keys))]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.wait_values(keys)

    def delete_key(self, key: str) -> bool:
        # The key and its adders' markers (key + "\x00..."), nothing else: the range [key, key + "\x01").
        self.kvs.pop(key, None)
        out = self.call("kv/deleterange", {"key": self.prefixed(key), "range_end": _b64(self.ns + key + "\x01")})
        return int(out.get("deleted", 0)) > 0

    def num_keys(self) -> int:
        """The launch's keys (adders' markers not counted): one read of its namespace's keys."""
        out = self.call("kv/range", {"key": _b64(self.ns), "range_end": range_end(self.ns), "keys_only": True})
        return sum(1 for kv in out.get("kvs", []) if "\x00" not in _unb64(kv["key"]).decode())

    def group_store(self, prefix: str) -> dist.Store:
        return EtcdGroupStore(self, prefix + "/")

    # -- the job's namespace ----------------------------------------------------

    def clear(self) -> int:
        """Delete every key of this launch, and the job's pointer if it still points here (the job is over);
        returns how many keys went."""
        return clear_launch(self)

    @classmethod
    def connect(cls, addr: str, *, timeout_s: float, secret: str, store_timeout_s: float | None = None,
                launch: str | None = None, insecure: bool = False) -> EtcdBackend:
        """A client of the job of ``secret`` on the etcd cluster at ``addr``, for launch ``launch`` (default:
        ``$UNBROKEN_STORE_LAUNCH``, else the job's current launch, read from its sealed pointer).

        Raises:
            ValueError: ``addr`` is malformed, plain etcd:// to another host without ``insecure``, or etcd3gw
                is missing.
            ConnectionError: no member answered within ``timeout_s`` (says what to check).
            StoreAccessDenied: the cluster holds no job under this secret.
        """
        launch = launch or os.environ.get(LAUNCH_ENV) or None
        try:
            if launch is None:
                pointer, _ = read_pointer(cls(addr, secret, timeout_s=timeout_s, store_timeout_s=store_timeout_s,
                                              insecure=insecure))
                launch = str(pointer["launch"]) if pointer else None
            backend = cls(addr, secret, timeout_s=timeout_s, store_timeout_s=store_timeout_s, launch=launch,
                          insecure=insecure)
            present = launch is not None and backend.check(["job"])
        except StoreUnavailable as exc:
            raise ConnectionError(f"store {addr}: no etcd member answered within {timeout_s:.0f} s ({exc}); "
                                  f"is etcd running there, with quorum, and the address right?") from None
        if not present:
            raise StoreAccessDenied(f"store {addr} holds no job under this secret; use the run's secret file or "
                                    f"{SECRET_ENV} of the job you mean")
        return backend

    @classmethod
    def create(cls, addr: str, *, timeout_s: float, secret: str, job: dict[str, Any],
               insecure: bool = False) -> EtcdBackend:
        """Open a new launch of a job on the cluster: a namespace of its own, and the job's pointer set to it.

        ``job`` describes this job (run directory, host, pid): a later job whose secret maps to the same
        namespace but runs in another run directory is refused with it; a new launch of the same job (a
        resume) replaces the pointer, and never reads the keys of an earlier launch.

        Raises:
            ValueError: the namespace is another job's (names that job and the fix), or plain etcd:// to
                another host without ``insecure``.
            ConnectionError: no member answered within ``timeout_s``.
        """
        backend = cls(addr, secret, timeout_s=timeout_s, launch=secrets.token_hex(16), insecure=insecure)
        try:
            point_here(backend, job)
            backend.compare_set("job", "", json.dumps(job, sort_keys=True))
        except StoreUnavailable as exc:
            raise ConnectionError(f"store {addr}: no etcd member answered within {timeout_s:.0f} s ({exc}); "
                                  f"is etcd running there, with quorum, and the address right?") from None
        return backend
