"""One machine plays a cluster: N agents on loopback, W workers each, one store.

``unbroken train --nodes N --workers-per-node W`` lands here. The launcher
checks everything that can be checked before anything is written (config,
data, fault specs, port), hosts the coordination store, publishes the run's
config under the store key ``config``, starts one agent per node
(``python -m unbroken.agent.command``, forked from this process's agent server,
:mod:`unbroken.agent.agent_server`, where it runs; output in
``logs/agent<R>.log``), follows
``metrics.jsonl`` and the store keys ``progress`` (committed steps: the only sign
of progress it trusts, see ``PROGRESS_TIMEOUT_S``), ``done`` / ``failed``, and
summarises. Under checkpoint-restart each attempt gets a fresh store at the
same address (the previous one is closed first).

Faults: ``fault.fail_at`` (and the ``fail_at`` argument, which is not saved in
the config) and a ``fault.trace`` preset (drawn here by ``generate_trace``;
seeded by ``train.seed``, scaled so the run stands for ``fault.job_hours``;
written to ``fault_trace.json``; each outage's worker is killed at its start
and restarted at its end) are parsed once, here, into typed specs, written to
the run's fault plan ``faults.json`` and handed to every agent
(``--faults-file``). Each agent carries out the faults of its own node.

Invariants: a run that fails validation leaves nothing on disk; an agent
killed by an injected node loss does not stop the job, only ``failed`` or
every agent's exit does; no agent (hence no worker) outlives :func:`launch`;
every wait is bounded.
"""

from __future__ import annotations

import copy
import json
import os
import logging
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from unbroken.agent.agent_server import ServedAgent, agent_server
from unbroken.agent.events import EventMerger
from unbroken.agent.launch_checks import check_launch
from unbroken.agent.options import RESTART_POLICIES
from unbroken.agent.preemption import PreemptSignals
from unbroken.config import Config, config_from_dict, validate
from unbroken.faults.fail_at import FaultSpec, parse_fail_at, trace_to_faults, write_fault_plan
from unbroken.faults.injector import check_faults
from unbroken.faults.store_loss import StoreFaults, store_lost_message
from unbroken.faults.traces import FailureTrace, generate_trace, step_time_for
from unbroken.jsonl import JsonlTail
from unbroken.monitor import watch_job
from unbroken.checkpoint.checkpointer import CheckpointError, latest_checkpoint, read_commit
from unbroken.snapshot.capacity import check_snapshot_config
from unbroken.snapshot.protection import announce as announce_protection
from unbroken.agent.preflight import _truncate_metrics, preflight, prepare_run_dir
from unbroken.agent.resume_point import resume_point
from unbroken.agent.run_summary import summarise
from unbroken.job.references import anchor_references
from unbroken.agent._replacer import NodeReplacer, spare_count
from unbroken.agent._store_host import StoreHost
from unbroken.store.etcd_client import parse_etcd
from unbroken.store.job_store import JobStore
from unbroken.store.backend import SECRET_ENV, SECRET_FILE, job_secret, new_secret, save_secret
from unbroken.store.wire import LAUNCH_ENV
from unbroken.runtime.recovery import recovery

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0
"""Longest an attempt may take to commit its first step (agents and workers starting, data loading)."""
PROGRESS_TIMEOUT_S = 300.0
"""Longest the job may then go without committing a step before we give up. Progress is the store's
committed-step counter (``progress``), whatever ``train.log_every`` says about metrics lines. Both
limits are at least ``train.timeout_s`` (a blocking wait that long may precede a reconfiguration)."""
AGENT_GRACE_S = 30.0
"""How long agents may take to stop their workers after ``done`` or ``failed``."""
POLL_S = 0.1


class JobFailed(RuntimeError):
    """No live worker is left: the job cannot go on by itself (the message says how to continue)."""


class StoreLost(JobFailed):
    """The job store did not answer for ``fault.store_timeout_s``: every agent and worker was stopped."""


class AgentFailed(RuntimeError):
    """An agent refused to start or crashed; carries its node, exit code and log tail."""

    def __init__(self, node: int, returncode: int, log_tail: str) -> None:
        super().__init__(f"agent of node {node} exited with code {returncode}; last log lines:\n{log_tail}")
        self.node, self.returncode, self.log_tail = node, returncode, log_tail


def launch(
    cfg: Config,
    run_dir: str | Path,
    *,
    nodes: int,
    workers_per_node: int,
    overwrite: bool = False,
    resume: bool = False,
    on_record: Callable[[dict[str, Any]], None] | None = None,
    on_event: Callable[[dict[str, Any]], None] | None = None,
    fail_at: str = "",
    standby: bool = False,
    restart: str = "on-failure",
    replace_lost_nodes_s: float | None = None,
    spare_nodes: int = 0,
    store: str | None = None,
    health_check: tuple[str | None, float] = (None, 120.0),
) -> dict[str, Any]:
    """Train ``cfg`` with ``nodes`` local agents of ``workers_per_node`` workers each.

    Args:
        cfg: the run; ``train.workers`` is set to ``nodes * workers_per_node``.
        on_record: called with each new ``metrics.jsonl`` record.
        on_event: called with each event of the run as it is merged into ``<run_dir>/events.jsonl``
            (:mod:`unbroken.agent.events`), in the order records and events were written.
        fail_at: extra fault specs for this launch (not saved in the config).
        standby: each agent keeps a warm standby worker process.
        restart: ``on-failure`` (dead workers rejoin) or ``never``.
        replace_lost_nodes_s: play a cluster scheduler that replaces lost machines: an agent that
            dies by SIGKILL (a lost node) is started again this many seconds later, as a new machine
            for that node rank, whose workers rejoin; None: a lost node stays lost.
        spare_nodes: agents started as spares (``unbroken agent --spare``): each imports and prepares
            (its template too), then takes the rank of the first node lost, at once; with
            ``replace_lost_nodes_s`` the scheduler brings a new spare that many seconds after one is used
            (without spares, it brings the lost node's replacement).
        store: ``etcd://HOST:PORT[,...][/PREFIX]``: the job's keys on that etcd cluster (they are deleted
            at the end); None: a ``TCPStore`` embedded in this process, on ``train.host:train.port``.
        health_check: each agent's ``--health-check`` command (None: none) and its timeout in seconds
            (:mod:`unbroken.agent.health_check`).
    Returns:
        The summary also written to ``<run_dir>/summary.json``.
    Raises:
        ValueError: invalid input (nothing written); JobFailed: no live worker
            left; AgentFailed: an agent refused to start; TimeoutError: no progress.
    """
    run_dir = Path(run_dir)
    cfg = _job_config(cfg, nodes, workers_per_node, restart)
    if resume:
        cfg = keep_global_batch(cfg, run_dir)
    problems = validate(cfg)  # train.workers is the layout's: its global batch checked again
    if problems:
        raise ValueError("; ".join(problems))
    anchor_references(cfg)  # a relative '/path/file.py:function' means the launching directory's, in every worker
    mode = recovery(cfg.fault.recovery)
    if mode.restarts_job:
        restart = "never"  # checkpoint-restart: the launcher restarts the whole job instead
    specs, trace = _job_faults(cfg, fail_at, nodes, workers_per_node)
    info = preflight(cfg)
    check_launch(cfg, workers_per_node, standby=standby,
                 placed=range(cfg.train.workers))  # every node of a launch runs on this machine
    check_snapshot_config(cfg, nodes, workers_per_node, info.get("vocab_size"))
    if cfg.train.shard_optimizer and cfg.train.workers == 1:
        logger.warning("train.shard_optimizer with one worker: nothing to shard, the run is the same without it")
    store_faults = StoreFaults(specs, members=len(parse_etcd(store)[0]) if store else None, run_dir=run_dir)
    # A resumed run keeps its secret: it keys the seals of the snapshot memory it may continue from.
    secret = job_secret(run_dir) if resume and (Path(run_dir) / SECRET_FILE).is_file() else new_secret()
    if spare_nodes < 0:
        raise ValueError(f"--spare-nodes {spare_nodes}: expected >= 0")
    host = StoreHost(cfg, nodes, secret, store, run_dir)  # before anything is written: a port in use fails early
    try:
        return _launch(host, cfg, run_dir, overwrite=overwrite, resume=resume, on_record=on_record,
                       on_event=on_event, specs=specs, trace=trace, info=info, nodes=nodes,
                       workers_per_node=workers_per_node, restart=restart, standby=standby,
                       replace_lost_nodes_s=replace_lost_nodes_s, spare_nodes=spare_nodes, store_faults=store_faults,
                       health_check=health_check)
    finally:
        host.close()


def _launch(host: StoreHost, cfg: Config, run_dir: Path, *, overwrite: bool, resume: bool,
            on_record: Callable[[dict[str, Any]], None] | None, on_event: Callable[[dict[str, Any]], None] | None,
            specs: tuple[FaultSpec, ...], trace: FailureTrace | None, info: Any, nodes: int, workers_per_node: int,
            restart: str, standby: bool, replace_lost_nodes_s: float | None, spare_nodes: int,
            store_faults: StoreFaults, health_check: tuple[str | None, float]) -> dict[str, Any]:
    """:func:`launch` once its store is open: prepare the run directory, run every attempt, summarise."""
    mode, secret = recovery(cfg.fault.recovery), host.secret
    same_layout = saved_layout(run_dir) in (None, (nodes, workers_per_node))
    if resume and not same_layout:
        logger.warning("%s: resumed on %d node(s) x %d worker(s), not the layout its snapshot memory was written "
                       "by %s: it continues from its newest committed checkpoint", run_dir, nodes, workers_per_node,
                       saved_layout(run_dir))
    resume_from = prepare_run_dir(run_dir, cfg, overwrite=overwrite, resume=resume, memory_usable=same_layout)
    save_secret(run_dir, secret)
    announce_protection(cfg, run_dir, nodes, workers_per_node)
    host.store.publish_config((run_dir / "config.json").read_text())
    if trace is not None:
        (run_dir / "fault_trace.json").write_text(json.dumps(trace.to_json(), indent=1))
    plan = run_dir / "faults.json" if specs else None
    if plan is not None:
        write_fault_plan(plan, specs)
    t0 = time.time()
    # The job's monitor process (unbroken.monitor): sinks and alerts, off the workers' path; a SIGTERM/SIGUSR1
    # stops the job with a final checkpoint (unbroken.agent.preemption).
    with watch_job(run_dir), PreemptSignals() as preempt:
        restarts = _run_attempts(host, cfg, run_dir, on_record, resume_from, on_event=on_event, nodes=nodes,
                                 workers_per_node=workers_per_node, restart=restart, fault_plan=plan, standby=standby,
                                 secret=secret, replace_lost_nodes_s=replace_lost_nodes_s, spare_nodes=spare_nodes,
                                 store_faults=store_faults, preempt=preempt, health_check=health_check,
                                 resume_memory=resume and not mode.restarts_job and same_layout)
        preempted_after = host.store.stop_point()[1]
    summary = summarise(run_dir, cfg, info, time.time() - t0, resume_from, nodes=nodes, t0=t0,
                        verify=preempted_after is None)
    if mode.restarts_job:
        summary["job_restarts"] = restarts
        summary["steps_redone"] = sum(r["failed_at_step"] - r["restarted_from_step"] for r in restarts)
    if preempted_after is not None:  # a SIGTERM/SIGUSR1 stopped the job with a final checkpoint
        summary["preempted_after_step"] = preempted_after
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    return summary


_DEATH = "a worker died"


def _run_attempts(host: StoreHost, cfg: Config, run_dir: Path, on_record: Callable[[dict[str, Any]], None] | None,
                  resume_from: Path | None, *, on_event: Callable[[dict[str, Any]], None] | None = None,
                  **agent_args: Any) -> list[dict[str, int]]:
    """Run the job to its end; under checkpoint-restart, again from the last checkpoint after each death.

    Returns:
        The job restarts (``failed_at_step``, ``restarted_from_step``); empty unless the mode restarts jobs.
    Raises:
        JobFailed: no live worker is left.
    """
    restarts: list[dict[str, int]] = []
    while True:
        start_step = int(read_commit(resume_from)["step"]) if resume_from else 0
        try:
            outcome = _attempt(host.store, host.addr, cfg, run_dir, on_record, on_event=on_event,
                               start_step=start_step, resume_from=resume_from, **agent_args)
        except TimeoutError as exc:  # the stall check: the agents are stopped now, their memory kept
            raise TimeoutError(f"{exc}; {_resume_hint(run_dir, cfg)}") from None
        if outcome is None:
            return restarts
        if outcome != _DEATH:
            raise JobFailed(_failure_message(outcome, run_dir, cfg))
        # Checkpoint-restart: everyone starts again from the last checkpoint.
        reached = host.store.progress() or start_step
        resume_from = latest_checkpoint(run_dir)
        restart_step = int(read_commit(resume_from)["step"]) if resume_from else 0
        restarts.append({"failed_at_step": reached, "restarted_from_step": restart_step})
        logger.warning("a worker died at step %d: restarting every worker from step %d", reached, restart_step)
        _truncate_metrics(run_dir / "metrics.jsonl", restart_step)
        host.replace((run_dir / "config.json").read_text())


def _attempt(store: JobStore, addr: str, cfg: Config, run_dir: Path,
             on_record: Callable[[dict[str, Any]], None] | None, *,
             on_event: Callable[[dict[str, Any]], None] | None = None, replace_lost_nodes_s: float | None = None,
             spare_nodes: int = 0, store_faults: StoreFaults | None = None, preempt: PreemptSignals | None = None,
             **agent_args: Any) -> str | None:
    """Run the agents until done (None), failed (message) or, under checkpoint-restart, a death."""
    agents: list[subprocess.Popen[bytes]] = []
    replacer = None
    agent_args["launch"] = store.launch
    if replace_lost_nodes_s is not None or spare_nodes:
        replacer = NodeReplacer(replace_lost_nodes_s, lambda r: _spawn_agent(r, cfg, run_dir, addr, **agent_args),
                                 run_dir=run_dir)
    with EventMerger(run_dir, since=time.time()) as events:  # this attempt's events: those written from now on
        try:
            for r in range(agent_args["nodes"]):
                agents.append(_spawn_agent(r, cfg, run_dir, addr, **agent_args))
            if replacer is not None:
                for _ in range(spare_nodes):
                    replacer.spares.append(replacer.spawn(-1))
            return _supervise(agents, store, run_dir, cfg, on_record, events=events, on_event=on_event,
                              replacer=replacer, store_faults=store_faults, preempt=preempt)
        except dist.DistStoreError as exc:
            raise StoreLost(store_lost_message(str(exc).splitlines()[0], addr, run_dir)) from None
        finally:
            _stop_agents(agents + (replacer.spares if replacer is not None else []))
            for e in events.poll():  # the exits of the agents' shutdown, for events.jsonl
                if on_event is not None:
                    on_event(e)


def launch_local(cfg: Config, run_dir: str | Path, **kwargs: Any) -> dict[str, Any]:
    """:func:`launch` as one node of ``cfg.train.workers`` workers (the plain one-machine run)."""
    return launch(cfg, run_dir, nodes=1, workers_per_node=cfg.train.workers, **kwargs)


def keep_global_batch(cfg: Config, run_dir: Path) -> Config:
    """``cfg`` of a run resumed in ``run_dir``, with the run's global batch kept when the worker count changed:
    a run saved with one micro-batch per worker (``train.global_batch=0``) gets its ``workers * micro_batch``
    stated, so that the resumed workers train the same rows per step."""
    path = run_dir / "config.json"
    if cfg.train.global_batch or not path.is_file():
        return cfg
    saved = config_from_dict(json.loads(path.read_text()))
    if saved.train.workers == cfg.train.workers or saved.data.micro_batch != cfg.data.micro_batch:
        return cfg
    cfg = copy.deepcopy(cfg)
    cfg.train.global_batch = saved.n_slots * saved.data.micro_batch
    logger.info("%s: resumed on %d workers; its global batch stays %d rows (train.global_batch)", run_dir,
                cfg.train.workers, cfg.train.global_batch)
    return cfg


def saved_layout(run_dir: Path) -> tuple[int, int] | None:
    """``(nodes, workers per node)`` of the run's ``layout.json``; None: none written yet."""
    path = run_dir / "layout.json"
    if not path.is_file():
        return None
    saved = json.loads(path.read_text())
    return int(saved["nodes"]), int(saved["workers_per_node"])


def _job_config(cfg: Config, nodes: int, workers_per_node: int, restart: str) -> Config:
    problems = []
    if not (isinstance(nodes, int) and nodes >= 1):
        problems.append(f"nodes={nodes!r}: need at least 1")
    if not (isinstance(workers_per_node, int) and workers_per_node >= 1):
        problems.append(f"workers_per_node={workers_per_node!r}: need at least 1")
    if restart not in RESTART_POLICIES:
        problems.append(f"restart={restart!r}: expected one of {', '.join(RESTART_POLICIES)}")
    if problems:
        raise ValueError("; ".join(problems))
    cfg = copy.deepcopy(cfg)
    cfg.train.workers = nodes * workers_per_node
    return cfg


def _job_faults(cfg: Config, fail_at: str, nodes: int,
                workers_per_node: int) -> tuple[tuple[FaultSpec, ...], FailureTrace | None]:
    """The job's fault specs (fail-at and the drawn trace, parsed once) and the trace, checked against the layout."""
    text = ",".join(t.strip() for t in (cfg.fault.fail_at, fail_at) if t.strip())
    specs = parse_fail_at(text, n_workers=cfg.train.workers, n_nodes=nodes)
    trace = None
    if cfg.fault.trace != "none":
        trace = generate_trace(cfg.fault.trace, n_workers=cfg.train.workers, n_steps=cfg.train.steps,
                               step_time_s=step_time_for(cfg.train.steps, cfg.fault.job_hours),
                               seed=cfg.train.seed, min_live=1, cluster_workers=cfg.fault.cluster_workers,
                               max_down=cfg.fault.max_down)
        specs += trace_to_faults(trace)
    check_faults(specs, n_nodes=nodes, workers_per_node=workers_per_node, sharded=cfg.train.shard_optimizer)
    return specs, trace


def _spawn_agent(node: int, cfg: Config, run_dir: Path, store_addr: str, *, nodes: int, workers_per_node: int,
                 restart: str, fault_plan: Path | None, standby: bool, start_step: int,
                 resume_from: Path | None, secret: str, resume_memory: bool = False,
                 launch: str | None = None,
                 health_check: tuple[str | None, float] = (None, 120.0)) -> subprocess.Popen[bytes]:
    """Start node ``node``'s agent (``-1``: a spare node's); ``launch``: the embedded store's launch id, which
    the agent and every process it starts pin."""
    rank = ["--spare"] if node < 0 else ["--node-rank", str(node)]
    cmd = [sys.executable, "-m", "unbroken.agent.command", *rank, "--nnodes", str(nodes),
           "--workers-per-node", str(workers_per_node), "--store", store_addr, "--run-dir", str(run_dir),
           "--restart", restart, "--start-step", str(start_step), "--timeout-s", str(cfg.train.timeout_s)]
    cmd += ["--faults-file", str(fault_plan)] if fault_plan else []
    cmd += ["--standby"] if standby else []
    cmd += ["--resume", str(resume_from)] if resume_from else []
    cmd += ["--resume-memory"] if resume_memory else []
    if health_check[0] is not None:
        cmd += ["--health-check", health_check[0], "--health-check-timeout-s", str(health_check[1])]
    log = run_dir / "logs" / (f"agent{node}.log" if node >= 0 else f"agent-spare{spare_count(run_dir)}.log")
    log.parent.mkdir(parents=True, exist_ok=True)
    # The secret travels in the environment (never on argv, which any local user can read). Forked by this
    # process's agent server where it runs (no interpreter and imports per agent), else a fresh process; both
    # in the launcher's process group: a terminal's Ctrl-C reaches the agents, which stop their workers.
    env = {**os.environ, SECRET_ENV: secret, **({LAUNCH_ENV: launch} if launch else {})}
    server = agent_server() if cfg.fault.template else None
    proc: subprocess.Popen[bytes] | ServedAgent | None = server.spawn(cmd[3:], log=log, env=env) if server else None
    if proc is None:
        with log.open("ab") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    proc.log_path = log  # type: ignore[union-attr]  # a spare keeps its own log after taking a rank
    return proc  # type: ignore[return-value]  # a ServedAgent has the surface of Popen the launcher uses


def _supervise(agents: list[subprocess.Popen[bytes]], store: JobStore, run_dir: Path, cfg: Config,
               on_record: Callable[[dict[str, Any]], None] | None, *, events: EventMerger | None = None,
               on_event: Callable[[dict[str, Any]], None] | None = None,
               replacer: NodeReplacer | None = None, store_faults: StoreFaults | None = None,
               preempt: PreemptSignals | None = None) -> str | None:
    """Follow the job to its end; returns ``None`` when done, else the failure message.

    Every poll hands the new metrics records to ``on_record`` and merges the new events (``events``)
    into ``events.jsonl``, handing each to ``on_event``.
    """
    tail = JsonlTail(run_dir / "metrics.jsonl")
    committed, last_progress = store.progress(), time.monotonic()
    done_at: float | None = None
    while True:
        now = time.monotonic()
        _emit(tail, on_record, events, on_event)
        progress = store.progress()
        if progress != committed:
            committed, last_progress = progress, now
        if store_faults is not None:
            store_faults.tick(progress)
        if preempt is not None and preempt.signum is not None and not store.is_done():
            store.request_stop()  # asked again each poll until done: a compare-and-set, idempotent
        failure = store.failure()
        if failure is not None:
            return failure
        if recovery(cfg.fault.recovery).restarts_job and store.deaths() > 0 and not store.is_done():
            return _DEATH
        if replacer is not None and not store.is_done():
            replacer.tick(agents, now)
        codes = [a.poll() for a in agents]
        for node, code in enumerate(codes):
            if code == 2:  # refused to start (config, rank, store): the job cannot run as asked
                raise AgentFailed(node, code, _log_tail(getattr(agents[node], "log_path",
                                                                run_dir / "logs" / f"agent{node}.log")))
        done = store.is_done()
        if all(c is not None for c in codes) and not (replacer is not None and replacer.lost):
            _emit(tail, on_record, events, on_event)
            if done:
                return None
            if store.failure() is not None:
                return store.failure()
            return f"every agent exited before the job finished (exit codes {codes}); see {run_dir / 'logs'}"
        if done:
            done_at = done_at or now
            if now - done_at > AGENT_GRACE_S:
                logger.warning("agents still running %.0f s after the job finished: stopping them", AGENT_GRACE_S)
                return None
        limit = max(STARTUP_TIMEOUT_S if committed is None else PROGRESS_TIMEOUT_S, cfg.train.timeout_s)
        if now - last_progress > limit:
            what = "committed no step" if committed is None else f"committed no step after step {committed}"
            raise TimeoutError(f"the job {what} for {limit:.0f} s; see {run_dir / 'logs'}")
        time.sleep(max(POLL_S, store.poll_s))


def _emit(tail: JsonlTail, on_record: Callable[[dict[str, Any]], None] | None, events: EventMerger | None = None,
          on_event: Callable[[dict[str, Any]], None] | None = None) -> bool:
    """Hand new metrics records and merged events to their callbacks, in the order they were written."""
    new = [(r.get("time", 0.0), on_record, r) for r in tail.read_new()]
    new += [(e.get("time", 0.0), on_event, e) for e in (events.poll() if events is not None else [])]
    new.sort(key=lambda item: item[0])  # stable: each source keeps its own order
    for _, callback, rec in new:
        if callback is not None:
            callback(rec)
    return bool(new)


def _stop_agents(agents: list[subprocess.Popen[bytes]]) -> None:
    """SIGINT (an agent then stops its workers at once: its SIGTERM would stop the job with a final checkpoint),
    SIGKILL after the grace period."""
    for a in agents:
        if a.poll() is None:
            a.send_signal(signal.SIGINT)
    deadline = time.monotonic() + AGENT_GRACE_S
    for a in agents:
        try:
            a.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            # Its workers die with it (they get SIGKILL when their agent dies).
            a.kill()
            a.wait(timeout=10.0)


STOPPED = "stopped: "
"""Prefix of a failure a worker records when it stops the job on purpose (e.g. optimizer shards lost)."""


def _resume_hint(run_dir: Path, cfg: Config) -> str:
    """What ``--resume`` would continue from once the agents stopped (they keep a failed job's memory)."""
    try:
        point = resume_point(run_dir, cfg)
    except (ValueError, CheckpointError) as exc:
        return str(exc).removeprefix(f"--resume {run_dir}: ")
    return f"{point.describe()}; continue with: unbroken train --resume {run_dir}"


def _failure_message(failure: str, run_dir: Path, cfg: Config) -> str:
    how = _resume_hint(run_dir, cfg)
    if failure.startswith(STOPPED):  # a worker stopped the job on purpose and says why
        return f"the job stopped: {failure.removeprefix(STOPPED)}; {how}"
    detail = failure.removeprefix("no live worker left").lstrip(": ")  # the workers' and agents' wording
    return f"no live worker is left: {detail}; {how}"


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(log unreadable: {exc})"
