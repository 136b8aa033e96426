"""The straggler decision and the rebalanced assignment: exact expectations, every row once."""

from __future__ import annotations

import itertools
from collections import Counter

import pytest

from unbroken.config import load_config
from unbroken.mecefo.gradients import SlotWork
from unbroken.mecefo.takeover import POLICIES, rebalance
from unbroken.runtime.stragglers import Stragglers

pytestmark = pytest.mark.timeout(60)


def test_a_slow_worker_keeps_the_first_rows_and_the_others_split_the_rest_exact():
    plan = POLICIES["neighbor"].assign(n_slots=4, live=range(4), micro_batch=8, n_workers=4)
    got = rebalance(plan, {1: 3}, n_workers=4, micro_batch=8)
    assert got[1] == [SlotWork(1, (0, 3))]
    moved = sorted((w, it.rows) for w in (0, 2, 3) for it in got[w][1:])
    # split_rows(5, 3) = (0,2) (2,4) (4,5) of rows 3..8, from position 1 * 5 % 3 = 2 of [0, 2, 3], around
    assert moved == [(0, (5, 7)), (2, (7, 8)), (3, (3, 5))]
    assert all(it.mode == "exact" for items in got.values() for it in items)


@pytest.mark.parametrize("policy", list(POLICIES))
def test_rebalanced_plans_cover_every_row_once(policy):
    n_workers, n_slots, mb = 4, 8, 5
    for live in (range(4), (0, 2, 3), (1, 3)):
        plan = POLICIES[policy].assign(n_slots=n_slots, live=live, micro_batch=mb, n_workers=n_workers)
        for slow in itertools.combinations(live, 1):
            for keep in range(1, mb + 1):
                got = rebalance(plan, {slow[0]: keep}, n_workers=n_workers, micro_batch=mb)
                rows = Counter((it.slot, r) for items in got.values() for it in items for r in range(*it.rows))
                assert rows == Counter({(k, r): 1 for k in range(n_slots) for r in range(mb)}), (live, slow, keep)


def _feed(s: Stragglers, per_row, steps, gen=0, start=0, members=(0, 1, 2, 3)):
    for step in range(start, start + steps):
        s.observe(gen, step, members, per_row, leader=True)


def test_a_worker_twice_as_slow_for_n_steps_keeps_its_share_and_comes_back_after_n_normal_ones():
    events = []
    s = Stragglers(n_workers=4, n_slots=4, micro_batch=8, factor=1.5, steps=3,
                   on_event=lambda name, **f: events.append((name, f)))
    _feed(s, [1.0, 9.0, 1.0, 1.0], 3)  # the view's first N = 3 steps: not counted, however slow
    assert s.keep(0, range(4)) == {} and events == []
    _feed(s, [1.0, 2.0, 1.0, 1.0], 2, start=3)
    assert s.keep(0, range(4)) == {}, "two steps slow are not yet N = 3"
    _feed(s, [1.0, 2.0, 1.0, 1.0], 1, start=5)
    # speeds 1, 0.5, 1, 1: its share of 32 rows is 32 * 0.5 / 3.5 = 4.57 -> 4 rows of its slot
    assert s.keep(0, range(4)) == {1: 4}
    assert events == [("straggler", {"slow": 1, "step": 6, "gen": 0, "ratio": 2.0})]
    # then back to normal: its smoothed time falls, its share grows; once at or below (1 + 1.5) / 2 for 3 steps
    # it keeps all again. Moved: 8 - keep for every step run with a keep.
    moved = 0
    for step, per_row in enumerate([[1.0, 2.0, 1.0, 1.0]] * 2 + [[1.0] * 4] * 20, start=6):
        moved += 8 - s.keep(0, range(4)).get(1, 8)
        s.observe(0, step, range(4), per_row, leader=True)
    assert s.keep(0, range(4)) == {}
    name, fields = events[-1]
    assert name == "straggler_end" and fields["slow"] == 1 and fields["why"] == "caught up"
    assert fields["rows_moved"] == moved and fields["since"] == 6 and moved > 8


def test_a_view_change_starts_over_and_a_member_not_in_the_view_keeps_nothing():
    s = Stragglers(n_workers=4, n_slots=8, micro_batch=4, factor=1.5, steps=1)
    _feed(s, [1.0, 1.0, 3.0, 1.0], 2)  # the view's first step is not counted (N = 1)
    assert s.keep(0, range(4)) == {2: 1}  # 32 rows * (1/3) / (3 + 1/3) / 2 home slots = 1.6 -> 1
    assert s.keep(1, range(4)) == {}, "another view: nothing decided yet"
    assert s.keep(0, (0, 1, 3)) == {}
    _feed(s, [1.0, 1.0, 3.0, 1.0], 1, gen=1, start=2)
    assert s.keep(1, range(4)) == {}, "the new view's first step is not counted"
    _feed(s, [1.0, 1.0, 3.0, 1.0], 1, gen=1, start=3)
    assert s.keep(1, range(4)) == {2: 1}


@pytest.mark.parametrize("overrides, message", [
    (["fault.straggler_factor=1"], "fault.straggler_factor=1.0: must be 0 (off) or a number > 1"),
    (["fault.straggler_factor=0.5"], "fault.straggler_factor=0.5: must be 0 (off) or a number > 1"),
    (["fault.straggler_factor=1.5", "fault.straggler_steps=0"], "fault.straggler_steps=0: must be >= 1"),
    (["fault.straggler_factor=1.5", "train.shard_degree=2"],
     "stragglers are not rebalanced under HSDP; give fault.straggler_factor=0"),
])
def test_thresholds_that_would_flag_everyone_are_refused(overrides, message):
    with pytest.raises(ValueError) as err:
        load_config(overrides=overrides)
    assert message in str(err.value)
