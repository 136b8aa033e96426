"""Warm standby: one pre-started worker process per node, handed a dead worker's id.

The worker side is ``python -m unbroken.agent.worker_process ... --standby
--node-rank R`` (no ``--worker``; see ``unbroken.runtime.worker_entry.standby``): it
imports everything, loads the data and builds its model, then waits for an
assignment; one that sees ``done`` or ``failed`` exits 0. Through the job
store's ``standby_*`` methods (keys ``standby/<R>/...``):

- ready: the standby announces its pid once it has imported everything and
  built its model; the agent clears it before starting a new standby.
- heartbeat: from just before it announces readiness, the standby adds 1 to
  its node's counter every 100 ms while it waits. The agent judges it as a
  starting worker (:mod:`unbroken.agent._supervision`): not ready within the
  start-up deadline, or silent for the start-up liveness timeout once it
  beat, it is SIGKILLed and replaced; one silent for ``OFFER_SILENCE_S`` is
  offered nothing (the worker is spawned afresh instead).
- offer: the agent hands over the fault indices of the worker it is to become
  ("" for none) and offers the worker id by compare-and-set from ""; the
  standby claims it by compare-and-set to ``claimed:<pid>`` and continues as
  ``--worker <id> --join``; the agent then resets the offer to "".
  An offer not claimed within ``CLAIM_TIMEOUT_S`` is retracted by
  compare-and-set back to "", so exactly one of "claimed" or "retracted" wins.
  An offer whose worker a whole-job restore names meanwhile is withdrawn the
  same way before the agent starts that worker itself (:meth:`Standby.withdraw`;
  the standby stays one), or, if the claim won, the standby is that worker.

Invariants: at most one live standby process and one assignment per node at
a time; an unclaimed assignment never leaves a worker without a process (the
agent spawns it afresh), and a worker with an offer pending is never started
by anyone else (one process per worker); a standby that keeps dying or hanging is given up on,
not restarted in a loop; nothing here waits for a process: a standby that is
let go (unclaimed, hung, or the job is over) holds no state, so it is
SIGKILLed and reaped by a later tick.
"""

from __future__ import annotations

import json
import logging
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from unbroken.agent._process import describe_exit, remove_pid, send, spawn, write_pid
from unbroken.agent._supervision import CHECK_S, Limits, ObserverClock, Pulse
from unbroken.store.job_store import JobStore

logger = logging.getLogger(__name__)

CLAIM_TIMEOUT_S = 2.0
"""A ready standby polls every ``STANDBY_POLL_S`` (20 ms); one that has not claimed in this long is hung."""
RESPAWN_INTERVAL_S = 5.0
"""Least time between two standby starts (a crashing standby must not spin)."""
MAX_FAILURES = 3
"""Standbys that died, hung or did not claim before standby is given up for this agent's life."""
OFFER_SILENCE_S = 1.0
"""A standby whose counter stood still this long (ten beats) is offered nothing."""


@dataclass(frozen=True, kw_only=True)
class Handover:
    """Outcome of an assignment: ``proc`` became ``worker``, or (``proc`` None) it must be spawned afresh."""

    worker: int
    proc: subprocess.Popen[bytes] | None
    wait_s: float
    faults: str = ""
    """The faults handed to the standby with the assignment (what it will inject)."""
    restore_gen: int | None = None
    """The restored view the worker was started for (the offer's), if any."""


class Standby:
    """The agent's side of one node's warm standby."""

    def __init__(self, store: JobStore, *, node: int, cmd: list[str], run_dir: Path, limits: Limits,
                 launch: Callable[..., Any] = spawn) -> None:
        """``launch(cmd, log=, header=)`` starts its process (the agent's: forked from the node's template)."""
        self.store, self.node, self.cmd, self.run_dir, self.limits = store, node, cmd, run_dir, limits
        self._launch = launch
        self.proc: subprocess.Popen[bytes] | None = None
        self._pulse: Pulse | None = None
        self._clock = ObserverClock(limits.liveness_s)
        self._next_check = 0.0
        self._dropped: list[subprocess.Popen[bytes]] = []  # SIGKILLed, not reaped yet
        # (worker, monotonic time of assignment, faults, the offer as written)
        self._assigned: tuple[int, float, str, str] | None = None
        self._last_start = -RESPAWN_INTERVAL_S
        self._failures = 0
        self.enabled = True

    def ready(self) -> bool:
        """A live standby that said it is ready, holds no assignment and beat within ``OFFER_SILENCE_S``."""
        if self.proc is None or self._assigned is not None or self.proc.poll() is not None:
            return False
        if self.store.standby_ready_pid(self.node) != str(self.proc.pid):
            return False
        assert self._pulse is not None
        now = time.monotonic()
        self._pulse.see(self.store.standby_beat(self.node, 0), now)
        if now - self._pulse.since > OFFER_SILENCE_S:
            logger.warning("[node %d] standby pid %d silent for %.1f s: not offering it a worker", self.node,
                           self.proc.pid, now - self._pulse.since)
            return False
        return True

    def assign(self, worker: int, faults: str, restore_gen: int | None = None) -> bool:
        """Offer ``worker`` (started for restored view ``restore_gen``, if given) to the ready standby;
        ``False``: none ready, spawn it yourself."""
        if not self.ready():
            return False
        offer = self.store.standby_offer(self.node, worker, faults, restore_gen)
        if offer is None:
            logger.warning("[node %d] standby assign key busy; spawning worker %d afresh", self.node, worker)
            return False
        self._assigned = (worker, time.monotonic(), faults, offer)
        return True

    def tick(self, now: float) -> Handover | None:
        """Reap, settle a pending assignment, replace a dead or hung standby; never waits."""
        self._reap()
        if self._assigned is not None:
            return self._settle(now)
        if not self.enabled:
            return None
        if self.proc is not None and self.proc.poll() is not None:
            self._lost(f"died unassigned ({describe_exit(self.proc.returncode)})")
        elif self.proc is not None and now >= self._next_check:
            self._judge(now)
        if self.enabled and self.proc is None and now - self._last_start >= RESPAWN_INTERVAL_S:
            self._start(now)
        return None

    def _start(self, now: float) -> None:
        self._last_start = now
        self.store.standby_clear_ready(self.node)
        self._pulse = Pulse.start(self.store.standby_beat(self.node, 0), now)
        self.proc = self._launch(self.cmd, log=self.run_dir / "logs" / f"standby{self.node}.log",
                                 header=f"node {self.node} standby: " + " ".join(self.cmd))
        write_pid(self._pid_file, self.proc.pid)
        logger.info("[node %d] standby started (pid %d)", self.node, self.proc.pid)

    def _judge(self, now: float) -> None:
        """Kill and replace a standby that stalled (module docstring)."""
        assert self.proc is not None and self._pulse is not None
        self._next_check = now + CHECK_S
        count = self.store.standby_beat(self.node, 0)
        after = time.monotonic()
        gap = self._clock.unwatched(now, after)
        if gap:
            self._pulse.excuse(gap, after)
        self._pulse.see(count, after)
        reason = self._pulse.stalled(after, self.limits)
        if reason is not None:
            self._drop(self.proc)
            self._lost(f"stalled ({reason}): killed")
            self._last_start = -RESPAWN_INTERVAL_S  # replace it at once; MAX_FAILURES stops a loop

    def _lost(self, what: str) -> None:
        """The standby is gone without becoming a worker: count it, give up after ``MAX_FAILURES``."""
        assert self.proc is not None
        self._failures += 1
        logger.warning("[node %d] standby pid %d %s", self.node, self.proc.pid, what)
        self.proc = None
        if self._failures >= MAX_FAILURES:
            logger.error("[node %d] %d standbys died, hung or did not claim: standby disabled; see "
                         "logs/standby%d.log", self.node, self._failures, self.node)
            self.enabled = False

    @property
    def _pid_file(self) -> Path:
        return self.run_dir / "pids" / f"standby{self.node}"

    def _settle(self, now: float) -> Handover | None:
        assert self._assigned is not None and self.proc is not None
        worker, t0, faults, offer = self._assigned
        retract = now - t0 >= CLAIM_TIMEOUT_S or self.proc.poll() is not None
        claimed = self.store.standby_settle(self.node, offer, self.proc.pid, retract=retract)
        if claimed is None:
            return None
        self._last_start = -RESPAWN_INTERVAL_S  # a used standby is replaced at once
        if claimed:
            return self._handed(now)
        proc, self._assigned = self.proc, None
        self._drop(proc)
        self._lost(f"did not claim worker {worker} within {CLAIM_TIMEOUT_S:.1f} s: killed; replacing it")
        return Handover(worker=worker, proc=None, wait_s=now - t0, restore_gen=_restore_gen(offer))

    @property
    def offered(self) -> int | None:
        """The worker of the offer pending (neither claimed nor retracted yet), if any."""
        return self._assigned[0] if self._assigned is not None else None

    def withdraw(self, now: float) -> Handover:
        """Settle the pending offer at once (its worker must be started otherwise: a restored view names it):
        retracted by compare-and-set, so the standby can no longer claim it and stays a standby (it did nothing
        wrong); or, if its claim came first, honoured (``proc``: the standby is that worker now)."""
        assert self._assigned is not None and self.proc is not None, "no offer pending"
        worker, t0, _, offer = self._assigned
        if self.store.standby_settle(self.node, offer, self.proc.pid, retract=True):
            self._last_start = -RESPAWN_INTERVAL_S  # a used standby is replaced at once
            return self._handed(now)
        self._assigned = None
        logger.info("[node %d] offer of worker %d withdrawn from standby pid %d", self.node, worker, self.proc.pid)
        return Handover(worker=worker, proc=None, wait_s=now - t0, restore_gen=_restore_gen(offer))

    def _handed(self, now: float) -> Handover:
        """The standby claimed the offer it was made (``_assigned`` still set): it is that worker now."""
        assert self._assigned is not None and self.proc is not None
        worker, t0, faults, offer = self._assigned
        proc, self.proc, self._assigned = self.proc, None, None
        remove_pid(self._pid_file, proc.pid)
        return Handover(worker=worker, proc=proc, wait_s=now - t0, faults=faults, restore_gen=_restore_gen(offer))

    def _drop(self, proc: subprocess.Popen[bytes]) -> None:
        """SIGKILL a standby that holds no state; a later tick reaps it."""
        send(proc, signal.SIGKILL)
        self._dropped.append(proc)

    def _reap(self) -> None:
        for proc in [p for p in self._dropped if p.poll() is not None]:
            self._dropped.remove(proc)
            remove_pid(self._pid_file, proc.pid)

    def kill_now(self) -> None:
        """SIGKILL the standby at once (the node is being lost)."""
        if self.proc is not None:
            send(self.proc, signal.SIGKILL)

    def stop(self) -> None:
        """The job is over: no more standby (SIGKILLed now, reaped by a later tick or :meth:`close`)."""
        self.enabled = False
        self._assigned = None
        if self.proc is not None:
            self._drop(self.proc)
            self.proc = None

    def close(self) -> None:
        """The agent exits: SIGKILL and reap every standby process (waits only for the kernel)."""
        self.stop()
        for proc in self._dropped:
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                logger.error("[node %d] standby pid %d survived SIGKILL for 10 s", self.node, proc.pid)
        self._reap()


def _restore_gen(offer: str) -> int | None:
    """The restored view an offer (:meth:`JobStore.standby_offer`'s JSON, written by this agent) was made for."""
    gen = json.loads(offer).get("restore_gen")
    return int(gen) if gen is not None else None
