"""Tests of unbroken.faults.traces: seeded failure traces and their analytics."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from unbroken.faults.analytics import down_distribution, expected_degraded_fraction, expected_down_fraction
from unbroken.faults.trace_presets import TRACE_PRESETS, TracePreset, trace_preset
from unbroken.faults.traces import FailureTrace, Outage, generate_trace, step_time_for

pytestmark = pytest.mark.timeout(60)

FAILING = ["low", "mid", "high", "extreme"]


def _trace(preset: str = "high", *, seed: int = 0, n_workers: int = 4, n_steps: int = 1000, **kw: int) -> FailureTrace:
    return generate_trace(preset, n_workers=n_workers, n_steps=n_steps, step_time_s=step_time_for(n_steps), seed=seed, **kw)


def test_presets() -> None:
    assert list(TRACE_PRESETS) == ["none", "low", "mid", "high", "extreme"]
    assert trace_preset("high") == TracePreset(name="high", mtbf_hours=0.5, mttr_hours=2.0)
    assert trace_preset("low") == TracePreset(name="low", mtbf_hours=2.0, mttr_hours=4.0)
    assert not trace_preset("none").fails
    with pytest.raises(ValueError, match=r"'sometimes'.*none, low, mid, high, extreme"):
        trace_preset("sometimes")


def test_step_time_for() -> None:
    assert step_time_for(1000) == pytest.approx(86.4)
    assert step_time_for(500, job_hours=1.0) == pytest.approx(7.2)
    with pytest.raises(ValueError, match="n_steps=0"):
        step_time_for(0)
    with pytest.raises(ValueError, match="job_hours=-1"):
        step_time_for(10, job_hours=-1)


def test_same_seed_same_trace_different_seed_different() -> None:
    assert _trace(seed=7) == _trace(seed=7)
    assert _trace(seed=7).outages != _trace(seed=8).outages


def test_none_has_no_outages() -> None:
    t = _trace("none", n_workers=1)
    assert t.outages == () and t.dropped == 0
    assert t.degraded_fraction() == 0.0 and t.down_at(0) == frozenset()


@pytest.mark.parametrize("preset", FAILING)
@pytest.mark.parametrize("seed", range(5))
def test_outages_of_a_worker_never_overlap_and_stay_in_range(preset: str, seed: int) -> None:
    t = _trace(preset, seed=seed, n_workers=3)
    assert t.outages, "a 24 h job under any failing preset sees failures"
    for w in range(t.n_workers):
        mine = [o for o in t.outages if o.worker == w]
        for a, b in zip(mine, mine[1:]):
            assert a.end_step <= b.start_step
    for o in t.outages:
        assert 0 <= o.start_step < o.end_step <= t.n_steps


@pytest.mark.parametrize("preset", FAILING)
@pytest.mark.parametrize("min_live", [1, 2])
def test_min_live_workers_always_up(preset: str, min_live: int) -> None:
    traces = [_trace(preset, seed=seed, min_live=min_live) for seed in range(5)]
    for t in traces:
        assert all(len(t.down_at(s)) <= t.n_workers - min_live for s in range(t.n_steps))
    # The bound is reached under these harsh presets, and arrivals beyond it are dropped.
    assert max(t.most_down() for t in traces) == 4 - min_live
    assert sum(t.dropped for t in traces) > 0


def test_min_live_zero_allows_all_down() -> None:
    t = _trace("extreme", n_workers=2, min_live=0)
    assert t.most_down() == 2


def test_queries_agree_with_outages() -> None:
    t = _trace("high", seed=3)
    down: set[int] = set()
    for s in range(t.n_steps):
        # Returns are applied at the step boundary, before the step's failures.
        assert not set(t.returns_at(s)) - down
        down -= set(t.returns_at(s))
        assert not set(t.failures_at(s)) & down
        down |= set(t.failures_at(s))
        assert t.down_at(s) == frozenset(down)
    with pytest.raises(ValueError, match="step=1000"):
        t.down_at(t.n_steps)


def test_hand_made_trace() -> None:
    t = FailureTrace(
        n_workers=3,
        n_steps=10,
        outages=(Outage(worker=2, start_step=4, end_step=10), Outage(worker=0, start_step=1, end_step=4)),
    )
    assert t.outages[0].worker == 0  # sorted by start step
    assert t.down_at(0) == frozenset() and t.down_at(3) == frozenset({0}) and t.down_at(4) == frozenset({2})
    assert t.failures_at(4) == (2,) and t.returns_at(4) == (0,)
    assert t.degraded_fraction() == pytest.approx(0.9)
    assert t.down_fraction() == pytest.approx(9 / 30)
    with pytest.raises(ValueError, match="overlaps"):
        FailureTrace(n_workers=1, n_steps=5, outages=(Outage(worker=0, start_step=0, end_step=3), Outage(worker=0, start_step=2, end_step=4)))
    with pytest.raises(ValueError, match="outside"):
        FailureTrace(n_workers=1, n_steps=5, outages=(Outage(worker=1, start_step=0, end_step=6),))
    with pytest.raises(ValueError, match="start_step < end_step"):
        Outage(worker=0, start_step=3, end_step=3)


def test_analytics_of_high() -> None:
    # Erlang loss with rho = MTTR/MTBF = 4 and K = n_workers - min_live = 3: pi = (3, 12, 24, 32) / 71.
    assert down_distribution("high", n_workers=4) == pytest.approx((3 / 71, 12 / 71, 24 / 71, 32 / 71))
    assert expected_degraded_fraction("high", n_workers=4) == pytest.approx(68 / 71)
    assert expected_down_fraction("high", n_workers=4) == pytest.approx(156 / 71 / 4)
    assert expected_degraded_fraction("none", n_workers=1) == 0.0


def test_realized_fraction_matches_stationary_analytics_over_a_long_trace() -> None:
    # 2000 h at 60 s per step: start-up transient (~MTTR) and rounding (+1 step on 7200 s) are negligible.
    t = generate_trace("high", n_workers=4, n_steps=120_000, step_time_s=60.0, seed=0)
    assert t.degraded_fraction() == pytest.approx(expected_degraded_fraction("high", n_workers=4), abs=0.02)
    assert t.down_fraction() == pytest.approx(expected_down_fraction("high", n_workers=4), abs=0.03)
    # Arrivals that find K workers down are dropped: by PASTA, a fraction pi_K of them.
    arrivals = len(t.outages) + t.dropped
    assert arrivals == pytest.approx(2000 / 0.5, rel=0.05)
    assert t.dropped / arrivals == pytest.approx(32 / 71, abs=0.03)


def test_cluster_workers_scales_the_failure_rate_to_the_jobs_share() -> None:
    # 4 of 64 workers: lam = (4/64) / 0.5 h = 1/8 per hour, rho = 2 h / 8 h = 1/4, K = 3:
    # pi = (1, 1/4, 1/32, 1/384) / (493/384) = (384, 96, 12, 1) / 493.
    assert down_distribution("high", n_workers=4, cluster_workers=64) == pytest.approx(
        (384 / 493, 96 / 493, 12 / 493, 1 / 493))
    assert expected_degraded_fraction("high", n_workers=4, cluster_workers=64) == pytest.approx(109 / 493)
    assert expected_down_fraction("high", n_workers=4, cluster_workers=64) == pytest.approx(123 / 493 / 4)
    # The job alone is the cluster: the same numbers, and the same draws, as leaving it out.
    assert down_distribution("high", n_workers=4, cluster_workers=4) == down_distribution("high", n_workers=4)
    assert _trace("high", seed=3, cluster_workers=4).outages == _trace("high", seed=3).outages
    # Realized over 20000 h: arrivals at 1/8 per hour, degraded and down fractions as computed.
    t = generate_trace("high", n_workers=4, n_steps=200_000, step_time_s=360.0, seed=0, cluster_workers=64)
    assert len(t.outages) + t.dropped == pytest.approx(20_000 / 8, rel=0.05)
    assert t.degraded_fraction() == pytest.approx(109 / 493, abs=0.02)
    assert t.down_fraction() == pytest.approx(123 / 493 / 4, abs=0.01)
    assert t.cluster_workers == 64
    assert FailureTrace.from_json(json.loads(json.dumps(t.to_json()))) == t


def _mean_degraded(preset: str, n_steps: int, seeds: range) -> float:
    return float(np.mean([_trace(preset, seed=s, n_steps=n_steps).degraded_fraction() for s in seeds]))


@pytest.mark.parametrize("preset", FAILING)
def test_short_and_long_run_tell_the_same_story(preset: str) -> None:
    # Same seeds: the same wall-clock failures at 500 and 20000 steps; only rounding differs.
    assert _mean_degraded(preset, 500, range(40)) == pytest.approx(_mean_degraded(preset, 20_000, range(40)), abs=0.02)


def test_short_and_long_run_agree_statistically() -> None:
    # Disjoint seeds: the per-run std of `high` over 24 h is ~0.05, so ~0.011 for a 40-seed mean.
    short = _mean_degraded("high", 500, range(40))
    long = _mean_degraded("high", 20_000, range(1000, 1040))
    assert short == pytest.approx(long, abs=0.04)


def test_json_round_trip() -> None:
    for t in (_trace("high", seed=1), _trace("none", n_workers=2)):
        d = json.loads(json.dumps(t.to_json(), allow_nan=False))
        assert FailureTrace.from_json(d) == t
    with pytest.raises(ValueError, match="not a failure trace"):
        FailureTrace.from_json({"format": "pickle"})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(n_workers=0), "n_workers=0"),
        (dict(n_workers=1), "no one to take over"),
        (dict(n_steps=0), "n_steps=0"),
        (dict(step_time_s=0.0), r"step_time_s=0\.0.*step_time_for"),
        (dict(step_time_s=-5.0), "step_time_s=-5"),
        (dict(preset="often"), "unknown failure trace 'often'"),
        (dict(seed=-3), "seed=-3"),
        (dict(min_live=-1), "min_live=-1"),
        (dict(min_live=4), "min_live=4.*min_live <= 3"),
        (dict(cluster_workers=3), "cluster_workers=3 must be an integer >= n_workers=4"),
        (dict(cluster_workers=8.0), "cluster_workers=8.0 must be an integer"),
    ],
)
def test_generate_trace_validation(kwargs: dict, match: str) -> None:
    args = dict(preset="high", n_workers=4, n_steps=100, step_time_s=10.0, seed=0) | kwargs
    preset = args.pop("preset")
    with pytest.raises(ValueError, match=match):
        generate_trace(preset, **args)


def test_generate_trace_reports_all_problems_at_once() -> None:
    with pytest.raises(ValueError, match=r"n_workers=1.*n_steps=0.*step_time_s=0"):
        generate_trace("high", n_workers=1, n_steps=0, step_time_s=0, seed=0)


def test_one_worker_without_failures_is_fine() -> None:
    assert _trace("none", n_workers=1).n_workers == 1


@pytest.mark.parametrize(("mtbf", "mttr", "match"), [(0.0, 1.0, "mtbf_hours=0.0"), (1.0, 0.0, "mttr_hours=0.0"), (1.0, -2.0, "mttr_hours=-2.0")])
def test_preset_validation(mtbf: float, mttr: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        TracePreset(name="custom", mtbf_hours=mtbf, mttr_hours=mttr)


def test_custom_preset_object() -> None:
    p = TracePreset(name="custom", mtbf_hours=1.0, mttr_hours=0.5)
    t = generate_trace(p, n_workers=2, n_steps=100, step_time_s=step_time_for(100), seed=0)
    assert t.preset == p and not math.isnan(t.degraded_fraction())
