"""Warm standby: one pre-started worker process per node, handed a dead worker's id.

The worker side is ``python -m unbroken.agent.worker_process ... --standby
--node-rank R`` (no ``--worker``; see ``unbroken.runtime.worker.standby``): it
imports everything, loads the data and builds its model, then waits for an
assignment; one that sees ``done`` or ``failed`` exits 0. Through the job
store's ``standby_*`` methods (keys ``standby/<R>/...``):

- ready: the standby announces its pid once it has imported everything and
  built its model; the agent clears it before starting a new standby.
- offer: the agent hands over the fault indices of the worker it is to become
  ("" for none) and offers the worker id by compare-and-set from ""; the
  standby claims it by compare-and-set to ``claimed:<pid>`` and continues as
  ``--worker <id> --join``; the agent then resets the offer to "".
  An offer not claimed within ``CLAIM_TIMEOUT_S`` is retracted by
  compare-and-set back to "", so exactly one of "claimed" or "retracted" wins.

Invariants: at most one standby process and one assignment per node at a
time; an unclaimed assignment never leaves a worker without a process (the
agent spawns it afresh); a standby that keeps dying is given up on, not
restarted in a loop.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from unbroken.agent._process import remove_pid, send, spawn, stop_all, write_pid
from unbroken.runtime.job_store import JobStore

logger = logging.getLogger(__name__)

CLAIM_TIMEOUT_S = 2.0
"""A ready standby polls every few ms; one that has not claimed in this long is hung."""
RESPAWN_INTERVAL_S = 5.0
"""Least time between two standby starts (a crashing standby must not spin)."""
MAX_FAILURES = 3
"""Standbys that died unassigned before standby is given up for this agent's life."""


@dataclass(frozen=True, kw_only=True)
class Handover:
    """Outcome of an assignment: ``proc`` became ``worker``, or (``proc`` None) it must be spawned afresh."""

    worker: int
    proc: subprocess.Popen[bytes] | None
    wait_s: float
    faults: str = ""
    """The faults handed to the standby with the assignment (what it will inject)."""


class Standby:
    """The agent's side of one node's warm standby."""

    def __init__(self, store: JobStore, *, node: int, cmd: list[str], run_dir: Path, grace_s: float) -> None:
        self.store, self.node, self.cmd, self.run_dir, self.grace_s = store, node, cmd, run_dir, grace_s
        self.proc: subprocess.Popen[bytes] | None = None
        self._assigned: tuple[int, float, str] | None = None  # (worker, monotonic time of assignment, faults)
        self._last_start = -RESPAWN_INTERVAL_S
        self._failures = 0
        self.enabled = True

    def ready(self) -> bool:
        """A live standby that said it is ready and holds no assignment."""
        if self.proc is None or self._assigned is not None or self.proc.poll() is not None:
            return False
        return self.store.standby_ready_pid(self.node) == str(self.proc.pid)

    def assign(self, worker: int, faults: str) -> bool:
        """Offer ``worker`` to the ready standby; ``False``: none ready, spawn it yourself."""
        if not self.ready():
            return False
        if not self.store.standby_offer(self.node, worker, faults):
            logger.warning("[node %d] standby assign key busy; spawning worker %d afresh", self.node, worker)
            return False
        self._assigned = (worker, time.monotonic(), faults)
        return True

    def tick(self, now: float) -> Handover | None:
        """Keep a standby running and settle a pending assignment."""
        if self._assigned is not None:
            return self._settle(now)
        if self.proc is not None and self.proc.poll() is not None:
            self._failures += 1
            logger.warning("[node %d] standby pid %d died unassigned (code %s)", self.node, self.proc.pid,
                           self.proc.returncode)
            self.proc = None
            if self._failures >= MAX_FAILURES:
                logger.error("[node %d] %d standbys died unassigned: standby disabled; see logs/standby%d.log",
                             self.node, self._failures, self.node)
                self.enabled = False
        if self.enabled and self.proc is None and now - self._last_start >= RESPAWN_INTERVAL_S:
            self._last_start = now
            self.store.standby_clear_ready(self.node)
            self.proc = spawn(self.cmd, log=self.run_dir / "logs" / f"standby{self.node}.log",
                              header=f"node {self.node} standby: " + " ".join(self.cmd))
            write_pid(self._pid_file, self.proc.pid)
            logger.info("[node %d] standby started (pid %d)", self.node, self.proc.pid)
        return None

    @property
    def _pid_file(self) -> Path:
        return self.run_dir / "pids" / f"standby{self.node}"

    def _settle(self, now: float) -> Handover | None:
        assert self._assigned is not None and self.proc is not None
        worker, t0, faults = self._assigned
        retract = now - t0 >= CLAIM_TIMEOUT_S or self.proc.poll() is not None
        claimed = self.store.standby_settle(self.node, worker, self.proc.pid, retract=retract)
        if claimed is None:
            return None
        proc, self.proc, self._assigned = self.proc, None, None
        self._last_start = -RESPAWN_INTERVAL_S  # a used standby is replaced at once
        remove_pid(self._pid_file, proc.pid)
        if claimed:
            return Handover(worker=worker, proc=proc, wait_s=now - t0, faults=faults)
        logger.warning("[node %d] standby pid %d did not claim worker %d within %.1f s: replacing it",
                       self.node, proc.pid, worker, CLAIM_TIMEOUT_S)
        stop_all([proc], grace_s=self.grace_s)
        return Handover(worker=worker, proc=None, wait_s=now - t0)

    def kill_now(self) -> None:
        """SIGKILL the standby at once (the node is being lost)."""
        if self.proc is not None:
            send(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        self.enabled = False
        if self.proc is not None:
            stop_all([self.proc], grace_s=self.grace_s)
            remove_pid(self._pid_file, self.proc.pid)
            self.proc = None
