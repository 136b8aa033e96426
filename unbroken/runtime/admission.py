"""Admitting joiners at a step boundary: the view's first member proposes a view with the workers waiting to
join, and hands them the state as it adopts it (:meth:`~unbroken.runtime.protocol.StepProtocol.adopt`).

A joiner is admitted only if it trains the same job (its config hash is the job's; else it is refused, and
told why) and the incarnation that asked was not marked dead since. Under HSDP the leader announces in the
step's replica word whether it admits joiners; the other ranks of its replica follow it into the new view.
"""

from __future__ import annotations

import logging

from unbroken.runtime.membership import MemberDied, View, ViewChanged
from unbroken.runtime.process_group import CollectiveFailed

__all__ = ["JoinerAdmission"]

logger = logging.getLogger(__name__)


class JoinerAdmission:
    """The admission half of :class:`~unbroken.runtime.protocol.StepProtocol` (a mixin of it)."""

    def admit_joiners(self, next_step: int) -> bool:
        """At a step boundary the view's first member admits workers waiting to join."""
        assert self.view is not None
        if self.view.leader != self.me:
            if self._admits and self.plan.same_replica(self.view.leader, self.me):
                self._follow_admission(next_step)
            return False
        if self.replica is not None and not self._admits:
            return False  # HSDP: the replica goes on at once; joiners asking now are announced in the next step
        joiners = self.plan.admissible([j for j in self.m.pending_joins(self.view, self.job.n_slots)
                                        if self._acceptable(j) and self._alive_since_request(j)], self.view.members)
        if not joiners:
            if self.replica is not None:
                self.replica_broadcast(self.view.leader, self.view.gen)  # HSDP: the leader's replica goes on as is
            return False
        if self.store.vote(self.view, next_step, "abort", after=self._voted) == "commit":  # pragma: no cover
            raise AssertionError("a step was committed without the view's first member")
        local = tuple(j for j in joiners
                      if self.memory_rejoin is not None and self.memory_rejoin(j, self.view, next_step))
        new = View(gen=self.view.gen + 1, members=tuple(sorted(set(self.view.members) | set(joiners))),
                   step=next_step, joiners=tuple(joiners), reason=f"rejoin {joiners}", from_memory=local)
        self._abandon()
        # The predecessors' death marks go before the view is published: a member that adopts it and reads the
        # marks again (another death moved the counter) must not take a joiner for dead by its predecessor's.
        # A joiner the view does not win for keeps its request; nobody needs the mark of a worker outside
        # every view.
        for j in joiners:
            self.store.clear_dead(j)
        winner = self._propose(self.view, new)
        # Only a joiner the winning view admits is done asking (a concurrent reconfiguration may have won
        # without it: then its request stands for the next boundary).
        for j in winner.joiners:
            self.store.clear_join(j)
        if self.replica is not None:
            self.replica_broadcast(self.me, winner.gen)  # HSDP: the leader's replica adopts it too, not its next step
        self.need_exchange = True
        try:
            self.adopt(winner)
        except (CollectiveFailed, ViewChanged, MemberDied) as exc:
            self._reconfigure(next_step, f"admission failed: {type(exc).__name__}: {exc}")
        return True

    def _follow_admission(self, next_step: int) -> None:
        """HSDP, a rank of the leader's replica at a step boundary the leader announced: learn from it whether
        it admitted joiners, and if so adopt that view with it (a rank computing the next step instead would
        wait for the leader inside FSDP2's collectives while the leader waits for it to arrive in the view)."""
        gen = self.replica_broadcast(self.view.leader, -1)
        if gen == self.view.gen:
            return
        self._abandon()
        self.need_exchange = True
        try:
            self.adopt(self.store.view(gen))
        except (CollectiveFailed, ViewChanged, MemberDied) as exc:
            self._reconfigure(next_step, f"admission failed: {type(exc).__name__}: {exc}")

    def replica_broadcast(self, sender: int, value: int) -> int:
        """HSDP: ``value`` (>= 0) of worker ``sender``, broadcast over its replica (the others pass -1): the leader's
        view generation at a step boundary it announced, the final checkpoint's writer's word to its siblings.

        Raises:
            CollectiveFailed: the broadcast failed, or delivered no value of the sender's (never taken for a
                generation or a word).
        """
        got = self.replica.boundary(self.plan.layout.index_of(sender), value)
        if got < 0:  # failed, or no value of the sender's arrived: never taken for a generation or a word
            raise CollectiveFailed(f"the broadcast from worker {sender} over its replica failed")
        return got

    def _acceptable(self, joiner: int) -> bool:
        """A joiner trains the same job: its config hash is ours (else it is refused, and told why)."""
        info = self.store.join_request(joiner) or {}
        if not self.config_hash or info.get("config_hash") == self.config_hash:
            return True
        reason = (f"worker {joiner} runs config {info.get('config_hash')!r}, the job runs {self.config_hash!r}: "
                  f"start it with the job's config.json")
        self.store.refuse_join(joiner, reason)
        self._event("join_refused", worker_refused=joiner, reason=reason)
        logger.error("refused the join request of worker %d: %s", joiner, reason)
        return False

    def _alive_since_request(self, joiner: int) -> bool:
        """The incarnation that asked was not marked dead since: a mark present now is the one its request
        recorded (its predecessor's) or none (the joiner's agent also withdraws the request when it reaps it)."""
        mark = self.store.dead_mark(joiner)
        return mark is None or mark == (self.store.join_request(joiner) or {}).get("predecessor_mark")
