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

__all__ = ["BLOCK_BYTES", "ReadBytes", "Stager", "Staging", "WINDOW_MARGIN", "split_ranges"]

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
        self.land_at(0, src, synchronize)

    def land_at(self, at: int, src: "Staging", synchronize: Callable[[], None]) -> None:
        """Copy all of ``src`` into bytes ``[at, at + src.total)`` of this buffer, a block of this one at a time
        (each copy queued on the current stream, ``synchronize`` waiting for it before the next)."""
        if at < 0 or at + src.total > self.total:
            raise ValueError(f"landing {src.total} bytes at {at} of a {self.total}-byte staging buffer")
        done = 0
        while done < src.total:
            i, off = divmod(at + done, self.block)
            n = min(src.total - done, self.block - off)
            dst = self.blocks[i][off:off + n]
            for piece, before in src.pieces(done, n):
                dst[before:before + piece.numel()].copy_(piece, non_blocking=True)
            synchronize()
            done += n

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


WINDOW_MARGIN = 0.8
"""Of what a step window carried off the device (measured), this share is counted on for the next one."""


class Stager:
    """One worker's staging buffers, and the copies into them: the bytes a snapshot's write reads, copied off
    the live state so that the next optimizer step may change it.

    - a fixed interval on CUDA (:meth:`stage`): into pinned memory on a side stream, in the writing thread;
    - ``auto`` on CUDA (:meth:`queue`, then :meth:`land`): queued by the training thread on the side stream,
      straight from the live state into pinned memory, in the window between the optimizer step that made it
      and the next one (forward and backward only read the state; that optimizer step waits, on the device,
      for the copies); only what the window cannot carry (measured: :attr:`rate`) is first copied device to
      device into a buffer of at most ``cap`` bytes (``snapshot.device_staging_bytes``), which the writing
      thread lands in pinned memory afterwards;
    - ``auto`` on the CPU (:meth:`host_copy`): into a host buffer, in the writing thread.

    Each returns the reader of the staged bytes and whether a buffer had to be allocated (that write's seconds
    are not a steady figure).
    """

    def __init__(self) -> None:
        self.stream: Any = None  # CUDA: the side stream of device-to-host copies
        self.pinned: Staging | None = None  # CUDA: sized to the bytes written
        self.host: Staging | None = None  # CPU under auto
        self.device_copy: Staging | None = None  # CUDA under auto: the spill, at most the cap
        self.rate: float | None = None
        """Bytes per second the copies from the live state into pinned memory ran at (CUDA, measured)."""
        self.pinned_bytes = 0
        """Bytes of pinned host memory held for the copies (0 off CUDA)."""
        self.device_bytes = 0
        """Bytes of device memory held for staging (the spill buffer; 0 unless a window was too short)."""

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

    def spill_for(self, total: int, cap: int, window_s: float | None) -> int:
        """Bytes of a ``total``-byte share to copy device to device first: what a step window of ``window_s``
        seconds cannot carry at the measured rate, at most ``cap``; before anything was measured, as much as
        the cap allows (the first window's copy is measured whole the next time)."""
        if cap <= 0:
            return 0
        if self.rate is None or window_s is None:
            return min(cap, total)
        return min(cap, max(0, total - int(WINDOW_MARGIN * self.rate * window_s)))

    def queue(self, tensors: dict[str, torch.Tensor], device: torch.device, ready: Any,
              ranges: list[tuple[int, int]], *, cap: int, window_s: float | None = None) -> tuple:
        """``auto`` on CUDA, in the training thread: after ``ready`` (the optimizer step), on the side stream,
        the last bytes of ``ranges`` that the window cannot carry (:meth:`spill_for`) device to device into the
        spill buffer, then the rest from the live tensors into pinned memory (one Python call per tensor
        here). The next optimizer step must wait on the device for the event this returns (sixth item).
        Returns what :meth:`land` needs."""
        stream = self.side_stream(device)
        total = sum(hi - lo for lo, hi in ranges)
        allocated = self.pin(total)
        spill = self.spill_for(total, cap, window_s)
        if spill and (self.device_copy is None or self.device_copy.total != spill):
            self.device_copy, self.device_bytes = None, 0
            try:
                with torch.cuda.stream(stream):
                    self.device_copy = Staging(spill, device=device)
                self.device_bytes, allocated = spill, True
            except torch.cuda.OutOfMemoryError:
                logger.warning("no room on the device for %.2f GiB of snapshot staging: the next optimizer step "
                               "waits for the copy instead", spill / 2**30)
                spill = 0
        head, tail = split_ranges(ranges, total - spill)
        pinned = self.pinned
        assert pinned is not None
        with torch.cuda.stream(stream):
            stream.wait_event(ready)
            spill_buffer = self.device_copy
            assert not tail or spill_buffer is not None  # a tail is what the spill buffer holds
            tail_index = spill_buffer.copy_in(tensors, tail, non_blocking=True) if tail and spill_buffer else []
            start = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            head_index = pinned.copy_in(tensors, head, non_blocking=True)
            copied = torch.cuda.Event(enable_timing=True)
            copied.record(stream)
        return device, head_index, tail_index, total - spill, start, copied, allocated

    def land(self, device: torch.device, head_index: list[tuple[int, int, int]],
             tail_index: list[tuple[int, int, int]], at_tail: int, start: Any, copied: Any,
             allocated: bool) -> tuple[ReadBytes, bool]:
        """The writing thread's side of :meth:`queue`: once its copies are done (their rate measured), the spill
        buffer's bytes copied into the pinned buffer after the head, a block at a time; complete when this
        returns."""
        torch.cuda.set_device(device)
        copied.synchronize()
        pinned, stream = self.pinned, self.side_stream(device)
        assert pinned is not None
        seconds = start.elapsed_time(copied) / 1000
        if at_tail > 0 and seconds > 0:
            self.rate = at_tail / seconds
        if tail_index:
            spill = self.device_copy
            assert spill is not None

            def landed() -> None:  # the next block is queued only now: the step's own copies go in between
                event = torch.cuda.Event()
                event.record(stream)
                event.synchronize()

            with torch.cuda.stream(stream):
                pinned.land_at(at_tail, spill, landed)
        index = head_index + [(lo, hi, at + at_tail) for lo, hi, at in tail_index]
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


def split_ranges(ranges: list[tuple[int, int]], at: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``ranges`` (sorted byte ranges) cut after their first ``at`` bytes: (the head, the tail)."""
    head, tail, seen = [], [], 0
    for lo, hi in ranges:
        n = hi - lo
        if seen + n <= at:
            head.append((lo, hi))
        elif seen >= at:
            tail.append((lo, hi))
        else:
            cut = lo + (at - seen)
            head.append((lo, cut))
            tail.append((cut, hi))
        seen += n
    return head, tail


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
