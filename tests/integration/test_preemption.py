"""Preemption with real processes and real signals (CPU, gloo): a SIGTERM saves, ``--resume`` trains the rest.

A 2-node x 2-worker debug job through the command line; once every worker has
committed a few steps, both agents get SIGTERM (as Slurm signals a job step).
The job stops after one step agreed by every worker, with a committed final
checkpoint of that step, exit code 75 and a message that says "requeue and
``--resume``"; ``unbroken train --resume`` then trains the rest, and the ledger
is exactly-once over both runs.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unbroken.agent.preemption import EXIT_PREEMPTED
from unbroken.checkpoint.checkpointer import latest_checkpoint, read_commit
from unbroken.jsonl import read_jsonl
from unbroken.runtime.ledger import check_ledger

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]

STEPS = 200
"""Far more steps than the few before the signal: the job is still running when the agents get it."""
MICRO_BATCH = 4
SMALL = ["train.val_every=0", "train.val_batches=1", "optim.warmup_steps=2", "optim.eps=1e-6",
         f"data.micro_batch={MICRO_BATCH}", "data.seq_len=32", "mecefo.policy=neighbor"]
"""The failover tests' small steps (``tests/integration/_faults.py``)."""
WAIT_S = 180.0


def _unbroken() -> list[str]:
    script = Path(sys.executable).parent / "unbroken"
    return [str(script)] if script.is_file() else [sys.executable, "-m", "unbroken.cli"]


def _commits(run: Path, worker: int) -> list[int]:
    path = run / "events" / f"w{worker}.jsonl"
    return [r["step"] for r in read_jsonl(path) if r.get("kind") == "commit"] if path.is_file() else []


def _until(cond, what: str, proc: subprocess.Popen[str]) -> None:
    """Wait for ``cond`` (an event of the job), failing if the job exits first or ``WAIT_S`` passes."""
    t0 = time.monotonic()
    while not cond():
        assert proc.poll() is None, f"the job exited ({proc.returncode}) before {what}"
        assert time.monotonic() - t0 < WAIT_S, f"no {what} within {WAIT_S} s"
        time.sleep(0.02)


def test_sigterm_saves_a_final_checkpoint_and_resume_trains_the_rest(tmp_path, corpus_overrides):
    run = tmp_path / "run"
    overrides = [f"--{o}" for o in corpus_overrides + SMALL]
    cmd = [*_unbroken(), "train", "--preset", "debug", "--nodes", "2", "--workers-per-node", "2",
           "--steps", str(STEPS), "--out", str(run), *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _until(lambda: all(len(_commits(run, w)) >= 3 for w in range(4)), "3 steps committed by every worker", proc)
        agents = [int((run / "pids" / f"agent{r}").read_text().split()[0]) for r in range(2)]
        for pid in agents:
            os.kill(pid, signal.SIGTERM)
        out, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "requeue and `--resume`" in err, err[-3000:]
    stopped = json.loads((run / "summary.json").read_text())["preempted_after_step"]
    assert 3 <= stopped < STEPS
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and int(read_commit(ckpt)["step"]) == stopped, "the final checkpoint is committed"
    assert all(max(_commits(run, w)) == stopped - 1 for w in range(4)), "every worker stopped after the same step"
    first = check_ledger(run, n_slots=4, micro_batch=MICRO_BATCH, steps=stopped)
    assert first.ok, first.examples
    for r in range(2):
        events = read_jsonl(run / "events" / f"agent{r}.jsonl")
        assert [e for e in events if e.get("event") == "preempt_requested" and e.get("signal") == "SIGTERM"]

    resumed = subprocess.run([*_unbroken(), "train", "--resume", str(run)], capture_output=True, text=True,
                             timeout=WAIT_S + 60)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["resumed_from"].endswith(f"step_{stopped:07d}")
    assert "preempted_after_step" not in summary
    both = check_ledger(run, n_slots=4, micro_batch=MICRO_BATCH, steps=STEPS)
    assert both.ok and not both.rows_twice and not both.lost_steps, both.examples
    assert all(sorted(_commits(run, w)) == list(range(STEPS)) for w in range(4)), "each step trained once"


def test_sigusr1_to_the_launcher_saves_too(tmp_path, corpus_overrides):
    run = tmp_path / "run"
    overrides = [f"--{o}" for o in corpus_overrides + SMALL]
    cmd = [*_unbroken(), "train", "--preset", "debug", "--nodes", "2", "--workers-per-node", "1",
           "--steps", str(STEPS), "--out", str(run), *overrides]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _until(lambda: all(len(_commits(run, w)) >= 2 for w in range(2)), "2 steps committed by every worker", proc)
        proc.send_signal(signal.SIGUSR1)  # a scheduler's warning to the launcher (Slurm: --signal=USR1@120)
        _, err = proc.communicate(timeout=WAIT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == EXIT_PREEMPTED, err[-3000:]
    assert "requeue and `--resume`" in err
    stopped = json.loads((run / "summary.json").read_text())["preempted_after_step"]
    ckpt = latest_checkpoint(run)
    assert ckpt is not None and int(read_commit(ckpt)["step"]) == stopped < STEPS
    assert all(max(_commits(run, w)) == stopped - 1 for w in range(2)), "every worker stopped after the same step"
    ledger = check_ledger(run, n_slots=2, micro_batch=MICRO_BATCH, steps=stopped)
    assert ledger.ok, ledger.examples


def _health_checked_job(tmp_path: Path, corpus_overrides: list[str], check: str,
                        *extra: str) -> tuple[subprocess.CompletedProcess[str], Path]:
    run = tmp_path / "run"
    overrides = [f"--{o}" for o in corpus_overrides + SMALL]
    cmd = [*_unbroken(), "train", "--preset", "debug", "--nodes", "2", "--workers-per-node", "1", "--steps", "4",
           "--out", str(run), "--health-check", check, *extra, *overrides]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=WAIT_S), run


def _health_events(run: Path) -> dict[int, dict]:
    return {r: e for r in range(2) for e in read_jsonl(run / "events" / f"agent{r}.jsonl")
            if e.get("event") == "health_check"}


def test_a_failing_health_check_keeps_its_node_out(tmp_path, corpus_overrides):
    # The first node to run it passes, the other fails with a driver's complaint on stdout.
    lock = tmp_path / "healthy"
    proc, run = _health_checked_job(tmp_path, corpus_overrides,
                                    f"mkdir {lock} 2>/dev/null && echo healthy || {{ echo 'GPU 0: Xid 79'; exit 3; }}")
    assert proc.returncode == 1, proc.stderr[-3000:]
    events = _health_events(run)
    failed = [r for r, e in events.items() if not e["ok"]]
    assert len(failed) == 1 and events[failed[0]]["code"] == 3 and "GPU 0: Xid 79" in events[failed[0]]["output"]
    assert f"agent of node {failed[0]} exited with code 2" in proc.stderr
    assert "exited with code 3: the node stays out" in proc.stderr
    assert not (run / "events" / f"w{failed[0]}.jsonl").exists(), "the node started no worker"


def test_a_hanging_health_check_is_killed_and_keeps_its_node_out(tmp_path, corpus_overrides):
    proc, run = _health_checked_job(tmp_path, corpus_overrides, "echo checking; sleep 600",
                                    "--health-check-timeout-s", "1")
    assert proc.returncode == 1, proc.stderr[-3000:]
    events = _health_events(run)
    assert events and all(e["hung"] and not e["ok"] and e["output"] == "checking\n" for e in events.values())
    assert "did not finish within its timeout and was killed: the node stays out" in proc.stderr
    assert not list((run / "events").glob("w*.jsonl")), "no node started a worker"


def test_preempt_save_benchmark_runs(corpus_overrides):
    from benchmarks import preempt_save

    result = preempt_save.main(["--preset", "debug", "--workers-per-node", "2", "--after-steps", "2",
                                *corpus_overrides, *SMALL])
    [run] = result["runs"]
    assert run["stopped_after_step"] >= 2 and 0 < run["sigterm_to_commit_s"] <= run["sigterm_to_exit_s"]
    assert run["final_checkpoint_write_s"] is not None and run["checkpoint_bytes"] > 0
