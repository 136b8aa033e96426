"""Completing a step after its membership changed mid-way.

When a view changes during step ``s``, the live workers keep what they already
computed. They publish it, and this pure function decides who computes the rows
that are still missing (those of dead workers, or of a worker that joined
before computing anything), following the takeover policy:

- ``neighbor``: each missing range of slot ``k`` goes to the first live worker
  at or after ``k`` in ring order; approximated unless that worker is ``k``'s
  home worker;
- ``spread``: each missing range is split evenly over all live workers, exact;
- ``spread-approx``: the same split, approximated (exact for the home worker).

Invariant: the returned items plus ``done`` cover every ``(slot, row)`` of the
step exactly once, provided ``done`` itself has no overlap.
"""

from __future__ import annotations

from typing import Mapping, Sequence

from unbroken.mecefo.gradients import SlotWork
from unbroken.mecefo.policy import POLICIES


def missing_rows(n_slots: int, micro_batch: int, done: Mapping[int, Sequence[SlotWork]]) -> dict[int, list[tuple[int, int]]]:
    """Per slot, the row ranges no item in ``done`` covers (sorted, merged)."""
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


def complete(
    policy: str, *, n_slots: int, micro_batch: int, live: Sequence[int], done: Mapping[int, Sequence[SlotWork]]
) -> dict[int, list[SlotWork]]:
    """Extra items per live worker so that the step is covered exactly once.

    Args:
        done: items already computed, by live worker (dead workers' items are lost
            and must not be passed).
    Raises:
        ValueError: unknown policy, no live worker, overlapping ``done``.
    """
    if policy not in POLICIES:
        raise ValueError(f"unknown takeover policy {policy!r}; valid: {', '.join(POLICIES)}")
    order = sorted(live)
    if not order:
        raise ValueError("no live worker to complete the step")
    extra: dict[int, list[SlotWork]] = {w: [] for w in order}
    for slot, gaps in sorted(missing_rows(n_slots, micro_batch, done).items()):
        for a, b in gaps:
            if policy == "neighbor":
                owner = next(w for w in sorted(order, key=lambda w: (w - slot) % n_slots))
                extra[owner].append(SlotWork(slot, (a, b), "exact" if owner == slot else "approx"))
                continue
            for i, w in enumerate(order):
                lo = a + (b - a) * i // len(order)
                hi = a + (b - a) * (i + 1) // len(order)
                if hi > lo:
                    mode = "exact" if policy == "spread" or w == slot else "approx"
                    extra[w].append(SlotWork(slot, (lo, hi), mode))
    return extra
