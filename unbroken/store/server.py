"""The job's embedded store: a key-value server that serves only the processes holding the job's secret.

Hosted by the launcher (or node 0's agent) on the job's host only, as torch's
``TCPStore`` was, with the operations the job uses and ``TCPStore``'s
semantics for them (a ``get`` of a missing key waits for it; a
compare-and-set on a missing key with a non-empty expected value echoes it
and creates nothing; counters are decimal text). What ``TCPStore`` lacks is
the reason it exists: every connection is authenticated before anything is
read (:mod:`unbroken.store.wire`), so whoever reaches the port without
the secret can neither list, read, write, delete, add to nor roll back any
key; they can only open connections that are refused.

A connection is one thread of the server. Requests are answered in order; a
waiting ``get`` or ``wait`` blocks only its own connection (the job gives
each process group's rendezvous a connection of its own). ``BATCH`` runs
several non-blocking operations in one round trip, in order, atomically
with respect to other clients.

Invariants: the store holds one launch of one job (a new launch is a new
server, with a new launch id); a refused or broken connection changes
nothing; unauthenticated connections are bounded (``MAX_PENDING``), each for
``HANDSHAKE_S`` at most, and one admitted to authenticate is never dropped for
another: past the bound the newest is turned away (closed before the hello),
never a pending one. Nothing tells an outsider's idle connection from a job's
slow one before its proof arrives, so any rule that drops a pending connection
lets a flood drop the job's own mid-handshake; a connection turned away at the
door is one the job's client tries again (:class:`~unbroken.store.wire.TurnedAway`),
as it does a full backlog.
"""

from __future__ import annotations

import logging
import secrets
import socket
import threading
import time
from typing import Callable

from unbroken.store.wire import (Channel, HandshakeRefused, WireError, pack, server_handshake, store_key,
                                         unpack)

__all__ = ["OPS", "StoreServer"]

logger = logging.getLogger(__name__)

OPS = {"set": 1, "get": 2, "cas": 3, "add": 4, "check": 5, "mget": 6, "mset": 7, "delete": 8, "nkeys": 9,
       "wait": 10, "peek": 11, "batch": 12}
"""Operation codes of a request's first byte."""
OK, TIMEOUT, ERROR = 0, 1, 2
"""Status codes of a reply's first byte."""
HANDSHAKE_S = 5.0
"""How long a new connection may take to authenticate."""
MAX_PENDING = 64
"""Connections still authenticating at once; past it a new one is turned away (module docstring)."""


class StoreServer:
    """The store (module docstring), listening on ``sock`` (bound and listening) for the job of ``secret``."""

    def __init__(self, sock: socket.socket, secret: str) -> None:
        self.sock, self.key = sock, store_key(secret)
        self.launch = secrets.token_hex(16)
        """This launch's id (every client finds it in the handshake; a process of the launch pins it)."""
        self.port: int = sock.getsockname()[1]
        self.refused = 0
        """Connections refused so far (they did not hold the secret)."""
        self.turned_away = 0
        """Connections closed before their hello so far (:data:`MAX_PENDING` were authenticating)."""
        self._data: dict[str, bytes] = {}
        self._changed = threading.Condition()
        self._pending: set[socket.socket] = set()  # connections still authenticating
        self._conns: set[socket.socket] = set()
        self._closed = threading.Event()
        self._ops: dict[int, Callable[[list[bytes]], tuple[int, list[bytes]]]] = {
            OPS["set"]: self._set, OPS["get"]: self._get, OPS["cas"]: self._cas, OPS["add"]: self._add,
            OPS["check"]: self._check, OPS["mget"]: self._mget, OPS["mset"]: self._mset,
            OPS["delete"]: self._delete, OPS["nkeys"]: self._nkeys, OPS["wait"]: self._wait,
            OPS["peek"]: self._peek, OPS["batch"]: self._batch}
        self._thread = threading.Thread(target=self._accept, name="store-accept", daemon=True)
        self._thread.start()

    @classmethod
    def listen(cls, host: str, port: int, secret: str, backlog: int = 128) -> StoreServer:
        """A server on ``host:port`` (0: a free port). Raises OSError when the address cannot be bound."""
        sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
            sock.listen(backlog)
        except OSError:
            sock.close()
            raise
        return cls(sock, secret)

    def close(self) -> None:
        """Stop serving: the listening socket and every connection close (clients see the store lost)."""
        self._closed.set()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        with self._changed:
            conns = list(self._conns)
            self._changed.notify_all()
        for c in conns:
            try:
                c.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            c.close()
        self._thread.join(timeout=5)

    def num_keys(self) -> int:
        with self._changed:
            return len(self._data)

    # -- connections -------------------------------------------------------------

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            with self._changed:
                full = len(self._pending) >= MAX_PENDING
                if not full:
                    self._pending.add(conn)
            if full:  # the newest goes, never one already authenticating (module docstring)
                self.turned_away += 1
                conn.close()
                if self.turned_away == 1 or self.turned_away % 1000 == 0:
                    logger.warning("the job's store turned away %d connection(s): %d were still authenticating",
                                   self.turned_away, MAX_PENDING)
                continue
            threading.Thread(target=self._serve, args=(conn,), name="store-conn", daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.settimeout(HANDSHAKE_S)
            try:
                channel = server_handshake(conn, self.key, self.launch)
            except HandshakeRefused:
                self.refused += 1
                if self.refused == 1 or self.refused % 1000 == 0:
                    logger.warning("the job's store refused %d connection(s) without the job's secret", self.refused)
                return
            except WireError:
                return
            finally:
                with self._changed:
                    self._pending.discard(conn)
            conn.settimeout(None)
            with self._changed:
                if self._closed.is_set():
                    return
                self._conns.add(conn)
            self._loop(channel)
        finally:
            with self._changed:
                self._conns.discard(conn)
            conn.close()

    def _loop(self, channel: Channel) -> None:
        while not self._closed.is_set():
            try:
                op, items = unpack(channel.recv())
                status, reply = self._answer(op, items)
                channel.send(pack(status, reply))
            except WireError:
                return

    def _answer(self, op: int, items: list[bytes]) -> tuple[int, list[bytes]]:
        handler = self._ops.get(op)
        if handler is None:
            return ERROR, [f"unknown operation {op}".encode()]
        try:
            return handler(items)
        except (ValueError, IndexError, UnicodeDecodeError) as exc:
            return ERROR, [f"malformed request: {exc}".encode()]

    # -- operations (TCPStore's semantics) ---------------------------------------

    def _set(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        with self._changed:
            self._data[items[0].decode()] = items[1]
            self._changed.notify_all()
        return OK, []

    def _until(self, keys: list[str], timeout_ms: bytes) -> bool:
        """Wait (holding the condition) until every key exists; False on timeout or close."""
        deadline = time.monotonic() + int(timeout_ms) / 1000
        while not all(k in self._data for k in keys):
            left = deadline - time.monotonic()
            if left <= 0 or self._closed.is_set():
                return False
            self._changed.wait(min(left, 1.0))
        return True

    def _get(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        key = items[0].decode()
        with self._changed:
            if not self._until([key], items[1]):
                return TIMEOUT, [key.encode()]
            return OK, [self._data[key]]

    def _cas(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        key, expected, desired = items[0].decode(), items[1], items[2]
        with self._changed:
            current = self._data.get(key)
            if current is None:
                if expected:
                    return OK, [expected]
                self._data[key] = desired
                self._changed.notify_all()
                return OK, [desired]
            if current == expected:
                self._data[key] = desired
                self._changed.notify_all()
                return OK, [desired]
            return OK, [current]

    def _add(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        key, amount = items[0].decode(), int(items[1])
        with self._changed:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            self._changed.notify_all()
            return OK, [str(value).encode()]

    def _check(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        with self._changed:
            return OK, [b"1" if all(k.decode() in self._data for k in items) else b"0"]

    def _mget(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        keys = [k.decode() for k in items[1:]]
        with self._changed:
            if not self._until(keys, items[0]):
                return TIMEOUT, [k for k in items[1:] if k.decode() not in self._data]
            return OK, [self._data[k] for k in keys]

    def _mset(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        with self._changed:
            for k, v in zip(items[0::2], items[1::2]):
                self._data[k.decode()] = v
            self._changed.notify_all()
        return OK, []

    def _delete(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        with self._changed:
            found = self._data.pop(items[0].decode(), None) is not None
            self._changed.notify_all()
        return OK, [b"1" if found else b"0"]

    def _nkeys(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        with self._changed:
            return OK, [str(len(self._data)).encode()]

    def _wait(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        keys = [k.decode() for k in items[1:]]
        with self._changed:
            return (OK, []) if self._until(keys, items[0]) else (TIMEOUT, [])

    def _peek(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        """Each key's value prefixed with ``1``, or ``0`` for a missing key (never waits)."""
        with self._changed:
            return OK, [b"1" + v if (v := self._data.get(k.decode())) is not None else b"0" for k in items]

    def _batch(self, items: list[bytes]) -> tuple[int, list[bytes]]:
        """Several non-blocking requests (each a packed request), answered in order, as one step."""
        out = []
        with self._changed:  # a reentrant lock: the handlers take it again; other clients wait for the batch
            for raw in items:
                op, sub = unpack(raw)
                if op in (OPS["get"], OPS["mget"], OPS["wait"], OPS["batch"]):
                    out.append(pack(ERROR, [b"a batch holds no blocking operation"]))
                    continue
                out.append(pack(*self._answer(op, sub)))
        return OK, out
