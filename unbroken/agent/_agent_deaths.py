"""The agent's side of deaths: reaping its workers, marking them dead, fencing, scheduling restarts.

A mixin of :class:`unbroken.agent.agent.Agent`. A worker's death is seen within one tick of the kill, while
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
from typing import TYPE_CHECKING, Any

from unbroken.agent._exit_watch import exiting_returncode
from unbroken.agent._job_error import CONSEQUENCE_EXIT_CODES, death_error
from unbroken.agent._process import HANG_HOWS, ForkedChild, describe_exit, dump_stacks, exit_status, remove_pid, send
from unbroken.agent._run_files import last_self_fault, was_admitted
from unbroken.agent._supervision import Incarnation, decode_mark
from unbroken.faults.fail_at import format_fail_at
from unbroken.faults.injector import DeathCause
from unbroken.runtime.membership import EXIT_FENCED, EXIT_REJOIN

if TYPE_CHECKING:
    from unbroken.agent.agent import Agent

__all__ = ["DeathDuties"]


class DeathDuties:
    """Reaps, marks, fences and schedules restarts (the agent's loop calls :meth:`_reap` and :meth:`_fence`)."""

    def _reap(self: Agent, now: float) -> None:
        for w, inc in list(self.workers.items()):
            rc = inc.proc.poll()
            seen = "reaped"
            if rc is None and (rc := exiting_returncode(inc.proc.pid)) is not None:
                seen = "exiting"  # dead from now on; the kernel may take seconds more to let it be reaped
                self._dying.append((inc, now))
            if rc is not None:
                del self.workers[w]
                self._on_exit(inc, rc, now, seen)
        self._reap_dying(now)

    def _reap_dying(self: Agent, now: float, wait_s: float = 0.0) -> None:
        """Reap the workers seen dying whose teardown is over (``wait_s``: wait that long for the rest)."""
        deadline = time.monotonic() + wait_s
        for inc, seen_at in list(self._dying):
            try:
                inc.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                continue
            self._dying.remove((inc, seen_at))
            self._event("worker_reaped", inc.worker, pid=inc.proc.pid, incarnation=inc.incarnation,
                        teardown_s=round(time.monotonic() - seen_at, 3))

    def _on_exit(self: Agent, inc: Incarnation, rc: int, now: float, seen: str = "reaped") -> None:
        """``seen``: ``exiting`` (the kernel tears it down still: :mod:`unbroken.agent._exit_watch`) or ``reaped``."""
        w = inc.worker
        remove_pid(self.run_dir / "pids" / f"w{w}", inc.proc.pid)
        self.watch.forget(w)
        code, sig = exit_status(rc)
        rec: dict[str, Any] = {"pid": inc.proc.pid, "code": code, "signal": sig, "incarnation": inc.incarnation,
                               "uptime_s": round(now - inc.started, 3), "seen": seen,
                               "fenced": inc.fenced or code in (EXIT_FENCED, EXIT_REJOIN), "reason": inc.reason}
        if rc == 0:
            self.finished.add(w)
            self._event("worker_exit", w, clean=True, **rec)
            self.log.info("worker %d finished", w)
            return
        # A dead joiner's request goes with it: no leader admits an incarnation that is gone (its successor
        # asks again), and a restore does not find a stale request to admit.
        self.store.clear_join(w)
        self._fence_replica(inc)
        error = death_error(self.run_dir, w, code, sig)  # the job's own error (None: killed from outside...)
        rec["error"] = error
        if (error is not None and not inc.fenced and isinstance(inc.proc, ForkedChild) and self.template is not None
                and not was_admitted(self.run_dir, w, inc.proc.pid)):
            self.template.forked_failed(error)  # twice alike before admission: workers start fresh (the fork...)
        reason = json.dumps({"by": "agent", "node": self.node, "how": "exit", "code": code, "signal": sig,
                             "error": error, "t": time.time()})
        self.store.mark_dead(w, reason)
        fired = last_self_fault(self.run_dir, w)
        progress = max(self._read_progress(), fired[0] if fired is not None else 0)
        cause = self.plan.on_death(w, progress, fired) if self.plan else DeathCause(injected=False)
        # A crash loop is the worker's own failing (an exit code, a fatal signal of its own), not a SIGKILL nor an
        # exit that follows from another's failure: a worker killed again and again from outside (or fenced, or
        # left with nobody to hand it the state) comes back every time.
        restart = None if self._done_at is not None else self.restarts.schedule(
            w, now=now, started=inc.started, crashed=not cause.injected and not inc.fenced and sig != signal.SIGKILL
            and code not in CONSEQUENCE_EXIT_CODES,
            back_step=cause.back_step, total_steps=self.total_steps, rejoin=code == EXIT_REJOIN and not cause.injected)
        self._event("worker_exit", w, clean=False, injected=cause.injected, progress=progress,
                    spec=format_fail_at([cause.spec]) if cause.spec else None,
                    restart_at_step=restart.at_step if restart else None,
                    restart_in_s=round(restart.at_time - now, 3) if restart and restart.at_time else None, **rec)
        self.log.warning("worker %d (pid %d) %s at step %d; %s", w, inc.proc.pid, describe_exit(rc), progress,
                         "not restarting" if restart is None else
                         f"restart at step {restart.at_step}" if restart.at_step is not None else
                         f"restart in {self.opts.restart_delay_s:.1f} s")

    def _fence(self: Agent) -> None:
        """SIGKILL any running worker of this node that someone marked dead after it started."""
        deaths = self.store.deaths()
        if deaths == self._deaths_seen:
            return
        self._deaths_seen = deaths
        for w, inc in self.workers.items():
            if inc.fenced:
                continue
            mark = self._mark(w)
            if mark is None:
                inc.mark_at_spawn = None  # the old mark was cleared: any new one is about this incarnation
            elif mark != inc.mark_at_spawn:
                self._kill(inc, decode_mark(mark), f"marked dead by {mark}")
        if self._done_at is None:
            self._check_live_member()

    def _fence_replica(self: Agent, inc: Incarnation) -> None:
        """HSDP: worker ``inc.worker`` is gone, and with it its replica (FSDP2's collectives inside it cannot
        finish): its running siblings are marked dead and fenced now, and the replica's next start gets keys
        of its own. A sibling fenced this way does not start another round."""
        k = self.shard_degree
        if k == 1 or (isinstance(inc.reason, dict) and inc.reason.get("how") == "replica"):
            return
        r = inc.worker // k
        self._replica_starts[r] = self._replica_starts.get(r, 0) + 1
        for sibling in range(r * k, (r + 1) * k):
            sib = self.workers.get(sibling)
            if sib is None or sib.fenced:
                continue
            reason = {"by": "agent", "node": self.node, "how": "replica", "worker": inc.worker, "t": time.time()}
            self.store.mark_dead(sibling, json.dumps(reason))
            self._kill(sib, reason, f"its replica {r} lost worker {inc.worker}")

    def _fence_stalled(self: Agent, now: float) -> None:
        """SIGKILL a worker that stopped beating before it was admitted (:mod:`unbroken.agent._supervision`)."""
        for w, reason in self.watch.stalled(now).items():
            if w in self.workers and not self.workers[w].fenced:
                self._kill(self.workers[w], reason, f"hung while starting or joining: {reason}")

    def _kill(self: Agent, inc: Incarnation, reason: Any, why: str) -> None:
        """Fence ``inc``: SIGKILL now; its exit, reaped by the loop, counts as a death (then a restart).

        A worker judged hung (not seen dead) first writes its threads' stacks to its log: where it hung."""
        if isinstance(reason, dict) and reason.get("how") in HANG_HOWS and dump_stacks(inc.proc):
            why += f"; its threads' stacks are in logs/w{inc.worker}.log"
        send(inc.proc, signal.SIGKILL)
        inc.fenced, inc.reason = True, reason
        self.watch.forget(inc.worker)
        self._event("fence", inc.worker, pid=inc.proc.pid, reason=reason)
        self.log.warning("fenced worker %d (pid %d): %s", inc.worker, inc.proc.pid, why)

    def _check_live_member(self: Agent) -> None:
        """Set ``failed`` when every member of the current view is marked dead.

        Nobody is left to hold the training state or hand it to a joiner, and
        with every worker gone nobody else would notice.
        """
        if not self.store.has_view():
            return
        view = self.store.current_view()
        if self.store.all_marked_dead(view.members):
            # A job-wide failure: bring the job back from snapshot memory or the checkpoint (_restore).
            self.restorer.all_dead(view)

    def _follow_restore(self: Agent) -> None:
        """A restored view names this node's dead workers: start them now (they load the state in it)."""
        if self.gen is None or self.gen == self._restored_gen or not self.store.has_view():
            return
        view = self.store.current_view()
        self._restored_gen = view.gen
        for w in self.restorer.workers_to_start(view, set(self.workers)):
            self.restarts.cancel(w)
            if self.standby is not None and self.standby.offered == w:
                # Handed to the standby, not claimed yet: one owner of "which process is w". The offer is
                # withdrawn (compare-and-set) before w is started here; if the standby's claim won, it is w.
                handover = self.standby.withdraw(time.monotonic())
                self._event("standby_withdrawn", w, gen=view.gen, claimed=handover.proc is not None)
                if handover.proc is not None:
                    self._take_handover(handover)
                    continue
                self._start(w, join=True, use_standby=False, restore_gen=view.gen)
                continue
            self._start(w, join=True, restore_gen=view.gen)
