"""A real Slurm cluster on this machine for the tests: one slurmctld and one slurmd per node, on loopback.

Debian's ``slurm-wlm`` (22.05) runs several ``slurmd`` on one host (``slurmd -N NAME``): each node of
``slurm.conf`` is a daemon of its own (``NodeName=nI NodeAddr=127.0.0.1 Port=P``, a port each), so a job of K
nodes gets K ``slurmstepd`` per step, and a task that dies ends on its node alone, as on a cluster.
Authentication is ``auth/none``/``cred/none`` (no munged to run); processes are tracked by
``proctrack/linuxproc`` with ``task/none`` (no cgroups needed). Everything lives in one temporary
directory (config, state, spool, logs); the daemons run in the foreground as this process's children and
are stopped by :meth:`LocalSlurm.stop`, after the jobs it still holds are cancelled.

Invariant: every wait has a deadline, and every call to a Slurm command a timeout.
"""

from __future__ import annotations

import getpass
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from unbroken.store.local_etcd import free_ports

COMMANDS = ("slurmctld", "slurmd", "sbatch", "srun", "scontrol", "sinfo", "squeue", "scancel")
INSTALL = "apt-get install slurm-wlm (scripts/setup.sh installs it where it runs as root)"
COMMAND_TIMEOUT_S = 20.0
CRED_EXPIRE_S = 10
POLL_S = 0.1
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL", "DEADLINE",
            "PREEMPTED"}


class SlurmUnavailable(RuntimeError):
    """Slurm is not installed here, or its daemons would not start; the message says which and how to fix."""


class LocalSlurm:
    """slurmctld and ``nodes`` slurmd in ``root``; :attr:`env` is the environment Slurm's commands need."""

    def __init__(self, root: Path, nodes: int, *, cpus_per_node: int = 1, start_timeout_s: float = 30.0) -> None:
        search = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
        found = {c: shutil.which(c, path=search) for c in COMMANDS}
        missing = [c for c, path in found.items() if path is None]
        if missing:
            raise SlurmUnavailable(f"Slurm is not installed ({', '.join(missing)} not found): {INSTALL}")
        if os.geteuid() != 0:
            raise SlurmUnavailable("Slurm's daemons need root to start job steps as the job's user: run the tests "
                                   "as root (CI does)")
        self.root, self.nodes = root, [f"n{i}" for i in range(1, nodes + 1)]
        self.procs: list[subprocess.Popen[bytes]] = []
        for d in ("state", "spool", "log"):
            (root / d).mkdir(parents=True, exist_ok=True)
        ctld_port, *node_ports = free_ports(1 + nodes)
        self.conf = root / "slurm.conf"
        self.conf.write_text(self._config(ctld_port, node_ports, cpus_per_node))
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        try:
            self._start("slurmctld", [str(found["slurmctld"]), "-D", "-f", str(self.conf)])
            for name in self.nodes:
                self._start(f"slurmd-{name}", [str(found["slurmd"]), "-D", "-N", name, "-f", str(self.conf)])
            self._wait_idle(start_timeout_s)
        except BaseException:
            self.stop()
            raise

    def _config(self, ctld_port: int, node_ports: list[int], cpus: int) -> str:
        user, r = getpass.getuser(), self.root
        host = socket.gethostname().split(".")[0]  # slurmctld and slurmd match the short name
        lines = [
            "ClusterName=unbroken-test", f"SlurmctldHost={host}(127.0.0.1)",
            f"SlurmctldPort={ctld_port}", f"SlurmUser={user}", f"SlurmdUser={user}",
            "AuthType=auth/none", "CredType=cred/none",
            f"StateSaveLocation={r}/state", f"SlurmdSpoolDir={r}/spool/%n",
            f"SlurmctldPidFile={r}/slurmctld.pid", f"SlurmdPidFile={r}/slurmd-%n.pid",
            f"SlurmctldLogFile={r}/log/slurmctld.log", f"SlurmdLogFile={r}/log/slurmd-%n.log",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none", "JobCompType=jobcomp/none", "MpiDefault=none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU", "SchedulerType=sched/builtin",
            "SlurmdParameters=config_overrides", "ReturnToService=2", "KillWait=5", "InactiveLimit=0",
            # A requeued job may start again this many seconds later (default 120; it is also how long a step's
            # credential is valid), and pending jobs are looked at every second (default 60).
            f"AuthInfo=cred_expire={CRED_EXPIRE_S}", "SchedulerParameters=sched_interval=1",
        ]
        lines += [f"NodeName={name} NodeHostname={host} NodeAddr=127.0.0.1 Port={port} CPUs={cpus} "
                  f"State=UNKNOWN" for name, port in zip(self.nodes, node_ports)]
        lines.append("PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP")
        return "\n".join(lines) + "\n"

    def _start(self, name: str, cmd: list[str]) -> None:
        with (self.root / "log" / f"{name}.out").open("ab") as out:
            self.procs.append(subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                               env=self.env, start_new_session=True))

    def _wait_idle(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        states = ""
        while time.monotonic() < deadline:
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                raise SlurmUnavailable(f"{', '.join(dead)} exited at start: {self._log_tail()}")
            done = self.run(["sinfo", "--noheader", "--Node", "--format=%N %T"], check=False)
            states = done.stdout.strip()
            if done.returncode == 0 and len(states.splitlines()) == len(self.nodes) and \
                    all(line.split()[1] == "idle" for line in states.splitlines()):
                return
            time.sleep(POLL_S)
        raise SlurmUnavailable(f"the nodes were not idle within {timeout_s:.0f} s (sinfo: {states!r}): "
                               f"{self._log_tail()}")

    def _log_tail(self) -> str:
        tails = []
        for log in sorted((self.root / "log").glob("*")):
            lines = log.read_text(errors="replace").splitlines()[-3:]
            tails.append(f"{log.name}: " + " | ".join(lines))
        return "; ".join(tails)

    def run(self, cmd: list[str], *, check: bool = True, **kwargs: object) -> subprocess.CompletedProcess[str]:
        """A Slurm command with this cluster's environment and a timeout."""
        done = subprocess.run(cmd, capture_output=True, text=True, env=kwargs.pop("env", self.env),
                              timeout=COMMAND_TIMEOUT_S, check=False, **kwargs)  # type: ignore[call-overload]
        if check and done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited with {done.returncode}: {done.stderr.strip()}")
        return done

    def sbatch(self, args: list[str], *, env: dict[str, str], cwd: Path) -> str:
        """Submit a batch job; returns its id."""
        done = self.run(["sbatch", "--parsable", *args], env={**env, "SLURM_CONF": str(self.conf)}, cwd=cwd)
        return done.stdout.strip().split(";")[0]

    def job(self, job_id: str) -> dict[str, str]:
        """The job's fields as ``scontrol show job`` prints them (``JobState``, ``ExitCode``, ...)."""
        out = self.run(["scontrol", "show", "job", "--oneliner", job_id]).stdout
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait_job(self, job_id: str, timeout_s: float, *, restarts: int = 0) -> dict[str, str]:
        """Wait until the job's run number ``restarts`` (0: the first; a requeue adds one) has ended; returns the
        job's fields.

        Raises:
            TimeoutError: it has not ended after ``timeout_s`` (its state is named).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            fields = self.job(job_id)
            if fields.get("JobState") in TERMINAL and int(fields.get("Restarts", 0)) >= restarts:
                return fields
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {fields.get('JobState')} (restarts "
                                   f"{fields.get('Restarts')}) after {timeout_s:.0f} s")
            time.sleep(POLL_S)

    def stop(self, timeout_s: float = 20.0) -> None:
        """Cancel every job still held and wait for them to end, then stop the daemons (SIGTERM, then SIGKILL)."""
        if self.procs and all(p.poll() is None for p in self.procs):
            jobs = self.run(["squeue", "--noheader", "--format=%i"], check=False).stdout.split()
            for job_id in jobs:
                self.run(["scancel", "--full", job_id], check=False)
            deadline = time.monotonic() + timeout_s
            while jobs and time.monotonic() < deadline and \
                    self.run(["squeue", "--noheader", "--format=%i"], check=False).stdout.split():
                time.sleep(POLL_S)
        for p in reversed(self.procs):  # the slurmd first, slurmctld last
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in reversed(self.procs):
            try:
                p.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=5)
        self.procs.clear()
