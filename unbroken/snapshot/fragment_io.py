"""Snapshot memory at memory speed: fragments checked, and loaded into the live tensors, by several threads.

Two uses, one way of cutting the work:

- :func:`verify_ranges` (an agent's inventory, a joiner's): the checksum of
  every byte range a seal describes, over a read-only memory map of the
  segment (no copy at all), in pieces of :data:`PIECE_BYTES` spread over
  threads;
- :func:`load_fragments` (a restore): data fragments straight into the
  tensors they belong to. Data fragment ``i`` of stripe ``[lo, hi)`` *is*
  flat-state bytes ``[lo + i*chunk, min(lo + (i+1)*chunk, hi))``, zero-padded
  to ``chunk`` (:mod:`unbroken.snapshot.erasure`), so a member that decodes a
  stripe from its own node's data fragments decodes nothing. Each piece is
  read with one ``os.preadv`` whose scatter list is the slices of the tensors
  it covers (a host state: no intermediate copy, no fresh ``bytes``; pages
  shared with the template the worker was forked from are not copied first:
  :mod:`unbroken.snapshot.overwrite_pages`), or, for
  a state on a GPU, into a pinned block copied to the device asynchronously
  (:mod:`unbroken.snapshot.device_blocks`).

Each piece's CRC-32 is computed by the thread that read it, right after the
read (from cache; zlib_ng's ``crc32`` runs outside the GIL, as ``os.preadv``
does), and the pieces of one range are combined (``crc32_combine``) and
compared with the seal's.

Invariants: every byte loaded or verified is checked against the seal's CRC;
a mismatch raises :class:`~unbroken.snapshot.segment.SnapshotCorrupt` naming
the segment and the range, or, in a load given ``on_mismatch`` (a restore's),
is handed to it once every read is done (the bytes it wrote into the tensors
are wrong: the restore writes that stripe again, rebuilt from other
fragments: :mod:`unbroken.snapshot._load_damage`); a segment is opened
as snapshot memory always is (never through a link, only a regular file of
this user's); when :func:`load_fragments` returns, every copy it queued on a
device has completed.
"""

from __future__ import annotations

import bisect
import dataclasses
import mmap
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Sequence

import torch
from zlib_ng import zlib_ng

from unbroken.snapshot.overwrite_pages import ready_to_overwrite
from unbroken.snapshot.segment import HEADER_BYTES, SealedBuffer, SnapshotCorrupt, crc32, open_segment

if TYPE_CHECKING:
    from unbroken.snapshot.device_blocks import DeviceBlocks

__all__ = ["MAX_THREADS", "PIECE_BYTES", "FragmentRead", "io_threads", "load_fragments", "verify_ranges",
           "verify_sealed"]

PIECE_BYTES = 8 << 20
"""Bytes one thread reads and checks at once: small enough that the checksum reads them from the cache the read
just filled, large enough that a piece costs far more than its call."""
MAX_THREADS = 8
"""Threads one load or verification uses at most (a GPU host's memory bandwidth is reached with fewer)."""

Targets = Sequence[tuple[int, int, torch.Tensor]]
"""``(flat offset, bytes, flat uint8 view)`` of each tensor of the state, by offset (``StateLoader.targets``)."""


def io_threads(sharing: int = 1) -> int:
    """Threads for a load or a verification: this process's cores shared by ``sharing`` processes that do the
    same at once (the workers of a node restoring together), at least 1, at most :data:`MAX_THREADS`."""
    return max(1, min(MAX_THREADS, len(os.sched_getaffinity(0)) // max(1, sharing)))


@dataclasses.dataclass(frozen=True)
class FragmentRead:
    """One data fragment to load: where it lies in a segment and where its bytes go in the flat state."""

    path: Path
    offset: int
    """Its first byte in the segment's payload (the seal's offset)."""
    length: int
    """Its bytes in the segment, padding included (the seal's length, which its CRC covers)."""
    crc: int
    start: int
    """The flat-state offset of its first byte of state."""
    useful: int
    """Its bytes that belong to the state, after ``skip`` (the rest, up to ``length``, is a stripe's zero
    padding)."""
    skip: int = 0
    """Bytes before its state (a parity fragment's header, when the parity is the data itself:
    :meth:`~unbroken.snapshot.erasure.Coding.parity_copies_data`): read and checked, not loaded."""


@dataclasses.dataclass(frozen=True)
class _Piece:
    item: int
    """Which range (or fragment) of the call it belongs to."""
    lo: int
    hi: int
    """Bytes ``[lo, hi)`` of that range."""


def _pieces(lengths: Sequence[int]) -> list[_Piece]:
    """Every range cut in pieces of at most :data:`PIECE_BYTES` (an empty range is one empty piece)."""
    out = []
    for item, length in enumerate(lengths):
        out += [_Piece(item, lo, min(lo + PIECE_BYTES, length)) for lo in range(0, length, PIECE_BYTES)] or [
            _Piece(item, 0, 0)]
    return out


def _combine(pieces: list[_Piece], crcs: list[int], n: int) -> list[int]:
    """The CRC of each of the ``n`` ranges from its pieces' (in order)."""
    whole = [0] * n
    for piece, crc in zip(pieces, crcs):
        whole[piece.item] = crc if piece.lo == 0 else zlib_ng.crc32_combine(whole[piece.item], crc,
                                                                              piece.hi - piece.lo)
    return whole


def _run(threads: int, work: Callable[[_Piece], int], pieces: list[_Piece]) -> list[int]:
    if threads <= 1 or len(pieces) <= 1:
        return [work(p) for p in pieces]
    with ThreadPoolExecutor(max_workers=min(threads, len(pieces)), thread_name_prefix="snapshot-io") as pool:
        return list(pool.map(work, pieces))


def verify_sealed(buf: SealedBuffer, threads: int = 1) -> None:
    """Check every byte ``buf``'s seal describes, over a read-only map of the segment, with ``threads`` threads.

    Raises:
        SnapshotCorrupt: bytes that do not match their checksum (or the segment is gone, or short).
    """
    try:
        verify_ranges(buf.path, buf.ranges(), threads=threads)
    except FileNotFoundError:
        raise SnapshotCorrupt(f"{buf.path.name}: removed while being read") from None
    except (KeyError, TypeError, ValueError) as exc:  # a seal keyed with the secret but not of this format
        raise SnapshotCorrupt(f"{buf.path.name}: the seal does not describe its bytes ({exc})") from None


def verify_ranges(path: Path, ranges: Sequence[tuple[int, int, int]], *, threads: int = 1) -> None:
    """Check payload ranges ``(offset, length, crc)`` of the segment at ``path`` over a read-only map of it.

    Raises:
        SnapshotCorrupt: a range's bytes do not match its CRC, or lie past the segment's end (names which).
    """
    if not ranges:
        return
    fd = open_segment(path)
    try:
        size = os.fstat(fd).st_size
        for offset, length, _ in ranges:
            if offset < 0 or HEADER_BYTES + offset + length > size:
                raise SnapshotCorrupt(f"{path.name}: bytes [{offset}, {offset + length}) lie past its end "
                                      f"({size - HEADER_BYTES} payload bytes)")
        mem = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) if size else None
    finally:
        os.close(fd)
    if mem is None:
        return
    pieces = _pieces([length for _, length, _ in ranges])
    view = memoryview(mem)
    try:
        def check(piece: _Piece) -> int:
            at = HEADER_BYTES + ranges[piece.item][0]
            return crc32(view[at + piece.lo:at + piece.hi])

        got = _combine(pieces, _run(threads, check, pieces), len(ranges))
    finally:
        view.release()
        mem.close()
    for (offset, length, crc), have in zip(ranges, got):
        if have != crc:
            raise SnapshotCorrupt(f"{path.name}: bytes [{offset}, {offset + length}) do not match their checksum")


def _spans(targets: Targets, offsets: list[int], start: int, stop: int) -> list[tuple[torch.Tensor, int, int]]:
    """The tensor slices flat bytes ``[start, stop)`` land in: ``(flat view, lo, hi)`` with ``lo`` and ``hi``
    offsets into the view."""
    out = []
    i = max(0, bisect.bisect_right(offsets, start) - 1)
    while start < stop and i < len(targets):
        offset, n, flat = targets[i]
        lo, hi = max(start, offset), min(stop, offset + n)
        if lo < hi:
            out.append((flat, lo - offset, hi - offset))
            start = hi
        i += 1
    if start < stop:
        raise SnapshotCorrupt(f"flat bytes [{start}, {stop}) belong to no tensor of the state's layout")
    return out


def _host_view(flat: torch.Tensor, lo: int, hi: int) -> memoryview:
    """Bytes ``[lo, hi)`` of a host tensor's flat view, to be overwritten whole by a read (made cheap to write
    first: :func:`~unbroken.snapshot.overwrite_pages.ready_to_overwrite`)."""
    ready_to_overwrite(flat.data_ptr() + lo, hi - lo)
    return flat[lo:hi].numpy().data


def _read_into(fd: int, buffers: list[memoryview], at: int, name: str) -> None:
    """``os.preadv`` of ``buffers`` (filled in order) from file offset ``at``; at most IOV_MAX at once."""
    limit = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
    for i in range(0, len(buffers), limit):
        group = buffers[i:i + limit]
        want = sum(len(b) for b in group)
        if os.preadv(fd, group, at) != want:
            raise SnapshotCorrupt(f"{name}: shorter than its seal says (removed or truncated while read)")
        at += want


class _PieceLoader:
    """Loads one piece of one fragment (called from several threads): ``[header][state][padding]`` bytes, the
    state's into its tensors, all of them checked; returns the piece's CRC-32."""

    def __init__(self, reads: Sequence[FragmentRead], targets: Targets, fds: dict[Path, int],
                 blocks: DeviceBlocks | None) -> None:
        self.reads, self.targets, self.fds, self.blocks = reads, targets, fds, blocks
        self.offsets = [int(t[0]) for t in targets]

    def __call__(self, piece: _Piece) -> int:
        r = self.reads[piece.item]
        lo, hi = max(piece.lo, r.skip), min(piece.hi, r.skip + r.useful)  # this piece's bytes of state
        spans = _spans(self.targets, self.offsets, r.start + lo - r.skip, r.start + hi - r.skip) if lo < hi else []
        head = max(0, min(piece.hi, r.skip) - piece.lo)  # a header's bytes: read and checked only
        tail = piece.hi - piece.lo - head - max(0, hi - lo)  # the stripe's zero padding: likewise
        at = HEADER_BYTES + r.offset + piece.lo
        if self.blocks is not None:
            return self.blocks.load(self.fds[r.path], at, piece.hi - piece.lo, spans, r.path.name, first=head)
        buffers = [_host_view(flat, a, b) for flat, a, b in spans]
        if head:
            buffers.insert(0, memoryview(bytearray(head)))
        if tail:
            buffers.append(memoryview(bytearray(tail)))
        _read_into(self.fds[r.path], buffers, at, r.path.name)
        crc = 0
        for buf in buffers:
            crc = zlib_ng.crc32(buf, crc)
        return crc & 0xFFFFFFFF


def _open_all(reads: Sequence[FragmentRead], fds: dict[Path, int]) -> None:
    """A descriptor of each segment ``reads`` name, into ``fds`` (the caller closes them)."""
    for r in reads:
        if r.path not in fds:
            try:
                fds[r.path] = open_segment(r.path)
            except FileNotFoundError:
                raise SnapshotCorrupt(f"{r.path.name}: removed before the restore read it") from None


def load_fragments(reads: Sequence[FragmentRead], targets: Targets, *, threads: int = 1,
                   device: torch.device | None = None,
                   on_mismatch: Callable[[FragmentRead], None] | None = None) -> int:
    """Load the fragments ``reads`` into the tensors of ``targets``; returns the state bytes written.

    A host tensor is read into directly; with a CUDA ``device`` the bytes pass through pinned blocks and are
    copied to each device tensor asynchronously (:class:`~unbroken.snapshot.device_blocks.DeviceBlocks`), all
    complete on return. ``on_mismatch``: called with each read whose bytes do not match the seal's CRC
    (its bytes in the tensors are then wrong: the caller writes them again) instead of raising.

    Raises:
        SnapshotCorrupt: a fragment's bytes do not match the seal's CRC (without ``on_mismatch``), or its
            segment is gone or short.
    """
    fds: dict[Path, int] = {}
    blocks = None
    if device is not None and device.type == "cuda" and any(t[2].is_cuda for t in targets):
        from unbroken.snapshot.device_blocks import DeviceBlocks  # local: only a GPU's load needs it

        blocks = DeviceBlocks(device, PIECE_BYTES)
    try:
        _open_all(reads, fds)
        pieces = _pieces([r.length for r in reads])
        got = _combine(pieces, _run(threads, _PieceLoader(reads, targets, fds, blocks), pieces), len(reads))
        if blocks is not None:
            blocks.finish()
    finally:
        if blocks is not None:
            blocks.close()
        for fd in fds.values():
            os.close(fd)
    for r, have in zip(reads, got):
        if have != r.crc and on_mismatch is not None:
            on_mismatch(r)
        elif have != r.crc:
            raise SnapshotCorrupt(f"{r.path.name}: bytes [{r.offset}, {r.offset + r.length}) do not match their "
                                  f"checksum")
    return sum(r.useful for r in reads)
