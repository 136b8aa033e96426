"""A client of the job's embedded store (:mod:`unbroken.store.server`), and the ``torch.distributed.Store``
the job's process groups rendezvous on.

One :class:`StoreClient` is one authenticated connection at a time (:mod:`unbroken.store.wire`), one
request at a time (a lock serialises threads). A broken connection, a store that does not answer within the
operation's timeout, or a store that went away raise ``torch.distributed.DistStoreError``, as a lost
``TCPStore`` did: the job's code treats them as the store lost. :attr:`StoreClient.round_trips` counts
requests (the benchmarks' store operations); :attr:`StoreClient.latency` holds the seconds of those that wait
for nothing (all but a ``get`` or ``wait`` of keys), a running histogram.

A connection whose request failed (no answer in time, broken mid-reply) is closed and never used again: the
late answer to that request would otherwise be read, authenticated, as the answer to the next one (the frames'
numbers follow the requests, not the answers awaited), and every answer after it would be shifted by one.
The next request opens a fresh authenticated connection to the same launch (one try: a store that refuses it
is lost, one that does not answer in time fails that request too).

Invariants: a client talks only to a store that proved it holds the job's secret, of the launch it pinned
(the first connection's, for every later one); no answer is read on a connection after one of its requests
failed.
"""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from unbroken.store.latency import LatencyHistogram
from unbroken.store.server import OK, OPS, TIMEOUT
from unbroken.store.wire import (Channel, HandshakeRefused, TurnedAway, WireError, client_handshake, pack,
                                         store_key, unpack)

__all__ = ["GroupStore", "StoreClient"]

SLACK_S = 5.0
"""A blocking request's socket waits this much longer than the wait the server was asked for."""


CONNECT_RETRY_S = (0.02, 0.5)
"""A refused connection is tried again after this long, doubling from the first value to the second: a
store's host may start after its clients (node 0 hosting the store on a cluster)."""


def _connect(host: str, port: int, timeout_s: float, *, retry: bool = True) -> socket.socket:
    """A TCP connection to ``host:port``, tried until ``timeout_s`` has passed (once if not ``retry``).

    Raises:
        ConnectionError: nothing accepted it in time (names the address and the last error).
    """
    deadline, pause = time.monotonic() + timeout_s, CONNECT_RETRY_S[0]
    while True:
        try:
            return socket.create_connection((host, port), timeout=max(0.1, deadline - time.monotonic()))
        except OSError as exc:
            if not retry or time.monotonic() + pause > deadline:
                raise ConnectionError(f"store {host}:{port} did not answer within {timeout_s:.0f} s "
                                      f"({exc.strerror or exc})") from None
            time.sleep(pause)
            pause = min(2 * pause, CONNECT_RETRY_S[1])


def _open(host: str, port: int, key: bytes, launch: str | None, timeout_s: float, *,
          retry: bool) -> tuple[Channel, str]:
    """An authenticated connection to ``host:port`` (and the launch it serves), within ``timeout_s``. A store
    that turned the connection away (too many authenticating) is tried again until then; a refused TCP
    connection too if ``retry``.

    Raises:
        HandshakeRefused: the store refused the secret, did not prove it holds it, or serves another launch.
        WireError: not the job's store, or no hello within ``timeout_s`` (TurnedAway: every try turned away).
        ConnectionError: nothing accepted a connection in time.
    """
    deadline, pause = time.monotonic() + timeout_s, CONNECT_RETRY_S[0]
    while True:
        sock = _connect(host, port, max(0.1, deadline - time.monotonic()), retry=retry)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            channel, theirs = client_handshake(sock, key, launch)
        except TurnedAway:
            sock.close()
            if time.monotonic() + pause > deadline:
                raise
            time.sleep(pause)
            pause = min(2 * pause, CONNECT_RETRY_S[1])
            continue
        except WireError:
            sock.close()
            raise
        return channel, theirs


def _b(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class StoreClient:
    """One connection to the store at ``host:port`` (module docstring).

    Raises:
        HandshakeRefused: the store refused the secret, did not prove it holds it, or serves another launch.
        ConnectionError: nothing answered within ``timeout_s``.
    """

    def __init__(self, host: str, port: int, *, secret: str, timeout_s: float, launch: str | None = None) -> None:
        self.host, self.port, self.timeout_s = host, port, timeout_s
        self._key = store_key(secret)
        self._lock = threading.Lock()
        self._closed = False
        self.round_trips = 0
        self.seconds = 0.0
        """Time spent in requests (sent to answered), summed."""
        self.latency = LatencyHistogram()
        """The seconds of each request that waits for no key (module docstring)."""
        self.reconnects = 0
        """Connections opened in place of one whose request failed (module docstring)."""
        channel, self.launch = _open(host, port, self._key, launch, timeout_s, retry=True)
        self._channel: Channel | None = channel

    def close(self) -> None:
        self._closed = True
        channel, self._channel = self._channel, None
        if channel is not None:
            channel.close()

    def _channel_for_request(self) -> Channel:
        """The open connection, or a fresh one in place of a failed one (module docstring)."""
        if self._channel is None:
            if self._closed:
                raise dist.DistStoreError(f"the connection to the job's store at {self.host}:{self.port} is closed")
            try:
                self._channel, _ = _open(self.host, self.port, self._key, self.launch, self.timeout_s, retry=False)
            except ConnectionError as exc:  # WireError and HandshakeRefused too
                raise dist.DistStoreError(f"the job's store at {self.host}:{self.port} is lost: {exc}") from None
            self.reconnects += 1
        return self._channel

    def _call(self, op: str, items: list[bytes], wait_s: float = 0.0) -> tuple[int, list[bytes]]:
        with self._lock:
            self.round_trips += 1
            t0 = time.perf_counter()
            try:
                channel = self._channel_for_request()
                channel.sock.settimeout(self.timeout_s + wait_s + (SLACK_S if wait_s else 0.0))
                channel.send(pack(OPS[op], items))
                status, reply = unpack(channel.recv())
            except WireError as exc:
                # Its answer may still come: this connection is never read again (module docstring).
                channel.close()
                if self._channel is channel:
                    self._channel = None
                raise dist.DistStoreError(f"the job's store at {self.host}:{self.port} is lost: {exc}") from None
            finally:
                seconds = time.perf_counter() - t0
                self.seconds += seconds
                if not wait_s:
                    self.latency.add(seconds)
        if status not in (OK, TIMEOUT):
            raise dist.DistStoreError(f"the job's store refused a request: {reply[0].decode(errors='replace')}")
        return status, reply

    @staticmethod
    def _ms(seconds: float) -> bytes:
        return str(max(1, int(seconds * 1000))).encode()

    # -- operations ---------------------------------------------------------------

    def set(self, key: str, value: str | bytes) -> None:
        self._call("set", [key.encode(), _b(value)])

    def get(self, key: str, timeout_s: float | None = None) -> bytes:
        """The key's value, waiting for it to exist up to ``timeout_s`` (default: the client's timeout)."""
        wait = self.timeout_s if timeout_s is None else timeout_s
        status, reply = self._call("get", [key.encode(), self._ms(wait)], wait)
        if status == TIMEOUT:
            raise dist.DistStoreError(f"store key {key!r} did not appear within {wait:.0f} s")
        return reply[0]

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self._call("cas", [key.encode(), _b(expected), _b(desired)])[1][0]

    def add(self, key: str, amount: int) -> int:
        return int(self._call("add", [key.encode(), str(int(amount)).encode()])[1][0])

    def check(self, keys: list[str]) -> bool:
        return self._call("check", [k.encode() for k in keys])[1][0] == b"1"

    def multi_get(self, keys: list[str], timeout_s: float | None = None) -> list[bytes]:
        wait = self.timeout_s if timeout_s is None else timeout_s
        status, reply = self._call("mget", [self._ms(wait), *(k.encode() for k in keys)], wait)
        if status == TIMEOUT:
            raise dist.DistStoreError(f"store keys {[k.decode() for k in reply]} did not appear within {wait:.0f} s")
        return reply

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self._call("mset", [x for k, v in zip(keys, values) for x in (k.encode(), _b(v))])

    def adds(self, pairs: list[tuple[str, int]]) -> list[int]:
        """Several counters' adds in one round trip, applied in order, atomically (the store's ``batch``)."""
        reqs = [pack(OPS["add"], [k.encode(), str(int(a)).encode()]) for k, a in pairs]
        out = []
        for raw in self._call("batch", reqs)[1]:
            status, items = unpack(raw)
            if status != OK:
                raise dist.DistStoreError(f"the job's store refused an add: {items[0].decode(errors='replace')}")
            out.append(int(items[0]))
        return out

    def peek(self, keys: list[str]) -> list[bytes | None]:
        """Each key's value, None for a missing one, in one round trip without waiting."""
        return [raw[1:] if raw[:1] == b"1" else None for raw in self._call("peek", [k.encode() for k in keys])[1]]

    def delete_key(self, key: str) -> bool:
        return self._call("delete", [key.encode()])[1][0] == b"1"

    def num_keys(self) -> int:
        return int(self._call("nkeys", [])[1][0])

    def wait(self, keys: list[str], timeout_s: float | None = None) -> None:
        wait = self.timeout_s if timeout_s is None else timeout_s
        if self._call("wait", [self._ms(wait), *(k.encode() for k in keys)], wait)[0] == TIMEOUT:
            raise dist.DistStoreError(f"store keys {keys} did not all appear within {wait:.0f} s")


class GroupStore(dist.Store):
    """A process group's rendezvous store: a connection of its own, every key under ``prefix`` (gloo and NCCL
    call it from C++; a waiting ``get`` blocks only this connection)."""

    def __init__(self, client: StoreClient, prefix: str) -> None:
        super().__init__()
        self.client, self.prefix = client, prefix

    def _k(self, key: str) -> str:
        return self.prefix + key

    def set(self, key: str, value: str | bytes) -> None:
        self.client.set(self._k(key), value)

    def get(self, key: str) -> bytes:
        return self.client.get(self._k(key))

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        self.client.wait([self._k(k) for k in keys], None if timeout is None else timeout.total_seconds())

    def check(self, keys: list[str]) -> bool:
        return self.client.check([self._k(k) for k in keys])

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self.client.multi_get([self._k(k) for k in keys])

    def multi_set(self, keys: list[str], values: list[str | bytes]) -> None:
        self.client.multi_set([self._k(k) for k in keys], values)

    def add(self, key: str, amount: int) -> int:
        return self.client.add(self._k(key), amount)

    def compare_set(self, key: str, expected: str | bytes, desired: str | bytes) -> bytes:
        return self.client.compare_set(self._k(key), expected, desired)

    def delete_key(self, key: str) -> bool:
        return self.client.delete_key(self._k(key))

    def num_keys(self) -> int:
        return self.client.num_keys()

    def set_timeout(self, timeout: timedelta) -> None:
        self.client.timeout_s = timeout.total_seconds()

    def __del__(self) -> None:
        try:
            self.client.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown: nothing to do
            pass


__all__ += ["HandshakeRefused"]
