"""Launch and start-up defects, with real files, real processes and real stores.

- ``--overwrite`` replaces only a directory that holds an unbroken run (the
  launcher's preflight and the simulator share the rule, ``unbroken.job.run_dir``);
- checkpoint-restart hosts each attempt's store again on a fixed ``train.port``;
- the launcher's stall check counts committed steps, not metrics lines;
- an agent stopped for a second keeps its node rank, and a takeover waits
  until the previous holder's workers are silent.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _faults import failover_config, port_free, run_job, store_port
from test_agent import until
from unbroken.agent import launcher
from unbroken.agent.preflight import prepare_run_dir
from unbroken.agent.rendezvous import NodeRegistration, StartRefused
from unbroken.config import Config, load_config
from unbroken.job.simulator import simulate
from unbroken.jsonl import read_jsonl
from unbroken.store.job_store import JobStore
from unbroken.store.backend import job_secret

pytestmark = pytest.mark.timeout(120)

STANDIN = Path(__file__).with_name("standin_worker.py")
AGENT = ("import sys; from unbroken.agent.command import main; "
         f"sys.exit(main(sys.argv[1:], worker_cmd=[sys.executable, {str(STANDIN)!r}]))")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*"))


# -- 1. --overwrite ------------------------------------------------------------


def test_overwrite_refuses_a_directory_that_holds_no_run(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = Config()
    mine = tmp_path / "mine"
    (mine / "src").mkdir(parents=True)
    (mine / "src" / "thesis.tex").write_text("years of work")
    (mine / "config.json").write_text(json.dumps({"name": "some other tool's config"}))
    before = listing(mine)
    with pytest.raises(ValueError, match="holds no unbroken run") as err:
        prepare_run_dir(mine, cfg, overwrite=True, resume=False)
    assert str(mine) in str(err.value) and "choose a new or empty --out" in str(err.value)
    assert listing(mine) == before
    monkeypatch.chdir(mine)  # --out . --overwrite
    with pytest.raises(ValueError, match="holds no unbroken run"):
        prepare_run_dir(Path("."), cfg, overwrite=True, resume=False)
    assert listing(mine) == before


def test_overwrite_never_clears_the_home_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    home = tmp_path / "home"
    home.mkdir()
    (home / "config.json").write_text(json.dumps(Config().to_dict()))  # looks like a run: still refused
    (home / ".bashrc").write_text("# mine")
    monkeypatch.setenv("HOME", str(home))
    with pytest.raises(ValueError, match="home directory"):
        prepare_run_dir(Path(os.path.expanduser("~")), Config(), overwrite=True, resume=False)
    assert (home / ".bashrc").read_text() == "# mine"


def test_overwrite_replaces_a_run_directory(tmp_path: Path) -> None:
    cfg = Config()
    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    old = Config()
    old.optim.lr = cfg.optim.lr / 2  # (train.steps would not do: a --resume may extend a run)
    (run / "config.json").write_text(json.dumps(old.to_dict()))
    (run / "logs" / "w0.log").write_text("old run")
    outside = tmp_path / "outside.txt"
    outside.write_text("not the run's")
    (run / "link").symlink_to(outside)
    with pytest.raises(ValueError, match="already holds a different run") as err:
        prepare_run_dir(run, cfg, overwrite=False, resume=False)
    assert "--overwrite" in str(err.value) and "--resume" in str(err.value)
    assert prepare_run_dir(run, cfg, overwrite=True, resume=False) is None
    assert listing(run) == ["config.json", "job_id"]  # a new job: a new id names its snapshot memory
    assert json.loads((run / "config.json").read_text()) == cfg.to_dict()
    assert outside.read_text() == "not the run's", "a link is removed, never what it points to"


def test_simulator_overwrite_follows_the_same_rule(tmp_path: Path, corpus_overrides: list[str]) -> None:
    cfg = load_config(preset_name="debug", overrides=corpus_overrides + [
        "train.workers=2", "train.steps=2", "train.val_every=0", "train.val_batches=1", "data.micro_batch=2"])
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    with pytest.raises(ValueError, match="holds no unbroken run"):
        simulate(cfg, mine, overwrite=True)
    assert listing(mine) == ["notes.txt"]
    out = tmp_path / "sim"
    simulate(cfg, out)
    (out / "stray.txt").write_text("from the old run")
    simulate(cfg, out, overwrite=True)  # a simulator run is a run directory: replaced
    assert not (out / "stray.txt").exists() and (out / "summary.json").is_file()


# -- 5. checkpoint-restart on a fixed port -------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_checkpoint_restart_hosts_the_store_again_on_a_fixed_port(tmp_path: Path,
                                                                    corpus_overrides: list[str]) -> None:
    port = free_port()
    cfg = failover_config(corpus_overrides, 8, "fault.recovery=restart", f"train.port={port}",
                          "train.checkpoint_every=2")
    # Killed by itself in step 4's forward: in that step however busy the machine (its agent fires a plain
    # kill once it reads progress 4, possibly steps later, past the checkpoint of step 6).
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=2, fail_at="step=4:worker=1:kill:phase=forward")
    (restart,) = job.summary["job_restarts"]
    assert restart["restarted_from_step"] in (2, 4) and restart["failed_at_step"] >= restart["restarted_from_step"]
    assert job.summary["steps"] == 8 and job.summary["workers_agree"]
    headers = [line for line in (job.run_dir / "logs" / "w0.log").read_text().splitlines() if "--store" in line]
    assert len(headers) == 2 and all(f"127.0.0.1:{port}" in h for h in headers), headers
    assert store_port(job.run_dir) == port and port_free(port), "the last attempt's store is closed"


# -- 6. stall = no committed step, not no metrics line -------------------------


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_a_run_without_metrics_lines_is_not_a_stall(tmp_path: Path, corpus_overrides: list[str],
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """Steps commit every few tens of ms, but the only metrics line comes at the end, long after the limit.

    The limit holds from the first committed step on (the start keeps its own, generous one): 450 steps take
    several times the limit here, whatever the start cost."""
    limit_s = 3.0
    monkeypatch.setattr(launcher, "PROGRESS_TIMEOUT_S", limit_s, raising=False)
    cfg = failover_config(corpus_overrides, 450, "train.log_every=100000", f"train.timeout_s={limit_s}")
    job = run_job(cfg, tmp_path / "run", nodes=1, workers_per_node=2)
    lines = job.train_records()
    assert [r["step"] for r in lines] == [450] and job.summary["steps"] == 450
    first_commit = min(r["time"] for r in job.records if r.get("kind") == "commit")
    assert lines[0]["time"] - first_commit > limit_s, "the steps must outlast the limit for the test to mean anything"


# -- 7. node rank takeover -----------------------------------------------------


class Agents:
    """The test's side of a job of stand-in workers: the store, the run directory, the agents started."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        run_dir.mkdir(parents=True)
        self.store = JobStore.host("127.0.0.1", 0, clients=8, secret=job_secret(run_dir, create=True))
        self.addr = f"127.0.0.1:{self.store.port}"
        cfg = Config().to_dict()
        (run_dir / "config.json").write_text(json.dumps(cfg))
        self.store.publish_config(json.dumps(cfg))
        self.procs: list[subprocess.Popen[bytes]] = []

    def agent(self) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-c", AGENT, "--node-rank", "0", "--nnodes", "1", "--workers-per-node", "1",
               "--store", self.addr, "--run-dir", str(self.run_dir), "--timeout-s", "20", "--grace-s", "3"]
        return self._spawn(cmd, f"agent.{len(self.procs)}.out")

    def standin(self, worker: int) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, str(STANDIN), "--run-dir", str(self.run_dir), "--worker", str(worker),
               "--world", "1", "--store", self.addr]
        return self._spawn(cmd, f"standin.{len(self.procs)}.out")

    def _spawn(self, cmd: list[str], out: str) -> subprocess.Popen[bytes]:
        env = {k: v for k, v in os.environ.items() if k != "UNBROKEN_JOB_SECRET"}  # the run's secret file
        p = subprocess.Popen(cmd, stdout=(self.run_dir / out).open("wb"), stderr=subprocess.STDOUT, env=env)
        self.procs.append(p)
        return p

    def output(self, p: subprocess.Popen[bytes]) -> str:
        return next(self.run_dir.glob(f"*.{self.procs.index(p)}.out")).read_text()

    def worker_starts(self) -> list[dict[str, Any]]:
        return [e for e in read_jsonl(self.run_dir / "events" / "agent0.jsonl") if e["event"] == "worker_start"]


@pytest.fixture
def agents(tmp_path: Path) -> Iterator[Agents]:
    a = Agents(tmp_path / "run")
    try:
        yield a
    finally:
        a.store.set_done()  # stand-ins and agents finish on their own
        for p in a.procs:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.mark.slow
def test_an_agent_stopped_for_a_second_keeps_its_node_rank(agents: Agents) -> None:
    first = agents.agent()
    until(lambda: agents.store.heartbeats([0])[0] > 0, 30.0)  # its worker runs
    os.kill(first.pid, signal.SIGSTOP)
    stopped_at = time.monotonic()
    second = agents.agent()
    # The second agent is now judging the silent holder (or, as before this fix, has already replaced it).
    until(lambda: second.poll() is not None or any(s in agents.output(second) for s in
                                                  ("watching its heartbeat", "took over")), 30.0)
    time.sleep(max(0.0, 1.0 - (time.monotonic() - stopped_at)))
    os.kill(first.pid, signal.SIGCONT)
    assert second.wait(timeout=30) == 2, agents.output(second)
    assert f"an agent with node rank 0 is already running (pid {first.pid}" in agents.output(second)
    assert "took over" not in agents.output(second)
    assert first.poll() is None, "the first agent goes on after SIGCONT"
    assert [e["worker"] for e in agents.worker_starts()] == [0], "worker 0 was started once, by the first agent"
    agents.store.set_done()
    assert first.wait(timeout=15) == 0


@pytest.mark.slow
def test_a_takeover_waits_for_the_previous_holders_workers(agents: Agents) -> None:
    """The previous holder's agent is gone (its beat stands still) but its worker still beats for a while."""
    store = agents.store
    assert store.claim_node(0, "previous-holder") == "previous-holder"
    old_worker = agents.standin(0)
    until(lambda: store.heartbeats([0])[0] > 0, 30.0)
    killed_at: list[float] = []

    def kill_later() -> None:
        time.sleep(2.0)
        old_worker.kill()
        killed_at.append(time.monotonic())

    threading.Thread(target=kill_later, daemon=True).start()
    reg = NodeRegistration(store, 0, timeout_s=20.0, workers=[0], silence_s=1.0)
    reg.register()
    done_at = time.monotonic()
    assert reg.took_over and reg.registered
    assert old_worker.poll() is not None and killed_at, "registered while the old worker still ran"
    assert done_at - killed_at[0] >= 1.0 - 0.15, "the old worker must have been silent for the whole window"
    reg.release()


@pytest.mark.slow
def test_a_takeover_is_refused_while_the_previous_workers_run(agents: Agents) -> None:
    store = agents.store
    assert store.claim_node(0, "previous-holder") == "previous-holder"
    agents.standin(0)
    until(lambda: store.heartbeats([0])[0] > 0, 30.0)
    reg = NodeRegistration(store, 0, timeout_s=2.0, workers=[0], silence_s=0.5)
    with pytest.raises(StartRefused, match=r"workers \[0\] of the previous agent .* still beat"):
        reg.register()
    assert not reg.registered and not reg.took_over
    assert store.claim_node(0, "someone", expected="nobody") == "previous-holder", "the rank is given back"


@pytest.mark.slow
def test_a_takeover_from_a_holder_known_dead_waits_out_no_silence(agents: Agents) -> None:
    """The previous holder ran on this machine and its agent and worker are dead (pids gone): the rank is taken
    at once, not after TAKEOVER_SILENCE_S of the agent's and then of its workers' silence."""
    import socket

    store = agents.store
    old_agent = subprocess.Popen(["sleep", "120"])  # a real process playing the lost node's agent
    old_worker = agents.standin(0)
    until(lambda: store.heartbeats([0])[0] > 0, 30.0)
    assert store.claim_node(0, f"{socket.gethostname()}:{old_agent.pid}:0123abcd") != ""
    (agents.run_dir / "pids").mkdir(exist_ok=True)
    (agents.run_dir / "pids" / "w0").write_text(f"{old_worker.pid}\n")
    slow = NodeRegistration(store, 0, timeout_s=20.0, workers=[0], silence_s=30.0, pid_dir=agents.run_dir / "pids")
    assert not slow._known_dead(store.claim_node(0, "probe", expected="nobody")), "both still run"
    for p in (old_agent, old_worker):
        p.kill()
        p.wait(10)
    t0 = time.monotonic()
    slow.register()
    assert slow.took_over and slow.registered
    assert time.monotonic() - t0 < 5.0, "no 30 s silence was waited out"
    slow.release()
