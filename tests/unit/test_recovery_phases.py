"""A recovery's phases read from a run's events (:mod:`unbroken.report.recovery_phases`): exact, on a written timeline."""

from __future__ import annotations

from unbroken.report.recovery_phases import recoveries

T = 1000.0


def _e(dt: float, **fields) -> dict:
    return {"time": T + dt, "kind": "event", **fields}


def _commit(dt: float, step: int, gen: int, worker: int) -> dict:
    return {"time": T + dt, "kind": "commit", "step": step, "gen": gen, "worker": worker}


def _steady(until: int, worker: int = 0) -> list[dict]:
    return [_commit(-(until - s) * 1.0, s, 0, worker) for s in range(until)]  # one step a second, the last at -1 s


def test_a_whole_job_restore_reads_every_phase_from_its_events():
    events = _steady(10) + [
        _e(0.0, event="fault_self", worker=0, step=10, how="kill"),
        _e(0.05, event="worker_exit", worker=0, clean=False, seen="exiting"),
        _e(0.10, event="worker_start", worker=0),
        _e(0.40, event="job_restore", inventory_s={"0": 0.2}, decided_s=0.3),
        _e(0.45, event="worker_reaped", worker=0, teardown_s=0.6),
        _e(0.70, event="state_loaded", worker=0, how="restore", bytes=7e8, seconds=0.25, gb_s=2.8),
        _e(0.71, event="start_phases", worker=0, join=True, phases={"process": 0.0, "admission": 0.5}),
        _e(1.60, event="first_step_after_recovery", worker=0, step=9),
        _commit(1.60, 9, 1, 0), _commit(3.50, 10, 1, 0), _commit(4.40, 11, 1, 0),  # slow, then at speed
    ]
    (r,) = recoveries(events)
    assert r["workers"] == [0] and r["kill_step"] == 10 and r["whole_job"] is True
    assert (r["death_seen"], r["reaped"], r["process_ready"], r["decided"], r["state_loaded"], r["first_step"]) == (
        0.05, 0.45, 0.21, 0.4, 0.7, 1.6)
    assert r["seen_while"] == ["exiting"] and r["median_step_s"] == 1.0
    assert r["steps_back"] == 4.4  # 3.5 - 1.6 = 1.9 s is slow; 4.4 - 3.5 = 0.9 s is back at speed
    assert r["load"] == {"bytes": 7e8, "seconds": 0.25, "gb_s": 2.8, "how": ["restore"]}
    assert r["inventory_s"] == {"0": 0.2} and r["decision_s"] == 0.3


def test_one_worker_killed_is_admitted_back_while_the_others_train_on():
    events = _steady(10, worker=0) + [
        _e(0.0, event="fault_self", worker=1, step=10, how="kill"),
        _e(0.02, event="worker_exit", worker=1, clean=False),
        _commit(0.5, 10, 1, 0),  # the survivor's step without it
        _e(0.9, event="view_adopted", worker=0, joiners=[1], adopt_s=0.2),
        _e(1.0, event="view_adopted", worker=1, joiners=[1], adopt_s=0.3),
        _e(1.0, event="start_phases", worker=1, join=True, phases={"admission": 0.6}),
        _e(2.0, event="first_step_after_recovery", worker=1, step=11),
        _commit(2.0, 11, 2, 0),
    ]
    (r,) = recoveries(events)
    assert r["whole_job"] is False and r["survivors_step"] == 0.5 and r["reaped"] == r["death_seen"] == 0.02
    assert (r["process_ready"], r["decided"], r["state_loaded"], r["first_step"]) == (0.4, 0.7, 1.0, 2.0)
    assert "load" not in r and r["steps_back"] is None  # no step after its first yet


def test_kills_close_together_are_one_failure_and_a_missing_phase_is_none():
    events = _steady(4) + [
        _e(0.0, event="fault_self", worker=0, step=4, how="kill"),
        _e(0.3, event="fault_self", worker=1, step=4, how="kill"),
        _e(0.1, event="worker_exit", worker=0, clean=False),
        _e(60.0, event="fault_injected", signal="SIGKILL", targets=[2, 3], progress=9),
    ]
    first, second = recoveries(events)
    assert first["workers"] == [0, 1] and first["death_seen"] is None  # worker 1's death was never recorded
    assert second["workers"] == [2, 3] and second["kill_step"] == 9 and second["first_step"] is None
