"""The agent with real processes and real signals, around a stand-in worker (no model).

The test process hosts the store and plays the rest of the job: it publishes
the config (as the launcher does), sets ``progress`` / ``done`` / ``failed`` (as
the metrics leader does) and marks workers dead (as a peer does). Every test
checks at the end that no process it caused is left (``os.kill(pid, 0)``).
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from unbroken.agent.agent_server import agent_server
from unbroken.config import Config
from unbroken.faults.fail_at import fail_at
from unbroken.jsonl import read_jsonl
from unbroken.store.job_store import JobStore
from unbroken.store.backend import job_secret
from unbroken.store.view import View

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STANDIN = Path(__file__).with_name("standin_worker.py")
AGENT = ("import sys; from unbroken.agent.command import main; "
         f"sys.exit(main(sys.argv[1:], worker_cmd=[sys.executable, {str(STANDIN)!r}]))")


class Job:
    """The test's side of a job: store, run directory, agents started, pids seen."""

    def __init__(self, run_dir: Path, cfg: Config | None = None) -> None:
        self.run_dir = run_dir
        self.store = JobStore.host("127.0.0.1", 0, clients=8, secret=job_secret(run_dir, create=True))
        self.addr = f"127.0.0.1:{self.store.port}"
        self.cfg = (cfg or Config()).to_dict()
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(self.cfg))
        self.store.publish_config(json.dumps(self.cfg))
        self.agents: list[Any] = []  # subprocess.Popen, or ServedAgent (Popen's surface)

    def agent(self, *args: str, node: int = 0, nnodes: int = 1, wpn: int = 2, store: str | None = None,
              timeout_s: float = 10.0, env: dict[str, str] | None = None, fresh: bool = False) -> Any:
        """Start an agent: forked from this process's agent server (as the launcher's agents are; its
        imports done once), or with ``fresh`` (or where the server cannot) as a fresh interpreter."""
        argv = ["--node-rank", str(node), "--nnodes", str(nnodes), "--workers-per-node", str(wpn),
                "--store", store or self.addr, "--run-dir", str(self.run_dir), "--timeout-s", str(timeout_s),
                "--grace-s", "3", *args]
        log = self.run_dir / f"agent{node}.{len(self.agents)}.out"
        environ = {**os.environ, **(env or {})}
        server = None if fresh else agent_server()
        p = server.spawn(argv, log=log, env=environ, worker_cmd=[sys.executable, str(STANDIN)]) if server else None
        if p is None:
            with log.open("ab") as out:
                p = subprocess.Popen([sys.executable, "-c", AGENT, *argv], stdout=out, stderr=subprocess.STDOUT,
                                     env=environ)
        self.agents.append(p)
        return p

    def output(self, p: subprocess.Popen[bytes]) -> str:
        i = self.agents.index(p)
        return next(self.run_dir.glob(f"agent*.{i}.out")).read_text()

    def events(self, node: int = 0, event: str | None = None) -> list[dict[str, Any]]:
        evs = read_jsonl(self.run_dir / "events" / f"agent{node}.jsonl")
        return [e for e in evs if event is None or e["event"] == event]

    def pid(self, w: int) -> int | None:
        try:
            return int((self.run_dir / "pids" / f"w{w}").read_text())
        except (OSError, ValueError):
            return None


    def started(self, *workers: int, timeout_s: float = 30.0) -> dict[int, int]:
        """Wait until each worker's current process beats; returns their pids."""
        def up() -> bool:
            for p in self.agents:
                assert p.poll() is None, f"agent exited with {p.returncode}:\n{self.output(p)}"
            return all(self.pid(w) and self.store.heartbeats([w])[0] > 0 for w in workers)

        until(up, timeout_s)
        return {w: self.pid(w) for w in workers}  # type: ignore[misc]

    def incarnations(self, w: int) -> list[dict[str, Any]]:
        files = sorted((self.run_dir / "standin").glob(f"w{w}.*.json"), key=lambda p: p.stat().st_mtime)
        return [json.loads(p.read_text()) for p in files]

    def all_pids(self) -> set[int]:
        pids = {p.pid for p in self.agents}
        for path in (self.run_dir / "events").glob("agent*.jsonl"):
            pids |= {e["pid"] for e in read_jsonl(path) if "pid" in e}
        pids |= {int(json.loads(p.read_text())["pid"]) for p in (self.run_dir / "standin").glob("*.json")}
        pids |= {int(p.read_text()) for p in (self.run_dir / "pids").glob("*")} if (self.run_dir / "pids").exists() else set()
        return pids


UNTIL_FLOOR_S = 120.0
"""The least any wait here allows: an event that comes is waited for, however busy the machine (a test that
never sees it still fails, well inside its own timeout)."""


def until(cond: Callable[[], Any], timeout_s: float, poll_s: float = 0.005) -> float:
    """Wait for ``cond``; returns the seconds it took. Fails the test if it has not held after
    ``max(timeout_s, UNTIL_FLOOR_S)``: ``timeout_s`` says how long the event takes on a quiet machine."""
    t0 = time.monotonic()
    limit = max(timeout_s, UNTIL_FLOOR_S)
    while not cond():
        if time.monotonic() - t0 > limit:
            raise AssertionError(f"condition not met within {limit} s")
        time.sleep(poll_s)
    return time.monotonic() - t0


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False


@contextmanager
def running_job(run_dir: Path, cfg: Config | None = None) -> Iterator[Job]:
    """A :class:`Job`; on the way out: ``done``, every agent exits, no process it caused is left."""
    j = Job(run_dir, cfg)
    try:
        yield j
    finally:
        j.store.set_done()  # lets stand-ins and agents finish on their own
        for p in j.agents:
            try:
                p.wait(timeout=15)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        pids = j.all_pids()
        until(lambda: not any(alive(pid) for pid in pids), 5.0)
        leaked = sorted(pid for pid in pids if alive(pid))
        assert not leaked, f"processes left behind: {leaked}"


@pytest.fixture
def job(tmp_path: Path) -> Iterator[Job]:
    with running_job(tmp_path / "run") as j:
        yield j


def test_second_agent_with_same_rank_is_refused(job: Job) -> None:
    first = job.agent(wpn=1)
    job.started(0)
    second = job.agent(wpn=1)
    assert second.wait(timeout=20) == 2
    assert f"an agent with node rank 0 is already running (pid {first.pid}" in job.output(second)
    assert first.poll() is None, "the refused agent must not disturb the first"
    job.store.set_done()
    assert first.wait(timeout=15) == 0


def test_store_that_does_not_answer(job: Job) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nobody listens once the socket is closed
    p = job.agent(store=f"127.0.0.1:{port}", timeout_s=2.0)
    assert p.wait(timeout=120) == 2
    assert f"store 127.0.0.1:{port} did not answer within 2 s" in job.output(p)
    assert not (job.run_dir / "pids").exists(), "nothing may be started without a store"


def test_different_config_is_refused_naming_the_field(job: Job) -> None:
    mine = json.loads((job.run_dir / "config.json").read_text())
    mine["optim"]["lr"] = 0.5
    (job.run_dir / "config.json").write_text(json.dumps(mine))
    p = job.agent()
    assert p.wait(timeout=20) == 2
    out = job.output(p)
    assert "differs from the job's config in optim.lr" in out and "here 0.5" in out
    assert not (job.run_dir / "pids" / "w0").exists()


def test_killed_worker_is_marked_dead_at_once_and_rejoins(job: Job) -> None:
    agent = job.agent("--restart", "on-failure")
    pids = job.started(0, 1)
    assert job.store.gen() == 0 and job.store.view(0).members == (0, 1)
    os.kill(pids[1], signal.SIGKILL)
    # At once: marked by the agent from the exit it reaped (a mark by a timeout would say so in "how").
    until(lambda: job.store.dead_mark(1) is not None, 60.0, poll_s=0.001)
    reason = json.loads(job.store.dead_mark(1))
    assert reason["by"] == "agent" and reason["how"] == "exit" and reason["signal"] == signal.SIGKILL
    until(lambda: job.store.deaths() == 1, 60.0)  # counted right after the mark
    until(lambda: job.pid(1) not in (None, pids[1]) and len(job.incarnations(1)) == 2, 20.0)
    first, second = job.incarnations(1)
    assert "--join" not in first["argv"] and "--join" in second["argv"]
    assert job.store.join_requests([1]) == [1], "the restarted worker asks to join"
    exit_ev = job.events(event="worker_exit")[0]
    assert exit_ev["worker"] == 1 and exit_ev["signal"] == signal.SIGKILL and not exit_ev["injected"]
    assert [e["join"] for e in job.events(event="worker_start") if e["worker"] == 1] == [False, True]
    assert job.pid(0) == pids[0], "the other worker is untouched"
    job.store.set_done()
    assert agent.wait(timeout=15) == 0


def _adopted(run_dir: Path, w: int, pid: int, gen: int) -> None:
    """The record a worker's process writes once it entered view ``gen`` (the stand-in enters none)."""
    path = run_dir / "events" / f"w{w}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(json.dumps({"kind": "event", "event": "view_adopted", "worker": w, "gen": gen, "pid": pid,
                             "time": time.time()}) + "\n")


def test_an_exit_seen_only_after_the_restore_that_counted_it_is_not_marked(job: Job) -> None:
    """Both members of view 0 are killed while their agent is stopped; meanwhile the job is restored as another
    agent does it (each death counted by a mark of silence, the marks cleared, a restored view 1 naming both
    published). The agent, continued, sees both exits: it marks neither (the mark would read as the death of
    the restored view's member: the next incarnation would not enter view 1, and its other members would wait
    for it there) and restarts both. A death of an incarnation that entered view 1 is marked."""
    agent = job.agent("--restart", "on-failure")
    pids = job.started(0, 1)
    for w, pid in pids.items():
        _adopted(job.run_dir, w, pid, gen=0)
    os.kill(agent.pid, signal.SIGSTOP)
    try:
        for pid in pids.values():
            os.kill(pid, signal.SIGKILL)
        for w in pids:
            job.store.mark_dead(w, json.dumps({"by": "agent", "node": 1, "how": "heartbeat", "gen": 0}))
            job.store.clear_dead(w)
        job.store.propose(job.store.view(0), View(gen=1, members=(0, 1), step=0, reason="restored (test)",
                                                  restore={"source": "memory", "step": 0}))
    finally:
        os.kill(agent.pid, signal.SIGCONT)
    until(lambda: {e["pid"] for e in job.events(event="worker_exit")} >= set(pids.values()), 30.0)
    assert [job.store.dead_mark(w) for w in pids] == [None, None], "a death the restore counted was marked"
    new = job.started(0, 1)
    assert set(new.values()).isdisjoint(pids.values()) and agent.poll() is None
    _adopted(job.run_dir, 1, new[1], gen=1)
    os.kill(new[1], signal.SIGKILL)  # a member of view 1 dies: marked, as any death
    until(lambda: job.store.dead_mark(1) is not None, 30.0)
    assert json.loads(job.store.dead_mark(1))["how"] == "exit"
    job.store.set_done()
    assert agent.wait(timeout=15) == 0


def test_a_dead_joiners_request_goes_when_its_agent_reaps_it(job: Job) -> None:
    """A joiner killed before its admission: its request is withdrawn at once, so no leader admits a process
    that is gone (and a restore finds no stale request); the next incarnation asks again."""
    agent = job.agent("--restart", "on-failure")
    pids = job.started(0, 1)
    os.kill(pids[1], signal.SIGKILL)
    until(lambda: len(job.incarnations(1)) == 2 and job.store.join_requests([1]) == [1], 20.0)
    joiner = job.incarnations(1)[1]["pid"]
    os.kill(joiner, signal.SIGKILL)
    until(lambda: len([e for e in job.events(event="worker_exit") if e["worker"] == 1]) == 2, 10.0, poll_s=0.001)
    assert job.store.join_requests([1]) == [], "the dead joiner's request is withdrawn"
    until(lambda: len(job.incarnations(1)) == 3 and job.store.join_requests([1]) == [1], 20.0)
    job.store.set_done()
    assert agent.wait(timeout=15) == 0


def test_stopped_worker_marked_dead_by_a_peer_is_fenced(job: Job) -> None:
    agent = job.agent("--restart", "never")
    pids = job.started(0, 1)
    os.kill(pids[1], signal.SIGSTOP)  # hung: its heartbeat stops
    peer_mark = json.dumps({"by": 0, "how": "heartbeat", "silent_s": 2.0})
    job.store.mark_dead(1, peer_mark)
    until(lambda: job.events(event="fence"), 60.0, poll_s=0.002)
    until(lambda: not alive(pids[1]), 60.0)  # the agent reaps it: no zombie either
    fence = job.events(event="fence")[0]
    assert fence["worker"] == 1 and fence["pid"] == pids[1] and fence["reason"]["by"] == 0
    assert job.store.dead_mark(1) == peer_mark and job.store.deaths() == 1, "one death, one mark"
    until(lambda: job.events(event="worker_exit"), 60.0)  # written by the agent just after it reaps the process
    exit_ev = job.events(event="worker_exit")[0]
    assert exit_ev["fenced"] and exit_ev["signal"] == signal.SIGKILL
    time.sleep(0.3)
    assert job.pid(1) is None, "restart=never: no new incarnation"
    assert alive(pids[0])
    job.store.set_done()
    assert agent.wait(timeout=15) == 0


def test_injected_kill_fires_at_its_step_and_returns_at_back(job: Job) -> None:
    # Worker 2 lives throughout: with every member of the view dead the agent would declare the job failed.
    agent = job.agent("--fail-at", "step=3:worker=1:kill:back=5,step=4:worker=0:kill:phase=forward", wpn=3)
    pids = job.started(0, 1, 2)
    first = job.incarnations(0)[0]
    assert first["argv"][-2:] == ["--faults", "1"], "the plan's second spec"
    assert first["faults"] == [dataclasses.asdict(fail_at(step=4, worker=0, phase="forward"))]
    job.store.set_progress(2)
    time.sleep(0.2)
    assert alive(pids[1]), "not before its step"
    job.store.set_progress(3)
    until(lambda: job.events(event="worker_exit"), 60.0, poll_s=0.001)
    ev = job.events(event="worker_exit")[0]
    assert ev["worker"] == 1 and ev["injected"] and ev["restart_at_step"] == 5
    job.store.set_progress(4)  # worker 0 kills itself (its phase fault); restarted by policy
    until(lambda: len(job.incarnations(0)) == 2, 20.0)
    assert len(job.incarnations(1)) == 1, "worker 1 must stay down until step 5"
    job.store.set_progress(5)
    until(lambda: len(job.incarnations(1)) == 2, 20.0)
    assert "--join" in job.incarnations(1)[1]["argv"]
    assert "--faults" not in job.incarnations(0)[1]["argv"], "a fired phase fault is not handed on"
    assert job.incarnations(0)[1]["faults"] == []
    injected = job.events(event="fault_injected")
    assert [(e["spec"], e["signal"], e["targets"]) for e in injected] == [("step=3:worker=1:kill:back=5", "SIGKILL", [1])]
    job.store.set_done()
    assert agent.wait(timeout=15) == 0


def test_node_kill_takes_the_agent_and_its_workers(job: Job) -> None:
    agent = job.agent("--fail-at", "step=2:node=0:kill")
    pids = job.started(0, 1)
    job.store.set_progress(2)
    assert agent.wait(timeout=10) == -signal.SIGKILL
    until(lambda: not any(alive(p) for p in pids.values()), 5.0)
    assert job.store.dead_mark(0) is None and job.store.dead_mark(1) is None, "a lost node marks nothing"
    assert job.events(event="fault_injected")[0]["lost_node"]


def test_standby_takes_over_a_dead_worker(job: Job) -> None:
    agent = job.agent("--standby")
    pids = job.started(0, 1)
    until(lambda: job.store.standby_ready_pid(0) is not None, 20.0)
    standby_pid = int(job.store.standby_ready_pid(0))
    os.kill(pids[0], signal.SIGKILL)
    until(lambda: job.events(event="standby_assign"), 10.0)
    assign = job.events(event="standby_assign")[0]
    assert assign["worker"] == 0 and assign["pid"] == standby_pid
    assert job.pid(0) == standby_pid
    inc = job.incarnations(0)[-1]
    assert inc["standby"] and inc["join"] and inc["pid"] == standby_pid
    until(lambda: job.store.standby_ready_pid(0) not in (None, str(standby_pid)), 20.0)  # a fresh standby waits
    assert job.store.backend.get("standby/0/assign") == b"", "the offer was reset"
    job.store.set_done()
    assert agent.wait(timeout=15) == 0


def test_failed_job_stops_the_workers(job: Job) -> None:
    agent = job.agent()
    pids = job.started(0, 1)
    job.store.fail("no live worker left: test")
    assert agent.wait(timeout=15) == 1
    assert "the job failed: no live worker left: test" in job.output(agent)
    assert not any(alive(p) for p in pids.values())


def test_sigterm_stops_the_agent_and_its_workers(job: Job) -> None:
    agent = job.agent()
    pids = job.started(0, 1)
    os.kill(pids[1], signal.SIGSTOP)  # a stopped worker must be stopped too
    agent.send_signal(signal.SIGTERM)  # the first asks the job to stop with a final checkpoint
    until(lambda: job.events(event="preempt_requested"), 10.0)
    assert job.store.stop_point() == (True, None), "asked; only the view's leader agrees the step"
    agent.send_signal(signal.SIGTERM)  # the second stops at once
    assert agent.wait(timeout=15) == 128 + signal.SIGTERM
    assert "interrupted by SIGTERM" in job.output(agent)
    assert not any(alive(p) for p in pids.values())
    assert job.store.node_released(0), "a clean exit releases the node rank"


def test_sigterm_stops_the_agent_once_its_preemption_grace_is_over(job: Job) -> None:
    agent = job.agent("--preempt-grace-s", "1")
    pids = job.started(0, 1)
    agent.send_signal(signal.SIGTERM)  # stand-in workers never stop for it: no final checkpoint comes
    assert agent.wait(timeout=15) == 128 + signal.SIGTERM
    assert job.events(event="preempt_requested") and "interrupted by SIGTERM" in job.output(agent)
    assert not any(alive(p) for p in pids.values())


def test_two_nodes_share_the_view_and_the_config(job: Job) -> None:
    a0 = job.agent(node=0, nnodes=2)
    a1 = job.agent(node=1, nnodes=2)
    job.started(0, 1, 2, 3)
    assert job.store.view(0).members == (0, 1, 2, 3)
    assert json.loads((job.run_dir / "layout.json").read_text()) == {"nodes": 2, "workers_per_node": 2}
    job.store.set_done()
    assert a0.wait(timeout=15) == 0 and a1.wait(timeout=15) == 0


def test_chaos_signals_a_running_job_from_outside(job: Job, capsys: pytest.CaptureFixture[str]) -> None:
    from unbroken.cli import main as cli_main

    agent = job.agent()
    pids = job.started(0, 1)
    with pytest.raises(ValueError, match="phase= and block need the worker itself"):
        from unbroken.faults.chaos import run_chaos
        run_chaos(job.run_dir, "step=1:worker=0:kill:phase=forward")
    (job.run_dir / "metrics.jsonl").write_text(json.dumps({"kind": "train", "step": 2}) + "\n")
    code = cli_main(["chaos", "--run-dir", str(job.run_dir), "--fail-at",
                     "step=2:worker=1:kill,step=1:worker=0:stop:for=0.3", "--timeout-s", "20"])
    assert code == 0
    printed = capsys.readouterr().out
    assert f"step=2:worker=1:kill -> SIGKILL to pids [{pids[1]}]" in printed
    assert f"continue -> SIGCONT to pids [{pids[0]}]" in printed
    until(lambda: job.events(event="worker_exit"), 5.0)
    assert job.events(event="worker_exit")[0]["worker"] == 1
    until(lambda: len(job.incarnations(1)) == 2, 20.0)  # restarted by the agent's policy
    assert alive(pids[0]), "stopped for 0.3 s, then continued"
    fired = read_jsonl(job.run_dir / "events" / "chaos.jsonl")
    assert [e["event"] for e in fired] == ["fault_injected", "fault_injected", "fault_resumed"]
    job.store.set_done()
    assert agent.wait(timeout=15) == 0


def test_agent_declares_failure_when_every_member_is_dead(job: Job) -> None:
    agent = job.agent("--restart", "never")
    pids = job.started(0, 1)
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)
    assert agent.wait(timeout=15) == 1
    assert "no live worker left: every member of view 0 [0, 1] is dead" in job.store.failure()


# -- the launcher, with the real worker -------------------------------------------


def _small_cfg(corpus_overrides: list[str], steps: int, *extra: str) -> Config:
    from unbroken.config import load_config

    return load_config(preset_name="debug", overrides=corpus_overrides + [
        f"train.steps={steps}", "train.val_every=0", "train.val_batches=1", *extra])


@pytest.mark.timeout(240)
def test_launch_two_nodes_with_a_killed_worker(tmp_path: Path, corpus_overrides: list[str]) -> None:
    from unbroken.agent.launcher import launch

    cfg = _small_cfg(corpus_overrides, 12)
    summary = launch(cfg, tmp_path / "run", nodes=2, workers_per_node=1, fail_at="step=3:worker=1:kill:back=5")
    assert summary["steps"] == 12 and summary["nodes"] == 2 and summary["workers"] == 2
    assert summary["faults_injected"] == 1 and summary["failures"] == 1 and summary["restarts"] == 1
    exits = [e for e in read_jsonl(tmp_path / "run" / "events" / "agent1.jsonl") if e["event"] == "worker_exit"]
    assert exits[0]["injected"] and exits[0]["signal"] == signal.SIGKILL and exits[0]["restart_at_step"] == 5
    pids = {e["pid"] for p in (tmp_path / "run" / "events").glob("agent*.jsonl") for e in read_jsonl(p) if "pid" in e}
    assert pids
    until(lambda: not any(alive(p) for p in pids), 5.0)  # SIGKILLed workers may take a moment to exit


@pytest.mark.timeout(240)
def test_launch_raises_job_failed_when_the_only_node_is_lost(tmp_path: Path, corpus_overrides: list[str]) -> None:
    from unbroken.agent.launcher import JobFailed, launch

    cfg = _small_cfg(corpus_overrides, 30, "train.checkpoint_every=1")
    with pytest.raises(JobFailed) as e:
        launch(cfg, tmp_path / "run", nodes=1, workers_per_node=2, fail_at="step=4:node=0:kill")
    msg = str(e.value)
    assert msg.startswith("no live worker is left")
    assert f"continue with: unbroken train --resume {tmp_path / 'run'}" in msg
    pids = {e["pid"] for e in read_jsonl(tmp_path / "run" / "events" / "agent0.jsonl") if "pid" in e}
    assert pids
    until(lambda: not any(alive(p) for p in pids), 5.0)  # SIGKILLed workers may take a moment to exit


def test_node_0_hosts_the_store_without_a_launcher(job: Job) -> None:

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{s.getsockname()[1]}"
    # As a user starts them on their machines: fresh interpreters (the fresh agent's path stays covered).
    a0 = job.agent("--host-store", node=0, nnodes=2, wpn=1, store=addr, fresh=True)
    a1 = job.agent(node=1, nnodes=2, wpn=1, store=addr, fresh=True)
    client = JobStore.connect(addr, timeout_s=30, secret=job_secret(job.run_dir))
    until(lambda: min(client.heartbeats([0, 1])) > 0, 30.0)
    assert json.loads(client.config()) == job.cfg, "node 0 published its config"
    client.set_done()
    assert a1.wait(timeout=15) == 0, job.output(a1)
    assert a0.wait(timeout=15) == 0, job.output(a0)
