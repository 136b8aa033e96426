"""When a node's dead workers come back: the restart policy, the crash-loop guard and the restarts pending.

An object the agent holds (:attr:`unbroken.agent.agent.Agent.restarts`); it decides and remembers, the agent
starts. A worker that left healthy only to come back with the state (a rejoin) is started again at once
whatever the policy; otherwise ``never`` starts nobody and, under ``on-failure``, an outage of a fault trace
brings the worker back at the step it ends (never when that is past the run's last step), and any other death
after the delay.

Invariants: at most one restart is pending per worker (a later decision replaces it); a worker that crashed
by itself (an exit code or a signal of its own, not a SIGKILL, a fence or an injected fault)
``MAX_FAST_CRASHES`` times in a row, each within ``FAST_CRASH_S`` of its start, is not started again (a crash
loop: its log says why); any other death resets that count.
"""

from __future__ import annotations

import logging
from pathlib import Path

from unbroken.agent._supervision import Restart
from unbroken.agent.options import RESTART_POLICIES

__all__ = ["FAST_CRASH_S", "MAX_FAST_CRASHES", "Restarts"]

FAST_CRASH_S = 10.0
"""A crash this soon after the worker's start counts towards a crash loop."""
MAX_FAST_CRASHES = 5
"""Fast crashes in a row after which a worker is not started again."""


class Restarts:
    """The restarts this node's agent has decided and not yet carried out."""

    def __init__(self, *, policy: str, delay_s: float, log: logging.Logger | logging.LoggerAdapter,
                 logs_dir: Path) -> None:
        if policy not in RESTART_POLICIES:
            raise ValueError(f"restart policy {policy!r}: expected one of {', '.join(RESTART_POLICIES)}")
        self.policy, self.delay_s, self.log, self.logs_dir = policy, delay_s, log, logs_dir
        self.pending: dict[int, Restart] = {}
        self.fast_crashes: dict[int, int] = {}

    def schedule(self, w: int, *, now: float, started: float, crashed: bool, back_step: int | None,
                 total_steps: int, rejoin: bool = False) -> Restart | None:
        """Decide when worker ``w``, started at ``started`` and dead at ``now`` (monotonic), comes back; None:
        not. ``crashed``: by its own failing (module docstring); ``back_step``: the step its outage ends (a
        fault trace's), None when it has none; ``rejoin``: it left healthy to come back with the state."""
        if rejoin:
            r = self.pending[w] = Restart(at_time=now)
            return r
        if self.policy == "never":
            return None
        if crashed and now - started < FAST_CRASH_S:
            self.fast_crashes[w] = self.fast_crashes.get(w, 0) + 1
            if self.fast_crashes[w] >= MAX_FAST_CRASHES:
                self.log.error("worker %d crashed %d times within %.0f s of starting: not restarting it; see %s",
                               w, self.fast_crashes[w], FAST_CRASH_S, self.logs_dir / f"w{w}.log")
                return None
        else:
            self.fast_crashes[w] = 0
        if back_step is not None:
            if back_step >= total_steps:
                return None  # back only when the run is over (an outage cut at the end of a trace)
            r = Restart(at_step=back_step)
        else:
            r = Restart(at_time=now + self.delay_s)
        self.pending[w] = r
        return r

    def due(self, *, now: float, progress: int) -> list[int]:
        """The workers whose restart is due at ``now`` with the job at step ``progress``, taken off the list."""
        due = [w for w, r in self.pending.items()
               if (r.at_step is not None and progress >= r.at_step) or (r.at_time is not None and now >= r.at_time)]
        for w in due:
            del self.pending[w]
        return due

    def cancel(self, w: int) -> None:
        """``w`` is started otherwise (a restore names it): its pending restart, if any, is dropped."""
        self.pending.pop(w, None)

    def clear(self) -> None:
        """The job is done: nobody is started again."""
        self.pending.clear()

    def waits_for_a_step(self) -> bool:
        """A pending restart fires at a step still to come."""
        return any(r.at_step is not None for r in self.pending.values())

    def __len__(self) -> int:
        return len(self.pending)
