"""Takeover policies: which live worker computes which rows of which slot, in which mode.

Worker ``i``'s home slot is ``i``. Given the live workers of a step, a policy
returns each live worker's list of :class:`SlotWork` items for that step:

- ``neighbor`` (MeCeFO): each dead slot goes to the first live worker after it
  in ring order (``k+1, k+2, ...`` modulo ``n``). A worker that covers at least
  one slot computes its own slot and every slot it covers in ``approx`` mode,
  so its load stays close to one exact micro-batch; a worker covering nothing
  stays exact.
- ``spread``: each dead slot's rows are cut with ``BatchSampler.split_rows(
  micro_batch, len(live))`` and handed out in ascending order of live worker
  ids (empty ranges skipped); everything is exact.
- ``spread-approx``: the same split, the extra rows in ``approx`` mode, every
  worker's own slot exact.

Invariants (checked by ``tests/unit/test_policy.py`` over every live subset):

- every ``(slot, row)`` with ``0 <= slot < n_slots`` and ``0 <= row <
  micro_batch`` is in exactly one item of exactly one worker;
- a live worker's first item is its whole home slot;
- with every worker live, each worker computes exactly its home slot, exact;
- the result is a pure function of the arguments (``live`` as a set).
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from unbroken.data.sampler import BatchSampler
from unbroken.mecefo.gradients import Mode, SlotWork, slot_rows

__all__ = ["POLICIES", "NoLiveWorker", "assign", "assignment_json", "degraded_slots"]

POLICIES = ("neighbor", "spread", "spread-approx")

Assignment = Mapping[int, Sequence[SlotWork]]


class NoLiveWorker(RuntimeError):
    """No worker is live, so nobody can compute the step: the caller must wait for a return."""


def assign(policy: str, *, n_slots: int, live: Collection[int], micro_batch: int) -> dict[int, list[SlotWork]]:
    """Each live worker's work for one step under ``policy``.

    Args:
        policy: one of :data:`POLICIES`.
        n_slots: data-parallel slots (= workers), ``>= 1``.
        live: ids of the live workers, each in ``[0, n_slots)``; duplicates are ignored.
        micro_batch: rows per slot, ``>= 1``.

    Returns:
        ``{worker: [SlotWork, ...]}`` for every live worker in ascending order;
        the worker's own slot comes first, covered work after it by slot id.

    Raises:
        ValueError: unknown policy, bad sizes, or live ids outside ``[0, n_slots)``.
        NoLiveWorker: ``live`` is empty.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown takeover policy {policy!r}; valid policies: {', '.join(POLICIES)}")
    if not (isinstance(n_slots, int) and n_slots >= 1):
        raise ValueError(f"n_slots={n_slots!r} must be an integer >= 1")
    if not (isinstance(micro_batch, int) and micro_batch >= 1):
        raise ValueError(f"micro_batch={micro_batch!r} must be an integer >= 1")
    bad = sorted(w for w in set(live) if not (isinstance(w, int) and 0 <= w < n_slots))
    if bad:
        raise ValueError(f"live workers {bad} outside [0, {n_slots}); worker ids are slot ids 0..{n_slots - 1}")
    workers = sorted(set(live))
    if not workers:
        raise NoLiveWorker(f"no live worker among {n_slots} slots; the step must wait for a worker to return")
    dead = [k for k in range(n_slots) if k not in set(workers)]
    if policy == "neighbor":
        return _neighbor(workers, dead, n_slots, micro_batch)
    extra_mode: Mode = "exact" if policy == "spread" else "approx"
    return _spread(workers, dead, micro_batch, extra_mode)


def _neighbor(workers: list[int], dead: list[int], n_slots: int, micro_batch: int) -> dict[int, list[SlotWork]]:
    live = set(workers)
    covered: dict[int, list[int]] = {w: [] for w in workers}
    for k in dead:
        # The ring successor among live workers; one exists because ``workers`` is non-empty.
        successor = next((k + d) % n_slots for d in range(1, n_slots) if (k + d) % n_slots in live)
        covered[successor].append(k)
    out: dict[int, list[SlotWork]] = {}
    for w in workers:
        # The whole load of a covering worker is approximated, its own slot included (paper, Alg. 1).
        mode: Mode = "approx" if covered[w] else "exact"
        out[w] = [SlotWork(slot=k, rows=(0, micro_batch), mode=mode) for k in [w, *covered[w]]]
    return out


def _spread(workers: list[int], dead: list[int], micro_batch: int, extra_mode: Mode) -> dict[int, list[SlotWork]]:
    out = {w: [SlotWork(slot=w, rows=(0, micro_batch), mode="exact")] for w in workers}
    ranges = BatchSampler.split_rows(micro_batch, len(workers))
    for k in dead:
        for w, (a, b) in zip(workers, ranges):
            if a < b:  # more survivors than rows: the trailing ranges are empty
                out[w].append(SlotWork(slot=k, rows=(a, b), mode=extra_mode))
    return out


def degraded_slots(assignment: Assignment, n_slots: int) -> list[dict[str, Any]]:
    """The slots computed by workers other than their home worker, as JSON-able dicts.

    Each entry is ``{"slot": k, "workers": [...], "mode": "approx" | "exact" |
    "mixed", "rows": [[a, b], ...]}``, ``rows[i]`` computed by ``workers[i]``
    (ordered by first row), entries ordered by slot; empty when nothing failed.
    A covering worker's own approximated slot is not listed here (it is not a
    covered slot); the full picture is :func:`assignment_json`.

    Raises:
        ValueError: an item names a slot outside ``[0, n_slots)``.
    """
    pieces: dict[int, list[tuple[int, int, int, str]]] = {}
    for worker, items in assignment.items():
        for item in items:
            if not 0 <= item.slot < n_slots:
                raise ValueError(f"slot {item.slot} of worker {worker} outside [0, {n_slots})")
            if item.slot != worker:
                pieces.setdefault(item.slot, []).append((item.rows[0], item.rows[1], worker, item.mode))
    out = []
    for slot in sorted(pieces):
        parts = sorted(pieces[slot])
        modes = {m for *_, m in parts}
        out.append({
            "slot": slot,
            "workers": [w for _, _, w, _ in parts],
            "mode": modes.pop() if len(modes) == 1 else "mixed",
            "rows": [[a, b] for a, b, _, _ in parts],
        })
    return out


def assignment_json(assignment: Assignment) -> dict[str, list[list[Any]]]:
    """``{"worker": [[slot, a, b, mode], ...]}`` (JSON object keys are strings), workers ascending."""
    return {str(w): slot_rows(assignment[w]) for w in sorted(assignment)}
