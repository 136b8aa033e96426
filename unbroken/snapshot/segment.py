"""Snapshot memory: POSIX shared-memory segments, two buffers per worker, each sealed last.

A segment is a file of the node's POSIX shared memory (``/dev/shm`` on Linux),
mode 0600, named ``unbroken-<job>-n<node>-w<worker>-b<buffer>``: the job id,
the node, the worker that wrote it and which of its two buffers it is
(``-r<buffer>``: the copies of other workers' optimizer shards it holds,
:mod:`unbroken.sharding.replicas`). It
belongs to the node's agent: it outlives the worker that wrote it and the
agent's own restarts (it is a file of memory, not a mapping of a process), and
the agent removes its node's segments when the job ends normally.

Layout of a buffer::

    [0, 8)        magic  b"UBSNAP1\\0"
    [8, 12)       seal length L (uint32 little endian; 0: not sealed)
    [12, 16)      crc32 of the seal
    [64, 64+L)    seal: JSON (step, generation, layout and config hashes, the
                  coding, the fragments held with their offsets and crc32)
    [HEADER, ...) payload: the state layout (JSON) then the fragments

Writing unseals the buffer first (L = 0), writes the payload, then the seal,
and the seal's length and crc last: a writer killed at any point leaves either
the old sealed content or an unsealed buffer, never a seal over torn bytes.
Every byte read back is checked against the crc32 the seal records.

Invariant: a reader never trusts a buffer whose seal is missing, torn, of
another job, or whose bytes do not match their checksums
(:class:`SnapshotCorrupt` says which).
"""

from __future__ import annotations

import json
import mmap
import os
import re
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["HEADER_BYTES", "SHM_DIR", "Buffer", "SealedBuffer", "SnapshotCorrupt", "crc32", "job_segments",
           "remove_segments", "segment_name"]

SHM_DIR = Path(os.environ.get("UNBROKEN_SHM_DIR", "/dev/shm"))
"""Where POSIX shared memory lives (``/dev/shm`` on Linux)."""
MAGIC = b"UBSNAP1\0"
HEADER_BYTES = 64 << 10
"""Room for the seal; the payload starts here."""
_SEAL_AT = 64
_NAME = re.compile(r"^unbroken-(?P<job>[0-9a-f]{4,32})-n(?P<node>\d+)-w(?P<worker>\d+)-(?P<kind>[br])(?P<buffer>[01])$")


class SnapshotCorrupt(RuntimeError):
    """A sealed buffer's bytes do not match what its seal records (or the seal itself is torn)."""


def segment_name(job: str, node: int, worker: int, buffer: int, kind: str = "b") -> str:
    """``kind``: ``b`` a snapshot buffer, ``r`` a buffer of shard replicas."""
    return f"unbroken-{job}-n{node}-w{worker}-{kind}{buffer}"


def job_segments(job: str, node: int | None = None, kind: str | None = "b") -> list[Path]:
    """The segments of ``job`` (of one node, if given; of one kind, None: all) in shared memory, sorted by name."""
    out = []
    for path in SHM_DIR.glob(f"unbroken-{job}-n*"):
        m = _NAME.match(path.name)
        if m and m["job"] == job and (node is None or int(m["node"]) == node) and kind in (None, m["kind"]):
            out.append(path)
    return sorted(out)


def remove_segments(job: str, node: int | None = None) -> int:
    """Unlink the segments of ``job`` (of one node, if given); returns how many."""
    n = 0
    for path in job_segments(job, node, kind=None):
        try:
            path.unlink()
            n += 1
        except FileNotFoundError:
            pass
    return n


def crc32(data: bytes | memoryview) -> int:
    """The checksum every sealed byte is checked against."""
    return zlib.crc32(data) & 0xFFFFFFFF


class Buffer:
    """One buffer of one worker, opened for writing (created or grown as needed)."""

    def __init__(self, job: str, node: int, worker: int, buffer: int, kind: str = "b") -> None:
        self.path = SHM_DIR / segment_name(job, node, worker, buffer, kind)
        self._fd: int | None = None
        self._map: mmap.mmap | None = None

    def _open(self, size: int) -> mmap.mmap:
        """Map the segment with room for ``size`` payload bytes (a fresh segment if it must grow)."""
        total = HEADER_BYTES + size
        if self._map is not None and len(self._map) >= total:
            return self._map
        self.close()
        if self.path.exists() and self.path.stat().st_size < total:
            self.path.unlink()  # growing: this buffer is being rewritten anyway (the other holds the last snapshot)
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            if os.fstat(fd).st_size < total:
                os.posix_fallocate(fd, 0, total)  # reserve now: a full /dev/shm fails here, not on a page fault
            self._fd, self._map = fd, mmap.mmap(fd, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            raise
        return self._map

    def begin(self, size: int) -> memoryview:
        """Unseal the buffer and return its payload area (at least ``size`` bytes) to fill."""
        mem = self._open(size)
        mem[0:8] = MAGIC
        mem[8:16] = b"\0" * 8  # unsealed from here until seal()
        return memoryview(mem)[HEADER_BYTES:HEADER_BYTES + size]

    def seal(self, seal: dict[str, Any]) -> None:
        """Write the seal (last): from now on readers trust the payload it describes."""
        mem = self._map
        assert mem is not None, "seal() without begin()"
        raw = json.dumps(seal, separators=(",", ":")).encode()
        if _SEAL_AT + len(raw) > HEADER_BYTES:
            raise ValueError(f"snapshot seal of {len(raw)} bytes does not fit the {HEADER_BYTES}-byte header")
        mem[_SEAL_AT:_SEAL_AT + len(raw)] = raw
        mem[8:16] = struct.pack("<II", len(raw), crc32(raw))

    def close(self) -> None:
        if self._map is not None:
            self._map.close()
            self._map = None
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


@dataclass
class SealedBuffer:
    """A sealed buffer found in shared memory: its seal, and its bytes on demand (checked)."""

    path: Path
    seal: dict[str, Any]

    @classmethod
    def open(cls, path: Path, job: str) -> SealedBuffer | None:
        """The buffer's seal, or None when it is not sealed (never written, or a write was interrupted).

        Raises:
            SnapshotCorrupt: a seal that is torn or names another job.
        """
        with path.open("rb") as fh:
            head = fh.read(_SEAL_AT)
            if len(head) < 16 or head[0:8] != MAGIC:
                return None
            length, crc = struct.unpack("<II", head[8:16])
            if length == 0:
                return None
            raw = fh.read(length)
        if length > HEADER_BYTES - _SEAL_AT or len(raw) != length or crc32(raw) != crc:
            raise SnapshotCorrupt(f"{path.name}: the seal is torn (length {length}, checksum mismatch)")
        seal = json.loads(raw)
        if seal.get("job") != job:
            raise SnapshotCorrupt(f"{path.name}: sealed by job {seal.get('job')!r}, not {job!r}")
        return cls(path, seal)

    def read(self, offset: int, length: int, crc: int) -> bytes:
        """Payload bytes ``[offset, offset+length)``, checked against ``crc``.

        Raises:
            SnapshotCorrupt: the bytes changed since they were sealed (or the segment is gone or short).
        """
        try:
            with self.path.open("rb") as fh:
                fh.seek(HEADER_BYTES + offset)
                data = fh.read(length)
        except FileNotFoundError:
            raise SnapshotCorrupt(f"{self.path.name}: removed while being read") from None
        if len(data) != length or crc32(data) != crc:
            raise SnapshotCorrupt(f"{self.path.name}: bytes [{offset}, {offset + length}) do not match their "
                                  f"checksum (step {self.seal.get('step')})")
        return data

    def layout(self) -> list[list]:
        s = self.seal
        return json.loads(self.read(s["layout_offset"], s["layout_len"], s["layout_crc"]))

    def fragment(self, stripe: int, frag: int) -> bytes:
        for st, fr, offset, length, crc in self.seal["fragments"]:
            if st == stripe and fr == frag:
                return self.read(offset, length, crc)
        raise KeyError(f"{self.path.name} holds no fragment {frag} of stripe {stripe}")

    def headers(self, stripe: int) -> bytes | None:
        """The data fragments' headers a parity holder kept for ``stripe`` (None: it kept none)."""
        for st, offset, length, crc in self.seal.get("headers", []):
            if st == stripe:
                return self.read(offset, length, crc)
        return None

    def verify(self) -> None:
        """Check every byte the seal describes (raises :class:`SnapshotCorrupt`)."""
        self.layout()
        for st, fr, *_ in self.seal["fragments"]:
            self.fragment(st, fr)
        for st, *_ in self.seal.get("headers", []):
            self.headers(st)

