"""examples/slurm/train.sbatch on a real Slurm, preempted: Slurm's warning signal stops the job with its final
checkpoint, the script requeues it, and the requeued run resumes losing no step.

The cluster is ``_slurm_cluster.py``'s (``slurm-wlm`` on loopback, one slurmd per node); the job: the debug
model on the CPU, 2 training nodes x 1 worker, no spare. Once it trains, the batch shell gets SIGUSR1
(``scancel --signal=USR1 --batch``: what ``#SBATCH --signal=B:USR1@120`` sends ahead of a time limit or a
preemption), hands it to the agents through srun; the job stops after one agreed step with a committed
checkpoint, the agents exit 75, the script requeues the job, and the requeued run (``SLURM_RESTART_COUNT=1``)
resumes from that checkpoint and finishes: every (step, slot, row) of both runs trained exactly once.

Skipped, naming the install command, only where Slurm is not installed or its daemons cannot start.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import Iterator

import pytest
from _slurm_cluster import LocalSlurm, SlurmUnavailable, free_ports
from test_slurm import SCRIPT, _events, _progress, _until

from unbroken.checkpoint.checkpointer import COMMIT_FILE, checkpoint_dir
from unbroken.jsonl import read_jsonl
from unbroken.runtime.ledger import check_ledger

STEPS = 60
SIGNAL_AT_STEP = 5


@pytest.fixture(scope="module")
def slurm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalSlurm]:
    try:
        cluster = LocalSlurm(tmp_path_factory.mktemp("slurm"), nodes=2)
    except SlurmUnavailable as exc:
        pytest.skip(str(exc))
    yield cluster
    cluster.stop()


@pytest.mark.timeout(300)
def test_slurms_warning_saves_requeues_and_the_job_resumes(slurm: LocalSlurm, tmp_path: Path,
                                                            corpus_overrides: list[str]) -> None:
    run_dir, out = tmp_path / "run", tmp_path / "job.out"
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
           "PYTHON": sys.executable, "RUN_DIR": str(run_dir), "SPARE_NODES": "0", "WORKERS_PER_NODE": "1",
           "STORE_PORT": str(free_ports(1)[0])}
    env.pop("UNBROKEN_JOB_SECRET", None)
    config = ["--preset", "debug", "--steps", str(STEPS), "--train.device=cpu", "--train.val_every=0",
              *(f"--{o}" for o in corpus_overrides)]
    job_id = slurm.sbatch(["--nodes=2", f"--output={out}", str(SCRIPT), *config], env=env, cwd=tmp_path)

    def state() -> str:
        return slurm.job(job_id).get("JobState", "?")

    try:
        _until(f"step {SIGNAL_AT_STEP} committed", lambda: _progress(run_dir) >= SIGNAL_AT_STEP, 120, state)
        slurm.run(["scancel", "--signal=USR1", "--batch", job_id])
        fields = slurm.wait_job(job_id, 150, restarts=1)
    finally:
        if state() in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            slurm.run(["scancel", job_id], check=False)
    output = out.read_text(errors="replace") if out.is_file() else "(no output)"
    assert fields["JobState"] == "COMPLETED" and fields["ExitCode"] == "0:0", output[-4000:]
    assert "train.sbatch: warned by Slurm (SIGUSR1)" in output, output[-4000:]
    assert "train.sbatch: srun exited with 75" in output and "requeue and `--resume`" in output, output[-4000:]
    assert f"train.sbatch: job {job_id} requeued (1): resuming {run_dir}" in output
    for r in range(2):
        assert [e for e in _events(run_dir, f"agent{r}.jsonl", "preempt_requested") if e["signal"] == "SIGUSR1"]
    # The first run stopped after one step every worker agreed, its final checkpoint committed; the second
    # continued from it.
    stops = {int(m) for m in re.findall(r"preempted: the job stopped after step (\d+)", output)}
    assert len(stops) == 1, output[-4000:]  # both agents name the same step
    (stopped,) = stops
    assert SIGNAL_AT_STEP <= stopped < STEPS and (checkpoint_dir(run_dir, stopped) / COMMIT_FILE).is_file()
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    assert train[-1]["step"] == STEPS
    cfg = json.loads((run_dir / "config.json").read_text())
    ledger = check_ledger(run_dir, n_slots=2, micro_batch=cfg["data"]["micro_batch"], steps=STEPS)
    assert ledger.ok and ledger.committed == STEPS and not ledger.rows_twice, ledger.examples
    report = json.loads((run_dir / "report.json").read_text())  # the requeued run's verdict
    assert report["ledger_ok"] is True and report["lost_steps"] == 0
