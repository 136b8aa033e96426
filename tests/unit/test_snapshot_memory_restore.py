"""Restoring from snapshot memory: exact from a node's own memory, parity rebuilding a lost node, a corrupt
buffer's fallback, the plan's bytes, erasure coding, settings refused, and a joiner loading from its node."""

from __future__ import annotations

import os

import pytest
import torch

from _snapshot_jobs import restore_into, restore_spec, same_state, snapshot, trained
from unbroken.config import load_config, preset
from unbroken.runtime.ledger import check_ledger
from unbroken.snapshot.capacity import check_snapshot_config, node_bytes, state_bytes
from unbroken.snapshot.erasure import Coding, ErasureError
from unbroken.snapshot.plan import plan_for
from unbroken.snapshot.segment import SnapshotCorrupt, job_segments, remove_segments, segment_dir

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("redundancy", ["parity", "replica"])
def test_restore_from_own_memory_is_exact(job_id, redundancy):
    job = trained()
    snapshot(job_id, job, done=1, redundancy=redundancy)
    spec, _ = restore_spec(job_id)
    assert spec["source"] == "memory" and spec["step"] == 1
    restored, stats = restore_into(job_id, spec, node=0, me=0)
    assert same_state(job, restored)
    # Parity rotates over the nodes: node 0 holds stripe 0's data and stripe 1's parity.
    assert stats["local"] == 2 and stats["rebuilt"] == (1 if redundancy == "parity" else 0)


def test_parity_rebuilds_a_lost_node_exactly(job_id):
    job = trained()
    snapshot(job_id, job, done=1)
    remove_segments(job_id, node=0)  # node 0 and its memory are gone
    spec, _ = restore_spec(job_id, nodes=(1,))
    assert spec["members"] == [2, 3] and spec["parity_stripes"] == [0]  # stripe 1's data lives on node 1
    restored, stats = restore_into(job_id, spec, node=1, me=2)
    assert same_state(job, restored) and stats["rebuilt"] == 1


def test_no_redundancy_cannot_survive_a_lost_node(job_id):
    job = trained()
    snapshot(job_id, job, done=1, redundancy="none")
    spec, _ = restore_spec(job_id)  # complete only with both nodes: each holds one of the two pieces
    assert spec["step"] == 1 and {h[2] for h in spec["holders"]} == {0, 1}
    remove_segments(job_id, node=0)
    spec, _ = restore_spec(job_id, nodes=(1,), checkpoint=(0, "/ckpt/step-0"))
    assert spec == {"source": "checkpoint", "step": 0, "path": "/ckpt/step-0"}
    assert restore_spec(job_id, nodes=(1,))[0] is None


def test_corrupt_buffer_falls_back_to_the_other_buffer_and_says_so(job_id):
    job = trained()
    snapshot(job_id, job, done=1)
    older = trained()  # the state of step 1, kept to compare
    for p in job.model.parameters():
        p.grad = torch.ones_like(p)
    job.optimizer.step()
    snapshot(job_id, job, done=2)
    victim = segment_dir() / f"unbroken-{job_id}-n0-w0-b1"  # step 2 lives in buffer 1 (step 1 in buffer 0)
    with open(victim, "r+b") as fh:
        fh.seek(-100, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-100, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 0xFF]))
    spec, invs = restore_spec(job_id)
    assert any("do not match their checksum" in p for p in invs[0]["problems"])
    # Step 2 is still complete through node 1's parity; lose that too and step 1 (buffer 0) is next.
    assert spec["step"] == 2 and spec["parity_stripes"] == [0]
    restored, _ = restore_into(job_id, spec, node=1, me=2)
    assert same_state(job, restored)
    for w in (2, 3):
        (segment_dir() / f"unbroken-{job_id}-n1-w{w}-b1").unlink()
    spec, _ = restore_spec(job_id)
    assert spec["step"] == 1
    restored, _ = restore_into(job_id, spec, node=0, me=0)
    assert same_state(older, restored)

def test_plan_bytes_per_node_follow_the_formula():
    node_of = {w: w // 2 for w in range(6)}  # 3 nodes of 2 workers
    plan = plan_for(node_of, node_of, redundancy="parity", parity=1, state_bytes=6_000_000)
    assert (plan.k, plan.m, plan.stripes) == (2, 1, 2)
    per_node = plan.stripes * len(plan.fragments_of(0, 0)) * (plan.state_bytes // plan.stripes // plan.k)
    assert per_node == pytest.approx((1 + 1 / 2) * 6_000_000 / 3)
    # Stripe i's parity (fragment 2) sits on node (2 - i) mod 3: the encoding work rotates.
    assert plan.assignment(node_of, node_of) == {0: [(0, 0)], 1: [(1, 1)], 2: [(0, 1)], 3: [(1, 2)],
                                                  4: [(0, 2)], 5: [(1, 0)]}
    alone = plan_for([0, 1], node_of, redundancy="parity", parity=1, state_bytes=100)
    assert (alone.k, alone.m, alone.protected) == (1, 0, False)


def test_erasure_needs_k_fragments():
    data = os.urandom(10_001)
    c = Coding(2, 1)
    chunk = c.chunk(len(data))
    raw = data.ljust(2 * chunk, b"\0")
    parity, headers = c.parity(data, [2])
    pieces = {0: raw[:chunk], 1: raw[chunk:], 2: parity[2]}
    assert c.decode({0: pieces[0], 1: pieces[1]}, len(data)) == data  # the data fragments are the bytes
    assert c.decode({1: pieces[1], 2: pieces[2]}, len(data), headers) == data
    with pytest.raises(ErasureError, match="needs 2 of its 3 fragments"):
        c.decode({2: pieces[2]}, len(data), headers)
    with pytest.raises(ErasureError, match="needs the data fragments' headers"):
        c.decode({1: pieces[1], 2: pieces[2]}, len(data))


def test_bad_snapshot_settings_are_refused_with_the_fix():
    cfg = load_config(preset_name="debug", overrides=["snapshot.parity=2"])
    with pytest.raises(ValueError, match="snapshot.parity=2 needs more than 2 nodes"):
        check_snapshot_config(cfg, nodes=2, workers_per_node=2)
    assert check_snapshot_config(preset("debug"), nodes=1, workers_per_node=4) > 0  # one node: nothing to protect across
    big = preset("llama-7b")
    assert state_bytes(big) > 12 * 6_000_000_000
    with pytest.raises(ValueError, match=r"snapshots need .* MiB of shared memory per node .*snapshot.every=0"):
        check_snapshot_config(big, nodes=2, workers_per_node=2)
    assert node_bytes(preset("debug"), 2, 2) > 2 * state_bytes(preset("debug"))
    with pytest.raises(ValueError, match="snapshot.every=-1"):
        load_config(preset_name="debug", overrides=["snapshot.every=-1"])
    with pytest.raises(ValueError, match="snapshot.redundancy"):
        load_config(preset_name="debug", overrides=["snapshot.redundancy=raid"])


def test_ledger_counts_the_history_after_a_restore(tmp_path):
    from unbroken.jsonl import JsonlWriter

    w = JsonlWriter(tmp_path / "events" / "w0.jsonl")
    for step, gen in ((0, 0), (1, 0), (1, 1)):  # step 1 committed in gen 0, then the job restored at step 1
        w.write({"kind": "work", "step": step, "gen": gen, "worker": 0, "items": [[0, 0, 2, "exact"]]})
        if (step, gen) != (1, 1):
            w.write({"kind": "commit", "step": step, "gen": gen, "worker": 0})
    w.write({"kind": "restore", "step": 1, "gen": 1, "worker": 0})
    w.write({"kind": "commit", "step": 1, "gen": 1, "worker": 0})
    w.close()
    check = check_ledger(tmp_path, n_slots=1, micro_batch=2, steps=2)
    assert check.ok and check.conflicting_steps == []


def test_resume_refuses_snapshot_memory_of_another_config(tmp_path):
    from unbroken.agent.preflight import prepare_run_dir
    from unbroken.runtime.snapshot_hooks import job_id as run_job_id

    cfg = load_config(preset_name="debug")
    run = tmp_path / "run"
    assert prepare_run_dir(run, cfg, overwrite=False, resume=False) is None
    ident = run_job_id(run)
    try:
        with pytest.raises(ValueError, match="no committed checkpoint .* and no complete snapshot of its job"):
            prepare_run_dir(run, cfg, overwrite=False, resume=True)
        snapshot(ident, trained(), done=1)  # sealed under config hash "cfg", not this run's
        with pytest.raises(ValueError, match=f"shared memory holds snapshots of job {ident} written under config cfg"):
            prepare_run_dir(run, cfg, overwrite=False, resume=True)
        # Overwriting the run starts a new job: the old job's memory is freed with it.
        prepare_run_dir(run, cfg, overwrite=True, resume=False)
        assert job_segments(ident) == [] and run_job_id(run) != ident
    finally:
        remove_segments(ident)


def test_a_joiner_loads_the_boundary_from_its_own_node_when_the_node_can_decode_alone(job_id, tmp_path):
    from unbroken.runtime import snapshot_hooks as th

    run = tmp_path / "run"
    run.mkdir()
    (run / "job_id").write_text(job_id + "\n")
    (run / "layout.json").write_text('{"nodes": 2, "workers_per_node": 2}')
    cfg = preset("debug")
    everyone = (0, 1, 2, 3)
    assert th.memory_rejoin_possible(cfg, run, 4, 1, everyone, 7)  # 2 nodes, k = 1: a node decodes alone
    assert not th.memory_rejoin_possible(cfg, run, 4, 1, (2, 3), 7)  # nobody on its node snapshotted step 7
    cfg.snapshot.every = 2
    assert not th.memory_rejoin_possible(cfg, run, 4, 1, everyone, 7)  # step 7 is not a snapshot step
    (run / "layout.json").write_text('{"nodes": 4, "workers_per_node": 1}')
    cfg.snapshot.every = 1
    assert not th.memory_rejoin_possible(cfg, run, 4, 1, everyone, 7)  # k = 3: needs other nodes' fragments
    # HSDP, one node of 2 replicas x 2 ranks: index 1's state is snapshotted by its members only (worker 1 of
    # the live replica 0, for the joiner 3), all on the node: it decodes alone.
    from unbroken.sharding.hsdp import ReplicaLayout

    (run / "layout.json").write_text('{"nodes": 1, "workers_per_node": 4}')
    assert th.memory_rejoin_possible(cfg, run, 4, 3, (0, 1), 7, ReplicaLayout(4, 2))
    (run / "layout.json").write_text('{"nodes": 2, "workers_per_node": 2}')  # a replica per node: nobody on it
    assert not th.memory_rejoin_possible(cfg, run, 4, 3, (0, 1), 7, ReplicaLayout(4, 2))
    job = trained()
    snapshot(job_id, job, done=7)
    fresh = trained(seed=5)
    done = th.load_from_node_memory(run, 1, 4, 7, fresh.model, fresh.optimizer, torch.device("cpu"), "cfg")
    assert same_state(job, fresh) and done["received"] == 0
    with pytest.raises(SnapshotCorrupt, match="no complete snapshot of step 8"):
        th.load_from_node_memory(run, 1, 4, 8, fresh.model, fresh.optimizer, torch.device("cpu"), "cfg")
    assert th.memory_rejoin_allowed(run, 1)
    th.memory_rejoin_failed(run, 1, "test")
    assert not th.memory_rejoin_allowed(run, 1) and th.memory_rejoin_allowed(run, 2)


def test_a_joiner_loads_the_restored_timelines_snapshot_not_the_abandoned_one(job_id, tmp_path):
    """Step 7 was sealed under view 2 (worker 0 the node's writer), then the job was restored at an earlier
    step and trained step 7 again, differently, under view 9 (worker 1 the writer; worker 0 down). Both are
    complete on node 0: worker 0, rejoining at step 7 from its node's memory, loads view 9's."""
    from unbroken.runtime import snapshot_hooks as th

    run = tmp_path / "run"
    run.mkdir()
    (run / "job_id").write_text(job_id + "\n")
    (run / "layout.json").write_text('{"nodes": 2, "workers_per_node": 2}')
    abandoned, restored = trained(seed=1), trained(seed=2)
    snapshot(job_id, abandoned, done=7, members=(0, 2, 3), gen=2)
    snapshot(job_id, restored, done=7, members=(1, 2, 3), gen=9)
    fresh = trained(seed=5)
    th.load_from_node_memory(run, 0, 4, 7, fresh.model, fresh.optimizer, torch.device("cpu"), "cfg")
    assert same_state(restored, fresh) and not same_state(abandoned, fresh)
