"""The agent's options: command line, validation, and the job's fault specs.

Invariant: :meth:`AgentOptions.faults` checks everything an agent could object
to in its options before it touches the store or starts a process.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path
from typing import Mapping

from unbroken.agent._supervision import Limits
from unbroken.faults.fail_at import FaultSpec, parse_fail_at, read_fault_plan, trace_to_faults
from unbroken.faults.injector import check_faults
from unbroken.faults.traces import FailureTrace

RESTART_POLICIES = ("never", "on-failure")


@dataclasses.dataclass(frozen=True, kw_only=True)
class AgentOptions:
    """The agent's command line (module docstring)."""

    node_rank: int
    nnodes: int
    workers_per_node: int
    store: str
    run_dir: Path
    restart: str = "on-failure"
    restart_delay_s: float = 0.0
    fail_at: str = ""
    faults_trace: Path | None = None
    faults_file: Path | None = None
    """The job's fault plan as the launcher parsed it (then ``fail_at`` and ``faults_trace`` must be empty)."""
    standby: bool = False
    start_step: int = 0
    resume: Path | None = None
    resume_memory: bool = False
    """``--resume``: restore the first view from the nodes' snapshot memory when it is newer than ``resume``."""
    timeout_s: float = 30.0
    """Store connection and start-up waits (config, initial view)."""
    grace_s: float = 10.0
    """SIGTERM -> SIGKILL grace, and how long finished stragglers may linger after ``done``."""
    host_store: bool = False
    """Node 0 without a launcher: host the store at ``store``'s port (the job then lives as long as this agent)."""
    startup_liveness_s: float | None = None
    """A worker not yet admitted (or the standby) whose heartbeat stood still this long is fenced and replaced;
    None: ``max(2 * fault.heartbeat_timeout_s, 5 s)`` (see :mod:`unbroken.agent._supervision`)."""
    startup_deadline_s: float | None = None
    """A worker (or standby) that has not beaten (or is not ready) this long after it started is fenced and
    replaced; None: ``timeout_s``."""
    preempt_grace_s: float = 60.0
    """The first SIGTERM/SIGUSR1 stops the job after an agreed step with a final checkpoint
    (:mod:`unbroken.agent.preemption`); this long without it, the agent stops at once. 0: a signal stops it at
    once."""
    health_check: str | None = None
    """A shell command run before the node starts workers (:mod:`unbroken.agent.health_check`); a non-zero exit
    or a hang keeps the node out."""
    health_check_timeout_s: float = 120.0
    """A health check still running this long is killed and counts as failed."""
    spare: bool = False
    """A spare node: start, import and prepare (its template too), then take the rank of the first node whose
    agent and workers are known dead (``node_rank`` is -1 until then)."""

    @property
    def n_workers(self) -> int:
        return self.nnodes * self.workers_per_node

    def startup_limits(self, *, heartbeat_timeout_s: float) -> Limits:
        """The start-up watch's limits: the flags, or their defaults from the job's heartbeat timeout."""
        return Limits.defaults(heartbeat_timeout_s=heartbeat_timeout_s, timeout_s=self.timeout_s,
                               liveness_s=self.startup_liveness_s, deadline_s=self.startup_deadline_s)

    def faults(self) -> tuple[FaultSpec, ...]:
        """The job's fault specs (``--fail-at`` and the trace), checked against the layout.

        Raises:
            ValueError: every problem of the options, at once.
        """
        problems = []
        if self.spare:
            if self.node_rank != -1 or self.host_store:
                problems.append("--spare takes no --node-rank (it takes a lost node's) and no --host-store")
        elif not 0 <= self.node_rank < self.nnodes:
            problems.append(f"--node-rank {self.node_rank}: expected 0..{self.nnodes - 1} (--nnodes {self.nnodes})")
        if self.workers_per_node < 1:
            problems.append(f"--workers-per-node {self.workers_per_node}: expected >= 1")
        if self.restart not in RESTART_POLICIES:
            problems.append(f"--restart {self.restart!r}: expected one of {', '.join(RESTART_POLICIES)}")
        if self.host_store and self.node_rank != 0:
            problems.append(f"--host-store with --node-rank {self.node_rank}: only node 0 hosts the store")
        if not self.restart_delay_s >= 0:
            problems.append(f"--restart-delay-s {self.restart_delay_s}: expected >= 0")
        for flag, value in (("--startup-liveness-s", self.startup_liveness_s),
                            ("--startup-deadline-s", self.startup_deadline_s)):
            if value is not None and not value > 0:
                problems.append(f"{flag} {value}: expected > 0 seconds (or leave it out for the default)")
        if self.faults_file is not None and (self.fail_at or self.faults_trace is not None):
            problems.append("--faults-file with --fail-at or --faults-trace: give the plan, or the specs to parse")
        if problems:
            raise ValueError("; ".join(problems))
        if self.faults_file is not None:
            specs = read_fault_plan(self.faults_file)
            check_faults(specs, n_nodes=self.nnodes, workers_per_node=self.workers_per_node)
            return specs
        specs = parse_fail_at(self.fail_at)
        if self.faults_trace is not None:
            try:
                trace = FailureTrace.from_json(json.loads(self.faults_trace.read_text()))
            except (OSError, json.JSONDecodeError) as exc:
                raise ValueError(f"--faults-trace {self.faults_trace}: cannot read a failure trace ({exc})") from None
            specs += trace_to_faults(trace)
        check_faults(specs, n_nodes=self.nnodes, workers_per_node=self.workers_per_node)
        return specs


def add_agent_args(ap: argparse.ArgumentParser) -> None:
    """The agent's options (shared by this module's entry point and ``unbroken agent``)."""
    ap.add_argument("--node-rank", type=int, default=-1,
                    help="this node's rank R (0..N-1); required unless --spare or --from-slurm")
    ap.add_argument("--spare", action="store_true",
                    help="a spare node: start and prepare now, take the rank of the first node lost")
    ap.add_argument("--nnodes", type=int, required=True, help="number of nodes N")
    ap.add_argument("--workers-per-node", type=int, required=True, help="workers per node W")
    ap.add_argument("--store", default=None, help="HOST:PORT of the job's store, or etcd://HOST:PORT[,HOST:PORT...] of "
                    "its etcd cluster; required unless --from-slurm")
    ap.add_argument("--store-insecure", action="store_true",
                    help="allow plain etcd:// to members on other hosts (an isolated network only)")
    ap.add_argument("--run-dir", type=Path, required=True, help="the run directory (holds config.json)")
    ap.add_argument("--restart", choices=RESTART_POLICIES, default="on-failure",
                    help="restart dead workers as joiners (default on-failure)")
    ap.add_argument("--restart-delay-s", type=float, default=0.0, help="wait before a restart (default 0)")
    ap.add_argument("--fail-at", default="", help="fault specs, e.g. step=40:worker=2:kill:back=60")
    ap.add_argument("--faults-trace", type=Path, default=None, help="failure trace JSON (outages -> kill + back)")
    ap.add_argument("--faults-file", type=Path, default=None,
                    help="the job's parsed fault plan (JSON, written by the launcher)")
    ap.add_argument("--standby", action="store_true", help="keep a warm standby worker process")
    ap.add_argument("--start-step", type=int, default=0, help="first step of the initial view (resume)")
    ap.add_argument("--resume", type=Path, default=None, help="checkpoint the first workers load")
    ap.add_argument("--resume-memory", action="store_true",
                    help="resume from the nodes' snapshot memory where it is newer than --resume")
    ap.add_argument("--timeout-s", type=float, default=30.0, help="store connection and start-up timeout")
    ap.add_argument("--grace-s", type=float, default=10.0, help="SIGTERM -> SIGKILL grace for workers")
    ap.add_argument("--preempt-grace-s", type=float, default=60.0,
                    help="the first SIGTERM/SIGUSR1 stops the job after the step in flight with a final checkpoint and "
                         "exit code 75 (requeue and --resume); a second signal, or this long without the "
                         "checkpoint, stops at once (default 60; 0: a signal stops at once)")
    ap.add_argument("--health-check", default=None, metavar="CMD",
                    help="a shell command run before this node starts workers (and before a spare takes a lost "
                         "node's rank), e.g. 'nvidia-smi' or 'dcgmi diag -r 1': a non-zero exit keeps the node out")
    ap.add_argument("--health-check-timeout-s", type=float, default=120.0,
                    help="kill a health check still running after this long; it counts as failed (default 120)")
    ap.add_argument("--host-store", action="store_true",
                    help="node 0 on a cluster without the launcher: host the store at --store's port")
    ap.add_argument("--startup-liveness-s", type=float, default=None,
                    help="fence and restart a starting or joining worker (or the standby) whose heartbeat stood "
                         "still this long (default max(2 x fault.heartbeat_timeout_s, 5))")
    ap.add_argument("--startup-deadline-s", type=float, default=None,
                    help="fence and restart a worker that has not beaten this long after it started, and replace "
                         "a standby not ready by then (default --timeout-s)")
    ap.add_argument("--from-slurm", action="store_true",
                    help="a task of srun, one per node: SLURM_PROCID 0..N-1 is the node rank (task 0 hosts the store "
                         "on the first host of the node list), N..N+S-1 a spare node; a requeued job "
                         "(SLURM_RESTART_COUNT > 0) resumes")
    ap.add_argument("--spare-nodes", type=int, default=0, metavar="S",
                    help="with --from-slurm: the step's last S tasks are spare nodes (SLURM_NTASKS must be N+S)")
    ap.add_argument("--store-port", type=int, default=None,
                    help="with --from-slurm and no --store: the store's port on the first host of the node list "
                         "(default 20000 + SLURM_JOB_ID %% 10000)")


def options_from(a: argparse.Namespace, env: Mapping[str, str] | None = None) -> AgentOptions:
    """The options of a parsed command line; with ``--from-slurm``, the place Slurm's environment (``env``,
    default ``os.environ``) gives this task (:mod:`unbroken.agent.slurm`)."""
    placed = {"spare": a.spare, "node_rank": a.node_rank, "store": a.store, "host_store": a.host_store,
              "resume": a.resume, "start_step": a.start_step, "resume_memory": a.resume_memory}
    if a.from_slurm:
        given = [flag for flag, on in (("--node-rank", a.node_rank != -1), ("--spare", a.spare),
                                       ("--host-store", a.host_store)) if on]
        if given:
            raise ValueError(f"--from-slurm with {', '.join(given)}: Slurm's task index says which node this is "
                             f"and whether it hosts the store; drop {', '.join(given)}")
        from unbroken.agent.slurm import slurm_fields

        placed.update(slurm_fields(os.environ if env is None else env, nnodes=a.nnodes, spare_nodes=a.spare_nodes,
                                   store=a.store, store_port_flag=a.store_port, run_dir=a.run_dir, resume=a.resume))
    else:
        slurm_only = [f for f, on in (("--spare-nodes", a.spare_nodes), ("--store-port", a.store_port is not None)) if on]
        if slurm_only:
            raise ValueError(f"{', '.join(slurm_only)} without --from-slurm: a spare started by hand takes --spare, "
                             f"and --store names the store's HOST:PORT")
        if a.node_rank == -1 and not a.spare:
            raise ValueError("--node-rank is required (or --spare)")
        if a.store is None:
            raise ValueError("--store is required: HOST:PORT of the job's store, or etcd://HOST:PORT[,...] "
                             "(or --from-slurm under srun)")
    return AgentOptions(**placed, nnodes=a.nnodes, workers_per_node=a.workers_per_node, run_dir=a.run_dir,
                        restart=a.restart, restart_delay_s=a.restart_delay_s, fail_at=a.fail_at,
                        faults_trace=a.faults_trace, faults_file=a.faults_file, standby=a.standby,
                        timeout_s=a.timeout_s, grace_s=a.grace_s, preempt_grace_s=a.preempt_grace_s,
                        health_check=a.health_check, health_check_timeout_s=a.health_check_timeout_s,
                        startup_liveness_s=a.startup_liveness_s, startup_deadline_s=a.startup_deadline_s)
