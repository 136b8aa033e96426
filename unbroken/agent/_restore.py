"""An agent's part in bringing a whole job back: after every worker died, or at ``--resume``.

When every member of the current view is dead (a job-wide fault: an OOM, a
bug, a hung collective that forced a kill), each live agent publishes its
node's snapshot inventory (:func:`unbroken.snapshot.restore.inventory`: the
sealed buffers; a torn, foreign or corrupt one is reported and left out). The
inventory trusts seals authenticated with the job's secret (the workers check
every byte as they load it); after a restore whose members all died before
training a step it checks every byte of the node's snapshot memory (with
several threads over a memory map), so a buffer whose bytes no longer match
its seal is left out of the next attempt. The newest checkpoint is verified
file by file. Each runs in a thread of the agent of its own, never in its
loop, so the agent keeps beating however large the state, and the checkpoint's
scan does not wait behind the memory's. While either runs, or a decision waits, the
agent's loop ticks fast (:meth:`JobRestore.busy`), so the decision follows
the last inventory within milliseconds. The first
agent to claim the restore waits until every node's inventory is in, except
those of nodes whose agent stopped beating for ``AGENT_SILENT_S`` (a node
whose agent is gone is lost with its memory; a beating one is still checking
its memory), at most ``INVENTORY_DEADLINE_S``, then publishes the next view: the workers of the nodes that answered, from
the newest complete snapshot (rebuilt from parity where a node is missing) or
the newest committed checkpoint, whichever is newer. Every agent then starts
its workers of that view at once; they load the state in the view's group.

At ``--resume`` the same happens before the first view: node 0 decides, with
the checkpoint the launcher found (if any) as the fallback.

The circuit breaker. A restored view carries, in its spec, the errors of
every whole-job death since the job was last restored at that step without
committing a step after it (``failures``: per death, the job's own errors
of its members, :mod:`unbroken.agent._job_error`; none for deaths by a
signal from outside). The job stops only when the last
``MAX_RESTORES_PER_STEP`` of them share an error: a fault that recurs. Deaths
from outside never stop it: each further restore of the step waits longer
(:func:`restore_backoff`). When it stops, the agents exit without removing
the snapshot memory, and the launcher's message says what ``--resume`` will
continue from.

Invariant: one agent decides per dead view (compare-and-set); nothing is
deleted or overwritten on the way, so a failed restore leaves every source as
it was.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable

from unbroken.faults.injector import workers_of
from unbroken.checkpoint.checkpointer import latest_checkpoint, read_commit
from unbroken.runtime.membership import SHARD_LOST
from unbroken.store.job_store import JobStore
from unbroken.store.view import View
from unbroken.snapshot.restore import decide, inventory
from unbroken.agent._supervision import decode_mark
from unbroken.agent.rendezvous import StartRefused
from unbroken.runtime.snapshot_hooks import job_id

__all__ = ["AGENT_SILENT_S", "INVENTORY_DEADLINE_S", "JobRestore", "recurring_error", "restore_backoff"]

logger = logging.getLogger(__name__)

MAX_RESTORES_PER_STEP = 3
"""A job whose every worker died this many times in a row after being restored, each time with the same error
of its own (:mod:`unbroken.agent._job_error`), stops: a fault that recurs. Deaths by signal from outside do not
count: restores go on, each after :func:`restore_backoff`."""
RESTORE_BACKOFF_S = 1.0
"""The pause before the second restore of a step; it doubles with each further one, up to ``MAX_BACKOFF_S``."""
MAX_BACKOFF_S = 30.0
AGENT_SILENT_S = 3.0
"""The restoring agent goes on without the inventory of a node whose agent has not beaten for this long."""
INVENTORY_DEADLINE_S = 600.0
"""The longest the restoring agent waits for the inventories of agents that still beat (a node that checks
terabytes of memory); past it, the restore goes on without them."""
DECIDE_POLL_S = 0.02
"""While a decision waits for other nodes' inventories, the store is read this often for them."""
WATCH_S = 0.1
"""How often an agent whose node's members are all dead looks at the other members' heartbeats."""
START_GEN = -1
"""The inventories of a ``--resume`` are published under this pseudo-generation (before view 0)."""


class JobRestore:
    """One agent's side of whole-job restores (see the module docstring)."""

    def __init__(self, store: JobStore, *, node: int, nnodes: int, workers_per_node: int, run_dir: Path,
                 config_hash: str, event: Callable[..., None], shard_degree: int = 1) -> None:
        self.store, self.node, self.nnodes, self.per_node = store, node, nnodes, workers_per_node
        self.shard_degree = shard_degree  # HSDP: each shard index's snapshot is its own (snapshot.restore.decide)
        self.run_dir, self.config_hash, self.event = run_dir, config_hash, event
        self.job = job_id(run_dir, create=True)  # the launcher wrote it; an agent started alone may not have
        self._published: set[int] = set()
        # two threads: the checkpoint's scan (a sha256 of every file) never waits behind the memory's inventory
        self._pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix=f"restore-n{node}")
        self._inventories: dict[int, Future[dict[str, Any]]] = {}  # gen -> this node's inventory, being computed
        self._checkpoint_found: Future[tuple[int, str] | None] | None = None
        self._agent_beats: dict[int, tuple[int, float]] = {}
        self._deciding: _Pending | None = None
        self._beats: dict[int, tuple[int, float]] = {}
        self._next_watch = 0.0
        self._next_read = 0.0

    # -- after every worker died ------------------------------------------------

    def all_dead(self, view: View) -> None:
        """Every member of ``view`` is dead: publish this node's inventory; maybe claim the restore.

        The inventory trusts the seals (authenticated with the job's secret; the load checks every byte it
        reads), unless ``view`` was itself a restore that trained nothing: its load may have met bytes that
        do not match their seal, and every byte is checked this time (that buffer is then left out)."""
        failures = self._failed_restores(view) if view.restore is not None else []
        self._publish(view.gen, verify=bool(failures))
        if self._deciding is None and self.store.claim_restore(view.gen, self.node):
            now = time.monotonic()
            self._claimed(_Pending(view=view, inventories_by=now + INVENTORY_DEADLINE_S,
                                   not_before=now + restore_backoff(len(failures)), failures=failures, claimed_at=now,
                                   shard_lost=self._shard_lost(view)))

    def busy(self) -> bool:
        """This node's inventory is being computed, or this agent waits to decide a restore: its loop should
        tick fast (each tick of the loop's idle pace would delay the restore)."""
        return bool(self._inventories) or self._deciding is not None

    def tick(self, now: float) -> str | None:
        """Decide once the inventories are in; returns a failure message if nothing can be restored."""
        self._publish_ready()
        pending, found = self._deciding, self._checkpoint_found
        if pending is None or found is None or now < pending.not_before or not found.done() or now < self._next_read:
            return None
        self._next_read = now + DECIDE_POLL_S
        view = pending.view
        invs = self.store.inventories(view.gen if view is not None else START_GEN, self.nnodes)
        if self._waiting_for(invs, now) and now < pending.inventories_by:
            return None
        self._deciding = None
        if view is not None and (recurring := recurring_error(pending.failures)) is not None:  # none at --resume
            return (f"every worker died {len(pending.failures)} times in a row after being restored at step "
                    f"{view.step}, each time with the same error ({recurring}): a fault that recurs, so the "
                    f"restores stop; see the workers' logs under {self.run_dir / 'logs'} and fix its cause first")
        inventories = [json.loads(t) for t in invs.values()]
        spec = decide(inventories, checkpoint=found.result(),
                      members_of=lambda nodes: [w for n in nodes for w in workers_of(n, self.per_node)],
                      shard_degree=self.shard_degree)
        if spec is None:
            who = f"every member of view {view.gen} {list(view.members)} is dead" if view else "--resume"
            return (f"no live worker left: {who}, and nothing to restore from: no complete snapshot in the "
                    f"memory of nodes {sorted(invs)} and no committed checkpoint under {self.run_dir / 'checkpoints'}")
        if pending.shard_lost is not None and spec["source"] != "memory":
            # The members are alive; only their optimizer state is incomplete. Memory had nothing newer than
            # the checkpoint: going back to it is for the user to decide (--resume), as before.
            return (f"stopped: {pending.shard_lost}; snapshot memory holds nothing newer than the checkpoint of "
                    f"step {spec['step']}")
        spec["failures"] = pending.failures  # carried by the views of this step: the next restore counts on
        members = tuple(spec.get("members") or [w for n in sorted(invs) for w in workers_of(n, self.per_node)])
        for w in members:
            self.store.clear_dead(w)
            self.store.clear_join(w)
        # The job's committed history is now the restored step's: steps past it count only once trained again
        # (so a death before any of them is one "right after the restore" for the circuit breaker).
        self.store.set_progress(spec["step"])
        lost = sorted(set(range(self.nnodes)) - set(invs))
        reason = (f"restored from {'snapshot memory' if spec['source'] == 'memory' else 'the checkpoint'} "
                  f"at step {spec['step']}" + (f" without lost nodes {lost}" if lost else ""))
        new = View(gen=(view.gen + 1) if view is not None else _next_generation(self.run_dir), members=members,
                   step=spec["step"],
                   reason=reason, restore=spec)
        if view is None:
            self.store.publish_initial(new)
        else:
            self.store.propose(view, new)
        for w in members:  # a mark that landed after the first clear, made for the view this one replaces
            self.store.clear_dead(w)
        self.event("job_restore", None, restored_from=spec["source"], step=spec["step"], gen=new.gen,
                   members=list(members), lost_nodes=lost, parity_stripes=spec.get("parity_stripes", []),
                   failed_restores=pending.failures, backoff_s=restore_backoff(len(pending.failures)),
                   inventory_s={str(inv["node"]): inv.get("seconds") for inv in inventories},
                   inventory_bytes={str(inv["node"]): inv.get("bytes") for inv in inventories},
                   decided_s=round(time.monotonic() - pending.claimed_at, 4))
        logger.warning("node %d: %s (view %d, members %s)", self.node, reason, new.gen, list(members))
        return None

    def workers_to_start(self, view: View, running: set[int]) -> list[int]:
        """This node's workers a restored ``view`` names that are not running (start them now)."""
        if view.restore is None:
            return []
        return [w for w in workers_of(self.node, self.per_node) if w in view.members and w not in running]

    def mark_silent(self, current_view: Callable[[], View | None], now: float, timeout_s: float) -> list[int]:
        """Once every member on this node is marked dead, mark dead the other members whose heartbeat
        stood still for ``timeout_s`` while this agent watched; returns them.

        A node lost together with every other worker (its agent killed with them) leaves nobody to mark
        its workers dead: their peers are dead too. Without this the job would wait for ever instead of
        being restored. While any member of this node lives, its own failure detector does this job.
        """
        if now < self._next_watch:
            return []
        self._next_watch = now + WATCH_S
        view = current_view()
        mine = [w for w in view.members if w in workers_of(self.node, self.per_node)] if view else []
        if view is None or not self.store.all_marked_dead(tuple(mine)):  # one round trip; empty: False
            self._beats.clear()
            return []
        others = [w for w in view.members if w not in mine]
        silent = []
        for w, beat in zip(others, self.store.heartbeats(others)):
            seen = self._beats.get(w)
            if seen is None or seen[0] != beat:
                self._beats[w] = (beat, now)
            elif now - seen[1] > timeout_s and not self.store.is_marked_dead(w):
                silent.append(w)
        for w in silent:
            reason = json.dumps({"by": "agent", "node": self.node, "how": "heartbeat", "gen": view.gen,
                                 "silent_s": round(now - self._beats[w][1], 3), "t": time.time()})
            if not self.store.mark_dead(w, reason):
                continue
            newer = current_view()
            if newer is not None and newer.gen > view.gen and w in newer.members:
                # A restore published a new view (a new incarnation of w) while this agent watched the old
                # one: the mark was for the dead incarnation; withdrawn unless someone else's replaced it.
                self.store.unmark_dead(w, reason)
                continue
            logger.warning("node %d: worker %d silent for %.1f s with every worker of this node dead: marked dead",
                           self.node, w, now - self._beats[w][1])
        return silent

    # -- at --resume ------------------------------------------------------------

    def first_view(self, heartbeat: Callable[[], None], poll_s: float) -> None:
        """``--resume``: publish this node's inventory; node 0 waits for the others' and publishes view 0.

        Raises:
            StartRefused: nothing to resume from (the message says what was looked for).
        """
        self.at_start()
        # Every node waits (beating) until its own inventory is out; node 0 then until it has decided.
        while START_GEN in self._inventories or (self.node == 0 and not self.store.has_view()):
            heartbeat()
            if (failure := self.tick(time.monotonic())) is not None:
                raise StartRefused(f"--resume: {failure}")
            time.sleep(poll_s)

    def at_start(self) -> None:
        """``--resume``: publish this node's inventory; node 0 decides the first view."""
        self._publish(START_GEN, verify=True)  # memory left by an earlier launch: every byte checked
        if self.node == 0 and self.store.claim_restore(START_GEN, self.node):
            now = time.monotonic()
            self._claimed(_Pending(view=None, inventories_by=now + INVENTORY_DEADLINE_S, not_before=now, failures=[],
                                   claimed_at=now))

    # -- helpers ----------------------------------------------------------------

    def _publish(self, gen: int, *, verify: bool) -> None:
        """Start taking this node's inventory for view ``gen``'s restore (published by :meth:`tick` when done);
        ``verify``: every byte checked (:func:`unbroken.snapshot.restore.inventory`)."""
        if gen in self._published:
            return
        self._published.add(gen)
        self._inventories[gen] = self._pool.submit(inventory, self.job, self.node, config_hash=self.config_hash,
                                                   verify=verify)

    def _publish_ready(self) -> None:
        """Publish the inventories the thread finished (the store is written from the agent's loop only)."""
        for gen, fut in [(g, f) for g, f in self._inventories.items() if f.done()]:
            del self._inventories[gen]
            try:
                inv = fut.result()
            except Exception as exc:  # unreadable memory: published empty, the others may still serve
                logger.error("node %d snapshot memory could not be checked: %s", self.node, exc)
                inv = {"node": self.node, "seals": [], "layouts": {}, "problems": [f"{type(exc).__name__}: {exc}"]}
            for problem in inv["problems"]:
                logger.warning("node %d snapshot memory: %s (not used)", self.node, problem)
                self.event("snapshot_fallback", None, problem=problem)
            self.store.publish_inventory(gen, self.node, self.nnodes, json.dumps(inv, separators=(",", ":")))

    def _claimed(self, pending: _Pending) -> None:
        """This agent decides the restore: find the newest intact checkpoint meanwhile (in the thread)."""
        self._deciding, self._agent_beats = pending, {}
        self._checkpoint_found = self._pool.submit(self._checkpoint)

    def _waiting_for(self, invs: dict[int, str], now: float) -> list[int]:
        """The nodes without an inventory yet whose agent still beats (judged on this agent's clock)."""
        missing = [r for r in range(self.nnodes) if r not in invs]
        waiting = []
        for r in missing:
            beat = self.store.agent_beat(r, 0)
            seen = self._agent_beats.get(r)
            if seen is None or seen[0] != beat:
                self._agent_beats[r] = seen = (beat, now)
            if now - seen[1] < AGENT_SILENT_S:
                waiting.append(r)
        return waiting

    def _failed_restores(self, view: View) -> list[list[str]]:
        """The job's own errors of each whole-job death since its last restore committed nothing, oldest
        first, this death of ``view`` last (``[]`` for a death by signal); empty when ``view`` trained on."""
        if view.restore is None or (self.store.progress() or 0) > view.step:
            return []  # no restore, or the restored view applied a step before it died: a new story
        marks = [decode_mark(self.store.dead_mark(w) or "") for w in view.members]
        errors = sorted({m["error"] for m in marks if isinstance(m, dict) and m.get("error")})
        return [*view.restore.get("failures", []), errors]

    def _shard_lost(self, view: View) -> str | None:
        """Why the members of ``view`` left, when they all left because an optimizer shard was lost with its
        copies (:class:`~unbroken.sharding.state.ShardLost`: alive, their state incomplete); else None."""
        marks = [decode_mark(self.store.dead_mark(w) or "") for w in view.members]
        lost = [m for m in marks if isinstance(m, dict) and m.get("how") == SHARD_LOST]
        return str(lost[0].get("error")) if lost and len(lost) == len(marks) else None

    def _checkpoint(self) -> tuple[int, str] | None:
        try:
            path = latest_checkpoint(self.run_dir)
        except Exception as exc:  # a damaged checkpoint directory: memory may still serve
            logger.warning("no usable checkpoint: %s", exc)
            return None
        return (int(read_commit(path)["step"]), str(path)) if path is not None else None


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Pending:
    """A restore this agent claimed and will decide once the inventories are in and the backoff is over."""

    view: View | None
    """The view whose members all died; None at ``--resume``."""
    inventories_by: float
    not_before: float
    failures: list[list[str]]
    """See :meth:`JobRestore._failed_restores`."""
    shard_lost: str | None = None
    """See :meth:`JobRestore._shard_lost`: the restore is one only from memory newer than the checkpoint."""
    claimed_at: float
    """When this agent claimed the decision (its loop's clock)."""


def restore_backoff(failed: int) -> float:
    """Seconds to wait before a restore that follows ``failed`` failed restores of the same step: 0, then
    1, 2, 4 ... up to ``MAX_BACKOFF_S``, so that faults from outside that land on workers while they start
    (a scheduler, an operator) meet fewer, later starts."""
    return 0.0 if failed == 0 else min(RESTORE_BACKOFF_S * 2 ** (failed - 1), MAX_BACKOFF_S)


def recurring_error(failures: list[list[str]]) -> str | None:
    """The error common to the last ``MAX_RESTORES_PER_STEP`` failed restores, if every one of them had it."""
    if len(failures) < MAX_RESTORES_PER_STEP:
        return None
    common = set.intersection(*(set(f) for f in failures[-MAX_RESTORES_PER_STEP:]))
    return min(common) if common else None


def _next_generation(run_dir: Path) -> int:
    """The first generation of a resumed job: above every generation its earlier launches recorded.

    The ledger tells attempts apart by generation, so a step trained again after ``--resume`` must not
    share its generation with the launch that trained it first.
    """
    from unbroken.runtime.ledger import read_events  # local: only a resume reads the whole history

    return 1 + max((int(r["gen"]) for r in read_events(run_dir) if isinstance(r.get("gen"), int)), default=-1)
