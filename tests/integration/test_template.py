"""The node's template process (:mod:`unbroken.agent.template`) in a real job: workers forked from it, its loss.

One job (2 nodes x 2 workers, restarts on), driven by what it reports:

1. at step 4 the test SIGKILLs node 0's template; the agent reports it lost;
2. then the test SIGKILLs worker 1: its agent restarts it at once, as a fresh
   process (no template is ready: a replacement starts only after
   ``RESPAWN_INTERVAL_S``);
3. once node 0's replacement template is ready, the test SIGKILLs worker 0: it is
   restarted by a fork of the new template;
4. once both have rejoined, the test SIGKILLs node 1's agent alone (not its
   workers): its template and its forked workers die with it (they arm
   ``PR_SET_PDEATHSIG`` themselves), and the survivors finish the job.

The end state is every scenario's (:func:`_faults.check_invariants`: every step
once, parameters equal, no process left, the template's included).

Two more jobs: forked workers that die twice in a row of the same error (an
optimizer factory that cannot start in a fork) make the node start fresh
processes; a factory module that does not load on the nodes fails the job once.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest
from _faults import check_invariants, failover_config, run_job

from unbroken.agent.launcher import JobFailed, launch
from unbroken.jsonl import read_jsonl

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 400
"""Steps of a run in which a template is replaced and two workers rejoin mid-run; the job is held back while a
restarted worker gets ready (``pace``: a fresh worker's start and a fresh template's are the slow part), so the
rejoins do not depend on how fast the machine is."""


def _pid(run_dir: Any, name: str) -> int:
    return int((run_dir / "pids" / name).read_text().split()[0])


def test_template_loss_fallback_and_agent_loss(tmp_path, corpus_overrides):
    run_dir = tmp_path / "run"
    cfg = failover_config(corpus_overrides, STEPS, "train.timeout_s=30")
    lock = threading.Lock()
    # Processes are told apart by pid: a member that missed a committed step's sum when a peer died leaves and
    # rejoins (EXIT_REJOIN), so a worker may start more often than the test kills it.
    seen: dict[str, Any] = {"ready0": [], "killed": [], "pid": {}, "back": {}}

    def kill(what: str, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        seen["killed"].append(what)
        seen["pid"][what] = pid

    def on_record(record: dict[str, Any]) -> None:
        with lock:
            if record.get("kind") == "train" and record["step"] >= 4 and not seen["killed"] and seen["ready0"]:
                kill("template0", seen["ready0"][0])
            elif (record.get("kind") == "train" and seen.get("both_back") and record.get("live_workers") == 4
                  and seen["killed"] == ["template0", "w1", "w0"]):
                # node 1 goes only once a step committed with all four members: w0 and w1 hold the state (a
                # member that missed w0's death's commit may have left to rejoin, and would still be waiting)
                seen["node1"] = [_pid(run_dir, "w2"), _pid(run_dir, "w3")]
                kill("agent1", _pid(run_dir, "agent1"))

    def on_event(e: dict[str, Any]) -> None:
        with lock:
            event, node = e.get("event"), e.get("node")
            if event == "template_ready" and node == 0:
                seen["ready0"].append(e["pid"])
                if seen["killed"] == ["template0", "w1"]:
                    kill("w0", _pid(run_dir, "w0"))
            elif event == "template_lost" and node == 0 and seen["killed"] == ["template0"]:
                kill("w1", _pid(run_dir, "w1"))
            elif event == "start_phases" and e["join"] and f"w{e['worker']}" in seen["pid"]:
                if e["pid"] != seen["pid"][f"w{e['worker']}"]:  # the killed worker's replacement is back
                    seen["back"].setdefault(e["worker"], e["pid"])
                if set(seen["back"]) == {0, 1} and seen["killed"] == ["template0", "w1", "w0"]:
                    seen["both_back"] = True

    job = run_job(cfg, run_dir, nodes=2, workers_per_node=2, restart="on-failure", on_record=on_record,
                  on_event=on_event, pace=True)
    assert seen["killed"] == ["template0", "w1", "w0", "agent1"], seen
    check_invariants(job, live=[0, 1])

    first = [(e["worker"], e["forked"]) for e in job.events("worker_start") if e["incarnation"] == 1]
    assert sorted(first) == [(0, True), (1, True), (2, True), (3, True)], "every first worker is forked"
    (w1,) = job.events("worker_start", worker=1, pid=seen["back"][1])
    assert not w1["forked"] and w1["join"], "no template was ready: a fresh process"
    (w0,) = job.events("worker_start", worker=0, pid=seen["back"][0])
    assert w0["forked"] and w0["join"], "forked from the replacement template"
    assert len(job.events("template_ready", node=0)) == 2 and len(job.events("template_lost", node=0)) == 1
    # The lost node's processes died with its agent (its template's pid is among job.pids: none left).
    assert all(p in job.pids for p in seen["node1"])
    # A start's "process" phase is the process's age at its first line: a fresh one's holds the interpreter and
    # every import, a forked one's only the fork.
    (forked,) = [e["phases"]["process"] for e in job.events("start_phases", worker=0, pid=seen["back"][0])]
    (fresh,) = [e["phases"]["process"] for e in job.events("start_phases", worker=1, pid=seen["back"][1])]
    assert forked < fresh, (forked, fresh)


FACTORY = '''"""A model factory whose module loads where the job is launched but not on its nodes (a broken install)."""

import os

from unbroken.models import build_model

if "UNBROKEN_PARENT_PID" in os.environ:  # set in every process an agent starts
    raise ImportError("libbroken.so: cannot open shared object file")


def make(ctx):
    return build_model("debug", vocab_size=ctx.vocab_size, seq_len=ctx.cfg.data.seq_len, seed=ctx.seed,
                       device=ctx.device)
'''


def test_a_template_that_cannot_load_the_job_fails_it_once(tmp_path, corpus_overrides):
    """The import error is the job's error, said once; no worker is started (no crash loop)."""
    factory = tmp_path / "factory.py"
    factory.write_text(FACTORY)
    cfg = failover_config(corpus_overrides, 5, "model.family=custom", f"model.factory={factory}:make")
    with pytest.raises(JobFailed) as failed:
        launch(cfg, tmp_path / "run", nodes=2, workers_per_node=1)
    message = str(failed.value)
    assert message.startswith("the job stopped: node ")
    assert message.count(f"loading {factory} (line 8) failed: ImportError: libbroken.so") == 1, message
    events = [e for p in (tmp_path / "run" / "events").glob("*.jsonl") for e in read_jsonl(p)]
    # (the launch's own record of what snapshots protect is written before any agent starts)
    assert {e["event"] for e in events if e.get("kind") == "event"} <= {"template_failed", "template_ready",
                                                                         "snapshot_protection"}
    assert any(e.get("event") == "template_failed" for e in events)
    assert not list((tmp_path / "run" / "logs").glob("w*.log")), "no worker was started"


FORK_FAILING_OPTIMIZER = '''"""An optimizer factory that cannot start in a forked process after the job's first two (a library that breaks
in a fork: what forking a CUDA worker from its template would look like if it did not work)."""

import os

import torch

COUNT = {count!r}


def build(model, ctx):
    with open("/proc/self/cmdline", "rb") as fh:
        forked = b"unbroken.agent.worker_process" not in fh.read()  # a fresh worker's command line names it
    if forked:
        with open(COUNT, "a") as fh:
            fh.write("x\\n")
        with open(COUNT) as fh:
            if len(fh.read().split()) > 2:
                raise RuntimeError("cannot start in a forked process")
    return torch.optim.AdamW(model.parameters(), lr=ctx.cfg.optim.lr, foreach=False)
'''


def test_forked_workers_that_fail_alike_twice_make_the_node_start_fresh_processes(tmp_path, corpus_overrides):
    factory = tmp_path / "fork_failing.py"
    factory.write_text(FORK_FAILING_OPTIMIZER.format(count=str(tmp_path / "forked_builds")))
    cfg = failover_config(corpus_overrides, STEPS, "train.timeout_s=30", f"optim.factory={factory}:build")
    run_dir = tmp_path / "run"
    killed: list[int] = []

    def on_record(record: dict[str, Any]) -> None:
        if record.get("kind") == "train" and record["step"] >= 4 and not killed:
            killed.append(_pid(run_dir, "w1"))
            os.kill(killed[0], signal.SIGKILL)

    job = run_job(cfg, run_dir, nodes=1, workers_per_node=2, restart="on-failure", on_record=on_record)
    assert killed
    (lost,) = job.events("template_lost", node=0)
    assert lost["why"].startswith("two forked workers failed alike (RuntimeError at ")
    assert "fork_failing.py" in lost["why"]
    starts = job.events("worker_start", worker=1)
    assert [(e["incarnation"], e["forked"]) for e in starts[:3]] == [(1, True), (2, True), (3, True)]
    assert len(job.events("worker_error", worker=1)) >= 2  # incarnations 2 and 3, at their optimizer
    after = [e for e in starts if e["time"] > lost["time"]]
    assert after and not any(e["forked"] for e in after), "after the template is lost: fresh processes"
    live = sorted(job.final_view()["members"])
    assert live in ([0], [0, 1]), live  # worker 1's fresh incarnation joins if the job lasts long enough
    check_invariants(job, live=live)
