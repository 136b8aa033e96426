"""The step protocol: finish every step, whatever fails, and apply it everywhere or nowhere.

For step ``s`` under view ``g`` a worker:

1. computes the items assigned to it (:func:`unbroken.mecefo.policy.assign`);
2. all-reduces its gradient sums on view ``g``'s group, polling, while the
   failure detector and the view watcher run;
3. votes: a member whose all-reduce completed compare-and-sets
   ``outcome/<g>/<s>`` to ``commit`` (its completion means every member
   contributed); the first worker to give up on the attempt sets it to
   ``abort``. Exactly one of the two wins: on ``abort`` nobody applies the
   step; on ``commit`` every member holding the reduced gradient applies it,
   and a member whose own all-reduce did not complete (a peer died in the
   middle of it) cannot, so it leaves (exit 3, fenced) and its agent brings it
   back as a joiner, with the state;
4. on commit: the caller applies the optimizer step.

If anything fails in 2–3 the worker aborts the attempt, agrees on view ``g+1``
(compare-and-set; proposals race safely), builds the new group, publishes the
items it already computed (``items/<g+1>/<s>/<w>``), and computes what
:func:`unbroken.mecefo.completion.complete` says is still missing: the dead
workers' rows, for the same step ``s``. Gradients already computed are kept.

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
from typing import Callable

import torch

from unbroken.jsonl import JsonlWriter
from unbroken.mecefo.completion import complete
from unbroken.mecefo.gradients import SlotWork, slot_rows
from unbroken.mecefo.policy import assign
from unbroken.runtime.membership import Fenced, Membership, NoLiveWorker, View, ViewChanged
from unbroken.runtime.process_group import CollectiveFailed, ViewGroup

logger = logging.getLogger(__name__)

CHECK_EVERY_S = 0.02
"""How often a waiting worker consults the failure detector and the view."""


class MemberDied(Exception):
    """The failure detector found dead members of the current view."""


ComputeFn = Callable[[int, list[SlotWork]], torch.Tensor]

StateFn = Callable[[], torch.Tensor]
LoadFn = Callable[[torch.Tensor], None]


class StepProtocol:
    """One worker's side of the step protocol across view changes."""

    def __init__(self, *, membership: Membership, n_slots: int, micro_batch: int, policy: str,
                 device: torch.device, timeout_s: float, compute: ComputeFn, pack_state: StateFn,
                 load_state: LoadFn, events: JsonlWriter,
                 fault_hook: Callable[[str, int], None] | None = None) -> None:
        self.m = membership
        self.me = membership.worker
        self.n_slots, self.micro_batch, self.policy = n_slots, micro_batch, policy
        self.device, self.timeout_s = device, timeout_s
        self.compute, self.pack_state, self.load_state = compute, pack_state, load_state
        self.events = events
        self.fault_hook = fault_hook or (lambda phase, step: None)
        self.view: View | None = None
        self.group: ViewGroup | None = None
        self.need_exchange = False
        self._next_check = 0.0

    # -- views ----------------------------------------------------------------

    def adopt(self, view: View) -> None:
        """Build ``view``'s group and, if it admits joiners, hand them the state.

        Raises:
            Fenced: this worker is not a member.
            MemberDied, ViewChanged, CollectiveFailed: the view cannot be formed;
                the caller moves on to a newer one.
        """
        if self.me not in view.members:
            raise Fenced(f"worker {self.me} is not a member of view {view.gen}")
        for j in view.joiners:
            self.m.forget_dead(j)
        t0 = time.perf_counter()
        self._abandon()  # a group from a failed earlier attempt is parked, never dropped
        self.view = view
        self._arrive(view)
        self.group = ViewGroup(self.m.store, gen=view.gen, rank=view.rank_of(self.me), size=len(view.members),
                               device=self.device, timeout_s=self.timeout_s)
        if view.joiners:
            source = next(w for w in view.members if w not in view.joiners)
            state = self.pack_state()
            got = self.group.broadcast(state, view.rank_of(source), self._check)
            if self.me in view.joiners:
                self.load_state(got)
        self._event("view_adopted", gen=view.gen, members=list(view.members), step=view.step,
                    joiners=list(view.joiners), reason=view.reason, build_s=self.group.build_s,
                    adopt_s=time.perf_counter() - t0)

    def _arrive(self, view: View) -> None:
        """Wait until every member of ``view`` is here, watching for deaths meanwhile.

        Building a group blocks until all members connect; a member that died
        after the view was proposed would make that wait last the whole timeout.
        """
        key, n = f"arrive/{view.gen}", len(view.members)
        if self.m.store.add(key, 1) < n:
            self._wait_for(lambda: self.m.store.add(key, 0) >= n, f"arrival of the members of view {view.gen}")

    def _wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Poll the store until ``ready()``, running the failure detector meanwhile."""
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            self._check(force=True)
            if time.monotonic() > deadline:
                raise CollectiveFailed(f"{what} did not finish within {self.timeout_s} s")
            time.sleep(0.002)

    def admit_joiners(self, next_step: int) -> bool:
        """At a step boundary the view's first member admits workers waiting to join."""
        assert self.view is not None
        if self.view.members[0] != self.me:
            return False
        joiners = self.m.pending_joins(self.view, self.n_slots)
        if not joiners:
            return False
        if self.m.decide(self.view.gen, next_step, "abort") == "commit":  # pragma: no cover - invariant
            raise AssertionError("a step was committed without the view's first member")
        for j in joiners:
            self.m.store.delete_key(f"dead/{j}")
            self.m.clear_join(j)
        new = View(gen=self.view.gen + 1, members=tuple(sorted(set(self.view.members) | set(joiners))),
                   step=next_step, joiners=tuple(joiners), reason=f"rejoin {joiners}")
        self._abandon()
        winner = self.m.propose(self.view, new)
        self.need_exchange = True
        try:
            self.adopt(winner)
        except (CollectiveFailed, ViewChanged, MemberDied) as exc:
            self._reconfigure(next_step, f"admission failed: {type(exc).__name__}: {exc}")
        return True

    # -- the step -------------------------------------------------------------

    def run_step(self, step: int) -> tuple[torch.Tensor, list[SlotWork]]:
        """Compute, reduce and commit ``step``; returns the reduced buffer and this worker's items.

        Raises:
            Fenced: the step was committed by members whose all-reduce completed,
                but this worker's did not, so it cannot apply it; it must leave
                and rejoin with the state (its agent restarts it).
        """
        items: list[SlotWork] = []
        local: torch.Tensor | None = None
        while True:
            reduced: torch.Tensor | None = None
            try:
                extra = self._exchange(step, items) if self.need_exchange else self._assigned()
                self.need_exchange = True  # any retry of this step exchanges first
                if extra or local is None:
                    self.fault_hook("forward", step)
                    buf = self.compute(step, extra)
                    self.fault_hook("backward", step)
                    local = buf if local is None else local + buf
                    items = items + extra
                # The ledger record precedes the all-reduce: whatever a committed reduction
                # contains, its contributors have recorded (a dead one included).
                self.events.write({"kind": "work", "step": step, "gen": self.view.gen, "worker": self.me,
                                   "items": slot_rows(items)})
                # A collective that completes within CHECK_EVERY_S never pays for the detector:
                # a crash fails it at once anyway, and a hang takes the heartbeat timeout.
                self._next_check = time.monotonic() + CHECK_EVERY_S
                reduced = self.group.allreduce(local, self._check, lambda: self.fault_hook("allreduce", step))
                self._vote(step)
                self.need_exchange = False
                return reduced, items
            except (ViewChanged, CollectiveFailed, MemberDied) as exc:
                if self._reconfigure(step, f"{type(exc).__name__}: {exc}"):
                    if reduced is None:
                        raise Fenced(f"step {step} was committed in view {self.view.gen}, but this worker's "
                                     f"all-reduce did not complete ({exc}); it rejoins with the state") from None
                    self.need_exchange = False
                    return reduced, items

    def _assigned(self) -> list[SlotWork]:
        return list(assign(self.policy, n_slots=self.n_slots, live=self.view.members,
                           micro_batch=self.micro_batch).get(self.me, []))

    def _vote(self, step: int) -> None:
        """Vote ``commit`` for ``step`` under the current view (see the module docstring).

        Only a member whose gradient all-reduce completed votes ``commit``: its
        completion anywhere means every member contributed, so the reduced
        gradient is defined and every member whose all-reduce completed holds
        it. A member that gives up votes ``abort`` (:meth:`_reconfigure`).
        The first vote, by compare-and-set on ``outcome/<g>/<s>``, decides for
        everyone: one store round trip per member and step beyond the all-reduce.
        """
        g = self.view.gen
        if self.m.decide(g, step, "commit") != "commit":
            raise ViewChanged(f"step {step} was aborted in view {g}")
        self.fault_hook("confirm", step)

    def _check(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now < self._next_check:
            return
        self._next_check = now + CHECK_EVERY_S
        if self.m.current_gen() != self.view.gen:
            raise ViewChanged(f"view {self.view.gen} replaced")
        dead = self.m.dead_members(self.view)
        if dead:
            raise MemberDied(f"workers {sorted(dead)} of view {self.view.gen} are dead")

    def reconfigure_at_start(self, step: int, reason: str) -> None:
        """The first view could not be formed: move to the next one, before computing anything."""
        self._reconfigure(step, reason)
        self.need_exchange = True

    def _reconfigure(self, step: int, reason: str) -> bool:
        """Abort the attempt and move to a newer view; True if the step turned out committed."""
        t0 = time.perf_counter()
        if self.m.decide(self.view.gen, step, "abort") == "commit":
            return True
        self._abandon()
        self._event("attempt_aborted", step=step, gen=self.view.gen, reason=reason)
        while True:
            old = self.view
            gen = self.m.current_gen()
            if gen > old.gen:
                new = self.m.view(gen)
            else:
                dead = self._wait_for_dead(old)
                members = tuple(w for w in old.members if w not in dead)
                if not members:
                    raise NoLiveWorker("no live worker is left")
                # An admission interrupted in this step may not have handed the state over: admit again.
                joiners = tuple(j for j in old.joiners if j in members) if old.step == step else ()
                if joiners and all(w in joiners for w in members):
                    raise NoLiveWorker("only workers still waiting for the state are left")
                new = self.m.propose(old, View(gen=old.gen + 1, members=members, step=step, joiners=joiners,
                                               reason=f"dead {sorted(dead)}" if dead else "collective failed"))
            if new.step != step:
                raise AssertionError(f"view {new.gen} is for step {new.step}, this worker is at step {step}")
            try:
                self.adopt(new)
            except (CollectiveFailed, RuntimeError, ViewChanged, MemberDied) as exc:
                if isinstance(exc, Fenced):
                    raise
                logger.warning("could not adopt view %d: %s", new.gen, exc)
                self.m.decide(new.gen, step, "abort")
                self.view = new
                continue
            self._event("reconfigured", step=step, gen=new.gen, members=list(new.members),
                        seconds=time.perf_counter() - t0, reason=reason)
            return False

    def _wait_for_dead(self, view: View) -> set[int]:
        """Who died? The agent says so at once; a silent node after the heartbeat timeout."""
        deadline = time.monotonic() + self.m.heartbeat_timeout_s + 1.0
        while time.monotonic() < deadline:
            dead = self.m.dead_members(view)
            if dead or self.m.current_gen() != view.gen:
                return dead
            time.sleep(0.005)
        return set()

    def _exchange(self, step: int, items: list[SlotWork]) -> list[SlotWork]:
        """Publish what this worker computed for ``step``; return what it must add."""
        g = self.view.gen
        self.m.store.set(f"items/{g}/{step}/{self.me}", json.dumps(slot_rows(items)))
        keys = [f"items/{g}/{step}/{w}" for w in self.view.members]
        self._wait_for(lambda: self.m.store.check(keys), f"item exchange of step {step} in view {g}")
        done = {w: [SlotWork(s, (a, b), mode) for s, a, b, mode in json.loads(raw)]
                for w, raw in zip(self.view.members, self.m.store.multi_get(keys))}
        extra = complete(self.policy, n_slots=self.n_slots, micro_batch=self.micro_batch,
                         live=self.view.members, done=done)[self.me]
        if extra:
            self._event("takeover", step=step, gen=g, items=slot_rows(extra))
        return extra

    def _abandon(self) -> None:
        if self.group is not None:
            self.group.abandon()
            self.group = None

    def _event(self, name: str, **fields: object) -> None:
        self.events.write({"kind": "event", "event": name, "worker": self.me, **fields})


class PlainProtocol(StepProtocol):
    """Plain data parallelism: own slot, one blocking all-reduce, no failure handling.

    Used for ``fault.recovery = "restart"`` (the torchrun way: any failure stops
    the job, which restarts from the last persistent checkpoint) and as the
    failure-free baseline of the overhead benchmark.
    """

    def run_step(self, step: int) -> tuple[torch.Tensor, list[SlotWork]]:
        items = [SlotWork(self.me, (0, self.micro_batch))]
        self.fault_hook("forward", step)
        local = self.compute(step, items)
        self.fault_hook("backward", step)
        work = self.group.pg.allreduce([local]) if self.group.size > 1 else None
        if work is not None:
            self.fault_hook("allreduce", step)
            if not work.wait(self.group.timeout):
                raise CollectiveFailed(f"all-reduce of step {step} timed out")
        self.events.write({"kind": "work", "step": step, "gen": self.view.gen, "worker": self.me,
                           "items": slot_rows(items)})
        return local, items

    def admit_joiners(self, next_step: int) -> bool:
        return False

    def reconfigure_at_start(self, step: int, reason: str) -> None:
        raise CollectiveFailed(f"the first view could not be formed ({reason}); plain data parallelism "
                               f"restarts the job")


class AlternatingProtocol(StepProtocol):
    """Even steps plain data parallelism, odd steps the step protocol (``fault.recovery = "alternate"``).

    A measurement of the protocol's failure-free overhead side by side in one
    job: both kinds of step run in the same processes, on the same cores and
    group, interleaved step by step, so drift between runs cancels. A failure
    on a plain step is not survived.
    """

    def run_step(self, step: int) -> tuple[torch.Tensor, list[SlotWork]]:
        if step % 2 == 0:
            return PlainProtocol.run_step(self, step)
        return super().run_step(step)
