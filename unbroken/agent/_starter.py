"""The agent's starts: a worker's process started (or the warm standby handed the slot), and adopted.

A part of :class:`unbroken.agent.agent.Agent` (:class:`Starter`), on the node's record
(:class:`~unbroken.agent.node.Node`); it owns the node's warm standby. Restarts fall due at their step or time,
a worker is started as a fresh member or a joiner (forked from the node's template where there is one), and
every start is recorded (pid file, ``worker_start`` event, the startup watch).
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Protocol, Sequence

from unbroken.agent._process import Child, ForkedChild, log_line, send, write_pid
from unbroken.agent._restore import JobRestore
from unbroken.agent._standby import Handover, Standby
from unbroken.agent._supervision import Incarnation, Limits, StartupWatch
from unbroken.agent.node import Node
from unbroken.agent.restarts import Restarts
from unbroken.faults.injector import NodeFaults

__all__ = ["Launch", "Starter"]


class Launch(Protocol):
    """Starts a worker's or standby's process (forked from the node's template where it is ready)."""

    def __call__(self, cmd: Sequence[str], *, log: Path, header: str) -> Child: ...


class Starter:
    """Starts and adopts workers, and keeps the node's warm standby (the agent's loop calls
    :meth:`restart_due`, :meth:`follow_restore` and :meth:`standby_tick`).

    Args:
        node: the node's record.
        launch: starts a process.
        base_cmd: the worker's command line before its arguments (``python -m unbroken.agent.worker_process``).
        fault_file: the node's fault plan, which a worker with faults to inject reads (None: no faults).
        watch: the start-up watch each start is given to.
        restarts: the restarts scheduled (:meth:`restart_due` starts those due).
        plan: the node's faults (each start is told its own).
        restorer: names the workers a restored view starts.
        limits: the start-up limits (the standby's too).
    """

    def __init__(self, node: Node, *, launch: Launch, base_cmd: Sequence[str], fault_file: Path | None,
                 watch: StartupWatch, restarts: Restarts, plan: NodeFaults, restorer: JobRestore,
                 limits: Limits) -> None:
        self.node, self.launch, self.base_cmd, self.fault_file = node, launch, list(base_cmd), fault_file
        self.watch, self.restarts, self.plan, self.restorer, self.limits = watch, restarts, plan, restorer, limits
        self.standby: Standby | None = None
        self._restored_gen: int | None = None

    def restart_due(self, now: float) -> None:
        for w in self.restarts.due(now=now, progress=self.node.progress):
            self._clear_stale_mark(w)
            self.start(w, join=True)

    def _clear_stale_mark(self, w: int) -> None:
        """Delete ``dead/<w>`` once the survivors' view excludes ``w``: the mark has done its job."""
        store = self.node.store
        if not store.is_marked_dead(w) or not store.has_view():
            return
        if w not in store.current_view().members:
            store.clear_dead(w)

    def start(self, w: int, *, join: bool, use_standby: bool = True, resume: bool = True,
              restore_gen: int | None = None) -> None:
        """Start worker ``w`` (``restore_gen``: a joiner started for the restored view of that generation);
        never a second process for a worker that has one, or whose offer to the standby is pending."""
        node, opts = self.node, self.node.opts
        if w in node.workers or (self.standby is not None and self.standby.offered == w):
            node.log.error("worker %d not started again: it has a process (or an offer to the standby)", w)
            return
        progress = node.read_progress()
        faults = ",".join(map(str, self.plan.worker_faults(w, progress)))
        if join and use_standby and self.standby is not None and self.standby.assign(w, faults, restore_gen):
            assert self.standby.proc is not None  # it was ready
            node.log.info("worker %d handed to the standby (pid %d)", w, self.standby.proc.pid)
            return
        k = node.incarnations[w] = node.incarnations.get(w, 0) + 1
        cmd = self.base_cmd + ["--run-dir", str(node.run_dir), "--worker", str(w), "--world", str(opts.n_workers),
                               "--store", opts.store]
        cmd += ["--join"] if join else []
        cmd += ["--restore-gen", str(restore_gen)] if join and restore_gen is not None else []
        cmd += ["--faults-file", str(self.fault_file), "--faults", faults] if faults else []
        if opts.resume is not None and not join and resume:
            cmd += ["--resume", str(opts.resume)]
        if (replica := node.replica_incarnation(w)) is not None:
            cmd += ["--replica-incarnation", replica]
        how = "join" if join else "start"
        proc = self.launch(cmd, log=node.run_dir / "logs" / f"w{w}.log",
                           header=f"node {node.rank} worker {w} incarnation {k} ({how}): " + " ".join(cmd))
        self._adopt(w, proc, join=join, incarnation=k, standby=False, faults=faults)

    def _adopt(self, w: int, proc: Child, *, join: bool, incarnation: int, standby: bool,
               faults: str) -> None:
        node = self.node
        now = time.monotonic()
        if (old := node.workers.get(w)) is not None:
            # Never overwrite a record: its process would run on unsupervised, never fenced nor reaped. The
            # newcomer loses: SIGKILLed, and reaped by the loop like any worker seen dying.
            loser = Incarnation(worker=w, proc=proc, incarnation=incarnation, join=join, started=now,
                                mark_at_spawn=None, fenced=True, reason={"how": "duplicate", "kept": old.proc.pid})
            send(proc, signal.SIGKILL)
            node.dying.append((loser, now))
            node.event("fence", w, pid=proc.pid, reason=loser.reason)
            node.log.error("worker %d has a process (pid %d): its second one (pid %d) stopped", w, old.proc.pid,
                           proc.pid)
            return
        node.workers[w] = Incarnation(worker=w, proc=proc, incarnation=incarnation, join=join, started=now,
                                      mark_at_spawn=node.mark(w))
        self.watch.watch(w, now, join=join)
        node.finished.discard(w)
        node.idle_since = None
        write_pid(node.run_dir / "pids" / f"w{w}", proc.pid)
        node.event("worker_start", w, pid=proc.pid, incarnation=incarnation, join=join, standby=standby,
                   forked=isinstance(proc, ForkedChild), faults=faults, progress=node.progress)
        node.log.info("worker %d %s (pid %d, incarnation %d)", w, "joining" if join else "started", proc.pid,
                      incarnation)

    # -- the warm standby -------------------------------------------------------

    def start_standby(self) -> None:
        """Start the node's warm standby (``--standby``): a worker process that waits, model built, to become
        whichever worker of this node dies next."""
        node, opts = self.node, self.node.opts
        cmd = self.base_cmd + ["--run-dir", str(node.run_dir), "--world", str(opts.n_workers),
                               "--store", opts.store, "--standby", "--node-rank", str(node.rank)]
        cmd += ["--faults-file", str(self.fault_file)] if self.fault_file else []
        self.standby = Standby(node.store, node=node.rank, cmd=cmd, run_dir=node.run_dir, limits=self.limits,
                               launch=self.launch)

    def standby_tick(self, now: float) -> None:
        """Keep the standby (after the job's end too: it reaps a standby let go)."""
        if self.standby is None:
            return
        handover = self.standby.tick(now)
        if handover is not None:
            self._take_handover(handover)

    def stop_standby(self) -> None:
        """The job is done: let the standby go."""
        if self.standby is not None:
            self.standby.stop()

    def kill_standby(self) -> None:
        """This node is lost (an injected fault): the standby goes with it, at once."""
        if self.standby is not None:
            self.standby.kill_now()

    def close_standby(self) -> None:
        """The agent exits: the standby holds no state (SIGKILL)."""
        if self.standby is not None:
            self.standby.close()

    def _take_handover(self, handover: Handover) -> None:
        """The standby became the worker (adopted), or did not (the worker is started afresh)."""
        node = self.node
        w = handover.worker
        if handover.proc is None:
            self.start(w, join=True, use_standby=False, restore_gen=handover.restore_gen)
            return
        k = node.incarnations[w] = node.incarnations.get(w, 0) + 1
        log_line(node.run_dir / "logs" / f"w{w}.log", f"node {node.rank} worker {w} incarnation {k} (join): "
                 f"standby pid {handover.proc.pid} took over; its output is in logs/standby{node.rank}.log")
        self._adopt(w, handover.proc, join=True, incarnation=k, standby=True,
                    faults=handover.faults)
        node.event("standby_assign", w, pid=handover.proc.pid, wait_s=round(handover.wait_s, 4))

    def follow_restore(self) -> None:
        """A restored view names this node's dead workers: start them now (they load the state in it)."""
        node = self.node
        if node.gen == self._restored_gen or not node.store.has_view():
            return
        view = node.store.current_view()
        self._restored_gen = view.gen
        for w in self.restorer.workers_to_start(view, set(node.workers)):
            self.restarts.cancel(w)
            if self.standby is not None and self.standby.offered == w:
                # Handed to the standby, not claimed yet: one owner of "which process is w". The offer is
                # withdrawn (compare-and-set) before w is started here; if the standby's claim won, it is w.
                handover = self.standby.withdraw(time.monotonic())
                node.event("standby_withdrawn", w, gen=view.gen, claimed=handover.proc is not None)
                if handover.proc is not None:
                    self._take_handover(handover)
                    continue
                self.start(w, join=True, use_standby=False, restore_gen=view.gen)
                continue
            self.start(w, join=True, restore_gen=view.gen)
