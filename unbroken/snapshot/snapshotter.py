"""The worker's side of snapshots: after each optimizer step, its share of the state into snapshot memory.

:meth:`Snapshotter.take` is called right after the optimizer step of a step
(``done`` steps applied). A side thread copies this worker's stripes of the
live state (:mod:`unbroken.snapshot.plan`), codes them
(:mod:`unbroken.snapshot.erasure`) and seals them into the buffer of its
segment (:mod:`unbroken.snapshot.segment`) that does not hold its newest
sealed snapshot, while the next step computes; the two buffers alternate only
as writes seal, so a failed write (a full ``/dev/shm``) never costs the last
good copy. :meth:`Snapshotter.wait` joins it; the worker
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

Under ``snapshot.every = auto`` (:mod:`unbroken.snapshot.cadence`) the
interval is decided every step from the proposals in the reduced gradient
buffer, and a write may outlive the step. The bytes it writes are first
*staged* (copied off the live state). On a CUDA device the training thread
queues those copies on the side stream, straight from the live state into
pinned memory, in the window between the optimizer step that made the state
and the next one (forward and backward only read it); only the tail that
window cannot carry (measured) is first copied device to device into a
buffer of at most ``snapshot.device_staging_bytes``, landed in pinned memory
by the writing thread (:class:`~unbroken.snapshot.staging.Stager`). The fence
before the next reduction (:meth:`Snapshotter.fence`) makes the compute
stream wait for the copies, so the next optimizer step runs after them: the
host never waits. On the CPU the thread copies into a host
buffer and the fence waits for that copy. The coding and the write into
shared memory go on while the next steps compute; a finished write is
joined at the next proposal, and its steady seconds feed it. A write still
in flight when the job ends is left unsealed (the final checkpoint holds the
state).

The write itself runs on up to ``write_threads`` threads, one stripe each
(copies and checksums release the GIL).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import nullcontext
from typing import Any, Callable, ContextManager, Sequence

import torch

from unbroken.store.view import View
from unbroken.snapshot.cadence import VETO, Cadence, StepRole, due, tally
from unbroken.snapshot.erasure import HEADER
from unbroken.snapshot.plan import GROUP_NODES, SnapshotPlan, plan_for
from unbroken.snapshot.segment import Buffer, SealedBuffer, SnapshotCorrupt, crc32
from unbroken.snapshot.staging import ReadBytes, Stager
from unbroken.snapshot.state_bytes import capture, describe, layout_hash

__all__ = ["Snapshotter", "byte_ranges"]

logger = logging.getLogger(__name__)

STAGE_TIMEOUT_S = 600.0
"""The longest the fence waits for a staging copy (a local copy: only a broken device takes this long)."""


class Snapshotter:
    """Per-step snapshots of one worker's share of the state.

    Args:
        job_id, node, worker: name the segments.
        node_of: worker id -> node (every worker of the job).
        every, redundancy, parity, group_nodes: the ``snapshot`` config section (``every``: steps, or
            ``"auto"``).
        config_hash: recorded in each seal.
        state: returns the live tensors of the state (model, optimizer, RNG) by name.
        on_event: receives snapshot events (errors, plan changes, the interval chosen).
        write_threads: threads that code and write stripes at once.
        shares_cores: training runs on the host's cores (a CPU device): see :class:`Cadence`.
        shard: HSDP: ``(index, degree)`` of this worker's shard; ``holders`` maps a view's members to the
            workers holding the same shard index (one per live replica), who snapshot it together: the
            plan, the coding and the stripes are theirs, apart from the other indices'.
        moments_in_copies: a sharded optimizer (ZeRO-1): the state holds no moments, the ring copies of the
            same step do (:mod:`unbroken.snapshot.replicas`); the seal says so (``"moments": "copies"``), and a
            restore takes such a step only with a copy of every range.
        map_ahead: with several write threads, map the second buffer beside the first write (off: each buffer
            is mapped by its own first write, for comparison).
        busy: entered around every wait of the calling (training) thread for a write or a staging copy
            (:meth:`Membership.busy`: its peers then see it progress, however long a write takes).
        device_staging_bytes: on CUDA under ``auto``, the most device memory the copy off the device may
            spill into (``snapshot.device_staging_bytes``; see :class:`~unbroken.snapshot.staging.Stager`).
    """

    def __init__(self, *, job_id: str, node: int, worker: int, node_of: dict[int, int], every: int | str,
                 redundancy: str, parity: int, config_hash: str, group_nodes: int = GROUP_NODES,
                 state: Callable[[], dict[str, torch.Tensor]], on_event: Callable[..., None],
                 write_threads: int = 1, shares_cores: bool = False, shard: tuple[int, int] = (0, 1),
                 holders: Callable[[Sequence[int]], Sequence[int]] = tuple, moments_in_copies: bool = False,
                 map_ahead: bool = True, busy: Callable[[], ContextManager[None]] = nullcontext,
                 device_staging_bytes: int = 2 << 30) -> None:
        self.job_id, self.node, self.worker, self.node_of = job_id, node, worker, node_of
        self.shard, self.holders, self.moments_in_copies = shard, holders, moments_in_copies
        self.every, self.redundancy, self.parity, self.config_hash = every, redundancy, parity, config_hash
        self.group_nodes = group_nodes
        self.state, self.on_event, self.busy = state, on_event, busy
        self.device_staging_bytes = device_staging_bytes
        self.auto = every == "auto"
        self.cadence = Cadence(shares_cores=shares_cores) if self.auto else None
        self.buffers = [Buffer(job_id, node, worker, b) for b in (0, 1)]
        self._next = self._older_buffer()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"snapshot-w{worker}")
        self.write_threads = max(1, write_threads)
        self._writers = (ThreadPoolExecutor(max_workers=self.write_threads, thread_name_prefix=f"snapshot-io-w{worker}")
                         if self.write_threads > 1 else None)
        self._pending: Future[dict[str, Any]] | None = None
        self._staged = threading.Event()
        self._staged.set()
        self._plan_gen = -1
        self.last: dict[str, Any] | None = None
        """What the last completed snapshot wrote (step, bytes, seconds)."""
        self.last_step = -1
        """The step of the last snapshot started (every member starts the same ones)."""
        self.spacing: int | None = None
        """Steps between the last two snapshots started (under ``auto``, more than the interval while writes
        are vetoed: the first writes into fresh memory, a write slower than the steps it was given)."""
        self.taken = 0
        self.skipped = 0
        """Snapshots due by the interval but vetoed (a write still in flight somewhere)."""
        self.stager = Stager()
        """The buffers the bytes a write reads are staged in (pinned, device, host)."""
        self._copied: tuple[Any, torch.device] | None = None  # CUDA under auto: the staging copies' event
        self.map_ahead = map_ahead
        self._reserving: tuple[int, Future[None]] | None = None
        """The other buffer being mapped while the first write goes on (its index, and the work)."""
        self._closing = threading.Event()
        """Set by :meth:`close`: a buffer still being mapped ahead stops there (a short job ends at once)."""

    @property
    def pinned_bytes(self) -> int:
        """Bytes of pinned host memory this worker holds for its copies (0 off CUDA)."""
        return self.stager.pinned_bytes

    @property
    def device_bytes(self) -> int:
        """Bytes of device memory this worker holds for staging (0 unless auto on CUDA found room)."""
        return self.stager.device_bytes

    def _older_buffer(self) -> int:
        """The buffer to write first: not the one holding this worker's newest sealed snapshot."""
        steps = []
        for b in self.buffers:
            try:
                sealed = SealedBuffer.open(b.path, self.job_id) if b.path.exists() else None
            except (SnapshotCorrupt, OSError):
                sealed = None
            steps.append(int(sealed.seal.get("step", -1)) if sealed is not None else -1)
        return 0 if steps[0] <= steps[1] else 1

    def vote(self) -> int:
        """This worker's interval proposal for the step being computed (``auto``)."""
        assert self.cadence is not None, "vote() without snapshot.every=auto"
        self._harvest()
        return self.cadence.proposal(in_flight=self._pending is not None)

    def _harvest(self) -> None:
        """Join a write that has finished (its seconds then count in the next proposal)."""
        if self._pending is not None and self._pending.done():
            self.wait()

    def observe_step(self, done: int, seconds: float) -> None:
        """The seconds of the step that ended with ``done`` steps (after :meth:`take` for it)."""
        if self.cadence is not None:
            role: StepRole = "taken" if self.last_step == done else "after" if self.last_step == done - 1 else "plain"
            self.cadence.observe_step(seconds, role)

    def _due(self, done: int, votes: torch.Tensor | None) -> bool:
        if not self.auto:
            return isinstance(self.every, int) and self.every > 0 and done % self.every == 0
        assert self.cadence is not None
        largest = tally(votes) if votes is not None and votes.numel() else 0
        if largest == VETO:
            if self.cadence.interval and done % self.cadence.interval == 0:
                self.skipped += 1
            return False
        if 0 < largest != self.cadence.interval:
            self.cadence.interval = largest
            write = max(self.cadence.writes) if self.cadence.writes else None
            step = sorted(self.cadence.steps)[len(self.cadence.steps) // 2] if self.cadence.steps else None
            cost = self.cadence.cost
            logger.info("snapshot interval %d steps (auto: writes of %s, steps of %s, %s of training per snapshot; "
                        "a whole-job failure goes back at most %d steps)", largest,
                        f"{write:.3f} s" if write is not None else "not measured yet",
                        f"{step:.3f} s" if step is not None else "not measured yet",
                        f"{cost:.3f} s" if cost is not None else "not measured yet", 2 * largest)
            self.on_event("snapshot_interval", step=done, interval=largest, recovery_point_steps=2 * largest,
                          write_s=write, step_s=step, cost_s=cost)
        return due(done, largest)

    def take(self, done: int, view: View, votes: torch.Tensor | None = None) -> bool:
        """Start the snapshot of the state after ``done`` steps, if one is due: on the ``every`` grid, or under
        ``auto`` by the proposals ``votes`` (the reduced buffer's vote slots). True if it did (every member
        decides alike)."""
        if not self._due(done, votes):
            return False
        self.wait()
        tensors = self.state()
        layout = describe(tensors)
        holders = self.holders(view.members)
        plan = plan_for(holders, self.node_of, redundancy=self.redundancy, parity=self.parity,
                        state_bytes=layout.nbytes, group_nodes=self.group_nodes)
        if view.gen != self._plan_gen:
            self._plan_gen = view.gen
            self.on_event("snapshot_plan", gen=view.gen, step=done, k=plan.k, m=plan.m, stripes=plan.stripes,
                          nodes=list(plan.nodes), groups=[len(g) for g in plan.groups],
                          protected=plan.protected, scheme=plan.scheme,
                          **({"shard_index": self.shard[0]} if self.shard[1] > 1 else {}))
        # A node's assignment depends only on its own live workers: not every node's computed (thousands)
        mine = plan.assignment([w for w in holders if self.node_of[w] == self.node], self.node_of).get(self.worker, [])
        # Never the buffer holding this worker's newest sealed snapshot: the other one, flipped only once a
        # write sealed (a failed write leaves its buffer unsealed, and the next write goes there again).
        index = self._next
        ready, queued = None, None
        device = next((t.device for t in tensors.values() if t.is_cuda), None)
        if device is not None:  # the optimizer step was queued on the compute stream: copy after it
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(device))
            if self.auto:
                steps = sorted(self.cadence.steps) if self.cadence is not None else []
                window_s = steps[len(steps) // 2] if steps else None  # the median step: the window's length
                queued = self.stager.queue(tensors, device, ready, byte_ranges(plan, mine),
                                           cap=self.device_staging_bytes, window_s=window_s)
                self._copied = (queued[5], device)
        self.spacing = done - self.last_step if self.last_step >= 0 else None
        self.last_step = done
        self._staged.clear()
        self._pending = self._pool.submit(self._write_from_device, index, tensors, ready, layout.entries, plan,
                                          mine, done, view.gen, queued)
        return True

    def fence(self) -> None:
        """Before the next reduction completes: the last snapshot no longer reads the live state. With a fixed
        interval it is sealed; under ``auto`` staged (its write goes on): on CUDA the compute stream waits for
        the staging copies (the host does not), on the CPU the host waits for the staging thread."""
        if not self.auto:
            self.wait()
            return
        if self._copied is not None:  # CUDA: the next optimizer step waits for the copies on the device, not here
            event, device = self._copied
            self._copied = None
            torch.cuda.current_stream(device).wait_event(event)
            return
        pending = self._pending
        if pending is None:
            return
        with self.busy():
            staged = self._staged.wait(STAGE_TIMEOUT_S)
        if not staged:
            logger.error("snapshot staging took more than %.0f s; waiting for the whole snapshot", STAGE_TIMEOUT_S)
            self.wait()

    def wait(self) -> None:
        """Block until the snapshot in flight is sealed (or failed: then it is reported, training goes on)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            with self.busy():
                last = pending.result()
            self._next = 1 - last.pop("index")
        except Exception as exc:  # a full /dev/shm, a coding failure: the job trains on, less protected
            logger.error("snapshot failed: %s", exc)
            self.on_event("snapshot_failed", error=f"{type(exc).__name__}: {exc}")
            return
        self.last = last
        self.taken += 1
        if self.cadence is not None and last.pop("steady", False):
            self.cadence.observe_write(last["stage_seconds"] + last["seconds"])
        # when it ran (wall clock), so the steps it overlapped can be told from the others
        self.on_event("snapshot_sealed", step=last["step"], bytes=last["bytes"], stage_s=last["stage_seconds"],
                      write_s=last["seconds"], started_at=last.pop("started_at"), sealed_at=last.pop("sealed_at"))

    def summary(self) -> dict[str, Any]:
        """Snapshots sealed by this worker, the last one's step, bytes and seconds; under ``auto`` the interval
        chosen, whether it rests on a measured steady write (``settled``), the steps between the last two
        snapshots (``spacing_steps``), the recovery point they imply (steps: twice the larger of the two), what
        a snapshot costs the training (``cost_s``: :attr:`~unbroken.snapshot.cadence.Cadence.cost`) and the
        snapshots skipped."""
        out: dict[str, Any] = {"taken": self.taken, **(self.last or {})}
        if self.cadence is not None:
            c = self.cadence
            out.update(every="auto", interval=c.interval, settled=bool(c.writes), spacing_steps=self.spacing,
                       recovery_point_steps=2 * max(c.interval, self.spacing or 0), skipped=self.skipped,
                       write_s=max(c.writes) if c.writes else None, cost_s=c.cost,
                       device_staging_bytes=self.stager.device_bytes,
                       proposal=c.proposal(in_flight=False))
        return out

    def close(self, *, finished: bool = False) -> None:
        """Join the write in flight and release the buffers. ``finished`` (the job is over, its final
        checkpoint written) under ``auto``: a write still in flight is left to end with the process (its
        buffer stays unsealed), so that a slow write does not hold the worker's report."""
        self._closing.set()
        if finished and self.auto and self._pending is not None and not self._pending.done():
            self._pending = None
            self._pool.shutdown(wait=False, cancel_futures=True)
            return
        self.wait()
        self._pool.shutdown(wait=True)
        if self._writers is not None:
            self._writers.shutdown(wait=True)
        for b in self.buffers:
            b.close()

    def _write_from_device(self, index: int, tensors: dict[str, torch.Tensor], ready: Any,
                           layout: list[list], plan: SnapshotPlan, mine: list[tuple[int, int]], done: int,
                           gen: int, queued: tuple | None = None) -> dict[str, Any]:
        """Write the snapshot into buffer ``index``; on CUDA (and on the CPU under ``auto``) stage the bytes
        this worker writes first (``queued``: the copies the training thread queued, to land in pinned memory
        here). ``steady``: this write neither allocated a staging buffer nor mapped its segment, nor waited
        for it to be mapped (its seconds are what the next snapshot will cost)."""
        t0, started_at = time.perf_counter(), time.time()
        try:
            if queued is not None:
                read, allocated = self.stager.land(*queued)
            elif ready is not None:
                read, allocated = self.stager.stage(tensors, ready, byte_ranges(plan, mine))
            elif self.auto:
                read, allocated = self.stager.host_copy(tensors, byte_ranges(plan, mine))
            else:
                read, allocated = (lambda out, a, b: capture(tensors, out, a, b)), False  # noqa: E731
        finally:
            self._staged.set()
        staged_s = time.perf_counter() - t0
        wrote = self._write(index, read, layout, plan, mine, done, gen)
        fresh = wrote.pop("fresh")
        return {**wrote, "stage_seconds": staged_s, "steady": not allocated and not fresh, "started_at": started_at,
                "sealed_at": time.time()}

    def _reserve_other(self, index: int, size: int) -> bool:
        """Before a write into buffer ``index``: wait for that buffer's reservation if one is in flight; when
        the other buffer is not mapped yet, map it now for a write of ``size`` bytes, beside this one, on one
        of the write threads (with one write thread, it is mapped by its own first write).

        Mapping a fresh buffer (reserving and first touching its pages) took about 11 s for 16 GB on an H100
        host, and the two buffers' first writes followed each other: for the first 20 s of a job, or after a
        replacement joined, its snapshots were vetoed while they lasted. Side by side they take the time of
        one. Returns whether this write waited for its buffer's reservation (then its seconds are not a
        steady figure)."""
        waited = False
        if self._reserving is not None and self._reserving[0] == index:
            _, work = self._reserving
            self._reserving = None
            waited = not work.done()
            try:
                work.result()
            except Exception as exc:  # the write maps it itself, and says why if that fails again
                logger.warning("snapshot buffer %d could not be reserved ahead: %s", index, exc)
        other = self.buffers[1 - index]
        if self.map_ahead and self._writers is not None and self._reserving is None and not other.is_mapped:
            self._reserving = (1 - index, self._writers.submit(other.reserve, size, self._closing))
        return waited

    def _write(self, index: int, read: ReadBytes, layout: list[list], plan: SnapshotPlan,
               mine: list[tuple[int, int]], done: int, gen: int) -> dict[str, Any]:
        t0 = time.perf_counter()
        buffer = self.buffers[index]
        layout_raw = json.dumps(layout, separators=(",", ":")).encode()
        by_stripe: dict[int, list[int]] = {}
        for stripe, frag in mine:
            by_stripe.setdefault(stripe, []).append(frag)
        # Where everything goes: the layout, then per stripe its fragments (and a parity holder's headers).
        places: dict[int, list[tuple[int, int, int]]] = {}
        offset = len(layout_raw)
        for stripe, frags in sorted(by_stripe.items()):
            lo, hi = plan.stripe_range(stripe)
            k, chunk = plan.k_of(stripe), plan.coding(stripe).chunk(hi - lo)
            for frag in sorted(frags):
                size = chunk if frag < k else chunk + HEADER
                places.setdefault(stripe, []).append((frag, offset, size))
                offset += size
            if any(f >= k for f in frags):
                places[stripe].append((-1, offset, HEADER * k))  # -1: the data fragments' headers
                offset += HEADER * k
        waited = self._reserve_other(index, offset)
        area = buffer.begin(offset)
        area[:len(layout_raw)] = layout_raw

        def fill(stripe: int) -> list[tuple[int, list[int]]]:
            """Write one stripe's places; their seal entries (-1 first for headers)."""
            lo, hi = plan.stripe_range(stripe)
            coding = plan.coding(stripe)  # its group's
            chunk = coding.chunk(hi - lo)
            entries, encoded = [], None
            for frag, at, size in places[stripe]:
                out = area[at:at + size]
                if 0 <= frag < coding.k:  # a data fragment is the stripe's own bytes: straight from the state
                    a, b = lo + frag * chunk, min(lo + (frag + 1) * chunk, hi)
                    read(out[:max(0, b - a)], a, b)
                    out[max(0, b - a):] = bytes(size - max(0, b - a))
                else:
                    if encoded is None:
                        staging = bytearray(hi - lo)
                        read(memoryview(staging), lo, hi)
                        encoded = coding.parity(staging, [f for f in by_stripe[stripe] if f >= coding.k])
                    parity, hdrs = encoded
                    out[:] = hdrs if frag < 0 else parity[frag]
                entries.append((frag, [stripe, at, size, crc32(out)] if frag < 0
                                else [stripe, frag, at, size, crc32(out)]))
            return entries

        stripes = sorted(places)
        done_stripes = (list(self._writers.map(fill, stripes)) if self._writers is not None and len(stripes) > 1
                        else [fill(stripe) for stripe in stripes])
        fragments = [e for entries in done_stripes for frag, e in entries if frag >= 0]
        headers = [e for entries in done_stripes for frag, e in entries if frag < 0]
        buffer.seal({
            "v": 1, "job": self.job_id, "node": self.node, "worker": self.worker, "step": done, "gen": gen,
            "config_hash": self.config_hash, "layout_hash": layout_hash(layout), "plan": plan.to_json(),
            "layout_offset": 0, "layout_len": len(layout_raw), "layout_crc": crc32(layout_raw),
            "fragments": fragments, "headers": headers, "t": time.time(),
            **({"shard": list(self.shard)} if self.shard[1] > 1 else {}),
            **({"moments": "copies"} if self.moments_in_copies else {}),
        })
        return {"step": done, "index": index, "bytes": offset, "seconds": time.perf_counter() - t0,
                "pinned_bytes": self.stager.pinned_bytes, "fresh": waited or buffer.mapped}


def byte_ranges(plan: SnapshotPlan, mine: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The byte ranges of the flat state a worker writing fragments ``mine`` reads, merged and sorted.

    A data fragment is its own bytes of the stripe; a parity fragment needs the
    whole stripe.
    """
    spans = []
    for stripe, frag in mine:
        lo, hi = plan.stripe_range(stripe)
        if frag >= plan.k_of(stripe):
            spans.append((lo, hi))
        else:
            chunk = plan.coding(stripe).chunk(hi - lo)
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
