"""examples/slurm/train.sbatch on a real Slurm: a lost node is replaced by the allocation's spare, and a
requeued job resumes where it was.

The cluster (``_slurm_cluster.py``) is Debian's ``slurm-wlm`` on loopback: one slurmctld and three
slurmd on this machine, each its own node (``slurmd -N n1..n3``), so the job's ``srun`` step runs one
agent per node under three ``slurmstepd``. The job: the debug model on the CPU, 2 training nodes x 1
worker + 1 spare node. Once it trains, node 1 is lost from outside (SIGKILL to its agent, then its
worker): its srun task dies, the step goes on, the spare node takes rank 1 and its worker rejoins. Then
Slurm requeues the job (``scontrol requeue``, as after a node failure or a preemption): the batch script
runs again with ``SLURM_RESTART_COUNT=1``, the agents restore the job's newest state (snapshot memory or
checkpoint) and finish it. The script's verdict (``unbroken report``: every (step, slot, row) of the
whole run trained exactly once) is the job's exit code in Slurm.

Skipped, naming the install command, only where Slurm is not installed or its daemons cannot start.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest
from _slurm_cluster import LocalSlurm, SlurmUnavailable, free_ports

from unbroken.jsonl import read_jsonl
from unbroken.runtime.ledger import check_ledger

SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "train.sbatch"
STEPS = 60
KILL_AT_STEP = 8
REQUEUE_AT_STEP = 20


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    try:
        cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=3)
    except SlurmUnavailable as exc:
        pytest.skip(str(exc))
    yield cluster
    cluster.stop()


def _until(what: str, ready: Callable[[], Any], timeout_s: float, state: Callable[[], str]) -> Any:
    """Poll ``ready`` until it returns something truthy; fail naming ``what`` once the job ended or the time is up."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = ready()
        if value:
            return value
        now = state()
        if now not in ("PENDING", "CONFIGURING", "RUNNING"):
            raise AssertionError(f"the job ended ({now}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout_s:.0f} s (job {now})")
        time.sleep(0.05)


def _progress(run_dir: Path) -> int:
    return max((int(r["step"]) for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"), default=0)


def _pid(path: Path) -> int | None:
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _events(run_dir: Path, name: str, event: str) -> list[dict[str, Any]]:
    return [e for e in read_jsonl(run_dir / "events" / name) if e.get("event") == event]


@pytest.mark.timeout(300)
def test_a_lost_node_is_replaced_by_the_spare_and_a_requeued_job_resumes(slurm: LocalSlurm, tmp_path: Path,
                                                                         corpus_overrides: list[str]) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHON": sys.executable, "RUN_DIR": str(run_dir), "SPARE_NODES": "1", "WORKERS_PER_NODE": "1",
           "STORE_PORT": str(free_ports(1)[0])}
    env.pop("UNBROKEN_JOB_SECRET", None)  # the script makes the job's own (and keeps it for the requeue)
    config = ["--preset", "debug", "--steps", str(STEPS), "--train.device=cpu", "--train.val_every=0",
              "--train.checkpoint_every=10", *(f"--{o}" for o in corpus_overrides)]
    job_id = slurm.sbatch(["--nodes=3", f"--output={out}", str(SCRIPT), *config], env=env, cwd=tmp_path)

    def state() -> str:
        return slurm.job(job_id).get("JobState", "?")

    try:
        _until(f"step {KILL_AT_STEP} committed", lambda: _progress(run_dir) >= KILL_AT_STEP, 120, state)
        agent, worker = _pid(run_dir / "pids" / "agent1"), _pid(run_dir / "pids" / "w1")
        assert agent is not None and worker is not None, sorted(p.name for p in (run_dir / "pids").iterdir())
        os.kill(agent, signal.SIGKILL)  # the agent first, so that it cannot react; then its worker
        os.kill(worker, signal.SIGKILL)
        (took,) = _until("the spare node taking rank 1", lambda: _events(run_dir, "agent1.jsonl", "spare_took_over"),
                         30, state)
        rejoined = _until("the spare's worker 1 joining", lambda: [
            e for e in _events(run_dir, "agent1.jsonl", "worker_start") if e["t"] >= took["t"]], 30, state)
        _until(f"step {REQUEUE_AT_STEP} committed", lambda: _progress(run_dir) >= REQUEUE_AT_STEP, 60, state)
        slurm.run(["scontrol", "requeue", job_id])
        fields = slurm.wait_job(job_id, 120, restarts=1)
    finally:
        if state() in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            slurm.run(["scancel", job_id], check=False)
    output = out.read_text(errors="replace") if out.is_file() else "(no output)"
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", output[-4000:]

    # First run: srun saw node 1's task die and the step went on; the spare (task 2) took rank 1 once node
    # 1's agent and worker were gone, and its worker 1 joined the running job.
    assert "task 1: Killed" in output
    assert took["node"] == 1 and rejoined[0]["worker"] == 1 and rejoined[0]["join"], rejoined
    # Second run: the script saw SLURM_RESTART_COUNT=1 and resumed; the agents restored the newest state
    # (memory, or the checkpoint of step 10 or 20), short of the end: the job was requeued while it trained.
    # It trained to the end at full strength.
    assert f"train.sbatch: job {job_id} requeued (1): resuming {run_dir}" in output
    (restore,) = _events(run_dir, "agent0.jsonl", "job_restore")
    assert REQUEUE_AT_STEP - 10 <= restore["step"] < STEPS and restore["members"] == [0, 1], restore
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    assert train[-1]["step"] == STEPS and train[-1]["live_workers"] == 2

    cfg = json.loads((run_dir / "config.json").read_text())
    assert cfg["train"]["workers"] == 2 and cfg["train"]["steps"] == STEPS
    ledger = check_ledger(run_dir, n_slots=2, micro_batch=cfg["data"]["micro_batch"], steps=STEPS)
    assert ledger.ok and ledger.committed == STEPS, ledger.examples
    report = json.loads((run_dir / "report.json").read_text())  # the script's verdict
    assert report["ledger_ok"] is True and report["lost_steps"] == 0
