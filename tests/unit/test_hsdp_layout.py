"""The HSDP layout: replicas, shard indices, the shapes refused, and FSDP2's chunk rule."""

from __future__ import annotations

import re

import pytest

from unbroken.config import load_config
from unbroken.mecefo.gradients import SlotWork
from unbroken.mecefo.takeover import takeover_policy
from unbroken.sharding.hsdp import (ReplicaLayout, ReplicaPlan, check_layout, local_rows, replica_assignment,
                                    replica_completion, shard_bytes)


def test_replicas_are_consecutive_workers_and_a_death_takes_its_replica():
    layout = ReplicaLayout(workers=8, shard_degree=4)
    assert layout.replicas == 2
    assert [layout.replica_of(w) for w in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    assert [layout.index_of(w) for w in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert layout.replica_members(1) == (4, 5, 6, 7)
    assert layout.shard_peers(2, [7, 6, 2, 0]) == (2, 6)
    assert layout.whole_replicas([5]) == {4, 5, 6, 7}
    assert layout.whole_replicas([0, 6]) == set(range(8))


@pytest.mark.parametrize("workers, per_node, k, message", [
    (8, 4, 0, "need at least 1"),
    (8, 4, 3, "does not divide train.workers=8"),
    (8, 2, 4, "does not divide the 2 workers per node: a replica's ranks must be on one node"),
])
def test_layouts_that_cut_a_replica_are_refused_with_the_fix(workers, per_node, k, message):
    with pytest.raises(ValueError, match=message):
        check_layout(workers, per_node, k)


def test_accepted_layouts():
    for workers, per_node, k in [(8, 4, 4), (8, 4, 2), (8, 4, 1), (4, 4, 4)]:
        check_layout(workers, per_node, k)


def test_fsdp2_chunks_dim_0_with_the_last_shards_shorter_or_empty():
    assert [local_rows(10, 4, i) for i in range(4)] == [3, 3, 3, 1]
    assert [local_rows(2, 4, i) for i in range(4)] == [1, 1, 0, 0]
    assert [local_rows(8, 1, 0)] == [8]
    # The most any index holds: index 0 of (10, 3) holds 3 rows x 3, of (5,) 2 elements.
    assert shard_bytes([(10, 3), (5,)], 4) == (9 + 2) * 4
    assert shard_bytes([(10, 3)], 4, element_bytes=2) == 18


@pytest.mark.parametrize("policy", ["spread", "neighbor", "spread-approx"])
def test_a_dead_replicas_slots_are_covered_per_shard_index_in_lockstep(policy):
    """3 replicas x 2 ranks, micro-batch 8; replica 1 is down (its rank 3 died: rank 2 goes with it)."""
    layout, mb = ReplicaLayout(workers=6, shard_degree=2), 8
    out = replica_assignment(takeover_policy(policy), layout, live=[0, 1, 2, 4, 5], micro_batch=mb)
    assert sorted(out) == [0, 1, 4, 5], "the replica of a dead rank computes nothing"
    rows = {s: [0] * mb for s in range(6)}
    for worker, items in out.items():
        assert items[0].slot == worker, "a worker's own slot first"
        for item in items:
            assert layout.index_of(item.slot) == layout.index_of(worker), "only slots of its own shard index"
            for row in range(*item.rows):
                rows[item.slot][row] += 1
    assert all(count == [1] * mb for count in rows.values()), "every (slot, row) exactly once"
    for r in (0, 2):  # the ranks of a replica: the same rows and modes, item by item
        a, b = out[2 * r], out[2 * r + 1]
        assert [(i.rows, i.mode) for i in a] == [(i.rows, i.mode) for i in b]
    # The same as the policy over replicas, slot by slot: nothing is invented.
    over = takeover_policy(policy).assign(n_slots=3, live=[0, 2], micro_batch=mb)
    assert [(i.slot * 2 + 1, i.rows, i.mode) for i in over[2]] == [(i.slot, i.rows, i.mode) for i in out[5]]


def test_with_every_replica_whole_each_worker_trains_its_own_slot():
    layout = ReplicaLayout(workers=4, shard_degree=2)
    out = replica_assignment(takeover_policy("spread"), layout, live=[0, 1, 2, 3], micro_batch=4)
    assert {w: [(i.slot, i.rows, i.mode) for i in items] for w, items in out.items()} == \
        {w: [(w, (0, 4), "exact")] for w in range(4)}


def test_a_step_interrupted_by_a_replicas_death_is_completed_by_the_others_per_shard_index():
    """2 replicas x 2 ranks, micro-batch 4: both computed their own slots, then replica 1 died (its slots'
    rows are lost): replica 0's rank i takes slot 2 + i, whole; nothing else moves."""
    layout, policy = ReplicaLayout(workers=4, shard_degree=2), takeover_policy("spread")
    done = {0: [SlotWork(0, (0, 4))], 1: [SlotWork(1, (0, 4))]}
    extra = replica_completion(policy, layout, live=[0, 1], micro_batch=4, done=done)
    assert {w: [(i.slot, i.rows, i.mode) for i in items] for w, items in extra.items()} == \
        {0: [(2, (0, 4), "exact")], 1: [(3, (0, 4), "exact")]}
    # 3 replicas, replica 2 lost: the two live ones split its rows, each rank in its own index's slot.
    layout = ReplicaLayout(workers=6, shard_degree=2)
    done = {w: [SlotWork(w, (0, 4))] for w in range(4)}
    extra = replica_completion(policy, layout, live=[0, 1, 2, 3], micro_batch=4, done=done)
    assert {w: [(i.slot, i.rows) for i in items] for w, items in extra.items()} == \
        {0: [(4, (0, 2))], 1: [(5, (0, 2))], 2: [(4, (2, 4))], 3: [(5, (2, 4))]}
    # A rank whose replica is not whole (its sibling is not live) gets nothing.
    extra = replica_completion(policy, layout, live=[0, 1, 2], micro_batch=4, done=done)
    assert extra[2] == [] and sorted(i.slot for i in extra[0] + extra[1]) == [2, 3, 4, 5]


def test_the_replica_plan_widens_deaths_admits_whole_replicas_and_groups_by_shard_index():
    plan = ReplicaPlan(takeover_policy("spread"), ReplicaLayout(workers=6, shard_degree=2), micro_batch=4)
    assert plan.widen({3}) == {2, 3} and plan.widen({0, 5}) == {0, 1, 4, 5}
    assert plan.admissible([2], members=[0, 1]) == [], "half a replica waits for its sibling"
    assert plan.admissible([3, 2, 5], members=[0, 1]) == [3, 2]
    assert plan.peers(3, [0, 1, 2, 3]) == (".i1", (1, 3))
    assert plan.peers(4, [0, 1, 4, 5]) == (".i0", (0, 4))
    assert plan.same_replica(4, 5) and not plan.same_replica(3, 4)
    assert [(i.slot, i.rows) for i in plan.assign(5, [0, 1, 4, 5])] == [(5, (0, 4)), (3, (2, 4))]


@pytest.mark.parametrize("override, message", [
    ("train.shard_degree=0", "train.shard_degree=0: must be >= 1"),
    ("train.shard_degree=3", "train.shard_degree=3 does not divide train.workers=4"),
    ("train.shard_optimizer=true", "FSDP2 already shards the moments inside each replica"),
    ("fault.recovery=restart", "HSDP runs with fault.recovery='takeover' only"),
])
def test_shard_degrees_and_settings_hsdp_cannot_run_are_refused(override, message):
    overrides = ["train.workers=4", "train.shard_degree=2", "mecefo.policy=spread", override]
    with pytest.raises(ValueError, match=re.escape(message)):
        load_config(preset_name="debug", overrides=overrides)


@pytest.mark.parametrize("policy", ["spread", "neighbor", "spread-approx"])
def test_several_micro_batches_per_rank_under_hsdp(policy):
    """2 replicas x 2 ranks, 8 slots a step (4 replica slots, 2 per replica): rank i of replica r trains
    slots 2j + i of its replica slots j = r, r + 2; a dead replica's replica slots go to the other, per shard
    index, every (slot, row) once."""
    layout, mb = ReplicaLayout(workers=4, shard_degree=2), 4
    whole = replica_assignment(takeover_policy(policy), layout, live=range(4), micro_batch=mb, n_slots=8)
    assert {w: [i.slot for i in items] for w, items in whole.items()} == {0: [0, 4], 1: [1, 5], 2: [2, 6], 3: [3, 7]}
    out = replica_assignment(takeover_policy(policy), layout, live=[2, 3], micro_batch=mb, n_slots=8)
    rows = {s: [0] * mb for s in range(8)}
    for worker, items in out.items():
        for item in items:
            assert layout.index_of(item.slot) == layout.index_of(worker)
            for row in range(*item.rows):
                rows[item.slot][row] += 1
    assert all(count == [1] * mb for count in rows.values()), "every (slot, row) exactly once"
    plan = ReplicaPlan(takeover_policy(policy), layout, mb, 8)
    assert plan.assign(3, [2, 3]) == out[3]
