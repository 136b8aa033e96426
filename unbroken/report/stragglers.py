"""Straggler episodes of a run (:mod:`unbroken.runtime.stragglers`): who, from which step to which, the rows
handed to the others, and what the episode cost (its median step time over the run's other steps)."""

from __future__ import annotations

import statistics
from typing import Any

__all__ = ["straggler_episodes"]


def straggler_episodes(records: list[dict[str, Any]], steps: dict[int, dict[str, Any]], *, n_slots: int,
                       n_workers: int, micro_batch: int, last_step: int) -> list[dict[str, Any]]:
    """One dict per episode: ``worker``, ``since`` (the first step it kept fewer rows), ``until`` (the first it
    kept all again; None: the run's end), ``steps``, ``rows_moved``, ``step_s`` (median step time during it),
    ``cost`` (that over the median of the steps outside every episode; None without such steps)."""
    events = [r for r in records if r.get("kind") == "event"]
    starts = [e for e in events if e.get("event") == "straggler"]
    ends = [e for e in events if e.get("event") == "straggler_end"]
    out: list[dict[str, Any]] = []
    for s in sorted(starts, key=lambda e: (e["step"], e["slow"])):
        end = next((e for e in sorted(ends, key=lambda e: e["step"])
                    if e["slow"] == s["slow"] and e["since"] == s["step"]), None)
        until = end["step"] if end is not None else None
        span = range(s["step"], until if until is not None else last_step + 1)
        moved = end["rows_moved"] if end is not None else _moved(records, s["slow"], span, n_slots=n_slots,
                                                                  n_workers=n_workers, micro_batch=micro_batch)
        out.append({"worker": s["slow"], "since": s["step"], "until": until, "steps": len(span),
                    "ratio": s.get("ratio"), "rows_moved": moved, "why_ended": end.get("why") if end else None,
                    "step_s": _median([steps[k + 1]["step_time_s"] for k in span if k + 1 in steps])})
    inside = {k for ep in out for k in range(ep["since"], ep["until"] if ep["until"] is not None else last_step + 1)}
    normal = _median([r["step_time_s"] for k, r in steps.items() if k - 1 not in inside])
    for ep in out:
        ep["cost"] = ep["step_s"] / normal if ep["step_s"] is not None and normal else None
    return out


def _moved(records: list[dict[str, Any]], worker: int, span: range, *, n_slots: int, n_workers: int,
           micro_batch: int) -> int:
    """Rows of ``worker``'s home slots that others computed in the committed attempts of the steps of ``span``."""
    gens = {r["step"]: r["gen"] for r in records if r.get("kind") == "commit" and r["step"] in span}
    moved = 0
    for r in records:
        if r.get("kind") == "work" and r["step"] in gens and r["gen"] == gens[r["step"]] and r["worker"] != worker:
            moved += sum(b - a for slot, a, b, _ in r["items"] if slot % n_workers == worker and slot < n_slots)
    return moved


def _median(xs: list[float]) -> float | None:
    return statistics.median(xs) if xs else None
