"""The step protocol: finish every step, whatever fails, and apply it everywhere or nowhere.

For step ``s`` under view ``g`` a worker:

1. computes the items its takeover policy assigns it
   (:meth:`unbroken.mecefo.takeover.TakeoverPolicy.assign`) with
   ``job.gradient_sums`` (:func:`unbroken.mecefo.gradients.compute_gradient_sums`);
2. writes them to its ledger, then all-reduces its gradient sums on view
   ``g``'s group (:meth:`~unbroken.runtime.process_group.ViewGroup.allreduce`),
   polling, while the failure detector and the view watcher run;
3. votes (:meth:`~unbroken.store.job_store.JobStore.vote`): a member whose
   all-reduce completed votes ``commit`` (its completion means every member
   contributed); the first worker to give up on the attempt votes ``abort``.
   Exactly one of the two wins: on ``abort`` nobody applies the step; on
   ``commit`` every member holding the reduced gradient applies it, and a
   member whose own all-reduce did not complete (a peer died in the middle of
   it) cannot, so it leaves (exit 3, fenced) and its agent brings it back as a
   joiner, with the state;
4. on commit: the caller applies the optimizer step.

If anything fails in 2–3 the worker aborts the attempt, agrees on view ``g+1``
(compare-and-set; proposals race safely), builds the new group, publishes the
items it already computed, and computes what the policy's
:meth:`~unbroken.mecefo.takeover.TakeoverPolicy.complete` says is still
missing: the dead workers' rows, for the same step ``s``. Gradients already
computed are kept.

At a step boundary the view's first member admits workers waiting to join
(:class:`~unbroken.runtime.admission.JoinerAdmission`, a mixin of :class:`StepProtocol`).

Hook points: :data:`PHASES` (``forward``, ``backward``, ``allreduce``,
``confirm``) are named points of a step where callables registered with
:meth:`StepProtocol.on` run (fault injection installs itself there from
outside; the runtime knows nothing of faults).

Invariants: a step is committed under exactly one view; the items of the
committed attempt cover every ``(slot, row)`` exactly once (each worker logs
them to its ledger before its all-reduce); no worker applies a step whose
reduced gradient it does not hold, and every worker that applies it holds the
same one.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol

import torch

from unbroken.jsonl import JsonlWriter
from unbroken.mecefo.gradients import SlotWork, slot_rows
from unbroken.mecefo.takeover import TakeoverPolicy
from unbroken.runtime.admission import AdmissionWord, JoinerAdmission
from unbroken.runtime.membership import (Fenced, MemberDied, Membership, MissedCommit, NoLiveWorker, View,
                                       ViewChanged)
from unbroken.runtime.process_group import CollectiveFailed, ViewGroup
from unbroken.runtime.state_transfer import transfer_state
from unbroken.store.backend import GroupStoreUnavailable
from unbroken.runtime.work_plan import SlotPlan
from unbroken.sharding.layout import StateLayout

if TYPE_CHECKING:
    from unbroken.sharding.hsdp import ReplicaPlan, ReplicaSync

__all__ = ["PHASES", "MemberDied", "RetriesExhausted", "StepJob", "StepProtocol"]

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 0.02
"""How often a waiting worker consults the failure detector and the view."""
MAX_SAME_VIEW_RETRIES = 3
"""Views of unchanged membership proposed in a row for one step (collectives failed, nobody found dead)
before this worker gives up and leaves: its agent restarts it as a joiner, so a fault nobody can name
costs one restart instead of an endless loop of new groups."""

Phase = Literal["forward", "backward", "allreduce", "update", "allgather", "confirm", "restore", "finish"]
PHASES: tuple[Phase, ...] = ("forward", "backward", "allreduce", "update", "allgather", "confirm", "restore",
                             "finish")
"""Hook points of a step: before the forward pass, after the backward pass, with the
all-reduce in flight, before a sharded run's optimizer update, with its all-gather of the
parameters in flight, right after the commit vote; ``restore``: on entering a restored view
(its step), before arriving in the view's group; ``finish``: after the last step (the run's
step count), the leader's final checkpoint begun and not yet committed."""


class RetriesExhausted(RuntimeError):
    """Views of the same members kept failing at one step with nobody found dead."""


class StepJob(Protocol):
    """What the protocol trains (:class:`unbroken.job.Job` is one)."""

    n_slots: int
    micro_batch: int
    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def gradient_sums(self, step: int, items: list[SlotWork]) -> torch.Tensor: ...


class StepProtocol(JoinerAdmission):
    """One worker's side of the step protocol across view changes.

    Args:
        membership: this worker's failure detector (its ``store`` is the job store).
        job: what is trained (gradient sums; model and optimizer for state transfer).
        policy: the takeover policy.
        events: this worker's ledger and event log.
        timeout_s: the longest any collective or store wait may take.
        config_hash: this job's config hash; a joiner whose request names another is refused.
        backend: the views' groups' backend (``train.backend``: ``auto``, or ``gloo`` on CUDA too).
    """

    def __init__(self, membership: Membership, job: StepJob, *, policy: TakeoverPolicy, events: JsonlWriter,
                 timeout_s: float, config_hash: str = "", backend: str = "auto") -> None:
        self.m, self.store, self.job, self.policy = membership, membership.store, job, policy
        self.me = membership.worker
        self.events, self.timeout_s, self.config_hash = events, timeout_s, config_hash
        self.backend = backend
        self.view: View | None = None
        self.group: ViewGroup | None = None
        self.step: int | None = None
        """The step in flight (for log lines)."""
        self.need_exchange = False
        self._hooks: dict[Phase, list[Callable[[int], None]]] = {p: [] for p in PHASES}
        self._pruned_below = 0
        self._voted = -1  # the last step this worker saw committed under the current view
        self._same_view_retries = 0
        self._admits = False  # HSDP: the leader announced, in this attempt's replica sync, that it admits joiners
        self._admit_next = False  # the committed step's reduction announced an admission at its boundary
        self._spare: torch.Tensor | None = None  # the host copy of the sums posted last (see _keep)
        self.announcer: AdmissionWord | None = None
        """Where a reduction buffer carries the leader's announcement of an admission (the job's gradient
        layout; None: the leader admits at once, aborting the members' next step)."""
        self._next_check = 0.0
        self.restorer: Callable[[View, Callable[[torch.Tensor, int], object]], None] | None = None
        """Loads the state a restored view names (``view.restore``), in :meth:`adopt` (the trainer sets it)."""
        self.memory_rejoin: Callable[[int, View, int], bool] | None = None
        """Leader: may joiner ``j``, admitted at ``step`` from ``view``, load from its node's snapshot memory?"""
        self.memory_loader: Callable[[View], None] | None = None
        """Joiner: load the state of ``view.step`` from this node's snapshot memory."""
        self.before_admission: Callable[[], None] | None = None
        """Member: make this worker's share of the boundary's snapshot sealed before joiners read it."""
        self.layout: StateLayout = StateLayout(job)
        """How the state is laid out across ranks (:mod:`unbroken.sharding.layout`): replicated, HSDP's shards,
        or ZeRO-1's moments (updated and all-gathered before the vote, re-sharded in :meth:`adopt`)."""
        self.replica: ReplicaSync | None = None
        """HSDP: the collectives over this worker's replica (:class:`~unbroken.sharding.hsdp.ReplicaSync`): after
        each reduction, whether every rank of the replica holds its part and whether the leader admits joiners
        at the step's end; at such a boundary, the leader's view generation."""
        self.plan: SlotPlan | ReplicaPlan = SlotPlan(policy, job.n_slots, job.micro_batch)
        """Who computes what and reduces with whom (HSDP's :class:`~unbroken.sharding.hsdp.ReplicaPlan`)."""
        self.peers: tuple[int, ...] = ()
        """The members of this worker's reduction group in the current view."""

    def on(self, phase: Phase, hook: Callable[[int], None]) -> None:
        """Run ``hook(step)`` at ``phase`` of every step (see :data:`PHASES`)."""
        if phase not in self._hooks:
            raise ValueError(f"unknown step phase {phase!r}; expected one of {', '.join(PHASES)}")
        self._hooks[phase].append(hook)

    def _phase(self, phase: Phase, step: int) -> None:
        self.m.advance()
        for hook in self._hooks[phase]:
            hook(step)

    # -- views ----------------------------------------------------------------

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
        self._abandon()  # a group from a failed earlier attempt is parked, never dropped
        self.view, self._voted = view, view.step - 1
        self._admits = False
        if view.restore is not None:
            self._phase("restore", view.step)
        if view.from_memory and self.me not in view.joiners and self.before_admission is not None:
            self.before_admission()  # sealed before arriving: a joiner reads only once everyone has arrived
        self._arrive(view)
        name, self.peers = self.plan.peers(self.me, view.members)
        try:
            rendezvous = self.store.group_store(view.gen, name)
        except GroupStoreUnavailable as exc:  # this view fails, as for a member that never connected
            raise CollectiveFailed(f"view {view.gen}'s group: {exc}") from None
        self.group = ViewGroup(rendezvous, gen=view.gen,
                               rank=self.peers.index(self.me), size=len(self.peers), device=self.job.device,
                               timeout_s=self.timeout_s, check=self._check, backend=self.backend)
        if view.restore is not None and self.restorer is not None:
            self.restorer(view, lambda t, src: self.group.broadcast_into(t, src, self._check))
        if self.me in view.from_memory and self.memory_loader is not None:
            self.memory_loader(view)
        if set(view.joiners) & set(self.peers) - set(view.from_memory):
            source = next(w for w in self.peers if w not in view.joiners)
            transfer_state(lambda t, src: self.group.broadcast_into(t, src, self._check),
                           self.job.model, self.job.optimizer, src=self.peers.index(source),
                           rank=self.peers.index(self.me), device=self.job.device,
                           receive=self.me in view.joiners and self.me not in view.from_memory)
        self.layout.reshard(view, lambda t: self.group.allreduce(t, self._check).clone(),
                            lambda t, src: self.group.broadcast_into(t, src, self._check))
        self._event("view_adopted", gen=view.gen, members=list(view.members), step=view.step,
                    joiners=list(view.joiners), reason=view.reason, build_s=self.group.build_s,
                    adopt_s=time.perf_counter() - t0)

    def _arrive(self, view: View) -> None:
        """Wait until every member of ``view`` is here, watching for deaths meanwhile.

        Building a group blocks until all members connect; a member that died
        after the view was proposed would make that wait last the whole timeout.
        """
        n = len(view.members)
        if self.store.arrive(view.gen) < n:
            self._wait_for(lambda: self.store.arrived(view.gen) >= n, f"arrival of the members of view {view.gen}")

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Poll the store until ``ready()``, running the failure detector meanwhile (every
        :data:`CHECK_EVERY_S`, as during a collective: not on every poll, which would multiply the store's
        reads by the members polling)."""
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            self._check()
            if time.monotonic() > deadline:
                raise CollectiveFailed(f"{what} did not finish within {self.timeout_s} s")
            time.sleep(0.002)

    def _propose(self, current: View, new: View) -> View:
        winner = self.store.propose(current, new)
        logger.info("view %d -> %d: members %s (%s)", current.gen, winner.gen, list(winner.members), winner.reason)
        return winner

    # -- the step -------------------------------------------------------------

    def run_step(self, step: int) -> tuple[torch.Tensor, list[SlotWork]]:
        """Compute, reduce and commit ``step``; returns the reduced buffer and this worker's items.

        Raises:
            Fenced: the step was committed by members whose all-reduce completed,
                but this worker's did not, so it cannot apply it; it must leave
                and rejoin with the state (its agent restarts it).
        """
        self.step = step
        items: list[SlotWork] = []
        local: torch.Tensor | None = None
        while True:
            reduced: torch.Tensor | None = None
            posted = False
            self.layout.discard()
            try:
                extra = self._exchange(step, items) if self.need_exchange else self._assigned()
                self.need_exchange = True  # any retry of this step exchanges first
                if local is None:  # the first attempt, or one after a reduction that used the sums up in place
                    items = items + extra
                    local = self._compute(step, items)
                elif extra:
                    local = local + self._compute(step, extra)
                    items = items + extra
                kept = self._keep(local)
                posted = True
                try:
                    reduced = self._reduce(step, local, items)
                except (ViewChanged, CollectiveFailed, MemberDied):
                    self._replica_word(step, ok=False)  # HSDP: its siblings wait for its word
                    raise
                self._replica_word(step, ok=True)
                # ZeRO-1: the whole step before the vote (update and all-gather)
                self.layout.after_reduction(step, reduced, self.group, self._check,
                                            lambda phase: self._phase(phase, step))
                self._vote(step)
                self.need_exchange = False
                return reduced, items
            except (ViewChanged, CollectiveFailed, MemberDied) as exc:
                if posted:
                    # Reduced in place, in part or whole, and the abandoned collective may still write into it:
                    # the next attempt starts from the copy kept on the host, else computes this worker's items
                    # again, into a new buffer (on a GPU a second gradient-sized buffer every step costs more
                    # than a failure's recomputation).
                    local, self._spare = kept, None
                if self._reconfigure(step, f"{type(exc).__name__}: {exc}"):
                    reduced = self.layout.missed(step, reduced, self.group,
                                                 lambda what, wait: self._late(step, what, wait))
                    if reduced is None:
                        raise MissedCommit(f"step {step} was committed in view {self.view.gen}, but this "
                                           f"worker's all-reduce did not complete ({exc}); it rejoins with the "
                                           "state") from None
                    self.need_exchange = False
                    return reduced, items

    def _keep(self, local: torch.Tensor) -> torch.Tensor | None:
        """A copy of ``local`` before its reduction is posted, when it lives in host memory (a CPU run): a
        retry of the step then adds only the rows it must take over, instead of computing its own again
        (which costs the survivors a whole step more per failure). None on a GPU: device memory is not spent
        on protection (DESIGN.md)."""
        if local.device.type != "cpu":
            return None
        if self._spare is None or self._spare.shape != local.shape:
            self._spare = torch.empty_like(local)  # one buffer reused every step, replaced only after a failure
        return self._spare.copy_(local)

    def _late(self, step: int, what: str, wait: Callable[[float], Any]) -> Any:
        """A false alarm: this worker gave up, the others committed; its own ``what`` (the all-reduce, ZeRO-1's
        all-gather) may still complete: ``wait(timeout)`` for it, up to a heartbeat timeout."""
        t0 = time.perf_counter()
        out = wait(self.m.heartbeat_timeout_s)
        self._event("late_result", step=step, gen=self.view.gen, ok=out is not None and out is not False,
                    seconds=time.perf_counter() - t0, what=what)
        return out

    def _assigned(self) -> list[SlotWork]:
        return self.plan.assign(self.me, self.view.members)

    def _compute(self, step: int, items: list[SlotWork]) -> torch.Tensor:
        """Gradient sums of ``items`` (the ``forward`` and ``backward`` hook points around it)."""
        self._phase("forward", step)
        buf = self.job.gradient_sums(step, items)
        self._phase("backward", step)
        return buf

    def _reduce(self, step: int, local: torch.Tensor, items: list[SlotWork],
                check: Callable[[], None] | None = None) -> torch.Tensor:
        """Record ``items`` in the ledger, then all-reduce ``local`` on the view's group.

        ``check`` runs while the all-reduce is pending (default: the failure
        detector and the view watcher) and may raise to abandon it.
        """
        # The ledger record precedes the all-reduce: whatever a committed reduction
        # contains, its contributors have recorded (a dead one included).
        self.events.write({"kind": "work", "step": step, "gen": self.view.gen, "worker": self.me,
                           "items": slot_rows(items)})
        # A collective that completes within CHECK_EVERY_S never pays for the detector:
        # a crash fails it at once anyway, and a hang takes the heartbeat timeout.
        self._next_check = time.monotonic() + self._check_every
        self.layout.before_reduction(check or self._check)  # ZeRO-1: the last step's shard copies sealed first
        self.announce(local)
        return self.group.allreduce(local, check or self._check, lambda: self._phase("allreduce", step))

    def _replica_word(self, step: int, ok: bool) -> None:
        """HSDP: tell the other ranks of this replica whether this worker's reduction of this attempt (its shard
        index's part of the step) completed, and learn theirs; the leader also says whether it admits joiners
        at the step's end.

        Every rank of a replica gets here once per attempt, its reduction completed or not, so the collective
        always matches (no earlier point of an attempt would: a rank whose item exchange failed may be a view
        ahead of its sibling, waiting in the store for the sibling's items). A member may vote ``commit`` only
        once every rank of its replica holds its part: then every part of the step is defined (a completed
        reduction means every member of that index's group contributed, one per live replica), and every
        member holding a part holds the same as its peers.

        Raises:
            CollectiveFailed: ``ok`` and another rank's reduction failed, or the collective itself failed (a
                rank died: its replica goes down).
        """
        if self.replica is None:
            return
        admit = self.view.leader == self.me and bool(
            self.plan.admissible(self.m.pending_joins(self.view, self.job.n_slots), self.view.members))
        got = self.replica.agree(ok, admit)
        if got is None:
            raise CollectiveFailed(f"the replica's word on the reductions of step {step} in view {self.view.gen} "
                                   "failed")
        every, self._admits = got
        if ok and not every:
            raise CollectiveFailed(f"the reduction of another shard index of step {step} in view {self.view.gen} "
                                   "did not complete")

    def _vote(self, step: int) -> None:
        """Vote ``commit`` for ``step`` under the current view (see the module docstring).

        Only a member whose gradient all-reduce completed votes ``commit``: its
        completion anywhere means every member contributed, so the reduced
        gradient is defined and every member whose all-reduce completed holds
        it. A member that gives up votes ``abort`` (:meth:`_reconfigure`).
        The first vote decides for everyone: one store round trip per member
        and step beyond the all-reduce. The leader's first commit in a view
        prunes the store's keys of older views (nobody needs them any more).
        """
        view = self.view
        self.m.completed_with(self.peers)  # every peer took part in the reduction: alive, whatever its counters say
        outcome = self.store.vote(view, step, "commit", after=self._voted)
        if outcome == "stale":
            raise Fenced(f"view {view.gen} was pruned while this worker was at step {step}")
        if outcome != "commit":
            raise ViewChanged(f"step {step} was aborted in view {view.gen}")
        self._voted, self._same_view_retries = step, 0
        if view.leader == self.me and self._pruned_below < view.gen:
            self.store.prune(view.gen)
            self._pruned_below = view.gen
        self._phase("confirm", step)

    @property
    def _check_every(self) -> float:
        """How often the detector reads the store while a collective runs (a floor per store: etcd's is higher)."""
        return max(CHECK_EVERY_S, self.store.poll_s)

    def _check(self, force: bool = False) -> None:
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
        if self._reconfigure(step, reason):
            raise Fenced(f"view {self.view.gen} went past step {step} without worker {self.me}")
        self.need_exchange = True

    def _reconfigure(self, step: int, reason: str) -> bool:
        """Abort the attempt and move to a newer view; True if the step turned out committed."""
        t0 = time.perf_counter()
        outcome = self.store.vote(self.view, step, "abort", after=self._voted)
        if outcome == "commit":
            self._voted = step
            return True
        if outcome == "stale":
            raise Fenced(f"view {self.view.gen} was pruned while this worker was at step {step}")
        self._abandon()
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
                self.view, self._voted = new, new.step - 1
                continue
            self._event("reconfigured", step=step, gen=new.gen, members=list(new.members),
                        seconds=time.perf_counter() - t0, reason=reason)
            return False

    def _next_view(self, old: View, step: int) -> View:
        """The view after ``old``: someone else's newer one, or ours without the dead."""
        if self.store.gen() > old.gen:
            return self.store.current_view()
        dead = self.plan.widen(self._wait_for_dead(old))
        self._same_view_retries = 0 if dead else self._same_view_retries + 1
        if self._same_view_retries > MAX_SAME_VIEW_RETRIES:
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

    def _exchange(self, step: int, items: list[SlotWork]) -> list[SlotWork]:
        """Publish what this worker computed for ``step``; return what it must add."""
        g, members = self.view.gen, self.view.members
        self.store.publish_items(g, self.me, step, slot_rows(items))
        self._wait_for(lambda: self.store.items_ready(g, members), f"item exchange of step {step} in view {g}")
        done = {w: [SlotWork(s, (a, b), mode) for s, a, b, mode in rows]
                for w, rows in self.store.items(g, step, members).items()}
        if not any(done.values()):  # nobody computed anything yet (a first or restored view): the plain assignment
            return self._assigned()
        extra = self.plan.complete(self.me, members, done)
        if extra:
            self._event("takeover", step=step, gen=g, items=slot_rows(extra))
        return extra

    def _abandon(self) -> None:
        if self.group is not None and self.view is not None:
            view = self.view
            self.layout.settle(lambda: self._raise_if_dead(view))
        if self.group is not None:
            self.group.abandon()
            self.group = None

    def _raise_if_dead(self, view: View) -> None:
        dead = self.m.dead_members(view)
        if dead:
            raise MemberDied(f"workers {sorted(dead)} of view {view.gen} are dead")

    def _event(self, name: str, **fields: object) -> None:
        self.events.write({"kind": "event", "event": name, "worker": self.me, **fields})
