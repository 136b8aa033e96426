"""The checks every start of a job makes wherever it starts: ``unbroken train``'s launcher, a cluster run's
preparation (:mod:`unbroken.agent.cluster_run`) and each node's agent.

Invariants: nothing here writes anything or reads the data; a refusal is a ``ValueError`` naming the value and
the fix, the same text wherever the job starts (an agent says its node first).
"""

from __future__ import annotations

from typing import Iterable

from unbroken.config import Config
from unbroken.models.factory import check_placement
from unbroken.sharding.replica_layout import ReplicaLayout, check_layout

__all__ = ["check_launch", "replicas_of"]


def replicas_of(cfg: Config) -> ReplicaLayout:
    """The job's replicas as its config lays them out (``train.shard_degree``; the agent package reads it only
    here). Raises ValueError where the degree does not divide the workers (:func:`check_launch` says why)."""
    return ReplicaLayout(cfg.train.workers, cfg.train.shard_degree)


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
    degree = cfg.train.shard_degree
    if degree > 1:
        check_layout(cfg.train.workers, workers_per_node, degree)
        if standby:
            raise ValueError(f"a warm standby with train.shard_degree={degree}: a standby is one worker, HSDP "
                             "restarts whole replicas; drop --standby")
    return replicas_of(cfg)
