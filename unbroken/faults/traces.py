"""Seeded failure traces: which worker is down at which training step.

Model
-----
A preset's ``MTBF`` is the mean time between failures of a whole *cluster* of
``N`` workers (``cluster_workers``; by default the job itself, ``N = n``). The
job's ``n`` workers are ``n`` of those ``N``, so the failures that reach the job
arrive as a Poisson process in wall-clock time with rate
``lam = (n / N) / MTBF`` (per job, not per worker; ``lam = 1 / MTBF`` when
``N = n``). ``N`` keeps the per-worker failure rate of the cluster the preset
describes: a 4-worker job cut out of a 64-worker cluster that fails every
half hour fails every 8 hours. Each arrival hits one worker drawn uniformly
among the workers that are up at that moment; that worker stays down for an exponentially
distributed repair time of mean ``MTTR`` hours and is then back. An arrival is
*dropped* (not applied, not postponed, counted in ``FailureTrace.dropped``) when

* no worker is up (possible only with ``min_live=0``): there is nobody to hit;
* the hit would leave fewer than ``min_live`` workers up (default 1, so the job
  always keeps a live worker to take over the dead slots).

Dropping rather than postponing keeps the model a plain Erlang loss system (see
below); postponed failures would pile up and strike the moment a worker returns.

A concurrency cap ``max_down`` (``fault.max_down``; ``None``, the default, is no
cap) is different on purpose: an arrival that would take the job past
``max_down`` workers down is *deferred* (counted in ``FailureTrace.deferred``),
first come first served, to the step boundary at which a worker returns and
the count falls below the cap; it then hits a worker drawn among those up at
that step and lasts its own drawn repair time from there. ``max_down=1`` is
"single-node failures only": one worker down at a time, the others queued.
Deferred failures do pile up: whenever the offered load ``rho = lam * MTTR``
reaches ``max_down`` (every preset at ``max_down=1`` with the job's own
rate: ``low`` 2, ``mid`` 3, ``high`` 4), the queue grows for the whole run,
the cap is reached soon after the first failure and stays reached, and the
presets differ only in when that first failure comes. Arrivals still queued
when the run ends never strike (``FailureTrace.pending_at_end``). ``min_live``
is checked after the cap: with ``max_down <= n_workers - min_live`` (always
true for ``min_live=1``, since ``max_down < n_workers``) nothing is dropped.

From wall clock to steps
------------------------
A run of ``n_steps`` steps stands for ``n_steps * step_time_s`` seconds of wall
clock. For an arrival at time ``t`` (seconds from the start) with repair time
``r`` seconds::

    failure step = floor(t / step_time_s)          # the worker dies during this step
    return step  = ceil((t + r) / step_time_s)     # the worker is back from this step

with at least one step down. The outage is ``[failure step, return step)``, cut
at ``n_steps`` when it outlasts the run. Whether a worker can be hit is judged
on these step-level outages, so the outages of one worker never overlap.

The step time is a parameter so that a short run sees the same fraction of
degraded steps as a long one: with ``step_time_s = step_time_for(n_steps,
job_hours) = job_hours * 3600 / n_steps`` every run stands for ``job_hours`` of
wall clock (default 24 h), the expected number of arrivals is ``job_hours /
MTBF`` whatever ``n_steps``, and ``n_steps`` only sets the resolution (outages
are lengthened by about one step by the rounding). The draws are made in wall
clock and in a fixed order per arrival (gap, choice, repair, all three even for a
dropped arrival), so one seed tells the same wall-clock story at every
resolution, up to rounding.

The presets, and the checks of a job's shape against them, are in
:mod:`unbroken.faults.trace_presets`; the long-run fractions a preset gives
(an Erlang loss system), with worked examples, in :mod:`unbroken.faults.analytics`.

Invariants of a ``FailureTrace``
--------------------------------
* outages are sorted by ``(start_step, worker)``, with ``0 <= worker <
  n_workers`` and ``0 <= start_step < end_step <= n_steps``;
* outages of one worker are disjoint; one may start at the step where the
  previous one ended (the worker rejoins at the step boundary, then fails again
  during that step: consumers apply ``returns_at(s)`` before ``failures_at(s)``);
* a generated trace keeps at least ``min_live`` workers up at every step, and
  at most ``max_down`` workers down when a cap is set;
* ``generate_trace`` is a pure function of its arguments.
"""

from __future__ import annotations

import bisect
import math
import sys
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

import numpy as np

from unbroken.faults.trace_presets import SECONDS_PER_HOUR, TracePreset, cluster_share, resolve_preset, shape_problems

__all__ = ["FailureTrace", "Outage", "generate_trace", "step_time_for"]

_JSON_FORMAT = "unbroken.failure_trace"
_JSON_VERSION = 1


def step_time_for(n_steps: int, job_hours: float = 24.0) -> float:
    """Seconds of wall clock per step so that ``n_steps`` steps stand for ``job_hours``.

    Raises:
        ValueError: ``n_steps < 1`` or ``job_hours`` not a finite number > 0.
    """
    problems = []
    if not n_steps >= 1:
        problems.append(f"n_steps={n_steps!r} must be >= 1")
    if not 0 < job_hours < math.inf:
        problems.append(f"job_hours={job_hours!r} must be a finite number > 0")
    if problems:
        raise ValueError("step_time_for: " + "; ".join(problems))
    return job_hours * SECONDS_PER_HOUR / n_steps


@dataclass(frozen=True, kw_only=True)
class Outage:
    """Worker ``worker`` is down for steps ``[start_step, end_step)``."""

    worker: int
    start_step: int
    end_step: int

    def __post_init__(self) -> None:
        if not (0 <= self.worker and 0 <= self.start_step < self.end_step):
            raise ValueError(
                f"invalid {self!r}: need worker >= 0 and 0 <= start_step < end_step"
            )


@dataclass(frozen=True, kw_only=True)
class FailureTrace:
    """Outages of ``n_workers`` workers over ``n_steps`` steps (see module invariants).

    Attributes:
        n_workers: number of workers (= slots).
        n_steps: steps covered; queries take ``0 <= step < n_steps``.
        outages: sorted into ``(start_step, worker)`` order on construction.
        dropped: failure arrivals that were not applied (nobody up, or ``min_live``).
        deferred: arrivals that waited for a worker to return under ``max_down``
            (applied later, or still waiting at the end: ``pending_at_end``).
        pending_at_end: deferred arrivals that had not struck when the run ended.
        max_down: the cap the trace was drawn under (``None``: none); checked
            against the outages on construction.
        preset, step_time_s, seed, min_live, cluster_workers: provenance of a
            generated trace, ``None`` for a hand-made one; not used by the queries.
    """

    n_workers: int
    n_steps: int
    outages: tuple[Outage, ...]
    dropped: int = 0
    deferred: int = 0
    pending_at_end: int = 0
    max_down: int | None = None
    preset: TracePreset | None = None
    step_time_s: float | None = None
    seed: int | None = None
    min_live: int | None = None
    cluster_workers: int | None = None
    _starts: tuple[int, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        ordered = tuple(sorted(self.outages, key=lambda o: (o.start_step, o.worker)))
        object.__setattr__(self, "outages", ordered)
        object.__setattr__(self, "_starts", tuple(o.start_step for o in ordered))
        problems = []
        if self.n_workers < 1:
            problems.append(f"n_workers={self.n_workers} must be >= 1")
        if self.n_steps < 1:
            problems.append(f"n_steps={self.n_steps} must be >= 1")
        for name in ("dropped", "deferred", "pending_at_end"):
            if getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)} must be >= 0")
        if self.pending_at_end > self.deferred:
            problems.append(f"pending_at_end={self.pending_at_end} must be <= deferred={self.deferred}")
        last_end: dict[int, int] = {}
        for o in ordered:
            if o.worker >= self.n_workers or o.end_step > self.n_steps:
                problems.append(f"{o} outside {self.n_workers} workers x {self.n_steps} steps")
            if o.start_step < last_end.get(o.worker, 0):
                problems.append(f"{o} overlaps an earlier outage of worker {o.worker}")
            last_end[o.worker] = o.end_step
        if not problems and self.max_down is not None and ordered and self.most_down() > self.max_down:
            problems.append(f"{self.most_down()} workers down at once, more than max_down={self.max_down}")
        if problems:
            raise ValueError("invalid FailureTrace: " + "; ".join(problems))

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.n_steps:
            raise ValueError(f"step={step} outside this trace; expected 0 <= step < {self.n_steps}")

    def down_at(self, step: int) -> frozenset[int]:
        """Workers down during ``step``."""
        self._check_step(step)
        # Only outages started by now can cover the step; the sort makes that a prefix.
        stop = bisect.bisect_right(self._starts, step)
        return frozenset(o.worker for o in self.outages[:stop] if o.end_step > step)

    def failures_at(self, step: int) -> tuple[int, ...]:
        """Workers that fail during ``step`` (their outage starts there), ascending."""
        self._check_step(step)
        lo = bisect.bisect_left(self._starts, step)
        hi = bisect.bisect_right(self._starts, step)
        return tuple(o.worker for o in self.outages[lo:hi])

    def returns_at(self, step: int) -> tuple[int, ...]:
        """Workers back from ``step`` on (rejoining at the boundary before it), ascending."""
        self._check_step(step)
        return tuple(sorted(o.worker for o in self.outages if o.end_step == step))

    @cached_property
    def _down_counts(self) -> np.ndarray:
        delta = np.zeros(self.n_steps + 1, dtype=np.int64)
        for o in self.outages:
            delta[o.start_step] += 1
            delta[o.end_step] -= 1
        return np.cumsum(delta[:-1])

    def degraded_fraction(self) -> float:
        """Fraction of steps with at least one worker down."""
        return float(np.count_nonzero(self._down_counts)) / self.n_steps

    def down_fraction(self) -> float:
        """Mean fraction of workers down per step (worker-steps lost / all worker-steps)."""
        return float(self._down_counts.sum()) / (self.n_steps * self.n_workers)

    def most_down(self) -> int:
        """Largest number of workers down at the same step (at most ``max_down`` when that is set)."""
        return int(self._down_counts.max())

    def to_json(self) -> dict[str, Any]:
        """Plain-JSON form (``json.dumps``-able, infinities written as ``null``)."""
        preset = None
        if self.preset is not None:
            preset = {
                "name": self.preset.name,
                "mtbf_hours": self.preset.mtbf_hours if self.preset.fails else None,
                "mttr_hours": self.preset.mttr_hours,
            }
        return {
            "format": _JSON_FORMAT,
            "version": _JSON_VERSION,
            "n_workers": self.n_workers,
            "n_steps": self.n_steps,
            "dropped": self.dropped,
            "deferred": self.deferred,
            "pending_at_end": self.pending_at_end,
            "max_down": self.max_down,
            "outages": [
                {"worker": o.worker, "start_step": o.start_step, "end_step": o.end_step}
                for o in self.outages
            ],
            "preset": preset,
            "step_time_s": self.step_time_s,
            "seed": self.seed,
            "min_live": self.min_live,
            "cluster_workers": self.cluster_workers,
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> FailureTrace:
        """Inverse of :meth:`to_json`.

        Raises:
            ValueError: not a failure trace of a known version, or malformed.
        """
        if d.get("format") != _JSON_FORMAT or d.get("version") != _JSON_VERSION:
            raise ValueError(
                f"not a failure trace: format={d.get('format')!r} version={d.get('version')!r}; "
                f"expected format={_JSON_FORMAT!r} version={_JSON_VERSION}"
            )
        try:
            p = d["preset"]
            preset = None
            if p is not None:
                mtbf = math.inf if p["mtbf_hours"] is None else float(p["mtbf_hours"])
                preset = TracePreset(name=p["name"], mtbf_hours=mtbf, mttr_hours=float(p["mttr_hours"]))
            return cls(
                n_workers=int(d["n_workers"]),
                n_steps=int(d["n_steps"]),
                dropped=int(d["dropped"]),
                deferred=int(d.get("deferred", 0)),
                pending_at_end=int(d.get("pending_at_end", 0)),
                max_down=None if d.get("max_down") is None else int(d["max_down"]),
                outages=tuple(
                    Outage(worker=int(o["worker"]), start_step=int(o["start_step"]), end_step=int(o["end_step"]))
                    for o in d["outages"]
                ),
                preset=preset,
                step_time_s=None if d["step_time_s"] is None else float(d["step_time_s"]),
                seed=None if d["seed"] is None else int(d["seed"]),
                min_live=None if d["min_live"] is None else int(d["min_live"]),
                cluster_workers=None if d.get("cluster_workers") is None else int(d["cluster_workers"]),
            )
        except (KeyError, TypeError) as e:
            raise ValueError(f"malformed failure trace JSON: {e!r}") from e


def generate_trace(
    preset: str | TracePreset,
    *,
    n_workers: int,
    n_steps: int,
    step_time_s: float,
    seed: int,
    min_live: int = 1,
    cluster_workers: int | None = None,
    max_down: int | None = None,
) -> FailureTrace:
    """Draw a failure trace (model and step mapping in the module docstring).

    Args:
        preset: a name in ``TRACE_PRESETS`` or a ``TracePreset``.
        n_workers: workers in the job.
        n_steps: steps the trace covers.
        step_time_s: wall-clock seconds per step; see ``step_time_for``.
        seed: seed of ``numpy.random.default_rng``.
        min_live: arrivals that would leave fewer workers up are dropped;
            0 lets every worker be down at once (the runtime must then wait).
        cluster_workers: workers of the cluster the preset's MTBF is for
            (``>= n_workers``); ``None``: the job itself.
        max_down: at most this many workers down at once (``0..n_workers-1``);
            arrivals beyond it are deferred until a worker returns; ``None``: no cap.

    Raises:
        ValueError: every invalid argument, all in one message.
    """
    p = resolve_preset(preset)
    problems = shape_problems(p, n_workers, min_live, cluster_workers, max_down)
    if n_steps < 1:
        problems.append(f"n_steps={n_steps} must be >= 1")
    if not 0 < step_time_s < math.inf:
        problems.append(f"step_time_s={step_time_s!r} must be a finite number > 0; see step_time_for()")
    if not (isinstance(seed, int) and seed >= 0):
        problems.append(f"seed={seed!r} must be an integer >= 0")
    if problems:
        raise ValueError("generate_trace: " + "; ".join(problems))

    outages, counts = _draw_outages(p, n_workers, n_steps, step_time_s, seed, min_live, cluster_workers, max_down)
    return FailureTrace(
        n_workers=n_workers,
        n_steps=n_steps,
        outages=tuple(outages),
        **counts,
        max_down=max_down,
        preset=p,
        step_time_s=step_time_s,
        seed=seed,
        min_live=min_live,
        cluster_workers=cluster_workers,
    )


def _draw_outages(p: TracePreset, n_workers: int, n_steps: int, step_time_s: float, seed: int, min_live: int,
                  cluster_workers: int | None, max_down: int | None) -> tuple[list[Outage], dict[str, int]]:
    """The outages of :func:`generate_trace` (arguments checked), and how many arrivals were dropped, deferred
    and still pending at the end."""
    outages: list[Outage] = []
    counts = {"dropped": 0, "deferred": 0, "pending_at_end": 0}
    if p.fails:
        rng = np.random.default_rng(seed)
        mtbf_s = p.mtbf_hours * SECONDS_PER_HOUR * cluster_share(n_workers, cluster_workers)
        mttr_s = p.mttr_hours * SECONDS_PER_HOUR
        horizon_s = n_steps * step_time_s
        back_at = [0] * n_workers  # first step each worker is up again
        queue_head = 0  # deferred arrivals strike in arrival order: none before this step
        t = 0.0
        while True:
            t += mtbf_s * rng.standard_exponential()
            if t >= horizon_s:
                break
            u = rng.random()
            repair_s = mttr_s * rng.standard_exponential()
            # min() guards the float division rounding t just below the horizon up to n_steps.
            start = min(math.floor(t / step_time_s), n_steps - 1)
            end = max(start + 1, math.ceil((t + repair_s) / step_time_s))
            if max_down is not None:
                capped = _capped_start(back_at, max(start, queue_head), max_down)
                if capped != start:
                    counts["deferred"] += 1
                    if capped >= n_steps:
                        counts["pending_at_end"] += 1
                        continue
                    # It strikes at the step boundary where a worker returned: its repair runs from there.
                    start, end = capped, capped + max(1, math.ceil(repair_s / step_time_s))
                    queue_head = capped
            up = [w for w in range(n_workers) if back_at[w] <= start]
            if not up or len(up) - 1 < min_live:
                counts["dropped"] += 1
                continue
            worker = up[int(u * len(up))]
            back_at[worker] = end
            outages.append(Outage(worker=worker, start_step=start, end_step=min(end, n_steps)))
    return outages, counts


def _capped_start(back_at: list[int], step: int, max_down: int) -> int:
    """First step ``>= step`` at which fewer than ``max_down`` workers are down.

    ``back_at[w]`` is the step worker ``w`` is up again; every outage placed so
    far starts at or before ``step`` (arrivals are placed in order), so the
    workers down at a later step ``s`` are those with ``back_at > s``. With
    ``max_down=0`` no step qualifies: the result is ``sys.maxsize`` (never).
    """
    if max_down == 0:
        return sys.maxsize
    ends = sorted(b for b in back_at if b > step)
    if len(ends) < max_down:
        return step
    # The (len - max_down + 1)-th return brings the count below the cap.
    return ends[len(ends) - max_down]
