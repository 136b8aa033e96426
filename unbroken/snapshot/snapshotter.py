"""The worker's side of snapshots: after each optimizer step, its share of the state into snapshot memory.

:meth:`Snapshotter.take` is called right after the optimizer step of a step
(``done`` steps applied). A side thread copies this worker's stripes of the
live state (:mod:`unbroken.snapshot.plan`), codes them
(:mod:`unbroken.snapshot.erasure`) and seals them into buffer
``(done // every) % 2`` of its segment (:mod:`unbroken.snapshot.segment`)
while the next step computes. :meth:`Snapshotter.wait` joins it; the worker
calls it before its all-reduce of the next step completes, so (1) the state
is never read while the next optimizer step changes it: a snapshot is the
state of exactly one step, and (2) when step ``s + 1`` commits, every member
has sealed its share of step ``s``: the newest complete snapshot is at most
one step behind the newest committed step.

On a CUDA device the same thread first copies to pinned host memory only
the bytes this worker writes (:func:`byte_ranges`: its data fragments'
ranges, and the whole stripe where it holds parity), on a side stream of the
tensors' own device made current in the thread, after an event recorded on
the compute stream when the optimizer step was queued; the copies are done
when an event recorded after them on that stream has completed. The pinned
buffer is sized to those bytes: about ``1/L`` of the state (``L`` live
workers on the node) instead of all of it.
"""

from __future__ import annotations

import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

import torch

from unbroken.runtime.view import View
from unbroken.snapshot.erasure import HEADER, Coding
from unbroken.snapshot.plan import SnapshotPlan, plan_for
from unbroken.snapshot.segment import Buffer, crc32
from unbroken.snapshot.state_bytes import capture, copy_range, describe, layout_hash

__all__ = ["Snapshotter", "byte_ranges"]

ReadBytes = Callable[[memoryview, int, int], None]
"""``read(out, start, stop)``: bytes ``[start, stop)`` of the flat state into ``out``."""

logger = logging.getLogger(__name__)


class Snapshotter:
    """Per-step snapshots of one worker's share of the state.

    Args:
        job_id, node, worker: name the segments.
        node_of: worker id -> node (every worker of the job).
        every, redundancy, parity: the ``snapshot`` config section.
        config_hash: recorded in each seal.
        state: returns the live tensors of the state (model, optimizer, RNG) by name.
        on_event: receives snapshot events (errors, plan changes).
    """

    def __init__(self, *, job_id: str, node: int, worker: int, node_of: dict[int, int], every: int,
                 redundancy: str, parity: int, config_hash: str,
                 state: Callable[[], dict[str, torch.Tensor]], on_event: Callable[..., None]) -> None:
        self.job_id, self.node, self.worker, self.node_of = job_id, node, worker, node_of
        self.every, self.redundancy, self.parity, self.config_hash = every, redundancy, parity, config_hash
        self.state, self.on_event = state, on_event
        self.buffers = [Buffer(job_id, node, worker, b) for b in (0, 1)]
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-w{worker}")
        self._pending: Future[dict[str, Any]] | None = None
        self._plan_gen = -1
        self.last: dict[str, Any] | None = None
        """What the last completed snapshot wrote (step, bytes, seconds)."""
        self.taken = 0
        self._stream: Any = None  # CUDA: the side stream of device-to-host copies
        self._pinned: torch.Tensor | None = None  # CUDA: the staging buffer, sized to the bytes written
        self.pinned_bytes = 0
        """Bytes of pinned host memory this worker holds for its copies (0 off CUDA)."""

    def take(self, done: int, view: View) -> None:
        """Start the snapshot of the state after ``done`` steps (a no-op off the ``every`` grid)."""
        if self.every <= 0 or done % self.every:
            return
        self.wait()
        tensors = self.state()
        layout = describe(tensors)
        plan = plan_for(view.members, self.node_of, redundancy=self.redundancy, parity=self.parity,
                        state_bytes=layout.nbytes)
        if view.gen != self._plan_gen:
            self._plan_gen = view.gen
            self.on_event("snapshot_plan", gen=view.gen, step=done, k=plan.k, m=plan.m, stripes=plan.stripes,
                          nodes=list(plan.nodes), protected=plan.protected, scheme=plan.scheme)
        mine = plan.assignment(view.members, self.node_of).get(self.worker, [])
        buffer = self.buffers[(done // self.every) % 2]
        ready = None
        device = next((t.device for t in tensors.values() if t.is_cuda), None)
        if device is not None:  # the optimizer step was queued on the compute stream: copy after it
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
        self._pending = self._pool.submit(self._write_from_device, buffer, tensors, ready, layout.entries, plan,
                                          mine, done, view.gen)

    def wait(self) -> None:
        """Block until the snapshot in flight is sealed (or failed: then it is reported, training goes on)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            self.last = pending.result()
            self.taken += 1
        except Exception as exc:  # a full /dev/shm, a coding failure: the job trains on, less protected
            logger.error("snapshot failed: %s", exc)
            self.on_event("snapshot_failed", error=f"{type(exc).__name__}: {exc}")

    def summary(self) -> dict[str, Any]:
        """Snapshots sealed by this worker, and the last one's step, bytes and seconds."""
        return {"taken": self.taken, **(self.last or {})}

    def close(self) -> None:
        self.wait()
        self._pool.shutdown(wait=True)
        for b in self.buffers:
            b.close()

    def _write_from_device(self, buffer: Buffer, tensors: dict[str, torch.Tensor], ready: Any,
                           layout: list[list], plan: SnapshotPlan, mine: list[tuple[int, int]], done: int,
                           gen: int) -> dict[str, Any]:
        """Write the snapshot; on CUDA, stage the bytes this worker writes in pinned memory first."""
        t0 = time.perf_counter()
        if ready is None:
            read: ReadBytes = lambda out, a, b: capture(tensors, out, a, b)  # noqa: E731
        else:
            read = self._stage(tensors, ready, byte_ranges(plan, mine))
        staged_s = time.perf_counter() - t0
        return {**self._write(buffer, read, layout, plan, mine, done, gen), "stage_seconds": staged_s}

    def _stage(self, tensors: dict[str, torch.Tensor], ready: Any, ranges: list[tuple[int, int]]) -> ReadBytes:
        """Copy ``ranges`` of the flat state into the pinned buffer on a side stream of the tensors' device.

        Returns the reader of the staged bytes. The copies start after ``ready``
        (the optimizer step) and are complete when this returns (an event
        recorded after them on the side stream, synchronized).
        """
        device = next(t.device for t in tensors.values() if t.is_cuda)
        torch.cuda.set_device(device)  # this thread's current device: no context or stream on another GPU
        if self._stream is None or self._stream.device != device:
            self._stream = torch.cuda.Stream(device=device)
        total = sum(hi - lo for lo, hi in ranges)
        if self._pinned is None or self._pinned.numel() != total:
            self._pinned = None
            self._pinned = torch.empty(total, dtype=torch.uint8, pin_memory=True)
            self.pinned_bytes = total
        pinned, index, pos = self._pinned, [], 0
        with torch.cuda.stream(self._stream):
            self._stream.wait_event(ready)
            for lo, hi in ranges:
                copy_range(tensors, pinned[pos:pos + hi - lo], lo, hi, non_blocking=True)
                index.append((lo, hi, pos))
                pos += hi - lo
            copied = torch.cuda.Event()
            copied.record(self._stream)
        copied.synchronize()
        host = pinned.numpy()

        def read(out: memoryview, a: int, b: int) -> None:
            if a >= b:
                return
            lo, _, at = next(r for r in index if r[0] <= a and b <= r[1])
            out[:] = host[at + a - lo:at + b - lo].data

        return read

    def _write(self, buffer: Buffer, read: ReadBytes, layout: list[list], plan: SnapshotPlan,
               mine: list[tuple[int, int]], done: int, gen: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        coding = Coding(plan.k, plan.m)
        layout_raw = json.dumps(layout, separators=(",", ":")).encode()
        by_stripe: dict[int, list[int]] = {}
        for stripe, frag in mine:
            by_stripe.setdefault(stripe, []).append(frag)
        # Where everything goes: the layout, then per stripe its fragments (and a parity holder's headers).
        places, offset = [], len(layout_raw)
        for stripe, frags in sorted(by_stripe.items()):
            lo, hi = plan.stripe_range(stripe)
            chunk = coding.chunk(hi - lo)
            for frag in sorted(frags):
                size = chunk if frag < plan.k else chunk + HEADER
                places.append((stripe, frag, offset, size))
                offset += size
            if any(f >= plan.k for f in frags):
                places.append((stripe, -1, offset, HEADER * plan.k))  # -1: the data fragments' headers
                offset += HEADER * plan.k
        area = buffer.begin(offset)
        area[:len(layout_raw)] = layout_raw
        fragments, headers = [], []
        encoded: dict[int, tuple[dict[int, bytes], bytes]] = {}
        for stripe, frag, at, size in places:
            lo, hi = plan.stripe_range(stripe)
            chunk = coding.chunk(hi - lo)
            out = area[at:at + size]
            if 0 <= frag < plan.k:  # a data fragment is the stripe's own bytes: straight from the state
                a, b = lo + frag * chunk, min(lo + (frag + 1) * chunk, hi)
                read(out[:max(0, b - a)], a, b)
                out[max(0, b - a):] = bytes(size - max(0, b - a))
            else:
                if stripe not in encoded:
                    staging = bytearray(hi - lo)
                    read(memoryview(staging), lo, hi)
                    encoded[stripe] = coding.parity(staging, [f for f in by_stripe[stripe] if f >= plan.k])
                parity, hdrs = encoded[stripe]
                out[:] = hdrs if frag < 0 else parity[frag]
            (headers if frag < 0 else fragments).append(
                [stripe, at, size, crc32(out)] if frag < 0 else [stripe, frag, at, size, crc32(out)])
        buffer.seal({
            "v": 1, "job": self.job_id, "node": self.node, "worker": self.worker, "step": done, "gen": gen,
            "config_hash": self.config_hash, "layout_hash": layout_hash(layout), "plan": plan.to_json(),
            "layout_offset": 0, "layout_len": len(layout_raw), "layout_crc": crc32(layout_raw),
            "fragments": fragments, "headers": headers, "t": time.time(),
        })
        return {"step": done, "bytes": offset, "seconds": time.perf_counter() - t0, "pinned_bytes": self.pinned_bytes}


def byte_ranges(plan: SnapshotPlan, mine: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges of the flat state a worker writing fragments ``mine`` reads, merged and sorted.

    A data fragment is its own bytes of the stripe; a parity fragment needs the
    whole stripe.
    """
    coding = Coding(plan.k, plan.m)
    spans = []
    for stripe, frag in mine:
        lo, hi = plan.stripe_range(stripe)
        if frag >= plan.k:
            spans.append((lo, hi))
        else:
            chunk = coding.chunk(hi - lo)
            a, b = lo + frag * chunk, min(lo + (frag + 1) * chunk, hi)
            if a < b:
                spans.append((a, b))
    merged: list[tuple[int, int]] = []
    for a, b in sorted(spans):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    return merged
