"""Preemption: a scheduler's warning signal stops the job after an agreed step, with a final checkpoint.

The first SIGTERM or SIGUSR1 to an agent (or to the launcher) asks the job to stop
(:meth:`~unbroken.store.job_store.JobStore.request_stop`); the view's leader agrees the step every member stops
after (the step in flight: a compare-and-set in the store just before it posts the step's reduction), writes the final checkpoint as at the
job's end and sets ``done``. Every agent then exits with :data:`EXIT_PREEMPTED` and the launcher says so: the
job is requeued and continues with ``--resume``. A second signal, or no final checkpoint within the agent's
``--preempt-grace-s``, stops at once as before (``128 + signal``).

A process that ran the command line of a preempted job (the launcher of ``unbroken train``, an ``unbroken agent``)
leaves at once once it said so (:func:`leave_at_once`): a scheduler's grace is counted in seconds, and the
interpreter's teardown of a process that imported torch costs about half a CPU second, seconds on a busy node.

Invariants: a preempted job ends with a committed checkpoint of the step every member stopped after, and a
resumed run trains exactly the rows it had not (the ledger is exactly-once over both runs).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from pathlib import Path
from types import FrameType
from typing import Any, NoReturn

__all__ = ["EXIT_PREEMPTED", "PREEMPT_SIGNALS", "PreemptSignals", "leave_at_once", "preempted_message"]

EXIT_PREEMPTED = 75
"""A preempted job's exit code (``EX_TEMPFAIL``: requeue it and ``--resume``)."""
PREEMPT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


def preempted_message(run_dir: Path, steps: int) -> str:
    """What an agent and the launcher say when the job stopped after ``steps`` steps on a preemption."""
    return (f"preempted: the job stopped after step {steps} with its final checkpoint committed; requeue and "
            f"`--resume` (unbroken train --resume {run_dir}, or the requeued examples/slurm/train.sbatch)")


def leave_at_once(code: int) -> NoReturn:
    """End this process with ``code`` now: log handlers and standard streams flushed, the interpreter's teardown
    skipped (module docstring). Only for a process whose work is all on disk: the checkpoint is committed and
    fsynced, the run's summary written, every child gone."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class PreemptSignals:
    """The launcher's handlers (its main thread only): the first SIGTERM or SIGUSR1 is recorded in
    :attr:`signum` for its loop to ask the job to stop; the previous handlers come back at once, so a second
    signal acts as before."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> PreemptSignals:
        if threading.current_thread() is threading.main_thread():
            self._previous = {s: signal.signal(s, self._on_signal) for s in PREEMPT_SIGNALS}
        return self

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.signum = signum
        self._restore()

    def _restore(self) -> None:
        previous, self._previous = self._previous, {}
        for s, h in previous.items():
            signal.signal(s, h)

    def __exit__(self, *exc: object) -> None:
        self._restore()
