"""Capacity from a run's records: each loss from its first record to the view its worker adopts again (a
rejoin, or a restored view), what else was lost meanwhile, and every gap from an exit to the next start with
what the agent said it waited for."""

from __future__ import annotations

from unbroken.bench.capacity import gaps, losses, summarize


def _e(t: float, event: str, worker: int | None = None, **f) -> dict:
    return {"kind": "event", "event": event, "worker": worker, "time": t, **f}


EVENTS = [
    _e(10.0, "worker_exit", 1, clean=False, restart_in_s=0.0, pid=11),
    _e(10.1, "worker_start", 1, pid=12),
    _e(10.2, "fence", 2),
    _e(10.3, "worker_exit", 2, clean=False, restart_in_s=0.0, pid=21),
    _e(14.0, "worker_start", 2, pid=22),  # started 3.7 s after its exit, for a restart said to be due at once
    _e(12.5, "view_adopted", 1, members=[0, 1, 3], joiners=[1], reason="rejoin [1]"),
    _e(16.0, "view_adopted", 2, members=[0, 1, 2, 3], reason="restored from snapshot memory at step 9"),
    _e(20.0, "worker_exit", 3, clean=False, restart_at_step=30, pid=31),
]


def test_each_loss_ends_when_its_worker_adopts_a_view_again_and_names_what_was_lost_meanwhile():
    got = {x["worker"]: x for x in losses(EVENTS, [{"pid": 11, "wall": 9.5, "signal": "SIGSTOP"}])}
    assert (got[1]["lost_at"], got[1]["back_s"], got[1]["how"], got[1]["cause"]) == (9.5, 3.0, "rejoin",
                                                                                      "SIGSTOP from outside")
    assert got[1]["meanwhile"] == [2], "worker 2 was lost while worker 1 waited to be admitted"
    assert (got[2]["back_s"], got[2]["how"], got[2]["cause"]) == (5.8, "restore", "fence")
    assert got[3]["back_s"] is None and got[3]["how"] is None, "never back: the run ended first"


def test_a_gap_longer_than_the_agent_said_is_unexplained():
    g = {x["worker"]: x for x in gaps(EVENTS)}
    assert g[1]["explained"] and g[1]["gap_s"] == 0.1
    assert not g[2]["explained"] and g[2]["gap_s"] == 3.7 and g[2]["why"] == "restart in 0.0 s"
    s = summarize(EVENTS)
    assert s["losses"] == 3 and s["back"] == 2 and len(s["never_back"]) == 1
    assert s["slower_than_target"] == 1 and len(s["unexplained_gaps"]) == 1
    assert [x["worker"] for x in s["slower_for_no_reason_found"]] == [2], \
        "worker 2 came back late with no other loss and no new fault meanwhile: named for a look"


def test_a_member_stopped_and_continued_before_anything_noticed_is_back_when_continued():
    events = [
        _e(1.0, "worker_start", 0, pid=10), _e(1.0, "worker_start", 1, pid=11), _e(1.0, "worker_start", 2, pid=12),
        _e(2.0, "view_adopted", 0, gen=1, members=[0, 1]), _e(2.0, "view_adopted", 1, gen=1, members=[0, 1]),
        # worker 2 is a joiner, not a member, when it is stopped: it is back only when admitted
        _e(12.0, "view_adopted", 2, gen=2, members=[0, 1, 2], joiners=[2], reason="rejoin [2]"),
        _e(22.5, "fence", 1),  # worker 1's second stall was noticed before its continue's slack ran out
        _e(23.0, "worker_exit", 1, clean=False, restart_in_s=0.0, pid=11),
        _e(23.1, "worker_start", 1, pid=13),
        _e(25.0, "view_adopted", 1, gen=3, members=[0, 1, 2], joiners=[1], reason="rejoin [1]"),
    ]
    faults = [{"pid": 11, "wall": 5.0, "signal": "SIGSTOP", "cont_wall": 6.5},
              {"pid": 12, "wall": 8.0, "signal": "SIGSTOP", "cont_wall": 9.0},
              {"pid": 11, "wall": 20.0, "signal": "SIGSTOP", "cont_wall": 22.0}]
    got = [(x["worker"], x["lost_at"], x["back_s"], x["how"]) for x in losses(events, faults)]
    assert got == [(1, 5.0, 1.5, "continued"), (2, 8.0, 4.0, "rejoin"), (1, 20.0, 5.0, "rejoin")]
    assert summarize(events, faults)["by_how"] == {"rejoin": 2, "restore": 0, "view": 0, "continued": 1}
