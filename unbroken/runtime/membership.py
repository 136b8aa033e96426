"""Membership: heartbeats, the failure detector and join requests of one worker.

The keys live in the job store (:mod:`unbroken.store.job_store`); this
module judges them. Views are proposed and read through the store as well.

Liveness is progress, not just a beating thread: the heartbeat thread
publishes two counters, its own beat and the main thread's progress (phases of
a step entered, :meth:`Membership.advance`). A member is dead to an observer
when its beat stands still for ``heartbeat_timeout_s`` (a crash, SIGSTOP, a
lost node) or its progress stands still for ``progress_timeout_s`` (a main
thread stuck outside Python while the heartbeat thread beats on), judged only
while the observer waits for it. Bounded work of the main thread that enters
no phase (the leader's validation and checkpoint saves, which may wait for the
previous save) runs inside :meth:`Membership.busy`: the heartbeat thread counts
progress for it meanwhile. A store error does not stop the heartbeat:
it retries with backoff until the hang timeout has passed.

Invariants: a worker marked dead never becomes a member again under the same
incarnation (its agent kills it: fencing); heartbeat liveness is judged on the
observer's own clock (counter changes), so no clock agreement is needed, and
only over time the observer itself kept watching: after a gap in its own
observations (it was not scheduled, or the store stalled) the clocks restart,
so a stall of the observer or of the store never gets peers declared dead. A gap
its own heartbeat thread beat through (the store answered it, this process ran:
its main thread was only busy computing) is no such stall: a counter that has
not moved since the observer last saw it was silent all along, and the clock
runs on (a hang is found a timeout after the last beat, not a timeout after the
observer's next wait began).
On etcd a counter another writer forged or deleted is read back through its
history to its newest authentic value (EtcdBackend.get_present); one with no
such value left (gone, or holding only values this launch did not write) is no
observation: it neither kills at
once nor restarts the clock, which runs from the last change of an authentic
value this observer saw, and such reads decide a silence only once they
have gone on, watched (looks less than half a timeout apart), for the limit
themselves; so a deleted or forged key never marks a live worker dead (its
next beat is a change) and never hides a silent one past two heartbeat
timeouts (one where the forged counter's history shows its last authentic
value: EtcdBackend.get_present). On etcd the counters also live under the worker's lease
(TTL ``LEASE_TTL_FACTOR`` heartbeat timeouts, refreshed by the beats): a dead
worker's keys expire by themselves, judged as silence like any other.

Counters can be deleted by anyone who can write to the store; a completed
collective cannot be faked by anyone outside it. So a member's silence clocks
also restart when this worker completes a collective with it
(:meth:`Membership.completed_with`: the reduction needed every peer's
contribution, posted by its main thread): a writer deleting a live worker's
counters after every beat never gets it declared dead while its peers' steps
complete, and a silently lost worker stalls those collectives, so nothing
restarts its clock and it is declared dead a heartbeat timeout after its last
sign of life.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from unbroken.mecefo.takeover import NoLiveWorker  # one notion of "nobody is alive", re-exported
from unbroken.store.job_store import JobStore
from unbroken.store.view import View

__all__ = ["EXIT_FENCED", "EXIT_REJOIN", "SHARD_LOST", "Fenced", "MemberDied", "Membership", "MissedCommit", "NoLiveWorker", "View",
           "ViewChanged"]

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.1
"""The shortest interval between a worker's beats; a longer heartbeat timeout beats less often
(:func:`beat_interval`: eight beats per timeout, at most every 0.25 s), each beat one store round trip (the
beat, the progress and the join requests batched: :meth:`JobStore.pulse`; three on a store that cannot)."""
BEATS_PER_TIMEOUT = 8
MAX_BEAT_INTERVAL_S = 0.25


def beat_interval(heartbeat_timeout_s: float) -> float:
    """How often a worker beats under ``heartbeat_timeout_s``."""
    return max(HEARTBEAT_INTERVAL_S, min(MAX_BEAT_INTERVAL_S, heartbeat_timeout_s / BEATS_PER_TIMEOUT))

LEASE_TTL_FACTOR = 2.0
"""On a store with leases (etcd) a worker's counters expire this many heartbeat timeouts after its last
beat: later than any observer's own judgement, so an expiry is proof of death, never a hasty verdict."""
EXIT_FENCED = 3
"""Exit code of a worker that left because it was fenced (not a member of the view)."""
EXIT_REJOIN = 7
SHARD_LOST = "shard lost"
"""The ``how`` of the dead mark a member writes itself when a shard of the state is lost with its copies (it
leaves, and once every member did, its agents restore the job from snapshot memory)."""
"""Exit code of a healthy worker that left to rejoin with the state (:class:`MissedCommit`): its agent
starts it again whatever its restart policy."""


class ViewChanged(Exception):
    """The current view was replaced; the caller must adopt the new one."""


FIRST_BEAT_FACTOR = 5.0
"""A member that has never beaten is declared dead after this many heartbeat timeouts (a start's grace: on a
loaded machine a process forked a moment after its peers may not beat for a few seconds)."""


class MemberDied(Exception):
    """The failure detector found dead members of the current view."""


class Fenced(Exception):
    """This worker is not a member of the current view: it must stop at once."""


class MissedCommit(Fenced):
    """A healthy member whose all-reduce failed (a peer died mid-collective) while the others completed and
    committed the step: it lacks the step's result, so it leaves and comes back with the state, whatever the
    agent's restart policy (not a failure of its own)."""


class Membership:
    """One worker's failure detector and heartbeat, over the job store."""

    def __init__(self, store: JobStore, worker: int, *, heartbeat_timeout_s: float,
                 progress_timeout_s: float | None = None, heartbeat_store: JobStore | None = None) -> None:
        self.store = store
        # Its own connection: a call blocked on the main one (a group rendezvous)
        # must never silence the heartbeat.
        self.heartbeat_store = heartbeat_store or store
        self.worker = worker
        self.heartbeat_timeout_s = heartbeat_timeout_s
        # A member whose counter is still 0 has not started yet (its first beat comes after its process, store
        # connection and heartbeat thread start): judged with a start's grace. Its agent marks it dead at once
        # if its process dies, and fences it if it hangs before the start-up deadline.
        self.first_beat_timeout_s = FIRST_BEAT_FACTOR * heartbeat_timeout_s
        self.progress_timeout_s = progress_timeout_s if progress_timeout_s is not None else math.inf
        self._hb_seen: dict[int, tuple[int, float]] = {}
        self._prog_seen: dict[int, tuple[int, float]] = {}
        self._unseen: dict[tuple[str, int], float] = {}
        """(counter, member): since when every read of it gave no observation (gone, or not authentic)."""
        self._progress = 0  # phases the main thread entered (written by it, published by the heartbeat thread)
        self._published = 0
        self._busy = 0  # nesting depth of busy() blocks of the main thread
        self._busy_ticks = 0  # progress the heartbeat thread counted for them
        self._last_watch = -math.inf
        self._last_pulse = -math.inf  # when the heartbeat thread's last pulse was answered (monotonic)
        self._pulse_gap_end = math.inf  # when its last gap of more than half a timeout between pulses ended
        self._deaths_seen = -1
        self._dead: set[int] = set()
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by stop() and by a leader's applied step: publish now
        self._applied: tuple[int, int] = (-1, 0)  # (view gen, steps its leader applied past its first): this one's
        self._applied_published: tuple[int, int] = (-1, 0)
        self._hb_thread: threading.Thread | None = None
        self._joins_seen = 0  # the ``joins`` counter as last read by the heartbeat thread
        self._joins_checked = -1  # the counter value at the last check that found no request

    # -- heartbeats ---------------------------------------------------------

    def start_heartbeat(self) -> None:
        """Publish liveness from a thread (keeps beating while the GIL is free in torch ops).

        The same thread reads the ``joins`` counter, so that checking for join
        requests at every step boundary costs no store round trip.
        """
        self.heartbeat_store.lease_liveness(self.worker, LEASE_TTL_FACTOR * self.heartbeat_timeout_s)
        self.heartbeat_store.beat(self.worker)
        self._joins_seen = self.heartbeat_store.joins()
        self._hb_thread = threading.Thread(target=self._beat, name=f"heartbeat-w{self.worker}", daemon=True)
        self._hb_thread.start()

    def _beat(self) -> None:
        """Beat every interval; on a store error retry with backoff until the hang timeout has passed."""
        interval = beat_interval(self.heartbeat_timeout_s)
        last_ok, delay = time.monotonic(), interval
        while True:
            self._wake.wait(delay)
            self._wake.clear()
            if self._stop.is_set():
                return
            try:
                self._publish()
                answered = time.monotonic()
                if answered - self._last_pulse > self.heartbeat_timeout_s / 2:
                    self._pulse_gap_end = answered
                self._last_pulse = answered
            except Exception as exc:  # the store did not answer: a hiccup, or it is gone for good
                if time.monotonic() - last_ok > self.heartbeat_timeout_s:
                    logger.error("heartbeat stopped: no store answer for %.1f s (%s)",
                                 time.monotonic() - last_ok, exc)
                    return
                delay = min(2 * delay, self.heartbeat_timeout_s / 4)
                logger.warning("heartbeat: store error (%s); retrying in %.2f s", exc, delay)
                continue
            last_ok, delay = time.monotonic(), interval

    def _publish(self) -> None:
        """One round trip (on a store that batches): the beat, the progress since the last, the joins; and the
        steps the leader applied (:meth:`applied`) when they changed, as a total (sent again after a failure,
        it counts nothing twice)."""
        if self._busy:
            self._busy_ticks += 1
        progress = self._progress + self._busy_ticks
        gen, steps = self._applied
        fresh = gen >= 0 and self._applied != self._applied_published
        self._joins_seen = self.heartbeat_store.pulse(self.worker, progress - self._published,
                                                      (gen, steps) if fresh else None)
        self._published = progress
        self._applied_published = (gen, steps)

    def applied(self, gen: int, first: int, done: int) -> None:
        """The leader of view ``gen`` (whose first step is ``first``) applied step ``done - 1``: the heartbeat
        thread publishes it at once, off the step's path (agents fire faults and the launcher measures progress
        by it: :meth:`JobStore.progress`)."""
        self._applied = (gen, done - first)
        self._wake.set()

    def advance(self) -> None:
        """The main thread entered a new phase of its work (the heartbeat thread publishes it)."""
        self._progress += 1

    @contextmanager
    def busy(self) -> Iterator[None]:
        """The main thread does bounded work that enters no phase (validation, a checkpoint save that waits
        for the previous one): the heartbeat thread advances its progress every beat until the block ends,
        so peers waiting for it never judge it stuck (every such wait has a timeout of its own)."""
        self._busy += 1
        try:
            yield
        finally:
            self._busy -= 1

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()

    # -- failure detection --------------------------------------------------

    def mark_dead(self, worker: int, reason: str) -> None:
        if self.store.mark_dead(worker, reason):
            logger.warning("declared worker %d dead: %s", worker, reason)
        self._dead.add(worker)

    def dead_members(self, view: View) -> set[int]:
        """Members of ``view`` marked dead, or silent for longer than the heartbeat timeout."""
        deaths = self.store.deaths()
        if deaths != self._deaths_seen:
            self._deaths_seen = deaths
            for w in view.members:
                if w not in self._dead and self.store.is_marked_dead(w):
                    self._dead.add(w)
        others = [w for w in view.members if w != self.worker and w not in self._dead]
        if others:
            before = time.monotonic()
            counters = self.store.liveness(others)
            now = time.monotonic()
            # Silence counts only while this observer kept watching: if it was itself stalled (not
            # scheduled, or the store did not answer), nobody's heartbeat could be seen, so the clocks
            # restart instead of blaming the others for the observer's own gap; a gap its heartbeat thread
            # was answered all through was only the main thread computing, and is no blindness.
            blind = ((before - self._last_watch > self.heartbeat_timeout_s / 2
                      and not self._beat_through(self._last_watch, before))
                     or now - before > self.heartbeat_timeout_s / 2)
            # A look long after the previous one (even one the heartbeat thread beat through) starts a new
            # streak of reads without observation (_judge): the reads in between are not there to count.
            watched = before - self._last_watch <= self.heartbeat_timeout_s / 2
            self._last_watch = now
            for w, counted in zip(others, counters):
                self._judge(w, counted, before, now, blind, watched)
        return self._dead & set(view.members)

    def _judge(self, w: int, counted: tuple[int | None, int | None], before: float, now: float, blind: bool,
               watched: bool) -> None:
        """Judge member ``w`` on its counters read at ``before .. now`` (None: gone; negative: not authentic).

        Silence is measured from the last change of an authentic counter this observer saw: a counter gone
        (its lease expired, or deleted by another writer) or holding a value this launch did not write is no
        observation, so it neither kills at once nor restarts the clock; a live worker's next beat is a change.
        Nor does one such read conclude a long silence the observer did not watch (its last look long ago): it
        judges only once the counter has given no observation for the limit itself."""
        last_beat = self._hb_seen.get(w)
        known = counted[0] if counted[0] is not None and counted[0] >= 0 else (last_beat[0] if last_beat else 0)
        # A counter gone from a published view's member (created at 0 when the view opened) beat before.
        hb_limit = self.heartbeat_timeout_s if known > 0 or counted[0] is None else self.first_beat_timeout_s
        for seen, got, limit, how in ((self._hb_seen, counted[0], hb_limit, "heartbeat"),
                                      (self._prog_seen, counted[1], self.progress_timeout_s, "no progress")):
            value = -1 if got is None else got
            last = seen.get(w)
            if value >= 0 or blind or not watched:
                self._unseen.pop((how, w), None)
            unseen = before if value >= 0 else self._unseen.setdefault((how, w), before)
            if last is None or blind or (value >= 0 and last[0] != value):
                seen[w] = (value if value >= 0 else (last[0] if last is not None else -1), now)
            elif before - last[1] > limit and (value >= 0 or before - unseen > limit) and w not in self._dead:
                self.mark_dead(w, json.dumps({"by": self.worker, "how": how, "silent_s": round(before - last[1], 3),
                                              **({} if value >= 0 else {"counter": "gone" if got is None
                                                                        else "not authentic"})}))

    def _beat_through(self, since: float, until: float) -> bool:
        """Did this worker's heartbeat thread get answers from the store all through ``since .. until``, never
        more than half a timeout apart? Then the observer was not blind meanwhile (module docstring)."""
        return (self._hb_thread is not None and self._pulse_gap_end <= since
                and until - self._last_pulse <= self.heartbeat_timeout_s / 2)

    def completed_with(self, peers: tuple[int, ...] | list[int]) -> None:
        """This worker's collective with ``peers`` completed just now: each of them took part (its main thread
        posted its share), so each was alive and advancing, whatever its counters in the store say. Their
        silence clocks restart here, on this observer's own clock (module docstring)."""
        now = time.monotonic()
        for w in peers:
            if w == self.worker or w in self._dead:
                continue
            for seen, how in ((self._hb_seen, "heartbeat"), (self._prog_seen, "no progress")):
                last = seen.get(w)
                seen[w] = (last[0] if last is not None else -1, now)
                self._unseen.pop((how, w), None)

    def forget_dead(self, worker: int) -> None:
        """A new incarnation of ``worker`` joined: judge it afresh (its mark, if one lands, read anew)."""
        self._dead.discard(worker)
        self._deaths_seen = -1
        self._hb_seen.pop(worker, None)
        self._prog_seen.pop(worker, None)
        for how in ("heartbeat", "no progress"):
            self._unseen.pop((how, worker), None)

    # -- joins --------------------------------------------------------------

    def request_join(self, info: dict[str, Any]) -> None:
        self.store.request_join(self.worker, info)

    def pending_joins(self, view: View, n_workers: int) -> list[int]:
        """Workers that asked to join and are not members of ``view``.

        With the heartbeat running, no store round trip unless the ``joins``
        counter moved since the last check that found nobody (a request is seen
        within one heartbeat interval). "Nobody" means no request of any
        worker: a new incarnation may ask while the view still names its dead
        predecessor a member, and the next view, which drops it, must see its
        request though the counter has not moved since.
        """
        seen = self._joins_seen if self._hb_thread is not None else self.store.joins()
        if seen == 0 or seen == self._joins_checked:
            return []
        asking = self.store.join_requests(list(range(n_workers)))
        if not asking:
            self._joins_checked = seen
        return [w for w in asking if w not in view.members]
