"""Where the job store's keys live: the backend interface and torch's ``TCPStore`` behind it.

Access. The host listens on the job's host only (``train.host``, loopback by
default; a socket bound there is handed to the store). ``TCPStore`` has no
authentication of its own, so every key of the job lives under a namespace
derived from a per-job secret (:func:`job_secret`: generated at launch, kept in
``RUN/secret`` with mode 0600, or given in ``UNBROKEN_JOB_SECRET`` for jobs
spanning machines): a client without the secret cannot name, read or change
any key of the job, cannot join a process group (their rendezvous keys are in
the namespace too) and so never receives the training state. A connection
with a wrong secret is refused at once (:class:`StoreAccessDenied`): the host
writes a marker under the namespace that only the right secret finds.

Invariant: every key a backend stores for the job is under its namespace.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import socket
import time
from abc import ABC, abstractmethod
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from unbroken.runtime.store_seal import (NONCE_LEN, TAG_LEN, Sealer, SealedStore, add_sealed, present,
                                        compare_set_sealed)
from unbroken.runtime.store_seal import POLL_S as SEAL_POLL_S

__all__ = ["ETCD_SCHEME", "ETCDS_SCHEME", "ETCD_TLS_ENV", "is_etcd_address", "SECRET_ENV", "SECRET_FILE",
           "StoreAccessDenied", "StoreBackend", "TCPStoreBackend", "job_secret", "new_secret", "save_secret"]

ETCD_SCHEME = "etcd://"
"""A store address starting so names an etcd cluster (:mod:`unbroken.runtime.etcd_backend`)."""
ETCDS_SCHEME = "etcds://"
"""The same over TLS with a client certificate (CA, certificate and key: :data:`ETCD_TLS_ENV`)."""
ETCD_TLS_ENV = {"ca": "UNBROKEN_ETCD_CA", "cert": "UNBROKEN_ETCD_CERT", "key": "UNBROKEN_ETCD_KEY"}
"""Environment variables naming the PEM files of an ``etcds://`` store: the CA that signed the members'
certificates, and this client's certificate and key (etcd run with ``--client-cert-auth``)."""


def is_etcd_address(addr: str) -> bool:
    """``addr`` names an etcd cluster (``etcd://`` or ``etcds://``)."""
    return addr.startswith((ETCD_SCHEME, ETCDS_SCHEME))
SECRET_ENV = "UNBROKEN_JOB_SECRET"
"""Environment variable holding the job's secret (agents pass it to their workers this way, never on argv)."""
SECRET_FILE = "secret"
"""The secret's file in the run directory (mode 0600)."""


UNSEEN = b"-1"
"""What :meth:`TCPStoreBackend.get_present` reads for a counter whose value is not the job's: no observation
(a liveness reader treats it as a moment it could not see, never as the counter standing still)."""


class StoreAccessDenied(PermissionError):
    """The store does not hold this job under the given secret."""


def job_secret(run_dir: Path, *, create: bool = False) -> str:
    """The job's secret: ``$UNBROKEN_JOB_SECRET``, else ``run_dir/secret``; created (0600) if asked.

    Raises:
        StoreAccessDenied: none exists and ``create`` is false (says where to put it).
    """
    if os.environ.get(SECRET_ENV):
        return os.environ[SECRET_ENV]
    path = Path(run_dir) / SECRET_FILE
    if path.is_file():
        return path.read_text().strip()
    if not create:
        raise StoreAccessDenied(f"no job secret: set {SECRET_ENV} or copy the run's {SECRET_FILE} file into {run_dir}")
    value = new_secret()
    save_secret(run_dir, value)
    return value


def new_secret() -> str:
    """A fresh job secret (``$UNBROKEN_JOB_SECRET`` if the user chose one)."""
    return os.environ.get(SECRET_ENV) or secrets.token_hex(16)


def save_secret(run_dir: Path, secret: str) -> None:
    """Write ``run_dir/secret``, readable by its owner only (0600 from creation, replaced atomically)."""
    path = Path(run_dir) / SECRET_FILE
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_name(f".{SECRET_FILE}.{os.getpid()}.{secrets.token_hex(4)}")
    # A new file of ours or nothing: never through a link, never into a file someone else put there.
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    except FileExistsError:
        raise StoreAccessDenied(f"{tmp} exists (planted?); the job secret is not written through it: "
                                f"remove it and start again") from None
    with os.fdopen(fd, "w") as fh:
        fh.write(secret + "\n")
    os.replace(tmp, path)


READY_KEY = "unbroken/ready"
"""Set by the host (outside any namespace) once the job's marker is written: a client waits for it before it
judges its secret, so one that connects in between is not refused."""


def _namespace(secret: str) -> str:
    return hashlib.sha256(b"unbroken-job-store\0" + secret.encode()).hexdigest()[:32] + "/"



class StoreBackend(ABC):
    """A key-value store with compare-and-set and counters (the subset of ``torch.distributed.Store`` used)."""

    poll_s: float = 0.0
    """The shortest sensible interval between two polls of the same keys by a supervising loop (0: no floor)."""

    def set_store_timeout(self, seconds: float) -> None:
        """How long an operation waits for an unanswering store before it fails (``fault.store_timeout_s``).
        Only a replicated store waits (etcd, for a quorum); the embedded store's loss is seen at once."""

    def lease_keys(self, keys: list[str], ttl_s: float) -> None:
        """Keep ``keys`` (counters this client adds to) only while this client keeps adding: they vanish
        about ``ttl_s`` after its last add. Only a store with leases does (etcd); others keep them."""

    def get_present(self, keys: list[str]) -> list[bytes | None]:
        """The keys' values, None for a missing one, without waiting (a store without leases: keys that
        exist by the job's invariants, read with :meth:`multi_get`)."""
        return list(self.multi_get(keys))

    @abstractmethod
    def get(self, key: str) -> bytes: ...
    @abstractmethod
    def set(self, key: str, value: str) -> None: ...
    @abstractmethod
    def compare_set(self, key: str, expected: str, desired: str) -> bytes: ...
    @abstractmethod
    def add(self, key: str, amount: int) -> int: ...
    @abstractmethod
    def check(self, keys: list[str]) -> bool: ...
    @abstractmethod
    def multi_get(self, keys: list[str]) -> list[bytes]: ...
    @abstractmethod
    def delete_key(self, key: str) -> bool: ...
    @abstractmethod
    def num_keys(self) -> int: ...

    @abstractmethod
    def group_store(self, prefix: str) -> dist.Store:
        """A ``torch.distributed.Store`` under ``prefix`` for a process group's rendezvous."""


class TCPStoreBackend(StoreBackend):
    """torch's ``TCPStore``, every key under the job's namespace and every value sealed with the job's secret
    (module docstring; :mod:`unbroken.runtime.store_seal`)."""

    SEEN_LIMIT = 100_000
    """Authentic values remembered per client (for reads that find a forged value); cleared when exceeded."""

    def __init__(self, store: dist.TCPStore, namespace: str, timeout_s: float = 30.0, *, secret: str) -> None:
        self.store, self.ns, self.timeout_s = store, namespace, timeout_s
        self.sealer = Sealer(secret)
        # The last authentic payload this client read or wrote, per key: where its own add of a forged
        # counter goes on from (a counter only grows); never used for other keys, whose value may have been
        # deleted or replaced since.
        self._seen: dict[str, bytes] = {}
        # The raw value this client last read or wrote at a key it swaps (counters, votes): tried as the
        # current one, so a swap on a value nobody else wrote since costs one round trip.
        self._raw: dict[str, bytes | None] = {}

    def _remember(self, key: str, value: bytes, raw: bytes | None = None) -> bytes:
        if len(self._seen) >= self.SEEN_LIMIT:
            self._seen.clear()
            self._raw.clear()
        self._seen[key] = value
        if raw is not None:
            self._raw[key] = raw
        return value

    def _open(self, key: str, raw: bytes | None) -> bytes | None:
        """The authentic payload of ``raw``; a forged value is tombstoned (only if still in place)."""
        value = self.sealer.open(key, raw)
        if value is not None:
            return self._remember(key, value)
        if raw:
            self.store.compare_set(self.ns + key, raw, b"")
        return None

    def get(self, key: str) -> bytes:
        deadline = time.monotonic() + self.timeout_s
        while (value := self._open(key, self.store.get(self.ns + key))) is None:
            if time.monotonic() > deadline:
                raise dist.DistStoreError(f"no value written by this job for store key {key!r} within "
                                          f"{self.timeout_s:.0f} s")
            time.sleep(SEAL_POLL_S)
        return value

    def set(self, key: str, value: str) -> None:
        sealed = self.sealer.seal(key, value)
        self.store.set(self.ns + key, sealed)
        self._remember(key, sealed[:-NONCE_LEN - TAG_LEN])

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        value, raw = compare_set_sealed(self.store, key, self.ns + key, expected, desired, self.sealer,
                                        self._raw.get(key))
        return self._remember(key, value, raw)

    def add(self, key: str, amount: int) -> int:
        known = int(self._seen.get(key) or 0)
        value, raw = add_sealed(self.store, key, self.ns + key, amount, self.sealer, known, self._raw.get(key))
        self._remember(key, str(value).encode(), raw)
        return value

    def check(self, keys: list[str]) -> bool:
        """Every key holds an authentic value (a forged or tombstoned one is absent)."""
        if len(keys) == 1:  # one round trip
            return self._open(keys[0], present(self.store, self.ns + keys[0])) is not None
        if not self.store.check([self.ns + k for k in keys]):
            return False
        return all(self._open(k, self.store.get(self.ns + k)) is not None for k in keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        raws = self.store.multi_get([self.ns + k for k in keys])
        return [value if (value := self._open(k, raw)) is not None else self.get(k) for k, raw in zip(keys, raws)]

    def get_present(self, keys: list[str]) -> list[bytes | None]:
        """Counters (which exist from a view's publication on): a forged or tombstoned one reads as
        :data:`UNSEEN` (-1), no observation: not as gone (which would read as a lease expired), and not
        as the last authentic value (an attacker rewriting a live worker's counter faster than it beats
        would make it look silent to every reader, and fenced)."""
        raws = self.store.multi_get([self.ns + k for k in keys])
        return [value if (value := self._open(k, raw)) is not None else UNSEEN for k, raw in zip(keys, raws)]

    def delete_key(self, key: str) -> bool:
        self._seen.pop(key, None)
        self._raw.pop(key, None)
        return self.store.delete_key(self.ns + key)

    def num_keys(self) -> int:
        return self.store.num_keys()

    @property
    def port(self) -> int:
        return self.store.port

    def group_store(self, prefix: str) -> dist.Store:
        """A rendezvous store on a connection of its own.

        A ``TCPStore`` client holds one lock for a whole blocking ``wait`` or
        ``get``: a group's rendezvous on the main client would stall the
        failure detector's reads behind a member that never arrives (and a new
        view's rendezvous behind an abandoned one's). Each group gets its own
        connection, closed with the group.
        """
        client = dist.TCPStore(self.store.host, self.store.port, None, is_master=False,
                               timeout=timedelta(seconds=self.timeout_s))
        return SealedStore(dist.PrefixStore(self.ns + prefix, client), prefix + "/", self.sealer,
                           self.timeout_s)

    @classmethod
    def connect(cls, addr: str, *, timeout_s: float, secret: str) -> TCPStoreBackend:
        """A client of the store at ``HOST:PORT`` for the job of ``secret``.

        Raises:
            ValueError: ``addr`` is not ``HOST:PORT``.
            ConnectionError: nothing answered within ``timeout_s`` (says what to check).
            StoreAccessDenied: the store holds no job under this secret.
        """
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"store address {addr!r} is not HOST:PORT")
        try:
            store = dist.TCPStore(host, int(port), None, is_master=False, timeout=timedelta(seconds=timeout_s))
        except (RuntimeError, OSError) as exc:
            raise ConnectionError(
                f"store {addr} did not answer within {timeout_s:.0f} s ({str(exc).splitlines()[0]}); "
                f"is the launcher running and the address right?"
            ) from None
        try:  # the host may be between listening and writing the job's marker
            store.wait([READY_KEY], timedelta(seconds=timeout_s))
        except (RuntimeError, dist.DistStoreError):
            raise ConnectionError(f"store {addr} answered but never became ready within {timeout_s:.0f} s; "
                                  f"is it this job's store?") from None
        backend = cls(store, _namespace(secret), timeout_s, secret=secret)
        if not backend.check(["job"]):
            raise StoreAccessDenied(f"store {addr} holds no job under this secret; use the run's {SECRET_FILE} "
                                    f"file or {SECRET_ENV} of the job you mean")
        return backend

    @classmethod
    def host(cls, host: str, port: int, *, clients: int, secret: str) -> TCPStoreBackend:
        """Host the store on ``host:port`` only (0: a free port), for the job of ``secret``.

        Raises:
            ValueError: the address cannot be bound (names it and the fix).
        """
        listener = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            listener.bind((host, port))
            listener.listen(max(128, 4 * clients))
            store = dist.TCPStore(host, listener.getsockname()[1], clients + 1, is_master=True,
                                  timeout=timedelta(seconds=30), wait_for_workers=False,
                                  master_listen_fd=listener.fileno())
        except (RuntimeError, OSError) as exc:
            listener.close()
            raise ValueError(
                f"cannot listen on {host}:{port} ({exc.__class__.__name__}: {str(exc).splitlines()[0]}); "
                f"the port is probably in use: pick another with --train.port=N or 0 for a free one"
            ) from None
        listener.detach()  # the store owns the socket now (it closes it when it goes), Python must not
        backend = cls(store, _namespace(secret), secret=secret)
        backend.set("job", "1")
        store.set(READY_KEY, "1")  # last: a client that connected meanwhile now tells a wrong secret from early
        return backend
