"""Per-node agent: runs a node's workers, marks their deaths, fences, restarts, injects faults.

One agent per node (machine); on one machine several agents on loopback play
several nodes. Node ``R`` owns workers ``R*W .. R*W + W-1`` (the job has ``N*W``)::

    python -m unbroken.agent.command --node-rank R --nnodes N --workers-per-node W --store HOST:PORT
        --run-dir DIR [--restart never|on-failure] [--restart-delay-s S] [--fail-at SPEC]
        [--faults-trace JSON] [--standby] [--start-step S] [--resume CKPT]
        [--startup-liveness-s S] [--startup-deadline-s S]

(also ``unbroken agent``). Exit 0: the job is done. 1: the job failed, the store was lost; 75: preempted,
the final checkpoint committed (:mod:`unbroken.agent.preemption`); 130/143: interrupted. 2: refused to start
(store unreachable, node rank taken, config differs).

The store keys an agent reads and writes, the files it keeps in the run
directory and the worker command line are listed in ``docs/design.md``
(section "Agents"); the warm standby's contract is in
:mod:`unbroken.agent._standby`.

The agent is composed of parts, each given what it needs at construction: the node's record
(:class:`~unbroken.agent.node.Node`), the reaper (:mod:`unbroken.agent._reaper`: deaths, marks, fencing), the
starter (:mod:`unbroken.agent._starter`: starts, adoption, the standby, restarts due), the fault firing
(:mod:`unbroken.agent._fault_firing`) and the restorer (:mod:`unbroken.agent._restore`); the agent keeps its
start-up and its loop, which calls them.

Invariants: a worker's nonzero exit is marked dead within one poll (~10 ms); a
marked incarnation never keeps running; one not yet admitted to the view that
stops beating is fenced and restarted (:mod:`unbroken.agent._supervision`),
members are judged by their peers; no child outlives the agent (own session
per child, SIGKILL on the agent's death, SIGTERM then SIGKILL on its exit);
every blocking call has a timeout, and no wait in the loop exceeds a poll.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable, MutableMapping, Sequence

import torch.distributed as dist

from unbroken.agent._fault_firing import FaultFiring, fault_plan_file
from unbroken.agent._reaper import Reaper, reap_dying
from unbroken.agent._restore import JobRestore
from unbroken.agent._run_files import fired_before, write_layout
from unbroken.agent._process import (Child, ChildWaker, become_subreaper, exit_status, remove_pid, spawn, stop_all,
                                     write_pid)
from unbroken.agent._starter import Starter
from unbroken.agent._supervision import Limits, StartupWatch
from unbroken.agent.node import EventLog, Node
from unbroken.agent.launch_checks import check_launch
from unbroken.agent.restarts import Restarts
from unbroken.agent.template_client import EarlyTemplate, Template, TemplateFailed
from unbroken.agent.rendezvous import NodeRegistration, StartRefused, wait_for_lost_node
from unbroken.agent.options import AgentOptions
from unbroken.agent.health_check import check_node
from unbroken.agent.preemption import EXIT_PREEMPTED, PREEMPT_SIGNALS, preempted_message
from unbroken.faults.injector import NodeFaults, workers_of
from unbroken.store.job_store import JobStore
from unbroken.store.backend import SECRET_ENV, StoreAccessDenied, is_etcd_address, job_secret
from unbroken.store.wire import LAUNCH_ENV
from unbroken.store.view import View
from unbroken.config import Config, config_from_dict, config_hash
from unbroken.sharding.replica_layout import ReplicaLayout
from unbroken.snapshot.segment import remove_segments

logger = logging.getLogger(__name__)

LOOP_S = 0.005  # with a fault to inject, progress is polled this often, so it lands within ~5 ms of its step
IDLE_S = 0.1
"""The loop's tick otherwise: a worker's exit wakes it at once (:class:`ChildWaker`); what it polls in the
store (marks to fence, the job's status, restarts due) is not needed sooner."""
FENCE_S = 0.1
"""How often the death counter is read for marks to fence (a store round trip: at the loop's pace, one agent
would cost the store 200 a second, more than the heartbeats of its workers). A mark comes from a peer that judged
a worker hung or fenced it (it is out of the view already); a crash this agent reaps itself, at once."""
STATUS_S = 0.1


class AgentError(RuntimeError):
    """The agent stops without finishing; carries the process exit code."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class _NodeLog(logging.LoggerAdapter[logging.Logger]):
    """Log lines carry their origin: ``[node 1 g7 step 412]`` (the newest generation and progress seen)."""

    def __init__(self, origin: Callable[[], str]) -> None:
        super().__init__(logger, {})
        self.origin = origin

    def process(self, msg: Any, kwargs: MutableMapping[str, Any]) -> tuple[Any, MutableMapping[str, Any]]:
        return f"[{self.origin()}] {msg}", kwargs


@dataclasses.dataclass(frozen=True, kw_only=True)
class _Parts:
    """What a started node's loop runs: its record and the parts that act on it."""

    node: Node
    rdv: NodeRegistration
    reaper: Reaper
    starter: Starter
    faults: FaultFiring
    restorer: JobRestore


class Agent:
    """Supervisor of one node's workers (module docstring): it starts the node and runs its loop; what it does
    on a death (:class:`~unbroken.agent._reaper.Reaper`), to start a worker
    (:class:`~unbroken.agent._starter.Starter`) and for a fault (:class:`~unbroken.agent._fault_firing.FaultFiring`)
    are parts it builds once the node's record (:class:`~unbroken.agent.node.Node`) is.

    Args:
        opts: the command line.
        worker_cmd: tests only: the command that replaces ``python -m
            unbroken.agent.worker_process`` (a stand-in worker script).
        template: the node's template process, started with the agent's process (None: the agent starts
            one itself, where the job wants one); the agent builds its :class:`Template` around it.
    """

    def __init__(self, opts: AgentOptions, *, worker_cmd: Sequence[str] | None = None,
                 template: EarlyTemplate | None = None) -> None:
        self.opts = opts
        self.node = opts.node_rank
        self.log = _NodeLog(self._origin)
        self.specs = opts.faults()
        self.base_cmd = list(worker_cmd) if worker_cmd else [sys.executable, "-m", "unbroken.agent.worker_process"]
        self.run_dir = opts.run_dir
        self.store: JobStore | None = None
        self.events: EventLog | None = None
        self.restarts = Restarts(policy=opts.restart, delay_s=opts.restart_delay_s, log=self.log,
                                 logs_dir=opts.run_dir / "logs")
        self._early = template
        self.template: Template | None = None  # built around it (or anew) once the job wants one
        self.child_env: dict[str, str] = {}
        """What the environment of each process this agent starts must hold beyond its template's: the job's
        secret and the store's launch id (:meth:`join_store`)."""
        self.interrupted: int | None = None
        """The signal that interrupted the agent (:meth:`interrupt`); its loop stops at its next tick."""
        self.preempted: tuple[int, float] | None = None
        """The first SIGTERM/SIGUSR1 and when (:mod:`unbroken.agent.preemption`): the job is asked to stop."""
        self._stop_asked = False
        self._stopped_after: int | None = None  # a preempted job's last step, once it is done
        self.rdv: NodeRegistration | None = None
        self._server: JobStore | None = None  # with --host-store: the store lives in this process
        self._node: Node | None = None  # the node's record, once the job's config is taken
        self._parts: _Parts | None = None  # once the node is started
        self._spare_since: float | None = None  # a spare: when it began to wait for a lost node

    def interrupt(self, signum: int) -> None:
        """A signal asks the agent to stop (called from its handler): the loop raises at its next tick. The
        first SIGTERM or SIGUSR1 asks the job to stop with a final checkpoint instead (``--preempt-grace-s``)."""
        if signum in PREEMPT_SIGNALS and self.opts.preempt_grace_s > 0 and self.preempted is None:
            self.preempted = (signum, time.monotonic())
            return
        self.interrupted = signum

    def _origin(self) -> str:
        """Where a log line comes from: the node, and the newest generation and progress it has seen."""
        if self._node is None:
            return f"node {self.node} g0 step {self.opts.start_step}"
        return f"node {self._node.rank} g{self._node.gen} step {self._node.progress}"

    # -- start-up ---------------------------------------------------------------

    def run(self) -> int:
        """Start, supervise until the job ends, stop every child; returns 0 (done).

        Raises:
            AgentError: refusal (code 2) or failure (code 1, 130, 143); the message says why.
        """
        store = self.join_store()
        if self.opts.spare and not self._take_a_lost_node(store):
            return 0
        self.rdv = rdv = NodeRegistration(store, self.node, timeout_s=self.opts.timeout_s,
                                          interrupted=lambda: self.interrupted is not None,
                                          workers=workers_of(self.node, self.opts.workers_per_node),
                                          pid_dir=self.run_dir / "pids")
        try:
            rdv.register()
            self.events = events = EventLog(self.run_dir / "events" / f"agent{self.node}.jsonl", self.node)
            write_pid(self.run_dir / "pids" / f"agent{self.node}", os.getpid())
            check = check_node(self.opts.health_check, self.opts.health_check_timeout_s, events,
                               spare=self._spare_since is not None)
            if check is not None and not check.ok:  # the node stays out: _shutdown gives its rank back
                raise AgentError(f"node {self.node}: {check.describe()}: the node stays out", 2)
            if self._spare_since is not None:
                events("spare_took_over", None, waited_s=round(time.monotonic() - self._spare_since, 3),
                       took_over=rdv.took_over)
            job_cfg, replicas = self._take_config(store, rdv)
            hb_timeout = float(job_cfg.fault.heartbeat_timeout_s)
            limits = self.opts.startup_limits(heartbeat_timeout_s=hb_timeout)
            restorer = JobRestore(store, node=self.node, nnodes=self.opts.nnodes,
                                  workers_per_node=self.opts.workers_per_node, run_dir=self.run_dir,
                                  config_hash=config_hash(job_cfg), event=events, shard_degree=replicas.shard_degree)
            self._node = node = Node(rank=self.node, opts=self.opts, store=store, event=events, log=self.log,
                                     replicas=replicas, total_steps=job_cfg.train.steps, progress=self.opts.start_step)
            if self.opts.resume_memory and not store.has_view():
                restorer.first_view(lambda: rdv.heartbeat(time.monotonic()), LOOP_S)
            view = rdv.initial_view(self.opts.n_workers, self.opts.start_step)
            write_layout(self.run_dir, self.node, self.opts.nnodes, self.opts.workers_per_node)
            if store.is_done():
                self.log.info("the job is already done; nothing to run")
                return 0
            node.progress = max(node.read_progress(), view.step)
            parts = self._start_node(node, rdv, view, job_cfg, limits, restorer)
            code = self._loop(parts, hb_timeout)
            if code == 0 and self._stopped_after is not None:
                raise AgentError(f"node {self.node}: {preempted_message(self.run_dir, self._stopped_after)}",
                                 EXIT_PREEMPTED)
            return code
        except StartRefused as exc:
            raise AgentError(str(exc), 2) from None
        except TemplateFailed as exc:
            store.fail(f"stopped: node {self.node} cannot start its workers: {exc}")  # said once, not per worker
            raise AgentError(f"node {self.node}: the workers cannot start: {exc}", 2) from None
        except dist.DistError as exc:
            if self._node is not None and self._node.done_at is not None:
                return 0  # the store's host closed it after the end: nothing was lost
            raise AgentError(f"node {self.node}: lost the store {self.opts.store} ({str(exc).splitlines()[0]}): "
                             f"its workers are stopped, the committed checkpoints kept; continue with "
                             f"unbroken train --resume {self.run_dir}", 1) from None
        finally:
            self._shutdown()

    def _take_config(self, store: JobStore, rdv: NodeRegistration) -> tuple[Config, ReplicaLayout]:
        """The job's config as this node must run it (refused when it differs or cannot run here: the launch's
        checks, :func:`unbroken.agent.launch_checks.check_launch`) and its replicas; the store's patience is set
        from it."""
        cfg = rdv.check_config(self.run_dir)
        rdv.check_shared_run_dir(self.run_dir)
        job_cfg = config_from_dict(cfg)
        try:
            replicas = check_launch(job_cfg, self.opts.workers_per_node, standby=self.opts.standby,
                                    placed=workers_of(self.node, self.opts.workers_per_node))
        except ValueError as exc:
            raise AgentError(f"node {self.node}: {exc}", 2) from None
        for joined in (store, self._server):  # from now on the job's own patience with its store
            if joined is not None:
                joined.set_store_timeout(job_cfg.fault.store_timeout_s)
        return job_cfg, replicas

    def _start_node(self, node: Node, rdv: NodeRegistration, view: View, job_cfg: Config, limits: Limits,
                    restorer: JobRestore) -> _Parts:
        """This node's fault plan, template, parts, workers of ``view`` and warm standby."""
        plan = NodeFaults(self.specs, node=self.node, workers_per_node=self.opts.workers_per_node,
                          start_step=node.progress, fired=fired_before(self.run_dir, self.node),
                          max_down=job_cfg.fault.max_down)
        fault_file = fault_plan_file(self.opts.faults_file, self.specs, run_dir=self.run_dir, node=self.node)
        if job_cfg.fault.template:
            self._start_template(limits, rdv, node.event)
        elif self._early is not None:  # started early from an older config
            self._early.close()
            self._early = None
        watch = StartupWatch(node.store, limits, node=self.node)
        starter = Starter(node, launch=self.launch, base_cmd=self.base_cmd, fault_file=fault_file, watch=watch,
                          restarts=self.restarts, plan=plan, restorer=restorer, limits=limits)
        self._parts = parts = _Parts(
            node=node, rdv=rdv, starter=starter, restorer=restorer,
            reaper=Reaper(node, watch=watch, restarts=self.restarts, plan=plan, template=self.template,
                          restorer=restorer),
            faults=FaultFiring(node, plan=plan, restarts=self.restarts, lose_node=starter.kill_standby))
        self._start_workers(parts, view)
        if self.opts.standby:
            starter.start_standby()
        return parts

    def join_store(self) -> JobStore:
        """Connect to the job's store (hosting it first with ``--host-store``); every process this agent starts
        holds the job's secret and pins the store's launch (:attr:`child_env`). Returns the store.

        Raises:
            AgentError: (code 2) no secret, no store at the address, or a store that refused this job.
        """
        try:
            secret = job_secret(self.run_dir, create=self.opts.host_store)
            os.environ[SECRET_ENV] = secret  # inherited by the workers this agent starts, never on argv
            self._server = self._host_store(secret) if self.opts.host_store else None
            self.store = store = JobStore.connect(self.opts.store, timeout_s=self.opts.timeout_s, secret=secret)
        except (ConnectionError, ValueError, StoreAccessDenied) as exc:
            raise AgentError(f"node {self.node}: {exc}", 2) from None
        self.child_env = {SECRET_ENV: secret}
        if store.launch is not None:  # the processes this agent starts talk to this launch's store only
            os.environ[LAUNCH_ENV] = self.child_env[LAUNCH_ENV] = store.launch
        return store

    def _host_store(self, secret: str) -> JobStore:
        if is_etcd_address(self.opts.store):  # open the job's keys on the cluster; nothing to host
            job = {"run_dir": str(self.run_dir.resolve()), "host": socket.gethostname(), "pid": os.getpid()}
            return JobStore.create_on_etcd(self.opts.store, timeout_s=self.opts.timeout_s, secret=secret, job=job)
        host, _, port = self.opts.store.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"--store {self.opts.store!r} is not HOST:PORT")
        return JobStore.host(host, int(port), clients=self.opts.n_workers + self.opts.nnodes, secret=secret)

    def _take_a_lost_node(self, store: JobStore) -> bool:
        """A spare node: wait (its template importing and preparing meanwhile) for a node whose agent and
        workers are known dead, then become that node; False if the job finished first."""
        self.log.info("spare node: waiting for a lost node (template %s)",
                      "starting" if self._early is not None else "off")
        self._spare_since = time.monotonic()
        def interrupted() -> bool:  # a spare holds no state: a preemption stops it at once
            self.interrupted = self.interrupted or (self.preempted[0] if self.preempted is not None else None)
            return self.interrupted is not None

        try:
            node = wait_for_lost_node(store, nnodes=self.opts.nnodes, workers_per_node=self.opts.workers_per_node,
                                      pid_dir=self.run_dir / "pids", interrupted=interrupted)
        except StartRefused as exc:
            raise AgentError(str(exc), 128 + (self.interrupted or 0)) from None
        if node is None:
            self.log.info("the job finished before any node was lost: the spare leaves")
            if self._early is not None:
                self._early.close()
            return False
        self.opts = dataclasses.replace(self.opts, node_rank=node, spare=False)
        self.node = node
        if self._early is not None:
            self._early.take_rank(node)
        self.log.warning("spare node: taking over node %d (its agent and workers are gone)", node)
        return True

    def _start_template(self, limits: Limits, rdv: NodeRegistration, event: EventLog) -> None:
        """Start the node's template (:mod:`unbroken.agent.template`), unless it started with the agent's
        process (:func:`unbroken.agent.command.prestart_template`), and wait for it: workers fork from it."""
        early, self._early = self._early, None
        if early is None and self.base_cmd[1:] != ["-m", "unbroken.agent.worker_process"]:  # a stand-in worker
            return
        if early is None and not become_subreaper():
            self.log.warning("cannot adopt forked workers here (no PR_SET_CHILD_SUBREAPER): no template")
            return
        self.template = Template(run_dir=self.run_dir, node=self.node, world=self.opts.n_workers, event=event,
                                 ready_timeout_s=limits.deadline_s, early=early)
        if early is None:
            self.template.start(time.monotonic(), fork=True)
        self.template.wait_ready(limits.deadline_s, lambda: rdv.heartbeat(time.monotonic()))

    def launch(self, cmd: Sequence[str], *, log: Path, header: str) -> Child:
        """Start a worker's or standby's process: forked from the template when it is ready."""
        if self.template is None:
            return spawn(cmd, log=log, header=header)
        # Its template may have forked before this agent connected (``unbroken agent`` starts it first): the
        # secret and the launch id go with each request, or the worker would accept any launch at the address.
        return self.template.launch(cmd, log=log, header=header, env=self.child_env)

    def _start_workers(self, parts: _Parts, view: View) -> None:
        node, starter = parts.node, parts.starter
        for w in parts.rdv.mark_predecessors_dead():
            self.log.warning("worker %d of the node's previous agent is gone with it: marked dead", w)
        if view.restore is not None:  # a restored first view: its members load the state themselves
            for w in workers_of(self.node, self.opts.workers_per_node):
                if w in view.members:
                    starter.start(w, join=False, resume=False)
            return
        for w in workers_of(self.node, self.opts.workers_per_node):
            # A fresh process without the training state can only be a member of a
            # view that starts now; otherwise it must join and receive the state.
            join = parts.rdv.took_over or w not in view.members or node.mark(w) is not None or node.progress > view.step
            starter.start(w, join=join)

    # -- the loop ---------------------------------------------------------------

    def _loop(self, parts: _Parts, hb_timeout: float) -> int:
        waker = ChildWaker()
        try:
            return self._ticks(parts, waker, hb_timeout)
        finally:
            waker.close()

    def _ticks(self, parts: _Parts, waker: ChildWaker, hb_timeout: float) -> int:
        """``hb_timeout``: the job's ``fault.heartbeat_timeout_s`` (a silent member is judged by it)."""
        node, store, restorer = parts.node, parts.node.store, parts.restorer
        next_status = next_fence = 0.0
        while True:
            now = time.monotonic()
            if self.preempted is not None and node.done_at is None:
                self._preempt(node, now)
            if self.interrupted is not None:
                name = signal.Signals(self.interrupted).name
                raise AgentError(f"node {self.node}: interrupted by {name}; workers stopped", 128 + self.interrupted)
            parts.rdv.heartbeat(now)
            parts.reaper.reap(now)
            if now >= next_fence:
                next_fence = now + FENCE_S
                parts.reaper.fence()
            if node.done_at is None and self.preempted is None:
                parts.reaper.fence_stalled(now)
                parts.faults.inject(now)
                parts.starter.restart_due(now)
                if (failure := restorer.tick(now)) is not None:
                    store.fail(failure)
                restorer.mark_silent(lambda: store.current_view() if store.has_view() else None, now, hb_timeout)
                parts.starter.follow_restore()
            # A stopping job restarts and restores nothing: its workers finish the step in flight and the final
            # checkpoint, or they are gone (a scheduler signals every process of the job), and then nothing is
            # left to save on this node: it stops at once rather than waiting out the grace.
            if self.preempted is not None and node.done_at is None and self._stop_asked and not node.workers \
                    and not node.dying and not store.is_done():
                self.interrupted = self.preempted[0]
            if self.template is not None and node.done_at is None:
                self.template.tick(now)
            parts.starter.standby_tick(now)  # after done: reaps a standby let go
            if now >= next_status:
                next_status = now + STATUS_S
                code = self._status(parts, now)
                if code is not None:
                    return code
            # Fast while a fault waits for a step (the progress is polled at LOOP_S), a stopped worker's SIGCONT
            # is due, or a restore is being decided.
            armed = parts.faults.armed() or restorer.busy()
            waker.sleep(max(LOOP_S if armed else IDLE_S, store.poll_s))

    def _preempt(self, node: Node, now: float) -> None:
        """Ask the job to stop with a final checkpoint (once); past ``--preempt-grace-s`` stop at once."""
        assert self.preempted is not None
        signum, since = self.preempted
        if not self._stop_asked:
            self._stop_asked = True
            node.store.request_stop()
            name = signal.Signals(signum).name
            node.event("preempt_requested", None, signal=name, grace_s=self.opts.preempt_grace_s)
            self.log.warning("%s: the job stops after the step in flight with a final checkpoint (a second signal, or "
                             "%.0f s without it, stops at once)", name, self.opts.preempt_grace_s)
        if now - since > self.opts.preempt_grace_s:
            self.interrupted = signum

    def _status(self, parts: _Parts, now: float) -> int | None:
        """Follow ``done`` / ``failed``; an exit code once this agent's part is over."""
        node, store = parts.node, parts.node.store
        message = store.failure()
        if message is not None:
            self.log.error("the job failed: %s", message)
            raise AgentError(f"node {self.node}: the job failed: {message}", 1)
        if store.has_view():
            node.gen = store.gen()
        if node.done_at is None and store.is_done():
            node.done_at = now
            self._stopped_after = store.stop_point()[1]  # a preemption's step: the job stopped early
            self.restarts.clear()
            parts.starter.stop_standby()
            self.log.info("the job is done; waiting for %d worker(s) to exit", len(node.workers))
        if node.done_at is not None:
            if not node.workers:
                return 0
            if now - node.done_at > self.opts.grace_s:
                self.log.warning("workers %s still running %.0f s after done: stopping them",
                                 sorted(node.workers), self.opts.grace_s)
                return 0  # _shutdown stops them
            return None
        if not node.workers and not self.restarts and node.finished:
            # Every local worker finished cleanly; done should follow at once from the leader.
            node.idle_since = node.idle_since or now
            if now - node.idle_since > self.opts.timeout_s:
                self.log.warning("all workers finished but 'done' never came; exiting")
                return 0
        return None

    # -- exit -------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Stop every child (SIGTERM, grace, SIGKILL) and release the node rank."""
        parts = self._parts
        if parts is not None:
            parts.starter.close_standby()  # it holds no state: SIGKILL
        for template in (t for t in (self.template, self._early) if t is not None):
            template.close()
        if parts is not None:
            node = parts.node
            stop_all([inc.proc for inc in node.workers.values()], grace_s=self.opts.grace_s)
            reap_dying(node.dying, node.event, wait_s=10.0)  # exiting already: only the kernel's teardown is left
            for w, inc in node.workers.items():
                remove_pid(self.run_dir / "pids" / f"w{w}", inc.proc.pid)
                code, sig = exit_status(inc.proc.returncode if inc.proc.returncode is not None else -9)
                node.event("worker_exit", w, pid=inc.proc.pid, code=code, signal=sig, stopped_by_agent=True,
                           clean=False, incarnation=inc.incarnation)
            node.workers.clear()
        if self.rdv is not None:
            try:
                self.rdv.release()
                if self._server is not None:
                    self.rdv.wait_released(self.opts.nnodes, self.opts.grace_s + 5.0)
            except dist.DistError:
                pass  # the store is gone with the launcher: nothing left to release
        remove_pid(self.run_dir / "pids" / f"agent{self.node}", os.getpid())
        if parts is not None and parts.node.done_at is not None:
            removed = remove_segments(parts.restorer.job, self.node)  # the job ended normally: memory is freed
            self.log.info("removed %d snapshot segment(s) of node %d", removed, self.node)
        if self.events is not None:
            self.events.close()
            self.events = None
