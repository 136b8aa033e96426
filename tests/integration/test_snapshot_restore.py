"""Whole-job failures survived from snapshot memory: real processes, real SIGKILLs, real /dev/shm.

1. Every worker of a 2-node x 2-worker job is SIGKILLed in the middle of a step:
   the agents restore the job from the newest complete snapshot (0 steps lost
   beyond the one in flight), and it ends with the parameters of an
   uninterrupted run, bit for bit; the ledger's final history is exactly-once; the
   segments are gone at the end.
2. The launcher, both agents and every worker are SIGKILLed, and node 0's
   memory is lost with them: ``unbroken train --resume`` continues from memory,
   newer than the checkpoint written by time (``train.checkpoint_every_s``):
   it rebuilds node 0's share from node 1's parity, sends it to node 0's
   workers, and finishes with the same parameters.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from _faults import MICRO_BATCH as MB
from _faults import _ours_alive, check_invariants, run_job
from _reference import checkpoint_params
from unbroken.agent._restore import MAX_RESTORES_PER_STEP
from unbroken.agent.launcher import JobFailed, launch
from unbroken.config import load_config
from unbroken.jsonl import read_jsonl
from unbroken.checkpoint.checkpointer import latest_checkpoint, read_commit
from unbroken.checkpoint.files import committed_checkpoints
from unbroken.runtime.ledger import check_ledger, read_events
from unbroken.snapshot.segment import job_segments, remove_segments
from unbroken.runtime.snapshot_hooks import job_id

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]


STEPS = 40


def _overrides(corpus_overrides: list[str]) -> list[str]:
    return [*corpus_overrides, f"train.steps={STEPS}", "train.val_every=0", "train.val_batches=1",
            "optim.warmup_steps=2", "optim.eps=1e-6", f"data.micro_batch={MB}", "data.seq_len=32",
            "mecefo.policy=spread", "train.workers=4"]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, corpus_overrides) -> dict[str, torch.Tensor]:
    """The parameters of the same job with no failure (the target of every restore)."""
    run = tmp_path_factory.mktemp("uninterrupted") / "run"
    summary = launch(load_config(preset_name="debug", overrides=_overrides(corpus_overrides)), run, nodes=2,
                     workers_per_node=2)
    return checkpoint_params(summary["checkpoint"])


def _assert_identical(ckpt, want: dict[str, torch.Tensor]) -> None:
    got = checkpoint_params(ckpt)
    assert got.keys() == want.keys()
    differ = [name for name in want if not torch.equal(got[name], want[name])]
    assert not differ, f"parameters differ from the uninterrupted run: {differ}"


def test_every_worker_killed_mid_step_resumes_from_memory(tmp_path, corpus_overrides, uninterrupted):
    """... and killed again, from outside, as they start in the restored view, three times over: more restores
    of step 6 than MAX_RESTORES_PER_STEP, which stops only a fault of the job's own that recurs; each restore
    after a failed one waits longer (1, 2, 4 s)."""
    cfg = load_config(preset_name="debug", overrides=_overrides(corpus_overrides))
    kills = [f"step=6:worker={w}:kill:phase=allreduce" for w in range(4)]
    kills += [f"step=6:worker={w}:kill:phase=restore" for _ in range(MAX_RESTORES_PER_STEP) for w in range(4)]
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2, fail_at=",".join(kills))
    check_invariants(job, live=[0, 1, 2, 3])
    restores = sorted(job.events("job_restore"), key=lambda e: e["gen"])  # by whichever agent claimed each
    assert [(e["restored_from"], e["step"], e["lost_nodes"]) for e in restores] == \
        [("memory", 6, [])] * (MAX_RESTORES_PER_STEP + 1)
    assert [(len(e["failed_restores"]), e["backoff_s"]) for e in restores] == [(0, 0), (1, 1), (2, 2), (3, 4)]
    assert all(f == [] for e in restores for f in e["failed_restores"]), "deaths by SIGKILL are no error of the job"
    assert len(job.events("fault_self", phase="restore")) == 4 * MAX_RESTORES_PER_STEP
    restored = job.events("restored")
    assert sorted(e["worker"] for e in restored) == [0, 1, 2, 3]
    assert all(e["restored_from"] == "memory" and e["step"] == 6 and e["received"] == 0 for e in restored)
    assert {e["rebuilt"] for e in restored} == {1}  # parity rotates: each node holds one stripe's parity
    # Step 6 was in flight (killed in its all-reduce): retrained once in the final history, nothing else redone.
    commits = [(r["step"], r["gen"]) for r in read_events(job.run_dir) if r.get("kind") == "commit"]
    assert not [s for s, g in commits if s < 6 and g > 0], "a step before the restore point was trained again"
    _assert_identical(job.summary["checkpoint"], uninterrupted)
    assert job_segments(job_id(job.run_dir)) == [], "the agents free snapshot memory when the job ends"


def _pids(run_dir) -> list[int]:
    out = []
    for p in (run_dir / "pids").glob("*"):
        try:
            out.append(int(p.read_text().split()[0]))
        except (ValueError, IndexError, FileNotFoundError):
            pass
    return out


def test_launcher_and_agents_killed_then_resume_rebuilds_a_lost_node_from_parity(tmp_path, corpus_overrides,
                                                                                uninterrupted):
    run = tmp_path / "run"
    overrides = _overrides(corpus_overrides) + ["train.checkpoint_every_s=0.5"]  # by time only, every 0.5 s
    script = ("import json, sys; from unbroken.config import load_config; from unbroken.agent.launcher import launch; "
              "launch(load_config(preset_name='debug', overrides=json.loads(sys.argv[1])), sys.argv[2], "
              "nodes=2, workers_per_node=2)")
    cmd = [sys.executable, "-c", script, json.dumps(overrides), str(run)]
    launcher = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 180

    def memory_is_newer() -> bool:  # than the newest checkpoint, by two steps or more
        recs = read_jsonl(run / "metrics.jsonl") if (run / "metrics.jsonl").is_file() else []
        ckpts = committed_checkpoints(run / "checkpoints")
        return bool(ckpts) and any(r.get("step", 0) >= max(10, int(read_commit(ckpts[0])["step"]) + 2) for r in recs)

    def signal_all(pids: list[int], sig: signal.Signals) -> None:
        for pid in pids:
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass

    try:
        while time.monotonic() < deadline:
            if memory_is_newer():
                # A checkpoint still being written may commit before the kill: freeze the job, look again, and
                # cut the power only if memory is still the newer; otherwise thaw it and wait on.
                victims = [launcher.pid, *_pids(run)]
                signal_all(victims, signal.SIGSTOP)
                if memory_is_newer():
                    break
                signal_all(victims, signal.SIGCONT)
            assert launcher.poll() is None, "the run ended before it could be killed"
            time.sleep(0.05)
        victims = [launcher.pid, *_pids(run)]
        signal_all(victims, signal.SIGKILL)  # a power cut: launcher, agents and workers at once
    finally:
        os.killpg(launcher.pid, signal.SIGKILL) if launcher.poll() is None else None
        launcher.wait(timeout=30)
    deadline = time.monotonic() + 30
    while any(_ours_alive(pid, run) for pid in victims) and time.monotonic() < deadline:
        time.sleep(0.05)
    job = job_id(run)
    reached = max(r["step"] for r in read_jsonl(run / "metrics.jsonl"))
    kept = latest_checkpoint(run)
    assert kept is not None and int(read_commit(kept)["step"]) < reached - 1
    assert job_segments(job, node=0) and job_segments(job, node=1)
    remove_segments(job, node=0)  # node 0 was a lost machine: its memory is gone
    resumed = subprocess.run([sys.executable, "-m", "unbroken.cli", "train", "--resume", str(run)],  # its own 2 x 2
                             capture_output=True, text=True, timeout=240)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == STEPS and summary["workers_agree"] and summary["resumed_from"] == str(kept)
    cfg = load_config(preset_name="debug", overrides=overrides)
    events = read_events(run)
    restore = [e for e in events if e.get("event") == "job_restore"]
    assert len(restore) == 1 and restore[0]["restored_from"] == "memory"
    assert reached - 1 <= restore[0]["step"] <= reached + 1, (reached, restore[0])  # memory first: it is newer
    assert restore[0]["parity_stripes"] == [0]  # node 0 held stripe 0's data
    restored = {e["worker"]: e for e in events if e.get("event") == "restored"}
    assert sorted(restored) == [0, 1, 2, 3]
    assert restored[0]["received"] == 2 and restored[2]["rebuilt"] == 1 and restored[2]["sent"] == 2
    ledger = check_ledger(run, n_slots=4, micro_batch=cfg.data.micro_batch, steps=STEPS)
    assert ledger.ok and ledger.committed == STEPS and not ledger.lost_steps, ledger.to_json()
    steps = [r["step"] for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    assert steps == list(range(1, STEPS + 1)), "metrics hold each step once after a resume from memory"
    _assert_identical(summary["checkpoint"], uninterrupted)
    assert job_segments(job) == []


def test_a_node_lost_with_every_worker_is_rebuilt_from_parity_by_the_surviving_agent(tmp_path, corpus_overrides):
    """Node 0 (agent and workers) is SIGKILLed and node 1's workers die in the same step: nobody is left to
    mark node 0's workers dead but node 1's agent, which does once they stay silent, then restores the
    job without node 0, its share rebuilt from parity."""
    cfg = load_config(preset_name="debug", overrides=_overrides(corpus_overrides)[:-1] + ["train.steps=16"])
    kills = "step=8:node=0:kill,step=8:worker=2:kill:phase=allreduce,step=8:worker=3:kill:phase=allreduce"
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2, fail_at=kills)
    check_invariants(job, live=[2, 3])
    [restore] = job.events("job_restore")
    # Node 0 dies once the job's progress reaches step 8: a worker of node 1 still finishing step 7 then never
    # snapshots the state after it, and the job restores the newest snapshot both of node 1's workers sealed
    sealed = [{e["step"] for e in job.events("snapshot_sealed", worker=w) if e["t"] < restore["t"]} for w in (2, 3)]
    newest = max(sealed[0] & sealed[1])
    assert newest in (7, 8), sealed
    assert (restore["restored_from"], restore["step"], restore["lost_nodes"], restore["parity_stripes"]) == \
        ("memory", newest, [0], [0])
    assert sorted(e["worker"] for e in job.events("restored")) == [2, 3]


def test_a_member_killed_in_a_restore_admission_is_left_out_and_the_others_restore(tmp_path, corpus_overrides):
    """Every worker of a 3-node x 1-worker job is SIGKILLed in step 8, the agents restore the job from snapshot
    memory, and worker 0 kills itself as it enters the restored view. The others' admission fails (every member
    of a restored view is a joiner): one of them proposes the next view of step 8, the restore kept, and they
    load the state without node 0. No node holds two of a stripe's three fragments, so node 0's fragment is
    replaced by the parity fragment from the nodes that still have a live member."""
    cfg = load_config(preset_name="debug", overrides=_overrides(corpus_overrides)[:-1] + ["train.steps=16"])
    kills = [f"step=8:worker={w}:kill:phase=allreduce" for w in range(3)] + ["step=8:worker=0:kill:phase=restore"]
    job = run_job(cfg, tmp_path / "run", nodes=3, workers_per_node=1, fail_at=",".join(kills))
    check_invariants(job, live=[1, 2])
    [restore] = job.events("job_restore")
    assert (restore["restored_from"], restore["step"], restore["members"]) == ("memory", 8, [0, 1, 2])
    assert [e["step"] for e in job.events("fault_self", worker=0, phase="restore")] == [8]
    restored = job.events("restored")
    assert sorted(e["worker"] for e in restored) == [1, 2]
    assert all(e["gen"] > restore["gen"] and e["rebuilt"] == 1 and e["received"] == 1 for e in restored)


def test_storms_in_a_row_each_restore_from_memory_and_train_every_row_once(tmp_path, corpus_overrides):
    """Every worker is SIGKILLed in step 9; the job comes back from memory at step 8, and every worker is killed
    again in step 11, right after it came back; worker 0 kills itself a third time as it enters that second
    restore. The agents restart each killed worker at once (restart on-failure): a new incarnation starts
    while the previous restored view is still the current one (its members all dead), and must not enter that
    view again (its steps were trained: an incarnation that took it for its own trained rows twice, or ran a
    step with no group). Each storm restores from memory, losing only the steps since the newest seal, and the
    run ends with every row trained exactly once. (Worker 0 is left out of the second restore and rejoins: the
    steps in between spread its rows, so the parameters are not bit for bit the uninterrupted run's.)"""
    cfg = load_config(preset_name="debug", overrides=_overrides(corpus_overrides) + ["snapshot.every=2"])
    kills = [f"step=9:worker={w}:kill:phase=allreduce" for w in range(4)]
    kills += [f"step=11:worker={w}:kill:phase=allreduce" for w in range(4)]
    kills += ["step=10:worker=0:kill:phase=restore"]
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2, fail_at=",".join(kills), restart="on-failure")
    check_invariants(job, live=[0, 1, 2, 3])
    restores = sorted(job.events("job_restore"), key=lambda e: e["gen"])
    assert [(e["restored_from"], e["step"]) for e in restores] == [("memory", 8), ("memory", 10)]
    assert [e["step"] for e in job.events("fault_self", worker=0, phase="restore")] == [10]
    first = restores[0]["gen"]
    # Nobody trained a step in the first restored view after the second storm (its members were all dead).
    late = [r for r in job.records if r.get("gen") == first and (r.get("kind") == "work" and r["step"] > 11
                                                                  or r.get("kind") == "commit" and r["step"] >= 11)]
    assert not late, f"the first restored view trained on after the second storm: {late[:3]}"
    errors = job.events("worker_error")
    assert not errors, f"a worker failed with an error of its own: {errors[:2]}"


SGD_OPTIMIZER = '''
import torch


def sgd(model, ctx):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
'''


def test_a_users_sgd_with_momentum_comes_back_from_memory_bit_for_bit(tmp_path, corpus_overrides):
    """A user's own optimizer (SGD with momentum: a state that is not AdamW's): the only worker of a job is
    killed in step 9, the job comes back from snapshot memory, and ends with the parameters of the same job
    without the kill, bit for bit (the momentum buffers were snapshotted too); the checkpoint the job wrote at
    its end holds them, and resumes bit for bit."""
    script = tmp_path / "opt.py"
    script.write_text(SGD_OPTIMIZER)
    overrides = [*corpus_overrides, "train.steps=14", "train.val_every=0", "train.val_batches=1",
                 f"data.micro_batch={MB}", "data.seq_len=32", "snapshot.every=2", f"optim.factory={script}:sgd"]
    cfg = load_config(preset_name="debug", overrides=overrides)
    plain = run_job(cfg, tmp_path / "plain", nodes=1, workers_per_node=1)
    killed = run_job(cfg, tmp_path / "killed", nodes=1, workers_per_node=1, restart="on-failure",
                     fail_at="step=9:worker=0:kill:phase=backward")
    check_invariants(killed, live=[0])
    [restore] = killed.events("job_restore")
    assert (restore["restored_from"], restore["step"]) == ("memory", 8)
    _assert_identical(killed.summary["checkpoint"], checkpoint_params(plain.summary["checkpoint"]))
    commit = read_commit(killed.summary["checkpoint"])
    assert any(name.endswith(".momentum_buffer") for name, *_ in commit["state"]), "the checkpoint holds them"


BUGGY_OPTIMIZER = '''
from pathlib import Path

import torch

BUG_ON = Path({marker!r})


class BuggyAdamW(torch.optim.AdamW):
    """AdamW with a bug that shows once a file exists: the same error at the same place, in every worker."""

    def step(self, closure=None):
        if BUG_ON.exists():
            raise RuntimeError("a bug in the optimizer")
        return super().step(closure)


def build_optimizer(model, ctx):
    return BuggyAdamW(model.parameters(), lr=ctx.cfg.optim.lr, eps=ctx.cfg.optim.eps)
'''


def test_a_fault_of_the_job_that_recurs_after_each_restore_stops_it_and_resume_continues(tmp_path,
                                                                                     corpus_overrides):
    """Both workers of a job raise the same error in their optimizer step from step 5 on (a bug). The agents
    restore the job from snapshot memory, it raises again: after MAX_RESTORES_PER_STEP restores that died of
    the same error the restores stop, the snapshot memory is kept, the message says so and names the error;
    with the bug fixed, --resume continues from memory to the end, every step trained exactly once."""
    marker, script, run = tmp_path / "bug_on", tmp_path / "buggy_optimizer.py", tmp_path / "run"
    script.write_text(BUGGY_OPTIMIZER.format(marker=str(marker)))
    line = BUGGY_OPTIMIZER.splitlines().index('            raise RuntimeError("a bug in the optimizer")') + 1
    steps = 16
    cfg = load_config(preset_name="debug", overrides=_overrides(corpus_overrides)[:-1] + [
        "train.workers=2", f"train.steps={steps}", f"optim.factory={script}:build_optimizer"])

    def bug_from_step_5(record: dict) -> None:
        if record.get("kind") == "train" and record["step"] >= 5:
            marker.touch()

    with pytest.raises(JobFailed) as failed:
        launch(cfg, run, nodes=1, workers_per_node=2, on_record=bug_from_step_5)
    restores = [e for e in read_events(run) if e.get("event") == "job_restore"]
    step = restores[0]["step"]
    assert [(e["restored_from"], e["step"]) for e in restores] == [("memory", step)] * MAX_RESTORES_PER_STEP
    bug = f"RuntimeError at {script}:{line} in step"
    assert [e["failed_restores"] for e in restores] == [[[bug]] * n for n in range(MAX_RESTORES_PER_STEP)]
    message = str(failed.value)
    assert (f"every worker died {MAX_RESTORES_PER_STEP} times in a row after being restored at step {step}, each "
            f"time with the same error ({bug})") in message, message
    assert (f"snapshot memory holds a complete snapshot of step {step}; continue with: unbroken train --resume "
            f"{run}") in message, message
    assert job_segments(job_id(run)), "a job stopped by the breaker keeps its snapshot memory for --resume"

    marker.unlink()  # the bug is fixed
    summary = launch(cfg, run, nodes=1, workers_per_node=2, resume=True)
    assert summary["steps"] == steps and summary["workers_agree"]
    resumed = [e for e in read_events(run) if e.get("event") == "job_restore"][-1]
    assert (resumed["restored_from"], resumed["step"]) == ("memory", step)
    ledger = check_ledger(run, n_slots=2, micro_batch=MB, steps=steps)
    assert ledger.ok and ledger.committed == steps and not ledger.lost_steps, ledger.to_json()
