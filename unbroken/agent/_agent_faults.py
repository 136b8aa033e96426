"""The agent's fault injection: the faults of ``--fail-at`` and ``--faults-trace`` fired at their step.

A mixin of :class:`unbroken.agent.agent.Agent`: the node's plan (:class:`~unbroken.faults.injector.NodeFaults`)
says which faults are due at the job's committed progress; each is a signal to some of this node's
workers (a stop is followed by its SIGCONT), or the loss of the whole node (this agent's own SIGKILL).
"""

from __future__ import annotations

import logging
import os
import signal
from typing import TYPE_CHECKING

from unbroken.agent._process import send
from unbroken.faults.fail_at import format_fail_at, write_fault_plan
from unbroken.faults.injector import Injection

if TYPE_CHECKING:
    from unbroken.agent.agent import Agent

__all__ = ["FaultDuties"]


class FaultDuties:
    """Fires this node's faults (the agent's loop calls :meth:`_inject` every tick)."""

    def _write_fault_plan(self: Agent) -> None:
        """Without the launcher's plan (``--faults-file``), this node's parsed specs go to a file of its own."""
        if self.fault_plan is None and self.specs:
            self.fault_plan = self.run_dir / "faults" / f"node{self.node}.json"
            write_fault_plan(self.fault_plan, self.specs)

    def _waits_for_a_step(self: Agent) -> bool:
        """A fault, or a restart, fires at a step still to come."""
        return self.plan is not None and (self.plan.next_step is not None or
                                          self.restarts.waits_for_a_step())

    def _inject(self: Agent, now: float) -> None:
        if self._waits_for_a_step():
            self._progress = self._read_progress()
            if self.plan.waiting(self._progress):
                held, down = set(self.plan.held), self._down_now()
                # The progress again, after the view: a fault held by the cap fires with a progress at least as
                # new as the view that let it (its return step counts from it).
                self._progress = max(self._progress, self._read_progress())
                for inj in self.plan.due(self._progress, down):
                    self._fire(inj, now)
                for spec in sorted(self.plan.held - held):
                    self._event("fault_deferred", None, spec=spec, progress=self._progress,
                                max_down=self.plan.max_down)
                    self.log.info("fault %s deferred at step %d: fault.max_down=%d workers are down",
                                  spec, self._progress, self.plan.max_down)
        for item in [t for t in self.stopped if t[0] <= now]:
            self.stopped.remove(item)
            _, w, proc = item
            inc = self.workers.get(w)
            if inc is not None and inc.proc is proc and not inc.fenced and send(proc, signal.SIGCONT):
                self.plan.resumed(w)
                self.log.info("worker %d continued (SIGCONT)", w)

    def _fire(self: Agent, inj: Injection, now: float) -> None:
        spec = format_fail_at([inj.spec])
        targets = {w: self.workers[w] for w in inj.workers if w in self.workers}
        self._event("fault_injected", inj.spec.index if inj.spec.target == "worker" else None, spec=spec,
                    signal=inj.signal.name, targets=sorted(targets), progress=self._progress,
                    pids=[i.proc.pid for i in targets.values()], lost_node=inj.kill_agent)
        self.log.warning("fault %s at step %d: %s to workers %s%s", spec, self._progress, inj.signal.name,
                         sorted(targets), " and this agent" if inj.kill_agent else "")
        for inc in targets.values():
            send(inc.proc, inj.signal)
            if inj.resume_after_s is not None:
                self.stopped.append((now + inj.resume_after_s, inc.worker, inc.proc))
        if inj.kill_agent:
            if self.standby is not None:
                self.standby.kill_now()
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)  # a lost node: no goodbye, no dead marks

    def _down_now(self: Agent) -> set[int]:
        """Workers of the job down as the store tells: outside the current view, or marked dead."""
        if self.plan is None or self.plan.max_down is None or not self.store.has_view():
            return set()
        members = set(self.store.current_view().members)
        return {w for w in range(self.opts.n_workers) if w not in members or self.store.is_marked_dead(w)}
