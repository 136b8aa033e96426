"""Snapshots at any node count: the nodes coded in groups of at most ``snapshot.group_nodes``.

The coder (pyeclib's ISA-L Reed-Solomon) codes at most 256 fragments of a
stripe, one a node: a job on 257 nodes or more is split into groups, each
coding its own stripes with ``parity`` parity fragments. The plans of 300,
1,000 and 12,500 nodes are checked whole (structure, assignment, every
group's coder built by the real library); coding and rebuilding are exercised
with the real coder on groups of the default size; a restore across two
groups runs on real shared memory with nodes lost, one per group.
"""

from __future__ import annotations

import itertools
import logging
import os
import random
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import pytest
import torch

from unbroken.config import load_config, preset
from unbroken.store.view import View
from unbroken.snapshot.erasure import MAX_FRAGMENTS, Coding
from unbroken.snapshot.plan import GROUP_NODES, SnapshotPlan, complete_steps, plan_for
from unbroken.snapshot.protection import announce, check_coding, protection
from unbroken.snapshot.restore import decide, inventory, restore_from_memory
from unbroken.snapshot.segment import remove_segments
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of
from _snapshot_state import ThreadBroadcasts, trained_state

pytestmark = pytest.mark.timeout(120)


def _whole_job(nodes: int, per_node: int) -> dict[int, int]:
    return {w: w // per_node for w in range(nodes * per_node)}


@pytest.mark.parametrize(("nodes", "parity"), [(300, 1), (1_000, 2), (12_500, 1)])
def test_a_plan_of_thousands_of_nodes_codes_every_stripe_within_the_coders_limit(nodes, parity):
    per_node = 2
    node_of = _whole_job(nodes, per_node)
    plan = plan_for(node_of, node_of, redundancy="parity", parity=parity, state_bytes=3 << 30)
    groups = -(-nodes // GROUP_NODES)
    assert len(plan.groups) == groups and plan.protected and plan.m == parity
    sizes = sorted(len(g) for g in plan.groups)
    assert sizes[-1] <= GROUP_NODES and sizes[-1] - sizes[0] <= 1 and sizes[0] > GROUP_NODES // 2 - 1
    assert sorted(n for g in plan.groups for n in g) == list(range(nodes))  # a partition of the nodes
    assert plan.stripes % (groups * per_node) == 0 and plan.group_stripes % per_node == 0
    for stripe in range(plan.stripes):  # each stripe: its group's k + m fragments, one a node of the group
        group = plan.groups[plan.group_of(stripe)]
        assert plan.k_of(stripe) + plan.m == len(group) <= MAX_FRAGMENTS
        held = [f for node in group for f in plan.fragments_of(node, stripe)]
        assert sorted(held) == list(range(len(group)))
    other = plan.groups[1][0]
    assert plan.fragments_of(other, 0) == [] and 0 not in plan.stripes_of(other)
    # Every fragment written by exactly one worker, each worker of a node about the same share.
    assignment = plan.assignment(node_of, node_of)
    written = [sf for frags in assignment.values() for sf in frags]
    assert len(written) == len(set(written)) == sum(plan.k_of(s) + plan.m for s in range(plan.stripes))
    assert {len(frags) for frags in assignment.values()} == {plan.group_stripes // per_node}
    assert SnapshotPlan.from_json(plan.to_json()) == plan
    for size in set(sizes):  # the real library builds every group's coder
        assert Coding(size - parity, parity).chunk(1 << 20) > 0


def test_up_to_group_nodes_the_plan_is_the_one_of_a_job_without_groups():
    node_of = _whole_job(3, 2)
    plan = plan_for(node_of, node_of, redundancy="parity", parity=1, state_bytes=6_000_000)
    assert plan.groups == ((0, 1, 2),) and (plan.k, plan.m, plan.stripes) == (2, 1, 2)
    assert plan.assignment(node_of, node_of) == {0: [(0, 0)], 1: [(1, 1)], 2: [(0, 1)], 3: [(1, 2)],
                                                  4: [(0, 2)], 5: [(1, 0)]}
    at_most = _whole_job(GROUP_NODES, 1)
    assert len(plan_for(at_most, at_most, redundancy="parity", parity=1, state_bytes=100).groups) == 1
    replica = _whole_job(300, 1)  # no coder limit without parity: one group, as ever
    assert plan_for(replica, replica, redundancy="replica", parity=1, state_bytes=100).groups == (tuple(range(300)),)


@pytest.mark.parametrize("parity", [1, 2, 4])
def test_a_stripe_of_a_group_decodes_with_any_parity_fragments_lost(parity):
    """A group of the default size, the real coder: every choice of ``parity`` lost fragments (data and parity
    alike) leaves the stripe decodable, exactly."""
    node_of = _whole_job(40, 1)  # 3 groups of 14, 13 and 13 nodes
    plan = plan_for(node_of, node_of, redundancy="parity", parity=parity, state_bytes=3 * 50_001)
    assert sorted(len(g) for g in plan.groups) == [13, 13, 14]
    stripe = plan.stripes_of(plan.groups[0][0])[0]
    lo, hi = plan.stripe_range(stripe)
    data = os.urandom(hi - lo)
    coding = plan.coding(stripe)
    k = plan.k_of(stripe)
    chunk = coding.chunk(len(data))
    raw = data.ljust(k * chunk, b"\0")
    parity_frags, headers = coding.parity(data, list(range(k, k + parity)))
    fragments = {i: raw[i * chunk:(i + 1) * chunk] for i in range(k)} | parity_frags
    for lost in itertools.combinations(range(k + parity), parity):
        left = {i: f for i, f in fragments.items() if i not in lost}
        assert coding.decode(left, len(data), headers) == data, lost


@pytest.mark.parametrize(("k", "m", "lost"), [(11, 5, (0, 2, 5, 12, 13)), (28, 4, None)])
def test_any_k_fragments_decode_even_where_a_vandermonde_code_cannot(k, m, lost):
    """ISA-L's Vandermonde code cannot rebuild from these losses (its generator has singular submatrices); the
    snapshot's coder must: a group of 16 nodes with parity 5, and of 32 with parity 4, survive any such loss."""
    data = os.urandom(6_000)
    coding = Coding(k, m)
    chunk = coding.chunk(len(data))
    raw = data.ljust(k * chunk, b"\0")
    parity, headers = coding.parity(data, list(range(k, k + m)))
    fragments = {i: raw[i * chunk:(i + 1) * chunk] for i in range(k)} | parity
    rng = random.Random(7)
    choices = [lost] if lost else [tuple(rng.sample(range(k + m), m)) for _ in range(3_000)]
    for gone in choices:
        left = {i: f for i, f in fragments.items() if i not in gone}
        assert coding.decode(left, len(data), headers) == data, gone


EIGHT = {w: w for w in range(8)}
"""Eight nodes of one worker each; with ``group_nodes = 4`` two groups, nodes [0, 2, 4, 6] and [1, 3, 5, 7]."""


def _snapshot_in_two_groups(job_id: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    snaps = [Snapshotter(job_id=job_id, node=w, worker=w, node_of=EIGHT, every=1, redundancy="parity", parity=1,
                         group_nodes=4, config_hash="cfg", state=lambda: tensors_of(model, optimizer),
                         on_event=lambda name, **f: None) for w in EIGHT]
    for s in snaps:
        s.take(1, View(gen=2, members=tuple(EIGHT), step=1))
    for s in snaps:
        s.close()


def _spec(job_id: str, live: list[int]) -> dict | None:
    invs = [inventory(job_id, n, config_hash="cfg") for n in live]
    return decide(invs, checkpoint=None, members_of=lambda nodes: sorted(nodes))


def _restore(job_id: str, spec: dict, members: tuple[int, ...], me: int,
             broadcast: Callable[[torch.Tensor, int], None]) -> tuple[dict[str, torch.Tensor], dict]:
    model, optimizer = trained_state(seed=99)  # another state: the restore must overwrite every byte
    stats = restore_from_memory(spec, job=job_id, node=me, node_of=EIGHT, members=members, me=me,
                                broadcast=broadcast, model=model, optimizer=optimizer, device=torch.device("cpu"))
    return tensors_of(model, optimizer), stats


def test_a_restore_rebuilds_each_stripe_within_its_group_one_node_lost_in_each(job_id):
    model, optimizer = trained_state(seed=1)
    _snapshot_in_two_groups(job_id, model, optimizer)
    whole = _spec(job_id, list(range(8)))
    plan = SnapshotPlan.from_json(whole["plan"])
    assert plan.groups == ((0, 2, 4, 6), (1, 3, 5, 7)) and plan.stripes == 2
    for stripe, _, node, _ in whole["holders"]:  # a stripe's fragments live on its group's nodes only
        assert node in plan.groups[plan.group_of(stripe)]
    # Node 2 held data fragment 1 of stripe 0 (group 0), node 7 data fragment 0 of stripe 1 (group 1).
    for lost in (2, 7):
        remove_segments(job_id, node=lost)
    live = [0, 1, 3, 4, 5, 6]
    spec = _spec(job_id, live)
    assert spec is not None and spec["step"] == 1 and spec["parity_stripes"] == [0, 1]
    members = tuple(live)
    group = ThreadBroadcasts(len(members))
    with ThreadPoolExecutor(len(members)) as pool:
        futures = [pool.submit(_restore, job_id, spec, members, w, group.of(rank)) for rank, w in enumerate(members)]
        results = [f.result(timeout=90) for f in futures]
    want = tensors_of(model, optimizer)
    for got, stats in results:
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert stats["rebuilt"] == 2  # each stripe from its own group's parity
    # A second node lost in one group (node 4, group 0): that group's stripe is gone, whatever the other holds.
    remove_segments(job_id, node=4)
    assert _spec(job_id, [0, 1, 3, 5, 6]) is None
    assert complete_steps([s for n in (0, 1, 3, 5, 6) for s in inventory(job_id, n)["seals"]]) == []


def test_group_settings_the_coder_cannot_build_are_refused_naming_the_field_and_range():
    with pytest.raises(ValueError, match=r"snapshot.group_nodes=257: must be a number of nodes in 2\.\.256"):
        load_config(preset_name="debug", overrides=["snapshot.group_nodes=257"])
    with pytest.raises(ValueError, match=r"snapshot.group_nodes=8 is too small for snapshot.parity=4: .* set "
                                         r"snapshot.group_nodes in 10\.\.256 or snapshot.parity <= 3"):
        load_config(preset_name="debug", overrides=["snapshot.group_nodes=8", "snapshot.parity=4"])
    assert load_config(preset_name="debug").snapshot.group_nodes == GROUP_NODES
    assert load_config(preset_name="debug", overrides=["snapshot.group_nodes=256"]).snapshot.group_nodes == 256
    cfg = preset("debug")
    cfg.snapshot.group_nodes = 300  # past validation (a config built in code): refused at the start
    with pytest.raises(ValueError, match=r"snapshot.group_nodes=300: must be in 1\.\.256"):
        check_coding(cfg, nodes=400, workers_per_node=1)
    assert {len(g) for g in check_coding(preset("debug"), nodes=12_500, workers_per_node=1).groups} == {15, 16}


def test_the_start_says_what_each_group_survives_or_loudly_that_nothing_is_protected(tmp_path, caplog):
    said = protection(preset("debug"), nodes=300, workers_per_node=8)
    assert said["protected"] and said["groups"] == 19 and said["group_sizes"] == [15, 16]
    assert said["tolerates_per_group"] == 1
    assert "300 nodes in 19 coding group(s) of 15-16 nodes" in said["message"]
    assert "each group survives the loss of up to 1 of its nodes" in said["message"]
    bare = load_config(preset_name="debug", overrides=["snapshot.redundancy=none"])
    with caplog.at_level(logging.INFO, logger="unbroken.snapshot.protection"):
        event = announce(bare, tmp_path, nodes=4, workers_per_node=2)
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "do NOT protect this job against a node loss" in warned[0].getMessage()
    assert not event["protected"] and "snapshot.redundancy=none" in event["reason"]
    from unbroken.runtime.ledger import read_events

    (recorded,) = [e for e in read_events(tmp_path) if e.get("event") == "snapshot_protection"]
    assert recorded["protected"] is False and recorded["message"] == event["message"]
    off = protection(load_config(preset_name="debug", overrides=["snapshot.every=0"]), 4, 2)
    assert not off["snapshots"] and not off["protected"] and "snapshot.every=0" in off["reason"]
