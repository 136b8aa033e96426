"""The agent's fault injection: the faults of ``--fail-at`` and ``--faults-trace`` fired at their step.

A part of :class:`unbroken.agent.agent.Agent` (:class:`FaultFiring`), on the node's record
(:class:`~unbroken.agent.node.Node`): the node's plan (:class:`~unbroken.faults.injector.NodeFaults`)
says which faults are due at the job's committed progress; each is a signal to some of this node's
workers (a stop is followed by its SIGCONT), or the loss of the whole node (this agent's own SIGKILL).
"""

from __future__ import annotations

import logging
import os
import signal
from pathlib import Path
from typing import Callable

from unbroken.agent._process import Child, send
from unbroken.agent.node import Node
from unbroken.agent.restarts import Restarts
from unbroken.faults.fail_at import FaultSpec, format_fail_at, write_fault_plan
from unbroken.faults.injector import Injection, NodeFaults

__all__ = ["FaultFiring", "fault_plan_file"]


def fault_plan_file(given: Path | None, specs: tuple[FaultSpec, ...], *, run_dir: Path, node: int) -> Path | None:
    """The fault plan this node's workers read: the launcher's (``--faults-file``, ``given``), or else this node's
    parsed specs written to a file of its own (None: no faults)."""
    if given is None and specs:
        given = run_dir / "faults" / f"node{node}.json"
        write_fault_plan(given, specs)
    return given


class FaultFiring:
    """Fires this node's faults (the agent's loop calls :meth:`inject` every tick).

    Args:
        node: the node's record.
        plan: the node's faults.
        restarts: a restart that waits for a step keeps the progress polled fast too.
        lose_node: called just before this agent kills itself for a lost node (the standby goes with it).
    """

    def __init__(self, node: Node, *, plan: NodeFaults, restarts: Restarts, lose_node: Callable[[], None]) -> None:
        self.node, self.plan, self.restarts, self.lose_node = node, plan, restarts, lose_node
        self.stopped: list[tuple[float, int, Child]] = []  # SIGCONT timers: (when, worker, its process)

    def waits_for_a_step(self) -> bool:
        """A fault, or a restart, fires at a step still to come."""
        return self.plan.next_step is not None or self.restarts.waits_for_a_step()

    def armed(self) -> bool:
        """A fault waits for a step (the progress should be polled often), or a stopped worker's SIGCONT is due."""
        return self.waits_for_a_step() or bool(self.stopped)

    def inject(self, now: float) -> None:
        node = self.node
        if self.waits_for_a_step():
            node.read_progress()
            if self.plan.waiting(node.progress):
                held, down = set(self.plan.held), self._down_now()
                # The progress again, after the view: a fault held by the cap fires with a progress at least as
                # new as the view that let it (its return step counts from it).
                node.read_progress()
                for inj in self.plan.due(node.progress, down):
                    self._fire(inj, now)
                for spec in sorted(self.plan.held - held):
                    node.event("fault_deferred", None, spec=spec, progress=node.progress,
                               max_down=self.plan.max_down)
                    node.log.info("fault %s deferred at step %d: fault.max_down=%d workers are down",
                                  spec, node.progress, self.plan.max_down)
        for item in [t for t in self.stopped if t[0] <= now]:
            self.stopped.remove(item)
            _, w, proc = item
            inc = node.workers.get(w)
            if inc is not None and inc.proc is proc and not inc.fenced and send(proc, signal.SIGCONT):
                self.plan.resumed(w)
                node.log.info("worker %d continued (SIGCONT)", w)

    def _fire(self, inj: Injection, now: float) -> None:
        node = self.node
        spec = format_fail_at([inj.spec])
        targets = {w: node.workers[w] for w in inj.workers if w in node.workers}
        node.event("fault_injected", inj.spec.index if inj.spec.target == "worker" else None, spec=spec,
                   signal=inj.signal.name, targets=sorted(targets), progress=node.progress,
                   pids=[i.proc.pid for i in targets.values()], lost_node=inj.kill_agent)
        node.log.warning("fault %s at step %d: %s to workers %s%s", spec, node.progress, inj.signal.name,
                         sorted(targets), " and this agent" if inj.kill_agent else "")
        for inc in targets.values():
            send(inc.proc, inj.signal)
            if inj.resume_after_s is not None:
                self.stopped.append((now + inj.resume_after_s, inc.worker, inc.proc))
        if inj.kill_agent:
            self.lose_node()
            logging.shutdown()
            os.kill(os.getpid(), signal.SIGKILL)  # a lost node: no goodbye, no dead marks

    def _down_now(self) -> set[int]:
        """Workers of the job down as the store tells: outside the current view, or marked dead."""
        store = self.node.store
        if self.plan.max_down is None or not store.has_view():
            return set()
        members = set(store.current_view().members)
        return {w for w in range(self.node.opts.n_workers) if w not in members or store.is_marked_dead(w)}
