"""A worker's view, its group and its peers, and every change of them: entering a view, leaving one after a
failure for the next, admitting joiners at a step boundary.

:class:`ViewChanges` is a part of :class:`~unbroken.runtime.protocol.StepProtocol`: the protocol runs the step
(compute, reduce, vote, exchange) in the view its ``ViewChanges`` holds, and asks it to move on when an
attempt fails (:meth:`ViewChanges.reconfigure`) or a boundary admits joiners (:meth:`ViewChanges.admit_joiners`).

Entering a view (:meth:`ViewChanges.adopt`): every member arrives (watching for deaths), builds the view's group
of its peers (:meth:`~unbroken.sharding.work_plan.WorkPlan.peers`), loads the state a restored view names or a
joiner's node memory holds (:class:`~unbroken.runtime.state_source.StateSource`), hands the state to joiners,
and moves the state to the view's layout.

Admitting joiners at a step boundary: the view's first member proposes a view with the workers waiting to
join, and hands them the state as it adopts it. A joiner is admitted only if it trains the same job (its config
hash is the job's; else it is refused, and told why) and the incarnation that asked was not marked dead since.
Under HSDP the leader announces in the step's replica word whether it admits joiners; the other ranks of its
replica follow it into the new view. Without HSDP the leader announces it in the step's own reduction (the
buffer's leader's word, :meth:`~unbroken.mecefo.gradients.GradLayout.write_word`, written before the reduction
is posted), and admits at the boundary after that step only. Every member that holds the step's reduced buffer
reads the same word, so all of them stop at that boundary and wait for the admitting view instead of starting
the next step in the old view: a joiner's entry never aborts the members' step in flight, and the old view's
group is dropped only once nobody uses it. A preemption's stop rides in the same word: only the leader of an
attempt reads the stop keys, before posting it (:meth:`ViewChanges.announce`); under HSDP every member reads the
agreed step after the reduction (:meth:`ViewChanges.stops_after`).

Invariants: no step attempt is aborted because of an admission (every abort has a death, a hang or a failed
collective of its own as its cause); a group from a failed attempt is parked, never dropped while a
collective may still use it; every member that applies a step decides alike whether the job stops after it.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Callable, Protocol, Sequence

import torch

from unbroken.jsonl import JsonlWriter
from unbroken.runtime.membership import Fenced, MemberDied, Membership, NoLiveWorker, View, ViewChanged
from unbroken.runtime.nonfinite import finite
from unbroken.runtime.process_group import CollectiveFailed, ViewGroup
from unbroken.runtime.state_transfer import transfer_state
from unbroken.sharding.layout import StateLayout
from unbroken.sharding.work_plan import WorkPlan
from unbroken.store.backend import GroupStoreUnavailable

if TYPE_CHECKING:
    from unbroken.runtime.state_source import StateSource
    from unbroken.sharding.hsdp import ReplicaSync

__all__ = ["AdmissionWord", "MAX_SAME_VIEW_RETRIES", "RetriesExhausted", "ViewChanges", "ViewJob"]

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 0.02
"""How often a waiting worker consults the failure detector and the view."""
MAX_SAME_VIEW_RETRIES = 3
"""Views of unchanged membership proposed in a row for one step (collectives failed, nobody found dead)
before this worker gives up and leaves: its agent restarts it as a joiner, so a fault nobody can name
costs one restart instead of an endless loop of new groups."""


class RetriesExhausted(RuntimeError):
    """Views of the same members kept failing at one step with nobody found dead."""


class AdmissionWord(Protocol):
    """Where a reduction buffer carries the leader's word (:class:`~unbroken.mecefo.gradients.GradLayout`)."""

    def write_word(self, buf: torch.Tensor, *, admit: bool, stop: bool) -> None: ...
    def admitted(self, buf: torch.Tensor) -> bool: ...
    def stopping(self, buf: torch.Tensor) -> bool: ...


class ViewJob(Protocol):
    """What a view change hands over (the model and optimizer) and on which device its group runs."""

    @property
    def n_workers(self) -> int: ...

    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


class ViewChanges:
    """This worker's view, group and peers, and every change of them (module docstring).

    Args:
        membership: this worker's failure detector (its ``store`` is the job store).
        job: what a view change hands over.
        plan: who reduces with whom, who leaves with the dead, which joiners are admitted together.
        layout: the state's layout across ranks (re-sharded on entering a view, settled before leaving one).
        replica: HSDP: the collectives over this worker's replica (None otherwise).
        announcer: where a reduction buffer carries the leader's word: an admission, a stop (None: the
            leader admits at once, aborting the members' next step; every member reads the stop keys).
        state: where this worker's state comes from when its view changes (None: only from a peer).
        events: this worker's ledger and event log.
        phase: runs the step protocol's hook point ``phase(name, step)`` (``restore``).
        timeout_s: the longest any collective or store wait may take.
        config_hash: this job's config hash; a joiner whose request names another is refused.
        backend: the views' groups' backend (``train.backend``).
    """

    def __init__(self, membership: Membership, job: ViewJob, *, plan: WorkPlan, layout: StateLayout,
                 replica: ReplicaSync | None, announcer: AdmissionWord | None, state: StateSource | None,
                 events: JsonlWriter, phase: Callable[[str, int], None], timeout_s: float, config_hash: str,
                 backend: str) -> None:
        self.m, self.store, self.job, self.me = membership, membership.store, job, membership.worker
        self.plan, self.layout, self.replica, self.announcer, self.state = plan, layout, replica, announcer, state
        self.events, self._phase, self.timeout_s = events, phase, timeout_s
        self.config_hash, self.backend = config_hash, backend
        self._view: View | None = None
        self.group: ViewGroup | None = None
        self.peers: tuple[int, ...] = ()
        """The members of this worker's reduction group in the current view."""
        self.need_exchange = False
        """The next attempt of a step publishes and exchanges what each member computed first (every member
        that reached the step's view through a failed attempt, or entered it restored, does)."""
        self.voted = -1  # the last step this worker saw committed under the current view
        self.same_view_retries = 0
        self._admits = False  # HSDP: the leader announced, in this attempt's replica sync, that it admits joiners
        self.pooled: list[int] = []  # HSDP: the replica's ranks' parameter check marks, summed, of that sync
        self._admit_next = False  # the committed step's reduction announced an admission at its boundary
        self._next_check = 0.0

    @property
    def view(self) -> View:
        """The view this worker is in (it has entered one: :meth:`adopt`)."""
        if self._view is None:
            raise AssertionError(f"worker {self.me} has entered no view yet")
        return self._view

    @view.setter
    def view(self, view: View) -> None:
        self._view = view

    @property
    def entered(self) -> bool:
        """Has this worker entered a view?"""
        return self._view is not None

    def defer_check(self) -> None:
        """A collective just posted: the failure detector runs only once it has been pending a while (one that
        completes within :data:`CHECK_EVERY_S` never pays for it; a crash fails it at once anyway)."""
        self._next_check = time.monotonic() + self._check_every

    def _event(self, name: str, **fields: object) -> None:
        self.events.write({"kind": "event", "event": name, "worker": self.me, **fields})

    # -- entering a view -------------------------------------------------------------

    def adopt(self, view: View) -> None:
        """Build ``view``'s group and, if it admits joiners, hand them the state.

        Raises:
            Fenced: this worker is not a member.
            MemberDied, ViewChanged, CollectiveFailed: the view cannot be formed (CollectiveFailed too when
                the store refused its group's rendezvous connection); the caller moves on to a newer one.
        """
        if self.me not in view.members:
            raise Fenced(f"worker {self.me} is not a member of view {view.gen}")
        # Joiners are new incarnations; so is every member of a restored view (a process that waited to join
        # before the restore may have judged them dead: that was their predecessors).
        for j in view.members if view.restore is not None else view.joiners:
            self.m.forget_dead(j)
        t0 = time.perf_counter()
        self.abandon()  # a group from a failed earlier attempt is parked, never dropped
        self.view, self.voted = view, view.step - 1
        self._admits = False
        if view.restore is not None:
            self._phase("restore", view.step)
        if view.from_memory and self.me not in view.joiners and self.state is not None:
            self.state.seal_before_admission()  # sealed before arriving: a joiner reads only once everyone arrived
        self._arrive(view)
        name, self.peers = self.plan.peers(self.me, view.members)
        try:
            rendezvous = self.store.group_store(view.gen, name)
        except GroupStoreUnavailable as exc:  # this view fails, as for a member that never connected
            raise CollectiveFailed(f"view {view.gen}'s group: {exc}") from None
        self.group = group = ViewGroup(rendezvous, gen=view.gen,
                                       rank=self.peers.index(self.me), size=len(self.peers), device=self.job.device,
                                       timeout_s=self.timeout_s, check=self.check, backend=self.backend)
        if view.restore is not None and self.state is not None:
            self.state.restore(view, self.peers, lambda t, src: group.broadcast_into(t, src, self.check))
        if self.me in view.from_memory and self.state is not None:
            self.state.load_from_memory(view)
        if set(view.joiners) & set(self.peers) - set(view.from_memory):
            source = next(w for w in self.peers if w not in view.joiners)
            transfer_state(lambda t, src: group.broadcast_into(t, src, self.check),
                           self.job.model, self.job.optimizer, src=self.peers.index(source),
                           rank=self.peers.index(self.me), device=self.job.device,
                           receive=self.me in view.joiners and self.me not in view.from_memory)
        self.layout.reshard(view, lambda t: group.allreduce(t, self.check).clone(),
                            lambda t, src: group.broadcast_into(t, src, self.check))
        self._event("view_adopted", gen=view.gen, members=list(view.members), step=view.step,
                    joiners=list(view.joiners), reason=view.reason, build_s=group.build_s, pid=os.getpid(),
                    adopt_s=time.perf_counter() - t0)

    def _arrive(self, view: View) -> None:
        """Wait until every member of ``view`` is here, watching for deaths meanwhile (building a group blocks
        until all members connect: one that died after the view was proposed would make that wait its timeout)."""
        n = len(view.members)
        if self.store.arrive(view.gen) < n:
            self.wait_for(lambda: self.store.arrived(view.gen) >= n, f"arrival of the members of view {view.gen}")

    def wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Poll the store until ``ready()``, running the failure detector meanwhile (every
        :data:`CHECK_EVERY_S`, as during a collective: not on every poll, which would multiply the store's
        reads by the members polling)."""
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            self.check()
            if time.monotonic() > deadline:
                raise CollectiveFailed(f"{what} did not finish within {self.timeout_s} s")
            time.sleep(0.002)

    def _propose(self, current: View, new: View) -> View:
        winner = self.store.propose(current, new)
        logger.info("view %d -> %d: members %s (%s)", current.gen, winner.gen, list(winner.members), winner.reason)
        return winner

    # -- an attempt of a step, and leaving a view after a failed one ------------------

    def replica_word(self, step: int, ok: bool, reduced: torch.Tensor | None = None,
                     marks: Sequence[int] = ()) -> bool | None:
        """HSDP: tell this replica's other ranks whether this worker's reduction of this attempt (its shard
        index's part) completed, and learn theirs; the leader also says whether it admits joiners at the step's
        end, each rank its parameter check's ``marks`` (summed into :attr:`pooled`); returned: whether every
        rank's reduced part (``reduced``) is finite (None without HSDP). Every rank gets here once per attempt,
        completed or not, so the collective always matches (a rank whose item exchange failed may be a view
        ahead, waiting for its sibling's items). A member votes ``commit`` only once every rank of its replica
        holds its part: then every part of the step is defined and the same as its peers'.

        Raises:
            CollectiveFailed: ``ok`` and another rank's reduction failed, or the collective failed (a rank died).
        """
        if self.replica is None:
            return None
        admit = self.view.leader == self.me and bool(
            self.plan.admissible(self.m.pending_joins(self.view, self.job.n_workers), self.view.members))
        got = self.replica.agree(ok, admit, bad=reduced is not None and not finite(reduced), marks=marks)
        if got is None:
            raise CollectiveFailed(f"the replica's word on the reductions of step {step} in view {self.view.gen} "
                                   "failed")
        every, self._admits, bad, self.pooled = got
        if ok and not every:
            raise CollectiveFailed(f"the reduction of another shard index of step {step} in view {self.view.gen} "
                                   "did not complete")
        return not bad

    @property
    def _check_every(self) -> float:
        """How often the detector reads the store while a collective runs (a floor per store: etcd's is higher)."""
        return max(CHECK_EVERY_S, self.store.poll_s)

    def check(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_check:
            return
        self._next_check = now + self._check_every
        self.m.advance()  # a main thread that keeps waiting actively is making progress
        if self.store.gen() != self.view.gen:
            raise ViewChanged(f"view {self.view.gen} replaced")
        dead = self.m.dead_members(self.view)
        if dead:
            raise MemberDied(f"workers {sorted(dead)} of view {self.view.gen} are dead")

    def reconfigure_at_start(self, step: int, reason: str) -> None:
        """The first view could not be formed: move to the next one, before computing anything.

        Raises:
            Fenced: the view's first step was decided without this worker (it took a view for its own that
                went on without it): it holds neither that step's state nor its reduction.
        """
        if self.reconfigure(step, reason):
            raise Fenced(f"view {self.view.gen} went past step {step} without worker {self.me}")
        self.need_exchange = True

    def reconfigure(self, step: int, reason: str) -> bool:
        """Abort the attempt and move to a newer view; True if the step turned out committed."""
        t0 = time.perf_counter()
        outcome = self.store.vote(self.view, step, "abort", after=self.voted)
        if outcome == "commit":
            self.voted = step
            return True
        if outcome == "stale":
            raise Fenced(f"view {self.view.gen} was pruned while this worker was at step {step}")
        self.abandon()
        self._event("attempt_aborted", step=step, gen=self.view.gen, reason=reason)
        while True:
            new = self._next_view(self.view, step)
            if new.step != step:
                raise AssertionError(f"view {new.gen} is for step {new.step}, this worker is at step {step}")
            try:
                self.adopt(new)
            except (CollectiveFailed, RuntimeError, ViewChanged, MemberDied) as exc:
                if isinstance(exc, Fenced):
                    raise
                logger.warning("could not adopt view %d: %s", new.gen, exc)
                self.store.vote(new, step, "abort")
                self.view, self.voted = new, new.step - 1
                continue
            self._event("reconfigured", step=step, gen=new.gen, members=list(new.members),
                        seconds=time.perf_counter() - t0, reason=reason)
            return False

    def _next_view(self, old: View, step: int) -> View:
        """The view after ``old``: someone else's newer one, or ours without the dead."""
        if self.store.gen() > old.gen:
            return self.store.current_view()
        dead = self.plan.widen(self._wait_for_dead(old))
        self.same_view_retries = 0 if dead else self.same_view_retries + 1
        if self.same_view_retries > MAX_SAME_VIEW_RETRIES:
            raise RetriesExhausted(f"{MAX_SAME_VIEW_RETRIES} views of members {list(old.members)} failed at step "
                                   f"{step} with nobody found dead; this worker leaves and rejoins")
        members = tuple(w for w in old.members if w not in dead)
        if not members:
            raise NoLiveWorker("no live worker is left")
        # An admission interrupted in this step may not have handed the state over: admit again.
        joiners = tuple(j for j in old.joiners if j in members) if old.step == step else ()
        if joiners and all(w in joiners for w in members):
            raise NoLiveWorker("only workers still waiting for the state are left")
        # A restore interrupted before its first step committed is done again by the survivors.
        restore = old.restore if old.step == step else None
        # A joiner reads its node's memory only if every member that was to seal the step's snapshot there is
        # still a member: one that died (a hung one never seals) leaves the snapshot incomplete, so the
        # joiners of the new view get the state by transfer from a survivor.
        local = tuple(j for j in old.from_memory if j in joiners) if not dead else ()
        return self._propose(old, View(gen=old.gen + 1, members=members, step=step, joiners=joiners,
                                       reason=f"dead {sorted(dead)}" if dead else "collective failed",
                                       restore=restore, from_memory=local))

    def _wait_for_dead(self, view: View) -> set[int]:
        """Who died? The agent says so at once; a silent node after the heartbeat timeout."""
        deadline = time.monotonic() + self.m.heartbeat_timeout_s + 1.0
        while time.monotonic() < deadline:
            self.m.advance()
            dead = self.m.dead_members(view)
            if dead or self.store.gen() != view.gen:
                return dead
            time.sleep(0.005)
        return set()

    def abandon(self) -> None:
        if self.group is not None and self._view is not None:
            view = self._view
            self.layout.settle(lambda: self._raise_if_dead(view))
        if self.group is not None:
            self.group.abandon()
            self.group = None

    def _raise_if_dead(self, view: View) -> None:
        dead = self.m.dead_members(view)
        if dead:
            raise MemberDied(f"workers {sorted(dead)} of view {view.gen} are dead")

    # -- admitting joiners at a step boundary ----------------------------------------

    def announce(self, local: torch.Tensor, step: int) -> None:
        """Before ``step``'s reduction is posted: the leader (only) reads the stop keys, agrees one asked for after
        this step, and with a word writes into ``local`` whether the step's boundary admits and the job stops."""
        lead = self.view.leader == self.me
        requested, at = self.store.stop_point() if lead else (False, None)
        at = self.store.agree_stop(step + 1) if requested and at is None else at
        if self.announcer is not None and self.replica is None:
            stop = at is not None and step + 1 >= at  # an agreed step in the past stops the job too
            self.announcer.write_word(local, admit=lead and bool(self._admissible()), stop=stop)

    def announced(self, reduced: torch.Tensor) -> None:
        """After a committed step is applied: learn from its reduced buffer whether its boundary admits."""
        self._admit_next = self.announcer is not None and self.replica is None and self.announcer.admitted(reduced)

    def stops_after(self, reduced: torch.Tensor, step: int) -> bool:
        """After ``step``'s reduction: does the job stop after it? Its leader's word, else (HSDP) the agreed step."""
        if self.announcer is not None and self.replica is None:
            return self.announcer.stopping(reduced)
        return (at := self.store.stop_point()[1]) is not None and step + 1 >= at  # every member reads it

    def _admissible(self) -> list[int]:
        return self.plan.admissible([j for j in self.m.pending_joins(self.view, self.job.n_workers)
                                     if self._acceptable(j) and self._alive_since_request(j)], self.view.members)

    def admit_joiners(self, next_step: int) -> bool:
        """At a step boundary the view's first member admits workers waiting to join; with an announcement
        (module docstring) the other members wait for the view it publishes and adopt it."""
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
        if self.store.vote(self.view, next_step, "abort", after=self.voted) == "commit":  # pragma: no cover
            raise AssertionError("a step was committed without the view's first member")
        local = tuple(j for j in joiners
                      if self.state is not None and self.state.may_load_from_memory(j, self.view, next_step))
        # An announced admission whose joiners are gone meanwhile still publishes a view (of the same members):
        # the others wait for one at this boundary.
        new = View(gen=self.view.gen + 1, members=tuple(sorted(set(self.view.members) | set(joiners))),
                   step=next_step, joiners=tuple(joiners), reason=f"rejoin {joiners}" if joiners else
                   "admission withdrawn", from_memory=local)
        self.abandon()
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
            self.reconfigure(next_step, f"admission failed: {type(exc).__name__}: {exc}")
        return True

    def _enter_announced(self, next_step: int) -> None:
        """A member at a boundary its step's leader announced: wait for the admitting view (watching for deaths:
        a leader that dies first is replaced by a view of the survivors, as in any step) and adopt it."""
        view = self.view
        try:
            self.wait_for(lambda: self.store.gen() != view.gen, f"the view admitting joiners at step {next_step}")
        except ViewChanged:
            pass  # it was published between two reads
        except (CollectiveFailed, MemberDied) as exc:
            self.reconfigure(next_step, f"announced admission failed: {type(exc).__name__}: {exc}")
            return
        self.need_exchange = True
        try:
            self.adopt(self.store.current_view())
        except (CollectiveFailed, ViewChanged, MemberDied) as exc:
            self.reconfigure(next_step, f"admission failed: {type(exc).__name__}: {exc}")

    def _follow_admission(self, next_step: int) -> None:
        """HSDP, a rank of the leader's replica at a step boundary the leader announced: learn from it whether
        it admitted joiners, and if so adopt that view with it (a rank computing the next step instead would
        wait for the leader inside FSDP2's collectives while the leader waits for it to arrive in the view)."""
        gen = self.replica_broadcast(self.view.leader, -1)
        if gen == self.view.gen:
            return
        self.abandon()
        self.need_exchange = True
        try:
            self.adopt(self.store.view(gen))
        except (CollectiveFailed, ViewChanged, MemberDied) as exc:
            self.reconfigure(next_step, f"admission failed: {type(exc).__name__}: {exc}")

    def replica_broadcast(self, sender: int, value: int) -> int:
        """HSDP: ``value`` (>= 0) of worker ``sender``, broadcast over its replica (the others pass -1): the leader's
        view generation at a step boundary it announced, the final checkpoint's writer's word to its siblings.

        Without HSDP (no replica of several ranks) ``value`` itself.

        Raises:
            CollectiveFailed: the broadcast failed, or delivered no value of the sender's (never taken for a
                generation or a word).
        """
        if self.replica is None:
            return value
        got = self.replica.boundary(self.plan.shard_index(sender), value)
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
