"""Gray failures injected into a real job (CPU, gloo, 2 workers): a slow worker, a flipped bit, a NaN; and a
process slowed from outside by ``unbroken chaos``.

Here the job trains through a slow worker (its rows move only with ``fault.straggler_factor``:
tests/integration/test_straggler_job.py) and applies a wrong gradient like any other (wrong
parameters are caught by the parameter check: tests/integration/test_param_check_job.py). A
non-finite one is applied nowhere
(:mod:`unbroken.runtime.nonfinite`): the step is done again with the same rows, a
worker whose rows stay non-finite is fenced, and rows non-finite on any other worker
too stop the job. Each scenario asserts that observable effect and the worker's
``fault_injected`` events with their detail.
"""

from __future__ import annotations

import json
import math
import statistics
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

from _faults import MICRO_BATCH, Job, check_fenced_and_taken_over, check_invariants, failover_config, run_job
from _reference import checkpoint_params, reference_train
from unbroken.agent.launcher import JobFailed
from unbroken.faults.chaos import run_chaos
from unbroken.report.run_report import summarize_run
from unbroken.runtime.ledger import read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def compute_seconds(job: Job, worker: int, step: int) -> float:
    """From ``worker``'s commit of ``step - 1`` to its ledger record of ``step``: its compute of ``step``, in
    its own events (the record precedes its all-reduce, so waiting for a slower peer is not in it)."""
    (done,) = [r["time"] for r in job.records if r.get("kind") == "commit" and r["worker"] == worker
               and r["step"] == step - 1]
    (work,) = [r["time"] for r in job.records if r.get("kind") == "work" and r["worker"] == worker
               and r["step"] == step]
    return work - done


def test_slow_worker_computes_its_steps_factor_times_as_long(tmp_path, corpus_overrides):
    cfg = failover_config(corpus_overrides, 10, "train.workers=2", "data.seq_len=128")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=2, fail_at="step=3:worker=1:slow:factor=3:for=5")
    check_invariants(job, live=[0, 1])
    (e,) = job.events("fault_injected")
    assert (e["worker"], e["step"], e["how"], e["factor"], e["for_steps"]) == (1, 3, "slow", 3.0, 5)
    assert e["spec"] == "step=3:worker=1:slow:factor=3.0:for=5" and e["compute_s"] > 0
    ratios = [compute_seconds(job, 1, s) / compute_seconds(job, 0, s) for s in range(3, 8)]
    assert statistics.median(ratios) >= 1.5, f"worker 1's compute over worker 0's, steps 3-7: {ratios}"
    assert job.summary["failures"] == 0 and not job.events("attempt_aborted"), "today the job trains through it"


@pytest.mark.parametrize("layout", ["replicated", "zero1"])
def test_nan_in_one_workers_gradient_is_applied_nowhere(tmp_path, corpus_overrides, layout):
    """A NaN at step 3: the step is done again with the same rows, and the job ends bit for bit as without it.
    With ZeRO-1 (each member updates its range of the moments before the vote) too: the check precedes it."""
    cfg = failover_config(corpus_overrides, 6, "train.workers=2",
                          *(["train.shard_optimizer=true"] if layout == "zero1" else []))
    clean = run_job(cfg, tmp_path / "clean", nodes=1, workers_per_node=2)
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=2, fail_at="step=3:worker=1:nan")
    check_invariants(job, live=[0, 1])
    (e,) = job.events("fault_injected")
    assert (e["worker"], e["step"], e["how"], e["tensor"], e["applied"]) == (1, 3, "nan", "grad", True)
    assert math.isfinite(e["before"]) and math.isnan(e["after"]) and e["param"] and e["index"] >= 0
    assert sorted((n["worker"], n["step"], n["gen"], n["decision"]) for n in job.events("nonfinite_step")) == [
        (0, 3, 0, "retry"), (1, 3, 0, "retry")], "every member found it, in the same attempt, and did it again"
    assert all(math.isfinite(r["grad_norm"]) for r in job.train_records()), "no optimizer step applied it"
    assert job.committed_items(3) == [(0, 0, 0, MICRO_BATCH, "exact"), (1, 1, 0, MICRO_BATCH, "exact")], \
        "the ledger holds each row of step 3 once, in the view it was computed in"
    assert job.commit_gen(3) == 0 and not job.events("reconfigured"), "done again in the same view"
    assert job.summary["param_digest"] == clean.summary["param_digest"], "bit for bit the run without it"
    failures = summarize_run(job.run_dir)["failure_details"]
    assert [(f["step"], f["gen"], f["reason"].startswith("non-finite")) for f in failures] == [(3, 0, True)], \
        "unbroken report lists it"


def test_nan_under_hsdp_is_applied_nowhere(tmp_path, corpus_overrides):
    """HSDP (2 replicas of 2 ranks): a NaN in one rank's gradient shard at step 3 reaches only its shard index's
    reduction; the replicas' word on their reductions carries it to every rank, the step is done again with the
    same rows, and the job ends bit for bit as without it."""
    cfg = failover_config(corpus_overrides, 6, "train.shard_degree=2")
    clean = run_job(cfg, tmp_path / "clean", nodes=2, workers_per_node=2)
    job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2, fail_at="step=3:worker=3:nan")
    check_invariants(job, live=[0, 1, 2, 3])
    (e,) = job.events("fault_injected")
    assert (e["worker"], e["step"], e["applied"]) == (3, 3, True) and math.isnan(e["after"]), e
    assert sorted((n["worker"], n["step"], n["decision"]) for n in job.events("nonfinite_step")) == [
        (w, 3, "retry") for w in range(4)], "every rank of every replica found it and did it again"
    assert job.commit_gen(3) == 0 and all(math.isfinite(r["grad_norm"]) for r in job.train_records())
    assert job.summary["param_digest"] == clean.summary["param_digest"], "bit for bit the run without it"


def test_nan_recurring_in_one_workers_rows_fences_it(tmp_path, corpus_overrides):
    """The same worker's rows non-finite twice at step 3: it leaves fenced (its agent brings it back), the other
    covers its rows in the same step, and the job goes on."""
    cfg = failover_config(corpus_overrides, 12, "train.workers=3")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=3, restart="on-failure", pace=True,
                  fail_at="step=3:worker=1:nan,step=3:worker=1:nan")
    check_invariants(job, live=[0, 1, 2])
    assert len(job.events("fault_injected", worker=1)) == 2
    (fenced,) = job.events("nonfinite_fenced")
    assert (fenced["worker"], fenced["step"], fenced["items"]) == (1, 3, [[1, 0, MICRO_BATCH, "exact"]])
    check_fenced_and_taken_over(job, worker=1, step=3, by=2, rejoined="its agent replaced it")
    assert all(math.isfinite(r["grad_norm"]) for r in job.train_records())


def test_nan_recurring_on_two_workers_rows_stops_the_job(tmp_path, corpus_overrides):
    """Both workers' rows of step 3 non-finite again on the retry: the job stops, naming the step and the slots,
    with the run's snapshot memory kept for ``--resume``."""
    cfg = failover_config(corpus_overrides, 6, "train.workers=2")
    with pytest.raises(JobFailed) as failed:
        run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=2,
                fail_at="step=3:worker=0:nan,step=3:worker=0:nan,step=3:worker=1:nan,step=3:worker=1:nan")
    message = str(failed.value)
    assert message.startswith("the job stopped: step 3's reduced gradient was not finite again on the retry with "
                              "the same rows, from the rows of 2 member(s); worker "), message
    assert "gave non-finite gradients" in message and "slot " in message
    assert "continue with: unbroken train --resume" in message
    records = read_events(tmp_path / "run")
    assert not [r for r in records if r.get("kind") == "commit" and r["step"] >= 3], "step 3 applied nowhere"
    # Every member decides alike; the first to stop fails the job, and on a busy machine its agent may stop the
    # other before that one wrote its own record.
    stops = [r for r in records if r.get("event") == "nonfinite_stop"]
    assert stops and all((r["step"], r["culprits"]) == (3, 2) for r in stops), stops


def test_bitflip_in_one_workers_gradient_changes_the_final_parameters(tmp_path, corpus_overrides):
    cfg = failover_config(corpus_overrides, 6, "train.workers=2")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=2, fail_at="step=3:worker=1:bitflip:target=grad")
    check_invariants(job, live=[0, 1])
    (e,) = job.events("fault_injected")
    assert (e["worker"], e["step"], e["how"], e["tensor"], e["applied"]) == (1, 3, "bitflip", "grad", True)
    assert 23 <= e["bit"] <= 30 and e["before"] != e["after"] and e["param"] and e["index"] >= 0
    got, want = checkpoint_params(job.summary["checkpoint"]), reference_train(cfg)
    assert got.keys() == want.keys()
    # The run without the fault equals the reference to this tolerance (test_failover.py's first scenario).
    differ = [n for n in want if not torch.allclose(got[n], want[n], rtol=1e-4, atol=1e-5)]
    assert e["param"] in differ, f"the flipped element's parameter {e['param']} trained as without it"


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_chaos_slows_a_running_process_until_its_steps_are_over(tmp_path):
    """``unbroken chaos`` from outside: the process named by ``pids/w1`` is stopped part of every period from
    progress 2 on, and left running once the progress reaches step + for."""
    run_dir = tmp_path / "run"
    (run_dir / "pids").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"train": {"steps": 100}}))
    metrics = run_dir / "metrics.jsonl"
    metrics.write_text(json.dumps({"kind": "train", "step": 1}) + "\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.001)"])
    try:
        (run_dir / "pids" / "w1").write_text(f"{proc.pid}\n")
        events: list[dict] = []
        seen = threading.Event()

        def on_event(e: dict) -> None:
            events.append(e)
            seen.set()

        chaos = threading.Thread(target=run_chaos, args=(run_dir, "step=2:worker=1:slow:factor=4:for=3"),
                                 kwargs={"timeout_s": 120, "on_event": on_event})
        chaos.start()
        with metrics.open("a") as f:
            f.write(json.dumps({"kind": "train", "step": 2}) + "\n")
        assert seen.wait(60), "the slow fault fired at progress 2"
        stopped = False
        while not stopped and chaos.is_alive():  # waits for the state to be seen, not for a time
            stopped = _state(proc.pid) == "T"
        assert stopped, "the process was stopped part of the time"
        with metrics.open("a") as f:
            f.write(json.dumps({"kind": "train", "step": 5}) + "\n")
        chaos.join(60)
        assert not chaos.is_alive()
        assert [(e["event"], e["spec"], e["pids"]) for e in events] == [
            ("fault_injected", "step=2:worker=1:slow:factor=4.0:for=3", [proc.pid]),
            ("fault_resumed", "step=2:worker=1:slow:factor=4.0:for=3", [proc.pid])]
        assert events[0]["signal"] == "SIGSTOP" and events[0]["duty"] == 0.25
        assert _state(proc.pid) != "T" and proc.poll() is None, "left running"
    finally:
        proc.kill()
        proc.wait(10)


def test_chaos_slowdown_ends_with_its_process(tmp_path):
    """A slow fault without for= lasts to the end, or until the worker it slows is gone: then the tool is done."""
    run_dir = tmp_path / "run"
    (run_dir / "pids").mkdir(parents=True)
    (run_dir / "config.json").write_text(json.dumps({"train": {"steps": 100}}))
    (run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 3}) + "\n")
    proc = subprocess.Popen([sys.executable, "-c", "import time\nwhile True: time.sleep(0.001)"])
    (run_dir / "pids" / "w0").write_text(f"{proc.pid}\n")
    fired = threading.Event()
    events: list[dict] = []
    chaos = threading.Thread(target=run_chaos, args=(run_dir, "step=1:worker=0:slow:factor=2"),
                             kwargs={"timeout_s": 120, "on_event": lambda e: (events.append(e), fired.set())})
    chaos.start()
    try:
        assert fired.wait(60)
    finally:
        proc.kill()
        proc.wait(10)
    chaos.join(60)
    assert not chaos.is_alive(), "the slowdown ended with the process"
    assert [(e["event"], e["pids"]) for e in events] == [("fault_injected", [proc.pid]), ("fault_resumed", [])]
