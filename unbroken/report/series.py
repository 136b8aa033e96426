"""Per-step series of a run, for ``unbroken report``'s picture (pure: records in, lists out).

Steps are the ledger's: step ``s`` (0-based) is the ``s``-th optimizer step. A
``metrics.jsonl`` line with ``step = k`` (steps done, 1-based) belongs to step
``k - 1``. Every per-step series is a list indexed by step, ``steps`` long;
``None`` where the run says nothing about that step.

Worker states per step (:func:`worker_states`):

- ``live``: the worker applied the step (its ledger ``commit`` record);
- ``rejoining``: a restarted incarnation of it had been started
  (``worker_start`` with ``join``, from the step then in flight) and not yet
  admitted (``rejoined``, whose step it trains: live from there);
- ``dead``: neither.

Deaths (:func:`deaths`), one per worker incarnation, from the first event that
tells: the worker's own fault (``fault_self``: ``how`` kill/term -> ``crash``,
stop -> ``hang``, block -> ``block``), an agent's injection (``fault_injected``:
SIGKILL/SIGTERM -> ``crash``, SIGSTOP -> ``hang``, its node killed with it ->
``node loss``), or else the agent's record of an unexpected exit
(``worker_exit``: ``fenced`` when judged dead by a peer, ``crash`` otherwise).
Faults sent from outside (``unbroken chaos``) show up through that exit record.

Degraded slots (:func:`slot_modes`): a slot some of whose rows a worker other
than its home worker computed in the step's committed attempt, ``covered
exact`` or ``covered approx`` (any of those rows approximated); a slot its home
worker computed itself but approximated (a covering worker approximating its
whole load) is ``own approx``.
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any, Iterable

Record = dict[str, Any]
Item = tuple[int, int, int, int, str]
"""``(worker, slot, first row, end row, mode)`` of one piece of a step's committed work."""

LIVE, REJOINING, DEAD = "live", "rejoining", "dead"
STATES = (LIVE, REJOINING, DEAD)
COVERED_EXACT, COVERED_APPROX, OWN_APPROX = "covered exact", "covered approx", "own approx"
SLOT_MODES = (COVERED_EXACT, COVERED_APPROX, OWN_APPROX)
DEATH_KINDS = ("crash", "hang", "block", "node loss", "fenced")

_HOW_KIND = {"kill": "crash", "term": "crash", "stop": "hang", "block": "block"}
_SIGNAL_KIND = {"SIGKILL": "crash", "SIGTERM": "crash", "SIGSTOP": "hang"}


def when(e: Record) -> float:
    """An event's wall-clock time: the agent's ``t`` where it has one, else the writer's ``time``."""
    return float(e["t"] if "t" in e else e.get("time", 0.0))


def _events(records: Iterable[Record]) -> list[Record]:
    return sorted((r for r in records if r.get("kind") == "event"), key=when)


def committed_items(records: Iterable[Record]) -> dict[int, list[Item]]:
    """The work of each step's committed attempt, sorted by slot, first row and worker.

    A step committed under more than one generation (a ledger violation, which
    the ledger check reports) is left out, as is a step nobody committed.
    """
    gens: dict[int, set[int]] = defaultdict(set)
    work: dict[tuple[int, int], list[Item]] = defaultdict(list)
    for r in records:
        if r.get("kind") == "commit":
            gens[r["step"]].add(r["gen"])
        elif r.get("kind") == "work":
            work[(r["step"], r["gen"])].extend((r["worker"], int(slot), int(a), int(b), str(mode))
                                               for slot, a, b, mode in r["items"])
    return {step: sorted(work.get((step, g.copy().pop()), []), key=lambda i: (i[1], i[2], i[0]))
            for step, g in gens.items() if len(g) == 1}


def slot_modes(items: list[Item]) -> dict[int, str]:
    """Each degraded slot of one step's committed work and how (see the module docstring)."""
    covered: dict[int, bool] = {}  # slot -> some covered row approximated
    own_approx: set[int] = set()
    for worker, slot, _a, _b, mode in items:
        if worker != slot:
            covered[slot] = covered.get(slot, False) or mode != "exact"
        elif mode != "exact":
            own_approx.add(slot)
    out = {slot: COVERED_APPROX if approx else COVERED_EXACT for slot, approx in covered.items()}
    out.update({slot: OWN_APPROX for slot in own_approx if slot not in covered})
    return dict(sorted(out.items()))


def degraded_series(items_by_step: dict[int, list[Item]], *, steps: int) -> dict[str, list[int]]:
    """Per step, how many slots were in each of :data:`SLOT_MODES` (0 for a step with no committed work)."""
    out = {mode: [0] * steps for mode in SLOT_MODES}
    for step, items in items_by_step.items():
        if 0 <= step < steps:
            for mode in slot_modes(items).values():
                out[mode][step] += 1
    return out


def slots_key(mode: str) -> str:
    """The report's name of the per-step count of slots in ``mode``: ``slots_covered_exact``..."""
    return "slots_" + mode.replace(" ", "_")


def worker_states(records: Iterable[Record], *, n_workers: int, steps: int) -> list[list[str]]:
    """``states[w][s]``: worker ``w``'s state at step ``s``, one of :data:`STATES`."""
    records = list(records)
    committed: dict[int, set[int]] = defaultdict(set)
    for r in records:
        if r.get("kind") == "commit":
            committed[r["worker"]].add(r["step"])
    states = [[LIVE if s in committed[w] else DEAD for s in range(steps)] for w in range(n_workers)]
    for w, first, end in rejoin_windows(records, steps=steps):
        if w < n_workers:
            for s in range(max(0, first), min(end, steps)):
                if states[w][s] == DEAD:
                    states[w][s] = REJOINING
    return states


def rejoin_windows(records: Iterable[Record], *, steps: int) -> list[tuple[int, int, int]]:
    """``(worker, first step, end step)`` from a joiner's start to its admission (or the run's end)."""
    opened: dict[int, int] = {}
    out = []
    for e in _events(records):
        if e.get("worker") is None:
            continue
        w = int(e["worker"])
        if e.get("event") == "worker_start" and e.get("join") and w not in opened:
            opened[w] = int(e.get("progress") or 0)
        elif e.get("event") == "rejoined" and w in opened:
            out.append((w, opened.pop(w), int(e["step"])))
    out += [(w, first, steps) for w, first in opened.items()]
    return sorted(out)


def deaths(records: Iterable[Record]) -> list[Record]:
    """Every death: ``{"worker", "step", "kind", "t"}``, by step then worker (see the module docstring)."""
    down: set[int] = set()
    out: list[Record] = []
    for e in _events(records):
        if e.get("event") == "worker_start":
            down.discard(e.get("worker"))
            continue
        for w, step, kind in _death_of(e):
            if w not in down and step is not None:
                down.add(w)
                out.append({"worker": w, "step": int(step), "kind": kind, "t": when(e)})
    return sorted(out, key=lambda d: (d["step"], d["worker"], d["t"]))


def _death_of(e: Record) -> list[tuple[int, int | None, str]]:
    name = e.get("event")
    if name == "fault_self":
        return [(e["worker"], e.get("step"), _HOW_KIND.get(e.get("how", ""), str(e.get("how"))))]
    if name == "fault_injected" and "targets" in e:
        kind = "node loss" if e.get("lost_node") else _SIGNAL_KIND.get(e.get("signal", ""), str(e.get("signal")))
        return [(w, e.get("progress"), kind) for w in e["targets"]]
    if name == "worker_exit" and not e.get("clean") and not e.get("stopped_by_agent"):
        return [(e["worker"], e.get("progress"), "fenced" if e.get("fenced") else "crash")]
    return []


def rejoin_steps(records: Iterable[Record]) -> list[tuple[int, int]]:
    """``(worker, step)`` of every admission back into the job (the step it trains first)."""
    return [(e["worker"], int(e["step"])) for e in _events(records) if e.get("event") == "rejoined"]


def live_counts(states: list[list[str]], *, steps: int) -> list[int]:
    """Per step, how many workers were live."""
    return [sum(row[s] == LIVE for row in states) for s in range(steps)]


def loss_series(metrics: Iterable[Record], *, steps: int) -> tuple[list[float | None], list[float | None]]:
    """Per step, the training loss and the validation loss (``None`` where not measured or not finite)."""
    train: list[float | None] = [None] * steps
    val: list[float | None] = [None] * steps
    for r in metrics:
        i = int(r.get("step", 0)) - 1
        if not 0 <= i < steps:
            continue
        if r.get("kind") == "train":
            train[i] = _finite(r.get("loss"))
        elif r.get("kind") == "val":
            val[i] = _finite(r.get("val_loss"))
    return train, val


def stall_series(failures: Iterable[Record], *, steps: int) -> list[float | None]:
    """Per step, the stall of the failure at that step (:func:`unbroken.report.run_report.summarize_run`'s details)."""
    out: list[float | None] = [None] * steps
    for f in failures:
        if 0 <= f["step"] < steps and f.get("stall_s") is not None:
            out[f["step"]] = float(f["stall_s"])
    return out


def simulated_records(metrics: Iterable[Record]) -> list[Record]:
    """Ledger-like ``work`` and ``commit`` records (generation 0) from the simulator's ``train`` lines.

    The simulator writes no event files; each of its lines names the live
    workers and what each computed (``assignment``), which is what the ledger holds.
    """
    out: list[Record] = []
    for r in metrics:
        if r.get("kind") != "train" or "assignment" not in r:
            continue
        step = int(r["step"]) - 1
        for w, items in sorted(r["assignment"].items(), key=lambda kv: int(kv[0])):
            out.append({"kind": "work", "step": step, "gen": 0, "worker": int(w), "items": items})
        out += [{"kind": "commit", "step": step, "gen": 0, "worker": int(w)} for w in r.get("live_workers", [])]
    return out


def ledger_verdict(ok: bool | None) -> str:
    """The ledger check in a word: ``OK``, ``VIOLATED``, or ``n/a`` (a simulated run has no ledger)."""
    return "n/a" if ok is None else "OK" if ok else "VIOLATED"


def _finite(x: Any) -> float | None:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else None
