"""The takeover policy registry, one split rule for assign and complete, assign = home slots + complete."""

from __future__ import annotations

import itertools
import re

import pytest

from unbroken.mecefo.gradients import SlotWork
from unbroken.mecefo.takeover import (
    POLICIES,
    NeighborPolicy,
    SpreadApproxPolicy,
    SpreadPolicy,
    TakeoverPolicy,
    takeover_policy,
)

pytestmark = pytest.mark.timeout(60)

MB = 7  # odd rows over 3 workers: split_rows(7, 3) = (0, 3) (3, 5) (5, 7), the first range gets the spare row


def E(slot: int, a: int = 0, b: int = MB) -> SlotWork:
    return SlotWork(slot=slot, rows=(a, b), mode="exact")


def A(slot: int, a: int = 0, b: int = MB) -> SlotWork:
    return SlotWork(slot=slot, rows=(a, b), mode="approx")


# --- registry --------------------------------------------------------------------


def test_registry_names_in_order():
    assert list(POLICIES) == ["neighbor", "spread", "spread-approx"]
    assert [type(p) for p in POLICIES.values()] == [NeighborPolicy, SpreadPolicy, SpreadApproxPolicy]
    for name, policy in POLICIES.items():
        assert isinstance(policy, TakeoverPolicy) and policy.name == name
        assert takeover_policy(name) is policy


def test_unknown_policy_lists_valid_ones():
    msg = "unknown takeover policy 'nope'; valid policies: neighbor, spread, spread-approx"
    with pytest.raises(ValueError, match=re.escape(msg)):
        takeover_policy("nope")


# --- neighbor --------------------------------------------------------------------


def test_neighbor_assign():
    # dead 1 -> ring successor 2; dead 4 -> wraps to 0; both coverers approximate their own slot
    got = NeighborPolicy().assign(n_slots=5, live={0, 2, 3}, micro_batch=MB)
    assert got == {0: [A(0), A(4)], 2: [A(2), A(1)], 3: [E(3)]}


def test_neighbor_complete_keeps_a_missing_range_whole():
    # 4 rows of slot 1 missing go to its home worker 1, exact; slot 2 (dead) wraps to worker 0, approx
    done = {0: [E(0)], 1: [E(1, 0, 3)]}
    got = NeighborPolicy().complete(n_slots=3, micro_batch=MB, live=[0, 1], done=done)
    assert got == {0: [A(2)], 1: [E(1, 3, MB)]}


# --- spread ----------------------------------------------------------------------


def test_spread_assign_starts_each_slot_at_its_own_worker():
    # slot 2's 7 rows: split_rows(7, 3) = (0, 3) (3, 5) (5, 7), the first range to position 2 * 7 % 3 = 2 of
    # the live workers [0, 1, 3], i.e. worker 3, then on around the ring
    got = SpreadPolicy().assign(n_slots=4, live={0, 1, 3}, micro_batch=MB)
    assert got == {0: [E(0), E(2, 3, 5)], 1: [E(1), E(2, 5, 7)], 3: [E(3), E(2, 0, 3)]}


def test_spread_complete_splits_the_missing_range_the_same_way():
    # rows 3..8 of slot 2 missing: split_rows(5, 3) = (0, 2) (2, 4) (4, 5), shifted by 3, from position 2 * 5 % 3 = 1
    done = {0: [E(0, 0, 8), E(2, 0, 3)], 1: [E(1, 0, 8)], 3: [E(3, 0, 8)]}
    got = SpreadPolicy().complete(n_slots=4, micro_batch=8, live=[0, 1, 3], done=done)
    assert got == {0: [E(2, 7, 8)], 1: [E(2, 3, 5)], 3: [E(2, 5, 7)]}


def test_spread_puts_a_lost_nodes_slots_on_different_survivors():
    # 8 consecutive slots of 4 rows dead among 1,000: each survivor computes at most one extra row
    got = SpreadPolicy().assign(n_slots=1000, live=set(range(8, 1000)), micro_batch=4)
    extra = [sum(i.rows[1] - i.rows[0] for i in items if i.slot != w) for w, items in got.items()]
    assert max(extra) == 1 and sum(extra) == 32


# --- spread-approx ---------------------------------------------------------------


def test_spread_approx_assign():
    got = SpreadApproxPolicy().assign(n_slots=5, live={1, 2, 4}, micro_batch=MB)
    assert got == {
        1: [E(1), A(0, 0, 3), A(3, 0, 3)],
        2: [E(2), A(0, 3, 5), A(3, 3, 5)],
        4: [E(4), A(0, 5, 7), A(3, 5, 7)],
    }


def test_spread_approx_complete_home_worker_exact():
    # worker 1 joined before computing: its slot is split over all three, its own share exact
    done = {0: [E(0)], 1: [], 2: [E(2)]}
    got = SpreadApproxPolicy().complete(n_slots=3, micro_batch=MB, live=[0, 1, 2], done=done)
    assert got == {0: [A(1, 5, 7)], 1: [E(1, 0, 3)], 2: [A(1, 3, 5)]}


# --- one mechanism ---------------------------------------------------------------


@pytest.mark.parametrize("name", list(POLICIES))
def test_assign_is_home_slots_plus_complete(name):
    policy = POLICIES[name]
    for size in range(1, 6):
        for live in itertools.combinations(range(5), size):
            got = policy.assign(n_slots=5, live=[*reversed(live), live[0]], micro_batch=MB)
            extra = policy.complete(n_slots=5, micro_batch=MB, live=live, done={w: [E(w)] for w in live})
            # neighbor: a covering worker computes its own slot approximated too (MeCeFO Alg. 1)
            home = {w: A(w) if name == "neighbor" and extra[w] else E(w) for w in live}
            assert got == {w: [home[w], *extra[w]] for w in live}, live
