"""The agent's side of deaths: reaping its workers, marking them dead, fencing, scheduling restarts.

A part of :class:`unbroken.agent.agent.Agent` (:class:`Reaper`), on the node's record
(:class:`~unbroken.agent.node.Node`). A worker's death is seen within one tick of the kill, while
the kernel still tears it down (:mod:`unbroken.agent._exit_watch`: a GPU worker's teardown takes seconds), or
when it is reaped, whichever comes first; it is then marked dead in the store (with the job's own error where
it left one) and given a restart per the policy (:mod:`unbroken.agent.restarts`), and a worker seen dying is
reaped later (``worker_reaped``, with its teardown's seconds); a worker someone else marked dead, one that
stopped beating before its admission and an HSDP replica's siblings are fenced (SIGKILL); when every member
of the view is dead the job is restored (:mod:`unbroken.agent._restore`).
"""

from __future__ import annotations

import json
import signal
import subprocess
import time
from typing import Any, Callable

from unbroken.agent._exit_watch import exiting_returncode
from unbroken.agent._job_error import CONSEQUENCE_EXIT_CODES, death_error
from unbroken.agent._process import HANG_HOWS, ForkedChild, describe_exit, dump_stacks, exit_status, remove_pid, send
from unbroken.agent._restore import JobRestore
from unbroken.agent._run_files import last_self_fault, newest_adopted_gen, was_admitted
from unbroken.agent._supervision import Incarnation, StartupWatch, decode_mark
from unbroken.agent.node import Node
from unbroken.agent.restarts import Restarts
from unbroken.agent.template_client import Template
from unbroken.faults.fail_at import format_fail_at
from unbroken.faults.injector import NodeFaults
from unbroken.runtime.membership import EXIT_FENCED, EXIT_REJOIN

__all__ = ["Reaper", "reap_dying", "seen_exits"]

Dying = list[tuple[Incarnation, float]]
"""Incarnations seen dying and when, not reaped yet."""


def seen_exits(workers: dict[int, Incarnation], dying: Dying, now: float) -> list[tuple[Incarnation, int, str]]:
    """Take the workers that exited out of ``workers``: each with its return code and how its death was seen,
    ``reaped`` or ``exiting`` (the kernel tears it down still: :mod:`unbroken.agent._exit_watch`; then it is
    added to ``dying``, to be reaped later)."""
    exits = []
    for w, inc in list(workers.items()):
        rc = inc.proc.poll()
        seen = "reaped"
        if rc is None and (rc := exiting_returncode(inc.proc.pid)) is not None:
            seen = "exiting"  # dead from now on; the kernel may take seconds more to let it be reaped
            dying.append((inc, now))
        if rc is not None:
            del workers[w]
            exits.append((inc, rc, seen))
    return exits


def reap_dying(dying: Dying, event: Callable[..., None], wait_s: float = 0.0) -> None:
    """Reap the workers seen dying whose teardown is over (``wait_s``: wait that long for the rest); each reap
    is a ``worker_reaped`` event with its teardown's seconds."""
    deadline = time.monotonic() + wait_s
    for inc, seen_at in list(dying):
        try:
            inc.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            continue
        dying.remove((inc, seen_at))
        event("worker_reaped", inc.worker, pid=inc.proc.pid, incarnation=inc.incarnation,
              teardown_s=round(time.monotonic() - seen_at, 3))


class Reaper:
    """Reaps, marks, fences and schedules restarts (the agent's loop calls :meth:`reap`, :meth:`fence` and
    :meth:`fence_stalled`).

    Args:
        node: the node's record.
        watch: the start-up watch (a worker's death ends its watch; a stalled start is fenced).
        restarts: where a death schedules its restart.
        plan: the node's faults (a death is told the fault that caused it, if any).
        template: the node's template, if workers fork from it (told of a forked worker that failed).
        restorer: told when every member of the view is dead.
    """

    def __init__(self, node: Node, *, watch: StartupWatch, restarts: Restarts, plan: NodeFaults,
                 template: Template | None, restorer: JobRestore) -> None:
        self.node, self.watch, self.restarts, self.plan = node, watch, restarts, plan
        self.template, self.restorer = template, restorer
        self._deaths_seen = -1

    def reap(self, now: float) -> None:
        """Handle every exit of this node's workers (a death at once, its reap when the kernel lets it)."""
        for inc, rc, seen in seen_exits(self.node.workers, self.node.dying, now):
            self._on_exit(inc, rc, now, seen)
        reap_dying(self.node.dying, self.node.event)

    def _on_exit(self, inc: Incarnation, rc: int, now: float, seen: str) -> None:
        """``seen``: ``exiting`` (the kernel tears it down still: :mod:`unbroken.agent._exit_watch`) or ``reaped``."""
        node = self.node
        w = inc.worker
        remove_pid(node.run_dir / "pids" / f"w{w}", inc.proc.pid)
        self.watch.forget(w)
        code, sig = exit_status(rc)
        rec: dict[str, Any] = {"pid": inc.proc.pid, "code": code, "signal": sig, "incarnation": inc.incarnation,
                               "uptime_s": round(now - inc.started, 3), "seen": seen,
                               "fenced": inc.fenced or code in (EXIT_FENCED, EXIT_REJOIN), "reason": inc.reason}
        if rc == 0:
            node.finished.add(w)
            node.event("worker_exit", w, clean=True, **rec)
            node.log.info("worker %d finished", w)
            return
        # A dead joiner's request goes with it: no leader admits an incarnation that is gone (its successor
        # asks again), and a restore does not find a stale request to admit.
        node.store.clear_join(w)
        self._fence_replica(inc)
        error = death_error(node.run_dir, w, code, sig)  # the job's own error (None: killed from outside...)
        rec["error"] = error
        if (error is not None and not inc.fenced and isinstance(inc.proc, ForkedChild) and self.template is not None
                and not was_admitted(node.run_dir, w, inc.proc.pid)):
            self.template.forked_failed(error)  # twice alike before admission: workers start fresh (the fork...)
        reason = json.dumps({"by": "agent", "node": node.rank, "how": "exit", "code": code, "signal": sig,
                             "error": error, "t": time.time()})
        self._mark_dead(inc, reason)
        fired = last_self_fault(node.run_dir, w)
        progress = max(node.read_progress(), fired[0] if fired is not None else 0)
        cause = self.plan.on_death(w, progress, fired)
        # A crash loop is the worker's own failing (an exit code, a fatal signal of its own), not a SIGKILL nor an
        # exit that follows from another's failure: a worker killed again and again from outside (or fenced, or
        # left with nobody to hand it the state) comes back every time.
        restart = None if node.done_at is not None else self.restarts.schedule(
            w, now=now, started=inc.started, crashed=not cause.injected and not inc.fenced and sig != signal.SIGKILL
            and code not in CONSEQUENCE_EXIT_CODES,
            back_step=cause.back_step, total_steps=node.total_steps, rejoin=code == EXIT_REJOIN and not cause.injected)
        node.event("worker_exit", w, clean=False, injected=cause.injected, progress=progress,
                    spec=format_fail_at([cause.spec]) if cause.spec else None,
                    restart_at_step=restart.at_step if restart else None,
                    restart_in_s=round(restart.at_time - now, 3) if restart and restart.at_time else None, **rec)
        node.log.warning("worker %d (pid %d) %s at step %d; %s", w, inc.proc.pid, describe_exit(rc), progress,
                         "not restarting" if restart is None else
                         f"restart at step {restart.at_step}" if restart.at_step is not None else
                         f"restart in {node.opts.restart_delay_s:.1f} s")

    def _mark_dead(self, inc: Incarnation, reason: str) -> None:
        """Mark dead the worker whose incarnation ``inc`` died, unless its death is already behind the job.

        A job restore publishes its view only once every member of the view before it is marked dead (a
        member on another node by its heartbeat's silence, when this agent has not seen its exit yet), and
        then clears every member's mark. An exit this agent sees only after that, of an incarnation that had
        entered an older view, is of a death the restore already counted: a mark written now would be read
        as the death of the new view's member (its next incarnation would not enter the restored view, and
        the other members would wait for it there). Such a mark is not written, or withdrawn when the view
        was published between the check and the write.
        """
        store, w = self.node.store, inc.worker
        if self._counted_by_restore(inc):
            self.node.log.info("worker %d: its death was counted by the job restore of view %d; not marked",
                               w, store.gen())
            return
        if store.mark_dead(w, reason) and self._counted_by_restore(inc):
            store.unmark_dead(w, reason)

    def _counted_by_restore(self, inc: Incarnation) -> bool:
        """Is the current view a restored view that names ``inc``'s worker and is newer than every view the
        incarnation entered (which was at least one)?"""
        store = self.node.store
        if not store.has_view():
            return False
        view = store.current_view()
        if view.restore is None or inc.worker not in view.members:
            return False
        adopted = newest_adopted_gen(self.node.run_dir, inc.worker, inc.proc.pid, since=inc.born - 1.0)
        return adopted is not None and adopted < view.gen

    def fence(self) -> None:
        """SIGKILL any running worker of this node that someone marked dead after it started."""
        deaths = self.node.store.deaths()
        if deaths == self._deaths_seen:
            return
        self._deaths_seen = deaths
        for w, inc in self.node.workers.items():
            if inc.fenced:
                continue
            mark = self.node.mark(w)
            if mark is None:
                inc.mark_at_spawn = None  # the old mark was cleared: any new one is about this incarnation
            elif mark != inc.mark_at_spawn:
                self._kill(inc, decode_mark(mark), f"marked dead by {mark}")
        if self.node.done_at is None:
            self._check_live_member()

    def _fence_replica(self, inc: Incarnation) -> None:
        """HSDP: worker ``inc.worker`` is gone, and with it its replica (FSDP2's collectives inside it cannot
        finish): its running siblings are marked dead and fenced now, and the replica's next start gets keys
        of its own. A sibling fenced this way does not start another round."""
        node = self.node
        if node.replicas.shard_degree == 1 or (isinstance(inc.reason, dict) and inc.reason.get("how") == "replica"):
            return
        r = node.replicas.replica_of(inc.worker)
        node.replica_losses[r] = node.replica_losses.get(r, 0) + 1
        for sibling in node.replicas.replica_members(r):
            sib = node.workers.get(sibling)
            if sib is None or sib.fenced:
                continue
            reason = {"by": "agent", "node": node.rank, "how": "replica", "worker": inc.worker, "t": time.time()}
            node.store.mark_dead(sibling, json.dumps(reason))
            self._kill(sib, reason, f"its replica {r} lost worker {inc.worker}")

    def fence_stalled(self, now: float) -> None:
        """SIGKILL a worker that stopped beating before it was admitted (:mod:`unbroken.agent._supervision`)."""
        workers = self.node.workers
        for w, reason in self.watch.stalled(now).items():
            if w in workers and not workers[w].fenced:
                self._kill(workers[w], reason, f"hung while starting or joining: {reason}")

    def _kill(self, inc: Incarnation, reason: Any, why: str) -> None:
        """Fence ``inc``: SIGKILL now; its exit, reaped by the loop, counts as a death (then a restart).

        A worker judged hung (not seen dead) first writes its threads' stacks to its log: where it hung."""
        if isinstance(reason, dict) and reason.get("how") in HANG_HOWS and dump_stacks(inc.proc):
            why += f"; its threads' stacks are in logs/w{inc.worker}.log"
        send(inc.proc, signal.SIGKILL)
        inc.fenced, inc.reason = True, reason
        self.watch.forget(inc.worker)
        self.node.event("fence", inc.worker, pid=inc.proc.pid, reason=reason)
        self.node.log.warning("fenced worker %d (pid %d): %s", inc.worker, inc.proc.pid, why)

    def _check_live_member(self) -> None:
        """Set ``failed`` when every member of the current view is marked dead.

        Nobody is left to hold the training state or hand it to a joiner, and
        with every worker gone nobody else would notice.
        """
        store = self.node.store
        if not store.has_view():
            return
        view = store.current_view()
        if store.all_marked_dead(view.members):
            # A job-wide failure: bring the job back from snapshot memory or the checkpoint (_restore).
            self.restorer.all_dead(view)
