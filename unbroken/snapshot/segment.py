"""Snapshot memory: POSIX shared-memory segments, two buffers per worker, each sealed last.

A segment is a file of the node's POSIX shared memory (``/dev/shm`` on Linux),
in the user's private folder there (:func:`segment_dir`: ``unbroken-u<uid>``,
0700, created exclusively, its type, owner and mode checked before use),
mode 0600, named ``unbroken-<job>-n<node>-w<worker>-b<buffer>``: the job id,
the node, the worker that wrote it and which of its two buffers it is
(``-r<buffer>``: the copies of other workers' optimizer shards it holds,
four buffers, :mod:`unbroken.snapshot.replicas`). It
belongs to the node's agent: it outlives the worker that wrote it and the
agent's own restarts (it is a file of memory, not a mapping of a process), and
the agent removes its node's segments when the job ends normally.

Layout of a buffer::

    [0, 8)        magic  b"UBSNAP1\\0"
    [8, 12)       seal length L (uint32 little endian; 0: not sealed)
    [12, 16)      crc32 of the seal
    [16, 48)      HMAC-SHA256 of the seal under the job's secret (zeros: written without one)
    [64, 64+L)    seal: JSON (step, generation, layout and config hashes, the
                  coding, the fragments held with their offsets and crc32)
    [HEADER, ...) payload: the state layout (JSON) then the fragments

Writing unseals the buffer first (L = 0), writes the payload, then the seal,
and the seal's length and crc last: a writer killed at any point leaves either
the old sealed content or an unsealed buffer, never a seal over torn bytes.
Every byte read back is checked against the crc32 the seal records.

Invariant: a reader never trusts a buffer whose seal is missing, torn, of
another job, not keyed with the job's secret (when the reader has it,
``$UNBROKEN_JOB_SECRET``, as every agent, worker and standby of a job does),
or whose bytes do not match their checksums; nor a file that is a link, not a
regular file, or not its user's (opened ``O_NOFOLLOW``, checked with
``fstat``); any of these is :class:`SnapshotCorrupt`, which the restore treats
as absent and reports. Writers create new segments ``O_EXCL|O_NOFOLLOW``.
"""

from __future__ import annotations

import hmac
import json
import mmap
import os
import re
import stat
import struct
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# zlib's CRC-32 (the same values), computed with the CPU's carry-less multiply at several times zlib's
# speed (and, as zlib's, outside the GIL): with zlib the checksum of every byte bounded a snapshot's write
from zlib_ng import zlib_ng

from unbroken.store.derived_keys import derive_key

__all__ = ["HEADER_BYTES", "SHM_DIR", "Buffer", "SealedBuffer", "SnapshotCorrupt", "SnapshotMemoryUnsafe", "crc32",
           "job_segments", "open_segment", "remove_segments", "segment_dir", "segment_name", "segment_path"]

SHM_DIR = Path(os.environ.get("UNBROKEN_SHM_DIR", "/dev/shm"))
"""Where POSIX shared memory lives (``/dev/shm`` on Linux)."""
MAGIC = b"UBSNAP1\0"
HEADER_BYTES = 64 << 10
"""Room for the seal; the payload starts here."""
_SEAL_AT = 64
_NAME = re.compile(r"^unbroken-(?P<job>[0-9a-f]{4,32})-n(?P<node>\d+)-w(?P<worker>\d+)-(?P<kind>[br])(?P<buffer>[0-3])$")


_MAC_AT, _MAC_LEN = 16, 32
SECRET_ENV = "UNBROKEN_JOB_SECRET"  # the same variable as unbroken.store.backend.SECRET_ENV
"""The job's secret (set by each agent for the processes it starts): the key of the seals."""


class SnapshotCorrupt(RuntimeError):
    """A sealed buffer's bytes do not match what its seal records (or the seal itself is torn, not keyed with
    the job's secret, or the file is not a regular file of this user's)."""


class SnapshotMemoryUnsafe(PermissionError):
    """The user's folder of snapshot memory is not private (a link, another owner, open to others)."""


def segment_dir() -> Path:
    """This user's private folder of snapshot memory, created (0700) if missing.

    Raises:
        SnapshotMemoryUnsafe: the name is taken by a link, a file, or a folder of another user or open to others.
    """
    uid = os.getuid()
    path = SHM_DIR / f"unbroken-u{uid}"
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != uid or st.st_mode & 0o077:
        raise SnapshotMemoryUnsafe(
            f"{path} is not a private folder of user {uid} (a link, another owner's, or open to others: mode "
            f"{stat.S_IMODE(st.st_mode):o}); snapshot memory is not kept there: remove it (or set UNBROKEN_SHM_DIR)")
    return path


def segment_path(name: str) -> Path:
    """Where the segment ``name`` lives (see :func:`segment_dir`)."""
    return segment_dir() / name


def _seal_key() -> bytes | None:
    secret = os.environ.get(SECRET_ENV)
    return derive_key(secret, b"unbroken-snapshot-seal") if secret else None


def _open_own(path: Path, flags: int) -> int:
    """``os.open`` that never follows a link and accepts only a regular file of this user's.

    Raises:
        SnapshotCorrupt: a link, not a regular file, another user's, or unreadable.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW)
    except FileNotFoundError:
        raise
    except OSError as exc:  # ELOOP (a link), EACCES (mode 000 by someone else), ...
        raise SnapshotCorrupt(f"{path.name}: cannot be opened safely ({exc.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
        os.close(fd)
        raise SnapshotCorrupt(f"{path.name}: not a regular file of user {os.getuid()} (owner {st.st_uid})")
    return fd


def open_segment(path: Path) -> int:
    """A read-only descriptor of the segment at ``path``, opened as snapshot memory always is (never through a
    link; only a regular file of this user's).

    Raises:
        FileNotFoundError: there is no such segment.
        SnapshotCorrupt: a link, not a regular file, another user's, or unreadable.
    """
    return _open_own(path, os.O_RDONLY)


def segment_name(job: str, node: int, worker: int, buffer: int, kind: str = "b") -> str:
    """``kind``: ``b`` a snapshot buffer, ``r`` a buffer of shard replicas."""
    return f"unbroken-{job}-n{node}-w{worker}-{kind}{buffer}"


def job_segments(job: str, node: int | None = None, kind: str | None = "b") -> list[Path]:
    """The segments of ``job`` (of one node, if given; of one kind, None: all) in shared memory, sorted by name."""
    out = []
    for path in segment_dir().glob(f"unbroken-{job}-n*"):
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
        except OSError:  # gone already, or not removable: never fails the end of a job
            pass
    return n


def crc32(data: bytes | memoryview) -> int:
    """The checksum every sealed byte is checked against."""
    return zlib_ng.crc32(data) & 0xFFFFFFFF


TOUCH_BYTES = 256 << 20
"""Bytes of a buffer reserved, or mapped, between two looks at the ``stop`` of :meth:`Buffer.reserve` (about
0.2 s)."""


def _touch(mem: mmap.mmap, stop: threading.Event | None = None) -> None:
    """Map every page of ``mem`` now, its contents untouched (it may hold a sealed snapshot), so that the
    first write does not fault its way through them: one read per page, by numpy, outside the GIL. Once
    ``stop`` is set, the pages left are not touched (their first write maps them).

    ``MAP_POPULATE`` (and ``madvise(MADV_POPULATE_WRITE)``) did the same about 25 % faster, but Python 3.11
    holds the GIL through the ``mmap`` call: 0.7 s per GB during which the training thread could not run
    (about 10 s for a 16 GB share on a GPU host).
    """
    pages = np.frombuffer(mem, dtype=np.uint8)[::mmap.PAGESIZE]
    per = TOUCH_BYTES // mmap.PAGESIZE
    for at in range(0, len(pages), per):
        if stop is not None and stop.is_set():
            break
        pages[at:at + per].max()
    del pages  # no view of the mapping outlives this call (close() refuses while one exists)


class Buffer:
    """One buffer of one worker, opened for writing (created or grown as needed)."""

    def __init__(self, job: str, node: int, worker: int, buffer: int, kind: str = "b") -> None:
        self.path = segment_path(segment_name(job, node, worker, buffer, kind))
        self._fd: int | None = None
        self._map: mmap.mmap | None = None
        self.mapped = False
        """Whether the last :meth:`begin` (or :meth:`reserve`) mapped the segment: reserving and first touching
        its pages (about 0.7 s per GB on one core) was part of that write."""

    @property
    def is_mapped(self) -> bool:
        return self._map is not None

    def reserve(self, size: int, stop: threading.Event | None = None) -> None:
        """Map the segment with room for ``size`` payload bytes now (its pages reserved and touched), so that
        a write of that size into it later costs only the write. Setting ``stop`` (the worker is closing: the
        buffer may never be written) ends the reserving and touching early."""
        self._open(size, stop)

    def _open(self, size: int, stop: threading.Event | None = None) -> mmap.mmap:
        """Map the segment with room for ``size`` payload bytes, growing it in place: what it holds (a sealed
        snapshot, perhaps the newest) stays readable until :meth:`begin` unseals it."""
        total = HEADER_BYTES + size
        self.mapped = False
        if self._map is not None and len(self._map) >= total:
            return self._map
        self.close()
        self.mapped = True
        try:
            # Grown in place, never replaced: this buffer may hold the newest sealed snapshot (the other
            # buffer mapped ahead of a write, after a restore whose plan made every share larger).
            fd = _open_own(self.path, os.O_RDWR)
        except (FileNotFoundError, SnapshotCorrupt):
            self.path.unlink(missing_ok=True)  # not ours or not a file: replaced by a new one (the folder is private)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            for at in range(os.fstat(fd).st_size, total, TOUCH_BYTES):
                # reserve now: a full /dev/shm fails here, not on a page fault
                os.posix_fallocate(fd, at, min(TOUCH_BYTES, total - at))
                if stop is not None and stop.is_set():
                    break  # mapped short: a write into it grows it
            self._fd, self._map = fd, mmap.mmap(fd, os.fstat(fd).st_size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        _touch(self._map, stop)
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
        key = _seal_key()
        mem[_MAC_AT:_MAC_AT + _MAC_LEN] = hmac.digest(key, raw, "sha256") if key else bytes(_MAC_LEN)
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
    authenticated: bool = False
    """Its seal's HMAC was checked with the job's secret (the reader has it): the seal is the job's own."""

    @classmethod
    def open(cls, path: Path, job: str) -> SealedBuffer | None:
        """The buffer's seal, or None when it is not sealed (never written, or a write was interrupted).

        Raises:
            SnapshotCorrupt: a seal that is torn or names another job.
        """
        with os.fdopen(_open_own(path, os.O_RDONLY), "rb") as fh:
            head = fh.read(_SEAL_AT)
            if len(head) < _SEAL_AT or head[0:8] != MAGIC:
                return None
            length, crc = struct.unpack("<II", head[8:16])
            if length == 0:
                return None
            raw = fh.read(min(length, HEADER_BYTES))
        if length > HEADER_BYTES - _SEAL_AT or len(raw) != length or crc32(raw) != crc:
            raise SnapshotCorrupt(f"{path.name}: the seal is torn (length {length}, checksum mismatch)")
        key = _seal_key()
        if key is not None and not hmac.compare_digest(head[_MAC_AT:_MAC_AT + _MAC_LEN],
                                                       hmac.digest(key, raw, "sha256")):
            raise SnapshotCorrupt(f"{path.name}: not sealed with this job's secret")
        try:
            seal = json.loads(raw)
        except ValueError:
            raise SnapshotCorrupt(f"{path.name}: the seal is not JSON") from None
        if not isinstance(seal, dict):
            raise SnapshotCorrupt(f"{path.name}: the seal is not a JSON object")
        if seal.get("job") != job:
            raise SnapshotCorrupt(f"{path.name}: sealed by job {seal.get('job')!r}, not {job!r}")
        return cls(path, seal, authenticated=key is not None)

    def read(self, offset: int, length: int, crc: int) -> bytes:
        """Payload bytes ``[offset, offset+length)``, checked against ``crc``.

        Raises:
            SnapshotCorrupt: the bytes changed since they were sealed (or the segment is gone or short).
        """
        try:
            with os.fdopen(_open_own(self.path, os.O_RDONLY), "rb") as fh:
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

    def ranges(self) -> list[tuple[int, int, int]]:
        """Every payload range the seal describes, ``(offset, length, crc)``: the layout, the fragments, the
        headers kept with parity."""
        s = self.seal
        return [(int(s["layout_offset"]), int(s["layout_len"]), int(s["layout_crc"]))] + [
            (int(offset), int(length), int(crc)) for _, _, offset, length, crc in s["fragments"]] + [
            (int(offset), int(length), int(crc)) for _, offset, length, crc in s.get("headers", [])]

