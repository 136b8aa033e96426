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

A :class:`Stager` holds one worker's staging buffers (pinned, device, host)
and makes the copies into them, on a side stream of the device.
"""

from __future__ import annotations

import logging
from typing import Any, Callable, Iterator

import numpy as np
import torch

from unbroken.snapshot.state_bytes import copy_range

__all__ = ["BLOCK_BYTES", "DEVICE_HEADROOM", "ReadBytes", "Stager", "Staging"]

logger = logging.getLogger(__name__)

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

        def read(out: memoryview, a: int, b: int) -> None:
            if a >= b:
                return
            lo, _, at = next(r for r in index if r[0] <= a and b <= r[1])
            dst = np.frombuffer(out, dtype=np.uint8)
            for piece, before in self.pieces(at + a - lo, b - a):
                # numpy's copy (of the same memory, pinned or not): one core, outside the GIL. torch's copy_
                # would run on a team of intra-op threads as many as the cores, and the write threads call it
                # at once: cores oversubscribed, the training thread's kernel launches (and so the GPU) kept
                # waiting
                np.copyto(dst[before:before + piece.numel()], piece.numpy())

        return read


DEVICE_HEADROOM = 0.9
"""A device staging buffer is used when the training's peak plus the buffer stay under this share of the card."""


class Stager:
    """One worker's staging buffers, and the copies into them: the bytes a snapshot's write reads, copied off
    the live state so that the next optimizer step may change it.

    - a fixed interval on CUDA (:meth:`stage`): into pinned memory on a side stream, in the writing thread;
    - ``auto`` on CUDA (:meth:`queue`, then :meth:`land`): queued by the training thread on the side stream,
      into a device buffer when the card has room beside the training's peak (else straight into pinned
      memory); the writing thread lands the device buffer in pinned memory;
    - ``auto`` on the CPU (:meth:`host_copy`): into a host buffer, in the writing thread.

    Each returns the reader of the staged bytes and whether a buffer had to be allocated (that write's seconds
    are not a steady figure).
    """

    def __init__(self) -> None:
        self.stream: Any = None  # CUDA: the side stream of device-to-host copies
        self.pinned: Staging | None = None  # CUDA: sized to the bytes written
        self.host: Staging | None = None  # CPU under auto
        self.device_copy: Staging | None = None  # CUDA under auto, when it fits
        self._device_ok: bool | None = None
        self.pinned_bytes = 0
        """Bytes of pinned host memory held for the copies (0 off CUDA)."""
        self.device_bytes = 0
        """Bytes of device memory held for staging (0 unless ``auto`` on CUDA found room)."""

    def host_copy(self, tensors: dict[str, torch.Tensor], ranges: list[tuple[int, int]]) -> tuple[ReadBytes, bool]:
        """CPU under ``auto``: copy ``ranges`` of the live state into a host buffer (the write reads it later)."""
        total = sum(hi - lo for lo, hi in ranges)
        allocated = self.host is None or self.host.total != total
        if allocated:
            self.host = None
            self.host = Staging(total)
        assert self.host is not None
        return self.host.reader(self.host.copy_in(tensors, ranges)), allocated

    def stage(self, tensors: dict[str, torch.Tensor], ready: Any,
              ranges: list[tuple[int, int]]) -> tuple[ReadBytes, bool]:
        """Copy ``ranges`` of the flat state into the pinned buffer on a side stream of the tensors' device,
        after ``ready`` (the optimizer step); complete when this returns (an event recorded after the copies on
        the side stream, synchronized)."""
        device = next(t.device for t in tensors.values() if t.is_cuda)
        torch.cuda.set_device(device)  # this thread's current device: no context or stream on another GPU
        stream = self.side_stream(device)
        allocated = self.pin(sum(hi - lo for lo, hi in ranges))
        pinned = self.pinned
        assert pinned is not None
        index, copied = _copy_on(stream, ready, pinned, tensors, ranges)
        copied.synchronize()
        return pinned.reader(index), allocated

    def queue(self, tensors: dict[str, torch.Tensor], device: torch.device, ready: Any,
              ranges: list[tuple[int, int]]) -> tuple:
        """``auto`` on CUDA, in the training thread: queue the copies of ``ranges`` on the side stream after
        ``ready`` (one Python call per tensor here, none contending for the GIL with the step). The next
        optimizer step must wait on the device for the event this returns (fifth item). Returns what
        :meth:`land` needs."""
        stream = self.side_stream(device)
        total = sum(hi - lo for lo, hi in ranges)
        on_device = self.device_room(device, total)
        allocated = False
        if on_device and (self.device_copy is None or self.device_copy.total != total):
            self.device_copy = None
            with torch.cuda.stream(stream):
                self.device_copy = Staging(total, device=device)
            self.device_bytes, allocated = total, True
        if not on_device:
            allocated = self.pin(total)  # the fallback: straight to pinned memory (the fence waits for it)
        first = self.device_copy if on_device else self.pinned
        assert first is not None
        index, copied = _copy_on(stream, ready, first, tensors, ranges)
        return device, first, on_device, index, copied, allocated

    def land(self, device: torch.device, first: Staging, on_device: bool, index: list[tuple[int, int, int]],
             copied: Any, allocated: bool) -> tuple[ReadBytes, bool]:
        """The writing thread's side of :meth:`queue`: a device buffer's bytes copied into pinned memory
        (allocated here the first time, off the training thread, a block at a time), complete when this
        returns."""
        torch.cuda.set_device(device)
        copied.synchronize()
        if not on_device:
            return first.reader(index), allocated
        allocated = self.pin(first.total) or allocated
        pinned, stream = self.pinned, self.side_stream(device)
        assert pinned is not None

        def landed() -> None:  # the next block is queued only now: the step's own copies go in between
            event = torch.cuda.Event()
            event.record(stream)
            event.synchronize()

        with torch.cuda.stream(stream):
            pinned.land(first, landed)
        return pinned.reader(index), allocated

    def side_stream(self, device: torch.device) -> Any:
        if self.stream is None or self.stream.device != device:
            self.stream = torch.cuda.Stream(device=device)
        return self.stream

    def pin(self, total: int) -> bool:
        """A pinned buffer of ``total`` bytes (in blocks); True when it had to be allocated."""
        if self.pinned is not None and self.pinned.total == total:
            return False
        self.pinned = None
        self.pinned = Staging(total, pin=True)
        self.pinned_bytes = total
        return True

    def device_room(self, device: torch.device, total: int) -> bool:
        """Does a device staging buffer of ``total`` bytes fit beside the training's peak (decided once, after
        the first step's peak is known)?"""
        if self._device_ok is None:
            peak = torch.cuda.max_memory_allocated(device)
            card = torch.cuda.get_device_properties(device).total_memory
            self._device_ok = peak + total <= DEVICE_HEADROOM * card
            logger.info("snapshot staging %s: %.2f GiB beside a training peak of %.2f GiB on a %.2f GiB card",
                        "on the device" if self._device_ok else "in pinned memory only", total / 2**30,
                        peak / 2**30, card / 2**30)
        return self._device_ok


def _copy_on(stream: Any, ready: Any, into: Staging, tensors: dict[str, torch.Tensor],
             ranges: list[tuple[int, int]]) -> tuple[list[tuple[int, int, int]], Any]:
    """Queue the copies of ``ranges`` into ``into`` on ``stream`` after the event ``ready``; returns their
    index and an event recorded after them."""
    with torch.cuda.stream(stream):
        stream.wait_event(ready)
        index = into.copy_in(tensors, ranges, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record(stream)
    return index, copied
