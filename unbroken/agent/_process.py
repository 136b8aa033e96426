"""Child processes of an agent: spawned in their own session, signalled, stopped, never leaked.

Invariants: every child runs in its own session (process group id == pid), so
a signal to the group reaches the child and whatever it started, and a
terminal's Ctrl-C reaches only the agent, which then stops its children; on
Linux every child receives SIGKILL when the agent dies (``PR_SET_PDEATHSIG``),
so even a SIGKILLed agent (a lost node) leaves nothing behind; :func:`stop_all`
returns only once every child is reaped.
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Iterable, Sequence

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _die_with_parent() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child die with this process (Linux only)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    parent = os.getpid()
    sigkill = int(signal.SIGKILL)

    def setup() -> None:
        prctl(_PR_SET_PDEATHSIG, sigkill, 0, 0, 0)
        # The parent may have died between fork and prctl: then nobody would kill us.
        if os.getppid() != parent:
            os._exit(1)

    return setup


def spawn(cmd: Sequence[str], *, log: Path, header: str, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    """Start ``cmd`` in a new session, output appended to ``log`` after a ``header`` line.

    The agent must be single-threaded when it calls this: the child runs a
    ``preexec_fn`` between fork and exec.
    """
    log_line(log, header)
    with log.open("ab") as fh:
        return subprocess.Popen(
            list(cmd), stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
            start_new_session=True, preexec_fn=_die_with_parent(), env=env,
        )


def log_line(path: Path, line: str) -> None:
    """Append a ``--- <time> <line>`` header to a child's log (one per incarnation)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fh.write(f"--- {time.strftime('%Y-%m-%d %H:%M:%S')} {line}\n")


def send(proc: subprocess.Popen[bytes], sig: int) -> bool:
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


def stop_all(procs: Iterable[subprocess.Popen[bytes]], *, grace_s: float) -> None:
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
