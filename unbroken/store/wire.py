"""The embedded store's wire: a handshake that authenticates both ends with the launch's key, then frames that
each carry a MAC over their direction, their sequence number and their bytes.

Handshake (fixed sizes, nothing else is read from an unauthenticated peer)::

    server -> client   MAGIC (8) + launch id (32 hex) + server nonce (16)
    client -> server   client nonce (16) + HMAC(K, "client" | launch | nonces)        (32)
    server -> client   b"\\x01" + HMAC(K, "server" | launch | nonces)                (33), or b"\\x00": refused

``K`` is derived from the job's secret (:func:`store_key`). The client proves
it holds the secret before the server reads a single request, and the server
proves it to the client (a process that took the port cannot pose as the
job's store). Both ends then key the frames with ``HMAC(K, "session" | launch
| nonces)``: ``length (4) | payload | tag (16)``, the tag over the direction,
the frame's number in its direction and the payload, so a frame cannot be
forged, replayed, reordered or moved to another connection. A client that
pins a launch id (every process of a launch learns it from the first
connection of its agent, :data:`LAUNCH_ENV`) never talks to another launch's
store, and a process of an earlier launch never talks to this one's.

Payloads: an operation code (one byte) and a list of byte strings, each
prefixed with its length (:func:`pack`, :func:`unpack`); nothing is pickled.

Invariant: no byte of a frame is acted on before its tag is checked.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import socket
import struct

from unbroken.store.derived_keys import derive_key

__all__ = ["LAUNCH_ENV", "MAX_FRAME", "Channel", "HandshakeRefused", "OtherLaunch", "TurnedAway", "WireError",
           "client_handshake", "pack", "server_handshake", "store_key", "unpack"]

MAGIC = b"UBSTORE2"
NONCE = 16
TAG = 16
LAUNCH_LEN = 32
MAX_FRAME = 256 << 20
"""The largest payload accepted (a config, a view, a rendezvous address: kilobytes; this is only a bound)."""
LAUNCH_ENV = "UNBROKEN_STORE_LAUNCH"
"""The launch id a process's store connections must find (set by its agent for the processes it starts)."""


class WireError(ConnectionError):
    """The connection broke, timed out, or a frame failed its tag (the peer is not the job's)."""


class HandshakeRefused(WireError):
    """The other end does not hold the job's secret."""


class OtherLaunch(HandshakeRefused):
    """The store serves another launch of the job than the one this process pinned."""


class TurnedAway(WireError):
    """The store closed a new connection before its hello: as many connections as it authenticates at once
    are still authenticating (a flood, or a burst of the job's own); a later try may get in."""


def store_key(secret: str) -> bytes:
    """The key of a job's store connections, derived from its secret (never the secret itself)."""
    return derive_key(secret, b"unbroken-store-auth")


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"\0".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int, closed: type[WireError] = WireError) -> bytes:
    """``n`` bytes; ``closed`` is raised for a connection the peer closed (the others: :class:`WireError`)."""
    chunks, got = [], 0
    while got < n:
        try:
            chunk = sock.recv(n - got)
        except socket.timeout:
            raise WireError("the store did not answer in time") from None
        except OSError as exc:
            raise WireError(f"the connection to the store broke ({exc.strerror or exc})") from None
        if not chunk:
            raise closed("the store closed the connection")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


def _send(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError as exc:
        raise WireError(f"the connection to the store broke ({exc.strerror or exc})") from None


class Channel:
    """Authenticated frames over one connected socket (one request or reply at a time per direction)."""

    def __init__(self, sock: socket.socket, session: bytes, *, server: bool) -> None:
        self.sock, self.session = sock, session
        self._out, self._in = (b"s", b"c") if server else (b"c", b"s")
        self._sent = self._received = 0

    def send(self, payload: bytes) -> None:
        head = struct.pack("<I", len(payload))
        tag = _mac(self.session, self._out, struct.pack("<Q", self._sent), payload)[:TAG]
        self._sent += 1
        _send(self.sock, head + payload + tag)

    def recv(self) -> bytes:
        (n,) = struct.unpack("<I", _recv_exact(self.sock, 4))
        if n > MAX_FRAME:
            raise WireError(f"a frame of {n} bytes (more than {MAX_FRAME}): not the job's store")
        payload = _recv_exact(self.sock, n)
        tag = _recv_exact(self.sock, TAG)
        want = _mac(self.session, self._in, struct.pack("<Q", self._received), payload)[:TAG]
        if not hmac.compare_digest(tag, want):
            raise WireError("a frame failed its authentication tag (forged, replayed or reordered)")
        self._received += 1
        return payload

    def close(self) -> None:
        try:
            self.sock.close()
        except OSError:
            pass


def server_handshake(sock: socket.socket, key: bytes, launch: str) -> Channel:
    """The server's side; raises :class:`HandshakeRefused` (having told the client) for a wrong key."""
    launch_b = launch.encode()
    assert len(launch_b) == LAUNCH_LEN
    sn = os.urandom(NONCE)
    _send(sock, MAGIC + launch_b + sn)
    got = _recv_exact(sock, NONCE + 32)
    cn, proof = got[:NONCE], got[NONCE:]
    if not hmac.compare_digest(proof, _mac(key, b"client", launch_b, sn, cn)):
        try:
            sock.sendall(b"\0")
        except OSError:
            pass
        raise HandshakeRefused("a client without the job's secret")
    _send(sock, b"\1" + _mac(key, b"server", launch_b, sn, cn))
    return Channel(sock, _mac(key, b"session", launch_b, sn, cn), server=True)


def client_handshake(sock: socket.socket, key: bytes, launch: str | None) -> tuple[Channel, str]:
    """The client's side; returns the channel and the server's launch id.

    Raises:
        HandshakeRefused: the server refused this secret, proved no knowledge of it, or serves another
            launch than ``launch`` (when given).
        TurnedAway: the store closed the connection before its hello (too many still authenticating).
        WireError: not a store of this kind, or the connection broke.
    """
    hello = _recv_exact(sock, 1, closed=TurnedAway)
    hello += _recv_exact(sock, len(MAGIC) + LAUNCH_LEN + NONCE - 1)
    if hello[:len(MAGIC)] != MAGIC:
        raise WireError("the address is not an unbroken job store (or one of another version)")
    launch_b, sn = hello[len(MAGIC):len(MAGIC) + LAUNCH_LEN], hello[len(MAGIC) + LAUNCH_LEN:]
    theirs = launch_b.decode(errors="replace")
    if launch is not None and theirs != launch:
        raise OtherLaunch(f"the store serves launch {theirs}, not this process's launch {launch} (a later "
                          f"or earlier launch of the job holds the address)")
    cn = os.urandom(NONCE)
    _send(sock, cn + _mac(key, b"client", launch_b, sn, cn))
    answer = _recv_exact(sock, 1)
    if answer != b"\1":
        raise HandshakeRefused("the store refused this job secret")
    proof = _recv_exact(sock, 32)
    if not hmac.compare_digest(proof, _mac(key, b"server", launch_b, sn, cn)):
        raise HandshakeRefused("the store did not prove it holds the job's secret: another process holds the address")
    return Channel(sock, _mac(key, b"session", launch_b, sn, cn), server=False), theirs


def pack(op: int, items: list[bytes]) -> bytes:
    """One request or reply: an operation (or status) byte, then each item with its length."""
    out = bytearray([op])
    out += struct.pack("<I", len(items))
    for item in items:
        out += struct.pack("<I", len(item))
        out += item
    return bytes(out)


def unpack(payload: bytes) -> tuple[int, list[bytes]]:
    """The inverse of :func:`pack` (raises :class:`WireError` on a malformed payload)."""
    try:
        op = payload[0]
        (count,) = struct.unpack_from("<I", payload, 1)
        at, items = 5, []
        for _ in range(count):
            (n,) = struct.unpack_from("<I", payload, at)
            at += 4
            if at + n > len(payload):
                raise WireError("a truncated item")
            items.append(payload[at:at + n])
            at += n
    except (IndexError, struct.error):
        raise WireError("a malformed store message") from None
    return op, items
