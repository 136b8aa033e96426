"""One background checkpoint write at a time, and the host buffers it reads.

A checkpointer (:class:`~unbroken.checkpoint.checkpointer.AsyncCheckpointer`, a sharded run's
:class:`~unbroken.checkpoint.sharded.ShardCheckpointer`) copies the state into host buffers kept from one save
to the next (:class:`~unbroken.checkpoint.writer.HostStage`) and writes them on a thread of its own while
training goes on. On a slow file system a write can outlast the next save and even the checkpointer's patience.
Copying the next step's state into the buffers it still reads would commit a checkpoint whose files mix two
steps and still match their checksums (each file is hashed as it is written), so a save that finds the previous
write running after its timeout is skipped instead (:meth:`WriteSlot.settle`): the previous one goes on and
commits one step's state, the next due checkpoint is tried again. That loses one checkpoint on storage that
cannot keep up, never the state's consistency, and costs no second set of buffers.

Invariants:
- The stage's buffers are never copied into while a write reads them (:meth:`HostStage.copy` refuses).
- A write either commits (its commit record, a part's marker) or is given up on, never both: the writer claims
  its commit and a waiter that stops waiting claims the give-up, under one lock, and the second yields
  (:class:`WriteClaim`). A write given up on removes what it wrote when it ends; its buffers stay lent to it
  until then.
"""

from __future__ import annotations

import dataclasses
import threading
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable

from unbroken.checkpoint.writer import HostStage

__all__ = ["Write", "WriteClaim", "WriteSlot"]


class WriteClaim:
    """Decides once whether a background write commits or was given up on: the first of :meth:`commit` (the
    writer, just before it commits) and :meth:`give_up` (a waiter that stops waiting) wins."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._outcome: str | None = None

    def commit(self) -> bool:
        """The writer may commit (False: it was given up on; it removes what it wrote)."""
        return self._decide("commit")

    def give_up(self) -> bool:
        """The write will never commit (False: its commit is already under way)."""
        return self._decide("give up")

    def _decide(self, outcome: str) -> bool:
        with self._lock:
            self._outcome = self._outcome or outcome
            return self._outcome == outcome


@dataclasses.dataclass
class Write:
    """The write of one save: its step, its thread's future, its claim, whether a waiter gave up on it."""

    step: int
    future: Future[Any]
    claim: WriteClaim
    given_up: bool = False


class WriteSlot:
    """A checkpointer's one background write and the :class:`HostStage` it reads."""

    def __init__(self, thread_name: str) -> None:
        self.stage = HostStage()
        self.pending: Write | None = None
        """The write not yet collected (running, given up on and still running, or ended)."""
        self._thread_name = thread_name
        self._pool: ThreadPoolExecutor | None = None

    def submit(self, step: int, fn: Callable[..., Any], *args: Any, reads_stage: bool) -> None:
        """Run ``fn(*args, claim)`` in the background as the write of ``step``, after the pending one (the slot
        is free: :meth:`settle` returned None; or the pending write was given up on and ``fn`` does not read the
        stage). ``reads_stage``: ``args`` hold the stage's copies, lent to it until it ends."""
        assert self.pending is None or (self.pending.given_up and not reads_stage), "a write is still pending"
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=self._thread_name)
        claim = WriteClaim()
        future = self._pool.submit(fn, *args, claim)
        if reads_stage:
            self.stage.lend(future)
        self.pending = Write(step, future, claim)

    def settle(self, timeout_s: float) -> int | None:
        """Before a save: wait up to ``timeout_s`` for the pending write to end (also one given up on) and
        collect it. Returns its step while it still runs (the save is then skipped), else None.

        Raises:
            Exception: what the write raised.
        """
        pending = self.pending
        if pending is None:
            return None
        futures.wait([pending.future], timeout=timeout_s)
        if not pending.future.done():
            return pending.step
        self._collect()
        return None

    def wait(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the pending write to end and collect it (one given up on is not waited
        for again); False while it still runs.

        Raises:
            Exception: what the write raised.
        """
        pending = self.pending
        if pending is None:
            return True
        if not pending.given_up:
            futures.wait([pending.future], timeout=timeout_s)
        if not pending.future.done():
            return False
        self._collect()
        return True

    def give_up(self) -> bool | None:
        """Stop waiting for the pending write, which still runs: True if it will never commit, False if its
        commit was already under way, None if it was given up on before (or nothing is pending)."""
        pending = self.pending
        if pending is None or pending.given_up:
            return None
        pending.given_up = True
        return pending.claim.give_up()

    def close(self) -> None:
        """Release the thread: at once if a write given up on still runs (it ends on its own), else after the
        pending write (call :meth:`wait` first)."""
        if self._pool is not None:
            self._pool.shutdown(wait=self.pending is None)

    def _collect(self) -> None:
        pending, self.pending = self.pending, None
        assert pending is not None
        pending.future.result()
