"""A process group per view, with collectives that can be abandoned.

Each view ``g`` gets its own group, rendezvoused on the store the job store
hands out for it (:meth:`~unbroken.runtime.job_store.JobStore.group_store`,
keys ``pg/<g>/...``; gloo on CPU, NCCL on CUDA), built directly rather than through
the global default group so that groups can come and go.

Collectives are started asynchronously and polled. Between polls the caller's
``check`` runs (failure detector, view watcher) and may raise to abandon the
collective. Building a group is watched the same way (a member that dies
while the others connect does not hold them for the whole timeout). An
abandoned group is never used again: with no operation pending it is
destroyed at once (its sockets, threads and buffer released); gloo with an
operation still blocked on a silent peer is parked until that peer is fenced
(killed), which unblocks it, and destroyed then; NCCL is aborted. Every
collective works on a buffer owned by the group, never on the caller's tensor,
so a late write by an abandoned operation can never corrupt state: the buffer
is reused from one step to the next (no allocation, no page faults on the hot
path) and goes with its group.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

CHECK_S = 0.02
"""How often a waiting collective lets the caller's check run."""


class CollectiveFailed(RuntimeError):
    """A collective errored (typically: a peer's connection closed because it died)."""


class ViewGroup:
    """The process group of one view."""

    def __init__(self, rendezvous: dist.Store, *, gen: int, rank: int, size: int, device: torch.device,
                 timeout_s: float, check: Callable[[], None] = lambda: None) -> None:
        """Build the group; ``check`` runs while the members connect and may raise to give up.

        Raises:
            CollectiveFailed: the members did not all connect within the timeout.
        """
        self.gen, self.rank, self.size, self.device = gen, rank, size, device
        self.timeout = timedelta(seconds=timeout_s)
        self._buf: torch.Tensor | None = None
        self._pending: dist.Work | None = None
        self._side: list[dist.Work] = []
        t0 = time.perf_counter()
        self.pg: dist.ProcessGroup = self._connect(rendezvous, check)
        self.build_s = time.perf_counter() - t0

    def _connect(self, rendezvous: dist.Store, check: Callable[[], None]) -> dist.ProcessGroup:
        """Rendezvous in a side thread, watched: a member that dies meanwhile must not hold us for the timeout.

        A construction given up on finishes (or times out) in its thread and is dropped.
        """
        built: dict[str, object] = {}

        def build() -> None:
            try:
                if self.device.type == "cuda":
                    opts = dist.ProcessGroupNCCL.Options()
                    opts._timeout = self.timeout
                    pg = dist.ProcessGroupNCCL(rendezvous, self.rank, self.size, opts)
                    # NCCL connects lazily, inside the first collective, which would block the caller
                    # beyond any check if a peer died meanwhile: connect here, in the watched thread.
                    pg.eager_connect_single_device(self.device)
                    built["pg"] = pg
                else:
                    built["pg"] = dist.ProcessGroupGloo(rendezvous, self.rank, self.size, self.timeout)
            except Exception as exc:  # handed to the caller below
                built["error"] = exc

        thread = threading.Thread(target=build, name=f"group-g{self.gen}", daemon=True)
        thread.start()
        deadline = time.monotonic() + self.timeout.total_seconds()
        while True:
            thread.join(CHECK_S)
            if not thread.is_alive():
                break
            self._tick(check, deadline, "group construction")
        if "error" in built:
            raise CollectiveFailed(f"group of view {self.gen} could not be built: "
                                   f"{str(built['error']).splitlines()[0]}")
        return built["pg"]  # type: ignore[return-value]

    def allreduce(self, tensor: torch.Tensor, check: Callable[[], None],
                  after_post: Callable[[], None] | None = None) -> torch.Tensor:
        """Sum ``tensor`` over the group; ``check`` may raise to abandon.

        Returns the group's buffer, valid until the next ``allreduce`` on this
        group; ``tensor`` itself is left untouched. ``after_post`` runs once the
        collective is in flight (fault injection hook).
        """
        src = tensor.detach()
        if self._buf is None or self._buf.shape != src.shape or self._buf.dtype != src.dtype:
            self._buf = torch.empty_like(src, device=self.device)
        buf = self._buf
        buf.copy_(src)
        if self.size == 1:
            if after_post is not None:
                after_post()
            return buf
        work = self._pending = self._post(lambda: self.pg.allreduce([buf]), "all-reduce")
        if after_post is not None:
            after_post()
        self._poll(work, check, "all-reduce")
        return buf

    def broadcast(self, tensor: torch.Tensor, src: int, check: Callable[[], None]) -> torch.Tensor:
        """Broadcast from group rank ``src``; returns the received tensor (a copy)."""
        buf = tensor.detach().clone().to(self.device)
        if self.size == 1:
            return buf
        work = self._post(lambda: self.pg.broadcast(buf, src), "broadcast")
        self._poll(work, check, "broadcast")
        return buf

    def allgather(self, shard: torch.Tensor, padded: int, check: Callable[[], None],
                  after_post: Callable[[], None] | None = None) -> torch.Tensor:
        """Every rank's ``shard`` (at most ``padded`` elements, zero-padded to it), in rank order.

        Returns a new ``(size * padded,)`` tensor: rank ``r``'s shard starts at ``r * padded``.
        ``after_post`` runs once the collective is in flight (fault injection hook).
        """
        inp = torch.zeros(padded, dtype=shard.dtype, device=self.device)
        inp[:shard.numel()].copy_(shard.reshape(-1))
        if self.size == 1:
            if after_post is not None:
                after_post()
            return inp
        out = torch.empty(self.size * padded, dtype=shard.dtype, device=self.device)
        parts = list(out.view(self.size, padded).unbind(0))
        work = self._post(lambda: self.pg.allgather([parts], [inp]), "all-gather")
        if after_post is not None:
            after_post()
        self._poll(work, check, "all-gather")
        return out

    def post_alltoall(self, out: torch.Tensor, inp: torch.Tensor, out_splits: list[int],
                      in_splits: list[int]) -> dist.Work:
        """Start an all-to-all: ``in_splits[r]`` elements of ``inp`` go to rank ``r`` (in rank order),
        ``out_splits[r]`` elements from rank ``r`` land in ``out``. Wait with :meth:`wait_side`.

        (An all-to-all rather than sends and receives: gloo closes the pair when a timed wait on
        a send or receive expires, so those could not be polled.)
        """
        work = self._post(lambda: self.pg.alltoall_base(out, inp, out_splits, in_splits, dist.AllToAllOptions()),
                          "all-to-all")
        self._side.append(work)
        return work

    def wait_side(self, works: list[dist.Work], check: Callable[[], None], what: str) -> None:
        """Wait for collectives started with ``post_*`` (``check`` runs meanwhile)."""
        for work in works:
            self._poll(work, check, what)
        self._side = [w for w in self._side if not w.is_completed()]

    def _poll(self, work: dist.Work, check: Callable[[], None], what: str) -> None:
        """Wait for ``work``, running ``check`` every ``CHECK_S`` until it completes.

        gloo: a timed ``work.wait`` blocks in C++ and returns the moment the
        collective completes (its "timed out" error leaves the operation running);
        CUDA: woken by the work's future.
        """
        self._pending = work  # until it completes: an abandoned group with pending work is parked, not destroyed
        deadline = time.monotonic() + self.timeout.total_seconds()
        if self.device.type == "cuda":
            done = threading.Event()
            work.get_future().add_done_callback(lambda _: done.set())
            while not done.wait(CHECK_S):
                self._tick(check, deadline, what)
        else:
            step = timedelta(seconds=CHECK_S)
            while True:
                try:
                    work.wait(step)
                    return
                except RuntimeError:
                    # Timed out, failed, or completed just after timing out: once it is
                    # completed, the untimed wait below tells success from failure.
                    if work.is_completed():
                        break
                self._tick(check, deadline, what)
        self._pending = None
        try:
            work.wait()
        except RuntimeError as exc:
            raise CollectiveFailed(f"{what} of view {self.gen} failed: {str(exc).splitlines()[0]}") from None

    def _post(self, start: Callable[[], dist.Work], what: str) -> dist.Work:
        """Start a collective; an error raised at once (NCCL checks synchronously) is a failed collective."""
        try:
            return start()
        except RuntimeError as exc:
            raise CollectiveFailed(f"{what} of view {self.gen} failed: {str(exc).splitlines()[0]}") from None

    def late_result(self, timeout_s: float) -> torch.Tensor | None:
        """The reduced buffer of an all-reduce given up on, if it completes well within ``timeout_s``.

        A member that gave up waiting (a false alarm) may learn that the others
        committed the step: its own contribution was posted, so its all-reduce
        may still complete, and then the buffer holds the same reduced gradient
        as everybody's. None if it failed or is still pending.
        """
        work, deadline = self._pending, time.monotonic() + timeout_s
        if work is None or self._buf is None:
            return None
        while not work.is_completed() and time.monotonic() < deadline:
            time.sleep(0.002)
        try:
            if not work.is_completed():
                return None
            work.wait()
        except RuntimeError:
            return None
        self._pending = None
        return self._buf

    def _tick(self, check: Callable[[], None], deadline: float, what: str) -> None:
        check()
        if time.monotonic() > deadline:
            raise CollectiveFailed(f"{what} of view {self.gen} did not finish within {self.timeout}")

    def abandon(self) -> None:
        """Stop using this group: destroyed now unless an operation is still pending (module docstring).

        NCCL is aborted first. A group whose last operation is still running
        (blocked on a silent peer) is parked until that operation ends (the
        peer is fenced, its connections close), then destroyed by a later
        :meth:`abandon`; so a worker holds at most the groups whose peers are
        still being fenced, not one per view it ever saw.
        """
        if self.device.type == "cuda":
            try:
                self.pg.abort()
            except Exception as exc:  # best effort: the group is never used again
                logger.warning("abort of view %d group failed: %s", self.gen, exc)
        for parked in [g for g in _PARKED if not g._busy()]:
            _PARKED.remove(parked)
            parked._release()
        if not self._busy():
            self._release()
        else:
            _PARKED.append(self)

    def _busy(self) -> bool:
        """An operation of this group is still running (a collective or a point-to-point transfer)."""
        return any(w is not None and not w.is_completed() for w in [self._pending, *self._side])

    def _release(self) -> None:
        """Drop the group, its buffer and its last operation: gloo closes its sockets and joins its threads."""
        self.pg, self._buf, self._pending, self._side = None, None, None, []  # type: ignore[assignment]

    def broadcast_into(self, tensor: torch.Tensor, src: int, check: Callable[[], None]) -> torch.Tensor:
        """Broadcast from group rank ``src`` in place: ``src`` sends ``tensor``, every other rank receives into it.

        Unlike the other collectives this works on the caller's tensor (the state
        transfer, :mod:`unbroken.runtime.state_transfer`, streams a joiner's state
        straight into its own tensors, chunk by chunk, with no copy of the state):
        ``src`` only reads it; a receiver's tensor is meaningful only once the
        transfer has completed, and a late write by an abandoned transfer carries
        the same bytes the next attempt sends. Returns ``tensor``.

        Raises:
            ValueError: ``tensor`` is not contiguous or not on the group's device.
            CollectiveFailed: the broadcast failed or outlived the group's timeout.
        """
        if tensor.device.type != self.device.type or not tensor.is_contiguous():
            raise ValueError(f"broadcast_into needs a contiguous tensor on {self.device}, got one on {tensor.device}"
                             f"{'' if tensor.is_contiguous() else ' (not contiguous)'}")
        if self.size == 1:
            return tensor
        work = self._post(lambda: self.pg.broadcast(tensor, src), "broadcast")
        self._poll(work, check, "broadcast")
        return tensor


_PARKED: list[ViewGroup] = []
"""Abandoned groups whose last operation is still pending: referenced until it ends, so no destructor
blocks on a stuck operation."""
