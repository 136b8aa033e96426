"""A run directory made ready for agents that a cluster's scheduler starts: ``unbroken train --prepare-only``.

``unbroken train`` prepares its run directory and starts its agents itself. On
a cluster, the scheduler starts one ``unbroken agent`` per machine (Slurm: one
``srun`` task per node, ``examples/slurm/train.sbatch``), and each needs the run
directory ready before it starts: ``config.json`` (``train.workers`` = nodes x
workers per node), the job id its snapshot memory is named by, the token cache
built once, and the job's secret (``$UNBROKEN_JOB_SECRET`` when set, else a new
one; written 0600 to ``RUN/secret``), and with an etcd ``store`` the job's keys
there, opened before any agent starts so that every agent connects and none
races to create them. With ``resume`` the run keeps its config and secret, its
metrics are cut back to the step it continues from, the keys its previous run
left on etcd (views, progress, its end) are deleted, and its agents restore the
newer of its newest committed checkpoint and snapshot memory.

Invariants: the same checks as :func:`unbroken.agent.launcher.launch` before anything is written
(:func:`unbroken.agent.launch_checks.check_launch` among them: a run that fails them leaves nothing on
disk); faults from the config (``fault.fail_at``, ``fault.trace``) are refused, not dropped: only
``unbroken train``'s launcher injects them.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from unbroken.agent.launch_checks import check_launch
from unbroken.agent.preflight import preflight, prepare_run_dir
from unbroken.config import Config
from unbroken.job.references import anchor_references
from unbroken.store.job_store import JobStore
from unbroken.store.backend import SECRET_FILE, StoreAccessDenied, job_secret, new_secret, save_secret
from unbroken.snapshot.capacity import check_snapshot_config
from unbroken.snapshot.protection import announce as announce_protection

__all__ = ["prepare_cluster_run"]


def prepare_cluster_run(cfg: Config, run_dir: Path, *, nodes: int, workers_per_node: int, overwrite: bool = False,
                        resume: bool = False, store: str | None = None) -> tuple[Path | None, str | None]:
    """Write (or, with ``resume``, check and cut back) ``run_dir`` for ``nodes`` agents of ``workers_per_node``;
    with ``store`` (``etcd://...``), open the job's keys there.

    Returns:
        The newest committed checkpoint a resumed run continues from (None: a new run, or none), and the prefix
        of the job's keys on etcd (None without ``store``).
    Raises:
        ValueError: a layout that does not give ``train.workers``, faults in the config, or any of
            :func:`unbroken.agent.preflight.preflight`'s and ``prepare_run_dir``'s refusals.
    """
    problems = []
    if nodes < 1 or workers_per_node < 1 or nodes * workers_per_node != cfg.train.workers:
        problems.append(f"{nodes} node(s) x {workers_per_node} worker(s) must be >= 1 each and equal "
                        f"train.workers={cfg.train.workers}")
    if cfg.fault.fail_at.strip() or cfg.fault.trace != "none":
        problems.append(f"fault.fail_at={cfg.fault.fail_at!r}, fault.trace={cfg.fault.trace!r}: only unbroken "
                        f"train's own launcher injects faults; on a cluster give the agents --fail-at, or run "
                        f"unbroken chaos --run-dir {run_dir} beside the job")
    if problems:
        raise ValueError("; ".join(problems))
    anchor_references(cfg)  # a relative factory path means this directory's, on every node
    info = preflight(cfg)
    check_snapshot_config(cfg, nodes, workers_per_node, info.get("vocab_size"))
    check_launch(cfg, workers_per_node, standby=False)  # each agent checks its own node's devices and --standby
    # A resumed run keeps its secret: it keys the seals of the snapshot memory it may continue from.
    secret = job_secret(run_dir) if resume and (run_dir / SECRET_FILE).is_file() else new_secret()
    resume_from = prepare_run_dir(run_dir, cfg, overwrite=overwrite, resume=resume)
    save_secret(run_dir, secret)
    announce_protection(cfg, run_dir, nodes, workers_per_node)
    prefix = None
    if store is not None:
        prefix = open_job_keys(store, secret=secret, run_dir=run_dir, timeout_s=cfg.train.timeout_s, resume=resume)
    return resume_from, prefix


def open_job_keys(url: str, *, secret: str, run_dir: Path, timeout_s: float, resume: bool) -> str:
    """Open the job's keys on the etcd cluster at ``url``; returns their prefix. A resumed run's (its previous
    run's, dead) are deleted first; a new run never deletes keys: a prefix that holds another job's is refused,
    naming it.

    Raises:
        ValueError: the namespace holds another job's keys; ConnectionError: no member answered.
    """
    if resume:
        try:
            JobStore.connect(url, timeout_s=timeout_s, secret=secret).backend.clear()  # type: ignore[attr-defined]
        except StoreAccessDenied:
            pass  # no keys left: nothing to delete
    job = {"run_dir": str(run_dir.resolve()), "host": socket.gethostname(), "pid": os.getpid(),
           "started": time.strftime("%Y-%m-%dT%H:%M:%S")}
    return str(JobStore.create_on_etcd(url, timeout_s=timeout_s, secret=secret, job=job).backend.ns)  # type: ignore[attr-defined]
