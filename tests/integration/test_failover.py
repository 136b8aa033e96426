"""Failover with real processes and real signals (CPU, gloo): every step completes, nothing is lost.

Each scenario launches agents and workers through :func:`unbroken.agent.launcher.launch`,
injects its faults declaratively (``fail_at`` specs: the agent signals a worker or a
node, or a worker signals itself at a phase of its step), and asserts:

- the shared end state (:func:`_faults.check_invariants`): all steps done, the
  ledger exact (every ``(step, slot, row)`` trained once), the live workers'
  parameters identical (one report per live worker), no process of the job left
  and the store's port free again;
- what the scenario is about: the step that failed, the view it was committed
  under, who trained the dead worker's rows and in which mode.

Worker ``w`` owns slot ``w``. Failures are injected at step 4 or later, once
every worker has started and trained a few steps. Rejoin scenarios need many
short steps: a restarted worker spends seconds importing torch before it can
ask to join.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from _faults import MICRO_BATCH as MB
from _faults import Job, check_invariants, failover_config, run_job
from _reference import checkpoint_params, reference_train
from unbroken.report.run_report import summarize_run
from unbroken.data import BatchSampler
from unbroken.faults.store_loss import STORE_PIDS_ENV
from unbroken.jsonl import read_jsonl
from unbroken.runtime.membership import EXIT_REJOIN
from unbroken.runtime.ledger import check_ledger
from unbroken.mecefo.takeover import POLICIES
from unbroken.mecefo.gradients import SlotWork

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

REJOIN_STEPS = 120
"""Steps of the rejoin scenarios; the job is held back while the restarted worker gets ready (``pace``), so its
rejoin mid-run does not depend on how fast the machine is."""
STALL_TIMEOUT = "train.timeout_s=30"
"""Bounds what any stall would cost in the multi-failure tests (every blocking wait is capped by train.timeout_s)."""


def exact(*workers: int) -> list[tuple[int, int, int, int, str]]:
    """Each worker trains exactly its own slot."""
    return [(w, w, 0, MB, "exact") for w in workers]


def failure_steps(job: Job) -> list[int]:
    """Steps whose attempt was aborted by a failure (admitting a joiner does not count)."""
    return [f["step"] for f in summarize_run(job.run_dir)["failure_details"]]


def no_work_after(job: Job, worker: int, step: int) -> bool:
    """``worker`` applied nothing from ``step`` on, and no committed reduction holds its work.

    (Its record of an aborted attempt may exist: records precede the all-reduce.)
    """
    return not [r for r in job.records if r.get("kind") in ("work", "commit") and r["worker"] == worker
                and r["step"] >= step and (r["kind"] == "commit" or r["gen"] == job.commit_gen(r["step"]))]


def test_no_failure_equals_data_parallel_reference(tmp_path, corpus_overrides):
    cfg = failover_config(corpus_overrides, 6, "train.workers=4")
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2)
    check_invariants(job, live=[0, 1, 2, 3])
    assert not job.events("attempt_aborted") and job.summary["failures"] == 0
    assert all(job.committed_items(s) == exact(0, 1, 2, 3) for s in range(6))
    got = checkpoint_params(job.summary["checkpoint"])
    want = reference_train(cfg)
    assert got.keys() == want.keys()
    for name in want:  # tolerance and eps=1e-6: see tests/integration/test_data_parallel.py
        torch.testing.assert_close(got[name], want[name], rtol=1e-4, atol=1e-5, msg=name)


def test_sigkill_mid_step(tmp_path, corpus_overrides):
    """Killed before computing (forward, worker 1 at step 4) or with its all-reduce in flight (worker 3 at
    step 7): each time the survivors finish the step it died in, under the next view. (Without templates:
    its workers start as fresh interpreters, as ``fault.template=false`` asks.)"""
    cfg = failover_config(corpus_overrides, 10, "fault.template=false")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=4,
                  fail_at="step=4:worker=1:kill:phase=forward,step=7:worker=3:kill:phase=allreduce")
    check_invariants(job, live=[0, 2])
    assert not job.events("template_ready") and not any(e["forked"] for e in job.events("worker_start"))
    fired = sorted((e["worker"], e["step"], e["phase"], e["how"]) for e in job.events("fault_self"))
    assert fired == [(1, 4, "forward", "kill"), (3, 7, "allreduce", "kill")]
    assert failure_steps(job) == [4, 7]
    assert job.commit_gen(3) == 0 and job.commit_gen(4) == 1 and job.commit_gen(7) == 2, \
        "each step that lost a worker is finished under the next view"
    assert no_work_after(job, 1, 4) and no_work_after(job, 3, 7), "a dead worker's work of its step must not count"
    # Neighbour takeover, same step: the ring successor adds the dead slot, approximated; its own slot,
    # computed exactly before the failure, is kept; from the next step on it approximates its whole load.
    assert job.committed_items(4) == [(0, 0, 0, MB, "exact"), (2, 1, 0, MB, "approx"), (2, 2, 0, MB, "exact"),
                                      (3, 3, 0, MB, "exact")]
    for step in (5, 6):
        assert job.committed_items(step) == [(0, 0, 0, MB, "exact"), (2, 1, 0, MB, "approx"),
                                             (2, 2, 0, MB, "approx"), (3, 3, 0, MB, "exact")]
    # Step 7: worker 3's slot goes to its ring successor 0, which had computed its own slot exactly.
    assert job.committed_items(7) == [(0, 0, 0, MB, "exact"), (2, 1, 0, MB, "approx"), (2, 2, 0, MB, "approx"),
                                      (0, 3, 0, MB, "approx")]
    for step in (8, 9):
        assert job.committed_items(step) == [(0, 0, 0, MB, "approx"), (2, 1, 0, MB, "approx"),
                                             (2, 2, 0, MB, "approx"), (0, 3, 0, MB, "approx")]
    assert job.summary["failures"] == 2


@pytest.mark.parametrize("backend", ["tcp", "etcd"])
def test_sigkill_right_after_confirm(tmp_path, corpus_overrides, backend, request, monkeypatch):
    """A worker that confirmed holds the reduced gradient: the step commits with its work; the next step sees the loss.

    Also on a 3-member etcd cluster whose leader is SIGKILLed after step 7: the same assertions (so that
    loss costs no step: step 5 stays the only one with a failure), and none of the job's keys left there.
    """
    fail_at, store = "step=4:worker=1:kill:phase=confirm", None
    if backend == "etcd":
        cluster = request.getfixturevalue("etcd_cluster")
        leader, store = cluster.leader(), cluster.url
        fail_at += f",step=7:store={leader}:kill"
        monkeypatch.setenv(STORE_PIDS_ENV, str(cluster.pids_file))
    cfg = failover_config(corpus_overrides, 10)
    try:
        job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=3, fail_at=fail_at, store=store)
    finally:
        if backend == "etcd":
            cluster.restart_member(leader)  # for the session's other tests
    if backend == "etcd":
        (fired,) = read_jsonl(job.run_dir / "events" / "store.jsonl")
        assert fired["member"] == leader and fired["committed"] >= 7
    check_invariants(job, live=[0, 2])
    (fired,) = job.events("fault_self", worker=1)
    assert (fired["step"], fired["phase"]) == (4, "confirm")
    assert job.commit_gen(4) == 0, "step 4 was confirmed by every member: it must commit in view 0"
    assert job.committed_items(4) == exact(0, 1, 2), "step 4 counts the dead worker's contribution"
    assert job.committers(4) == {0, 2}, "worker 1 died before applying step 4"
    assert failure_steps(job) == [5]
    view1 = [e for e in job.events("view_adopted") if e["gen"] == 1]
    assert view1 and all(e["step"] == 5 and e["members"] == [0, 2] for e in view1)
    assert job.slot_items(5, 1) == [(2, 1, 0, MB, "approx")]


def test_hang_and_blocked_main_thread_are_detected_and_fenced(tmp_path, corpus_overrides):
    """Worker 1 hangs (SIGSTOP at step 4: its heartbeat stops); worker 3's main thread blocks inside the
    all-reduce phase of step 8 while its heartbeat thread beats on (only progress detection finds it).
    Each time a peer declares it dead and its agent SIGKILLs it."""
    timeout, progress_timeout = 1.0, 3.0
    cfg = failover_config(corpus_overrides, 12, f"fault.heartbeat_timeout_s={timeout}",
                          f"fault.progress_timeout_s={progress_timeout}")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=4,
                  fail_at="step=4:worker=1:stop:phase=forward,step=8:worker=3:block:phase=allreduce")
    check_invariants(job, live=[0, 2])
    (stopped,) = job.events("fault_self", worker=1)
    assert (stopped["step"], stopped["how"]) == (4, "stop")
    (fence,) = job.events("fence", worker=1)
    mark = fence["reason"]
    assert mark["how"] == "heartbeat" and mark["by"] in (0, 2, 3) and mark["silent_s"] >= timeout
    # Judged on the observer's clock from the last beat it saw (beats every 0.1 s): not before the
    # timeout, and soon after it (generous bound: the machine may be loaded).
    detected = fence["t"] - stopped["time"]
    assert timeout - 0.2 <= detected <= timeout + 10.0, f"fenced {detected:.2f} s after the stop"
    (blocked,) = job.events("fault_self", worker=3)
    assert (blocked["step"], blocked["how"], blocked["phase"]) == (8, "block", "allreduce")
    (fence,) = job.events("fence", worker=3)
    assert fence["reason"]["how"] == "no progress" and fence["reason"]["by"] in (0, 2)
    detected = fence["t"] - blocked["time"]
    assert progress_timeout - 0.2 <= detected <= progress_timeout + 10.0, f"fenced {detected:.2f} s after the block"
    for w in (1, 3):
        (exit_,) = job.events("worker_exit", worker=w)
        assert exit_["fenced"] and exit_["signal"] == 9
    # Its agent asked the blocked worker where it hung before the SIGKILL: every thread's stack is in its log,
    # the main thread's ending in the injector's read (the stopped worker 1 could not answer)
    log = (job.run_dir / "logs" / "w3.log").read_text()
    assert "Current thread" in log, log[-3000:]
    main_thread = log[log.index("Current thread"):]
    assert " in _fire\n" in main_thread and " in _beat\n" in log, log[-3000:]
    # The blocked worker's contribution was posted before it blocked: step 8 commits with it, and the peers
    # find it stuck when they wait for it in step 9.
    assert (3, 3, 0, MB, "exact") in job.committed_items(8)
    assert failure_steps(job) == [4, 9]
    assert all(job.slot_items(s, 1) == [(2, 1, 0, MB, "approx")] for s in range(4, 12))
    assert all(job.slot_items(s, 3) == [(0, 3, 0, MB, "approx")] for s in range(9, 12))


def test_leader_dies_before_the_final_checkpoint_is_committed(tmp_path, corpus_overrides):
    """Worker 0 (the leader) is SIGKILLed after the last step with its final checkpoint begun: the others stay
    until ``done``; worker 1, the first live member, writes the final checkpoint and sets ``done``."""
    steps = 8
    cfg = failover_config(corpus_overrides, steps)
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2, fail_at=f"step={steps}:worker=0:kill:phase=finish")
    (fired,) = job.events("fault_self", worker=0)
    assert fired["phase"] == "finish" and fired["step"] == steps
    (takeover,) = job.events("final_checkpoint_takeover")
    assert takeover["worker"] == 1 and takeover["leader"] == 0 and takeover["step"] == steps
    assert job.summary["steps"] == steps and job.summary["checkpoint"].endswith(f"step_{steps:07d}")
    ledger = check_ledger(job.run_dir, n_slots=4, micro_batch=MB, steps=steps)
    assert ledger.ok and ledger.committed == steps
    reports = sorted(int(p.stem[1:]) for p in (job.run_dir / "workers").glob("w*.json"))
    assert reports == [1, 2, 3] and job.summary["workers_agree"]
    # Nothing failed before the last step was applied: the final checkpoint is the failure-free run's (to
    # float tolerance: 8 steps of differently ordered sums), and bit for bit the survivors' parameters.
    got, want = checkpoint_params(job.summary["checkpoint"]), reference_train(job.cfg)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-3, atol=1e-4, msg=name)
    digest = hashlib.sha256()
    for name in want:  # the model's parameter order, as the workers hash them
        digest.update(got[name].contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    assert digest.hexdigest() == json.loads((job.run_dir / "workers" / "w1.json").read_text())["param_digest"]


def test_node_loss(tmp_path, corpus_overrides):
    """Agent and workers of node 1 SIGKILLed together: nobody marks them, heartbeats tell."""
    cfg = failover_config(corpus_overrides, 12, STALL_TIMEOUT)
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2, fail_at="step=4:node=1:kill")
    check_invariants(job, live=[0, 1])
    (fired,) = job.events("fault_injected", node=1)
    assert fired["lost_node"] and fired["targets"] == [2, 3]
    (failed,) = failure_steps(job)
    assert failed >= 4, "the node is lost once step 4 is under way, not before"
    assert all(job.commit_gen(s) == 0 and job.committed_items(s) == exact(0, 1, 2, 3) for s in range(failed))
    # Killed mid-all-reduce, the node may leave worker 1's ring read failing after worker 0's completed: worker 0
    # commits, worker 1 lacks the step's sum and leaves to rejoin with the state (EXIT_REJOIN, started again
    # whatever the restart policy); worker 0 covers slot 1 meanwhile.
    rejoined = [e for e in job.events("worker_exit", worker=1) if e.get("code") == EXIT_REJOIN]
    assert all(e["fenced"] and not e["injected"] for e in rejoined)
    for step in range(failed, 12):  # worker 0 is the ring successor of both slot 2 and slot 3
        items = job.committed_items(step)
        assert [i for i in items if i[1] in (2, 3)] == [(0, 2, 0, MB, "approx"), (0, 3, 0, MB, "approx")]
        allowed = [[(1, 1, 0, MB, "exact")]] + ([[(0, 1, 0, MB, "approx")]] if rejoined else [])
        assert [i for i in items if i[1] == 1] in allowed
    assert job.summary["failures"] == 2 + len(rejoined)


def test_kill_the_covering_neighbour(tmp_path, corpus_overrides):
    """Worker 1 dies; worker 2 covers slot 1; worker 2 dies while covering: worker 3 covers both."""
    # No snapshots: a phase=allreduce fault fires after the step's other allreduce hooks, and the snapshot
    # fence among them waits for the last write to seal; under load its all-reduce had completed by then,
    # step 8 committed and the death was found at step 9 (this test is about the covering, not snapshots)
    cfg = failover_config(corpus_overrides, 12, "snapshot.every=0")
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2,
                  fail_at="step=4:worker=1:kill:phase=backward,step=8:worker=2:kill:phase=allreduce")
    check_invariants(job, live=[0, 3])
    assert failure_steps(job) == [4, 8]
    for step in range(4, 8):
        assert job.slot_items(step, 1) == [(2, 1, 0, MB, "approx")]
    # Worker 2 died with slot 1 and slot 2 in its all-reduce: both are recomputed for step 8.
    for step in range(8, 12):
        items = job.committed_items(step)
        assert [i for i in items if i[1] in (1, 2)] == [(3, 1, 0, MB, "approx"), (3, 2, 0, MB, "approx")]
    assert no_work_after(job, 2, 8)


def test_two_failures_in_one_step(tmp_path, corpus_overrides):
    """Workers 1 and 2 (on different nodes) die with their all-reduce of step 4 in flight."""
    cfg = failover_config(corpus_overrides, 10, STALL_TIMEOUT)
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2,
                  fail_at="step=4:worker=1:kill:phase=allreduce,step=4:worker=2:kill:phase=allreduce")
    check_invariants(job, live=[0, 3])
    assert sorted((e["worker"], e["step"]) for e in job.events("fault_self")) == [(1, 4), (2, 4)]
    assert failure_steps(job) == [4]
    # Worker 3 is the ring successor of both slots; its own slot, computed before the failure, is kept.
    assert job.committed_items(4) == [(0, 0, 0, MB, "exact"), (3, 1, 0, MB, "approx"), (3, 2, 0, MB, "approx"),
                                      (3, 3, 0, MB, "exact")]
    assert job.summary["failures"] == 2


def test_crash_and_hang_in_one_step(tmp_path, corpus_overrides):
    """Worker 1 crashes and worker 2 hangs in the same step (the deterministic form of two failures at once).

    The crash is marked by its agent at once; the hang only after the heartbeat
    timeout, so the view that drops worker 1 still holds worker 2, and its
    silence must be noticed while that view is being set up.
    """
    cfg = failover_config(corpus_overrides, 10, STALL_TIMEOUT)
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2,
                  fail_at="step=4:worker=1:kill:phase=forward,step=4:worker=2:stop:phase=forward")
    check_invariants(job, live=[0, 3])
    assert failure_steps(job) == [4]
    (fence,) = job.events("fence", worker=2)
    assert fence["reason"]["how"] == "heartbeat"
    assert [i for i in job.committed_items(4) if i[1] in (1, 2)] == [(3, 1, 0, MB, "approx"), (3, 2, 0, MB, "approx")]


def test_kill_then_rejoin(tmp_path, corpus_overrides):
    """Worker 1 dies at step 3, is restarted once step 5 is committed, rejoins and trains slot 1 again."""
    steps = REJOIN_STEPS
    cfg = failover_config(corpus_overrides, steps)
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=3,
                  fail_at="step=3:worker=1:kill:phase=forward:back=5", restart="on-failure", pace=True)
    check_invariants(job, live=[0, 1, 2])
    rejoined = job.events("rejoined", worker=1)
    assert len(rejoined) == 1, f"worker 1 rejoined {len(rejoined)} times (not at all: it never got ready)"
    back = rejoined[0]["step"]
    assert 5 <= back < steps - 1
    (start,) = job.events("worker_start", worker=1, join=True)
    assert start["progress"] >= 5, "restarted only once step 5 was committed"
    assert failure_steps(job) == [3]
    for step in range(3, back):
        assert job.slot_items(step, 1) == [(2, 1, 0, MB, "approx")]
    assert all(job.committed_items(s) == exact(0, 1, 2) for s in range(back + 1, steps)), \
        "after its rejoin step the worker trains its own slot and nobody is approximated"
    assert 1 in job.committers(back)
    report = summarize_run(job.run_dir)
    assert [(r["worker"], r["step"]) for r in report["rejoins"]] == [(1, back)]
    assert job.summary["restarts"] == 1 and job.summary["failures"] == 1
    # Its node's live workers snapshotted the admission step: it loads it from the node's memory.
    (loaded,) = job.events("rejoin_from_memory", worker=1)
    assert loaded["step"] == back and loaded["received"] == 0


def test_global_batch_kill_then_rejoin(tmp_path, corpus_overrides):
    """3 workers, 6 micro-batches a step (2 each, accumulated): worker 1 dies mid-step; its ring successor covers
    both its micro-batches, approximated, until it rejoins; then it trains its own two again. Every
    ``(step, slot, row)`` once."""
    steps = REJOIN_STEPS
    cfg = failover_config(corpus_overrides, steps, f"train.global_batch={6 * MB}")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=3,
                  fail_at="step=3:worker=1:kill:phase=backward:back=5", restart="on-failure", pace=True)
    check_invariants(job, live=[0, 1, 2])
    (rejoined,) = job.events("rejoined", worker=1)
    back = rejoined["step"]
    assert failure_steps(job) == [3]
    for step in range(3, back):
        assert [i for i in job.committed_items(step) if i[1] in (1, 4)] == [(2, 1, 0, MB, "approx"),
                                                                             (2, 4, 0, MB, "approx")]
    home = sorted(((w, k, 0, MB, "exact") for w in range(3) for k in (w, w + 3)), key=lambda i: (i[1], i[2]))
    assert all(job.committed_items(s) == home for s in range(back + 1, steps)), \
        "after its rejoin step every worker trains its own two micro-batches, exact"


def test_failure_during_rejoin(tmp_path, corpus_overrides):
    """The joiner dies in the very step it was admitted at, after receiving the state.

    When it will be admitted depends on how long it takes to start, so it gets a
    forward-phase kill at every step it could be admitted at (each with a ``back``
    at the end of the run: it is not restarted again). The first step it trains
    is the one it dies in: the step admitting it must still complete, without it.
    """
    steps = REJOIN_STEPS
    cfg = failover_config(corpus_overrides, steps)
    joiner_kills = [f"step={k}:worker=1:kill:phase=forward:back={steps}" for k in range(5, steps)]
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=3, restart="on-failure", pace=True,
                  fail_at=",".join(["step=3:worker=1:kill:phase=forward:back=5", *joiner_kills]))
    check_invariants(job, live=[0, 2])
    rejoined = job.events("rejoined", worker=1)
    assert len(rejoined) == 1, f"worker 1 rejoined {len(rejoined)} times (not at all: it never got ready)"
    admitted, gen = rejoined[0]["step"], rejoined[0]["gen"]
    first, died = job.events("fault_self", worker=1)
    assert first["step"] == 3 and (died["step"], died["phase"]) == (admitted, "forward")
    assert job.commit_gen(admitted) > gen, "the admitting view lost a member: the step completes in a later one"
    assert failure_steps(job) == [3, admitted]
    assert 1 not in {i[0] for i in job.committed_items(admitted)} and no_work_after(job, 1, admitted)
    assert all(job.slot_items(s, 1) == [(2, 1, 0, MB, "approx")] for s in range(admitted + 1, steps))
    assert job.summary["restarts"] == 1


@pytest.mark.parametrize("policy", ["spread", "spread-approx"])
def test_spread_policies_under_a_kill(tmp_path, corpus_overrides, policy):
    """The dead slot's rows are split over every survivor; approximated only under spread-approx."""
    cfg = failover_config(corpus_overrides, 10, f"mecefo.policy={policy}")
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2, fail_at="step=4:worker=1:kill:phase=backward")
    check_invariants(job, live=[0, 2, 3])
    assert failure_steps(job) == [4]
    mode = "exact" if policy == "spread" else "approx"
    # Step 4: the survivors keep their own slots and split slot 1, as the completion rule says.
    done = {w: [SlotWork(w, (0, MB))] for w in (0, 2, 3)}
    extra = POLICIES[policy].complete(n_slots=4, micro_batch=MB, live=[0, 2, 3], done=done)
    split = [(w, i.slot, *i.rows, i.mode) for w, items in extra.items() for i in items]
    assert {i[0] for i in split} == {0, 2, 3} and {(i[1], i[4]) for i in split} == {(1, mode)}
    assert job.committed_items(4) == sorted(exact(0, 2, 3) + split, key=lambda i: (i[1], i[2]))
    # From step 5 on, the policy's assignment: split_rows over the survivors, from position 1 * MB % 3 on.
    start = MB % 3
    split = [(w, 1, a, b, mode) for w, (a, b) in zip([0, 2, 3][start:] + [0, 2, 3][:start],
                                                      BatchSampler.split_rows(MB, 3))]
    for step in range(5, 10):
        assert job.committed_items(step) == sorted(exact(0, 2, 3) + split, key=lambda i: (i[1], i[2]))
    report = summarize_run(job.run_dir)
    assert report["approx_rows"] == (0 if policy == "spread" else 6 * MB)
    assert json.loads((job.run_dir / "config.json").read_text())["mecefo"]["policy"] == policy
