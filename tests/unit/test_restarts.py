"""The agent's restart scheduler on its own: the policy, a fault trace's outage, a rejoin, the crash-loop guard
and the restarts due."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from unbroken.agent.restarts import FAST_CRASH_S, MAX_FAST_CRASHES, Restarts


def _restarts(policy: str = "on-failure", delay_s: float = 0.5) -> Restarts:
    return Restarts(policy=policy, delay_s=delay_s, log=logging.getLogger("test"), logs_dir=Path("/run/logs"))


def test_a_death_comes_back_after_the_delay_and_an_outage_at_its_end_step():
    r = _restarts()
    assert r.schedule(1, now=100.0, started=0.0, crashed=False, back_step=None, total_steps=50).at_time == 100.5
    assert r.schedule(2, now=100.0, started=0.0, crashed=False, back_step=30, total_steps=50).at_step == 30
    assert r.schedule(3, now=100.0, started=0.0, crashed=False, back_step=50, total_steps=50) is None, \
        "an outage that ends with the run: not started again"
    assert len(r) == 2 and r.waits_for_a_step()
    assert r.due(now=100.4, progress=29) == []
    assert r.due(now=100.5, progress=29) == [1]
    assert r.due(now=200.0, progress=30) == [2] and len(r) == 0 and not r.waits_for_a_step()


def test_never_starts_nobody_but_a_worker_that_left_to_rejoin():
    r = _restarts("never")
    assert r.schedule(1, now=5.0, started=0.0, crashed=True, back_step=None, total_steps=50) is None
    back = r.schedule(1, now=5.0, started=0.0, crashed=False, back_step=None, total_steps=50, rejoin=True)
    assert back is not None and back.at_time == 5.0
    assert r.due(now=5.0, progress=0) == [1]


def test_a_crash_loop_stops_restarts_and_any_other_death_resets_its_count(caplog):
    r = _restarts()
    for i in range(MAX_FAST_CRASHES - 1):
        assert r.schedule(1, now=10.0 * i + 1.0, started=10.0 * i, crashed=True, back_step=None, total_steps=9)
    killed = r.schedule(1, now=100.0, started=99.0, crashed=False, back_step=None, total_steps=9)
    assert killed is not None and r.fast_crashes[1] == 0, "a SIGKILL or a fence is not the worker's own failing"
    slow = r.schedule(1, now=200.0 + FAST_CRASH_S, started=200.0, crashed=True, back_step=None, total_steps=9)
    assert slow is not None and r.fast_crashes[1] == 0, "a crash after FAST_CRASH_S is not a fast one"
    with caplog.at_level(logging.ERROR):
        got = [r.schedule(1, now=300.0 + i, started=300.0 + i - 1, crashed=True, back_step=None, total_steps=9)
               for i in range(MAX_FAST_CRASHES)]
    assert got[-1] is None and all(got[:-1]), "the fifth fast crash in a row is the last"
    assert "crashed 5 times" in caplog.text and "/run/logs/w1.log" in caplog.text


def test_a_later_decision_replaces_the_pending_one_and_cancel_or_clear_drop_them():
    r = _restarts()
    r.schedule(1, now=1.0, started=0.0, crashed=False, back_step=20, total_steps=50)
    r.schedule(1, now=2.0, started=1.5, crashed=False, back_step=None, total_steps=50)
    assert len(r) == 1 and not r.waits_for_a_step()
    r.schedule(2, now=2.0, started=1.5, crashed=False, back_step=None, total_steps=50)
    r.cancel(1)
    r.cancel(7)  # nothing pending: nothing to do
    assert list(r.pending) == [2]
    r.clear()
    assert len(r) == 0 and r.due(now=1e9, progress=10 ** 9) == []


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="always.*expected one of never, on-failure"):
        _restarts("always")
