"""When the view's leader writes a persistent checkpoint: by steps, by time, and at the end.

Three rules, any of which makes a step's checkpoint due: every
``train.checkpoint_every`` steps, once ``train.checkpoint_every_s`` seconds
have passed since the last checkpoint, and after the last step. Every member
runs the schedule on its own clock (only the leader writes), so a member that
takes the lead goes on in step with the one before; a worker that joins
counts from the newest committed checkpoint on disk (or its own start).
A checkpoint due by time only is put off while the previous save is still
being written: the leader never waits for the disk for it.

Invariants: the step rule and the last step give the same answer on every
member (a sharded run, whose members each write their range of the moments,
uses only those: ``every_s`` is 0 there); the time rule never fires twice
within ``every_s`` seconds on one member.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Literal

from unbroken.checkpoint.files import COMMIT_FILE, committed_checkpoints

__all__ = ["CheckpointSchedule", "Due", "newest_checkpoint_age_s"]

Due = Literal["step", "time"]


class CheckpointSchedule:
    """The checkpoint rules of one worker (module docstring).

    Args:
        every: checkpoint every this many steps (0: not by steps).
        every_s: checkpoint once this many seconds passed since the last (0: not by time).
        steps: the run's last step (always checkpointed).
        age_s: how long ago the last checkpoint was taken (0: count from now).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, *, every: int, every_s: float, steps: int, age_s: float = 0.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if every < 0 or every_s < 0:
            raise ValueError(f"checkpoint_every={every}, checkpoint_every_s={every_s}: must be >= 0")
        self.every, self.every_s, self.steps, self.clock = every, every_s, steps, clock
        self.last = clock() - max(0.0, age_s)

    def due(self, done: int) -> Due | None:
        """Why the state after ``done`` steps is checkpointed: ``"step"`` (the step rule or the last step),
        ``"time"`` (``every_s`` passed), or None."""
        if (self.every and done % self.every == 0) or done == self.steps:
            return "step"
        if self.every_s and self.clock() - self.last >= self.every_s:
            return "time"
        return None

    def taken(self) -> None:
        """A checkpoint was taken now (by this worker, or by the leader it follows): the time rule restarts."""
        self.last = self.clock()


def newest_checkpoint_age_s(run_dir: Path) -> float:
    """Seconds since the newest committed checkpoint of the run was committed (0 when there is none)."""
    found = committed_checkpoints(Path(run_dir) / "checkpoints")
    if not found:
        return 0.0
    try:
        return max(0.0, time.time() - (found[0] / COMMIT_FILE).stat().st_mtime)
    except OSError:
        return 0.0
