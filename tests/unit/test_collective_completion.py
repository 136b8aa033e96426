"""When is a collective finished? ``ViewGroup`` waits for the device, never for the work's future.

NCCL marks ``work.get_future()`` complete when the collective is *enqueued*, not
when it has run: the ``Work.get_future`` docstring says so ("``fut.done()`` only
means enqueued" for GPU work), and on an H100 the callback fired within 50 ms
while ``work.is_completed()`` stayed False for another second. A vote cast on the
future commits a reduction that a peer's death can still leave half done. These
tests drive ``ViewGroup``'s wait with a work object that behaves that way (its
future is done at once, its ``is_completed`` only later), on a CPU: the rule is
the same code for every backend.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from torch.futures import Future

from unbroken.runtime import process_group
from unbroken.runtime.membership import Fenced
from unbroken.runtime.process_group import AbortHung, CollectiveFailed, ViewGroup

pytestmark = pytest.mark.timeout(60)


class EnqueuedWork:
    """An NCCL-like work: the future completes at enqueue, the collective later (:meth:`finish`)."""

    def __init__(self) -> None:
        self.fut: Future[list[torch.Tensor]] = Future()
        self.fut.set_result([])  # what ProcessGroupNCCL does right after launching the kernel
        self.done = threading.Event()
        self.error: RuntimeError | None = None

    def finish(self, error: RuntimeError | None = None) -> None:
        self.error = error
        self.done.set()

    def get_future(self) -> Future[list[torch.Tensor]]:
        return self.fut

    def is_completed(self) -> bool:
        return self.done.is_set()

    def get_future_result(self) -> Future[int]:
        """c10d's WorkResult: COMM_ERROR (2) as soon as the completion check sees the error; SUCCESS (0) only
        later, from NCCL's watchdog (left unset here, as it is right after completion)."""
        result: Future[int] = Future()
        if self.done.is_set() and self.error is not None:
            result.set_result(2)
        return result

    def wait(self, timeout: object = None) -> bool:
        return True  # NCCL's untimed wait only makes the current stream wait: it returns at once


class HangingAbortGroup:
    """A process group whose ``abort`` blocks (``ncclCommAbort`` can hang) until released."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.calls = 0

    def abort(self) -> None:
        self.calls += 1
        self.release.wait(30)


def _gpu_group(pg: object = None) -> ViewGroup:
    """A ViewGroup of a CUDA view without connecting (only its waiting and abort logic run)."""
    g = ViewGroup.__new__(ViewGroup)
    g.gen, g.rank, g.size, g.device, g.nccl = 3, 0, 2, torch.device("cuda", 0), True
    g.timeout = process_group.timedelta(seconds=20)
    g._buf, g._pending, g._side, g._aborted = torch.zeros(4), None, [], False
    g.pg = pg  # type: ignore[assignment]
    return g


def test_the_wait_ends_when_the_collective_completes_not_when_its_future_does():
    g, work = _gpu_group(), EnqueuedWork()
    assert work.get_future().done(), "the future is done at enqueue, as NCCL's"
    checks: list[bool] = []

    def check() -> None:  # the failure detector: runs while the collective is in flight
        checks.append(work.is_completed())
        if len(checks) == 3:
            work.finish()

    g._poll(work, check, "all-reduce")  # type: ignore[arg-type]
    assert work.is_completed(), "returned only once the collective had completed"
    assert checks == [False, False, False], "the failure detector ran while the collective was in flight"
    assert g._pending is None


def test_a_collective_that_completes_with_an_error_fails():
    g, work = _gpu_group(), EnqueuedWork()
    threading.Timer(0.05, work.finish, [RuntimeError("NCCL error: remote process exited")]).start()
    with pytest.raises(CollectiveFailed, match="all-reduce of view 3 failed: NCCL reported COMM_ERROR$"):
        g._poll(work, lambda: None, "all-reduce")  # type: ignore[arg-type]


def test_a_check_that_raises_abandons_the_pending_collective():
    g, work = _gpu_group(), EnqueuedWork()

    def check() -> None:
        raise TimeoutError("worker 1 judged dead")

    with pytest.raises(TimeoutError, match="judged dead"):
        g._poll(work, check, "all-reduce")  # type: ignore[arg-type]
    assert g._pending is work, "still pending: the abandoned group is parked, not destroyed"


def test_a_hung_abort_costs_at_most_its_deadline_then_the_worker_leaves(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(process_group, "ABORT_DEADLINE_S", 0.3)
    pg = HangingAbortGroup()
    g = _gpu_group(pg)
    t0 = time.monotonic()
    try:
        with pytest.raises(AbortHung, match="did not return within 0.3 s") as raised:
            g.abandon()
    finally:
        pg.release.set()
    assert 0.3 <= time.monotonic() - t0 < 2.0
    assert isinstance(raised.value, Fenced), "a worker that cannot abort leaves and rejoins, as a fenced one"
    assert pg.calls == 1 and g._aborted


def test_work_of_an_aborted_group_never_counts_as_a_result():
    """After an abort NCCL skips its error check: an aborted work may read as completed without error."""
    pg = HangingAbortGroup()
    pg.release.set()  # this abort returns at once
    g, work = _gpu_group(pg), EnqueuedWork()
    g._pending = work
    work.finish()
    g._abort()
    assert g.late_result(0.1) is None
    with pytest.raises(CollectiveFailed, match="was aborted"):
        g._poll(work, lambda: None, "all-reduce")  # type: ignore[arg-type]
