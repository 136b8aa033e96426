"""How much longer a step takes while workers are down, per takeover policy (as the runtime assigns work).

Loads are in units of one exact micro-batch of ``rows`` rows; an approximated
micro-batch costs ``approx`` of an exact one (MeCeFO's FLOPs ratio, measured),
and a worker that approximates anything also runs the low-rank gradient's
amortised SVD (``svd``). The rules follow :mod:`unbroken.mecefo.takeover`
exactly:

* ``neighbor``: a dead slot is covered by the first live worker after it in
  ring order, approximated, and that worker approximates its own slot too. A
  run of ``r`` consecutive dead slots lands on one worker: load ``(r + 1)
  approx + svd``.
* ``spread`` / ``spread-approx``: each dead slot's ``rows`` are cut with
  ``split_rows`` over the ``L`` live workers, starting at position
  ``slot * rows mod L`` (:meth:`unbroken.mecefo.takeover.SpreadPolicy.cover`),
  so consecutive dead slots land on disjoint workers: ``k`` dead slots add
  ``ceil(k * rows / L)`` rows to the most loaded survivor (exact for a run of
  consecutive slots, such as a lost node; close to it otherwise).

:func:`worker_loads` gives each live worker's load; :func:`step_load` its
maximum and sum in closed form. A worker's time in a step is
``fixed + (1 - fixed) * load``: ``fixed`` is the
share of a failure-free step that does not grow with the rows computed (the
optimizer step, the reduction, the snapshot copy; 0 by default, so that the
whole step scales, the conservative choice). The step time is the slowest
worker's (GPUs: a worker has its device to itself). With ``cores`` given (a
CPU machine where ``G`` workers share ``cores`` cores, one intra-op thread
each) it is ``max(slowest worker, sum over workers / cores)``, relative to
the failure-free ``max(1, G / cores)``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = ["POLICY_NAMES", "StepLoad", "dead_runs", "step_load", "worker_loads"]

POLICY_NAMES = ("neighbor", "spread", "spread-approx")


@dataclass(frozen=True)
class StepLoad:
    """A degraded step: its time relative to a failure-free step, and the rows computed approximately."""

    factor: float
    approx_rows: int


def dead_runs(down: Sequence[int], workers: int) -> list[int]:
    """Lengths of the runs of consecutive dead slots in ring order (``down``: distinct ids)."""
    if not down:
        return []
    ids = sorted(down)
    if len(ids) >= workers:
        return [workers]
    runs, run = [], 1
    for a, b in zip(ids, ids[1:]):
        if b == a + 1:
            run += 1
        else:
            runs.append(run)
            run = 1
    runs.append(run)
    if len(runs) > 1 and ids[0] == 0 and ids[-1] == workers - 1:  # the ring closes: first and last run are one
        runs[0] += runs.pop()
    return runs


def _live(policy: str, workers: int, down: Sequence[int]) -> int:
    """The live workers' count, after checking the policy and that someone is left to take over."""
    if policy not in POLICY_NAMES:
        raise ValueError(f"policy={policy!r}; valid: {', '.join(POLICY_NAMES)}")
    live = workers - len(down)
    if live < 1:
        raise ValueError(f"{len(down)} of {workers} workers down: no live worker to take over")
    return live


def worker_loads(policy: str, *, workers: int, rows: int, down: Sequence[int], approx: float,
                 svd: float) -> list[float]:
    """Each live worker's load in a step with the workers ``down`` dead, in exact micro-batches.

    Raises:
        ValueError: unknown policy, or no live worker left (nobody to take over).
    """
    live = _live(policy, workers, down)
    k = workers - live
    if k == 0:
        return [1.0] * workers
    if policy == "neighbor":
        runs = dead_runs(down, workers)
        return [1.0] * (live - len(runs)) + [(r + 1) * approx + svd for r in runs]
    cost = 1.0 if policy == "spread" else approx
    base, more = divmod(k * rows, live)  # the dead slots' rows, as evenly as the runtime cuts them
    loads = []
    for i in range(live):
        extra = base + (1 if i < more else 0)
        loads.append(1.0 + extra / rows * cost + (svd if policy == "spread-approx" and extra else 0.0))
    return loads


def step_load(policy: str, *, workers: int, rows: int, down: Sequence[int], approx: float, svd: float,
              cores: int | None = None, fixed: float = 0.0) -> StepLoad:
    """The degraded step of ``policy`` with the workers ``down`` dead.

    Raises:
        ValueError: unknown policy, or no live worker left (nobody to take over).
    """
    if not 0.0 <= fixed < 1.0:
        raise ValueError(f"fixed={fixed!r} must be in [0, 1): the share of a step that does not scale with rows")
    live = _live(policy, workers, down)
    k = workers - live
    if k == 0:
        return StepLoad(1.0, 0)
    # max and sum of worker_loads, in closed form (the simulator calls this with up to 10^5 workers)
    if policy == "neighbor":
        runs = dead_runs(down, workers)
        peak = (max(runs) + 1) * approx + svd
        total = (live - len(runs)) + sum((r + 1) * approx + svd for r in runs)
        approx_rows = sum(r + 1 for r in runs) * rows
    else:
        per = math.ceil(k * rows / live)
        cost = 1.0 if policy == "spread" else approx
        peak = 1.0 + per / rows * cost + (svd if policy == "spread-approx" else 0.0)
        total = live + k * cost + (min(live, k * rows) * svd if policy == "spread-approx" else 0.0)
        approx_rows = k * rows if policy == "spread-approx" else 0
    peak = fixed + (1.0 - fixed) * peak
    total = live * fixed + (1.0 - fixed) * total
    if cores is None:
        return StepLoad(peak, approx_rows)
    return StepLoad(max(peak, total / cores) / max(1.0, workers / cores), approx_rows)
