"""The start clock: each phase's seconds from the process's birth, as the start_phases event carries them."""

from __future__ import annotations

import sys

import pytest

from unbroken.runtime.start_phases import StartClock, process_age_s

pytestmark = pytest.mark.timeout(30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_process_phase_is_the_age_of_this_process():
    age = process_age_s()
    assert age is not None and 0 < age < 24 * 3600
    clock = StartClock()
    assert abs(clock.phases["process"] - age) < 1.0


def test_phases_accumulate_and_sum_to_the_total(monkeypatch: pytest.MonkeyPatch):
    ticks = iter([10.0, 10.5, 12.0, 12.25])
    monkeypatch.setattr("unbroken.runtime.start_phases.time.perf_counter", lambda: next(ticks))
    monkeypatch.setattr("unbroken.runtime.start_phases.process_age_s", lambda: 3.0)
    clock = StartClock()
    clock.mark("data")
    clock.mark("model")
    clock.mark("data")  # a phase marked twice adds up
    assert clock.summary() == {"phases": {"process": 3.0, "data": 0.75, "model": 1.5}, "total_s": 5.25}
