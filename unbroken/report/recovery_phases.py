"""Where each recovery of a run went: its phases, from the run's own events, in seconds after the kill.

A recovery starts at a kill: the ``fault_self`` events of the workers that
killed themselves (``fail_at ... :kill``), or an agent's ``fault_injected``
SIGKILL (its targets); kills within :data:`SAME_FAILURE_S` of the first are one
failure (a whole job's). Its phases, each the time of an event minus the
kill's, the latest over the killed workers where several:

- ``death_seen``: its agent recorded the death (``worker_exit``; ``seen`` says
  whether while the kernel still tore it down), ``reaped``: its process was
  reaped (``worker_reaped``, else the same);
- ``process_ready``: the restarted worker had built its job and waited to be
  let in (its ``start_phases`` event less its ``admission`` phase);
- ``decided``: the restore was decided (``job_restore``), or the joiner's
  admission (the view naming it a joiner, when its first member began to adopt
  it);
- ``state_loaded``: the state was in its tensors (``state_loaded``, with bytes,
  seconds and GB/s), else the joiner's own adoption ended (a transfer from a
  peer);
- ``first_step``: the restarted worker committed its first step
  (``first_step_after_recovery``); ``survivors_step``: the first step any
  worker not killed committed after the kill (training went on without it);
- ``steps_back``: the first step after the restarted worker's first whose
  duration is within :data:`BACK_WITHIN` of the median step before the kill.

Invariants: pure (events in, dicts out); a phase with no event is None, never
guessed.
"""

from __future__ import annotations

import statistics
from typing import Any, Iterable

__all__ = ["BACK_WITHIN", "SAME_FAILURE_S", "recoveries"]

SAME_FAILURE_S = 2.0
"""Kills this close to the first are the same failure (every worker of a job kills itself in one step)."""
BACK_WITHIN = 1.25
"""A step is back at speed when it lasts at most this times the median step before the kill."""

Event = dict[str, Any]


def _kills(events: list[Event]) -> list[tuple[float, list[int], int | None]]:
    """``(time, workers, step)`` of each failure by a kill."""
    hits = []
    for e in events:
        if e.get("event") == "fault_self" and e.get("how") == "kill":
            hits.append((e["time"], [e["worker"]], e.get("step")))
        elif e.get("event") == "fault_injected" and e.get("signal") == "SIGKILL":
            hits.append((e["time"], list(e.get("targets") or []), e.get("progress")))
    out: list[tuple[float, list[int], int | None]] = []
    for t, workers, step in sorted(hits, key=lambda h: h[0]):
        if out and t - out[-1][0] <= SAME_FAILURE_S:
            out[-1][1].extend(w for w in workers if w not in out[-1][1])
        else:
            out.append((t, workers, step))
    return out


def _first(events: Iterable[Event], after: float, until: float, **match: Any) -> Event | None:
    for e in events:
        if after <= e["time"] < until and all(e.get(k) == v for k, v in match.items()):
            return e
    return None


def _latest(found: list[Event | None], kill: float, at: Any = None) -> float | None:
    """The latest of the events' times (or ``at(event)``) after ``kill``; None when any is missing."""
    present = [e for e in found if e is not None]
    if not found or len(present) < len(found):
        return None
    return round(max((at(e) if at else e["time"]) for e in present) - kill, 4)


def _commits(events: list[Event]) -> list[tuple[float, int, list[int]]]:
    """Each committed ``(step, gen)`` once: ``(first commit time, step, workers that committed it)``, by time."""
    seen: dict[tuple[int, int], tuple[float, int, list[int]]] = {}
    for e in events:
        if e.get("kind") == "commit":
            key = (e["step"], e["gen"])
            t, step, who = seen.get(key, (e["time"], e["step"], []))
            seen[key] = (min(t, e["time"]), step, who + [e["worker"]])
    return sorted(seen.values())


def _steps_back(commits: list[tuple[float, int, list[int]]], kill: float, since: float | None) -> tuple[
        float | None, float | None]:
    """``(median step before the kill, seconds from the kill to the first step at that pace after since)``."""
    before = [b[0] - a[0] for a, b in zip(commits, commits[1:]) if b[0] < kill][2:]  # the first steps warm up
    if not before or since is None:
        return (statistics.median(before) if before else None), None
    median = statistics.median(before)
    after = [c for c in commits if c[0] >= since]
    for prev, cur in zip(after, after[1:]):
        if cur[0] - prev[0] <= BACK_WITHIN * median:
            return median, round(cur[0] - kill, 4)
    return median, None


def _one(events: list[Event], kill: float, workers: list[int], step: int | None, until: float,
         commits: list[tuple[float, int, list[int]]]) -> dict[str, Any]:
    exits = [_first(events, kill - 1.0, until, event="worker_exit", worker=w, clean=False) for w in workers]
    reaped = [_first(events, kill - 1.0, until, event="worker_reaped", worker=w) or x for w, x in zip(workers, exits)]
    starts = [_first(events, kill, until, event="start_phases", worker=w, join=True) for w in workers]
    restore = _first(events, kill, until, event="job_restore")
    views = [e for e in events if kill <= e["time"] < until and e.get("event") == "view_adopted"]
    # the view that admits w: published when its first member began to adopt it; w's state in once w adopted it
    admitting = [min((e for e in views if w in e.get("joiners", [])), default=None,
                     key=lambda e: e["time"] - e.get("adopt_s", 0.0)) for w in workers]
    admitted = [next((e for e in views if e.get("worker") == w and w in e.get("joiners", [])), None) for w in workers]
    loaded = [_first(events, kill, until, event="state_loaded", worker=w) for w in workers]
    first = [_first(events, kill, until, event="first_step_after_recovery", worker=w) for w in workers]
    survivors = next((c for c in commits if c[0] > kill and set(c[2]) - set(workers)), None)
    first_s = _latest(first, kill)
    median, back = _steps_back(commits, kill, None if first_s is None else kill + first_s)
    out: dict[str, Any] = {
        "kill_step": step, "workers": sorted(workers), "whole_job": restore is not None,
        "death_seen": _latest(exits, kill), "seen_while": sorted({x.get("seen", "reaped") for x in exits if x}),
        "reaped": _latest(reaped, kill),
        "process_ready": _latest(starts, kill, lambda e: e["time"] - e["phases"].get("admission", 0.0)),
        "decided": (round(restore["time"] - kill, 4) if restore is not None else
                    _latest(admitting, kill, lambda e: e["time"] - e.get("adopt_s", 0.0))),
        "state_loaded": _latest(loaded, kill) if any(loaded) else _latest(admitted, kill),
        "first_step": first_s, "survivors_step": round(survivors[0] - kill, 4) if survivors else None,
        "steps_back": back, "median_step_s": median,
    }
    got = [e for e in loaded if e is not None]
    if got:
        out["load"] = {"bytes": max(e.get("bytes") or 0 for e in got),
                       "seconds": max(e.get("seconds") or 0.0 for e in got),
                       "gb_s": min((e["gb_s"] for e in got if e.get("gb_s")), default=None),
                       "how": sorted({e.get("how") for e in got})}
    if restore is not None:
        out["inventory_s"], out["decision_s"] = restore.get("inventory_s"), restore.get("decided_s")
    return out


def recoveries(events: list[Event]) -> list[dict[str, Any]]:
    """Each recovery of a run by a kill, with its phases (see the module docstring), in order."""
    events = sorted((e for e in events if "time" in e), key=lambda e: e["time"])
    commits = _commits(events)
    kills = _kills(events)
    out = []
    for i, (t, workers, step) in enumerate(kills):
        until = kills[i + 1][0] if i + 1 < len(kills) else float("inf")
        out.append(_one(events, t, workers, step, until, commits))
    return out
