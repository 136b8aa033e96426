"""``TakeoverPolicy.complete`` after a mid-step view change: hand-computed plans and exactly-once coverage."""

from __future__ import annotations

import itertools

import pytest

from unbroken.mecefo.gradients import SlotWork
from unbroken.mecefo.takeover import POLICIES, missing_rows

pytestmark = pytest.mark.timeout(60)
MB = 8


def own(*workers: int) -> dict[int, list[SlotWork]]:
    return {w: [SlotWork(w, (0, MB))] for w in workers}


def test_neighbor_gives_dead_slot_to_ring_successor_approximated():
    extra = POLICIES["neighbor"].complete(n_slots=4, micro_batch=MB, live=[0, 2, 3], done=own(0, 2, 3))
    assert extra == {0: [], 2: [SlotWork(1, (0, MB), "approx")], 3: []}


def test_neighbor_wraps_around_and_skips_dead_successor():
    # slots 2 and 3 dead: both go to worker 0 (ring successor of 3 is 0, of 2 is 3 -> dead -> 0)
    extra = POLICIES["neighbor"].complete(n_slots=4, micro_batch=MB, live=[0, 1], done=own(0, 1))
    assert extra[0] == [SlotWork(2, (0, MB), "approx"), SlotWork(3, (0, MB), "approx")]
    assert extra[1] == []


def test_spread_splits_rows_evenly_exact():
    # split_rows(8, 3): the first ranges get the spare rows, as in assign, from position 2 * 8 % 3 = 1
    extra = POLICIES["spread"].complete(n_slots=4, micro_batch=MB, live=[0, 1, 3], done=own(0, 1, 3))
    assert extra == {0: [SlotWork(2, (6, 8))], 1: [SlotWork(2, (0, 3))], 3: [SlotWork(2, (3, 6))]}


def test_spread_approx_marks_extra_rows_approx():
    extra = POLICIES["spread-approx"].complete(n_slots=3, micro_batch=MB, live=[1, 2], done=own(1, 2))
    assert extra == {1: [SlotWork(0, (0, 4), "approx")], 2: [SlotWork(0, (4, 8), "approx")]}


def test_partial_work_of_a_dead_coverer_is_recomputed_only_where_missing():
    # worker 3 covered rows 0..4 of slot 1 then died; worker 2 had rows 4..8 of slot 1.
    done = {0: [SlotWork(0, (0, MB))], 2: [SlotWork(2, (0, MB)), SlotWork(1, (4, 8))]}
    extra = POLICIES["neighbor"].complete(n_slots=4, micro_batch=MB, live=[0, 2], done=done)
    assert extra == {0: [SlotWork(3, (0, MB), "approx")], 2: [SlotWork(1, (0, 4), "approx")]}


def test_joiner_with_nothing_computes_its_own_slot_exactly():
    done = {0: [SlotWork(0, (0, MB)), SlotWork(1, (0, MB), "approx")], 1: [], 2: [SlotWork(2, (0, MB))]}
    extra = POLICIES["neighbor"].complete(n_slots=3, micro_batch=MB, live=[0, 1, 2], done=done)
    assert extra == {0: [], 1: [], 2: []}
    done = {0: [], 1: [], 2: [SlotWork(2, (0, MB))]}  # the leader admitted 1 before computing
    extra = POLICIES["neighbor"].complete(n_slots=3, micro_batch=MB, live=[0, 1, 2], done=done)
    assert extra == {0: [SlotWork(0, (0, MB))], 1: [SlotWork(1, (0, MB))], 2: []}


@pytest.mark.parametrize("policy", list(POLICIES))
@pytest.mark.parametrize("n", [2, 3, 5])
def test_every_row_exactly_once_for_every_live_set(policy, n):
    for k in range(1, n + 1):
        for live in itertools.combinations(range(n), k):
            done = own(*live)
            done_5 = {w: [SlotWork(w, (0, 5))] for w in live}
            extra = POLICIES[policy].complete(n_slots=n, micro_batch=5, live=live, done=done_5)
            merged = {w: done[w][:1] + extra[w] for w in live}
            for w in merged:
                for item in merged[w]:
                    if item.slot == w:
                        assert item.mode == "exact"
            merged_items = {w: [SlotWork(i.slot, i.rows) for i in items] for w, items in merged.items()}
            assert missing_rows(n, 5, merged_items) == {}, (policy, live)


def test_bad_input():
    with pytest.raises(ValueError, match="no live worker"):
        POLICIES["spread"].complete(n_slots=2, micro_batch=MB, live=[], done={})
    with pytest.raises(ValueError, match="computed twice"):
        missing_rows(2, MB, {0: [SlotWork(0, (0, 5))], 1: [SlotWork(0, (4, 8))]})
