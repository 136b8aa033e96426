"""Where the job store's keys live: the backend interface, and the job's embedded store behind it.

Access. The embedded store (:mod:`unbroken.store.server`) listens on
the job's host only (``train.host``, loopback by default) and serves only
connections that prove they hold the job's secret (:func:`job_secret`:
generated at launch, kept in ``RUN/secret`` with mode 0600, or given in
``UNBROKEN_JOB_SECRET`` for jobs spanning machines), and only to processes of
its launch: a client without the secret cannot list, read, write, delete or
add to any key, cannot join a process group (their rendezvous goes through the
store too) and so never receives the training state. A connection with a
wrong secret is refused at once (:class:`StoreAccessDenied`). An etcd cluster
(:mod:`unbroken.store.etcd_backend`) is reached with etcd's own access
control; there every key lives under a namespace derived from the secret and
every value is sealed (:mod:`unbroken.store.seal`).

Invariant: a backend serves one job; on a shared store (etcd) every key it
writes is under the job's namespace.
"""

from __future__ import annotations

import hashlib
import logging
import os
import secrets
from abc import ABC, abstractmethod
from pathlib import Path

import torch.distributed as dist

from unbroken.store.client import GroupStore, StoreClient
from unbroken.store.server import StoreServer
from unbroken.store.wire import LAUNCH_ENV, HandshakeRefused, OtherLaunch, TurnedAway, WireError

__all__ = ["ETCD_SCHEME", "ETCDS_SCHEME", "ETCD_TLS_ENV", "is_etcd_address", "SECRET_ENV", "SECRET_FILE",
           "GROUP_CONNECT_TRIES", "GroupStoreUnavailable", "StoreAccessDenied", "StoreBackend", "EmbeddedBackend",
           "job_secret", "new_secret", "save_secret"]

logger = logging.getLogger(__name__)

ETCD_SCHEME = "etcd://"
"""A store address starting so names an etcd cluster (:mod:`unbroken.store.etcd_backend`)."""
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


GROUP_CONNECT_TRIES = 3
"""Tries at a process group's rendezvous connection before its view is given up (each within the client's
timeout): a store that refused or dropped one handshake may take the next; one that refuses them all fails
the view, not the worker (:class:`GroupStoreUnavailable`)."""


class GroupStoreUnavailable(dist.DistStoreError):
    """No rendezvous connection for a view's process group in :data:`GROUP_CONNECT_TRIES` tries: the view cannot
    be formed (the step protocol moves on to a newer one, as for a member that never connected)."""


UNSEEN = b"-1"
"""What :meth:`EmbeddedBackend.get_present` reads for a missing counter: no observation (a liveness reader
treats it as a moment it could not see; a counter gone from a store with leases is no observation either:
its lease expired, or another writer deleted it, and the silence is judged on the reader's own clock)."""


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


def _namespace(secret: str) -> str:
    """The prefix of a job's keys on a shared store (etcd), derived from its secret."""
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

    def peek(self, keys: list[str]) -> list[bytes | None]:
        """The keys' values, None for a missing one, never waiting (one round trip where the store can)."""
        return [self.get(k) if self.check([k]) else None for k in keys]

    def adds(self, pairs: list[tuple[str, int]]) -> list[int]:
        """Several counters' adds (``0``: a read), in order; one round trip where the store can."""
        return [self.add(k, amount) for k, amount in pairs]

    def restore(self, key: str) -> bool:
        """Bring decision key ``key`` (``gen``, ``outcome/<g>``) back if another writer deleted it, with the
        newest decision written there; True if it holds a value now. Only a store others can write to (etcd)
        can lose one: here it is False (nothing to bring back from)."""
        return False

    def create_unless_moved(self, key: str, value: str, witness: str) -> bytes | None:
        """``key``'s value, created as ``value`` if absent, provided ``witness`` is still as this client last
        read it; None if it changed since and nothing was created. Checked in the same transaction on a store
        other writers may reach (etcd); the embedded store has no writer but the job's: its compare-and-set."""
        return self.compare_set(key, "", value)

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


class EmbeddedBackend(StoreBackend):
    """The job's embedded store (:mod:`unbroken.store.server`), reached over authenticated connections
    (:mod:`unbroken.store.client`): nobody without the secret reads or writes a key, so its values
    need no seals and it needs no namespace (it serves one launch of one job)."""

    def __init__(self, client: StoreClient, secret: str, server: StoreServer | None = None) -> None:
        """``secret``: the job's, which opens the further connections of :meth:`group_store`."""
        self.client, self._secret, self.server = client, secret, server

    @property
    def launch(self) -> str:
        """The launch id of the store (its processes pin it: :data:`~unbroken.store.wire.LAUNCH_ENV`)."""
        return self.client.launch

    @property
    def round_trips(self) -> int:
        """Requests sent so far on this connection (the benchmarks' store operations)."""
        return self.client.round_trips

    def get(self, key: str) -> bytes:
        return self.client.get(key)

    def set(self, key: str, value: str) -> None:
        self.client.set(key, value)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self.client.compare_set(key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        return self.client.add(key, amount)

    def check(self, keys: list[str]) -> bool:
        return self.client.check(keys)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.client.multi_get(keys)

    def get_present(self, keys: list[str]) -> list[bytes | None]:
        """Counters in one round trip, never waiting; a missing one reads :data:`UNSEEN` (no lease here: a
        counter is missing only before its view is published)."""
        return [UNSEEN if raw is None else raw for raw in self.client.peek(keys)]

    def peek(self, keys: list[str]) -> list[bytes | None]:
        return self.client.peek(keys)

    def adds(self, pairs: list[tuple[str, int]]) -> list[int]:
        """One round trip (the store's ``batch``)."""
        return self.client.adds(pairs)

    def delete_key(self, key: str) -> bool:
        return self.client.delete_key(key)

    def num_keys(self) -> int:
        return self.client.num_keys()

    @property
    def port(self) -> int:
        return self.client.port

    def group_store(self, prefix: str) -> dist.Store:
        """A rendezvous store on a connection of its own: a waiting ``get`` holds only its own connection, so a
        group's rendezvous never stalls the failure detector's reads (nor a new view's behind an abandoned
        one's). The connection closes with the group.

        Raises:
            GroupStoreUnavailable: no connection in :data:`GROUP_CONNECT_TRIES` tries (handshakes refused or
                broken, nothing answering).
        """
        errors = []
        for _ in range(GROUP_CONNECT_TRIES):
            try:
                client = StoreClient(self.client.host, self.client.port, secret=self._secret,
                                     timeout_s=self.client.timeout_s, launch=self.client.launch)
            except ConnectionError as exc:  # HandshakeRefused, TurnedAway, WireError: one connection's fate
                logger.warning("the rendezvous connection of %s failed (%s: %s)", prefix, type(exc).__name__, exc)
                errors.append(f"{type(exc).__name__}: {exc}")
                continue
            return GroupStore(client, prefix + "/")
        raise GroupStoreUnavailable(f"no rendezvous connection for {prefix} in {GROUP_CONNECT_TRIES} tries "
                                    f"({'; '.join(errors)})")

    def close(self) -> None:
        """Close this connection, and stop the store if this process hosts it."""
        self.client.close()
        if self.server is not None:
            self.server.close()
            self.server = None

    def __del__(self) -> None:  # the last reference to a hosted store gone: it stops, as a TCPStore did
        server = getattr(self, "server", None)
        if server is not None:
            server.close()

    @classmethod
    def connect(cls, addr: str, *, timeout_s: float, secret: str, launch: str | None = None) -> EmbeddedBackend:
        """A client of the store at ``HOST:PORT`` for the job of ``secret`` (``launch``: the launch id it must
        serve; default ``$UNBROKEN_STORE_LAUNCH``, set by an agent for the processes it starts).

        Raises:
            ValueError: ``addr`` is not ``HOST:PORT``.
            ConnectionError: nothing answered within ``timeout_s`` (says what to check).
            StoreAccessDenied: the store refused this secret, or serves another launch of the job.
        """
        host, _, port = addr.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"store address {addr!r} is not HOST:PORT")
        launch = launch or os.environ.get(LAUNCH_ENV) or None
        try:
            client = StoreClient(host.strip("[]"), int(port), secret=secret, timeout_s=timeout_s, launch=launch)
        except OtherLaunch as exc:
            raise StoreAccessDenied(f"store {addr}: {exc}") from None
        except TurnedAway as exc:
            raise ConnectionError(f"store {addr} turned every connection away for {timeout_s:.0f} s (too many "
                                  f"connections authenticating at once: {exc})") from None
        except HandshakeRefused:
            raise StoreAccessDenied(f"store {addr} holds no job under this secret (it refused this secret's proof); "
                                    f"use the run's {SECRET_FILE} file or {SECRET_ENV} of the job you mean") from None
        except WireError as exc:  # (a ConnectionError too: caught first)
            raise ConnectionError(f"store {addr} answered but is not this job's store ({exc}); is the address "
                                  f"right?") from None
        except ConnectionError as exc:
            raise ConnectionError(f"{exc}; is the launcher running and the address right?") from None
        return cls(client, secret)

    @classmethod
    def host(cls, host: str, port: int, *, clients: int, secret: str) -> EmbeddedBackend:
        """Host the store on ``host:port`` only (0: a free port), for the job of ``secret``; returns a client of
        it that also owns it (:meth:`close` stops it).

        Raises:
            ValueError: the address cannot be bound (names it and the fix).
        """
        try:
            server = StoreServer.listen(host, port, secret, backlog=max(128, 4 * clients))
        except OSError as exc:
            raise ValueError(
                f"cannot listen on {host}:{port} ({exc.__class__.__name__}: {str(exc).splitlines()[0]}); "
                f"the port is probably in use: pick another with --train.port=N or 0 for a free one"
            ) from None
        client = StoreClient(host, server.port, secret=secret, timeout_s=30.0, launch=server.launch)
        return cls(client, secret, server)
