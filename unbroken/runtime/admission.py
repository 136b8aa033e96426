"""Admitting joiners at a step boundary: the view's first member proposes a view with the workers waiting to
join, and hands them the state as it adopts it (:meth:`~unbroken.runtime.protocol.StepProtocol.adopt`).

A joiner is admitted only if it trains the same job (its config hash is the job's; else it is refused, and
told why) and the incarnation that asked was not marked dead since. Under HSDP the leader announces in the
step's replica word whether it admits joiners; the other ranks of its replica follow it into the new view.

Without HSDP the leader announces an admission in the step's own reduction (the buffer's admission word,
:meth:`~unbroken.mecefo.gradients.GradLayout.admit`, written before the reduction is posted), and admits at
the boundary after that step only. Every member that holds the step's reduced buffer reads the same word, so
all of them stop at that boundary and wait for the admitting view instead of starting the next step in the
old view: a joiner's entry never aborts the members' step in flight, and the old view's group is dropped only
once nobody uses it. Invariant: no step attempt is aborted because of an admission (every abort has a death,
a hang or a failed collective of its own as its cause).
"""

from __future__ import annotations

import logging
from typing import Protocol

import torch

from unbroken.runtime.membership import MemberDied, View, ViewChanged
from unbroken.runtime.process_group import CollectiveFailed

__all__ = ["AdmissionWord", "JoinerAdmission"]

logger = logging.getLogger(__name__)


class AdmissionWord(Protocol):
    """Where a reduction buffer carries the leader's announcement (:class:`~unbroken.mecefo.gradients.GradLayout`)."""

    def admit(self, buf: torch.Tensor) -> torch.Tensor: ...

    def admitted(self, buf: torch.Tensor) -> bool: ...


class JoinerAdmission:
    """The admission half of :class:`~unbroken.runtime.protocol.StepProtocol` (a mixin of it)."""

    def announce(self, local: torch.Tensor) -> None:
        """Before a reduction is posted: the leader writes into ``local`` whether the boundary after this step
        admits joiners (every other member writes 0, overwriting what an earlier attempt of the step wrote)."""
        if self.announcer is None or self.replica is not None:
            return
        wanted = self.view.leader == self.me and bool(self._admissible())
        self.announcer.admit(local).fill_(1.0 if wanted else 0.0)

    def announced(self, reduced: torch.Tensor) -> None:
        """After a committed step is applied: learn from its reduced buffer whether its boundary admits."""
        self._admit_next = self.announcer is not None and self.replica is None and self.announcer.admitted(reduced)

    def _admissible(self) -> list[int]:
        return self.plan.admissible([j for j in self.m.pending_joins(self.view, self.job.n_slots)
                                     if self._acceptable(j) and self._alive_since_request(j)], self.view.members)

    def admit_joiners(self, next_step: int) -> bool:
        """At a step boundary the view's first member admits workers waiting to join; with an announcement
        (module docstring) the other members wait for the view it publishes and adopt it."""
        assert self.view is not None
        announced, self._admit_next = self._admit_next, False
        if self.view.leader != self.me:
            if self._admits and self.plan.same_replica(self.view.leader, self.me):
                self._follow_admission(next_step)
            elif announced:
                self._enter_announced(next_step)
                return True
            return False
        if self.replica is not None and not self._admits:
            return False  # HSDP: the replica goes on at once; joiners asking now are announced in the next step
        if self.announcer is not None and self.replica is None and not announced:
            return False  # the others already compute the next step in this view: admit after the next one
        joiners = self._admissible()
        if not joiners and not announced:
            if self.replica is not None:
                self.replica_broadcast(self.view.leader, self.view.gen)  # HSDP: the leader's replica goes on as is
            return False
        if self.store.vote(self.view, next_step, "abort", after=self._voted) == "commit":  # pragma: no cover
            raise AssertionError("a step was committed without the view's first member")
        local = tuple(j for j in joiners
                      if self.memory_rejoin is not None and self.memory_rejoin(j, self.view, next_step))
        # An announced admission whose joiners are gone meanwhile still publishes a view (of the same members):
        # the others wait for one at this boundary.
        new = View(gen=self.view.gen + 1, members=tuple(sorted(set(self.view.members) | set(joiners))),
                   step=next_step, joiners=tuple(joiners), reason=f"rejoin {joiners}" if joiners else
                   "admission withdrawn", from_memory=local)
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

    def _enter_announced(self, next_step: int) -> None:
        """A member at a boundary its step's leader announced: wait for the admitting view (watching for deaths:
        a leader that dies first is replaced by a view of the survivors, as in any step) and adopt it."""
        view = self.view
        try:
            self._wait_for(lambda: self.store.gen() != view.gen, f"the view admitting joiners at step {next_step}")
        except ViewChanged:
            pass  # it was published between two reads
        except (CollectiveFailed, MemberDied) as exc:
            self._reconfigure(next_step, f"announced admission failed: {type(exc).__name__}: {exc}")
            return
        self.need_exchange = True
        try:
            self.adopt(self.store.current_view())
        except (CollectiveFailed, ViewChanged, MemberDied) as exc:
            self._reconfigure(next_step, f"admission failed: {type(exc).__name__}: {exc}")

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
