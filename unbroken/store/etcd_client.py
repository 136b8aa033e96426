"""Reaching an etcd cluster: its address (``etcd[s]://HOST:PORT[,HOST:PORT...][/PREFIX]``), TLS with a client
certificate, and one client per member with failover between them (:class:`Cluster`).

:class:`~unbroken.store.etcd_backend.EtcdBackend` keeps the job's keys there through a :class:`Cluster`.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import torch.distributed as dist

try:  # an optional dependency: ``pip install unbroken[etcd]``
    from etcd3gw.client import Etcd3Client
    from etcd3gw import exceptions as etcd_exceptions
except ImportError:  # pragma: no cover - reported by EtcdBackend.connect
    Etcd3Client = None  # type: ignore[assignment,misc]
    etcd_exceptions = None  # type: ignore[assignment]

from unbroken.store.backend import ETCD_SCHEME, ETCD_TLS_ENV, ETCDS_SCHEME, is_etcd_address
from unbroken.store.latency import LatencyHistogram

__all__ = ["Cluster", "DEFAULT_PREFIX", "INSECURE_ENV", "INSECURE_FLAG", "RequestRefused", "StoreUnavailable", "check_transport",
           "is_etcd", "parse_etcd", "tls_files"]

logger = logging.getLogger(__name__)

DEFAULT_PREFIX = "/unbroken"
REQUEST_TIMEOUT_S = 1.0
"""One HTTP request to one member; past it the next member is tried (a member without quorum answers late)."""
WAIT_LOG_S = 5.0
"""While no member answers, a client says so at once and then every this many seconds."""


class StoreUnavailable(dist.DistStoreError):
    """No member of the etcd cluster answered (with quorum) within the operation's timeout."""


class RequestRefused(dist.DistStoreError):
    """A member answered that the request names a lease that expired (no other member would take it)."""


def is_etcd(addr: str) -> bool:
    return is_etcd_address(addr)


def _tls_session(tls: dict[str, str]) -> Any:
    """An HTTP session that trusts only the job's CA and shows the client's certificate. Not from the
    environment: requests lets ``REQUESTS_CA_BUNDLE`` (set on many machines) override a session's CA."""
    import requests

    session = requests.Session()
    session.trust_env = False
    session.verify = tls["ca"]
    session.cert = (tls["cert"], tls["key"])
    return session


def tls_files(addr: str) -> dict[str, str] | None:
    """The CA, certificate and key files of an ``etcds://`` address (None for ``etcd://``).

    Raises:
        ValueError: a variable of :data:`ETCD_TLS_ENV` is unset or names no readable file (says which).
    """
    if not addr.startswith(ETCDS_SCHEME):
        return None
    files, problems = {}, []
    for what, var in ETCD_TLS_ENV.items():
        path = os.environ.get(var, "")
        if not path:
            problems.append(f"{var} is not set")
        elif not os.path.isfile(path) or not os.access(path, os.R_OK):
            problems.append(f"{var}={path!r} is not a readable file")
        files[what] = path
    if problems:
        raise ValueError(f"store {addr}: TLS needs the CA, this client's certificate and its key as PEM files: "
                         f"{'; '.join(problems)}")
    return files


INSECURE_FLAG = "--store-insecure"
"""The option that lets a job use plain ``etcd://`` to a cluster on other hosts."""
INSECURE_ENV = "UNBROKEN_STORE_INSECURE"
"""Set to ``1`` by that option for the processes the job starts."""


def check_transport(addr: str, endpoints: list[tuple[str, int]], insecure: bool) -> None:
    """Plain ``etcd://`` only to this host's loopback, unless the user said ``--store-insecure``.

    Raises:
        ValueError: names the remote members, the risk and the two fixes.
    """
    if addr.startswith(ETCDS_SCHEME) or insecure or os.environ.get(INSECURE_ENV) == "1":
        return
    remote = [f"{h}:{p}" for h, p in endpoints if not _loopback(h)]
    if remote:
        raise ValueError(f"store {addr}: plain etcd:// to {', '.join(remote)} sends the job's coordination in the "
                         f"clear to a cluster anyone on the network may reach; use etcds:// with a client "
                         f"certificate ({', '.join(ETCD_TLS_ENV.values())}), or pass {INSECURE_FLAG} if the "
                         f"network is isolated")


def _loopback(host: str) -> bool:
    import ipaddress

    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse_etcd(addr: str) -> tuple[list[tuple[str, int]], str]:
    """``etcd://H:P[,H:P...][/PREFIX]`` → (endpoints, prefix without trailing slash).

    Raises:
        ValueError: the address is malformed (names it and the expected form).
    """
    scheme = ETCDS_SCHEME if addr.startswith(ETCDS_SCHEME) else ETCD_SCHEME
    body = addr[len(scheme):] if is_etcd(addr) else ""
    hosts, slash, prefix = body.partition("/")
    endpoints: list[tuple[str, int]] = []
    for part in hosts.split(",") if hosts else []:
        host, _, port = part.strip().rpartition(":")
        host = host.strip("[]")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            endpoints = []
            break
        endpoints.append((host, int(port)))
    if not endpoints:
        raise ValueError(f"store address {addr!r}: expected etcd[s]://HOST:PORT[,HOST:PORT...][/PREFIX] with each "
                         f"PORT in 1..65535, e.g. etcd://10.0.0.1:2379,10.0.0.2:2379,10.0.0.3:2379")
    prefix = "/" + prefix.strip("/") if slash and prefix.strip("/") else DEFAULT_PREFIX
    return endpoints, prefix


class Cluster:
    """HTTP clients of the cluster's members; sends a request to one member, moving on when it fails.

    While no member answers (no quorum, or all down) it keeps trying for ``store_timeout_s`` and says so:
    a warning at once, then every ``WAIT_LOG_S``. Once it gave up, the store counts as lost: later calls
    try for ``REQUEST_TIMEOUT_S`` only (the clean stop that follows must not wait the whole timeout again),
    until a call succeeds.
    """

    def __init__(self, endpoints: list[tuple[str, int]], store_timeout_s: float,
                 tls: dict[str, str] | None = None) -> None:
        if Etcd3Client is None:
            raise ValueError("an etcd:// store needs the etcd client: pip install 'unbroken[etcd]' (etcd3gw)")
        self.addrs = [f"{h}:{p}" for h, p in endpoints]
        # TLS: the members' certificates are checked against the job's CA, and this client shows its own.
        self.clients = [Etcd3Client(host=h, port=p, timeout=REQUEST_TIMEOUT_S, api_path="/v3/",
                                    **({} if tls is None else {"protocol": "https", "session": _tls_session(tls)}))
                        for h, p in endpoints]
        self.current = os.getpid() % len(self.clients)
        self.round_trips = 0
        self.seconds = 0.0  # what the calls took, failovers included
        self.latency = LatencyHistogram()  # each call's seconds (a wait for a key is a series of calls: each)
        self.store_timeout_s = store_timeout_s
        self.lost = False

    def call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        """POST ``payload`` to ``/v3/<path>`` of a live member; raises :class:`StoreUnavailable` at the deadline.
        Its seconds, from the first try to the answer or the error, are counted into :attr:`latency`."""
        t0 = time.perf_counter()
        try:
            return self._call(path, payload)
        finally:
            seconds = time.perf_counter() - t0
            self.seconds += seconds
            self.latency.add(seconds)

    def _call(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        t0 = time.monotonic()
        limit = REQUEST_TIMEOUT_S if self.lost else self.store_timeout_s
        last, tries, next_log = "", 0, 0.0
        while True:
            client = self.clients[self.current]
            try:
                self.round_trips += 1
                out = client.post(client.get_url(path), json=payload)
                if next_log and not self.lost:
                    logger.warning("etcd: %s answers again after %.1f s", self.addrs[self.current],
                                   time.monotonic() - t0)
                self.lost = False
                return out
            except etcd_exceptions.Etcd3Exception as exc:
                if any(why in str(exc.detail_text) for why in ("lease not found", "compacted")):  # every member alike
                    raise RequestRefused(f"etcd refused {path}: {str(exc.detail_text)[:200]}") from None
                last = f"{self.addrs[self.current]}: {exc.__class__.__name__} {str(exc)[:200]}"
            tries += 1
            waited = time.monotonic() - t0
            if waited > limit:
                self.lost = True
                raise StoreUnavailable(f"no etcd member answered with quorum for {waited:.0f} s (last: {last})")
            self.current = (self.current + 1) % len(self.clients)
            if tries % len(self.clients) == 0:  # every member failed once: no quorum, or all are down
                if waited >= next_log and not self.lost:
                    logger.warning("etcd: no member answers with quorum for %.0f s (last: %s); still trying, the "
                                   "job stops after %.0f s (fault.store_timeout_s)", waited, last, limit)
                    next_log = waited + WAIT_LOG_S
                time.sleep(min(0.2, max(0.0, limit - waited)))
