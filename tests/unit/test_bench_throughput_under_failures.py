"""The throughput-under-failures study's modelled comparisons and its slot count (benchmarks/throughput_under_failures.py):
exact figures on a hand-made trace."""

from __future__ import annotations

import dataclasses

import pytest

from benchmarks.throughput_under_failures import covered, drop_the_step, restart_from_memory, slot_overrides
from unbroken.config import load_config
from unbroken.faults.traces import FailureTrace, Outage

pytestmark = pytest.mark.timeout(60)

# Worker 1 of 4 down for steps [2, 6) of 10: one failure, four steps at 3/4 strength.
TRACE = FailureTrace(n_workers=4, n_steps=10, outages=(Outage(worker=1, start_step=2, end_step=6),))


def test_dropping_the_step_loses_the_step_in_flight_and_the_lost_slots_of_the_outage():
    row = drop_the_step(TRACE, step_s=1.0, detect_s=0.5)
    assert row["modelled"] and row["failures"] == 1
    assert row["trained_share"] == pytest.approx((6 + 4 * 0.75) / 10)
    # 10 steps and the dropped one, plus the regroup: 11.5 s for 9 steps' worth of tokens
    assert row["throughput_ratio"] == pytest.approx(0.9 / 1.15)
    assert row["phases"] == {"step_s": 1.0, "detect_s": 0.5}


def test_a_restart_from_memory_costs_the_step_in_flight_the_detection_and_a_start_per_failure():
    row = restart_from_memory(TRACE, step_s=1.0, detect_s=0.5, restart_s=2.0)
    assert row["modelled"] and row["failures"] == 1
    assert row["throughput_ratio"] == pytest.approx(10 / 13.5)


def test_a_policy_from_its_phases_costs_its_covering_step_while_degraded_and_its_stall_per_failure():
    row = covered(TRACE, step_s=1.0, stall_s=0.5, cover_ratio=1.5)
    assert row["modelled"] and row["failures"] == 1
    assert row["throughput_ratio"] == pytest.approx(10 / (6 + 4 * 1.5 + 0.5))  # nothing lost, only slower


def test_no_failure_costs_nothing():
    quiet = FailureTrace(n_workers=4, n_steps=10, outages=())
    assert drop_the_step(quiet, step_s=1.0, detect_s=0.5)["throughput_ratio"] == 1.0
    assert restart_from_memory(quiet, step_s=1.0, detect_s=0.5, restart_s=2.0)["throughput_ratio"] == 1.0
    assert covered(quiet, step_s=1.0, stall_s=0.5, cover_ratio=1.7)["throughput_ratio"] == 1.0


def test_slots_are_one_per_worker_or_a_global_batch_of_several_micro_batches(corpus_overrides):
    cfg = load_config(preset_name="debug", overrides=[*corpus_overrides, "train.workers=4", "data.micro_batch=2"])
    assert slot_overrides(cfg, 4) == []
    with pytest.raises(ValueError, match="multiple of the 4 workers"):
        slot_overrides(cfg, 6)
    if "global_batch" in {f.name for f in dataclasses.fields(cfg.train)}:
        assert slot_overrides(cfg, 8) == ["train.global_batch=16"]
    else:
        with pytest.raises(ValueError, match="one slot per worker"):
            slot_overrides(cfg, 8)
