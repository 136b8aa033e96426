"""Takeover policies: which live worker computes which rows of which slot, in which mode.

A step has ``n_slots`` slots of ``micro_batch`` rows (the global batch) and ``n_workers`` workers; worker
``i``'s home slots are ``i, i + n_workers, i + 2 n_workers, ...`` (:func:`home_slots`; with one slot per
worker, the default, its home slot is ``i``), which it computes one after the other, accumulating their
gradients in one buffer. A policy is one :class:`TakeoverPolicy`
object; it plans both the start of a step (:meth:`TakeoverPolicy.assign`: each
live worker's list of :class:`SlotWork` items) and the completion of a step
whose membership changed mid-way (:meth:`TakeoverPolicy.complete`: the live
workers keep what they already computed and publish it; the policy says who
computes the rows still missing, those of dead workers or of a worker that
joined before computing anything).

There is one mechanism: ``assign`` gives every live worker its home slots and
lets ``complete`` cover the rest. A policy only says how one missing row range
``[a, b)`` of slot ``k`` is covered (:meth:`TakeoverPolicy.cover`):

- ``neighbor`` (MeCeFO): the first live worker at or after ``k``'s home worker
  in ring order (``h, h+1, ...`` modulo ``n_workers``), approximated unless it
  is ``k``'s home worker. In ``assign`` a worker that covers at least one slot
  also computes its own slots in ``approx`` mode (paper, Alg. 1), so its load
  stays close to its exact share; a worker covering nothing stays exact.
- ``spread``: ``[a, b)`` cut with ``BatchSampler.split_rows(b - a, len(live))``
  and handed out in ascending order of live worker ids, everything exact.
- ``spread-approx``: the same split, approximated except for ``k``'s home worker.

Spare rows are split by one rule everywhere, ``BatchSampler.split_rows``: the
first ranges get one row more; empty ranges (more workers than rows) are skipped.

Invariants (checked by ``tests/unit/test_policy.py``, ``test_completion.py``
and ``test_takeover.py`` over every live subset):

- ``assign``: every ``(slot, row)`` with ``0 <= slot < n_slots`` and ``0 <= row
  < micro_batch`` is in exactly one item of exactly one worker;
- ``complete``: the returned items plus ``done`` cover every ``(slot, row)``
  exactly once, provided ``done`` itself has no overlap;
- a live worker's first assigned items are its whole home slots;
- with every worker live, each worker computes exactly its home slots, exact;
- ``assign(live)`` is the home slots plus ``complete(done=home slots)`` (for
  ``neighbor``, with the covering workers' home slots approximated);
- results are pure functions of the arguments (``live`` as a set).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Mapping, Sequence
from typing import Any

from unbroken.config.choices import POLICY_NAMES, check_registry
from unbroken.data.sampler import BatchSampler
from unbroken.mecefo.gradients import Mode, SlotWork, slot_rows

__all__ = [
    "POLICIES",
    "NeighborPolicy",
    "NoLiveWorker",
    "SpreadApproxPolicy",
    "SpreadPolicy",
    "TakeoverPolicy",
    "assignment_json",
    "degraded_homes",
    "degraded_slots",
    "home_of",
    "home_slots",
    "missing_rows",
    "rebalance",
    "takeover_policy",
]

Assignment = Mapping[int, Sequence[SlotWork]]


def home_slots(worker: int, n_slots: int, n_workers: int) -> range:
    """The slots ``worker`` computes when every worker is live: ``worker, worker + n_workers, ...``."""
    return range(worker, n_slots, n_workers)


def home_of(slot: int, n_workers: int) -> int:
    """The worker whose home slot ``slot`` is."""
    return slot % n_workers


def degraded_homes(n_slots: int, n_workers: int, members: Collection[int]) -> list[int]:
    """The slots whose home worker is not among ``members``, ascending (a metrics line's ``degraded``)."""
    live = set(members)
    return [k for k in range(n_slots) if home_of(k, n_workers) not in live]


class NoLiveWorker(RuntimeError):
    """No worker is live, so nobody can compute the step: the caller must wait for a return."""


class TakeoverPolicy(ABC):
    """How the live workers of a step cover the slots of workers that are not computing."""

    name: str
    """The policy's name in the config (``mecefo.policy``) and in :data:`POLICIES`."""
    approximates: bool = True
    """Whether the policy ever computes in ``approx`` mode (then the model needs a MeCeFO adapter)."""

    @abstractmethod
    def cover(self, slot: int, rows: tuple[int, int], live: Sequence[int], n_workers: int) -> list[tuple[int, SlotWork]]:
        """``(worker, item)`` pairs that compute the missing ``rows`` of ``slot``, each row once.

        Args:
            slot: the slot missing rows.
            rows: the missing range ``[a, b)``, non-empty.
            live: the live workers, ascending, without duplicates, non-empty.
            n_workers: the job's workers (``slot``'s home worker is :func:`home_of`).
        """

    def home_mode(self, covering: bool) -> Mode:
        """Mode of a worker's own slot in :meth:`assign`, given whether it covers other work."""
        return "exact"

    def assign(self, *, n_slots: int, live: Collection[int], micro_batch: int,
               n_workers: int | None = None) -> dict[int, list[SlotWork]]:
        """Each live worker's work for one step.

        Args:
            n_slots: slots of the step (its global batch in micro-batches), ``>= n_workers``.
            live: ids of the live workers, each in ``[0, n_workers)``; duplicates are ignored.
            micro_batch: rows per slot, ``>= 1``.
            n_workers: the job's workers (default ``n_slots``: one slot each).

        Returns:
            ``{worker: [SlotWork, ...]}`` for every live worker in ascending order;
            the worker's own slots come first, covered work after them by slot id.

        Raises:
            ValueError: bad sizes, or live ids outside ``[0, n_workers)``.
            NoLiveWorker: ``live`` is empty.
        """
        n_workers = n_slots if n_workers is None else n_workers
        workers = _checked_workers(n_slots, n_workers, live, micro_batch)
        home = {w: [SlotWork(slot=k, rows=(0, micro_batch)) for k in home_slots(w, n_slots, n_workers)]
                for w in workers}
        extra = self.complete(n_slots=n_slots, micro_batch=micro_batch, live=workers, done=home, n_workers=n_workers)
        return {
            w: [*(SlotWork(slot=it.slot, rows=it.rows, mode=self.home_mode(bool(extra[w]))) for it in home[w]),
                *extra[w]]
            for w in workers
        }

    def complete(
        self, *, n_slots: int, micro_batch: int, live: Sequence[int], done: Mapping[int, Sequence[SlotWork]],
        n_workers: int | None = None,
    ) -> dict[int, list[SlotWork]]:
        """Extra items per live worker so that the step is covered exactly once.

        Args:
            n_slots: slots of the step.
            micro_batch: rows per slot.
            live: ids of the live workers.
            done: items already computed, by live worker (dead workers' items are
                lost and must not be passed).

        Returns:
            ``{worker: [SlotWork, ...]}`` for every live worker in ascending order,
            items by slot then by first row (possibly empty lists).

        Raises:
            ValueError: no live worker, overlapping ``done``.
        """
        order = sorted(set(live))
        if not order:
            raise ValueError("no live worker to complete the step")
        extra: dict[int, list[SlotWork]] = {w: [] for w in order}
        for slot, gaps in sorted(missing_rows(n_slots, micro_batch, done).items()):
            for gap in gaps:
                for worker, item in self.cover(slot, gap, order, n_slots if n_workers is None else n_workers):
                    extra[worker].append(item)
        return extra

    def __repr__(self) -> str:
        return f"{type(self).__name__}()"


class NeighborPolicy(TakeoverPolicy):
    """MeCeFO: the ring successor covers a slot, approximated, its own slot included."""

    name = "neighbor"

    def cover(self, slot: int, rows: tuple[int, int], live: Sequence[int], n_workers: int) -> list[tuple[int, SlotWork]]:
        home = home_of(slot, n_workers)
        owner = min(live, key=lambda w: (w - home) % n_workers)
        return [(owner, SlotWork(slot=slot, rows=rows, mode="exact" if owner == home else "approx"))]

    def home_mode(self, covering: bool) -> Mode:
        # The whole load of a covering worker is approximated, its own slot included (paper, Alg. 1).
        return "approx" if covering else "exact"


class SpreadPolicy(TakeoverPolicy):
    """Missing rows split over all live workers, computed exactly."""

    name = "spread"
    approximates = False

    def covered_mode(self, worker: int, slot: int, n_workers: int) -> Mode:
        """Mode in which ``worker`` computes rows of ``slot`` it covers."""
        return "exact"

    def cover(self, slot: int, rows: tuple[int, int], live: Sequence[int], n_workers: int) -> list[tuple[int, SlotWork]]:
        """Split ``rows`` over the live workers, starting at position ``slot * rows % L`` of the ascending
        list (wrapping): consecutive dead slots (a lost node) land on disjoint workers instead of all on the
        lowest ones, so k dead slots add about ``k * rows / L`` rows to each survivor, not ``k * rows / L``
        rounded up per slot to the same few workers."""
        a, b = rows
        parts = BatchSampler.split_rows(b - a, len(live))
        start = slot * (b - a) % len(live)
        order = list(live[start:]) + list(live[:start])
        return sorted(
            ((w, SlotWork(slot=slot, rows=(a + lo, a + hi), mode=self.covered_mode(w, slot, n_workers)))
             for w, (lo, hi) in zip(order, parts)
             if lo < hi),  # more workers than rows: the trailing ranges are empty
            key=lambda t: t[1].rows)


class SpreadApproxPolicy(SpreadPolicy):
    """The ``spread`` split, approximated except for the slot's home worker."""

    name = "spread-approx"
    approximates = True

    def covered_mode(self, worker: int, slot: int, n_workers: int) -> Mode:
        return "exact" if worker == home_of(slot, n_workers) else "approx"


POLICIES: dict[str, TakeoverPolicy] = {p.name: p for p in (NeighborPolicy(), SpreadPolicy(), SpreadApproxPolicy())}
"""The takeover policies by name; iterating gives the names in documentation order."""
check_registry("mecefo.policy", POLICIES, POLICY_NAMES)


def takeover_policy(name: str) -> TakeoverPolicy:
    """The policy called ``name``.

    Raises:
        ValueError: ``name`` is not in :data:`POLICIES`.
    """
    if name not in POLICIES:
        raise ValueError(f"unknown takeover policy {name!r}; valid policies: {', '.join(POLICIES)}")
    return POLICIES[name]


def _checked_workers(n_slots: int, n_workers: int, live: Collection[int], micro_batch: int) -> list[int]:
    """The live workers, ascending, after checking the sizes and ids of :meth:`TakeoverPolicy.assign`."""
    if not (isinstance(n_workers, int) and n_workers >= 1):
        raise ValueError(f"n_workers={n_workers!r} must be an integer >= 1")
    if not (isinstance(n_slots, int) and n_slots >= n_workers):
        raise ValueError(f"n_slots={n_slots!r} must be an integer >= n_workers={n_workers} (every worker a home slot)")
    if not (isinstance(micro_batch, int) and micro_batch >= 1):
        raise ValueError(f"micro_batch={micro_batch!r} must be an integer >= 1")
    bad = sorted(w for w in set(live) if not (isinstance(w, int) and 0 <= w < n_workers))
    if bad:
        raise ValueError(f"live workers {bad} outside [0, {n_workers}); worker ids are 0..{n_workers - 1}")
    workers = sorted(set(live))
    if not workers:
        raise NoLiveWorker(f"no live worker among {n_workers} workers; the step must wait for a worker to return")
    return workers


def rebalance(assignment: Assignment, keep: Mapping[int, int], *, n_workers: int,
              micro_batch: int) -> dict[int, list[SlotWork]]:
    """``assignment`` with each slow worker ``w`` in ``keep`` computing only rows ``[0, keep[w])`` of its whole
    exact home slots, the rest of them split over the other workers of the assignment (``spread``'s split,
    exact). Every ``(slot, row)`` stays in exactly one item; workers not in ``keep`` keep their items first.

    Raises:
        ValueError: a ``keep`` outside ``[1, micro_batch]``.
    """
    out = {w: list(items) for w, items in assignment.items()}
    others = sorted(w for w in out if w not in keep)
    if not others:
        return out
    missing: list[tuple[int, tuple[int, int]]] = []
    for w, rows in sorted(keep.items()):
        if w not in out or rows == micro_batch:
            continue
        if not 1 <= rows <= micro_batch:
            raise ValueError(f"worker {w} keeps {rows} rows of a slot of {micro_batch}")
        mine = []
        for it in out[w]:
            if home_of(it.slot, n_workers) == w and it.rows == (0, micro_batch) and it.mode == "exact":
                mine.append(SlotWork(it.slot, (0, rows)))
                missing.append((it.slot, (rows, micro_batch)))
            else:
                mine.append(it)
        out[w] = mine
    spread = POLICIES["spread"]
    for slot, gap in missing:
        for worker, item in spread.cover(slot, gap, others, n_workers):
            out[worker].append(item)
    return out


def missing_rows(
    n_slots: int, micro_batch: int, done: Mapping[int, Sequence[SlotWork]]
) -> dict[int, list[tuple[int, int]]]:
    """Per slot, the row ranges no item in ``done`` covers (sorted, merged).

    Raises:
        ValueError: two items of ``done`` overlap.
    """
    covered: dict[int, list[tuple[int, int]]] = {k: [] for k in range(n_slots)}
    for items in done.values():
        for it in items:
            covered[it.slot].append(it.rows)
    out: dict[int, list[tuple[int, int]]] = {}
    for k, ranges in covered.items():
        gaps, pos = [], 0
        for a, b in sorted(ranges):
            if a < pos:
                raise ValueError(f"slot {k}: rows {a}..{b} were computed twice")
            if a > pos:
                gaps.append((pos, a))
            pos = b
        if pos < micro_batch:
            gaps.append((pos, micro_batch))
        if gaps:
            out[k] = gaps
    return out


def degraded_slots(assignment: Assignment, n_slots: int, n_workers: int | None = None) -> list[dict[str, Any]]:
    """The slots computed by workers other than their home worker (of ``n_workers``, default ``n_slots``),
    as JSON-able dicts.

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
            if home_of(item.slot, n_slots if n_workers is None else n_workers) != worker:
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
