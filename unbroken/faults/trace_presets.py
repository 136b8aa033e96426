"""Failure regimes (:class:`TracePreset`: a cluster's MTBF and MTTR) and the checks of a job's shape against one.

The model they drive, and the traces drawn from them, are in :mod:`unbroken.faults.traces`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["SECONDS_PER_HOUR", "TRACE_PRESETS", "TracePreset", "cluster_share", "resolve_preset", "shape_problems",
           "trace_preset"]

SECONDS_PER_HOUR = 3600.0


@dataclass(frozen=True, kw_only=True)
class TracePreset:
    """A failure regime.

    Attributes:
        name: preset name, recorded in traces for provenance.
        mtbf_hours: mean time between failures of the whole cluster (by
            default the job), in hours; ``math.inf`` means nothing ever fails.
        mttr_hours: mean repair time of a failed worker, in hours (finite, > 0;
            may be 0 only when nothing fails).
    """

    name: str
    mtbf_hours: float
    mttr_hours: float

    def __post_init__(self) -> None:
        problems = []
        if not self.name:
            problems.append("name must be a non-empty string")
        if not self.mtbf_hours > 0:  # also rejects NaN
            problems.append(f"mtbf_hours={self.mtbf_hours!r} must be > 0 (math.inf for no failures)")
        if self.fails and not (0 < self.mttr_hours < math.inf):
            problems.append(f"mttr_hours={self.mttr_hours!r} must be a finite number > 0")
        if not self.fails and not self.mttr_hours >= 0:
            problems.append(f"mttr_hours={self.mttr_hours!r} must be >= 0")
        if problems:
            raise ValueError(f"invalid TracePreset {self.name!r}: " + "; ".join(problems))

    @property
    def fails(self) -> bool:
        """Whether any failure can happen under this preset."""
        return math.isfinite(self.mtbf_hours)


# MeCeFO's low / mid / high regimes, plus a harsher one and a failure-free baseline.
TRACE_PRESETS: dict[str, TracePreset] = {
    p.name: p
    for p in (
        TracePreset(name="none", mtbf_hours=math.inf, mttr_hours=0.0),
        TracePreset(name="low", mtbf_hours=2.0, mttr_hours=4.0),
        TracePreset(name="mid", mtbf_hours=1.0, mttr_hours=3.0),
        TracePreset(name="high", mtbf_hours=0.5, mttr_hours=2.0),
        TracePreset(name="extreme", mtbf_hours=0.25, mttr_hours=1.0),
    )
}


def trace_preset(name: str) -> TracePreset:
    """Return the preset called ``name``.

    Raises:
        ValueError: unknown name; the message lists the valid ones.
    """
    try:
        return TRACE_PRESETS[name]
    except KeyError:
        raise ValueError(
            f"unknown failure trace {name!r}; expected one of {', '.join(TRACE_PRESETS)}"
        ) from None


def resolve_preset(preset: str | TracePreset) -> TracePreset:
    """``preset`` itself, or the preset of that name."""
    return preset if isinstance(preset, TracePreset) else trace_preset(preset)


def shape_problems(p: TracePreset, n_workers: int, min_live: int, cluster_workers: int | None,
                   max_down: int | None = None) -> list[str]:
    """What is wrong with drawing ``p`` for this job shape (empty when nothing is)."""
    problems = []
    if max_down is not None and not (
        isinstance(max_down, int) and not isinstance(max_down, bool) and 0 <= max_down < max(n_workers, 1)
    ):
        problems.append(
            f"max_down={max_down!r} must be an integer in 0..{n_workers - 1} (fewer than n_workers={n_workers}: "
            "someone must stay up to take over); None for no cap"
        )
    if cluster_workers is not None and not (
        isinstance(cluster_workers, int) and not isinstance(cluster_workers, bool) and cluster_workers >= n_workers
    ):
        problems.append(
            f"cluster_workers={cluster_workers!r} must be an integer >= n_workers={n_workers} "
            "(the job's workers are part of the cluster); None for the job alone"
        )
    if n_workers < 1:
        problems.append(f"n_workers={n_workers} must be >= 1")
    elif p.fails and n_workers < 2:
        problems.append(
            f"n_workers={n_workers} with failure trace {p.name!r}: no one to take over; "
            "use n_workers >= 2 or trace 'none'"
        )
    if min_live < 0:
        problems.append(f"min_live={min_live} must be >= 0")
    elif p.fails and n_workers >= 2 and min_live >= n_workers:
        problems.append(
            f"min_live={min_live} with n_workers={n_workers} would drop every failure; "
            f"use min_live <= {n_workers - 1}"
        )
    return problems


def cluster_share(n_workers: int, cluster_workers: int | None) -> float:
    """``N / n``: how much longer the job waits between failures than the whole cluster."""
    return 1.0 if cluster_workers is None else cluster_workers / n_workers
