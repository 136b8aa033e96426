"""Silently wrong parameters in a real job (CPU, gloo): a bit flipped in one worker's parameters before its forward
pass is found by the replicas' checksums in the same step's reduction (:mod:`unbroken.runtime.param_check`).

With three workers the two that agree are a strict majority: the step is applied nowhere, the odd worker takes
the majority's parameters and the step is done again with the same rows, so the run ends bit for bit as the run
without the fault; flipped again in that step, the odd worker leaves fenced, the others take its rows over in the
same step, and it rejoins with a peer's state, so the run ends with every worker's parameters equal. With two
nobody can tell which is wrong: the job stops, naming both.
"""

from __future__ import annotations

import math

import pytest

from _faults import MICRO_BATCH, check_fenced_and_taken_over, check_invariants, failover_config, run_job
from unbroken.agent.launcher import JobFailed
from unbroken.report.run_report import summarize_run
from unbroken.runtime.ledger import check_ledger, read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def test_a_flipped_parameter_is_repaired_and_the_run_ends_bit_for_bit_as_without_it(tmp_path, corpus_overrides):
    cfg = failover_config(corpus_overrides, 6, "train.workers=3")
    clean = run_job(cfg, tmp_path / "clean", nodes=1, workers_per_node=3)
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=3, fail_at="step=3:worker=1:bitflip:target=param")
    check_invariants(job, live=[0, 1, 2])
    (e,) = job.events("fault_injected")
    assert (e["worker"], e["step"], e["how"], e["tensor"], e["applied"]) == (1, 3, "bitflip", "param", True)
    decided = job.events("param_mismatch")
    assert sorted((m["worker"], m["decision"], tuple(m["wrong"]), m["step"], m["gen"]) for m in decided) == [
        (w, "repair", (1,), 3, 0) for w in range(3)], "every member found it in the same attempt"
    (repaired,) = job.events("param_repaired")
    assert (repaired["worker"], repaired["step"], repaired["source"]) == (1, 3, 0)
    assert repaired["checksum"] == decided[0]["checksums"]["0"], "it holds the majority's parameters again"
    assert job.commit_gen(3) == 0 and not job.events("reconfigured") and not job.events("param_mismatch_fenced")
    assert job.committed_items(3) == [(w, w, 0, MICRO_BATCH, "exact") for w in range(3)], "done again, alike"
    assert job.summary["param_digest"] == clean.summary["param_digest"], "bit for bit the run without it"


def test_a_parameter_flipped_again_after_its_repair_fences_its_worker_which_rejoins(tmp_path, corpus_overrides):
    cfg = failover_config(corpus_overrides, 8, "train.workers=3")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=3, restart="on-failure", pace=True,
                  fail_at="step=3:worker=1:bitflip:target=param,step=3:worker=1:bitflip:target=param")
    check_invariants(job, live=[0, 1, 2])  # the ledger exactly once, every worker's parameters equal at the end
    assert job.summary["workers_agree"]
    assert [(e["worker"], e["step"], e["applied"]) for e in job.events("fault_injected")] == [(1, 3, True)] * 2
    (fenced,) = job.events("param_mismatch_fenced")
    assert (fenced["worker"], fenced["step"], fenced["gen"]) == (1, 3, 0)
    # Every member that read the reduction decided alike: the first attempt repaired, the second fenced; one still
    # polling its all-reduce when worker 1's mark arrived leaves the attempt for that death instead (it never
    # votes on it either way).
    decided = job.events("param_mismatch")
    assert {(m["decision"], tuple(m["wrong"]), m["step"], m["gen"]) for m in decided} == {
        ("repair", (1,), 3, 0), ("fence", (1,), 3, 0)}
    fence = [m for m in decided if m["decision"] == "fence"]
    assert 1 in {m["worker"] for m in fence} and len(fence) >= 2, decided
    check_fenced_and_taken_over(job, worker=1, step=3, by=2, rejoined="its agent replaced it, with a peer's state")
    assert all(math.isfinite(r["grad_norm"]) for r in job.train_records())
    failures = summarize_run(job.run_dir)["failure_details"]
    assert [(f["step"], f["gen"]) for f in failures] == [(3, 0)], "unbroken report lists it"


def test_a_flipped_parameter_between_two_workers_stops_the_job(tmp_path, corpus_overrides):
    cfg = failover_config(corpus_overrides, 6, "train.workers=2")
    with pytest.raises(JobFailed) as failed:
        run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=2, fail_at="step=3:worker=1:bitflip:target=param")
    message = str(failed.value)
    assert message.startswith("the job stopped: step 3: the parameters of workers 0 and 1 differ"), message
    assert "no strict majority" in message and "continue with: unbroken train --resume" in message
    records = read_events(tmp_path / "run")
    assert not [r for r in records if r.get("kind") == "commit" and r["step"] >= 3], "step 3 applied nowhere"
    assert sorted(r["worker"] for r in records if r.get("event") == "param_mismatch_stop") == [0, 1]


def test_under_hsdp_a_flipped_shard_takes_its_replica_out_and_the_others_train_on(tmp_path, corpus_overrides):
    """3 replicas of 2 ranks (one per node), a bit flipped in worker 3's shard (replica 1, shard index 1) at step
    3: only index 1's ranks see the checksums differ, the replica's word tells index 0's, so both ranks of replica
    1 leave (not restarted here) and replicas 0 and 2 finish step 3 and the run, every row once, equal."""
    cfg = failover_config(corpus_overrides, 8, "train.workers=6", "train.shard_degree=2", "mecefo.policy=spread",
                          "fault.heartbeat_timeout_s=6.0")
    job = run_job(cfg, tmp_path / "run", nodes=3, workers_per_node=2, fail_at="step=3:worker=3:bitflip:target=param")
    ledger = check_ledger(job.run_dir, n_slots=cfg.n_slots, micro_batch=cfg.data.micro_batch, steps=8)
    assert ledger.ok and ledger.committed == 8, ledger.to_json()
    assert job.summary["steps"] == 8 and job.summary["workers_agree"], job.summary["param_digest"]
    assert sorted(job.final_view()["members"]) == [0, 1, 4, 5]
    fenced = sorted((e["worker"], e["step"]) for e in job.events("param_mismatch_fenced"))
    assert fenced == [(2, 3), (3, 3)], fenced
    decided = job.events("param_mismatch")
    assert {(m["decision"], tuple(m["wrong"]), m["step"]) for m in decided} == {("fence", (2, 3), 3)}, decided
    assert job.commit_gen(3) > 0 and job.committers(3) == {0, 1, 4, 5}, "step 3 applied only without replica 1"
    assert {i[1] for i in job.committed_items(3)} == set(range(cfg.n_slots))
