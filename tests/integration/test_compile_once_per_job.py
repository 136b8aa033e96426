"""Compile once per job: the first compiled step's graphs and kernels are written to the run directory, and every
later process of the job loads them before its first step.

A job of two workers with ``train.compile`` on (CPU: inductor's C++ kernels) and a warm standby, in an inductor
cache directory of its own (empty: the first workers compile from scratch). Worker 1 is killed once the standby
has compiled ahead, and again once the standby, now worker 1, has trained; its third process is a replacement
(forked from the node's template, or the next standby). The scenario waits for each of these events however slow
the machine: the members are frozen while the standby compiles ahead, and worker 0 is let run only in short slices
while a process it must admit gets ready, so the job cannot run out of steps first. The end state is every failover scenario's
(:func:`_faults.check_invariants`), and:

- the leader wrote the job's compile cache once, after its first compiled step, kernels included;
- the standby loaded it and compiled ahead (a forward and backward, graphs from the cache), and the step it took
  over with compiled nothing more;
- the replacement loaded it and built no graph: every graph it compiled came from the cache
  (``scripts/gpu/compile_cache.py`` times it).
"""

from __future__ import annotations

import json
import os
import signal
import threading
from typing import Any

import pytest

from _faults import check_invariants, failover_config, run_job
from unbroken.report.run_report import summarize_run

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

STEPS = 500
"""More steps than the scenario needs; it does not count on them: the job is held while it waits (below)."""
HOLD_S = 600.0
"""The heartbeat and progress timeouts: the scenario freezes members while the standby compiles ahead and while
the replacement starts, and no peer may be judged hung meanwhile (kills are seen by the agent, not by a timeout)."""


class _Hold:
    """Keeps worker 0 from running out of steps while a process it waits for gets ready, however slow the machine:
    frozen (SIGSTOP) while nothing needs it, or let run one short slice at a time while a joiner needs it for its
    admission, until :meth:`release`."""

    def __init__(self) -> None:
        self.released = threading.Event()
        self.thread: threading.Thread | None = None

    def freeze(self, pids: list[int]) -> None:
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)

    def trickle(self, pid: int) -> None:
        """Let ``pid`` run a slice of 20 ms in every 200 ms until released (the joiner's admission needs it)."""

        def run() -> None:
            while not self.released.is_set():
                _signal(pid, signal.SIGCONT)
                if self.released.wait(0.02):
                    break
                _signal(pid, signal.SIGSTOP)
                self.released.wait(0.18)
            _signal(pid, signal.SIGCONT)

        self.released.clear()
        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def release(self, pids: list[int]) -> None:
        self.released.set()
        if self.thread is not None:
            self.thread.join(timeout=10)
        for pid in pids:
            _signal(pid, signal.SIGCONT)


def _signal(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def test_a_standby_and_a_replacement_load_the_jobs_compile_cache(tmp_path, corpus_overrides, monkeypatch):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))  # inherited by every process
    # train.timeout_s: the standby waits up to half of it for the leader's cache, which a first compile from
    # scratch on a busy machine may take minutes to write.
    cfg = failover_config(corpus_overrides, STEPS, "train.compile=true", f"fault.progress_timeout_s={HOLD_S}",
                          f"fault.heartbeat_timeout_s={HOLD_S}", "train.timeout_s=1200")
    run_dir = tmp_path / "run"
    lock = threading.Lock()
    seen: dict[str, Any] = {"w0": None, "w1": [], "standby": None, "killed": [], "frozen": False}
    hold = _Hold()

    def kill(pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        seen["killed"].append(pid)

    def on_event(e: dict[str, Any]) -> None:
        with lock:
            if e.get("event") == "compiled" and e["worker"] == 0:
                seen["w0"] = seen["w0"] or e["pid"]
            elif e.get("event") == "compiled" and e["worker"] == 1:
                seen["w1"].append(e["pid"])
                if len(seen["killed"]) == 2 and e["pid"] not in seen["killed"]:
                    hold.release([seen["w0"]])  # the replacement was admitted and trained
                if e["pid"] == seen["standby"] and len(seen["killed"]) == 1:  # it took over and trained
                    # Worker 0 holds back until the replacement is admitted, so the job cannot end before.
                    hold.release([])
                    hold.freeze([seen["w0"]])
                    kill(e["pid"])
                    hold.trickle(seen["w0"])
            elif e.get("event") == "standby_ready" and ((e.get("compile") or {}).get("ahead") or {}).get("frames"):
                seen["standby"] = seen["standby"] or e["pid"]
            elif e.get("event") == "standby_ready" and not seen["standby"]:
                seen["unready"] = e  # compiled nothing ahead: the scenario cannot go on (said at the end)
                hold.release([p for p in (seen["w0"], *seen["w1"][:1]) if p])
            elif (e.get("event") == "start_phases" and e.get("worker") == 1 and len(seen["killed"]) == 2
                  and e.get("pid") not in seen["killed"]):
                hold.release([seen["w0"]])  # the replacement (a fork) was admitted
            if seen["w0"] and seen["w1"] and not seen["standby"] and not seen["frozen"] and not seen["killed"]:
                # Both trained a compiled step (the cache is written): frozen until the standby compiled ahead.
                seen["frozen"] = True
                hold.freeze([seen["w0"], seen["w1"][0]])
            if seen["standby"] and seen["w1"] and not seen["killed"]:
                kill(seen["w1"][0])
                hold.trickle(seen["w0"])  # until the standby took over and trained

    try:
        job = run_job(cfg, run_dir, nodes=1, workers_per_node=2, restart="on-failure", on_event=on_event,
                      standby=True)
    finally:
        hold.release([seen["w0"]] if seen["w0"] else [])
    assert "unready" not in seen, f"the standby compiled nothing ahead: {seen['unready']}"
    check_invariants(job, live=[0, 1])
    assert len(seen["killed"]) == 2 and seen["killed"][1] == seen["standby"], seen

    (written,) = job.events("compile_cache_written")
    assert written["worker"] == 0 and written["kernels"] > 0 and written["artifacts"].get("aot_autograd")
    (cold,) = job.events("compiled", worker=0)
    assert cold["cache"] == {"loaded": False, "why": "absent"} and cold["cache_misses"] > 0

    (ready,) = [e for e in job.events("standby_ready") if e["pid"] == seen["standby"]]
    ahead = ready["compile"]["ahead"]
    assert ready["compile"]["cache"]["loaded"] and ahead["frames"] > 0 and ahead["cache_hits"] > 0
    (took_over,) = job.events("compiled", worker=1, pid=seen["standby"])
    assert took_over["frames"] == ahead["frames"], "the step it took over with compiled nothing more"
    assert took_over["cache_misses"] == 0

    replacement = json.loads((run_dir / "workers" / "w1.json").read_text())["compile"]
    assert seen["w1"][-1] not in seen["killed"]
    loaded = replacement["cache"]["loaded"]
    assert loaded and replacement["cache"]["artifacts"].get("aot_autograd"), replacement
    assert replacement["cache_misses"] == 0 and replacement["cache_hits"] > 0  # (its seconds: the benchmark's)

    compiles = {c["pid"]: c for c in summarize_run(run_dir)["compiles"]}  # what unbroken report prints
    assert compiles[cold["pid"]]["wrote"] and not compiles[cold["pid"]]["loaded"]
    assert compiles[seen["standby"]]["loaded"] and compiles[seen["standby"]]["ahead_s"] is not None
    assert compiles[seen["w1"][-1]]["loaded"] and compiles[seen["w1"][-1]]["cache_misses"] == 0
