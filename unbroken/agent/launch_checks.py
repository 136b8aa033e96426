"""The checks every start of a job makes wherever it starts: ``unbroken train``'s launcher, a cluster run's
preparation (:mod:`unbroken.agent.cluster_run`) and each node's agent.

Invariants: nothing here writes anything or reads the data; a refusal is a ``ValueError`` naming the value and
the fix, the same text wherever the job starts (an agent says its node first).
"""

from __future__ import annotations

from typing import Iterable

from unbroken.config import Config
from unbroken.models.factory import check_placement
from unbroken.sharding.parallelism import check_replicas, replicas_of
from unbroken.sharding.replica_layout import ReplicaLayout

__all__ = ["check_launch", "replicas_of"]


def check_launch(cfg: Config, workers_per_node: int, *, standby: bool,
                 placed: Iterable[int] | None = None) -> ReplicaLayout:
    """Refuse a job whose workers do not fit where they start: ``placed``, the workers this machine runs
    (None: not known here), on its devices; the replicas (``train.shard_degree``) whole on single nodes of
    ``workers_per_node``; a warm ``standby`` under HSDP.

    Returns:
        The job's replicas (one worker each without HSDP).
    Raises:
        ValueError: the first problem found.
    """
    if placed is not None:
        check_placement(cfg.train.device, placed, cfg.train.backend)
    return check_replicas(cfg, workers_per_node, standby=standby)
