"""A fork server for the agents one launcher starts: ``python -m unbroken.agent.agent_server``.

A launcher that plays a cluster on one machine (``unbroken train``, ``unbroken demo``, the benchmarks) starts
an agent per node, and one more per replaced or spare node. Each agent's interpreter imports torch (1.6 CPU-s
on two cores) before it can do anything, and a replacement node's start waits for it. This server imports the
agent's modules once, runs no thread, and forks an agent on each request (one JSON line in: the agent's
arguments, environment, working directory and log; the pid back), the way ``torch.multiprocessing``'s
forkserver works. The server also imports what a worker needs beyond the agent (``torch._dynamo``, the
worker's modules); the agent then forks its node's template from itself (:mod:`unbroken.agent.command`), so a
node's start costs forks and the preparation of its data, not an interpreter or an import.

The server is the agents' parent: it reaps each one and writes its exit status as a line of its own
(``{"exit": pid, "code": ...}``, :func:`subprocess.Popen.returncode`'s convention). The launcher's side,
:class:`AgentServer`, hands out :class:`ServedAgent` objects with ``Popen``'s ``pid``, ``poll``, ``wait``,
``terminate``, ``kill`` and ``returncode``. One server serves every launch of its process; it dies with the
launcher (``PR_SET_PDEATHSIG``) and exits when the launcher closes its end, leaving running agents as they
would be without it. Where it cannot start or stops answering, agents start as fresh processes.

Invariants: the server forks only while it runs a single thread (checked before every fork); a forked agent
starts with exactly the environment and working directory the launcher asked for, its output in its log,
no descriptor of the server's but those; the launcher reads the server's lines only with a deadline, and
signals an agent only while no exit of it was reported (the server reaps at once, so a pid could be reused
between the reap and the launcher's next read: a window of one report line).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Sequence

from unbroken.agent._process import ChildWaker, ForkedChild, LineBuffer, close_pipes, run_forked

logger = logging.getLogger(__name__)

READY_TIMEOUT_S = 60.0
"""The server's imports, on a loaded machine, before the launcher gives up on it (agents start fresh)."""
IDLE_S = 1.0
"""The server's loop wakes for a request on its input or an agent's exit (SIGCHLD); this tick is a backstop."""
REPLY_TIMEOUT_S = 10.0
"""A fork request not answered in this long: the server is given up on."""


# -- the server ---------------------------------------------------------------------------------------


def _become_agent(request: dict[str, Any]) -> None:
    """In the forked child: the agent the request describes, as a fresh ``python -m unbroken.agent.command``
    would be (its own environment, directory, output and default signal handlers). Never returns."""
    def body() -> int:
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        os.environ.clear()
        os.environ.update({str(k): str(v) for k, v in request["env"].items()})
        os.chdir(request["cwd"])
        out = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o600)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(out, 1)
        os.dup2(out, 2)
        os.closerange(3, os.sysconf("SC_OPEN_MAX"))
        from unbroken.agent._process import set_name
        from unbroken.agent.command import main

        set_name("unbroken-agent")
        argv = [str(a) for a in request["argv"]]
        sys.argv = [sys.executable, "-m", "unbroken.agent.command", *argv]
        worker_cmd = request.get("worker_cmd")  # another worker program (the tests' stand-in), as main() takes
        return main(argv, worker_cmd=[str(a) for a in worker_cmd] if worker_cmd else None)

    run_forked(body)


def serve() -> int:
    """The server's loop: fork on each request, report each exit; returns when the launcher closes stdin."""
    from unbroken.agent._process import die_with_parent
    from unbroken.agent.template import thread_count

    die_with_parent(os.getppid())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a terminal's Ctrl-C is for the launcher and its agents
    out = os.fdopen(os.dup(1), "w")  # replies; anything else printed goes to stderr
    os.dup2(2, 1)

    def reply(message: dict[str, Any]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # numpy's pool would be a thread (see command.py)
    t0 = time.perf_counter()
    import unbroken.agent.agent  # noqa: F401 (torch and the agent's modules, once for every agent)
    import unbroken.agent.command  # noqa: F401
    # What the template each agent forks imports beyond the agent: inherited, its start is a fork and its data.
    import torch._dynamo  # noqa: F401
    import unbroken.agent.worker_process  # noqa: F401

    threads = thread_count()
    reply({"ready": threads == 1, "threads": threads, "imports_s": round(time.perf_counter() - t0, 3)})
    if threads != 1:
        return 2
    buf = b""
    waker = ChildWaker()  # an agent's exit (SIGCHLD) wakes the loop at once, as a request does
    while True:
        readable = waker.wait(0, IDLE_S)
        while True:  # reap: each agent's exit, in the launcher's terms
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if not pid:
                break
            reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if not readable:
            continue
        chunk = os.read(0, 65536)
        if not chunk:
            return 0
        buf += chunk
        while b"\n" in buf:
            line, _, buf = buf.partition(b"\n")
            try:
                request = json.loads(line)
                if (n := thread_count()) != 1:
                    raise RuntimeError(f"the server has {n} threads: forking it is unsafe")
                sys.stdout.flush()
                sys.stderr.flush()
                pid = os.fork()
                if pid == 0:
                    _become_agent(request)
            except Exception as exc:  # the launcher starts a fresh process instead
                reply({"error": f"{type(exc).__name__}: {exc}"})
                continue
            reply({"pid": pid})


# -- the launcher's side ------------------------------------------------------------------------------


class ServedAgent(ForkedChild):
    """An agent forked by the server, as the launcher sees it (``subprocess.Popen``'s surface): a
    :class:`ForkedChild` whose exit status comes from the server's reports (the server is its parent)."""

    def __init__(self, server: AgentServer, pid: int, args: Sequence[str]) -> None:
        super().__init__(pid, args)
        self.server = server

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # not reported gone: its pid is still its own (the server reaps on report)
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class AgentServer:
    """The launcher's handle on its server (one per process, :func:`agent_server`)."""

    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-m", "unbroken.agent.agent_server"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=None, env={**os.environ})
        self._lines = LineBuffer()
        self._exits: dict[int, int] = {}
        self._lock = threading.Lock()
        self.ready = False
        reply = self._read(READY_TIMEOUT_S)
        if reply is None or not reply.get("ready"):
            logger.warning("the agents' fork server did not start (%s): agents start as fresh processes", reply)
            self.close()
            return
        self.ready = True

    def spawn(self, argv: Sequence[str], *, log: Path, env: dict[str, str],
              worker_cmd: Sequence[str] | None = None) -> ServedAgent | None:
        """Fork an agent with ``argv`` (``unbroken.agent.command``'s), ``env`` and output appended to ``log``;
        ``worker_cmd``: the program its workers run instead of the worker (``main``'s argument); None when
        the server cannot (the caller starts a fresh process)."""
        with self._lock:
            if not self.alive():
                return None
            try:
                request = {"argv": list(argv), "env": env, "cwd": os.getcwd(), "log": str(log),
                           "worker_cmd": list(worker_cmd) if worker_cmd else None}
            except OSError as exc:  # the launcher's directory is gone: a fresh process says so
                logger.warning("no agent forked (%s): a fresh process", exc)
                return None
            try:
                assert self.proc.stdin is not None
                self.proc.stdin.write((json.dumps(request) + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, OSError) as exc:
                self._give_up(f"did not take a request ({exc})")
                return None
            deadline = time.monotonic() + REPLY_TIMEOUT_S
            while True:
                reply = self._read(max(0.0, deadline - time.monotonic()))
                if reply is None:
                    self._give_up(f"did not answer a fork request within {REPLY_TIMEOUT_S:.0f} s")
                    return None
                if "pid" in reply:
                    return ServedAgent(self, int(reply["pid"]), argv)
                if "error" in reply:
                    logger.warning("the agents' fork server could not fork (%s): a fresh process", reply["error"])
                    return None

    def exit_code(self, pid: int) -> int | None:
        """``pid``'s exit status once the server reported it (a gone server: read from ``/proc``)."""
        with self._lock:
            if self.alive():
                while self._read(0.0) is not None:
                    pass
            if pid in self._exits:
                return self._exits[pid]
            if not self.alive() and not Path(f"/proc/{pid}").exists():
                return self._exits.setdefault(pid, -int(signal.SIGKILL))  # its status went with the server
            return None

    def alive(self) -> bool:
        return self.ready and self.proc.poll() is None

    def close(self) -> None:
        """Close the server's input: it exits, leaving any agent running as it is."""
        self.ready = False
        close_pipes(self.proc)
        try:
            self.proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            self.proc.kill()

    def _give_up(self, why: str) -> None:
        logger.warning("the agents' fork server %s: agents start as fresh processes", why)
        self.proc.kill()
        self.close()

    def _read(self, timeout_s: float) -> dict[str, Any] | None:
        """One line from the server (exit reports are recorded and skipped), or None within ``timeout_s``."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while (line := self._lines.line(self.proc.stdout.fileno(), deadline - time.monotonic())) is not None:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict) and "exit" in message:
                self._exits[int(message["exit"])] = int(message["code"])
                continue
            if isinstance(message, dict):
                return message
        return None


MAX_STARTS = 3
"""Servers a process starts (the first, and replacements of ones that died or stopped answering) before its
agents start as fresh processes for good."""
_SERVER: AgentServer | None = None
_STARTS = 0
_SERVER_LOCK = threading.Lock()


def agent_server() -> AgentServer | None:
    """This process's agent fork server, started on first use (again if it died); None where it cannot run."""
    global _SERVER, _STARTS
    if not sys.platform.startswith("linux"):
        return None
    with _SERVER_LOCK:
        if _SERVER is None or not _SERVER.alive():
            if _STARTS >= MAX_STARTS:
                return None
            _STARTS += 1
            _SERVER = AgentServer()
        return _SERVER if _SERVER.ready else None


if __name__ == "__main__":
    sys.exit(serve())
