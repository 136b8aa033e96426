"""An agent's place in a Slurm allocation: ``unbroken agent --from-slurm`` as a task of ``srun``.

One ``srun`` step runs one agent per node of the allocation (``--ntasks-per-node=1``),
for ``--nnodes N --spare-nodes S``: tasks ``0 .. N-1`` are the training nodes (task
``R`` is node rank ``R``), tasks ``N .. N+S-1`` spare nodes (``--spare``). Task 0
hosts the job's store, unless ``--store`` names an etcd cluster: then every task
connects to the keys the batch script opened there (``unbroken train --prepare-only
--store``). All of it comes from the task's environment (``SLURM_PROCID``,
``SLURM_NTASKS``, ``SLURM_NODEID``, ``SLURM_STEP_NODELIST``, ``SLURM_JOB_ID``,
``SLURM_RESTART_COUNT``), so a batch script holds no rank arithmetic.

Without ``--store``, the store is at the first host of the step's node list
(expanded by ``scontrol show hostnames``; its address is the ``NodeAddr`` Slurm
itself uses to reach it, from ``scontrol show node``) on ``--store-port``, by
default ``STORE_PORT_BASE + SLURM_JOB_ID % STORE_PORT_SPAN``: two jobs that share
a node take different ports, and a requeued job its own again.

A requeued job (``SLURM_RESTART_COUNT`` > 0) resumes: from the run's newest
committed checkpoint (``--resume``, ``--start-step``), or from the nodes'
snapshot memory where that is newer (``--resume-memory``), as ``unbroken train
--resume`` does.

Importing this module imports no torch: :func:`unbroken.agent.command.prestart_template`
reads :data:`SLURM_PROCID` before the agent's imports.

Invariants: a task whose environment contradicts the command line (a task count
other than ``N + S``, a task index outside it, task 0 on another node than the
first of the list) is refused with a ``ValueError`` naming both values, before
anything connects or starts; every call to Slurm's commands has a timeout.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import subprocess
from pathlib import Path
from typing import Any, Mapping

__all__ = ["SlurmTask", "expand_nodelist", "node_address", "read_task", "slurm_fields", "store_port"]

logger = logging.getLogger(__name__)

SLURM_JOB_ID = "SLURM_JOB_ID"
SLURM_PROCID = "SLURM_PROCID"
"""The task's index in the step (0 .. SLURM_NTASKS-1): its node rank, or a spare beyond ``--nnodes``."""
SLURM_NTASKS = "SLURM_NTASKS"
SLURM_NODEID = "SLURM_NODEID"
"""The index, in the step's node list, of the node the task runs on."""
SLURM_STEP_NODELIST = "SLURM_STEP_NODELIST"
SLURM_JOB_NODELIST = "SLURM_JOB_NODELIST"
SLURM_STEP_NUM_NODES = "SLURM_STEP_NUM_NODES"
SLURM_RESTART_COUNT = "SLURM_RESTART_COUNT"
"""How often the batch job was requeued (unset or 0 on its first run)."""

STORE_PORT_BASE = 20000
STORE_PORT_SPAN = 10000
"""The default store port lies in ``[STORE_PORT_BASE, STORE_PORT_BASE + STORE_PORT_SPAN)``: below Linux's
ephemeral ports (32768 on), which another process's outgoing connection may hold."""
SCONTROL_TIMEOUT_S = 30.0
"""Longest a ``scontrol`` call may take (it may ask slurmctld, which can be busy)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class SlurmTask:
    """What Slurm tells one task of a step about itself."""

    job_id: str
    task: int
    ntasks: int
    node_index: int
    nodelist: str
    step_nodes: int
    restart_count: int


def read_task(env: Mapping[str, str]) -> SlurmTask:
    """This task of a Slurm step, from its environment.

    Raises:
        ValueError: not a task of a Slurm step (a variable is missing), or a value is not a number.
    """
    missing = [v for v in (SLURM_JOB_ID, SLURM_PROCID, SLURM_NTASKS, SLURM_NODEID) if not env.get(v)]
    nodelist = env.get(SLURM_STEP_NODELIST) or env.get(SLURM_JOB_NODELIST) or ""
    if not nodelist:
        missing.append(SLURM_STEP_NODELIST)
    if missing:
        raise ValueError(f"--from-slurm: {', '.join(missing)} not set: this is not a task of a Slurm step; start "
                         f"the agents with srun (one task per node), or give --node-rank (or --spare) and --store "
                         f"instead of --from-slurm")
    numbers, problems = {}, []
    for var in (SLURM_JOB_ID, SLURM_PROCID, SLURM_NTASKS, SLURM_NODEID, SLURM_STEP_NUM_NODES, SLURM_RESTART_COUNT):
        text = env.get(var) or "0"
        if not text.isdigit():
            problems.append(f"{var}={text!r}: expected a whole number")
        numbers[var] = int(text) if text.isdigit() else 0
    if problems:
        raise ValueError(f"--from-slurm: {'; '.join(problems)} (is the environment Slurm's?)")
    return SlurmTask(job_id=env[SLURM_JOB_ID], task=numbers[SLURM_PROCID], ntasks=numbers[SLURM_NTASKS],
                     node_index=numbers[SLURM_NODEID], nodelist=nodelist,
                     step_nodes=numbers[SLURM_STEP_NUM_NODES] or numbers[SLURM_NTASKS],
                     restart_count=numbers[SLURM_RESTART_COUNT])


def check_task(task: SlurmTask, *, nnodes: int, spare_nodes: int) -> None:
    """Refuse a step that does not run one agent per node of ``nnodes + spare_nodes``.

    Raises:
        ValueError: every contradiction, each naming Slurm's value and the flag's.
    """
    agents = nnodes + spare_nodes
    problems = []
    if spare_nodes < 0:
        problems.append(f"--spare-nodes {spare_nodes}: expected >= 0")
    if task.ntasks != agents:
        problems.append(f"{SLURM_NTASKS}={task.ntasks} tasks, but --nnodes {nnodes} + --spare-nodes {spare_nodes} "
                        f"= {agents} agents: run one task per node of an allocation of {agents} nodes "
                        f"(sbatch --nodes={agents}, srun --ntasks-per-node=1), or change --nnodes/--spare-nodes")
    if not 0 <= task.task < agents:
        problems.append(f"{SLURM_PROCID}={task.task} is outside 0..{agents - 1} (--nnodes {nnodes} + "
                        f"--spare-nodes {spare_nodes})")
    if task.task == 0 and task.node_index != 0:
        problems.append(f"{SLURM_PROCID}=0 runs on {SLURM_NODEID}={task.node_index}, not on the first node of "
                        f"{task.nodelist} (where node 0 hosts the store): keep srun's block distribution (drop "
                        f"--distribution and --relative)")
    if problems:
        raise ValueError("--from-slurm: " + "; ".join(problems))
    if task.step_nodes < task.ntasks:
        logger.warning("%d agents on %d nodes: some nodes run more than one agent (and lose them together); "
                       "start one task per node (srun --ntasks-per-node=1)", task.ntasks, task.step_nodes)


def store_port(job_id: str) -> int:
    """The default store port of Slurm job ``job_id`` (module docstring)."""
    return STORE_PORT_BASE + int(job_id) % STORE_PORT_SPAN


def expand_nodelist(nodelist: str, *, timeout_s: float = SCONTROL_TIMEOUT_S) -> list[str]:
    """The host names of a Slurm node list (``node[01-04],gpu7``), in its order, as ``scontrol`` expands it.

    Raises:
        ValueError: ``scontrol`` is missing, failed or took longer than ``timeout_s``; the message says how to
            name the store instead.
    """
    out = _scontrol(["show", "hostnames", nodelist], timeout_s=timeout_s)
    hosts = out.split()
    if not hosts:
        raise ValueError(f"--from-slurm: scontrol show hostnames {nodelist!r} printed no host; give --store HOST:PORT")
    return hosts


def node_address(name: str, *, timeout_s: float = SCONTROL_TIMEOUT_S) -> str:
    """The address Slurm reaches node ``name`` at (its ``NodeAddr``; the name itself where Slurm names none)."""
    try:
        out = _scontrol(["show", "node", "--oneliner", name], timeout_s=timeout_s)
    except ValueError as exc:
        logger.warning("the address of node %s is unknown (%s): using its name", name, exc)
        return name
    for field in out.split():
        key, _, value = field.partition("=")
        if key == "NodeAddr" and value and value != "(null)":
            return value
    return name


def slurm_fields(env: Mapping[str, str], *, nnodes: int, spare_nodes: int, store: str | None,
                 store_port_flag: int | None, run_dir: Path, resume: Path | None) -> dict[str, Any]:
    """The agent's options this task of a Slurm step stands for: ``node_rank`` and ``spare``, ``store`` and
    ``host_store``, and on a requeued job ``resume``, ``start_step`` and ``resume_memory`` (unless the command
    line names a checkpoint).

    Raises:
        ValueError: not a task of a Slurm step, a step that contradicts ``nnodes``/``spare_nodes``, or a
            ``--store-port`` with ``--store``.
    """
    from unbroken.store.backend import is_etcd_address  # torch: not before the agent forks its template

    task = read_task(env)
    check_task(task, nnodes=nnodes, spare_nodes=spare_nodes)
    if store is not None and store_port_flag is not None:
        raise ValueError(f"--store {store} with --store-port {store_port_flag}: give one (--store-port puts the "
                         f"store on the first host of {task.nodelist})")
    if store is None:
        first = expand_nodelist(task.nodelist)[0]
        port = store_port_flag if store_port_flag is not None else store_port(task.job_id)
        store = f"{node_address(first)}:{port}"
    spare = task.task >= nnodes
    hosts = task.task == 0 and not is_etcd_address(store)  # an etcd job's keys: opened by the batch step
    fields: dict[str, Any] = {"node_rank": -1 if spare else task.task, "spare": spare, "store": store,
                              "host_store": hosts}
    if task.restart_count > 0 and resume is None:
        fields.update(requeued_resume(run_dir))
    place = f"spare node ({task.task - nnodes + 1} of {spare_nodes})" if spare else f"node {task.task}"
    logger.info("Slurm job %s task %d of %d: %s, store %s%s%s", task.job_id, task.task, task.ntasks, place, store,
                " (hosted here)" if hosts else "",
                f", requeued {task.restart_count}x: resuming" if task.restart_count > 0 else "")
    return fields


def requeued_resume(run_dir: Path) -> dict[str, Any]:
    """A requeued job's resume options: the run's newest committed checkpoint and its step (none: from the
    start), and snapshot memory where newer (not under ``fault.recovery=restart``, which restarts from
    checkpoints only).

    Raises:
        ValueError: ``run_dir`` holds no config.json (not a run directory).
    """
    from unbroken.checkpoint.checkpointer import latest_checkpoint, read_commit
    from unbroken.runtime.recovery import recovery

    cfg_file = run_dir / "config.json"
    try:
        cfg = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"--run-dir {run_dir}: a requeued job resumes its run, but {cfg_file} cannot be read "
                         f"({exc}); prepare it first (unbroken train --resume {run_dir} --prepare-only)") from None
    checkpoint = latest_checkpoint(run_dir)
    start = int(read_commit(checkpoint)["step"]) if checkpoint is not None else 0
    memory = not recovery(cfg.get("fault", {}).get("recovery", "takeover")).restarts_job
    return {"resume": checkpoint, "start_step": start, "resume_memory": memory}


def _scontrol(args: list[str], *, timeout_s: float) -> str:
    try:
        done = subprocess.run(["scontrol", *args], capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        raise ValueError("--from-slurm: scontrol is not on PATH; run the agent under srun on a Slurm node, or "
                         "give --store HOST:PORT") from None
    except subprocess.TimeoutExpired:
        raise ValueError(f"--from-slurm: scontrol {' '.join(args)} took more than {timeout_s:.0f} s; give --store "
                         f"HOST:PORT") from None
    if done.returncode != 0:
        why = (done.stderr.strip().splitlines() or [f"exit code {done.returncode}"])[-1]
        raise ValueError(f"--from-slurm: scontrol {' '.join(args)} failed ({why}); give --store HOST:PORT")
    return done.stdout
