"""The failover scenarios on the etcd job store: one job, the same faults and the same assertions.

``tests/integration/test_failover.py`` runs each scenario as its own job on
the embedded TCPStore. Here one job on a real 3-member etcd cluster (2 nodes
x 3 workers, ``neighbor``) meets, one after the other: a SIGKILL with the
all-reduce in flight, a SIGSTOP hang (heartbeat detection), a SIGKILL right
after the commit vote, a main thread that blocks while its heartbeat beats on
(progress detection), and the loss of the etcd leader. The end state is
checked as for every TCPStore scenario (:func:`_faults.check_invariants`:
every step done, the ledger exact, identical parameters, no process or key
left), and each failure where it must show.
"""

from __future__ import annotations

import pytest

from _faults import check_invariants, failover_config, run_job
from unbroken.report.run_report import summarize_run
from unbroken.faults.store_loss import STORE_PIDS_ENV
from unbroken.jsonl import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_failover_scenarios_on_etcd(tmp_path, corpus_overrides, etcd_cluster, monkeypatch):
    leader = etcd_cluster.leader()
    monkeypatch.setenv(STORE_PIDS_ENV, str(etcd_cluster.pids_file))
    # A heartbeat and a progress timeout well above a loaded start-up's silences (six workers starting on two
    # cores in a full test run: a starting worker's heartbeat thread was once silent for 1.02 s, and two workers
    # were judged dead before their faults could fire).
    cfg = failover_config(corpus_overrides, 30, "fault.heartbeat_timeout_s=2.5", "fault.progress_timeout_s=6.0",
                          "train.timeout_s=30")
    faults = ("step=4:worker=1:kill:phase=allreduce,step=8:worker=2:stop:phase=forward,"
              "step=12:worker=4:kill:phase=confirm,step=16:worker=5:block:phase=allreduce,"
              f"step=20:store={leader}:kill")
    try:
        job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=3, fail_at=faults, store=etcd_cluster.url)
    finally:
        etcd_cluster.restart_member(leader)  # for the session's other tests
    check_invariants(job, live=[0, 3])  # also: none of the job's keys left on the cluster
    fired = {(e["worker"], e["step"], e["how"], e["phase"]) for e in job.events("fault_self")}
    assert fired == {(1, 4, "kill", "allreduce"), (2, 8, "stop", "forward"), (4, 12, "kill", "confirm"),
                     (5, 16, "block", "allreduce")}
    (store_kill,) = read_jsonl(job.run_dir / "events" / "store.jsonl")
    assert store_kill["member"] == leader and store_kill["committed"] >= 20
    # The kill after the vote counts its step in view order; every other fault fails the step it hit or the
    # next (a blocked worker's all-reduce was posted before it stuck), and the leader's loss fails none.
    failed = sorted({f["step"] for f in summarize_run(job.run_dir)["failure_details"]})
    assert failed[:2] == [4, 8] and 13 in failed and (16 in failed or 17 in failed) and max(failed) <= 17, failed
    fences = {e["worker"]: e["reason"]["how"] for e in job.events("fence")}
    assert fences.get(5) == "no progress", fences
    assert job.committed_items(12) and 4 in {i[0] for i in job.committed_items(12)}, "step 12 counts worker 4"
    assert job.summary["failures"] == 4
    # Each live worker's etcd requests reach its store_latency reports (the last one at its last step).
    latency = {e["worker"]: e for e in job.events("store_latency")}
    assert set(latency) >= {0, 3} and all(latency[w]["calls"] > 0 and latency[w]["p99_s"] > 0 for w in (0, 3))
