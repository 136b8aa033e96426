"""``TakeoverPolicy.assign``: hand-computed assignments, exactly-once coverage, bad inputs."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from unbroken.mecefo.gradients import SlotWork
from unbroken.mecefo.takeover import POLICIES, NoLiveWorker, assignment_json, degraded_slots

pytestmark = pytest.mark.timeout(60)

MB = 8


def W(slot: int, a: int = 0, b: int = MB, mode: str = "exact") -> SlotWork:
    return SlotWork(slot=slot, rows=(a, b), mode=mode)


def A(slot: int, a: int = 0, b: int = MB) -> SlotWork:
    return W(slot, a, b, "approx")


# --- neighbor ---------------------------------------------------------------


@pytest.mark.parametrize("live, want", [
    # one failure: the ring successor of 2 is 3; it approximates its own slot too
    ({0, 1, 3}, {0: [W(0)], 1: [W(1)], 3: [A(3), A(2)]}),
    # the last slot's successor wraps around to 0
    ({0, 1, 2}, {0: [A(0), A(3)], 1: [W(1)], 2: [W(2)]}),
    # two adjacent failures, 1 and its successor 2: worker 3 covers both
    ({0, 3}, {0: [W(0)], 3: [A(3), A(1), A(2)]}),
    # two adjacent failures across the wrap
    ({0, 1}, {0: [A(0), A(2), A(3)], 1: [W(1)]}),
    # two non-adjacent failures: two covering workers, no exact slot left
    ({1, 3}, {1: [A(1), A(0)], 3: [A(3), A(2)]}),
    # nothing failed: everything exact
    ({0, 1, 2, 3}, {w: [W(w)] for w in range(4)}),
])
def test_neighbor_hand_computed(live, want):
    assert POLICIES["neighbor"].assign(n_slots=4, live=live, micro_batch=MB) == want


def test_neighbor_single_survivor_covers_all():
    got = POLICIES["neighbor"].assign(n_slots=4, live=[2], micro_batch=MB)
    assert got == {2: [A(2), A(0), A(1), A(3)]}


# --- spread / spread-approx ---------------------------------------------------


@pytest.mark.parametrize("live, want", [
    # one failure: split_rows(8, 3) = (0,3) (3,6) (6,8) from position 2 * 8 % 3 = 1 of [0, 1, 3], around the ring
    ({0, 1, 3}, {0: [W(0), W(2, 6, 8)], 1: [W(1), W(2, 0, 3)], 3: [W(3), W(2, 3, 6)]}),
    # two adjacent failures: each dead slot halved between 0 and 3
    ({0, 3}, {0: [W(0), W(1, 0, 4), W(2, 0, 4)], 3: [W(3), W(1, 4, 8), W(2, 4, 8)]}),
    # two non-adjacent failures
    ({1, 3}, {1: [W(1), W(0, 0, 4), W(2, 0, 4)], 3: [W(3), W(0, 4, 8), W(2, 4, 8)]}),
])
def test_spread_hand_computed(live, want):
    assert POLICIES["spread"].assign(n_slots=4, live=live, micro_batch=MB) == want
    approx = {w: [items[0]] + [SlotWork(i.slot, i.rows, "approx") for i in items[1:]] for w, items in want.items()}
    assert POLICIES["spread-approx"].assign(n_slots=4, live=live, micro_batch=MB) == approx


def test_spread_skips_empty_ranges():
    # 2 rows over 3 survivors: the third range is empty and worker 3 gets nothing extra.
    got = POLICIES["spread"].assign(n_slots=4, live=[1, 2, 3], micro_batch=2)
    assert got == {1: [W(1, 0, 2), W(0, 0, 1)], 2: [W(2, 0, 2), W(0, 1, 2)], 3: [W(3, 0, 2)]}


# --- degraded_slots / assignment_json ----------------------------------------


def test_degraded_slots_describe_covered_slots():
    assert degraded_slots(POLICIES["neighbor"].assign(n_slots=4, live={0, 3}, micro_batch=MB), 4) == [
        {"slot": 1, "workers": [3], "mode": "approx", "rows": [[0, 8]]},
        {"slot": 2, "workers": [3], "mode": "approx", "rows": [[0, 8]]},
    ]
    assert degraded_slots(POLICIES["spread"].assign(n_slots=4, live={0, 1, 3}, micro_batch=MB), 4) == [
        {"slot": 2, "workers": [1, 3, 0], "mode": "exact", "rows": [[0, 3], [3, 6], [6, 8]]},
    ]
    assert degraded_slots(POLICIES["spread"].assign(n_slots=4, live=range(4), micro_batch=MB), 4) == []
    mixed = {0: [W(0), W(1, 0, 4)], 2: [W(2), A(1, 4, 8)]}
    assert degraded_slots(mixed, 4) == [{"slot": 1, "workers": [0, 2], "mode": "mixed", "rows": [[0, 4], [4, 8]]}]


def test_assignment_json():
    got = assignment_json(POLICIES["neighbor"].assign(n_slots=3, live={0, 2}, micro_batch=4))
    assert got == {"0": [[0, 0, 4, "exact"]], "2": [[2, 0, 4, "approx"], [1, 0, 4, "approx"]]}


# --- invariants over every live set --------------------------------------------


def _check_invariants(policy: str, n: int, live: tuple[int, ...], mb: int) -> None:
    got = POLICIES[policy].assign(n_slots=n, live=live, micro_batch=mb)
    assert sorted(got) == sorted(live)
    rows = Counter()
    for worker, items in got.items():
        assert items[0].slot == worker and items[0].rows == (0, mb), "own slot first and whole"
        for item in items:
            assert 0 <= item.rows[0] < item.rows[1] <= mb
            rows.update((item.slot, r) for r in range(*item.rows))
        if policy == "neighbor":
            assert {i.mode for i in items} == {"approx" if len(items) > 1 else "exact"}
        elif policy == "spread":
            assert all(i.mode == "exact" for i in items)
        else:
            assert items[0].mode == "exact" and all(i.mode == "approx" for i in items[1:])
    assert rows == Counter({(k, r): 1 for k in range(n) for r in range(mb)}), "every (slot, row) exactly once"
    covered = {d["slot"] for d in degraded_slots(got, n)}
    assert covered == set(range(n)) - set(live)


@pytest.mark.parametrize("n", [2, 3, 4, 5, 6])
@pytest.mark.parametrize("policy", POLICIES)
def test_every_row_covered_exactly_once(policy, n):
    for mb in (1, 3, 8):
        for size in range(1, n + 1):
            for live in itertools.combinations(range(n), size):
                _check_invariants(policy, n, live, mb)


# --- bad inputs ----------------------------------------------------------------


def test_no_live_worker_is_a_named_error():
    with pytest.raises(NoLiveWorker):
        POLICIES["neighbor"].assign(n_slots=4, live=[], micro_batch=MB)


@pytest.mark.parametrize("live", [[4], [0, -1], [0, 7]])
def test_live_ids_outside_slots(live):
    with pytest.raises(ValueError, match=r"outside \[0, 4\)"):
        POLICIES["spread"].assign(n_slots=4, live=live, micro_batch=MB)


@pytest.mark.parametrize("kwargs", [{"n_slots": 0, "micro_batch": MB}, {"n_slots": 4, "micro_batch": 0}])
def test_bad_sizes(kwargs):
    with pytest.raises(ValueError):
        POLICIES["neighbor"].assign(live=[0], **kwargs)


# --- several slots per worker (train.global_batch) ------------------------------


def test_home_slots_go_round_robin_and_nothing_else_when_all_live():
    got = POLICIES["spread"].assign(n_slots=8, live=range(3), micro_batch=MB, n_workers=3)
    assert got == {0: [W(0), W(3), W(6)], 1: [W(1), W(4), W(7)], 2: [W(2), W(5)]}


def test_neighbor_covers_every_home_slot_of_a_dead_worker_and_approximates_its_own():
    # 3 workers, 6 slots; worker 1 (slots 1, 4) dead: its ring successor 2 covers both
    got = POLICIES["neighbor"].assign(n_slots=6, live={0, 2}, micro_batch=MB, n_workers=3)
    assert got == {0: [W(0), W(3)], 2: [A(2), A(5), A(1), A(4)]}


def test_spread_approx_is_exact_only_on_the_home_worker():
    got = POLICIES["spread-approx"].complete(n_slots=4, micro_batch=2, live=[0, 1], n_workers=2,
                                              done={0: [W(0, 0, 2), W(2, 0, 1)], 1: [W(1, 0, 2), W(3, 0, 2)]})
    assert got == {0: [SlotWork(2, (1, 2), "exact")], 1: []}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("n_workers, n_slots", [(2, 8), (3, 7), (4, 8)])
def test_several_slots_per_worker_cover_every_row_once_for_every_live_subset(policy, n_workers, n_slots):
    for r in range(1, n_workers + 1):
        for live in itertools.combinations(range(n_workers), r):
            got = POLICIES[policy].assign(n_slots=n_slots, live=live, micro_batch=3, n_workers=n_workers)
            rows = Counter((it.slot, row) for items in got.values() for it in items for row in range(*it.rows))
            assert rows == Counter({(k, row): 1 for k in range(n_slots) for row in range(3)}), (live, got)
            for w in live:  # its home slots first, whole
                assert [it.slot for it in got[w][:len(range(w, n_slots, n_workers))]] == list(range(w, n_slots, n_workers))


def test_fewer_slots_than_workers_is_refused():
    with pytest.raises(ValueError, match=r"n_slots=2 must be an integer >= n_workers=3"):
        POLICIES["spread"].assign(n_slots=2, live=[0], micro_batch=MB, n_workers=3)


def test_degraded_lists_the_dead_workers_home_slots():
    from unbroken.mecefo.takeover import degraded_homes

    assert degraded_homes(8, 4, [0, 2, 3]) == [1, 5]
    got = POLICIES["spread"].assign(n_slots=4, live=[0], micro_batch=2, n_workers=2)
    assert [d["slot"] for d in degraded_slots(got, 4, 2)] == [1, 3]
