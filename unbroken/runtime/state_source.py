"""Where a worker's state comes from when its view changes: a restore, its node's snapshot memory, or a peer.

A view change (:meth:`~unbroken.runtime.view_changes.ViewChanges.adopt`) asks the worker's :class:`StateSource`:

- a joiner asks whether it :meth:`rejoins_from_memory` at all (its join request says so);
- every member of a restored view :meth:`restore` s the state the view names (snapshot memory or checkpoint);
- the leader asks whether a joiner :meth:`may_load_from_memory` (its node holds the boundary's snapshot), and
  such a joiner :meth:`load_from_memory` instead of receiving the state from a peer;
- before such a joiner reads, every other member :meth:`seal_before_admission` its share of that snapshot.

A run without snapshots still restores (from a checkpoint); it never loads from memory.

Invariant: a joiner reads its node's memory only once every member that wrote the step's snapshot there has
sealed it (sealed before arriving in the view; the joiner reads after everyone arrived).
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any, Callable

import torch

from unbroken.config import Config
from unbroken.jsonl import JsonlWriter
from unbroken.runtime.membership import View
from unbroken.runtime.snapshot_hooks import (load_from_node_memory, memory_rejoin_allowed, memory_rejoin_failed,
                                             memory_rejoin_possible, restore_state)
from unbroken.sharding.layout import StateLayout
from unbroken.sharding.parallelism import Parallelism
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.store.job_store import JobStore

__all__ = ["Broadcast", "StateSource"]

logger = logging.getLogger(__name__)

Broadcast = Callable[[torch.Tensor, int], object]
"""``broadcast(tensor, src)`` over the view's group (``src``: a rank of it)."""


class StateSource:
    """Where this worker's state comes from when its view changes (module docstring).

    Args:
        cfg: the job's config.
        run_dir: the run directory (its snapshots' job id and node layout).
        parallelism: where this worker stands (its shard of the state).
        job: what is trained (its model and optimizer receive the state).
        snapshots: this worker's snapshotter (None: the run takes no snapshots).
        store: the job store (joiners' requests).
        layout: the state's layout across ranks (told of a restore).
        events: this worker's ledger and event log; ``event(name, **fields)`` writes an event to it.
        config_hash: the job's config hash (a snapshot or checkpoint of another config is refused).
    """

    def __init__(self, *, cfg: Config, run_dir: Path, world: int, parallelism: Parallelism, job: Any,
                 snapshots: Snapshotter | None, store: JobStore, layout: StateLayout, events: JsonlWriter,
                 event: Callable[..., None], config_hash: str) -> None:
        self.cfg, self.run_dir, self.world, self.parallelism = cfg, run_dir, world, parallelism
        self.worker = parallelism.worker
        self.job, self.snapshots, self.store, self.layout = job, snapshots, store, layout
        self.events, self.event, self.config_hash = events, event, config_hash

    def restore(self, view: View, members: tuple[int, ...], broadcast: Broadcast) -> None:
        """Load the state ``view.restore`` names (every member of a restored view does); ``members`` are the
        workers ``broadcast`` reaches, by rank."""
        assert view.restore is not None  # a restored view
        t0 = time.perf_counter()
        if self.snapshots is not None:
            self.snapshots.wait()
        done = restore_state(view.restore, run_dir=self.run_dir, worker=self.worker, world=self.world,
                             members=members, broadcast=broadcast, model=self.job.model,
                             optimizer=self.job.optimizer, device=self.job.device, config_hash=self.config_hash,
                             shard_index=self.parallelism.index)
        self.layout.restored(view.gen)
        self.events.write({"kind": "restore", "step": view.step, "gen": view.gen, "worker": self.worker})
        self.event("restored", **{**done, "gen": view.gen, "step": view.step, "seconds": time.perf_counter() - t0})
        self.event("state_loaded", how="restore", source=done["restored_from"], gen=view.gen, step=view.step,
                   bytes=done.get("bytes"), seconds=done.get("seconds"), gb_s=done.get("gb_s"))
        logger.info("restored the state of step %d from %s in %.2f s", view.step, done["restored_from"],
                    time.perf_counter() - t0)

    def rejoins_from_memory(self) -> bool:
        """Joiner: may this worker ask to load its state from its node's memory? Snapshots are taken, they hold
        its whole state (not under ZeRO-1: its range of the moments comes in the re-shard), and no load from
        memory failed for it before."""
        return (self.snapshots is not None and self.layout.rejoins_from_memory
                and memory_rejoin_allowed(self.run_dir, self.worker))

    def may_load_from_memory(self, joiner: int, view: View, step: int) -> bool:
        """Leader: ``joiner`` loads the state of ``step`` from its node's memory (no transfer) when its
        node's live members snapshotted that step under ``view`` and hold enough fragments to decode it."""
        if self.snapshots is None:
            return False
        info = self.store.join_request(joiner) or {}
        snapshotted = not self.snapshots.auto or self.snapshots.last_step == step  # auto: not every boundary
        return bool(info.get("memory")) and snapshotted and memory_rejoin_possible(
            self.cfg, self.run_dir, self.world, joiner, view.members, step, self.parallelism.replicas)

    def load_from_memory(self, view: View) -> None:
        """Joiner: the state of ``view.step`` from this node's snapshot memory (a failure is remembered, so
        the next incarnation asks for a transfer instead)."""
        t0 = time.perf_counter()
        try:
            done = load_from_node_memory(self.run_dir, self.worker, self.world, view.step, self.job.model,
                                         self.job.optimizer, self.job.device, self.config_hash,
                                         self.parallelism.shard)
        except Exception as exc:
            memory_rejoin_failed(self.run_dir, self.worker, f"{type(exc).__name__}: {exc}")
            raise
        self.event("rejoin_from_memory", gen=view.gen, **{**done, "seconds": time.perf_counter() - t0})
        self.event("state_loaded", how="memory", gen=view.gen, step=view.step, bytes=done.get("bytes"),
                   seconds=done.get("seconds"), gb_s=done.get("gb_s"))

    def seal_before_admission(self) -> None:
        """Member: make this worker's share of the boundary's snapshot sealed before joiners read it."""
        if self.snapshots is not None:
            self.snapshots.wait()
