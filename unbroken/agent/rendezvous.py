"""An agent's entry into the job: its node rank, the job's config, the initial view.

Through the job store (:mod:`unbroken.store.job_store`): the agent owning
node rank ``R`` holds its registration (set by compare-and-set from "", reset
to "" on a clean exit) with its pid, and beats its own heartbeat counter (+1
every 100 ms); the job's config JSON is published by the launcher or node 0;
node 0 publishes the initial view if absent.

Invariants: at most one live agent holds a node rank, and at most one
incarnation of each worker id runs: a holder is replaced only once its heartbeat
stood still for ``TAKEOVER_SILENCE_S``, and its successor starts workers only
once every worker of the node it was given (``workers``) has been silent that
long too; no agent starts workers under a config that differs from the job's;
every wait is bounded by the start-up timeout and, once registered, keeps the
heartbeat going, so a waiting agent still counts as live.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Sequence

from unbroken.config import config_diff
from unbroken.store.job_store import JobStore
from unbroken.store.view import View

logger = logging.getLogger(__name__)

HEARTBEAT_S = 0.1
TAKEOVER_SILENCE_S = 3.0
"""How long the previous holder of a node rank must have been silent before another agent takes it
over: first its agent's heartbeat, then each of its workers' (``hb/<w>``). That is 30 beats of either
(every 100 ms), so a holder stopped or descheduled for a second or two (SIGSTOP, swapping, a loaded
machine) keeps its node and no worker id runs twice; a lost node costs its successor these seconds once."""
RUN_DIR_TOKEN_FILE = "run_dir_token"
"""Node 0's token in the run directory: the other nodes find it there when they share the directory."""
RUN_DIR_VISIBLE_S = 10.0
"""How long a node looks for node 0's token in its run directory (a shared filesystem may show it late)."""
PER_MACHINE_FIELDS = frozenset({"data.cache_dir", "train.threads_per_worker"})
"""Config fields that may differ between nodes (paths and core counts of each machine)."""


class StartRefused(RuntimeError):
    """The agent must not start; the message says why and what to do."""


SPARE_POLL_S = 0.05
"""How often a spare node looks for a lost node."""


def holder_known_dead(holder: str, workers: Sequence[int], pid_dir: Path | None) -> bool:
    """The holder of a node rank (token ``host:pid:...``) ran on this machine, and neither its agent nor any
    of ``workers`` (their pid files in ``pid_dir``) is alive: no silence need be waited out. Anything
    unknown: False."""
    host, _, rest = holder.partition(":")
    agent_pid = rest.partition(":")[0]
    if host != socket.gethostname() or not agent_pid.isdigit() or pid_dir is None:
        return False
    pids = [int(agent_pid)]
    for w in workers:
        try:
            pids.append(int((pid_dir / f"w{w}").read_text().split()[0]))
        except FileNotFoundError:
            continue  # never started, or reaped and removed by its agent
        except (OSError, ValueError, IndexError):
            return False
    return all(_process_gone(p) for p in pids)


def wait_for_lost_node(store: JobStore, *, nnodes: int, workers_per_node: int, pid_dir: Path | None,
                       interrupted: Callable[[], bool], silence_s: float = TAKEOVER_SILENCE_S) -> int | None:
    """A spare node's wait: the rank of the first node whose agent and workers are known dead (this
    machine's pid files), or whose agent gave its rank back or stood silent for ``silence_s`` (another
    machine's); None once the job is done.

    Raises:
        StartRefused: interrupted.
    """
    silent: dict[int, tuple[int, float]] = {}  # node -> (its agent's beat count, since when unchanged)
    while True:
        if interrupted():
            raise StartRefused("the spare node was interrupted while waiting for a lost node")
        if store.is_done():
            return None
        now = time.monotonic()
        for node in range(nnodes):
            holder = store.node_holder(node)
            if holder is None:
                continue  # not taken yet: its own agent is starting
            workers = range(node * workers_per_node, (node + 1) * workers_per_node)
            if holder == "" or holder_known_dead(holder, workers, pid_dir):
                return node
            beats = store.agent_beat(node, 0)
            if silent.get(node, (None, 0.0))[0] != beats:
                silent[node] = (beats, now)
            elif now - silent[node][1] >= silence_s:
                return node
        time.sleep(SPARE_POLL_S)


class NodeRegistration:
    """One agent's hold on its node rank, and its start-up checks."""

    def __init__(self, store: JobStore, node: int, *, timeout_s: float,
                 interrupted: Callable[[], bool] = lambda: False, workers: Sequence[int] = (),
                 silence_s: float = TAKEOVER_SILENCE_S, pid_dir: Path | None = None) -> None:
        """
        Args:
            timeout_s: the start-up timeout (every wait here is bounded by it).
            workers: this node's worker ids; a takeover waits until the previous holder's are silent.
            silence_s: ``TAKEOVER_SILENCE_S`` (tests may shorten it).
            pid_dir: where agents keep their workers' pid files (``RUN/pids``): a previous holder that ran
                on this machine is known dead, without waiting for silence, once none of its processes lives.
        """
        self.store, self.node, self.timeout_s, self.interrupted = store, node, timeout_s, interrupted
        self.workers, self.silence_s, self.pid_dir = list(workers), silence_s, pid_dir
        self.token = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"
        self.took_over = False
        self.registered = False
        self._next_hb = 0.0

    def register(self) -> None:
        """Take node rank ``R``; refuse if a live agent holds it, or its workers still run.

        Raises:
            StartRefused: another live agent holds the rank, or the previous holder's
                workers kept beating for the whole start-up timeout.
        """
        holder = self.store.claim_node(self.node, self.token)
        if holder != self.token:
            pid = self.store.node_pid(self.node) or "unknown"
            gone = self._known_dead(holder)
            if not gone:
                logger.info("[node %d] the node rank is held (pid %s): watching its heartbeat for %.1f s",
                            self.node, pid, self.silence_s)
                if self._beats_within(lambda: [self.store.agent_beat(self.node, 0)]):
                    raise StartRefused(f"an agent with node rank {self.node} is already running (pid {pid}); "
                                       f"stop it or pick another --node-rank")
            if self.store.claim_node(self.node, self.token, expected=holder) != self.token:
                raise StartRefused(f"an agent with node rank {self.node} registered at the same time; retry")
            logger.warning("[node %d] took over the node rank from a %s agent (pid %s)", self.node,
                           "dead" if gone else "silent", pid)
            self.took_over = self.registered = True
            if not gone:
                self._wait_workers_silent(holder, pid)
        self.registered = True
        self.store.set_node_pid(self.node, f"{os.getpid()} on {socket.gethostname()}")
        self.heartbeat(time.monotonic())

    def _known_dead(self, holder: str) -> bool:
        return holder_known_dead(holder, self.workers, self.pid_dir)

    def _beats_within(self, read: Callable[[], list[int]], *, beat: bool = False) -> bool:
        """Whether the counters ``read`` returns change within ``silence_s`` (``beat``: keep ours going)."""
        first = read()
        deadline = time.monotonic() + self.silence_s
        while time.monotonic() < deadline:
            if self.interrupted():
                raise StartRefused(f"node {self.node}: interrupted while starting")
            if beat:
                self.heartbeat(time.monotonic())
            time.sleep(0.05)
            if read() != first:
                return True
        return False

    def _wait_workers_silent(self, holder: str, pid: str) -> None:
        """After a takeover: wait until the previous holder's workers stopped beating (they die with
        their agent); give the rank back to ``holder`` if they keep beating for the start-up timeout."""
        if not self.workers:
            return
        deadline = time.monotonic() + self.timeout_s
        while self._beats_within(lambda: self.store.heartbeats(self.workers), beat=True):
            if time.monotonic() > deadline:
                self.store.claim_node(self.node, holder, expected=self.token)
                self.took_over = self.registered = False
                raise StartRefused(f"node {self.node}: workers {self.workers} of the previous agent (pid {pid}) "
                                   f"still beat after {self.timeout_s:.0f} s; stop them (or that agent) first")
            logger.info("[node %d] workers %s of the previous agent still beat; waiting", self.node, self.workers)

    def mark_predecessors_dead(self) -> list[int]:
        """After a takeover, mark dead the previous holder's workers that the current view still names;
        returns them.

        They are gone with it (known dead, or silent as long as ``TAKEOVER_SILENCE_S``). Marked before
        their successors start beating under the same ids: otherwise the members would take the new
        incarnations' heartbeats for theirs and wait on them until the progress timeout. An existing
        mark stays (first mark wins).
        """
        if not self.took_over or not self.store.has_view():
            return []
        view = self.store.current_view()
        reason = json.dumps({"by": "agent", "node": self.node, "how": "node lost", "t": time.time()})
        return [w for w in self.workers if w in view.members and self.store.mark_dead(w, reason)]

    def heartbeat(self, now: float) -> None:
        """Beat if the interval has passed (called from the agent's loop)."""
        if now >= self._next_hb:
            self._next_hb = now + HEARTBEAT_S
            self.store.agent_beat(self.node)

    def release(self) -> None:
        """Give the rank back so a successor need not wait out the liveness window."""
        if self.registered:
            self.store.release_node(self.node, self.token)
            self.registered = False

    def wait_released(self, nnodes: int, timeout_s: float) -> None:
        """Node 0 hosting the store: let the other agents see the end before the store goes.

        Waits until every other node rank is released ("" or never taken), at
        most ``timeout_s`` (a lost node never releases its rank).
        """
        deadline = time.monotonic() + timeout_s
        others = [r for r in range(nnodes) if r != self.node]
        while time.monotonic() < deadline:
            if all(self.store.node_released(r) for r in others):
                return
            time.sleep(0.05)
        logger.warning("[node %d] other agents still registered after %.0f s; closing the store", self.node, timeout_s)

    def wait_for(self, ready: Callable[[], bool], what: str) -> None:
        """Wait until ``ready()`` up to the start-up timeout, heartbeating meanwhile.

        Raises:
            StartRefused: it did not happen in time, or the agent was interrupted.
        """
        deadline = time.monotonic() + self.timeout_s
        while not ready():
            if time.monotonic() > deadline:
                raise StartRefused(f"node {self.node}: {what} within {self.timeout_s:.0f} s; "
                                   f"is the node-0 agent running?")
            if self.interrupted():
                raise StartRefused(f"node {self.node}: interrupted while starting")
            self.heartbeat(time.monotonic())
            time.sleep(0.01)

    def check_config(self, run_dir: Path) -> dict[str, Any]:
        """Compare ``run_dir/config.json`` with the job's ``config`` (node 0 publishes it if absent).

        Returns:
            The config (``Config.to_dict()`` form).

        Raises:
            StartRefused: no config.json, or it differs; the message names the fields and both values.
        """
        path = run_dir / "config.json"
        if not path.is_file():
            raise StartRefused(f"node {self.node}: {path} does not exist; give the run directory the launcher "
                               f"prepared (or copy the run's config.json there)")
        mine = json.loads(path.read_text())
        if self.node == 0:
            job: str | None = self.store.agree_config(json.dumps(mine))
        else:
            self.wait_for(lambda: self.store.config() is not None,
                          "node 0 (or the launcher) has not published the job's config")
            job = self.store.config()
        assert job is not None  # waited for above
        theirs = json.loads(job)
        diff = [f for f in config_diff(theirs, mine) if f not in PER_MACHINE_FIELDS]
        if diff:
            values = "; ".join(f"{f}: job {_field(theirs, f)!r}, here {_field(mine, f)!r}" for f in diff)
            raise StartRefused(f"node {self.node}: {path} differs from the job's config in {', '.join(diff)} "
                               f"({values}); use the same config on every node")
        return mine

    def check_shared_run_dir(self, run_dir: Path) -> None:
        """Refuse a run directory that is not the one node 0 uses (a copy on another machine).

        The run directory must be one directory every node sees (a shared filesystem on a multi-machine job):
        a restore names the deciding agent's checkpoint path, a sharded checkpoint gathers every machine's
        shards in the leader's folder, the final checkpoint and the reports are read from it. Node 0 writes a
        fresh token into ``run_dir/RUN_DIR_TOKEN_FILE`` and publishes it; every other node (and a node 0 that
        finds one published) reads the file and compares.

        Raises:
            StartRefused: the file is missing or holds another token; the message says why it matters.
        """
        path = run_dir / RUN_DIR_TOKEN_FILE
        if self.node == 0 and self.store.run_dir_token() is None:
            token = secrets.token_hex(16)
            tmp = path.with_name(f".{path.name}.{os.getpid()}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(token)
                fh.flush()
                os.fsync(fh.fileno())
            os.replace(tmp, path)
            job: str | None = self.store.agree_run_dir_token(token)
        else:
            self.wait_for(lambda: self.store.run_dir_token() is not None,
                          "node 0 has not published its run directory's token")
            job = self.store.run_dir_token()
        assert job is not None  # waited for above
        deadline = time.monotonic() + RUN_DIR_VISIBLE_S  # a shared filesystem may show a new file late
        while True:
            try:
                here = path.read_text().strip()
            except OSError:
                here = None
            if here == job or time.monotonic() >= deadline:
                break
            self.heartbeat(time.monotonic())
            time.sleep(0.1)
        if here != job:
            raise StartRefused(
                f"node {self.node}: {run_dir} is not the run directory node 0 uses ({path.name} "
                f"{'is missing' if here is None else 'holds another token'}): every node of a job must use one "
                f"shared run directory (the same folder on a shared filesystem, at the same path), because "
                f"checkpoints, restores and the final state are read from it by any node")

    def initial_view(self, n_workers: int, start_step: int) -> View:
        """The current view; node 0 first publishes generation 0 (all workers, from ``start_step``) if absent."""
        if self.node == 0:
            self.store.publish_initial(View(gen=0, members=tuple(range(n_workers)), step=start_step, reason="start"))
        else:
            self.wait_for(self.store.has_view, "node 0 has not published the initial view")
        return self.store.current_view()


def _field(d: dict[str, Any], dotted: str) -> Any:
    section, _, name = dotted.partition(".")
    return d.get(section, {}).get(name)


def _process_gone(pid: int) -> bool:
    """No process ``pid`` runs on this machine (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # alive, another user's: the pid was reused
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rpartition(")")[2].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return True
