"""One node's record, as the parts of its agent share it: its workers, their incarnations and deaths, the job's
progress and generation as last seen, and where it writes.

:class:`unbroken.agent.agent.Agent` builds one :class:`Node` once it has joined the store and taken the job's
config, and hands it to each of its parts at construction: the reaper (:mod:`unbroken.agent._reaper`: deaths,
marks, fencing), the starter (:mod:`unbroken.agent._starter`: starts, adoption, the standby, restarts due) and the
fault firing (:mod:`unbroken.agent._fault_firing`). Each part owns the rest of its state itself.

Invariants: a worker has at most one record in :attr:`Node.workers` (one process the agent supervises); a record
leaves it when its process is seen dead (then it may sit in :attr:`Node.dying` until reaped) or the agent exits;
the progress only grows.
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import time
from pathlib import Path
from typing import Any

from unbroken.agent._supervision import Incarnation
from unbroken.agent.options import AgentOptions
from unbroken.jsonl import JsonlWriter
from unbroken.sharding.replica_layout import ReplicaLayout
from unbroken.store.job_store import JobStore

__all__ = ["EventLog", "Node"]


class EventLog:
    """This node's ``events/agent<R>.jsonl``: one line per event (failure, fence, start ...), each with its node,
    worker and wall-clock time."""

    def __init__(self, path: Path, node: int) -> None:
        self.node = node
        self._writer: JsonlWriter | None = JsonlWriter(path)

    def __call__(self, event: str, worker: int | None, **fields: Any) -> None:
        if self._writer is not None:
            self._writer.write({"kind": "event", "event": event, "node": self.node, "worker": worker,
                                "t": time.time(), **fields})

    def close(self) -> None:
        """Close the file; later events are dropped (the agent is exiting)."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None


@dataclasses.dataclass(kw_only=True, eq=False)
class Node:
    """One node's record (module docstring): what more than one part of its agent reads or changes."""

    rank: int
    opts: AgentOptions
    store: JobStore
    event: EventLog
    log: logging.LoggerAdapter[logging.Logger]
    replicas: ReplicaLayout
    """HSDP (``train.shard_degree``): a replica is consecutive workers, all on this node; the death of one takes
    its siblings down (fenced here), and they start again together."""
    total_steps: int
    progress: int
    """The job's committed progress, as last read (log lines, fault steps, restart steps)."""
    gen: int = 0
    """The newest view generation seen (log lines, restored views)."""
    workers: dict[int, Incarnation] = dataclasses.field(default_factory=dict)
    """The running incarnation of each of this node's workers that has one."""
    incarnations: dict[int, int] = dataclasses.field(default_factory=dict)
    """How many processes each worker has had (its next start is the next incarnation)."""
    dying: list[tuple[Incarnation, float]] = dataclasses.field(default_factory=list)
    """Incarnations seen dying (and when), not reaped yet."""
    finished: set[int] = dataclasses.field(default_factory=set)
    """Workers whose last process exited cleanly."""
    done_at: float | None = None
    """When the job was seen done (the agent's clock); None while it runs."""
    idle_since: float | None = None
    """Since when no local worker runs while every one finished (None: one runs, or one is due)."""
    replica_token: str = dataclasses.field(default_factory=lambda: secrets.token_hex(4))
    """This agent's replica incarnations: keys of their own (``--replica-incarnation``)."""
    replica_losses: dict[int, int] = dataclasses.field(default_factory=dict)
    """How often each replica of this node lost a worker (each loss: its next start gets new keys)."""

    @property
    def run_dir(self) -> Path:
        return self.opts.run_dir

    def read_progress(self) -> int:
        """The job's committed progress, read from the store (it never goes back here)."""
        progress = self.store.progress()
        if progress is not None:
            self.progress = max(self.progress, progress)
        return self.progress

    def mark(self, w: int) -> str | None:
        """Worker ``w``'s dead mark in the store, if any."""
        return self.store.dead_mark(w)

    def replica_incarnation(self, w: int) -> str | None:
        """HSDP: the incarnation of worker ``w``'s replica a start of ``w`` now joins; None without HSDP."""
        if self.replicas.shard_degree == 1:
            return None
        return f"{self.replica_token}.{self.replica_losses.get(self.replicas.replica_of(w), 0)}"
