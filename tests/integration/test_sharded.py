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
from unbroken.checkpoint.files import committed_checkpoints, read_commit
from unbroken.runtime.ledger import check_ledger, read_events
from unbroken.checkpoint.sharded import load_moments

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 120
CONFIRMED = 30
"""Worker 3 dies right after its commit vote of this step, for good."""
SECOND = 80
"""Worker 2 dies here (worker 1, forked from its node's template once step 5 is committed, has usually
rejoined by then; the test holds either way) and stays dead. The job is held back while worker 1 gets ready
(``pace``), so it is back before the end however slow the machine."""


def test_failures_at_the_sharded_phases_rebuild_the_range_from_its_copy(tmp_path, corpus_overrides):
    cfg = failover_config(corpus_overrides, STEPS, "train.shard_optimizer=true", "mecefo.policy=spread",
                          "train.checkpoint_every=20", "train.keep_checkpoints=20")
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2, restart="on-failure", pace=True,
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


def test_losing_a_shard_and_its_copy_restores_the_job_from_memory_by_itself(tmp_path, corpus_overrides):
    """Workers 0 and 2 (each the other's ring buddy) die together in step 9: the shards of both are lost with
    their copies. The survivors leave (each marks itself dead, "shard lost"), and the agents restore the job
    from snapshot memory at the newest step with a snapshot and a copy of every range (step 8: step 9's
    copies of the dead workers' ranges were never sealed), as for a replicated job whose workers all died,
    instead of stopping for a human. The run finishes: every step trained exactly once, the result plain
    training's on the same batches."""
    cfg = failover_config(corpus_overrides, 16, "train.shard_optimizer=true", "mecefo.policy=spread",
                          "train.checkpoint_every=4", "snapshot.every=1")
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2, restart="never",
                  fail_at="step=9:worker=0:kill:phase=forward,step=9:worker=2:kill:phase=forward")
    check_invariants(job, live=[0, 1, 2, 3])
    # each survivor leaves by itself (it marks itself dead, "shard lost", and exits with code 4), or is fenced by
    # its agent on reading that mark before it exits
    left = [e for e in read_events(job.run_dir) if e.get("event") == "worker_exit" and not e.get("clean")
            and not e.get("injected")]
    assert sorted(e["worker"] for e in left) == [1, 3], f"the survivors left, the shards lost: {left}"
    assert all(e["code"] == 4 or (e["fenced"] and e["reason"]["how"] == "shard lost") for e in left), left
    restores = job.events("job_restore")
    assert [(e["restored_from"], e["step"]) for e in restores] == [("memory", 8)], restores
    loaded = job.events("restored")
    assert sorted((e["worker"], e["restored_from"], e["moment_ranges"]) for e in loaded) == [
        (w, "memory", 4) for w in range(4)], loaded
    got, want = checkpoint_params(job.summary["checkpoint"]), reference_train(cfg)
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-4, msg=name)


def test_losing_a_shard_and_its_copy_without_newer_memory_stops_and_resume_continues(tmp_path, corpus_overrides):
    """The same losses with no snapshot memory (snapshot.every=0): nothing newer than the checkpoint, so the job
    stops for the user (going back to the checkpoint is theirs to decide), saying so; --resume continues."""
    cfg = failover_config(corpus_overrides, 16, "train.shard_optimizer=true", "mecefo.policy=spread",
                          "train.checkpoint_every=4", "snapshot.every=0")
    run = tmp_path / "run"
    with pytest.raises(JobFailed) as failed:
        launch(cfg, run, nodes=2, workers_per_node=2, restart="never",
               fail_at="step=9:worker=0:kill:phase=forward,step=9:worker=2:kill:phase=forward")
    msg = str(failed.value)
    assert "the optimizer shards of workers [0, 2] are lost" in msg, msg
    assert "snapshot memory holds nothing newer than the checkpoint of step" in msg, msg
    assert f"unbroken train --resume {run}" in msg, msg
    summary = launch(cfg, run, nodes=2, workers_per_node=2, resume=True)
    assert summary["steps"] == 16 and summary["workers_agree"]
    ledger = check_ledger(run, n_slots=4, micro_batch=cfg.data.micro_batch, steps=16)
    assert ledger.ok and ledger.committed == 16, ledger.to_json()


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
