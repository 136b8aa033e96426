"""Faults from outside a running job: real signals to the pids its run directory names.

``unbroken chaos --run-dir DIR --fail-at SPEC`` plays an operator (or a
failing machine) next to a job started by ``unbroken train``:

* progress is the ``step`` of the newest train line of ``metrics.jsonl``
  (committed steps, written by the metrics leader every ``train.log_every``
  steps); a spec fires once that reaches its ``step``, as with the agent;
* ``worker=I`` signals the pid in ``pids/w<I>`` (the current incarnation);
* ``node=R`` signals the whole node: first its agent (``pids/agent<R>``, so it
  cannot react), then its workers (``layout.json`` maps nodes to workers). A
  SIGKILLed agent takes its workers with it anyway; a stopped node is
  continued as a whole after ``for=``.

* ``worker=I:slow:factor=F[:for=N]`` slows that worker's process from outside,
  as a CPU quota would: in every :data:`SLOW_PERIOD_S` it runs ``1/F`` of the
  time and is stopped (SIGSTOP, then SIGCONT) the rest, from ``step`` until
  the progress reaches ``step + N`` (without ``for=``: the run's end). It ends
  with the process: once that is gone or the pid file names another
  incarnation, or when the tool exits, the process is left running.

Not supported, with an error up front: ``phase=``, ``block`` and the gray failures
``bitflip`` and ``nan`` (only the worker itself knows where in a step it
is, and what its gradient holds: use ``unbroken train --fail-at``) and ``back=``
(restarts are the agent's: its restart policy brings a killed worker back).

Invariants: a signal goes only to a pid that a pid file names at that moment
and that is alive (not a zombie), except the SIGCONT that ends a stop or a
slowdown; each spec fires at most once; the tool exits when every spec has
fired, every stop was continued and every slowdown ended, when the run has
finished, or at its timeout; a process it slowed is left running.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from unbroken.faults.fail_at import GRAY, FaultSpec, format_fail_at, parse_fail_at
from unbroken.faults.injector import signal_for, workers_of
from unbroken.jsonl import JsonlTail, JsonlWriter

logger = logging.getLogger(__name__)

POLL_S = 0.02
SLOW_PERIOD_S = 0.1
"""A slowed process's duty cycle: short beside any heartbeat timeout, so it is slow, not hung."""


def check_chaos_specs(specs: tuple[FaultSpec, ...]) -> None:
    """Raises ValueError naming every spec the chaos tool cannot carry out."""
    problems = []
    for s in specs:
        if s.how in GRAY and s.how != "slow":
            problems.append(f"{format_fail_at([s])}: {s.how} changes the worker's own gradient or parameters; "
                            f"use unbroken train --fail-at")
        elif s.phase != "any" or s.how == "block":
            problems.append(f"{format_fail_at([s])}: phase= and block need the worker itself; "
                            f"use unbroken train --fail-at")
        if s.back_step is not None:
            problems.append(f"{format_fail_at([s])}: back= needs the agent; drop it (the agent's restart "
                            f"policy brings a killed worker back) or use unbroken train --fail-at")
    if problems:
        raise ValueError("unbroken chaos cannot inject:\n  " + "\n  ".join(problems))


def run_chaos(run_dir: str | Path, fail_at: str, *, timeout_s: float = 3600.0,
              on_event: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Send ``fail_at``'s signals to the job in ``run_dir`` at their steps.

    Returns:
        The events (also appended to ``events/chaos.jsonl``), one per fired spec or continued stop.
    Raises:
        ValueError: not a run directory, or specs that cannot be carried out from outside.
    """
    run_dir = Path(run_dir)
    cfg_file = run_dir / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"--run-dir {run_dir}: no config.json there; is this a running job's directory?")
    steps = int(json.loads(cfg_file.read_text())["train"]["steps"])
    specs = parse_fail_at(fail_at)
    if any(s.target == "store" for s in specs):
        raise ValueError(f"--fail-at {fail_at!r}: unbroken chaos signals workers and nodes; a store=I target is "
                         f"fired by the launcher (unbroken train --fail-at), or kill the store's process yourself")
    check_chaos_specs(specs)
    pending = sorted(specs, key=lambda s: s.step)
    resumes: list[tuple[float, list[int]]] = []
    slowed: list[Slowdown] = []
    tail = JsonlTail(run_dir / "metrics.jsonl")
    writer = JsonlWriter(run_dir / "events" / "chaos.jsonl")
    events: list[dict[str, Any]] = []
    progress, deadline = 0, time.monotonic() + timeout_s

    def emit(rec: dict[str, Any]) -> None:
        writer.write(rec)
        events.append(rec)
        if on_event:
            on_event(rec)

    try:
        while pending or resumes or slowed:
            progress = max([progress] + [int(r["step"]) for r in tail.read_new() if r.get("kind") == "train"])
            if progress >= steps or (run_dir / "summary.json").exists():
                logger.info("the run finished at step %d; %d spec(s) never fired", progress, len(pending))
                break
            if time.monotonic() > deadline:
                logger.warning("timeout after %.0f s; %d spec(s) never fired", timeout_s, len(pending))
                break
            while pending and pending[0].step <= progress:
                spec = pending.pop(0)
                pids = _target_pids(run_dir, spec)
                if spec.how == "slow":
                    slowed += [Slowdown(run_dir / "pids" / f"w{spec.index}", p, spec) for p in pids if alive(p)]
                    emit({"kind": "event", "event": "fault_injected", "by": "chaos", "spec": format_fail_at([spec]),
                          "signal": "SIGSTOP", "duty": 1 / float(spec.factor or 1), "pids": [d.pid for d in
                          slowed if d.spec is spec], "progress": progress, "t": time.time()})
                    continue
                sent = [p for p in pids if send(p, signal_for(spec.how))]
                if spec.duration_s is not None and sent:
                    resumes.append((time.monotonic() + spec.duration_s, sent))
                emit({"kind": "event", "event": "fault_injected", "by": "chaos", "spec": format_fail_at([spec]),
                      "signal": signal_for(spec.how).name, "pids": sent, "progress": progress, "t": time.time()})
            for d in [d for d in slowed if d.over(progress)]:
                slowed.remove(d)
                emit({"kind": "event", "event": "fault_resumed", "by": "chaos", "spec": format_fail_at([d.spec]),
                      "pids": [d.pid] if d.stop() else [], "t": time.time()})
            for item in [r for r in resumes if r[0] <= time.monotonic()]:
                resumes.remove(item)
                sent = [p for p in item[1] if send(p, signal.SIGCONT)]
                emit({"kind": "event", "event": "fault_resumed", "by": "chaos", "pids": sent, "t": time.time()})
            time.sleep(POLL_S)
    finally:
        for d in slowed:
            d.stop()
        writer.close()
    return events


class Slowdown:
    """One process slowed from outside by ``spec`` (``slow:factor=F``): a thread that lets it run ``1/F`` of
    every :data:`SLOW_PERIOD_S` and stops it the rest, until :meth:`stop` or until the process is gone."""

    def __init__(self, pid_file: Path, pid: int, spec: FaultSpec) -> None:
        self.pid_file, self.pid, self.spec = pid_file, pid, spec
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"chaos-slow-{pid}", daemon=True)
        self._thread.start()

    def over(self, progress: int) -> bool:
        """Its steps are over, or its process is gone (a slow fault ends with the worker it slows)."""
        ended = self.spec.for_steps is not None and progress >= self.spec.step + self.spec.for_steps
        return ended or self._done.is_set() or read_pid(self.pid_file) != self.pid or not alive(self.pid)

    def stop(self) -> bool:
        """End the slowdown and leave the process running; whether it was still there."""
        self._done.set()
        self._thread.join(timeout=10 * SLOW_PERIOD_S)
        return send(self.pid, signal.SIGCONT)

    def _run(self) -> None:
        running = SLOW_PERIOD_S / float(self.spec.factor or 1)
        while not self._done.wait(running):
            if read_pid(self.pid_file) != self.pid or not send(self.pid, signal.SIGSTOP):
                break
            self._done.wait(SLOW_PERIOD_S - running)
            if not send(self.pid, signal.SIGCONT):
                break
        self._done.set()


def _target_pids(run_dir: Path, spec: FaultSpec) -> list[int]:
    """Agent first for a node: it must not see its workers die and react."""
    pids = run_dir / "pids"
    if spec.target == "worker":
        return [p for p in [read_pid(pids / f"w{spec.index}")] if p is not None]
    layout = json.loads((run_dir / "layout.json").read_text())
    names = [f"agent{spec.index}"] + [f"w{w}" for w in workers_of(spec.index, int(layout["workers_per_node"]))]
    return [p for p in (read_pid(pids / n) for n in names) if p is not None]


def read_pid(path: Path) -> int | None:
    """The pid a pid file names (None: no file, or being rewritten)."""
    try:
        return int(path.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Running or stopped, not a zombie (without ``/proc``: assumed alive, the signal tells)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return not Path("/proc/self").exists()


def send(pid: int, sig: int) -> bool:
    """Signal a live process; ``False`` if it is gone (or only a zombie)."""
    if not alive(pid):
        return False
    try:
        os.kill(pid, sig)
        return True
    except ProcessLookupError:
        return False
