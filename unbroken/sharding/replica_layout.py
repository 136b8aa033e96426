"""Which replica and shard index each worker has (HSDP's ``train.shard_degree = k``; with ``k = 1`` a replica is
one worker).

Replica ``r`` is the ``k`` consecutive workers ``r*k .. r*k + k - 1``, all on one node (``k`` divides the
workers per node: the replica is the fault unit, and one agent fences and restarts all of it); worker ``w``'s
shard index is ``w % k``. Replicas spanning nodes are refused (:func:`check_layout`).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

__all__ = ["ReplicaLayout", "check_layout"]


def check_layout(workers: int, workers_per_node: int, shard_degree: int) -> None:
    """Refuse a shard degree that does not cut the job into whole replicas on single nodes.

    Raises:
        ValueError: naming the values and the layouts accepted.
    """
    if shard_degree < 1:
        raise ValueError(f"train.shard_degree={shard_degree}: need at least 1 (1 = no sharding inside a replica)")
    if workers % shard_degree:
        raise ValueError(f"train.shard_degree={shard_degree} does not divide train.workers={workers}: a replica "
                         f"is shard_degree workers; pick a divisor of {workers}")
    if workers_per_node % shard_degree:
        raise ValueError(f"train.shard_degree={shard_degree} does not divide the {workers_per_node} workers per "
                         f"node: a replica's ranks must be on one node (its agent fences and restarts them "
                         f"together); replicas spanning nodes are not supported")


@dataclasses.dataclass(frozen=True)
class ReplicaLayout:
    """Which replica and shard index each worker has."""

    workers: int
    shard_degree: int

    def __post_init__(self) -> None:
        if self.shard_degree < 1 or self.workers % self.shard_degree:
            raise ValueError(f"shard degree {self.shard_degree} does not divide {self.workers} workers")

    @property
    def replicas(self) -> int:
        return self.workers // self.shard_degree

    def replica_of(self, worker: int) -> int:
        return worker // self.shard_degree

    def index_of(self, worker: int) -> int:
        return worker % self.shard_degree

    def replica_members(self, replica: int) -> tuple[int, ...]:
        return tuple(range(replica * self.shard_degree, (replica + 1) * self.shard_degree))

    def shard_peers(self, index: int, members: Sequence[int]) -> tuple[int, ...]:
        """The workers among ``members`` with shard index ``index``, in order: one per live replica."""
        return tuple(w for w in sorted(members) if self.index_of(w) == index)

    def whole_replicas(self, dead: Sequence[int]) -> set[int]:
        """Every worker of a replica with a dead worker (the fault unit is the replica)."""
        return {w for d in dead for w in self.replica_members(self.replica_of(d))}
