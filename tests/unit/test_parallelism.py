"""Where a worker stands (:mod:`unbroken.sharding.parallelism`): one object built from the config answers every
question the worker and the step protocol ask about replicas, shards, the work plan and the state's layout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from unbroken.config import load_config
from unbroken.mecefo.takeover import takeover_policy
from unbroken.sharding.hsdp import ReplicaPlan
from unbroken.sharding.layout import ShardedModel, StateLayout
from unbroken.sharding.parallelism import ReplicaLayout, kind_of, parallelism_for
from unbroken.sharding.work_plan import SlotPlan


def _cfg(*overrides: str):
    return load_config(overrides=["train.workers=4", *overrides])


def test_the_kind_comes_from_the_config():
    assert kind_of(_cfg()) == "replicated"
    assert kind_of(_cfg("train.shard_optimizer=true")) == "zero1"
    assert kind_of(_cfg("train.shard_degree=2")) == "hsdp"


def test_a_replicated_worker_is_a_replica_of_its_own_holding_the_whole_state():
    p = parallelism_for(_cfg(), 4, 3)
    assert (p.kind, p.hsdp, p.zero1, p.replica, p.index, p.shard) == ("replicated", False, False, 3, 0, (0, 1))
    assert p.same_replica(3, 3) and not p.same_replica(3, 2)
    assert p.holders((0, 1, 3)) == (0, 1, 3)
    assert not p.checkpoints_by_steps and not p.writes_parts
    assert p.checkpoint_stage(7, 3) == 7
    plan = p.plan(takeover_policy("spread"), n_slots=4, micro_batch=2)
    assert isinstance(plan, SlotPlan) and plan.peers(3, (0, 1, 3)) == ("", (0, 1, 3))
    assert plan.shard_index(3) == 0
    assert type(p.state_layout(SimpleNamespace(), node_of={}, replica_store=_no_store, on_event=print)) is StateLayout


def test_an_hsdp_worker_knows_its_replica_shard_and_the_holders_of_its_shard_index():
    p = parallelism_for(_cfg("train.shard_degree=2"), 4, 3)
    assert (p.kind, p.hsdp, p.replica, p.index, p.shard, p.shard_degree) == ("hsdp", True, 1, 1, (1, 2), 2)
    assert p.replicas == ReplicaLayout(4, 2)
    assert p.same_replica(2, 3) and not p.same_replica(1, 2)
    assert p.holders((0, 1, 2, 3)) == (1, 3)
    assert p.checkpoints_by_steps and p.writes_parts
    assert p.checkpoint_stage(7, 2) == "7w2"
    plan = p.plan(takeover_policy("spread"), n_slots=4, micro_batch=2)
    assert isinstance(plan, ReplicaPlan) and plan.peers(3, (0, 1, 2, 3)) == (".i1", (1, 3))
    assert plan.shard_index(3) == 1
    layout = p.state_layout(SimpleNamespace(), node_of={}, replica_store=_no_store, on_event=print)
    assert isinstance(layout, ShardedModel) and (layout.index, layout.shard_degree) == (1, 2)


def test_a_zero1_worker_checkpoints_by_steps_and_writes_its_range():
    p = parallelism_for(_cfg("train.shard_optimizer=true"), 4, 1)
    assert (p.kind, p.zero1, p.shard) == ("zero1", True, (0, 1))
    assert p.checkpoints_by_steps and p.writes_parts and p.checkpoint_stage(5, 1) == 5
    with pytest.raises(TypeError, match="ShardedAdamW"):  # its layout is ZeRO-1's, over the job's optimizer
        p.state_layout(SimpleNamespace(optimizer=None), node_of={}, replica_store=lambda: None, on_event=print)


def _no_store():
    raise AssertionError("only ZeRO-1 keeps ring copies")
