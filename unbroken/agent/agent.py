"""Per-node agent: runs a node's workers, marks their deaths, fences, restarts, injects faults.

One agent per node (machine); on one machine several agents on loopback play
several nodes. Node ``R`` owns workers ``R*W .. R*W + W-1`` (worker ``w``'s
home slot is ``w``; the job has ``N*W``)::

    python -m unbroken.agent.command --node-rank R --nnodes N --workers-per-node W --store HOST:PORT
        --run-dir DIR [--restart never|on-failure] [--restart-delay-s S] [--fail-at SPEC]
        [--faults-trace JSON] [--standby] [--start-step S] [--resume CKPT]
        [--startup-liveness-s S] [--startup-deadline-s S]

(also ``unbroken agent``). Exit 0: the job is done. 1: the job failed, the
store was lost; 130/143: interrupted. 2: refused to start (store unreachable,
node rank taken, config differs).

The store keys an agent reads and writes, the files it keeps in the run
directory and the worker command line are listed in ``docs/design.md``
(section "Agents"); the warm standby's contract is in
:mod:`unbroken.agent._standby`.

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
import secrets
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

import torch.distributed as dist

from unbroken.agent._agent_deaths import DeathDuties
from unbroken.agent._agent_faults import FaultDuties
from unbroken.agent._agent_starts import StartDuties
from unbroken.agent._restore import JobRestore
from unbroken.agent._run_files import fired_before, write_layout
from unbroken.agent._process import (ChildWaker, become_subreaper, exit_status, remove_pid, spawn, stop_all,
                                     write_pid)
from unbroken.agent._standby import Standby
from unbroken.agent._supervision import Incarnation, Limits, StartupWatch
from unbroken.agent.restarts import Restarts
from unbroken.agent.template_client import Child, Template, TemplateFailed
from unbroken.agent.rendezvous import NodeRegistration, StartRefused, wait_for_lost_node
from unbroken.agent.options import AgentOptions
from unbroken.models.factory import check_placement
from unbroken.faults.injector import NodeFaults, workers_of
from unbroken.jsonl import JsonlWriter
from unbroken.store.job_store import JobStore
from unbroken.store.backend import SECRET_ENV, StoreAccessDenied, is_etcd_address, job_secret
from unbroken.store.wire import LAUNCH_ENV
from unbroken.store.view import View
from unbroken.config import Config, config_from_dict, config_hash
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


class _NodeLog(logging.LoggerAdapter):
    """Log lines carry their origin: ``[node 1 g7 step 412]`` (the newest generation and progress seen)."""

    def process(self, msg: Any, kwargs: Any) -> tuple[Any, Any]:
        agent = self.extra["agent"]
        return f"[node {agent.node} g{agent.gen} step {agent._progress}] {msg}", kwargs


class Agent(DeathDuties, FaultDuties, StartDuties):
    """Supervisor of one node's workers (module docstring); what it does on a death
    (:mod:`unbroken.agent._agent_deaths`), for a fault (:mod:`unbroken.agent._agent_faults`) and to start a
    worker (:mod:`unbroken.agent._agent_starts`) lives beside it.

    Args:
        opts: the command line.
        worker_cmd: tests only: the command that replaces ``python -m
            unbroken.agent.worker_process`` (a stand-in worker script).
        template: the node's template process, started with the agent's process (None: the agent starts
            one itself, where the job wants one).
    """

    def __init__(self, opts: AgentOptions, *, worker_cmd: Sequence[str] | None = None,
                 template: Template | None = None) -> None:
        self.opts = opts
        self.node = opts.node_rank
        self.gen = 0  # the newest view generation seen (for log lines)
        self.log = _NodeLog(logger, {"agent": self})
        self.specs = opts.faults()
        self.base_cmd = list(worker_cmd) if worker_cmd else [sys.executable, "-m", "unbroken.agent.worker_process"]
        self.fault_plan = opts.faults_file
        self.run_dir = opts.run_dir
        self.store: JobStore | None = None
        self.events: JsonlWriter | None = None
        self.workers: dict[int, Incarnation] = {}
        self._dying: list[tuple[Incarnation, float]] = []  # seen dying, not reaped yet (_agent_deaths)
        self.watch: StartupWatch | None = None
        self.restarts = Restarts(policy=opts.restart, delay_s=opts.restart_delay_s, log=self.log,
                                 logs_dir=opts.run_dir / "logs")
        self.incarnations: dict[int, int] = {}
        self.finished: set[int] = set()
        self.stopped: list[tuple[float, int, subprocess.Popen[bytes]]] = []  # SIGCONT timers
        self.standby: Standby | None = None
        self.template = template
        self.child_env: dict[str, str] = {}
        """What the environment of each process this agent starts must hold beyond its template's: the job's
        secret and the store's launch id (:meth:`_join_store`)."""
        self.plan: NodeFaults | None = None
        self.interrupted: int | None = None  # set by the signal handler of run_agent
        self.rdv: NodeRegistration | None = None
        self.total_steps = 0
        self._server: JobStore | None = None  # with --host-store: the store lives in this process
        self._deaths_seen = -1
        self._next_fence = 0.0
        self._progress = opts.start_step
        self._done_at: float | None = None
        self._restored_gen: int | None = None
        self._hb_timeout = 2.0
        self.shard_degree = 1
        """HSDP (``train.shard_degree``): a replica is this many consecutive workers, all on this node; the
        death of one takes its siblings down (fenced here), and they start again together."""
        self._replica_token = secrets.token_hex(4)  # this agent's replica incarnations: keys of their own
        self._replica_starts: dict[int, int] = {}
        self.restorer: JobRestore | None = None
        self._idle_since: float | None = None
        self._spare_since: float | None = None  # a spare: when it began to wait for a lost node

    # -- start-up ---------------------------------------------------------------

    def run(self) -> int:
        """Start, supervise until the job ends, stop every child; returns 0 (done).

        Raises:
            AgentError: refusal (code 2) or failure (code 1, 130, 143); the message says why.
        """
        self._join_store()
        if self.opts.spare and not self._take_a_lost_node():
            return 0
        self.rdv = NodeRegistration(self.store, self.node, timeout_s=self.opts.timeout_s,
                                    interrupted=lambda: self.interrupted is not None,
                                    workers=workers_of(self.node, self.opts.workers_per_node),
                                    pid_dir=self.run_dir / "pids")
        try:
            self.rdv.register()
            self.events = JsonlWriter(self.run_dir / "events" / f"agent{self.node}.jsonl")
            write_pid(self.run_dir / "pids" / f"agent{self.node}", os.getpid())
            if self._spare_since is not None:
                self._event("spare_took_over", None, waited_s=round(time.monotonic() - self._spare_since, 3),
                            took_over=self.rdv.took_over)
            cfg, job_cfg, limits = self._take_config()
            if self.opts.resume_memory and not self.store.has_view():
                self.restorer.first_view(lambda: self.rdv.heartbeat(time.monotonic()), LOOP_S)
            view = self.rdv.initial_view(self.opts.n_workers, self.opts.start_step)
            write_layout(self.run_dir, self.node, self.opts.nnodes, self.opts.workers_per_node)
            if self.store.is_done():
                self.log.info("the job is already done; nothing to run")
                return 0
            self._progress = max(self._read_progress(), view.step)
            self._start_node(view, cfg, job_cfg, limits)
            return self._loop()
        except StartRefused as exc:
            raise AgentError(str(exc), 2) from None
        except TemplateFailed as exc:
            self.store.fail(f"stopped: node {self.node} cannot start its workers: {exc}")  # said once, not per worker
            raise AgentError(f"node {self.node}: the workers cannot start: {exc}", 2) from None
        except dist.DistError as exc:
            if self._done_at is not None:
                return 0  # the store's host closed it after the end: nothing was lost
            raise AgentError(f"node {self.node}: lost the store {self.opts.store} ({str(exc).splitlines()[0]}): "
                             f"its workers are stopped, the committed checkpoints kept; continue with "
                             f"unbroken train --resume {self.run_dir}", 1) from None
        finally:
            self._shutdown()

    def _take_config(self) -> tuple[dict[str, Any], Config, Limits]:
        """The job's config as this node must run it (refused when it differs or cannot run here), the store's
        patience set from it, the start-up watch and the restorer made."""
        cfg = self.rdv.check_config(self.run_dir)
        self.rdv.check_shared_run_dir(self.run_dir)
        self.total_steps = int(cfg["train"]["steps"])
        self._hb_timeout = float(cfg["fault"]["heartbeat_timeout_s"])
        job_cfg = config_from_dict(cfg)
        self.shard_degree = job_cfg.train.shard_degree
        if self.shard_degree > 1 and self.opts.standby:
            raise AgentError(f"node {self.node}: --standby with train.shard_degree={self.shard_degree}: a warm "
                             "standby is one worker, HSDP restarts whole replicas; drop --standby", 2)
        try:
            check_placement(job_cfg.train.device, workers_of(self.node, self.opts.workers_per_node),
                            job_cfg.train.backend)
        except ValueError as exc:
            raise AgentError(f"node {self.node}: {exc}", 2) from None
        for store in (self.store, self._server):  # from now on the job's own patience with its store
            if store is not None:
                store.set_store_timeout(job_cfg.fault.store_timeout_s)
        limits = self.opts.startup_limits(heartbeat_timeout_s=self._hb_timeout)
        self.watch = StartupWatch(self.store, limits, node=self.node)
        self.restorer = JobRestore(self.store, node=self.node, nnodes=self.opts.nnodes,
                                   workers_per_node=self.opts.workers_per_node, run_dir=self.run_dir,
                                   config_hash=config_hash(job_cfg), event=self._event,
                                   shard_degree=job_cfg.train.shard_degree)
        return cfg, job_cfg, limits

    def _start_node(self, view: View, cfg: dict[str, Any], job_cfg: Config, limits: Limits) -> None:
        """This node's fault plan, template, workers of ``view`` and warm standby."""
        self.plan = NodeFaults(self.specs, node=self.node, workers_per_node=self.opts.workers_per_node,
                               start_step=self._progress, fired=fired_before(self.run_dir, self.node),
                               max_down=cfg["fault"].get("max_down"))
        self._write_fault_plan()
        if job_cfg.fault.template:
            self._start_template(limits)
        elif self.template is not None:  # started early from an older config
            self.template.close()
            self.template = None
        self._start_workers(view)
        if self.opts.standby:
            cmd = self.base_cmd + ["--run-dir", str(self.run_dir), "--world", str(self.opts.n_workers),
                                   "--store", self.opts.store, "--standby", "--node-rank", str(self.node)]
            cmd += ["--faults-file", str(self.fault_plan)] if self.fault_plan else []
            self.standby = Standby(self.store, node=self.node, cmd=cmd, run_dir=self.run_dir, limits=limits,
                                   launch=self._launch)

    def _join_store(self) -> None:
        """Connect to the job's store (hosting it first with ``--host-store``); every process this agent starts
        holds the job's secret and pins the store's launch (:attr:`child_env`).

        Raises:
            AgentError: (code 2) no secret, no store at the address, or a store that refused this job.
        """
        try:
            secret = job_secret(self.run_dir, create=self.opts.host_store)
            os.environ[SECRET_ENV] = secret  # inherited by the workers this agent starts, never on argv
            self._server = self._host_store(secret) if self.opts.host_store else None
            self.store = JobStore.connect(self.opts.store, timeout_s=self.opts.timeout_s, secret=secret)
        except (ConnectionError, ValueError, StoreAccessDenied) as exc:
            raise AgentError(f"node {self.node}: {exc}", 2) from None
        self.child_env = {SECRET_ENV: secret}
        if self.store.launch is not None:  # the processes this agent starts talk to this launch's store only
            os.environ[LAUNCH_ENV] = self.child_env[LAUNCH_ENV] = self.store.launch

    def _host_store(self, secret: str) -> JobStore:
        if is_etcd_address(self.opts.store):  # open the job's keys on the cluster; nothing to host
            job = {"run_dir": str(self.run_dir.resolve()), "host": socket.gethostname(), "pid": os.getpid()}
            return JobStore.create_on_etcd(self.opts.store, timeout_s=self.opts.timeout_s, secret=secret, job=job)
        host, _, port = self.opts.store.rpartition(":")
        if not port.isdigit():
            raise ValueError(f"--store {self.opts.store!r} is not HOST:PORT")
        return JobStore.host(host, int(port), clients=self.opts.n_workers + self.opts.nnodes, secret=secret)

    def _take_a_lost_node(self) -> bool:
        """A spare node: wait (its template importing and preparing meanwhile) for a node whose agent and
        workers are known dead, then become that node; False if the job finished first."""
        self.log.info("spare node: waiting for a lost node (template %s)",
                      "starting" if self.template is not None else "off")
        self._spare_since = time.monotonic()
        try:
            node = wait_for_lost_node(self.store, nnodes=self.opts.nnodes, workers_per_node=self.opts.workers_per_node,
                                      pid_dir=self.run_dir / "pids", interrupted=lambda: self.interrupted is not None)
        except StartRefused as exc:
            raise AgentError(str(exc), 128 + (self.interrupted or 0)) from None
        if node is None:
            self.log.info("the job finished before any node was lost: the spare leaves")
            if self.template is not None:
                self.template.close()
            return False
        self.opts = dataclasses.replace(self.opts, node_rank=node, spare=False)
        self.node = node
        if self.template is not None:
            self.template.node = node
        self.log.warning("spare node: taking over node %d (its agent and workers are gone)", node)
        return True

    def _start_template(self, limits: Limits) -> None:
        """Start the node's template (:mod:`unbroken.agent.template`), unless it started with the agent's
        process (:func:`unbroken.agent.command.prestart_template`), and wait for it: workers fork from it."""
        if self.template is None:
            if self.base_cmd[1:] != ["-m", "unbroken.agent.worker_process"]:  # a test's stand-in worker
                return
            if not become_subreaper():
                self.log.warning("cannot adopt forked workers here (no PR_SET_CHILD_SUBREAPER): no template")
                return
            self.template = Template(run_dir=self.run_dir, node=self.node, world=self.opts.n_workers)
            self.template.start(time.monotonic(), fork=True)
        self.template.attach(event=self._event, ready_timeout_s=limits.deadline_s)
        self.template.wait_ready(limits.deadline_s, lambda: self.rdv.heartbeat(time.monotonic()))

    def _launch(self, cmd: Sequence[str], *, log: Path, header: str) -> Child:
        """Start a worker's or standby's process: forked from the template when it is ready."""
        if self.template is None:
            return spawn(cmd, log=log, header=header)
        # Its template may have forked before this agent connected (``unbroken agent`` starts it first): the
        # secret and the launch id go with each request, or the worker would accept any launch at the address.
        return self.template.launch(cmd, log=log, header=header, env=self.child_env)

    def _start_workers(self, view: View) -> None:
        for w in self.rdv.mark_predecessors_dead():
            self.log.warning("worker %d of the node's previous agent is gone with it: marked dead", w)
        if view.restore is not None:  # a restored first view: its members load the state themselves
            for w in workers_of(self.node, self.opts.workers_per_node):
                if w in view.members:
                    self._start(w, join=False, resume=False)
            return
        for w in workers_of(self.node, self.opts.workers_per_node):
            # A fresh process without the training state can only be a member of a
            # view that starts now; otherwise it must join and receive the state.
            join = self.rdv.took_over or w not in view.members or self._mark(w) is not None or self._progress > view.step
            self._start(w, join=join)

    # -- the loop ---------------------------------------------------------------

    def _loop(self) -> int:
        waker = ChildWaker()
        try:
            return self._ticks(waker)
        finally:
            waker.close()

    def _ticks(self, waker: ChildWaker) -> int:
        next_status = 0.0
        while True:
            now = time.monotonic()
            if self.interrupted is not None:
                name = signal.Signals(self.interrupted).name
                raise AgentError(f"node {self.node}: interrupted by {name}; workers stopped", 128 + self.interrupted)
            self.rdv.heartbeat(now)
            self._reap(now)
            if now >= self._next_fence:
                self._next_fence = now + FENCE_S
                self._fence()
            if self._done_at is None:
                self._fence_stalled(now)
                self._inject(now)
                self._restart_due(now)
                if (failure := self.restorer.tick(now)) is not None:
                    self.store.fail(failure)
                self.restorer.mark_silent(lambda: self.store.current_view() if self.store.has_view() else None,
                                          now, self._hb_timeout)
                self._follow_restore()
            if self.template is not None and self._done_at is None:
                self.template.tick(now)
            if self.standby is not None:
                self._standby_tick(now)  # after done: reaps a standby let go
            if now >= next_status:
                next_status = now + STATUS_S
                code = self._status(now)
                if code is not None:
                    return code
            waker.sleep(max(LOOP_S if self._armed() else IDLE_S, self.store.poll_s))

    def _armed(self) -> bool:
        """A fault waits for a step (the progress is polled at :data:`LOOP_S`), a stopped worker's
        SIGCONT is due, or a restore is being decided."""
        return self._waits_for_a_step() or bool(self.stopped) or (self.restorer is not None and self.restorer.busy())

    def _status(self, now: float) -> int | None:
        """Follow ``done`` / ``failed``; an exit code once this agent's part is over."""
        message = self.store.failure()
        if message is not None:
            self.log.error("the job failed: %s", message)
            raise AgentError(f"node {self.node}: the job failed: {message}", 1)
        if self.store.has_view():
            self.gen = self.store.gen()
        if self._done_at is None and self.store.is_done():
            self._done_at = now
            self.restarts.clear()
            if self.standby is not None:
                self.standby.stop()
            self.log.info("the job is done; waiting for %d worker(s) to exit", len(self.workers))
        if self._done_at is not None:
            if not self.workers:
                return 0
            if now - self._done_at > self.opts.grace_s:
                self.log.warning("workers %s still running %.0f s after done: stopping them",
                                 sorted(self.workers), self.opts.grace_s)
                return 0  # _shutdown stops them
            return None
        if not self.workers and not self.restarts and self.finished:
            # Every local worker finished cleanly; done should follow at once from the leader.
            self._idle_since = self._idle_since or now
            if now - self._idle_since > self.opts.timeout_s:
                self.log.warning("all workers finished but 'done' never came; exiting")
                return 0
        return None

    # -- deaths and fencing: _agent_deaths.py; faults: _agent_faults.py; starts: _agent_starts.py ----------

    # -- store helpers ----------------------------------------------------------

    def _mark(self, w: int) -> str | None:
        return self.store.dead_mark(w)

    def _read_progress(self) -> int:
        progress = self.store.progress()
        if progress is not None:
            self._progress = max(self._progress, progress)
        return self._progress

    def _event(self, event: str, worker: int | None, **fields: Any) -> None:
        if self.events is not None:
            self.events.write({"kind": "event", "event": event, "node": self.node, "worker": worker,
                               "t": time.time(), **fields})

    # -- exit -------------------------------------------------------------------

    def _shutdown(self) -> None:
        """Stop every child (SIGTERM, grace, SIGKILL) and release the node rank."""
        if self.standby is not None:
            self.standby.close()  # it holds no state: SIGKILL
        if self.template is not None:
            self.template.close()
        stop_all([inc.proc for inc in self.workers.values()], grace_s=self.opts.grace_s)
        self._reap_dying(time.monotonic(), wait_s=10.0)  # exiting already: only the kernel's teardown is left
        for w, inc in self.workers.items():
            remove_pid(self.run_dir / "pids" / f"w{w}", inc.proc.pid)
            code, sig = exit_status(inc.proc.returncode if inc.proc.returncode is not None else -9)
            self._event("worker_exit", w, pid=inc.proc.pid, code=code, signal=sig, stopped_by_agent=True,
                        clean=False, incarnation=inc.incarnation)
        self.workers.clear()
        if self.rdv is not None:
            try:
                self.rdv.release()
                if self._server is not None:
                    self.rdv.wait_released(self.opts.nnodes, self.opts.grace_s + 5.0)
            except dist.DistError:
                pass  # the store is gone with the launcher: nothing left to release
        remove_pid(self.run_dir / "pids" / f"agent{self.node}", os.getpid())
        if self._done_at is not None and self.restorer is not None:
            removed = remove_segments(self.restorer.job, self.node)  # the job ended normally: memory is freed
            self.log.info("removed %d snapshot segment(s) of node %d", removed, self.node)
        if self.events is not None:
            self.events.close()
            self.events = None
