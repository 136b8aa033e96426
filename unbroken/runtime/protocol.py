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
   before voting, each member looks at the reduced buffer: an attempt whose
   reduction is not finite is never voted on, but done again with the same
   rows, or its culprit fenced, or the job stopped (:mod:`unbroken.runtime.nonfinite`); nor is one whose
   members' parameter checksums differ (:mod:`unbroken.runtime.param_check`: the minority fenced, or the job
   stopped);
4. on commit: the caller applies the optimizer step.

If anything fails in 2–3 the worker aborts the attempt, agrees on view ``g+1``
(compare-and-set; proposals race safely), builds the new group, publishes the
items it already computed, and computes what the policy's
:meth:`~unbroken.mecefo.takeover.TakeoverPolicy.complete` says is still
missing: the dead workers' rows, for the same step ``s``. Gradients already
computed are kept.

The view, its group and peers, and every change of them (entering a view, moving to the next after a
failed attempt, admitting joiners at a step boundary) are the protocol's
:class:`~unbroken.runtime.view_changes.ViewChanges`, one part of it built with it.

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

import json
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Literal, Protocol

import torch

from unbroken.jsonl import JsonlWriter
from unbroken.mecefo.gradients import GradLayout, SlotWork, slot_rows
from unbroken.mecefo.takeover import TakeoverPolicy
from unbroken.runtime.membership import Fenced, Membership, MemberDied, MissedCommit, View, ViewChanged
from unbroken.runtime.nonfinite import NonFiniteSteps
from unbroken.runtime.param_check import Finding, ParamCheck
from unbroken.runtime.stragglers import Stragglers
from unbroken.runtime.process_group import CollectiveFailed, ViewGroup
from unbroken.runtime.view_changes import (CHECK_EVERY_S, MAX_SAME_VIEW_RETRIES, AdmissionWord, RetriesExhausted,
                                           ViewChanges)
from unbroken.sharding.layout import StateLayout
from unbroken.sharding.work_plan import SlotPlan, WorkPlan

if TYPE_CHECKING:
    from unbroken.runtime.state_source import StateSource
    from unbroken.sharding.hsdp import ReplicaSync

__all__ = ["CHECK_EVERY_S", "MAX_SAME_VIEW_RETRIES", "PHASES", "MemberDied", "RetriesExhausted", "StepJob",
           "StepProtocol"]

logger = logging.getLogger(__name__)

Phase = Literal["forward", "backward", "allreduce", "update", "allgather", "confirm", "restore", "finish"]
PHASES: tuple[Phase, ...] = ("forward", "backward", "allreduce", "update", "allgather", "confirm", "restore",
                             "finish")
"""Hook points of a step: before the forward pass, after the backward pass, with the
all-reduce in flight, before a sharded run's optimizer update, with its all-gather of the
parameters in flight, right after the commit vote; ``restore``: on entering a restored view
(its step), before arriving in the view's group; ``finish``: after the last step (the run's
step count), the leader's final checkpoint begun and not yet committed."""


class StepJob(Protocol):
    """What the protocol trains (:class:`unbroken.job.Job` is one)."""

    @property
    def n_slots(self) -> int: ...

    @property
    def n_workers(self) -> int: ...

    @property
    def micro_batch(self) -> int: ...

    device: torch.device
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer

    def gradient_sums(self, step: int, items: list[SlotWork]) -> torch.Tensor: ...


class StepProtocol:
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
                 timeout_s: float, config_hash: str = "", backend: str = "auto", plan: WorkPlan | None = None,
                 layout: StateLayout | None = None, replica: ReplicaSync | None = None,
                 announcer: AdmissionWord | None = None, state: StateSource | None = None,
                 stragglers: Stragglers | None = None, param_check: ParamCheck | None = None) -> None:
        self.m, self.store, self.job, self.policy = membership, membership.store, job, policy
        self.me = membership.worker
        self.events, self.timeout_s, self.config_hash = events, timeout_s, config_hash
        self.step: int | None = None
        """The step in flight (for log lines)."""
        self.sums: torch.Tensor | None = None
        """The sums this worker just computed (its reduction buffer), during the ``backward`` hook point only (no
        reference outlives it: the buffer goes with its step)."""
        self._hooks: dict[str, list[Callable[[int], None]]] = {p: [] for p in PHASES}  # a layout names a phase
        self._pruned_below = 0
        self._spare: torch.Tensor | None = None  # the host copy of the sums posted last (see _keep)
        self._recorded: tuple[int, int, list[list[object]]] | None = None  # the last ledger record's (see _reduce)
        self.state = state
        """Where this worker's state comes from when its view changes (:class:`~unbroken.runtime.state_source.
        StateSource`): a restore, its node's snapshot memory; None: only transfers from a peer."""
        self.layout: StateLayout = layout if layout is not None else StateLayout(job)
        """How the state is laid out across ranks (:mod:`unbroken.sharding.layout`): replicated, HSDP's shards,
        or ZeRO-1's moments (updated and all-gathered before the vote, re-sharded when the view changes)."""
        self.plan: WorkPlan = plan if plan is not None else SlotPlan(policy, job.n_slots, job.micro_batch,
                                                                     job.n_workers)
        """Who computes what and reduces with whom (HSDP's :class:`~unbroken.sharding.hsdp.ReplicaPlan`)."""
        self.views = ViewChanges(membership, job, plan=self.plan, layout=self.layout, replica=replica,
                                 announcer=announcer, state=state, events=events, phase=self._phase,
                                 timeout_s=timeout_s, config_hash=config_hash, backend=backend)
        """The view, its group and peers, and every change of them (HSDP: with ``replica``, the collectives
        over this worker's replica; ``announcer``: where a reduction buffer carries an admission's word)."""
        self.nonfinite = NonFiniteSteps(membership, announcer if isinstance(announcer, GradLayout)
                                        and replica is None else None, self._event)
        """A reduction found not finite is applied nowhere (:mod:`unbroken.runtime.nonfinite`)."""
        self.stragglers = stragglers
        """A slow worker's rows moved to the others (:mod:`unbroken.runtime.stragglers`); None: off."""
        self._computed = (0.0, 0)  # this step's compute seconds and rows so far (the stragglers' timing)
        self.param_check = param_check
        """The members' parameter checksums compared in the reduction (:mod:`unbroken.runtime.param_check`);
        None: off."""

    # -- what the view changes hold, as the step reads it ---------------------------

    @property
    def view(self) -> View:
        """The view this worker is in (it has entered one: :meth:`adopt`)."""
        return self.views.view

    @property
    def group(self) -> ViewGroup | None:
        """The current view's group of this worker's peers (None between a failed attempt and the next view)."""
        return self.views.group

    @property
    def peers(self) -> tuple[int, ...]:
        """The members of this worker's reduction group in the current view."""
        return self.views.peers

    @property
    def need_exchange(self) -> bool:
        """The next attempt of a step exchanges what each member computed first (:attr:`ViewChanges.need_exchange`)."""
        return self.views.need_exchange

    @need_exchange.setter
    def need_exchange(self, value: bool) -> None:
        self.views.need_exchange = value

    @property
    def _voted(self) -> int:
        """The last step this worker saw committed under the current view."""
        return self.views.voted

    @_voted.setter
    def _voted(self, step: int) -> None:
        self.views.voted = step

    @property
    def _same_view_retries(self) -> int:
        return self.views.same_view_retries

    @_same_view_retries.setter
    def _same_view_retries(self, n: int) -> None:
        self.views.same_view_retries = n

    def exchange_first(self) -> None:
        """The next attempt of a step exchanges what each member computed first, as every member of its view does
        (this worker entered a restored view, or was admitted into one)."""
        self.views.need_exchange = True

    def where(self) -> tuple[int, int] | None:
        """``(generation, step)`` of this worker (the step in flight, else its view's first), or None before it
        entered a view (for log lines)."""
        if not self.views.entered:
            return None
        view = self.views.view
        return view.gen, self.step if self.step is not None else view.step

    # -- hook points -----------------------------------------------------------------

    def on(self, phase: Phase, hook: Callable[[int], None]) -> None:
        """Run ``hook(step)`` at ``phase`` of every step (see :data:`PHASES`)."""
        if phase not in self._hooks:
            raise ValueError(f"unknown step phase {phase!r}; expected one of {', '.join(PHASES)}")
        self._hooks[phase].append(hook)

    def _phase(self, phase: str, step: int) -> None:
        self.m.advance()
        for hook in self._hooks[phase]:
            hook(step)

    def finish(self, steps: int) -> None:
        """After the run's last step (``steps``), the leader's final checkpoint begun: the ``finish`` hook point."""
        self._phase("finish", steps)

    # -- views (:class:`~unbroken.runtime.view_changes.ViewChanges`) -----------------

    def adopt(self, view: View) -> None:
        """Enter ``view`` (:meth:`ViewChanges.adopt`)."""
        self.views.adopt(view)

    def reconfigure_at_start(self, step: int, reason: str) -> None:
        """The first view could not be formed: move to the next one (:meth:`ViewChanges.reconfigure_at_start`)."""
        self.views.reconfigure_at_start(step, reason)

    def admit_joiners(self, next_step: int) -> bool:
        """At a step boundary: admit workers waiting to join (:meth:`ViewChanges.admit_joiners`)."""
        return self.views.admit_joiners(next_step)

    def announced(self, reduced: torch.Tensor) -> None:
        """After a committed step is applied: learn whether its boundary admits (:meth:`ViewChanges.announced`)."""
        self.views.announced(reduced)

    def replica_broadcast(self, sender: int, value: int) -> int:
        """HSDP: ``value`` of worker ``sender`` over its replica (:meth:`ViewChanges.replica_broadcast`)."""
        return self.views.replica_broadcast(sender, value)


    # -- views ----------------------------------------------------------------

    # -- the step -------------------------------------------------------------

    def run_step(self, step: int) -> tuple[torch.Tensor, list[SlotWork]]:
        """Compute, reduce and commit ``step``; returns the reduced buffer and this worker's items.

        Raises:
            Fenced: the step was committed by members whose all-reduce completed,
                but this worker's did not, so it cannot apply it; it must leave
                and rejoin with the state (its agent restarts it).
        """
        self.step = step
        self._computed = (0.0, 0)
        items: list[SlotWork] = []
        local: torch.Tensor | None = None
        again = False  # the last attempt's reduction was not finite: the same items, computed afresh
        while True:
            reduced: torch.Tensor | None = None
            posted = False
            self.layout.discard()
            try:
                extra = [] if again else self._exchange(step, items) if self.need_exchange else self._assigned()
                again = False
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
                    self._replica_word(step, ok=False, reduced=None)  # HSDP: its siblings wait for its word
                    raise
                found = None if self.param_check is None else self.param_check.find(step, reduced, self.view.members)
                shards_finite = self._replica_word(step, ok=True, reduced=reduced, found=found)
                if self.param_check is not None:  # a reduction of gradients from differing parameters: none applies it
                    repair = self.param_check.settle(step, self.view.gen, found, self.views.pooled)
                    if repair is not None:  # the odd members take the majority's parameters: done again, alike
                        group = self.group
                        assert group is not None
                        self.param_check.repair(step, self.view.gen, repair, self.peers,
                                                lambda t, src: group.broadcast_into(t, src, self._check))
                        local, again = None, True
                        continue
                if self.nonfinite.after_reduction(step, self.view.gen, reduced, items, shards_finite):
                    local, again = None, True  # reduced in place: computed again, by the same members
                    continue
                # ZeRO-1: the whole step before the vote (update and all-gather)
                self.layout.after_reduction(step, reduced, self.group, self._check,
                                            lambda phase: self._phase(phase, step))
                self._vote(step)
                self.need_exchange = False
                if self.stragglers is not None:
                    view = self.view
                    self.stragglers.reduced(view.gen, step, view.members, reduced, leader=view.leader == self.me)
                    self._replace_if_slow(step)
                return reduced, items
            except (ViewChanged, CollectiveFailed, MemberDied) as exc:
                again = False
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

    def _replace_if_slow(self, step: int) -> None:
        """This worker has been a straggler for ``fault.straggler_replace_s``: it leaves (marked dead, how
        ``straggler``) after voting for ``step``, and its agent starts a replacement that rejoins with the state.

        Raises:
            Fenced: it leaves.
        """
        assert self.stragglers is not None
        limit, slow_s = self.stragglers.replace_s, self.stragglers.slow_for_s(self.me)
        if not limit or slow_s is None or slow_s < limit:
            return
        reason = (f"a straggler for {slow_s:.0f} s (fault.straggler_replace_s={limit:g}): it leaves after step "
                  f"{step} and a replacement rejoins")
        self._event("straggler_replaced", step=step, gen=self.view.gen, slow_s=round(slow_s, 3), reason=reason)
        self.m.mark_dead(self.me, json.dumps({"by": self.me, "how": "straggler", "step": step, "t": time.time()}))
        raise Fenced(f"worker {self.me}: {reason}")

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

    @property
    def retry_copy(self) -> torch.Tensor | None:
        """The host copy of the sums this worker posted last (see :meth:`_keep`; None on a GPU)."""
        return self._spare

    def _late(self, step: int, what: str, wait: Callable[[float], Any]) -> Any:
        """A false alarm: this worker gave up, the others committed; its own ``what`` (the all-reduce, ZeRO-1's
        all-gather) may still complete: ``wait(timeout)`` for it, up to a heartbeat timeout."""
        t0 = time.perf_counter()
        out = wait(self.m.heartbeat_timeout_s)
        self._event("late_result", step=step, gen=self.view.gen, ok=out is not None and out is not False,
                    seconds=time.perf_counter() - t0, what=what)
        return out

    def _assigned(self) -> list[SlotWork]:
        view = self.view
        keep = self.stragglers.keep(view.gen, view.members) if self.stragglers is not None else None
        return self.plan.assign(self.me, view.members, keep)

    def _compute(self, step: int, items: list[SlotWork]) -> torch.Tensor:
        """Gradient sums of ``items`` (the ``forward`` and ``backward`` hook points around it)."""
        t0 = time.perf_counter()
        self._phase("forward", step)
        buf = self.job.gradient_sums(step, items)
        self.sums = buf
        try:
            self._phase("backward", step)
        finally:
            self.sums = None
        seconds, rows = self._computed
        self._computed = (seconds + time.perf_counter() - t0, rows + sum(i.n_rows for i in items))
        return buf

    def _reduce(self, step: int, local: torch.Tensor, items: list[SlotWork],
                check: Callable[[], None] | None = None) -> torch.Tensor:
        """Record ``items`` in the ledger, then all-reduce ``local`` on the view's group.

        ``check`` runs while the all-reduce is pending (default: the failure
        detector and the view watcher) and may raise to abandon it.
        """
        # The ledger record precedes the all-reduce: whatever a committed reduction
        # contains, its contributors have recorded (a dead one included).
        # An attempt done again in the same view with the same items (a non-finite reduction's) is recorded once:
        # the ledger counts every record of a (step, generation).
        recorded = (step, self.view.gen, slot_rows(items))
        if recorded != self._recorded:
            self.events.write({"kind": "work", "step": step, "gen": self.view.gen, "worker": self.me,
                               "items": recorded[2]})
            self._recorded = recorded
        # A collective that completes within CHECK_EVERY_S never pays for the detector:
        # a crash fails it at once anyway, and a hang takes the heartbeat timeout.
        self.views.defer_check()
        self.layout.before_reduction(check or self._check)  # ZeRO-1: the last step's shard copies sealed first
        self.views.announce(local, step)
        self.nonfinite.before_reduction(step, local)  # after the word: counted in it
        if self.stragglers is not None:
            self.stragglers.stamp(local, self.me, *self._computed)
        if self.param_check is not None:
            self.param_check.stamp(step, local)
        assert self.group is not None  # a step reduces in its view's group
        return self.group.allreduce(local, check or self._check, lambda: self._phase("allreduce", step))

    def _replica_word(self, step: int, ok: bool, reduced: torch.Tensor | None,
                      found: Finding | None = None) -> bool | None:
        """HSDP: this worker's word to its replica on its reduction (:meth:`ViewChanges.replica_word`, with what
        its parameter check ``found``); returns whether every rank's reduced part is finite (None without HSDP:
        the caller looks at ``reduced`` itself)."""
        marks = [] if self.param_check is None else self.param_check.marks(found)
        return self.views.replica_word(step, ok, reduced, marks)

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

    def _check(self, force: bool = False) -> None:
        """The failure detector and the view watcher (:meth:`ViewChanges.check`)."""
        self.views.check(force)

    def _reconfigure(self, step: int, reason: str) -> bool:
        """Abort the attempt and move to a newer view; True if the step turned out committed."""
        return self.views.reconfigure(step, reason)

    def _exchange(self, step: int, items: list[SlotWork]) -> list[SlotWork]:
        """Publish what this worker computed for ``step``; return what it must add."""
        g, members = self.view.gen, self.view.members
        self.store.publish_items(g, self.me, step, slot_rows(items))
        self.views.wait_for(lambda: self.store.items_ready(g, members), f"item exchange of step {step} in view {g}")
        done = {w: [SlotWork(s, (a, b), mode) for s, a, b, mode in rows]
                for w, rows in self.store.items(g, step, members).items()}
        if not any(done.values()):  # nobody computed anything yet (a first or restored view): the plain assignment
            return self._assigned()
        extra = self.plan.complete(self.me, members, done)
        if extra:
            self._event("takeover", step=step, gen=g, items=slot_rows(extra))
        return extra

    def _event(self, name: str, **fields: object) -> None:
        self.events.write({"kind": "event", "event": name, "worker": self.me, **fields})
