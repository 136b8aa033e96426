"""Sharded optimizer state (``train.shard_optimizer``) under real failures: no rollback, nothing lost.

Two jobs of 2 nodes x 2 workers (real processes, SIGKILL, gloo):

- failures at the sharded step's own phases: worker 1 dies with its all-gather
  in flight, worker 3 right after voting to commit (its copy of that step was
  never sent: the holder brings the older copy forward one step), worker 2
  just before its update (both for good); each time the survivors re-shard,
  the dead worker's range comes from the copy its ring buddy keeps, the
  interrupted step completes, every ``(step, slot)`` is trained once, and
  worker 1, restarted, gets a range back when it rejoins; a checkpoint written
  while a worker was down holds the three ranges of that view;
- two workers that hold each other's copies die at once: the job stops and
  says why; the checkpoint written by the four workers before the failure
  holds the parameters and moments of plain single-process training (to float
  tolerance); ``--resume`` as a replicated run continues from snapshot memory,
  newer than the checkpoint: the parameters from the snapshot, the moments
  from the ring copies of the same step (sealed in the agents' memory, they
  outlive the workers that held them), and ends where plain training ends;
- every worker dies at once: the job is restored from snapshot memory with no
  step lost, the parameters from the snapshot, the moments from the ring
  copies of the same step.
"""

from __future__ import annotations

import json

import pytest
import torch

from _faults import check_invariants, failover_config, run_job
from _reference import checkpoint_params, reference_train
from unbroken.agent.launcher import JobFailed, launch
from unbroken.config import Config
from unbroken.runtime.checkpoint_files import committed_checkpoints, read_commit
from unbroken.runtime.ledger import check_ledger, read_events
from unbroken.sharding.checkpoint import load_moments

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 120
CONFIRMED = 30
"""Worker 3 dies right after its commit vote of this step, for good."""
SECOND = 80
"""Worker 2 dies here (worker 1, forked from its node's template once step 5 is committed, has usually
rejoined by then; the test holds either way) and stays dead."""


def test_failures_at_the_sharded_phases_rebuild_the_range_from_its_copy(tmp_path, corpus_overrides):
    cfg = failover_config(corpus_overrides, STEPS, "train.shard_optimizer=true", "mecefo.policy=spread",
                          "train.checkpoint_every=20", "train.keep_checkpoints=20")
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2, restart="on-failure",
                  fail_at=f"step=3:worker=1:kill:phase=allgather:back=5,"
                          f"step={CONFIRMED}:worker=3:kill:phase=confirm:back={STEPS},"
                          f"step={SECOND}:worker=2:kill:phase=update:back={STEPS}")
    check_invariants(job, live=[0, 1])
    # Worker 1 dies with its all-gather of step 3 posted: if that all-gather completed everywhere first, step 3
    # commits (every survivor holds its parameters) and the range is rebuilt at step 4. A survivor whose own
    # all-gather broke while another's completed cannot apply step 3: it leaves to rejoin (MissedCommit), and
    # its range too comes from its copy.
    at = min(e["step"] for e in job.events("resharded"))
    assert at in (3, 4), at
    first = [e for e in job.events("resharded") if e["step"] == at]
    members = first[0]["members"]
    assert 1 not in members and len(members) >= 2 and sorted(e["worker"] for e in first) == members, first
    assert all(e["members"] == members for e in first)
    lost = sorted({0, 1, 2, 3} - set(members))
    assert all(e["from_copies"] == lost for e in first), "the lost ranges came from their buddies' copies"
    # Killed right after voting to commit: its step counts, but its copy of that step was never sent, so the
    # holder brings the copy of the step before forward with the reduced gradient every member kept.
    confirmed = [e for e in job.events("resharded") if e["step"] == CONFIRMED + 1]
    assert confirmed and all(e["from_copies"] == [3] for e in confirmed)
    assert [w for e in confirmed for w in e["replayed"]] == [3], confirmed
    second = [e for e in job.events("resharded") if e["step"] == SECOND]
    assert second and all(e["from_copies"] == [2] for e in second)
    assert {e["worker"] for e in job.events("rejoined")} == set(lost)
    ranges = {w: json.loads((job.run_dir / "workers" / f"w{w}.json").read_text())["sharded"]["range"]
              for w in (0, 1)}
    assert sorted(ranges.values())[0][0] == 0 and all(
        a[1] == b[0] for a, b in zip(sorted(ranges.values()), sorted(ranges.values())[1:])), ranges
    kept = {len(read_commit(p)["shards"]) for p in committed_checkpoints(job.run_dir / "checkpoints")}
    assert 3 in kept, f"a checkpoint written by 3 members expected, got range counts {kept}"


def test_losing_a_shard_and_its_copy_stops_the_job_and_resume_continues(tmp_path, corpus_overrides):
    cfg = failover_config(corpus_overrides, 16, "train.shard_optimizer=true", "mecefo.policy=spread",
                          "train.checkpoint_every=4", "snapshot.every=1")
    run = tmp_path / "run"
    with pytest.raises(JobFailed) as failed:
        launch(cfg, run, nodes=2, workers_per_node=2, restart="never",
               fail_at="step=9:worker=0:kill:phase=forward,step=9:worker=2:kill:phase=forward")
    msg = str(failed.value)
    assert "optimizer shards of workers [0, 2] are lost" in msg and f"unbroken train --resume {run}" in msg, msg
    # The checkpoint of step 4 is committed before the kills: the leader's save of step 8 first waited for it
    # (and each worker's for its part of it). Step 8's own commit may have been cut by the leader's death.
    kept = next(p for p in committed_checkpoints(run / "checkpoints") if read_commit(p)["step"] == 4)
    assert len(read_commit(kept)["shards"]) == 4
    # Until the failure the sharded job is plain data parallelism: equal to the oracle's parameters and moments.
    want, want_moments = reference_train(cfg, 4, moments=True)
    got = checkpoint_params(kept)
    m, v = load_moments(kept, read_commit(kept)["shards"], sum(p.numel() for p in want.values()))
    at = 0
    for name, p in want.items():  # tolerance and eps=1e-6: see tests/integration/test_data_parallel.py
        torch.testing.assert_close(got[name], p, rtol=1e-4, atol=1e-5, msg=name)
        for flat, ref in zip((m, v), want_moments[name]):
            torch.testing.assert_close(flat[at:at + p.numel()].view_as(p), ref, rtol=1e-3, atol=1e-7, msg=name)
        at += p.numel()
    replicated = Config.from_dict({**cfg.to_dict(), "train": {**cfg.to_dict()["train"], "shard_optimizer": False}})
    summary = launch(replicated, run, nodes=2, workers_per_node=2, resume=True)
    assert summary["steps"] == 16 and summary["workers_agree"]
    # Step 9's copies of the dead workers' ranges were never sealed (their holders died in its forward pass):
    # the newest step with a snapshot and a copy of every range is 8 (memory, also where a checkpoint of 8 is
    # committed: at the same step the memory is preferred).
    restores = [e for e in read_events(run) if e.get("event") == "job_restore"]
    assert [(e["restored_from"], e["step"]) for e in restores] == [("memory", 8)], restores
    loaded = [e for e in read_events(run) if e.get("event") == "restored"]
    assert sorted((e["worker"], e["restored_from"], e["moment_ranges"]) for e in loaded) == [
        (w, "memory", 4) for w in range(4)], loaded
    got, want = checkpoint_params(summary["checkpoint"]), reference_train(cfg)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-4, msg=name)


def test_a_whole_job_killed_restores_the_parameters_from_snapshots_and_the_moments_from_the_ring_copies(
        tmp_path, corpus_overrides):
    """2 nodes x 1 worker (each the other's ring buddy), a snapshot every step, no checkpoint before the
    end. Both workers die in step 6 with their reduction in flight (the snapshot of the state after 6 steps
    and both ring copies of that step sealed by then): the agents restore the job from memory at step 6, no
    step lost. The snapshot holds the parameters, steps and RNG; each range's moments come from the copy
    its ring buddy sealed for step 6 in the same view, read on the buddy's node and broadcast. The run then
    finishes: every step trained exactly once, and the result is plain training's on the same batches (zero
    or stale moments would change it). (With 4 workers, the kills land a few milliseconds apart: two buddies
    dead before the others are stops the job with ShardLost, see the test above.)"""
    cfg = failover_config(corpus_overrides, 12, "train.shard_optimizer=true", "mecefo.policy=spread",
                          "snapshot.every=1", "train.checkpoint_every_s=0")
    kills = ",".join(f"step=6:worker={w}:kill:phase=allreduce" for w in range(2))
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=1, restart="on-failure", fail_at=kills)
    restores = job.events("job_restore")
    assert [(e["restored_from"], e["step"]) for e in restores] == [("memory", 6)], restores
    loaded = job.events("restored")
    assert sorted((e["worker"], e["restored_from"], e["step"], e["moment_ranges"]) for e in loaded) == [
        (w, "memory", 6, 2) for w in range(2)], loaded
    assert sum(e["moment_bytes_sent"] for e in loaded) == sum(e["moment_bytes_received"] for e in loaded) > 0
    s = job.summary
    assert s["steps"] == 12 and s["workers_agree"], s
    ledger = check_ledger(job.run_dir, n_slots=2, micro_batch=cfg.data.micro_batch, steps=12)
    assert ledger.ok and ledger.committed == 12, ledger.to_json()
    got, want = checkpoint_params(s["checkpoint"]), reference_train(job.cfg)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-4, msg=name)
