"""Membership: views, heartbeats and death marks in the coordination store.

Keys (all in one job's store):

- ``gen``: the current view generation (decimal string).
- ``view/<g>``: JSON :class:`View` of generation ``g``; written once, by
  compare-and-set, so two survivors proposing different views for ``g`` end up
  reading the same one.
- ``hb/<w>``: worker ``w``'s heartbeat counter (incremented by a thread).
- ``dead/<w>``: why worker ``w`` was declared dead (by its agent on exit, or by
  a peer after missed heartbeats); ``deaths`` counts such marks.
- ``join/<w>`` + ``joins``: a restarted or replacement worker asks to join.
- ``outcome/<g>/<s>``: ``commit`` or ``abort`` of step ``s`` under view ``g``,
  decided by compare-and-set, so a step is either applied by every member or by
  none (see :mod:`unbroken.runtime.protocol`).

Invariants: generations only grow; ``view/<g+1>`` exists before ``gen`` says
``g+1``; a worker marked dead never becomes a member again under the same
incarnation (its agent kills it: fencing); heartbeat liveness is judged on the
observer's own clock (counter changes), so no clock agreement is needed, and
only over time the observer itself kept watching: after a gap in its own
observations (it was not scheduled, or the store stalled) the clocks restart,
so a stall of the observer or of the store never gets peers declared dead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import threading
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from unbroken.mecefo.policy import NoLiveWorker  # one notion of "nobody is alive", re-exported

__all__ = ["Fenced", "Membership", "NoLiveWorker", "View", "ViewChanged", "connect_store"]

logger = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 0.1
EXIT_FENCED = 3
"""Exit code of a worker that left because it was fenced (not a member, or behind the committed step)."""


class ViewChanged(Exception):
    """The current view was replaced; the caller must adopt the new one."""


class Fenced(Exception):
    """This worker is not a member of the current view: it must stop at once."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class View:
    """One membership generation: who trains, from which step, who joins."""

    gen: int
    members: tuple[int, ...]
    step: int
    joiners: tuple[int, ...] = ()
    reason: str = ""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> View:
        d = json.loads(text)
        return cls(gen=d["gen"], members=tuple(d["members"]), step=d["step"],
                   joiners=tuple(d.get("joiners", ())), reason=d.get("reason", ""))

    def rank_of(self, worker: int) -> int:
        return self.members.index(worker)


def connect_store(addr: str, *, timeout_s: float, world: int | None = None) -> dist.TCPStore:
    """Client connection to the job's store at ``HOST:PORT`` with a clear error."""
    host, _, port = addr.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"store address {addr!r} is not HOST:PORT")
    try:
        return dist.TCPStore(host, int(port), world, is_master=False, timeout=timedelta(seconds=timeout_s))
    except (RuntimeError, OSError) as exc:
        raise ConnectionError(
            f"store {addr} did not answer within {timeout_s:.0f} s ({str(exc).splitlines()[0]}); "
            f"is the launcher running and the address right?"
        ) from None


class Membership:
    """One worker's handle on the job's membership state."""

    def __init__(self, store: dist.Store, worker: int, *, heartbeat_timeout_s: float,
                 heartbeat_store: dist.Store | None = None) -> None:
        self.store = store
        # Its own connection: a call blocked on the main one (a group rendezvous)
        # must never silence the heartbeat.
        self.heartbeat_store = heartbeat_store or store
        self.worker = worker
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._hb_seen: dict[int, tuple[int, float]] = {}
        self._last_watch = -math.inf
        self._deaths_seen = -1
        self._dead: set[int] = set()
        self._stop = threading.Event()
        self._hb_thread: threading.Thread | None = None
        self._joins_seen = 0  # the ``joins`` counter as last read by the heartbeat thread
        self._joins_checked = -1  # the counter value at the last check that found no request

    # -- heartbeats ---------------------------------------------------------

    def start_heartbeat(self) -> None:
        """Publish liveness from a thread (keeps beating while the GIL is free in torch ops).

        The same thread reads the ``joins`` counter, so that checking for join
        requests at every step boundary costs no store round trip.
        """
        self.heartbeat_store.add(f"hb/{self.worker}", 1)
        self._joins_seen = self.heartbeat_store.add("joins", 0)
        self._hb_thread = threading.Thread(target=self._beat, name=f"heartbeat-w{self.worker}", daemon=True)
        self._hb_thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(HEARTBEAT_INTERVAL_S):
            try:
                self.heartbeat_store.add(f"hb/{self.worker}", 1)
                self._joins_seen = self.heartbeat_store.add("joins", 0)
            except Exception as exc:  # store gone: the job is over or this node is cut off
                logger.warning("heartbeat stopped: %s", exc)
                return

    def stop(self) -> None:
        self._stop.set()

    # -- views --------------------------------------------------------------

    def current_gen(self) -> int:
        return int(self.store.get("gen"))

    def view(self, gen: int) -> View:
        return View.from_json(self.store.get(f"view/{gen}"))

    def current_view(self) -> View:
        return self.view(self.current_gen())

    def publish_initial(self, view: View) -> None:
        """Write generation 0 (done once, by the launcher or the first agent)."""
        self.store.compare_set(f"view/{view.gen}", "", view.to_json())
        self.store.compare_set("gen", "", str(view.gen))

    def propose(self, current: View, new: View) -> View:
        """Replace ``current`` by ``new`` unless someone already replaced it; returns the winner."""
        assert new.gen == current.gen + 1
        key = f"view/{new.gen}"
        won = self.store.compare_set(key, "", new.to_json())
        winner = View.from_json(won)
        self.store.compare_set("gen", str(current.gen), str(new.gen))
        logger.info("view %d -> %d: members %s (%s)", current.gen, winner.gen, list(winner.members), winner.reason)
        return winner

    def decide(self, gen: int, step: int, outcome: str) -> str:
        """Compare-and-set the outcome of ``step`` under view ``gen``; returns the decided one."""
        return self.store.compare_set(f"outcome/{gen}/{step}", "", outcome).decode()

    # -- failure detection --------------------------------------------------

    def mark_dead(self, worker: int, reason: str) -> None:
        if self.store.compare_set(f"dead/{worker}", "", reason).decode() == reason:
            self.store.add("deaths", 1)
            logger.warning("declared worker %d dead: %s", worker, reason)
        self._dead.add(worker)

    def dead_members(self, view: View) -> set[int]:
        """Members of ``view`` marked dead, or silent for longer than the heartbeat timeout."""
        deaths = self.store.add("deaths", 0)
        if deaths != self._deaths_seen:
            self._deaths_seen = deaths
            for w in view.members:
                if w not in self._dead and self.store.check([f"dead/{w}"]):
                    self._dead.add(w)
        others = [w for w in view.members if w != self.worker and w not in self._dead]
        if others:
            before = time.monotonic()
            counts = self.store.multi_get([f"hb/{w}" for w in others])
            now = time.monotonic()
            # Silence counts only while this observer kept watching: if it was itself stalled (not
            # scheduled, or the store did not answer), nobody's heartbeat could be seen, so the clocks
            # restart instead of blaming the others for the observer's own gap.
            blind = (before - self._last_watch > self.heartbeat_timeout_s / 2
                     or now - before > self.heartbeat_timeout_s / 2)
            self._last_watch = now
            for w, raw in zip(others, counts):
                c = int(raw)
                seen = self._hb_seen.get(w)
                if seen is None or seen[0] != c or blind:
                    self._hb_seen[w] = (c, now)
                elif before - seen[1] > self.heartbeat_timeout_s:
                    self.mark_dead(w, json.dumps({"by": self.worker, "how": "heartbeat",
                                                  "silent_s": round(before - seen[1], 3)}))
        return self._dead & set(view.members)

    def forget_dead(self, worker: int) -> None:
        """A new incarnation of ``worker`` joined: judge it afresh."""
        self._dead.discard(worker)
        self._hb_seen.pop(worker, None)

    # -- joins --------------------------------------------------------------

    def request_join(self, info: dict[str, Any]) -> None:
        self.store.set(f"join/{self.worker}", json.dumps(info))
        self.store.add("joins", 1)

    def pending_joins(self, view: View, n_workers: int) -> list[int]:
        """Workers that asked to join and are not members of ``view``.

        With the heartbeat running, no store round trip unless the ``joins``
        counter moved since the last check that found nobody (a request is seen
        within one heartbeat interval).
        """
        seen = self._joins_seen if self._hb_thread is not None else self.store.add("joins", 0)
        if seen == 0 or seen == self._joins_checked:
            return []
        keys = [f"join/{w}" for w in range(n_workers) if w not in view.members]
        joiners = [int(k.split("/")[1]) for k in keys if self.store.check([k])]
        if not joiners:
            self._joins_checked = seen
        return joiners

    def clear_join(self, worker: int) -> None:
        self.store.delete_key(f"join/{worker}")
