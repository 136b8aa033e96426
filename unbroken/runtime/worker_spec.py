"""What a worker process is told on its command line (:class:`WorkerSpec`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

__all__ = ["WorkerSpec"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerSpec:
    """Everything a worker process is told on its command line."""

    run_dir: Path
    worker: int
    world: int
    store: str
    join: bool = False
    resume: Path | None = None
    replica_incarnation: str = "0"
    """HSDP: names this start of the worker's replica (its ranks rendezvous on keys of their own)."""
    restore_gen: int | None = None
    """A joiner its agent started for the restored view of this generation (every member of which is a new
    incarnation): it enters that view even when it is already the current one."""
