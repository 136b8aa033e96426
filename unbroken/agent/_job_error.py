"""A worker's death as the restore circuit breaker sees it: the job's own error, or a kill from outside.

The worker's entry point records an exception that ends it as the last line
of its event file (``worker_error``: the exception's type, message, and the
place it was raised, the innermost frame); its agent reads that line when it
reaps the process and puts the error's signature (``RuntimeError at
/path/file.py:41 in step``) into the worker's dead mark. A death by a signal
the process raises on itself (SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) is
an error too (``signal SIGSEGV``), and so is any other nonzero exit without
a record (``exit code 1``). A death by any other signal (SIGKILL, SIGTERM:
sent from outside, by an operator, the OOM killer, a scheduler, or this
agent's fencing), by silence (a heartbeat that stopped), or an exit that is
the consequence of another's failure (fenced, no live worker left, the store
lost) is not the job's error and has no signature.

An error about the data a worker read rather than the worker itself (its
snapshot memory damaged beyond what the restore's load rebuilds:
``SnapshotCorrupt``) is the job's error too, but never evidence against the
process it ran in (:func:`is_data_error`): two forked workers that fail to
load the same damaged memory say nothing about forking.

Invariant: a signature names what failed and where, never when or in whom, so
the same fault in two incarnations gives the same signature.
"""

from __future__ import annotations

import signal
import time
import traceback
from pathlib import Path

from unbroken.agent._run_files import last_worker_record
from unbroken.jsonl import JsonlWriter

__all__ = ["CONSEQUENCE_EXIT_CODES", "DATA_ERRORS", "SELF_SIGNALS", "death_error", "is_data_error", "record_error"]

SELF_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL})
"""Signals a process raises on itself when its own code fails (a crash in native code, an abort)."""
CONSEQUENCE_EXIT_CODES = frozenset({3, 4, 6, 7})
"""A worker's exits that follow from someone else's failure: fenced, no live worker left, the job store lost,
left to rejoin after a peer died mid-collective (:mod:`unbroken.runtime.worker`)."""
DATA_ERRORS = frozenset({"SnapshotCorrupt"})
"""Exception types that say the data a worker read was bad (:func:`is_data_error`), not the worker."""


def record_error(run_dir: Path, worker: int, exc: BaseException) -> None:
    """Append ``worker_error`` (type, message, place) to the worker's event file, just before it dies of ``exc``."""
    frames = traceback.extract_tb(exc.__traceback__)
    where = f"{frames[-1].filename}:{frames[-1].lineno} in {frames[-1].name}" if frames else "?"
    out = JsonlWriter(Path(run_dir) / "events" / f"w{worker}.jsonl")
    try:
        out.write({"kind": "event", "event": "worker_error", "worker": worker, "t": time.time(),
                   "error": type(exc).__name__, "where": where, "message": (str(exc).splitlines() or [""])[0][:300]})
    finally:
        out.close()


def death_error(run_dir: Path, worker: int, code: int | None, sig: int | None) -> str | None:
    """The signature of the job's own error that ended ``worker`` (exit ``code`` or signal ``sig``), or None
    when it was killed from outside, went silent, or left because of another's failure (module docstring)."""
    if sig is not None:
        return f"signal {signal.Signals(sig).name}" if sig in SELF_SIGNALS else None
    if not code or code in CONSEQUENCE_EXIT_CODES:
        return None
    last = last_worker_record(run_dir, worker)
    if last.get("event") == "worker_error":
        return f"{last.get('error')} at {last.get('where')}"
    return f"exit code {code}"



def is_data_error(error: str) -> bool:
    """Whether the signature ``error`` (:func:`death_error`) is of an exception about the data the worker read
    (:data:`DATA_ERRORS`): no sign that the way the worker was started is at fault."""
    return error.split(" ", 1)[0] in DATA_ERRORS
