"""Where a worker stands: replicated, ZeRO-1 or HSDP, its replica and shard, its work plan and state layout.

:class:`Parallelism` is built once per worker from the config (:func:`parallelism_for`), the one place besides
the config's validation that reads ``train.shard_degree``; the worker and the step protocol ask it instead of
the config. Three kinds:

- ``replicated``: every member holds the whole state (:class:`~unbroken.sharding.layout.StateLayout`);
- ``zero1`` (``train.shard_optimizer``): the AdamW moments split over the members
  (:class:`~unbroken.sharding.state.ShardedState`);
- ``hsdp`` (``train.shard_degree = k > 1``): FSDP2 shards the model inside each replica of ``k`` workers
  (:class:`~unbroken.sharding.layout.ShardedModel`, :mod:`unbroken.sharding.hsdp`).

:class:`~unbroken.sharding.replica_layout.ReplicaLayout` says which replica and shard index each worker has; with ``k = 1`` a replica is one
worker and its shard index 0, so the questions below have one answer for every kind.

Invariants: a worker's :class:`Parallelism` never changes while it runs; replica ``r`` is the ``k``
consecutive workers ``r*k .. r*k + k - 1``, all on one node
(:func:`~unbroken.sharding.replica_layout.check_layout`).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any, Callable, Literal, Sequence

from unbroken.config import Config
from unbroken.mecefo.takeover import TakeoverPolicy
from unbroken.sharding.layout import StateLayout
from unbroken.sharding.replica_layout import ReplicaLayout, check_layout
from unbroken.sharding.work_plan import SlotPlan, WorkPlan

if TYPE_CHECKING:
    from unbroken.snapshot.replicas import ReplicaStore

__all__ = ["Kind", "Parallelism", "ReplicaLayout", "check_layout", "check_replicas", "kind_of", "parallelism_for",
           "replicas_of"]

Kind = Literal["replicated", "zero1", "hsdp"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Parallelism:
    """Where worker ``worker`` stands (module docstring).

    Args:
        kind: replicated, ZeRO-1 or HSDP.
        worker: this worker's id.
        replicas: the job's replicas (shard degree 1 unless HSDP).
    """

    kind: Kind
    worker: int
    replicas: ReplicaLayout

    @property
    def hsdp(self) -> bool:
        """FSDP2 shards the model inside each replica."""
        return self.kind == "hsdp"

    @property
    def zero1(self) -> bool:
        """The optimizer's moments are split over the members (``train.shard_optimizer``)."""
        return self.kind == "zero1"

    @property
    def shard_degree(self) -> int:
        return self.replicas.shard_degree

    @property
    def replica(self) -> int:
        """This worker's replica."""
        return self.replicas.replica_of(self.worker)

    @property
    def index(self) -> int:
        """This worker's shard index in its replica (0 unless HSDP)."""
        return self.replicas.index_of(self.worker)

    @property
    def shard(self) -> tuple[int, int]:
        """``(index, degree)`` of the state this worker holds ((0, 1): all of it)."""
        return self.index, self.shard_degree

    def same_replica(self, a: int, b: int) -> bool:
        """Are workers ``a`` and ``b`` ranks of one replica (without HSDP: the same worker)?"""
        return self.replicas.replica_of(a) == self.replicas.replica_of(b)

    def holders(self, members: Sequence[int]) -> tuple[int, ...]:
        """The workers among ``members`` holding the same state as this one (its shard index's: one per live
        replica; without HSDP every member)."""
        return self.replicas.shard_peers(self.index, members)

    @property
    def checkpoints_by_steps(self) -> bool:
        """A sharded run checkpoints by steps only: its members must agree on the step."""
        return self.kind != "replicated"

    @property
    def writes_parts(self) -> bool:
        """Workers write parts of a checkpoint (ZeRO-1's ranges of the moments, HSDP's shards)."""
        return self.kind != "replicated"

    def checkpoint_stage(self, gen: int, writer: int) -> int | str:
        """Where the parts of a checkpoint ``writer`` commits in view ``gen`` are staged: by the generation
        (ZeRO-1's ranges, which every member writes whoever commits), and under HSDP by the writer too (the
        replica that takes over the final checkpoint from a dead leader writes its parts apart from the dead
        one's)."""
        return f"{gen}w{writer}" if self.hsdp else gen

    def plan(self, policy: TakeoverPolicy, *, n_slots: int, micro_batch: int, n_workers: int | None = None) -> WorkPlan:
        """Who computes what in a step of ``n_slots`` slots by ``n_workers`` workers (default ``n_slots``) and who
        reduces with whom (HSDP: over whole replicas)."""
        if self.hsdp:
            from unbroken.sharding.hsdp import ReplicaPlan  # local: FSDP2's imports, for HSDP runs only

            return ReplicaPlan(policy, self.replicas, micro_batch, n_slots)
        return SlotPlan(policy, n_slots, micro_batch, n_workers)

    def state_layout(self, job: Any, *, node_of: dict[int, int], replica_store: Callable[[], ReplicaStore],
                     on_event: Callable[..., None]) -> StateLayout:
        """The layout of ``job``'s state across ranks. ZeRO-1 keeps its ring copies in ``replica_store()``
        and reports re-shards to ``on_event``; ``node_of`` maps every worker to its node."""
        if self.zero1:
            from unbroken.sharding.state import ShardedState

            return ShardedState(job, worker=self.worker, node_of=node_of, on_event=on_event,
                                replicas=replica_store())
        if self.hsdp:
            from unbroken.sharding.layout import ShardedModel

            return ShardedModel(job, index=self.index, shard_degree=self.shard_degree)
        return StateLayout(job)


def kind_of(cfg: Config) -> Kind:
    """The kind of parallelism ``cfg`` (validated) trains with (what a process that is no worker yet asks)."""
    t = cfg.train
    return "hsdp" if t.shard_degree > 1 else "zero1" if t.shard_optimizer else "replicated"


def parallelism_for(cfg: Config, world: int, worker: int) -> Parallelism:
    """Where ``worker`` of a job of ``world`` workers stands under ``cfg`` (validated)."""
    return Parallelism(kind=kind_of(cfg), worker=worker, replicas=ReplicaLayout(world, cfg.train.shard_degree))


def replicas_of(cfg: Config) -> ReplicaLayout:
    """The job's replicas as its config lays them out (``train.shard_degree``). Raises ValueError where the
    degree does not divide the workers (:func:`check_replicas` says why)."""
    return ReplicaLayout(cfg.train.workers, cfg.train.shard_degree)


def check_replicas(cfg: Config, workers_per_node: int, *, standby: bool) -> ReplicaLayout:
    """The job's replicas, refused (ValueError naming the fix) unless each is whole on one node of
    ``workers_per_node`` workers, and under HSDP without a warm ``standby`` (a standby is one worker; HSDP
    restarts whole replicas)."""
    degree = cfg.train.shard_degree
    if degree > 1:
        check_layout(cfg.train.workers, workers_per_node, degree)
        if standby:
            raise ValueError(f"a warm standby with train.shard_degree={degree}: a standby is one worker, HSDP "
                             "restarts whole replicas; drop --standby")
    return replicas_of(cfg)
