"""A real etcd cluster on loopback, for tests, benchmarks and the demo of store-member loss.

:class:`LocalEtcd` starts ``members`` etcd processes (the ``etcd`` binary of the
``etcd-server`` package, found on ``PATH`` or in ``$UNBROKEN_ETCD``) on free
loopback ports, with data directories under one temporary directory, and
stops them all and removes that directory on :meth:`LocalEtcd.stop` (also as a
context manager). Elections are tuned short (50 ms heartbeats, 500 ms election
timeout) so that the loss of the leader costs well under a second, and history
is compacted to the last 10,000 revisions (every put is a revision: an etcd
serving a job must auto-compact, or its database grows with every heartbeat).

The members' pids are written to ``<dir>/pids.json`` (``{"0": pid, ...}``):
``store=I`` faults read it through ``UNBROKEN_STORE_PIDS`` to kill member ``I``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import requests

__all__ = ["ETCD_ENV", "EtcdNotFound", "LocalEtcd", "etcd_binary", "free_ports"]

logger = logging.getLogger(__name__)

ETCD_ENV = "UNBROKEN_ETCD"
"""Path of the etcd binary, if it is not on ``PATH``."""
START_TIMEOUT_S = 30.0
STOP_TIMEOUT_S = 10.0


class EtcdNotFound(RuntimeError):
    """No etcd binary: install the ``etcd-server`` package (scripts/setup.sh does) or set ``UNBROKEN_ETCD``."""


def etcd_binary() -> str:
    """The etcd binary's path.

    Raises:
        EtcdNotFound: neither ``$UNBROKEN_ETCD`` nor ``etcd`` on ``PATH`` (says how to install it).
    """
    path = os.environ.get(ETCD_ENV) or shutil.which("etcd")
    if not path or not os.access(path, os.X_OK):
        raise EtcdNotFound(f"no etcd binary (${ETCD_ENV} unset and no etcd on PATH): install it with "
                           f"'apt-get install etcd-server' (scripts/setup.sh does, as root) or set {ETCD_ENV}")
    return path


def free_ports(n: int) -> list[int]:
    """``n`` ports free on loopback now."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class LocalEtcd:
    """``members`` etcd processes on loopback forming one cluster (module docstring)."""

    def __init__(self, members: int = 3, *, workdir: Path | None = None) -> None:
        if members < 1:
            raise ValueError(f"members={members}: need at least 1")
        self.binary = etcd_binary()
        self.dir = Path(tempfile.mkdtemp(prefix="unbroken-etcd-", dir=workdir))
        ports = free_ports(2 * members)
        self.client_ports, self.peer_ports = ports[:members], ports[members:]
        self.names = [f"m{i}" for i in range(members)]
        self.procs: list[subprocess.Popen[bytes] | None] = [None] * members
        self.token = f"unbroken-{os.getpid()}-{self.client_ports[0]}"
        try:
            for i in range(members):
                self.start_member(i, state="new")
            self.wait_healthy(range(members), START_TIMEOUT_S)
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        """The ``--store`` address of the cluster."""
        return "etcd://" + ",".join(f"127.0.0.1:{p}" for p in self.client_ports)

    @property
    def pids_file(self) -> Path:
        return self.dir / "pids.json"

    def start_member(self, i: int, *, state: str = "existing") -> None:
        """Start member ``i`` (again: ``state="existing"`` rejoins with its data directory)."""
        cluster = ",".join(f"{n}=http://127.0.0.1:{p}" for n, p in zip(self.names, self.peer_ports))
        client, peer = f"http://127.0.0.1:{self.client_ports[i]}", f"http://127.0.0.1:{self.peer_ports[i]}"
        cmd = [self.binary, "--name", self.names[i], "--data-dir", str(self.dir / self.names[i]),
               "--listen-client-urls", client, "--advertise-client-urls", client,
               "--listen-peer-urls", peer, "--initial-advertise-peer-urls", peer,
               "--initial-cluster", cluster, "--initial-cluster-state", state,
               "--initial-cluster-token", self.token, "--heartbeat-interval", "50", "--election-timeout", "500",
               "--auto-compaction-mode", "revision", "--auto-compaction-retention", "10000",
               "--logger", "zap", "--log-outputs", str(self.dir / f"{self.names[i]}.log")]
        self.procs[i] = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.DEVNULL, start_new_session=True)
        self._write_pids()

    def _write_pids(self) -> None:
        pids = {str(i): p.pid for i, p in enumerate(self.procs) if p is not None and p.poll() is None}
        tmp = self.pids_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(pids))
        os.replace(tmp, self.pids_file)

    def healthy(self, i: int) -> bool:
        try:
            r = requests.get(f"http://127.0.0.1:{self.client_ports[i]}/health", timeout=1.0)
            return r.ok and r.json().get("health") == "true"
        except (requests.RequestException, ValueError):
            return False

    def leader(self) -> int:
        """The index of the member that leads now (asked of each live member).

        Raises:
            RuntimeError: no live member knows a leader.
        """
        for i, proc in enumerate(self.procs):
            if proc is None or proc.poll() is not None:
                continue
            try:
                status = requests.post(f"http://127.0.0.1:{self.client_ports[i]}/v3/maintenance/status", json={},
                                       timeout=1.0).json()
            except (requests.RequestException, ValueError):
                continue
            if status.get("leader") and status.get("header", {}).get("member_id") == status["leader"]:
                return i
        raise RuntimeError("no etcd member of the cluster reports being the leader")

    def wait_healthy(self, members: range | list[int], timeout_s: float) -> None:
        """Wait until each of ``members`` reports healthy (it has a leader and quorum).

        Raises:
            TimeoutError: one did not within ``timeout_s`` (names its log file).
        """
        deadline = time.monotonic() + timeout_s
        for i in members:
            while not self.healthy(i):
                proc = self.procs[i]
                if proc is None or proc.poll() is not None or time.monotonic() > deadline:
                    raise TimeoutError(f"etcd member {i} not healthy within {timeout_s:.0f} s; see "
                                       f"{self.dir / (self.names[i] + '.log')}")
                time.sleep(0.05)

    def kill(self, i: int) -> None:
        """SIGKILL member ``i`` (a lost machine) and reap it."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(STOP_TIMEOUT_S)
        self._write_pids()

    def restart_member(self, i: int, timeout_s: float = START_TIMEOUT_S) -> None:
        """Bring member ``i`` back (killed if it still runs) with its data, and wait for the cluster's health."""
        self.kill(i)
        self.start_member(i)
        self.wait_healthy(range(len(self.procs)), timeout_s)

    def stop(self) -> None:
        """Stop every member and remove the data directory: nothing left behind.

        SIGKILL, not SIGTERM: the data goes with the directory, and a graceful stop would only spend seconds
        handing leadership over."""
        for proc in self.procs:
            if proc is not None and proc.poll() is None:
                proc.kill()
        for i, proc in enumerate(self.procs):
            if proc is None:
                continue
            try:
                proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(STOP_TIMEOUT_S)
            self.procs[i] = None
        shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> LocalEtcd:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
