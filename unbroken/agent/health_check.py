"""A node's health check: ``--health-check CMD``, run by its agent before it starts workers.

An agent runs the command (a shell command line: ``nvidia-smi``, ``dcgmi diag -r 1``, a site's own script)
once it holds its node rank and before it starts any worker; a spare node runs it once it took a lost node's
rank, before it starts that node's workers. A non-zero exit, or a hang past ``--health-check-timeout-s``
(the command and everything it started are killed), keeps the node out: the agent writes the command's
output in a ``health_check`` event, gives the rank back (a spare may take it) and exits refusing to start.

Invariants: the check is bounded by its timeout plus the kill; its output is kept (the last
:data:`OUTPUT_CHARS` characters) whatever it wrote; nothing it started outlives it (its own session,
killed as a group).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import time
from typing import Any, Protocol

__all__ = ["OUTPUT_CHARS", "HealthCheck", "check_node", "run_health_check"]

logger = logging.getLogger(__name__)

OUTPUT_CHARS = 4000
"""How much of the command's output (its end) the event keeps."""
KILL_WAIT_S = 10.0
"""How long the output of a killed check is waited for (its pipe closes with the killed group)."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class HealthCheck:
    """One run of the health check."""

    command: str
    ok: bool
    code: int | None
    """Its exit status (negative: a signal); None when it hung and was killed."""
    hung: bool
    seconds: float
    output: str

    def describe(self) -> str:
        """Why the node stays out, in a line."""
        if self.hung:
            return f"--health-check {self.command!r} did not finish within its timeout and was killed"
        return f"--health-check {self.command!r} exited with code {self.code}"


class _Events(Protocol):
    def __call__(self, event: str, worker: int | None, **fields: Any) -> None: ...


def check_node(command: str | None, timeout_s: float, events: _Events, *, spare: bool) -> HealthCheck | None:
    """Run the node's health check (None: there is none) and write its ``health_check`` event (``spare``: run
    by a spare that took the node's rank)."""
    if command is None:
        return None
    check = run_health_check(command, timeout_s)
    events("health_check", None, ok=check.ok, command=check.command, code=check.code, hung=check.hung,
           seconds=round(check.seconds, 3), output=check.output, spare=spare)
    if not check.ok:
        logger.error("%s: the node stays out; its output:\n%s", check.describe(), check.output.rstrip())
    return check


def run_health_check(command: str, timeout_s: float) -> HealthCheck:
    """Run ``command`` in a shell, its stdout and stderr together, killed (with all it started) after
    ``timeout_s``."""
    t0 = time.monotonic()
    proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            stdin=subprocess.DEVNULL, start_new_session=True)
    hung = False
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        hung = True
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        try:
            out, _ = proc.communicate(timeout=KILL_WAIT_S)
        except subprocess.TimeoutExpired:  # a descendant left the group and holds the pipe: give up its output
            proc.kill()
            proc.wait(timeout=KILL_WAIT_S)
            out = b""
    text = out.decode(errors="replace")[-OUTPUT_CHARS:]
    code = None if hung else proc.returncode
    return HealthCheck(command=command, ok=code == 0, code=code, hung=hung, seconds=time.monotonic() - t0,
                       output=text)
