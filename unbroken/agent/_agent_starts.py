"""The agent's starts: a worker's process started (or the warm standby handed the slot), and adopted.

A mixin of :class:`unbroken.agent.agent.Agent`: restarts fall due at their step or time, a worker is
started as a fresh member or a joiner (forked from the node's template where there is one), and every
start is recorded (pid file, ``worker_start`` event, the startup watch).
"""

from __future__ import annotations

import signal
import subprocess
import time
from typing import TYPE_CHECKING

from unbroken.agent._process import ForkedChild, log_line, send, write_pid
from unbroken.agent._standby import Handover
from unbroken.agent._supervision import Incarnation

if TYPE_CHECKING:
    from unbroken.agent.agent import Agent

__all__ = ["StartDuties"]


class StartDuties:
    """Starts and adopts workers (the agent's loop calls :meth:`_restart_due` and :meth:`_standby_tick`)."""

    def _restart_due(self: Agent, now: float) -> None:
        for w in self.restarts.due(now=now, progress=self._progress):
            self._clear_stale_mark(w)
            self._start(w, join=True)

    def _clear_stale_mark(self: Agent, w: int) -> None:
        """Delete ``dead/<w>`` once the survivors' view excludes ``w``: the mark has done its job."""
        if not self.store.is_marked_dead(w) or not self.store.has_view():
            return
        if w not in self.store.current_view().members:
            self.store.clear_dead(w)

    def _start(self: Agent, w: int, *, join: bool, use_standby: bool = True, resume: bool = True,
               restore_gen: int | None = None) -> None:
        """Start worker ``w`` (``restore_gen``: a joiner started for the restored view of that generation);
        never a second process for a worker that has one, or whose offer to the standby is pending."""
        if w in self.workers or (self.standby is not None and self.standby.offered == w):
            self.log.error("worker %d not started again: it has a process (or an offer to the standby)", w)
            return
        progress = self._read_progress()
        faults = ",".join(map(str, self.plan.worker_faults(w, progress))) if self.plan else ""
        if join and use_standby and self.standby is not None and self.standby.assign(w, faults, restore_gen):
            self.log.info("worker %d handed to the standby (pid %d)", w, self.standby.proc.pid)
            return
        k = self.incarnations[w] = self.incarnations.get(w, 0) + 1
        cmd = self.base_cmd + ["--run-dir", str(self.run_dir), "--worker", str(w), "--world", str(self.opts.n_workers),
                               "--store", self.opts.store]
        cmd += ["--join"] if join else []
        cmd += ["--restore-gen", str(restore_gen)] if join and restore_gen is not None else []
        cmd += ["--faults-file", str(self.fault_plan), "--faults", faults] if faults else []
        if self.opts.resume is not None and not join and resume:
            cmd += ["--resume", str(self.opts.resume)]
        if self.shard_degree > 1:
            r = w // self.shard_degree
            cmd += ["--replica-incarnation", f"{self._replica_token}.{self._replica_starts.get(r, 0)}"]
        how = "join" if join else "start"
        proc = self._launch(cmd, log=self.run_dir / "logs" / f"w{w}.log",
                            header=f"node {self.node} worker {w} incarnation {k} ({how}): " + " ".join(cmd))
        self._adopt(w, proc, join=join, incarnation=k, standby=False, faults=faults)

    def _adopt(self: Agent, w: int, proc: subprocess.Popen[bytes], *, join: bool, incarnation: int, standby: bool,
               faults: str) -> None:
        now = time.monotonic()
        if (old := self.workers.get(w)) is not None:
            # Never overwrite a record: its process would run on unsupervised, never fenced nor reaped. The
            # newcomer loses: SIGKILLed, and reaped by the loop like any worker seen dying.
            loser = Incarnation(worker=w, proc=proc, incarnation=incarnation, join=join, started=now,
                                mark_at_spawn=None, fenced=True, reason={"how": "duplicate", "kept": old.proc.pid})
            send(proc, signal.SIGKILL)
            self._dying.append((loser, now))
            self._event("fence", w, pid=proc.pid, reason=loser.reason)
            self.log.error("worker %d has a process (pid %d): its second one (pid %d) stopped", w, old.proc.pid,
                           proc.pid)
            return
        self.workers[w] = Incarnation(worker=w, proc=proc, incarnation=incarnation, join=join, started=now,
                                      mark_at_spawn=self._mark(w))
        self.watch.watch(w, now, join=join)
        self.finished.discard(w)
        self._idle_since = None
        write_pid(self.run_dir / "pids" / f"w{w}", proc.pid)
        self._event("worker_start", w, pid=proc.pid, incarnation=incarnation, join=join, standby=standby,
                    forked=isinstance(proc, ForkedChild), faults=faults, progress=self._progress)
        self.log.info("worker %d %s (pid %d, incarnation %d)", w, "joining" if join else "started", proc.pid,
                      incarnation)

    def _standby_tick(self: Agent, now: float) -> None:
        assert self.standby is not None
        handover = self.standby.tick(now)
        if handover is not None:
            self._take_handover(handover)

    def _take_handover(self: Agent, handover: Handover) -> None:
        """The standby became the worker (adopted), or did not (the worker is started afresh)."""
        w = handover.worker
        if handover.proc is None:
            self._start(w, join=True, use_standby=False, restore_gen=handover.restore_gen)
            return
        k = self.incarnations[w] = self.incarnations.get(w, 0) + 1
        log_line(self.run_dir / "logs" / f"w{w}.log", f"node {self.node} worker {w} incarnation {k} (join): "
                 f"standby pid {handover.proc.pid} took over; its output is in logs/standby{self.node}.log")
        self._adopt(w, handover.proc, join=True, incarnation=k, standby=True,
                    faults=handover.faults)
        self._event("standby_assign", w, pid=handover.proc.pid, wait_s=round(handover.wait_s, 4))
