"""Where a worker's start went: the time of each phase from its process's birth to its first step.

A cold start (a restarted worker, a replacement node's) is mostly invisible in
the logs: the interpreter and imports before the first line, the data, the
model, then the wait to be admitted and the state's load. :class:`StartClock`
marks each phase's end; the worker writes them as one ``start_phases`` event
(seconds per phase, and the whole) when it is about to train, so a report can
show where a slow start went.

Phases: ``process`` (from the kernel's start of the process to the clock's
creation: interpreter and imports), then those the worker marks (``config``,
``store``, ``data``, ``model``, ``job``, ``compile_cache``, ``approx_compile``,
``admission``). ``approx_compile`` is the compile of MeCeFO's approximate
graphs at the start (:mod:`unbroken.mecefo.warm_up`): a job that compiles
under a policy that approximates pays it here, before its first step, instead
of in a takeover.
"""

from __future__ import annotations

import os
import time

__all__ = ["StartClock", "process_age_s"]


def process_age_s() -> float | None:
    """Seconds since the kernel started this process (Linux ``/proc``; None elsewhere)."""
    try:  # both counted from boot: the process's start in clock ticks, the uptime in seconds (10 ms)
        with open("/proc/self/stat") as fh:
            start_ticks = int(fh.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as fh:
            uptime = float(fh.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


class StartClock:
    """Phase marks of one start, in seconds."""

    def __init__(self) -> None:
        self._last = time.perf_counter()
        age = process_age_s()
        self.phases: dict[str, float] = {"process": round(age, 3)} if age is not None else {}

    def mark(self, phase: str) -> None:
        """End ``phase`` now (its time is what passed since the previous mark)."""
        now = time.perf_counter()
        self.phases[phase] = round(self.phases.get(phase, 0.0) + now - self._last, 3)
        self._last = now

    def summary(self) -> dict[str, object]:
        return {"phases": dict(self.phases), "total_s": round(sum(self.phases.values()), 3)}
