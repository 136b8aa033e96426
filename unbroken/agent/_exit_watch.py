"""A child's death seen when the kernel starts tearing it down, not when its parent is told.

SIGCHLD, ``waitpid`` and a pidfd all report a process only once its exit is
complete: the kernel first unmaps its memory and closes its files (``exit_mm``
and ``exit_files`` run before ``exit_notify``, which makes the process a
zombie, wakes a pidfd's pollers and signals the parent). A GPU worker holds
tens of GB of shared and pinned mappings and a CUDA context: its teardown took
3.1 s on an H200, during which nobody knew it was dead. A child holding 4 GB of
populated shared memory and SIGKILLed, on the CPU: ``/proc/<pid>/stat`` shows
it exiting within a millisecond; a pidfd and ``waitid`` only 0.17 s later
(0.32 s for 4 GB of anonymous memory). A pidfd is therefore no earlier than the
SIGCHLD the agent already wakes on.

What is read: the main thread's flags (``PF_EXITING``, set as soon as it enters
the kernel's exit, before any teardown), its state (``Z``/``X`` once it is a
zombie) and its exit code (fields 9, 3 and 52 of ``/proc/<pid>/stat``; the
exit code is set before the teardown too: 9 for a SIGKILL, ``n << 8`` for
``exit(n)``).

Invariants: only a child of the caller that is not yet reaped is asked about
(its pid cannot be reused until the caller reaps it); an exit with status 0 is
not reported early (the main thread alone may end so while the others run on),
so a clean exit is still known only when it is reaped; where ``/proc`` cannot
be read, nothing is reported early.
"""

from __future__ import annotations

import os

__all__ = ["PF_EXITING", "exiting_returncode"]

PF_EXITING = 0x4
"""The kernel's task flag of a thread inside its exit (``include/linux/sched.h``)."""


def _stat(pid: int) -> tuple[str, int, int] | None:
    """``(state, flags, exit code)`` of the process's main thread, or None (no ``/proc``, gone, an old kernel)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rpartition(b")")[2].split()
        return fields[0].decode(), int(fields[6]), int(fields[49])
    except (OSError, ValueError, IndexError):
        return None


def exiting_returncode(pid: int) -> int | None:
    """The return code (as :attr:`subprocess.Popen.returncode`: ``-signal`` or the exit status) of child ``pid``
    once it is exiting with a non-zero status, before it can be reaped; None while it runs, exits cleanly, or
    cannot be told."""
    seen = _stat(pid)
    if seen is None:
        return None
    state, flags, code = seen
    if not (flags & PF_EXITING or state in ("Z", "X", "x")) or code == 0:
        return None
    try:
        return os.waitstatus_to_exitcode(code)
    except ValueError:  # a status waitpid would not give (a stopped or continued one): not an exit
        return None
