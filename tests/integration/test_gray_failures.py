"""Gray failures injected into a real job (CPU, gloo, 2 workers): a slow worker, a flipped bit, a NaN; and a
process slowed from outside by ``unbroken chaos``.

Nothing detects them yet: the job trains through a slow worker and applies a wrong
or non-finite gradient like any other. Each scenario asserts that observable effect
and the worker's one ``fault_injected`` event with its detail.
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

from _faults import Job, check_invariants, failover_config, run_job
from _reference import checkpoint_params, reference_train
from unbroken.faults.chaos import run_chaos

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


def test_nan_in_one_workers_gradient_is_applied_everywhere(tmp_path, corpus_overrides):
    cfg = failover_config(corpus_overrides, 6, "train.workers=2")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=2, fail_at="step=3:worker=1:nan")
    check_invariants(job, live=[0, 1])
    (e,) = job.events("fault_injected")
    assert (e["worker"], e["step"], e["how"], e["tensor"], e["applied"]) == (1, 3, "nan", "grad", True)
    assert math.isfinite(e["before"]) and math.isnan(e["after"]) and e["param"] and e["index"] >= 0
    norms = {r["step"] - 1: r["grad_norm"] for r in job.train_records()}  # a train record counts committed steps
    assert math.isfinite(norms[2]) and math.isnan(norms[3]), "the reduced gradient of step 3 holds the NaN"
    params = checkpoint_params(job.summary["checkpoint"])
    assert not all(torch.isfinite(p).all() for p in params.values()), "nothing checks: the step applied it"


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
