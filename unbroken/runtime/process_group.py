"""A process group per view, with collectives that can be abandoned.

Each view ``g`` gets its own group, rendezvoused on the store the job store
hands out for it (:meth:`~unbroken.runtime.job_store.JobStore.group_store`,
keys ``pg/<g>/...``; gloo on CPU, NCCL on CUDA), built directly rather than through
the global default group so that groups can come and go.

Collectives are started asynchronously and polled. Between polls the caller's
``check`` runs (failure detector, view watcher) and may raise to abandon the
collective. An abandoned group is never used again: gloo, whose pending
operation may still be blocked on a silent peer, is parked until that peer is
fenced (killed), which unblocks it; NCCL is aborted. Every collective works on
a buffer owned by the group, never on the caller's tensor, so a late write by an
abandoned operation can never corrupt state: the buffer is reused from one step
to the next (no allocation, no page faults on the hot path) and is parked with
its group when the group is abandoned.
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
                 timeout_s: float) -> None:
        self.gen, self.rank, self.size, self.device = gen, rank, size, device
        self.timeout = timedelta(seconds=timeout_s)
        t0 = time.perf_counter()
        if device.type == "cuda":
            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self.pg: dist.ProcessGroup = dist.ProcessGroupNCCL(rendezvous, rank, size, opts)
        else:
            self.pg = dist.ProcessGroupGloo(rendezvous, rank, size, self.timeout)
        self.build_s = time.perf_counter() - t0
        self._buf: torch.Tensor | None = None

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
        work = self.pg.allreduce([buf])
        if after_post is not None:
            after_post()
        self._poll(work, check, "all-reduce")
        return buf

    def broadcast(self, tensor: torch.Tensor, src: int, check: Callable[[], None]) -> torch.Tensor:
        """Broadcast from group rank ``src``; returns the received tensor (a copy)."""
        buf = tensor.detach().clone().to(self.device)
        if self.size == 1:
            return buf
        work = self.pg.broadcast(buf, src)
        self._poll(work, check, "broadcast")
        return buf

    def _poll(self, work: dist.Work, check: Callable[[], None], what: str) -> None:
        """Wait for ``work``, running ``check`` every ``CHECK_S`` until it completes.

        gloo: a timed ``work.wait`` blocks in C++ and returns the moment the
        collective completes (its "timed out" error leaves the operation running);
        CUDA: woken by the work's future.
        """
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
        try:
            work.wait()
        except RuntimeError as exc:
            raise CollectiveFailed(f"{what} of view {self.gen} failed: {str(exc).splitlines()[0]}") from None

    def _tick(self, check: Callable[[], None], deadline: float, what: str) -> None:
        check()
        if time.monotonic() > deadline:
            raise CollectiveFailed(f"{what} of view {self.gen} did not finish within {self.timeout}")

    def abandon(self) -> None:
        """Stop using this group. NCCL: abort now. gloo: see the module docstring."""
        if self.device.type == "cuda":
            try:
                self.pg.abort()
            except Exception as exc:  # best effort: the group is never used again
                logger.warning("abort of view %d group failed: %s", self.gen, exc)
        _PARKED.append(self)


_PARKED: list[ViewGroup] = []
"""Abandoned groups stay referenced so no destructor blocks on a stuck operation."""
