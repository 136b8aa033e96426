"""The loss of the job's store, injected from outside (``--fail-at step=N:store=I:kill``).

- Embedded ``TCPStore``: the launcher that hosts it is SIGKILLed (its machine is
  lost). Every agent and worker must exit by itself, the agents saying why; the
  committed checkpoint stays; ``--resume`` finishes the job.
- etcd without quorum (two members of three SIGKILLed): the job waits
  ``fault.store_timeout_s``, saying so, then stops cleanly (every agent and
  worker exits, a message says how to continue, the committed checkpoint and
  the snapshot memory stay, the run is resumable).

(The loss of an etcd member, which must cost no step, is asserted with the etcd variant of
``test_failover.py::test_sigkill_right_after_confirm``: one job, both faults.)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from _faults import _ours_alive
from unbroken.agent.launcher import StoreLost, launch
from unbroken.agent.preflight import prepare_run_dir
from unbroken.config import load_config
from unbroken.faults.store_loss import STORE_PIDS_ENV
from unbroken.jsonl import read_jsonl
from unbroken.checkpoint.checkpointer import latest_checkpoint, read_commit
from unbroken.snapshot.segment import segment_dir

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

EXIT_WAIT_S = 60.0
"""How long the orphaned agents and workers may take to notice the loss and exit (their grace included)."""


def _job_pids(run_dir: Path) -> set[int]:
    """The agents (pid files, present while they run) and every worker they started (their events)."""
    pids = set()
    for path in (run_dir / "pids").glob("agent*"):
        try:
            pids.add(int(path.read_text().split()[0]))
        except (OSError, ValueError, IndexError):
            pass  # the agent has just removed it: it is gone
    for path in (run_dir / "events").glob("agent*.jsonl"):
        for e in read_jsonl(path):
            pids.update([e["pid"]] if "pid" in e else [])
    return pids


def _wait_all_exited(pids: set[int], run: Path, limit_s: float) -> list[int]:
    deadline = time.monotonic() + limit_s
    while (alive := [p for p in pids if _ours_alive(p, run)]) and time.monotonic() < deadline:
        time.sleep(0.2)
    return alive


def test_embedded_store_host_loss_stops_cleanly_and_resume_finishes(tmp_path, corpus_overrides):
    run = tmp_path / "run"
    overrides = [f"--{o}" for o in corpus_overrides] + ["--train.checkpoint_every=3", "--train.val_every=0"]
    cmd = [sys.executable, "-m", "unbroken.cli", "train", "--preset", "debug", "--workers", "2", "--steps", "12",
           "--out", str(run), "--fail-at", "step=6:store=0:kill", *overrides]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env={**os.environ})
    assert proc.returncode == -9, f"the launcher (the store's host) was to be SIGKILLed:\n{proc.stderr[-2000:]}"
    (fired,) = read_jsonl(run / "events" / "store.jsonl")
    assert fired["event"] == "store_fault" and fired["committed"] >= 6
    pids = _job_pids(run)
    assert pids, "no agent or worker was seen"
    alive = _wait_all_exited(pids, run, EXIT_WAIT_S)
    assert not alive, f"agents or workers still running {EXIT_WAIT_S:.0f} s after the store's host died: {alive}"
    log = (run / "logs" / "agent0.log").read_text()
    assert "lost the store" in log and f"unbroken train --resume {run}" in log, log[-2000:]
    kept = latest_checkpoint(run)
    assert kept is not None and 3 <= int(read_commit(kept)["step"]) <= fired["committed"]

    resumed = subprocess.run([sys.executable, "-m", "unbroken.cli", "train", "--resume", str(run)],
                             capture_output=True, text=True, timeout=180)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 12 and summary["workers_agree"]
    assert summary["resumed_from"] == str(kept)
    assert len(read_jsonl(run / "events" / "store.jsonl")) == 1, "the resumed job must not kill its store again"


STORE_TIMEOUT_S = 4.0


def test_etcd_without_quorum_stops_cleanly_after_the_store_timeout(tmp_path, corpus_overrides,
                                                                                      monkeypatch, caplog):
    pytest.importorskip("etcd3gw", reason="the etcd client is not installed: pip install 'unbroken[etcd]'")
    from unbroken.store.local_etcd import EtcdNotFound, LocalEtcd

    try:
        cluster = LocalEtcd(3)
    except EtcdNotFound as exc:
        pytest.skip(str(exc))
    run, shm_before = tmp_path / "run", set(segment_dir().glob("unbroken-*"))
    cfg = load_config(preset_name="debug", overrides=corpus_overrides + [
        "train.workers=2", "train.steps=12", "train.checkpoint_every=3", "train.val_every=0",
        f"fault.store_timeout_s={STORE_TIMEOUT_S}"])
    monkeypatch.setenv(STORE_PIDS_ENV, str(cluster.pids_file))
    try:
        with pytest.raises(StoreLost) as lost:
            launch(cfg, run, nodes=1, workers_per_node=2, store=cluster.url,
                   fail_at="step=6:store=1:kill,step=6:store=2:kill")
        stopped = time.time()
        fired = read_jsonl(run / "events" / "store.jsonl")
        assert [e["member"] for e in fired] == [1, 2] and fired[0]["committed"] >= 6
        # The launcher waited the store timeout (saying so), then stopped every agent, which stopped its workers.
        assert STORE_TIMEOUT_S <= stopped - fired[-1]["time"] < STORE_TIMEOUT_S + 15
        assert "no member answers with quorum" in caplog.text and "fault.store_timeout_s" in caplog.text
        message = str(lost.value)
        assert f"lost the job store {cluster.url}" in message
        assert f"unbroken train --resume {run} --store {cluster.url}" in message
        pids = _job_pids(run)
        assert pids and not _wait_all_exited(pids, run, 1.0), "an agent or worker outlived the launcher"
        log = (run / "logs" / "agent0.log").read_text()
        assert "no member answers with quorum" in log, log[-2000:]
        kept = latest_checkpoint(run)
        assert kept is not None and 3 <= int(read_commit(kept)["step"]) <= fired[0]["committed"]
        assert f"(step {read_commit(kept)['step']})" in message
        assert set(segment_dir().glob("unbroken-*")) - shm_before, "the snapshot memory was kept for --resume"

        # --resume is not run here (a second start-up; the embedded store's test runs one): what it
        # needs is asserted above, and preflight accepts the run.
        assert prepare_run_dir(run, cfg, overwrite=False, resume=True) == kept
    finally:
        cluster.stop()
