"""The per-step series of ``unbroken report`` from hand-made ledger, event and metrics records."""

from __future__ import annotations

import pytest

from unbroken.report import series as rs

pytestmark = pytest.mark.timeout(10)

MB = 4


def work(step: int, gen: int, worker: int, *items: tuple[int, int, int, str]) -> dict:
    return {"kind": "work", "step": step, "gen": gen, "worker": worker, "items": [list(i) for i in items]}


def commit(step: int, gen: int, worker: int) -> dict:
    return {"kind": "commit", "step": step, "gen": gen, "worker": worker}


def event(name: str, t: float, **fields: object) -> dict:
    return {"kind": "event", "event": name, "time": t, **fields}


def three_workers_one_death() -> list[dict]:
    """Workers 0-2, 4 steps; worker 1 dies in step 1 (view 0 aborted), worker 2 covers slot 1 approximately."""
    recs = []
    for w in range(3):
        recs += [work(0, 0, w, (w, 0, MB, "exact")), commit(0, 0, w)]
    recs += [work(1, 0, w, (w, 0, MB, "exact")) for w in range(3)]  # the aborted attempt: history only
    recs += [work(1, 1, 0, (0, 0, MB, "exact")), work(1, 1, 2, (2, 0, MB, "exact"), (1, 0, MB, "approx"))]
    for step in (2, 3):
        recs += [work(step, 1, 0, (0, 0, MB, "exact")), work(step, 1, 2, (1, 0, MB, "approx"), (2, 0, MB, "approx"))]
    recs += [commit(s, 1, w) for s in (1, 2, 3) for w in (0, 2)]
    return recs


def test_committed_items_are_the_committed_attempts_work_only():
    items = rs.committed_items(three_workers_one_death())
    assert sorted(items) == [0, 1, 2, 3]
    assert items[0] == [(0, 0, 0, MB, "exact"), (1, 1, 0, MB, "exact"), (2, 2, 0, MB, "exact")]
    assert items[1] == [(0, 0, 0, MB, "exact"), (2, 1, 0, MB, "approx"), (2, 2, 0, MB, "exact")]
    assert items[3] == [(0, 0, 0, MB, "exact"), (2, 1, 0, MB, "approx"), (2, 2, 0, MB, "approx")]


def test_committed_items_leave_out_a_step_committed_under_two_generations():
    recs = [work(0, 0, 0, (0, 0, MB, "exact")), commit(0, 0, 0), commit(0, 1, 1)]
    assert rs.committed_items(recs) == {}


def test_slot_modes():
    assert rs.slot_modes([(0, 0, 0, 4, "exact"), (1, 1, 0, 4, "exact")]) == {}
    # Slot 1 split between its home worker (rows 0-2) and worker 0 (rows 2-4, exact): covered exactly.
    assert rs.slot_modes([(1, 1, 0, 2, "exact"), (0, 1, 2, 4, "exact")]) == {1: rs.COVERED_EXACT}
    # One approximated covered row range makes the slot approximated.
    assert rs.slot_modes([(0, 1, 0, 2, "exact"), (2, 1, 2, 4, "approx")]) == {1: rs.COVERED_APPROX}
    # The covering worker approximating its own slot: not covered, but degraded.
    assert rs.slot_modes([(2, 1, 0, 4, "approx"), (2, 2, 0, 4, "approx")]) == {1: rs.COVERED_APPROX,
                                                                               2: rs.OWN_APPROX}


def test_degraded_series_counts_slots_per_step_and_mode():
    out = rs.degraded_series(rs.committed_items(three_workers_one_death()), steps=5)
    assert out == {rs.COVERED_EXACT: [0, 0, 0, 0, 0], rs.COVERED_APPROX: [0, 1, 1, 1, 0],
                   rs.OWN_APPROX: [0, 0, 1, 1, 0]}


def test_worker_states_live_dead_and_rejoining():
    recs = three_workers_one_death() + [
        event("worker_start", 1.0, worker=1, join=False, progress=0),
        event("fault_self", 2.0, worker=1, step=1, phase="forward", how="kill"),
        event("worker_start", 3.0, worker=1, join=True, progress=2),  # restarted while step 2 was in flight
        event("rejoined", 4.0, worker=1, step=4, gen=2),
    ] + [r for w in range(3) for r in (work(4, 2, w, (w, 0, MB, "exact")), commit(4, 2, w))]
    states = rs.worker_states(recs, n_workers=3, steps=5)
    L, R, D = rs.LIVE, rs.REJOINING, rs.DEAD
    assert states == [[L, L, L, L, L], [L, D, R, R, L], [L, L, L, L, L]]
    assert rs.live_counts(states, steps=5) == [3, 2, 2, 2, 3]
    assert rs.rejoin_windows(recs, steps=5) == [(1, 2, 4)]
    assert rs.rejoin_steps(recs) == [(1, 4)]


def test_a_joiner_never_admitted_is_rejoining_to_the_end():
    recs = [event("worker_start", 1.0, worker=2, join=True, progress=3)]
    assert rs.rejoin_windows(recs, steps=6) == [(2, 3, 6)]


def test_deaths_by_kind_one_per_incarnation():
    recs = [
        # worker 1 kills itself in step 4; its agent then records the exit (the same death)
        event("fault_self", 10.0, worker=1, step=4, phase="forward", how="kill"),
        {"kind": "event", "event": "worker_exit", "t": 10.1, "time": 10.2, "worker": 1, "clean": False,
         "injected": True, "progress": 4, "fenced": False},
        # worker 2 hangs (SIGSTOP) in step 6, is fenced later: one death, a hang
        event("fault_self", 20.0, worker=2, step=6, phase="forward", how="stop"),
        {"kind": "event", "event": "fence", "t": 21.0, "worker": 2},
        {"kind": "event", "event": "worker_exit", "t": 21.1, "worker": 2, "clean": False, "injected": True,
         "progress": 7, "fenced": True},
        # worker 1, restarted, blocks its main thread in step 9
        {"kind": "event", "event": "worker_start", "t": 30.0, "worker": 1, "join": True, "progress": 7},
        event("fault_self", 40.0, worker=1, step=9, phase="allreduce", how="block"),
        # node 1 (workers 3 and 4) lost in step 11
        {"kind": "event", "event": "fault_injected", "t": 50.0, "node": 1, "worker": None, "signal": "SIGKILL",
         "targets": [3, 4], "progress": 11, "lost_node": True},
        # an unplanned exit of worker 0, judged dead by a peer; agent shutdown exits are no deaths
        {"kind": "event", "event": "worker_exit", "t": 60.0, "worker": 0, "clean": False, "injected": False,
         "progress": 12, "fenced": True},
        {"kind": "event", "event": "worker_exit", "t": 70.0, "worker": 5, "clean": False, "stopped_by_agent": True},
        {"kind": "event", "event": "worker_exit", "t": 70.0, "worker": 6, "clean": True},
    ]
    got = [(d["worker"], d["step"], d["kind"]) for d in rs.deaths(recs)]
    assert got == [(1, 4, "crash"), (2, 6, "hang"), (1, 9, "block"), (3, 11, "node loss"), (4, 11, "node loss"),
                   (0, 12, "fenced")]


def test_deaths_from_an_agents_signal():
    recs = [{"kind": "event", "event": "fault_injected", "t": 5.0, "node": 0, "worker": 1, "signal": "SIGSTOP",
             "targets": [1], "progress": 3, "lost_node": False},
            {"kind": "event", "event": "worker_exit", "t": 7.0, "worker": 1, "clean": False, "injected": True,
             "progress": 4, "fenced": True}]
    assert [(d["worker"], d["step"], d["kind"]) for d in rs.deaths(recs)] == [(1, 3, "hang")]


def test_loss_series_maps_steps_done_to_step_index():
    metrics = [{"kind": "train", "step": 1, "loss": 5.0}, {"kind": "train", "step": 2, "loss": 4.5},
               {"kind": "val", "step": 2, "val_loss": 4.75}, {"kind": "train", "step": 4, "loss": float("nan")},
               {"kind": "train", "step": 9, "loss": 1.0}]  # beyond the run's steps: ignored
    assert rs.loss_series(metrics, steps=4) == ([5.0, 4.5, None, None], [None, 4.75, None, None])


def test_stall_series():
    failures = [{"step": 1, "stall_s": 0.5}, {"step": 3, "stall_s": None}]
    assert rs.stall_series(failures, steps=4) == [None, 0.5, None, None]


def test_simulated_records_feed_the_same_series():
    metrics = [{"kind": "train", "step": 1, "live_workers": [0, 1], "assignment": {"0": [[0, 0, 4, "exact"]],
                                                                                 "1": [[1, 0, 4, "exact"]]}},
               {"kind": "train", "step": 2, "live_workers": [0],
                "assignment": {"0": [[0, 0, 4, "approx"], [1, 0, 4, "approx"]]}},
               {"kind": "val", "step": 2, "val_loss": 3.0}]
    recs = rs.simulated_records(metrics)
    assert rs.worker_states(recs, n_workers=2, steps=2) == [[rs.LIVE, rs.LIVE], [rs.LIVE, rs.DEAD]]
    assert rs.degraded_series(rs.committed_items(recs), steps=2) == {
        rs.COVERED_EXACT: [0, 0], rs.COVERED_APPROX: [0, 1], rs.OWN_APPROX: [0, 1]}


def test_ledger_verdict():
    assert [rs.ledger_verdict(x) for x in (True, False, None)] == ["OK", "VIOLATED", "n/a"]
