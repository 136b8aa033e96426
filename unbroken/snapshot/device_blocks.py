"""Pinned host blocks that carry snapshot bytes to a GPU: read into by a thread, copied to the device asynchronously.

Each loading thread (:func:`unbroken.snapshot.fragment_io.load_fragments`)
owns :data:`RING` pinned blocks and a stream of the state's device, made
current in that thread. A piece of a fragment is read into the thread's next
block (``os.preadv``, outside the GIL), its CRC-32 computed from the block,
then copied to each device tensor it covers by ``non_blocking`` copies queued
on the thread's stream, with an event recorded after them. Before a block is
read into again its event is waited for, so reading piece ``n + 1`` overlaps
the copy of piece ``n``. A host tensor of the state (the RNG states, numbers
the optimizer keeps on the host) is copied from the block at once.

Invariants: a block is never written while a copy from it may be in flight
(its event is waited for first); every stream starts after the work queued
on the caller's current stream when the loader was made (the state's tensors
may reuse memory that work still reads); :meth:`DeviceBlocks.finish` returns
only when every copy queued has completed; each thread pins its blocks once
(``RING`` blocks of ``block_bytes``), released by :meth:`DeviceBlocks.close`.
"""

from __future__ import annotations

import dataclasses
import os
import threading

import torch

from unbroken.snapshot.segment import SnapshotCorrupt, crc32

__all__ = ["RING", "DeviceBlocks"]

RING = 2
"""Pinned blocks per loading thread: one being read into while the copy of the other runs."""


@dataclasses.dataclass
class _ThreadBlocks:
    stream: torch.cuda.Stream
    blocks: list[torch.Tensor]
    events: list[torch.cuda.Event | None]
    next: int = 0


class DeviceBlocks:
    """The pinned blocks and streams of one load onto ``device`` (see the module docstring)."""

    def __init__(self, device: torch.device, block_bytes: int) -> None:
        self.device, self.block_bytes = device, block_bytes
        self._local = threading.local()
        self._all: list[_ThreadBlocks] = []
        self._lock = threading.Lock()
        self._start = torch.cuda.Event()
        self._start.record(torch.cuda.current_stream(device))

    def _mine(self) -> _ThreadBlocks:
        """This thread's blocks and stream, made at its first piece."""
        mine = getattr(self._local, "blocks", None)
        if mine is None:
            torch.cuda.set_device(self.device)  # this thread's current device: no context or stream on another GPU
            stream = torch.cuda.Stream(device=self.device)
            stream.wait_event(self._start)
            mine = _ThreadBlocks(stream=stream, events=[None] * RING, blocks=[
                torch.empty(self.block_bytes, dtype=torch.uint8, pin_memory=True) for _ in range(RING)])
            with self._lock:
                self._all.append(mine)
            self._local.blocks = mine
        return mine

    def load(self, fd: int, at: int, n: int, spans: list[tuple[torch.Tensor, int, int]], name: str, *,
             first: int = 0) -> int:
        """Read ``n`` bytes at file offset ``at`` of ``fd`` into a block, queue their copies into ``spans``
        (``(flat view, lo, hi)``, in order from the block's byte ``first``; bytes outside them are only checked);
        returns their CRC-32.

        Raises:
            SnapshotCorrupt: the file is shorter than ``at + n`` (``name`` says which).
        """
        if n > self.block_bytes:
            raise ValueError(f"a piece of {n} bytes does not fit a {self.block_bytes}-byte block")
        mine = self._mine()
        i = mine.next
        mine.next = (i + 1) % RING
        event = mine.events[i]
        if event is not None:
            event.synchronize()  # the copies that read this block are done
        block = mine.blocks[i]
        view = block.numpy().data[:n]
        if os.preadv(fd, [view], at) != n:
            raise SnapshotCorrupt(f"{name}: shorter than its seal says (removed or truncated while read)")
        crc = crc32(view)
        view.release()
        pos = first
        with torch.cuda.stream(mine.stream):
            for flat, lo, hi in spans:
                if flat.is_cuda:
                    flat[lo:hi].copy_(block[pos:pos + hi - lo], non_blocking=True)
                else:
                    flat[lo:hi].copy_(block[pos:pos + hi - lo])
                pos += hi - lo
            event = torch.cuda.Event()
            event.record(mine.stream)
        mine.events[i] = event
        return crc

    def finish(self) -> None:
        """Wait until every copy queued by every thread has completed."""
        for mine in self._all:
            for event in mine.events:
                if event is not None:
                    event.synchronize()

    def close(self) -> None:
        """Wait for the copies (a failed load too: a block must not be freed under one), release the blocks."""
        self.finish()
        self._all.clear()
