"""Who computes what in a step, and who reduces with whom: the step protocol's plan.

:class:`SlotPlan` is data parallelism's: every worker its slot, the takeover policy's cover for the dead,
one group of all members per view. HSDP's is :class:`unbroken.sharding.hsdp.ReplicaPlan` (work over whole
replicas, one group per shard index). The protocol (:mod:`unbroken.runtime.protocol`) asks its plan
(:class:`WorkPlan`, which :meth:`unbroken.sharding.parallelism.Parallelism.plan` builds) and never the policy
directly.
"""

from __future__ import annotations

from typing import Mapping, Protocol, Sequence

from unbroken.mecefo.gradients import SlotWork
from unbroken.mecefo.takeover import TakeoverPolicy, rebalance

__all__ = ["SlotPlan", "WorkPlan"]


class WorkPlan(Protocol):
    """Who computes what in a step, and who reduces with whom (:class:`SlotPlan`'s methods)."""

    def assign(self, me: int, live: Sequence[int], keep: Mapping[int, int] | None = None) -> list[SlotWork]: ...

    def complete(self, me: int, live: Sequence[int], done: Mapping[int, Sequence[SlotWork]]) -> list[SlotWork]: ...

    def widen(self, dead: set[int]) -> set[int]: ...

    def admissible(self, joiners: Sequence[int], members: Sequence[int]) -> list[int]: ...

    def peers(self, me: int, members: Sequence[int]) -> tuple[str, tuple[int, ...]]: ...

    def same_replica(self, a: int, b: int) -> bool: ...

    def shard_index(self, worker: int) -> int: ...


class SlotPlan:
    """Who computes what, and who reduces with whom: every worker its home slots, the takeover policy's cover
    for the dead, one group of all members per view. (HSDP's plan is :class:`unbroken.sharding.hsdp.ReplicaPlan`.)

    Args:
        policy: the takeover policy.
        n_slots: slots per step (the global batch in micro-batches).
        micro_batch: rows per slot.
        n_workers: the job's workers (default ``n_slots``: one slot each).
    """

    def __init__(self, policy: TakeoverPolicy, n_slots: int, micro_batch: int, n_workers: int | None = None) -> None:
        self.policy, self.n_slots, self.micro_batch = policy, n_slots, micro_batch
        self.n_workers = n_slots if n_workers is None else n_workers

    def assign(self, me: int, live: Sequence[int], keep: Mapping[int, int] | None = None) -> list[SlotWork]:
        """``me``'s work of a step that starts with ``live``; ``keep``: rows per home slot of slow workers
        (:mod:`unbroken.runtime.stragglers`), the rest of their slots going to the others."""
        plan = self.policy.assign(n_slots=self.n_slots, live=live, micro_batch=self.micro_batch,
                                  n_workers=self.n_workers)
        if keep:
            plan = rebalance(plan, keep, n_workers=self.n_workers, micro_batch=self.micro_batch)
        return list(plan.get(me, []))

    def complete(self, me: int, live: Sequence[int], done: Mapping[int, Sequence[SlotWork]]) -> list[SlotWork]:
        """``me``'s extra work so that ``live``, having computed ``done``, cover the step exactly once."""
        return self.policy.complete(n_slots=self.n_slots, micro_batch=self.micro_batch, live=live, done=done,
                                    n_workers=self.n_workers)[me]

    def widen(self, dead: set[int]) -> set[int]:
        """Who leaves the view with ``dead``: nobody else."""
        return dead

    def admissible(self, joiners: Sequence[int], members: Sequence[int]) -> list[int]:
        """The joiners that may be admitted together: all."""
        return list(joiners)

    def peers(self, me: int, members: Sequence[int]) -> tuple[str, tuple[int, ...]]:
        """The name of ``me``'s reduction group within a view (:meth:`JobStore.group_store`), and its members."""
        return "", tuple(members)

    def same_replica(self, a: int, b: int) -> bool:
        """Are workers ``a`` and ``b`` ranks of one replica (here: the same worker)?"""
        return a == b

    def shard_index(self, worker: int) -> int:
        """``worker``'s rank in its replica (here: 0, a replica is one worker)."""
        return 0
