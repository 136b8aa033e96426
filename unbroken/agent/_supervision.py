"""Start-up supervision: an agent watches its workers until they are members of the view, and its standby.

Members of the current view are judged by their peers
(:mod:`unbroken.runtime.membership`: heartbeat timeout, dead mark, fencing by
the agent). Before that, while a worker starts (imports, data, model) or waits
to be admitted, nobody but its own agent can see it: without this watch one
that hangs there stays hung, in no view, for the rest of the run. The warm
standby is in no view at all.

The signal is a heartbeat counter in the job store, judged on the agent's own
clock: a worker's ``hb/<w>``, beaten every 100 ms by the thread that
:func:`unbroken.runtime.worker_entry.run` starts right after connecting (before the
job is built); the standby's ``hb/standby/<R>``, beaten every 100 ms while it
waits for an offer (the first beat just before it announces readiness). A
SIGSTOPped process beats no more. A watched process is **stalled** when

- its counter has not moved since it was started, for ``deadline_s`` (the
  start-up deadline: imports, data load, model build; default the agent's
  ``--timeout-s``, generous), or
- its counter moved, then stood still for ``liveness_s`` (the start-up
  liveness timeout; default ``max(2 * fault.heartbeat_timeout_s, 5 s)``).

The agent then fences a stalled worker (SIGKILL) and its usual exit path
marks the death and restarts it as a joiner; a stalled standby is killed
(never waited for) and replaced.

Invariants: a worker is judged here only while it is not a member of the
current view (a joiner: until a view newer than the one current at its start
holds it), so no worker is judged by its peers and by its agent at once;
silence counts only while the agent kept watching (after a gap in its own
checks, as in :class:`unbroken.runtime.membership.Membership`, the clocks
restart), so a stalled agent or store never gets a healthy process killed; a
check is a few store round trips, at most once per ``CHECK_S``, and never
blocks.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from typing import Any

from unbroken.agent._process import Child
from unbroken.store.job_store import JobStore
from unbroken.store.view import View

CHECK_S = 0.1
"""How often the counters are read (a heartbeat's period)."""
LIVENESS_FLOOR_S = 5.0
"""The least default start-up liveness timeout: a starting worker shares its machine with busy ones."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class Limits:
    """How long a starting process may go without a heartbeat."""

    liveness_s: float
    """Its counter moved, then stood still this long: stalled."""
    deadline_s: float
    """Its counter has not moved at all this long after it started: stalled."""

    @classmethod
    def defaults(cls, *, heartbeat_timeout_s: float, timeout_s: float, liveness_s: float | None = None,
                 deadline_s: float | None = None) -> Limits:
        """The documented defaults (module docstring) for what was not given."""
        return cls(liveness_s=liveness_s if liveness_s is not None else max(2 * heartbeat_timeout_s, LIVENESS_FLOOR_S),
                   deadline_s=deadline_s if deadline_s is not None else timeout_s)


@dataclasses.dataclass(kw_only=True)
class Pulse:
    """One process's heartbeat counter as its agent sees it (times on the agent's monotonic clock)."""

    count: int
    started: float
    since: float
    """When the count last changed (or, before it ever did, when watching began)."""
    beaten: bool = False

    @classmethod
    def start(cls, count: int, now: float) -> Pulse:
        return cls(count=count, started=now, since=now)

    def see(self, count: int, now: float) -> None:
        if count != self.count:
            self.count, self.since, self.beaten = count, now, True

    def excuse(self, gap: float, now: float) -> None:
        """The observer did not watch for ``gap`` seconds: that time counts against nobody."""
        self.started = min(self.started + gap, now)
        self.since = now

    def stalled(self, now: float, limits: Limits) -> dict[str, Any] | None:
        """Why the process counts as hung (a reason record), or None."""
        if self.beaten:
            silent = now - self.since
            if silent > limits.liveness_s:
                return {"how": "startup_silent", "silent_s": round(silent, 3), "limit_s": limits.liveness_s}
            return None
        waited = now - self.started
        if waited > limits.deadline_s:
            return {"how": "startup_deadline", "waited_s": round(waited, 3), "limit_s": limits.deadline_s}
        return None


def decode_mark(text: str) -> Any:
    """A dead mark as a record (marks are JSON by convention; anything else stays text)."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


class ObserverClock:
    """Whether the observer itself kept watching between two checks (see the module docstring)."""

    def __init__(self, liveness_s: float) -> None:
        self.tolerance = liveness_s / 2
        self.last = -math.inf

    def unwatched(self, before: float, after: float) -> float:
        """Seconds not watched since the previous check (0: it kept watching).

        ``before``/``after`` bracket this check's store reads: a slow read is a
        gap too (the store stalled, so nobody's beats could be seen).
        """
        last, self.last = self.last, after
        if before - last > self.tolerance or after - before > self.tolerance:
            return after - last if last > -math.inf else 0.0
        return 0.0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Restart:
    """When a dead worker of this node comes back: at a time (monotonic), or once progress reaches a step."""

    at_time: float | None = None
    at_step: int | None = None


@dataclasses.dataclass(kw_only=True)
class Incarnation:
    """One incarnation of a worker of this node, as its agent supervises it."""

    worker: int
    proc: Child
    incarnation: int
    join: bool
    started: float
    mark_at_spawn: str | None  # a dead/<w> mark left by the previous incarnation
    born: float = dataclasses.field(default_factory=time.time)
    """Wall-clock time of its start (its event records from then on are its own)."""
    fenced: bool = False
    reason: Any = None
    """Why it was fenced: the dead mark a peer wrote, or this watch's verdict."""


@dataclasses.dataclass(kw_only=True)
class _Watched:
    pulse: Pulse
    join: bool
    gen: int
    """The newest generation when it started (-1: none yet)."""

    def admitted(self, worker: int, view: View | None) -> bool:
        """A member of the current view, and so judged by its peers from now on."""
        if view is None or worker not in view.members:
            return False
        # A joiner's predecessor may still be listed in the view current at its start.
        return not self.join or view.gen > self.gen


class StartupWatch:
    """The agent's watch over its workers that are not (yet) members of the current view."""

    def __init__(self, store: JobStore, limits: Limits, *, node: int) -> None:
        self.store, self.limits, self.node = store, limits, node
        self._watched: dict[int, _Watched] = {}
        self._clock = ObserverClock(limits.liveness_s)
        self._view: View | None = None
        self._next = 0.0

    def watch(self, worker: int, now: float, *, join: bool) -> None:
        """A new incarnation of ``worker`` started (or a standby became it) at ``now``."""
        gen = self.store.gen() if self.store.has_view() else -1
        count = self.store.heartbeats([worker])[0]
        self._watched[worker] = _Watched(pulse=Pulse.start(count, now), join=join, gen=gen)

    def forget(self, worker: int) -> None:
        self._watched.pop(worker, None)

    def stalled(self, now: float) -> dict[int, dict[str, Any]]:
        """The watched workers that stalled before admission, with why (a dead-mark-like reason record).

        Reads the store at most once per ``CHECK_S``; a stalled worker is reported until it is forgotten.
        """
        if not self._watched or now < self._next:
            return {}
        self._next = now + CHECK_S
        view = self._current_view()
        workers = list(self._watched)
        counts = self.store.heartbeats(workers)
        after = time.monotonic()
        gap = self._clock.unwatched(now, after)
        out = {}
        for w, count in zip(workers, counts):
            watched = self._watched[w]
            if gap:
                watched.pulse.excuse(gap, after)
            watched.pulse.see(count, after)
            if not watched.admitted(w, view):
                reason = watched.pulse.stalled(after, self.limits)
                if reason is not None:
                    out[w] = {"by": "agent", "node": self.node, **reason}
        return out

    def _current_view(self) -> View | None:
        """The current view, read again only when the generation moved."""
        if not self.store.has_view():
            return None
        if self._view is None or self._view.gen != self.store.gen():
            self._view = self.store.current_view()
        return self._view
