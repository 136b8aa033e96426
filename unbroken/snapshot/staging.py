"""Where a snapshot's bytes wait between the live state and shared memory: a buffer made of blocks.

A worker stages the bytes it writes (about ``1/L`` of the state) before it
codes and writes them. On a CUDA device the host side of that staging is
pinned memory: 16 GB for ``llama-1b`` on one GPU. Pinned in one allocation
(one ``cudaHostAlloc``) it took about 9 s, and the training thread's CUDA
calls waited behind it: the step after a worker's first snapshot took 9.2 s
on an H100 and 9.1 s on an H200, once per process, so again after each
rejoin, and every member of the job waited for that worker. A
:class:`Staging` buffer is allocated in blocks of :data:`BLOCK_BYTES`, each
in its own call: the step's calls go in between them.

The same blocks serve the other copies: the device staging buffer lands in
pinned memory one block at a time (the step's own small copies to the host
queue behind one copy in flight), and the write threads read the staged
bytes with numpy (one core each, outside the GIL).
"""

from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch

from unbroken.snapshot.state_bytes import copy_range

__all__ = ["BLOCK_BYTES", "ReadBytes", "Staging"]

ReadBytes = Callable[[memoryview, int, int], None]
"""``read(out, start, stop)``: bytes ``[start, stop)`` of the flat state into ``out``."""

BLOCK_BYTES = 64 << 20
"""Bytes of one block: one pinned allocation (tens of ms), and one device-to-host copy of the landing
(about 1 ms over PCIe 5). With one copy of the whole state the step after each snapshot took 0.17 s longer
on an H200; landed in copies of this size, that step took 0.153 s on an H100 (its steady steps 0.165 s)."""


class Staging:
    """A ``uint8`` buffer of ``total`` bytes in blocks of ``block`` bytes (the last one shorter), on the host
    (``pin``: pinned memory) or on ``device`` (one block: a device allocation does not stall the host)."""

    def __init__(self, total: int, *, pin: bool = False, device: torch.device | None = None,
                 block: int | None = None) -> None:
        block = BLOCK_BYTES if block is None else block
        if total < 0 or block <= 0:
            raise ValueError(f"a staging buffer of {total} bytes in blocks of {block}")
        on_device = device is not None and device.type != "cpu"
        self.total = total
        self.block = max(total, 1) if on_device else block
        self.blocks = [torch.empty(min(self.block, total - lo), dtype=torch.uint8, pin_memory=pin and not on_device,
                                   device=device) for lo in range(0, total, self.block)]

    def pieces(self, at: int, n: int) -> Iterator[tuple[torch.Tensor, int]]:
        """Bytes ``[at, at + n)`` of the buffer: ``(slice of a block, bytes before it)`` in order."""
        if at < 0 or at + n > self.total:
            raise ValueError(f"bytes [{at}, {at + n}) of a {self.total}-byte staging buffer")
        done = 0
        while done < n:
            i, off = divmod(at + done, self.block)
            take = min(n - done, self.block - off)
            yield self.blocks[i][off:off + take], done
            done += take

    def copy_in(self, tensors: dict[str, torch.Tensor], ranges: list[tuple[int, int]], *,
                non_blocking: bool = False) -> list[tuple[int, int, int]]:
        """Copy ``ranges`` of the flat state of ``tensors`` back to back into the buffer; returns where each
        went, ``(lo, hi, at)`` (``non_blocking``: queued on the current stream, as :func:`copy_range`)."""
        index, at = [], 0
        for lo, hi in ranges:
            for piece, before in self.pieces(at, hi - lo):
                copy_range(tensors, piece, lo + before, lo + before + piece.numel(), non_blocking=non_blocking)
            index.append((lo, hi, at))
            at += hi - lo
        return index

    def land(self, src: "Staging", synchronize: Callable[[], None]) -> None:
        """Copy ``src`` (a device buffer of the same size) into this one, a block at a time: each copy is
        queued on the current stream and ``synchronize`` waits for it before the next one is queued."""
        if src.total != self.total:
            raise ValueError(f"landing {src.total} bytes in a {self.total}-byte staging buffer")
        for i, dst in enumerate(self.blocks):
            for piece, before in src.pieces(i * self.block, dst.numel()):
                dst[before:before + piece.numel()].copy_(piece, non_blocking=True)
            synchronize()

    def reader(self, index: list[tuple[int, int, int]]) -> ReadBytes:
        """The reader of flat-state bytes staged here (a host buffer) at ``index`` ((lo, hi, at) per range)."""
        arrays = [b.numpy() for b in self.blocks]  # the same memory (pinned or not)

        def read(out: memoryview, a: int, b: int) -> None:
            if a >= b:
                return
            lo, _, at = next(r for r in index if r[0] <= a and b <= r[1])
            dst = np.frombuffer(out, dtype=np.uint8)
            start = at + a - lo
            done = 0
            while done < b - a:
                i, off = divmod(start + done, self.block)
                take = min(b - a - done, self.block - off)
                # numpy's copy: one core, outside the GIL. torch's copy_ would run on a team of intra-op threads
                # as many as the cores, and the write threads call it at once: cores oversubscribed, the
                # training thread's kernel launches (and so the GPU) kept waiting
                np.copyto(dst[done:done + take], arrays[i][off:off + take])
                done += take

        return read
