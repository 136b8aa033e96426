"""Reading the ledger: was every ``(step, slot, row)`` trained exactly once?

Workers append to ``<run>/events/w<id>.jsonl``:

- ``{"kind": "work", "step", "gen", "worker", "items": [[slot, a, b, mode], ...]}``
  before its all-reduce (so whatever a committed reduction contains, its
  contributors have recorded, a worker that died right after included);
- ``{"kind": "commit", "step", "gen", "worker"}`` after applying a step;
- ``{"kind": "event", "event": ...}`` for view changes, takeovers, rejoins;
- ``{"kind": "restore", "step", "gen"}`` when a job comes back from a snapshot
  or checkpoint of ``step``: commits of steps ``>= step`` in generations below
  ``gen`` are superseded (those steps are trained again; the final history is
  the one that counts);
- ``{"kind": "resume", "step", "time"}`` (``events/resume.jsonl``) when ``--resume`` continues the run from
  ``step``: work and commits of steps ``>= step`` written before it belong to the job that stopped (their
  steps are trained again by the resumed one, whose generations start again at 0).

The committed attempt of a step is the generation its commit records name
(they must agree). Only the work records of that attempt count; records of
aborted attempts are history. The check is exact: it enumerates rows.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from pathlib import Path
from typing import Any

from unbroken.jsonl import read_jsonl


@dataclasses.dataclass(kw_only=True)
class LedgerCheck:
    """Outcome of :func:`check_ledger`; ``ok`` when nothing was lost or repeated."""

    steps: int
    committed: int
    lost_steps: list[int]
    conflicting_steps: list[int]
    rows_never: int
    rows_twice: int
    examples: list[str]
    approx_rows: int
    degraded_steps: int

    @property
    def ok(self) -> bool:
        return not (self.lost_steps or self.conflicting_steps or self.rows_never or self.rows_twice)

    def to_json(self) -> dict[str, Any]:
        return {**dataclasses.asdict(self), "ok": self.ok}


def read_events(run_dir: str | Path) -> list[dict[str, Any]]:
    """All records of all workers' and agents' event files, in file order."""
    out: list[dict[str, Any]] = []
    for f in sorted((Path(run_dir) / "events").glob("*.jsonl")):
        out.extend(read_jsonl(f))
    return out


def check_ledger(run_dir: str | Path, *, n_slots: int, micro_batch: int, steps: int,
                 start_step: int = 0, n_workers: int | None = None) -> LedgerCheck:
    """Verify exactly-once training of steps ``[start_step, steps)`` from the event files (``n_workers``: the
    job's workers, default ``n_slots``; a step is degraded when a slot is computed by another worker than
    its home worker, ``slot % n_workers``)."""
    records = read_events(run_dir)
    commit_gens: dict[int, set[int]] = defaultdict(set)
    work: dict[tuple[int, int], list[tuple[int, list[Any]]]] = defaultdict(list)
    restores = [(r["step"], r["gen"]) for r in records if r.get("kind") == "restore"]
    resumes = [(r["step"], r["time"]) for r in records if r.get("kind") == "resume"]
    homes = n_slots if n_workers is None else n_workers

    def superseded(r: dict[str, Any]) -> bool:
        step = r["step"]
        return any(step >= s and r["gen"] < g for s, g in restores) or \
            any(step >= s and r.get("time", 0.0) < t for s, t in resumes)

    for r in records:
        if r.get("kind") in ("commit", "work") and superseded(r):
            continue
        if r.get("kind") == "commit":
            commit_gens[r["step"]].add(r["gen"])
        elif r.get("kind") == "work":
            work[(r["step"], r["gen"])].extend((r["worker"], item) for item in r["items"])
    lost: list[int] = []
    conflicting: list[int] = []
    examples: list[str] = []
    never = twice = approx = degraded = 0
    for step in range(start_step, steps):
        gens = commit_gens.get(step, set())
        if not gens:
            lost.append(step)
            continue
        if len(gens) > 1:
            conflicting.append(step)
            continue
        count = [[0] * micro_batch for _ in range(n_slots)]
        items = work.get((step, next(iter(gens))), [])
        for _, (slot, a, b, mode) in items:
            for row in range(a, b):
                count[slot][row] += 1
            if mode != "exact":
                approx += b - a
        degraded += any(worker != slot % homes for worker, (slot, *_) in items)
        for slot in range(n_slots):
            for row in range(micro_batch):
                c = count[slot][row]
                if c != 1:
                    never += c == 0
                    twice += c > 1
                    if len(examples) < 10:
                        examples.append(f"step {step} slot {slot} row {row} trained {c} times")
    return LedgerCheck(steps=steps - start_step, committed=len(commit_gens), lost_steps=lost,
                       conflicting_steps=conflicting, rows_never=never, rows_twice=twice, examples=examples,
                       approx_rows=approx, degraded_steps=degraded)

