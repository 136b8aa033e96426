"""Long-run analytics of the failure model of :mod:`unbroken.faults.traces`.

The number ``k`` of down workers goes ``k -> k+1`` at rate ``lam`` while
``k < K = n_workers - min_live`` and ``k -> k-1`` at rate ``k / MTTR``: an
Erlang loss system with ``K`` servers and offered load
``rho = lam * MTTR = (n / N) * MTTR / MTBF``::

    pi_k = (rho**k / k!) / sum_{j=0..K} rho**j / j!

    expected_degraded_fraction = 1 - pi_0        # steps with at least one worker down
    expected_down_fraction     = sum_k k * pi_k / n_workers
    fraction of arrivals dropped = pi_K

With a cap ``max_down = K`` (``K <= n_workers - min_live``, so nothing is
dropped) an arrival that finds ``K`` workers down waits: an M/M/K queue with
``K`` servers, the queued arrivals being the deferred failures. For
``rho < K`` the number ``k`` of down workers has::

    pi_k = c * rho**k / k!                       for k < K
    pi_K = c * rho**K / K! * K / (K - rho)       (K down, any number waiting)

with ``c`` normalising, and the mean number down is ``rho``. For ``rho >= K``
the queue grows without bound: in the long run ``K`` workers are always down
(``pi = (0, .., 0, 1)``). A cap above ``n_workers - min_live`` is never reached
(the ``min_live`` drop comes first): the loss formula above applies.

Worked example for the cap: 32 workers, ``max_down=1`` (one failure at a
time). ``high``, ``mid`` and ``low`` offer ``rho = 4, 3, 2`` with the job's own
rate: all saturate, one worker is down 100 % of the time in the long run
(a 720-step trace of 24 h reaches it after the first failure, half an hour in
for ``high``). As a slice of a 256-worker cluster, ``high`` offers ``rho = 32 /
256 * 4 = 0.5``: one worker down 50 % of the time, ``pi = (1/2, 1/2)``.

A trace starts with every worker up, so a run spanning only a few MTTRs sees a
little less than these stationary values; ``FailureTrace.degraded_fraction()``
is the realized value that benchmarks report.

Worked example: ``high`` (MTBF 0.5 h, MTTR 2 h), 4 workers, ``min_live=1``,
1000 steps standing for 24 h. ``step_time_s = 24 * 3600 / 1000 = 86.4 s``, so
MTBF = 1800 s = 20.8 steps and MTTR = 7200 s = 83.3 steps. Expected arrivals
``24 / 0.5 = 48``. ``rho = 4``, ``K = 3``: ``pi = (3, 12, 24, 32) / 71``, so
about 95.8 % of steps are degraded, 54.9 % of worker-steps are down on average,
and 45 % of arrivals (about 22 of 48) are dropped because three workers are
already down. MTTR > MTBF with few workers means several workers down at once:
a 4-worker job that fails as often as a whole cluster would. The same
preset with ``cluster_workers=64`` (the 4 workers are a slice of a 64-worker
cluster failing every half hour): ``lam = 1/8`` per hour, ``rho = 0.25``,
``pi = (1, 1/4, 1/32, 1/384) / 1.284``: 22 % of steps degraded, 6.2 % of
worker-steps down.
"""

from __future__ import annotations

from unbroken.faults.trace_presets import TracePreset, cluster_share, resolve_preset, shape_problems

__all__ = ["down_distribution", "expected_degraded_fraction", "expected_down_fraction"]


def down_distribution(
    preset: str | TracePreset, *, n_workers: int, min_live: int = 1, cluster_workers: int | None = None,
    max_down: int | None = None,
) -> tuple[float, ...]:
    """Long-run probability ``pi_k`` that ``k`` workers are down, ``k = 0..K``.

    ``K = n_workers - min_live`` without a cap: the Erlang loss formula with
    offered load ``(n / N) * MTTR / MTBF``; ``K = max_down`` with a cap at or
    below that: the M/M/K queue of deferred failures (module docstring).
    ``(1.0,)`` for a preset that never fails.
    """
    p = resolve_preset(preset)
    problems = shape_problems(p, n_workers, min_live, cluster_workers, max_down)
    if problems:
        raise ValueError("down_distribution: " + "; ".join(problems))
    if not p.fails:
        return (1.0,)
    rho = p.mttr_hours / (p.mtbf_hours * cluster_share(n_workers, cluster_workers))
    capped = max_down is not None and max_down <= n_workers - min_live
    top = max_down if capped and max_down is not None else n_workers - min_live
    if capped and rho >= top:
        return tuple(float(k == top) for k in range(top + 1))  # the queue of deferred failures never empties
    weights = [1.0]
    for k in range(1, top + 1):
        weights.append(weights[-1] * rho / k)
    if capped:
        weights[-1] *= top / (top - rho)  # K down with 0, 1, 2, ... waiting: a geometric series
    total = sum(weights)
    return tuple(w / total for w in weights)


def expected_degraded_fraction(
    preset: str | TracePreset, *, n_workers: int, min_live: int = 1, cluster_workers: int | None = None,
    max_down: int | None = None,
) -> float:
    """Long-run fraction of time with at least one worker down: ``1 - pi_0``."""
    return 1.0 - down_distribution(preset, n_workers=n_workers, min_live=min_live, cluster_workers=cluster_workers,
                           max_down=max_down)[0]


def expected_down_fraction(
    preset: str | TracePreset, *, n_workers: int, min_live: int = 1, cluster_workers: int | None = None,
    max_down: int | None = None,
) -> float:
    """Long-run mean fraction of workers down: ``sum_k k * pi_k / n_workers``."""
    pi = down_distribution(preset, n_workers=n_workers, min_live=min_live, cluster_workers=cluster_workers,
                           max_down=max_down)
    return sum(k * q for k, q in enumerate(pi)) / n_workers
