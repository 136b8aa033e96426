"""Child processes of an agent: spawned in their own session, signalled, stopped, never leaked.

Invariants: every child runs in its own session (process group id == pid), so
a signal to the group reaches the child and whatever it started, and a
terminal's Ctrl-C reaches only the agent, which then stops its children; on
Linux every child receives SIGKILL when the agent dies (``PR_SET_PDEATHSIG``,
armed by the child itself: :func:`die_with_parent`), so even a SIGKILLed agent
(a lost node) leaves nothing behind; :func:`stop_all` returns only once every
child is reaped. A child is either spawned (``exec`` of a fresh interpreter, no
Python between fork and exec) or forked from the node's template process
(:mod:`unbroken.agent.template`) and adopted (:class:`ForkedChild`).
"""

from __future__ import annotations

import ctypes
import logging
import os
import select
import signal
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Callable, Iterable, Sequence

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_NAME = 15
PARENT_ENV = "UNBROKEN_PARENT_PID"
"""The pid of the agent a child must die with (set by :func:`spawn` and the template; read by
:func:`die_with_parent` in the child itself)."""


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def set_name(name: str) -> None:
    """Name this process as ``ps -o comm`` and ``top`` show it (15 bytes): a process forked without ``exec``
    keeps its parent's command line, so a forked template or worker says what it is this way."""
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_NAME, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)


def die_with_parent(parent: int | None = None) -> None:
    """Make this process die (SIGKILL) with its agent: the first thing a child of an agent does.

    ``parent`` defaults to :data:`PARENT_ENV`; without either this does nothing
    (a process not started by an agent). The agent may have died before the
    call: then its pid is no longer this process's parent, and it exits at once.
    The child arms this itself, after ``exec``: an agent runs threads (the
    store it hosts, heartbeats), and a fork from a threaded process must run no
    Python before ``exec`` (no ``preexec_fn``), or the child can deadlock on a
    lock another thread held at the fork.
    """
    if parent is None:
        value = os.environ.get(PARENT_ENV, "")
        if not value.isdigit():
            return
        parent = int(value)
    prctl = _prctl()
    if prctl is not None:
        prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent:
        os._exit(1)


def run_forked(body: Callable[[], int | None]) -> None:
    """In a forked child: run ``body`` and leave with its exit code, never returning into the parent's code
    (``SystemExit`` gives its code; any other exception is printed and gives 1; standard streams flushed)."""
    code = 1
    ChildWaker.forget()  # the parent's wakeup pipe is not this process's
    try:
        code = body() or 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except BaseException:
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


class ChildWaker:
    """The agent loop's sleep: until a timeout, or at once when a child exits (SIGCHLD) or a signal with a
    handler arrives. A crashed worker is reaped within microseconds while the loop otherwise ticks slowly (the
    loop's store reads cost the store a round trip each). Installed from the main thread (else it sleeps)."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        os.set_blocking(self._w, False)
        try:
            self._handler = signal.signal(signal.SIGCHLD, _ignore)
            self._fd = signal.set_wakeup_fd(self._w, warn_on_full_buffer=False)
            self.armed = True
        except ValueError:  # not the main thread
            self.armed = False

    def sleep(self, seconds: float) -> None:
        self.wait(None, seconds)

    def wait(self, fd: int | None, seconds: float) -> bool:
        """Sleep as :meth:`sleep`, or until ``fd`` is readable too; returns whether it is."""
        if not self.armed:
            if fd is None:
                time.sleep(seconds)
                return False
            return bool(select.select([fd], [], [], seconds)[0])
        ready = select.select([self._r] if fd is None else [self._r, fd], [], [], seconds)[0]
        if self._r in ready:
            try:
                while os.read(self._r, 512):
                    pass
            except BlockingIOError:
                pass
        return fd is not None and fd in ready

    def close(self) -> None:
        if self.armed:
            signal.set_wakeup_fd(self._fd)
            signal.signal(signal.SIGCHLD, self._handler)
            self.armed = False
        os.close(self._r)
        os.close(self._w)

    @staticmethod
    def forget() -> None:
        """In a forked child: no wakeup pipe, default SIGCHLD (a child's exit would write to a pipe that
        is closed here, or the parent's)."""
        try:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        except ValueError:
            pass


def _ignore(signum: int, frame: object) -> None:
    """A Python-level handler, so that the signal writes to the wakeup pipe (it does nothing itself)."""


def become_subreaper() -> bool:
    """Adopt this process's orphaned descendants (Linux): a worker forked from the template (a child of a
    child of the template) is reparented to its agent, which then reaps it and reads its exit status."""
    prctl = _prctl()
    return prctl is not None and prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def child_env(env: dict[str, str] | None = None) -> dict[str, str]:
    """``env`` (default: this process's) with :data:`PARENT_ENV` naming this process."""
    return {**(os.environ if env is None else env), PARENT_ENV: str(os.getpid())}


def spawn(cmd: Sequence[str], *, log: Path, header: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new session, output appended to ``log`` after a ``header`` line.

    No Python runs in the child between fork and exec (the agent has threads);
    the child arms :func:`die_with_parent` itself from :data:`PARENT_ENV`.
    """
    log_line(log, header)
    with log.open("ab") as fh:
        return subprocess.Popen(list(cmd), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=child_env(env))


class ForkedChild:
    """A child this agent adopted (a worker forked from the template), with :class:`subprocess.Popen`'s
    ``pid``, ``returncode``, ``poll`` and ``wait``: the agent is its subreaper, so it reaps it like its own."""

    def __init__(self, pid: int, args: Sequence[str]) -> None:
        self.pid, self.args = pid, list(args)
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere, or never adopted: its status is lost
                self.returncode = -int(signal.SIGKILL)
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
            time.sleep(0.005)
        assert self.returncode is not None
        return self.returncode


Child = subprocess.Popen[bytes] | ForkedChild
"""A process an agent started: spawned (a ``Popen``) or forked from its template and adopted."""


def close_pipes(proc: subprocess.Popen[bytes]) -> None:
    """Close a child's stdin and stdout (each may already be closed or absent)."""
    for pipe in (proc.stdin, proc.stdout):
        try:
            if pipe is not None:
                pipe.close()
        except OSError:
            pass


def log_line(path: Path, line: str) -> None:
    """Append a ``--- <time> <line>`` header to a child's log (one per incarnation)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")


def send(proc: Child, sig: int) -> bool:
    """Send ``sig`` to the child's process group; ``False`` if it is already gone.

    A child that exited but is not reaped yet still holds its pid, so this
    never hits a recycled pid.
    """
    if proc.returncode is not None:
        return False
    try:
        os.killpg(proc.pid, sig)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        # The child left its group (setsid of its own): signal the process itself.
        try:
            os.kill(proc.pid, sig)
            return True
        except ProcessLookupError:
            return False


class LineBuffer:
    """Whole lines from a child's pipe (JSON, one per line): a line read in parts waits for its end."""

    def __init__(self) -> None:
        self.data = b""

    def line(self, fd: int, timeout_s: float) -> bytes | None:
        """The next whole line from ``fd`` (without its newline), or None when none came within ``timeout_s``
        or the writer closed its end."""
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self.data:
            ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                return None
            self.data += chunk
        line, _, self.data = self.data.partition(b"\n")
        return line


HANG_HOWS = frozenset({"heartbeat", "no progress", "lease expired", "startup_silent", "startup_deadline"})
"""Reasons of a fence that judge a process hung (it may be alive): its stacks are worth having."""
STACK_SIGNAL = signal.SIGUSR1
"""A worker writes every thread's Python stack to its log on this signal (``faulthandler.register``)."""
STACK_WAIT_S = 0.1
"""How long a fence waits for that dump before SIGKILL (the handler writes at once when it gets the CPU)."""


def dump_stacks(proc: Child) -> bool:
    """Ask a live child (not its group: a helper of its own would die of the signal) to write its threads'
    stacks to its log, and give it :data:`STACK_WAIT_S` to do so; ``False`` if it is already gone."""
    if proc.returncode is not None:
        return False
    try:
        os.kill(proc.pid, STACK_SIGNAL)
    except ProcessLookupError:
        return False
    time.sleep(STACK_WAIT_S)
    return True


def exit_status(returncode: int) -> tuple[int | None, int | None]:
    """``(exit code, signal number)`` of a reaped child; one of them is ``None``."""
    return (None, -returncode) if returncode < 0 else (returncode, None)


def describe_exit(returncode: int) -> str:
    code, sig = exit_status(returncode)
    if sig is not None:
        try:
            return f"killed by {signal.Signals(sig).name}"
        except ValueError:
            return f"killed by signal {sig}"
    return f"exit code {code}"


def stop_all(procs: Iterable[Child], *, grace_s: float) -> None:
    """SIGTERM every live child (SIGCONT too: a stopped one cannot act on it), SIGKILL after ``grace_s``."""
    procs = [p for p in procs if p.poll() is None]
    for p in procs:
        send(p, signal.SIGTERM)
        send(p, signal.SIGCONT)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            logger.warning("pid %d ignored SIGTERM for %.1f s: SIGKILL", p.pid, grace_s)
            send(p, signal.SIGKILL)
    for p in procs:
        try:
            p.wait(timeout=10.0)  # SIGKILL cannot be ignored; this only waits for the kernel
        except subprocess.TimeoutExpired:
            logger.error("pid %d survived SIGKILL for 10 s (uninterruptible sleep?)", p.pid)


def write_pid(path: Path, pid: int) -> None:
    """Atomically write a pid file (readers never see a partial number)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(f"{pid}\n")
    os.replace(tmp, path)


def remove_pid(path: Path, pid: int) -> None:
    """Remove a pid file if it still names ``pid`` (a newer incarnation may own it)."""
    try:
        if int(path.read_text().split()[0]) == pid:
            path.unlink()
    except (OSError, ValueError, IndexError):
        pass
