"""What a job's snapshots protect it against, decided once at its start.

Before any agent starts, :func:`check_coding` builds the coder of every
coding group the job's plan has (:mod:`unbroken.snapshot.plan`): a plan the
coding library cannot build is refused then, naming the setting that fixes
it, rather than failing every snapshot of the run. :func:`announce` then says
in one line what the snapshots survive (per coding group: the loss of up to
``parity`` of its nodes) or, loudly (a warning), that they do not protect the
job against a node loss, and why; it records the same as a
``snapshot_protection`` event in ``events/launch.jsonl``, which
``unbroken report`` shows.

Invariants: a run whose snapshots are on has passed :func:`check_coding`;
every run prepared by ``unbroken train`` (or ``--prepare-only``) has one
``snapshot_protection`` event per launch; the event and the log line say the
same thing.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

from unbroken.config import Config
from unbroken.jsonl import JsonlWriter
from unbroken.snapshot.cadence import enabled
from unbroken.snapshot.erasure import EC_TYPE, Coding
from unbroken.snapshot.plan import SnapshotPlan, plan_for

__all__ = ["EVENTS_FILE", "announce", "check_coding", "job_plan", "protection"]

logger = logging.getLogger(__name__)

EVENTS_FILE = "launch.jsonl"
"""The launch's own event file, under ``RUN/events/``."""


def job_plan(cfg: Config, nodes: int, workers_per_node: int) -> SnapshotPlan:
    """The snapshot plan of the whole job (every worker live), without the state's size (one byte)."""
    node_of = {w: w // workers_per_node for w in range(nodes * workers_per_node)}
    s = cfg.snapshot
    return plan_for(node_of, node_of, redundancy=s.redundancy, parity=s.parity, state_bytes=1,
                    group_nodes=s.group_nodes)


def check_coding(cfg: Config, nodes: int, workers_per_node: int) -> SnapshotPlan:
    """The job's plan, once the coder of each of its groups is built.

    Raises:
        ValueError: the plan or a group's coder cannot be built (names the group size, the limit and the
            settings that change it).
    """
    s = cfg.snapshot
    plan = job_plan(cfg, nodes, workers_per_node)
    for size in sorted({len(g) for g in plan.groups}):
        k = size - plan.m
        try:
            Coding(k, plan.m).chunk(1 << 20)  # builds the backend's coder, as the first snapshot would
        except Exception as exc:  # pyeclib raises its own family; a missing library raises ImportError
            raise ValueError(
                f"snapshots of {nodes} nodes cannot be coded: a group of {size} nodes is k={k} data + m={plan.m} "
                f"parity fragments, which the coder ({EC_TYPE}) refuses ({exc}); set snapshot.group_nodes "
                f"(now {s.group_nodes}) or snapshot.parity (now {s.parity}) lower, or snapshot.redundancy=replica "
                f"or none") from None
    return plan


def protection(cfg: Config, nodes: int, workers_per_node: int) -> dict[str, Any]:
    """What the job's snapshots survive: the ``snapshot_protection`` event's fields (``message`` says it)."""
    s = cfg.snapshot
    on = enabled(s.every)
    plan = job_plan(cfg, nodes, workers_per_node)
    sizes = sorted({len(g) for g in plan.groups})
    fields: dict[str, Any] = {"snapshots": on, "protected": on and plan.protected, "scheme": s.redundancy,
                              "nodes": nodes, "parity": plan.m, "groups": len(plan.groups), "group_sizes": sizes,
                              "tolerates_per_group": 0}
    if not on:
        why = (f"snapshots are off (snapshot.every={s.every}): a whole-job failure goes back to the newest "
               f"checkpoint")
    elif nodes == 1:
        why = ("one node: no other node holds parity or a copy, so the snapshots survive worker failures, not "
               "the loss of the node")
    elif not plan.protected:
        why = (f"snapshot.redundancy={s.redundancy}: each node holds only its own piece of a snapshot, so the loss "
               f"of any node loses it (a whole-job restore then goes back to the checkpoint); "
               f"snapshot.redundancy=parity survives node losses")
    elif plan.m:
        span = f"{sizes[0]}" if len(sizes) == 1 else f"{sizes[0]}-{sizes[-1]}"
        fields["tolerates_per_group"] = plan.m
        return {**fields, "message": (
            f"snapshots: {nodes} nodes in {len(plan.groups)} coding group(s) of {span} nodes "
            f"(snapshot.group_nodes={s.group_nodes}); each group survives the loss of up to {plan.m} of its nodes "
            f"(snapshot.parity={plan.m}); more in one group leaves that snapshot incomplete (a restore takes an "
            f"older one, or the checkpoint)")}
    else:
        fields["tolerates_per_group"] = 1
        return {**fields, "message": (f"snapshots: {nodes} nodes, each node's pieces also held by the next "
                                      f"(snapshot.redundancy=replica): the loss of any one node is survived")}
    return {**fields, "reason": why, "message": f"snapshots do NOT protect this job against a node loss: {why}"}


def announce(cfg: Config, run_dir: Path, nodes: int, workers_per_node: int) -> dict[str, Any]:
    """Log what the job's snapshots survive (a warning when they do not protect it across nodes) and record it as
    a ``snapshot_protection`` event in ``RUN/events/launch.jsonl``; returns the event."""
    event = {"kind": "event", "event": "snapshot_protection", "t": time.time(),
             **protection(cfg, nodes, workers_per_node)}
    # A single-node job has nothing to protect across: said, not warned about
    (logger.warning if not event["protected"] and (nodes > 1 or not event["snapshots"]) else logger.info)(
        "%s", event["message"])
    writer = JsonlWriter(run_dir / "events" / EVENTS_FILE)
    try:
        writer.write(event)
    finally:
        writer.close()
    return event
