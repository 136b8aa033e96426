"""``snapshot.every = auto``: the smallest snapshot interval that keeps pace, agreed by every worker.

Each worker measures what its snapshots cost (the seconds from the optimizer
step to the seal: staging off the device, coding, writing into shared memory)
and how long a step takes, and proposes the smallest interval ``n`` whose
``n`` steps cover its write with a margin and whose steps the snapshot costs at
most :data:`BUDGET` of (:meth:`Cadence.proposal`). What a snapshot costs the
training: on a CPU device the write's seconds (it takes cores from training
while it runs); on a GPU, whose host cores are otherwise idle, the measured
slowdown of the step that took it and the step after (queueing the copies, the
next optimizer step waiting on the device for them, the copies sharing the
device's memory bandwidth), against the median of the steps near no snapshot.
A worker whose last write is still in flight proposes :data:`VETO` ("not now").

The proposals travel in the step's gradient buffer, in :data:`VOTE_SLOTS`
float32 slots after the group weights (:class:`~unbroken.mecefo.gradients.GradLayout`,
``votes``): a proposal ``p`` sets its first ``p`` slots to 1 (:func:`cast`).
The all-reduce sums them, so slot ``i`` of the reduced buffer is nonzero iff
some worker proposed more than ``i``: the number of nonzero slots is the
largest proposal (:func:`tally`), the same on every member because every
member applies the same reduced buffer. The snapshot after step ``s`` is due
iff that largest proposal ``n`` is not the veto and ``s % n == 0``
(:func:`due`). Nothing is kept between steps: a joiner, a restored job and a
worker that just started decide like everyone else, from the step's buffer.

The slowest writer sets the interval; an in-flight write skips a snapshot
rather than stalling the step. The recovery point: a whole-job failure goes
back to the newest snapshot sealed on every node, at most ``2 n`` steps
behind (the newest one may still be written when the failure comes).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from typing import Literal

import torch

__all__ = ["BUDGET", "MARGIN", "VETO", "VOTE_SLOTS", "Cadence", "StepRole", "auto", "cast", "due", "enabled",
           "tally"]

VOTE_SLOTS = 64
"""Slots of the gradient buffer that carry the proposals: intervals 1 .. VOTE_SLOTS - 1, and the veto."""
VETO = VOTE_SLOTS
"""The proposal of a worker whose last snapshot is still being written: no snapshot this step."""
MARGIN = 1.25
"""A write must fit in ``n`` steps with this much to spare (step times and writes vary)."""
BUDGET = 0.02
"""A snapshot may cost the training at most this share of the steps of its interval."""
LOWER = 0.7
"""A proposal comes down only once the need is at most this share of it (no flapping between neighbours)."""
COSTS = 3
"""Snapshots whose cost to their steps was measured, kept; a cost is taken as their median, and only once there
are this many (one slow step, a pause or a validation run after a snapshot, must not set the interval)."""
BASELINE_STEPS = 3
"""Steps near no snapshot needed before a snapshot's cost to its steps is measured (below an interval of 3 there
are none: then the write is at most about two steps long, and a copy off a GPU costs a small part of it)."""

StepRole = Literal["plain", "taken", "after"]
"""A step's place relative to the snapshots: ``taken`` (a snapshot of its state was started at its end),
``after`` (the step after one, not itself taking one) or ``plain``."""


def enabled(every: int | str) -> bool:
    """Does ``snapshot.every`` ask for snapshots (``auto`` or a positive interval)?"""
    return every == "auto" or (isinstance(every, int) and every > 0)


def auto(cfg: object) -> bool:
    """Does the run of ``cfg`` pick its snapshot interval itself (``snapshot.every=auto``, snapshots taken)?"""
    return cfg.snapshot.every == "auto"  # type: ignore[attr-defined]


def cast(slots: torch.Tensor, proposal: int) -> None:
    """Write ``proposal`` (1 .. VETO) into this worker's vote ``slots`` of its gradient buffer."""
    if not 1 <= proposal <= VETO:
        raise ValueError(f"snapshot interval proposal {proposal} outside 1..{VETO}")
    slots.zero_()
    slots[:proposal] = 1.0


def tally(slots: torch.Tensor) -> int:
    """The largest proposal of a reduced buffer's vote ``slots`` (0: nobody proposed)."""
    return int((slots > 0).sum())


def due(done: int, largest: int) -> bool:
    """Is the snapshot after ``done`` steps due under the largest proposal ``largest``?"""
    return 0 < largest < VETO and done % largest == 0


class Cadence:
    """One worker's measurements and proposal.

    Args:
        window: how many recent steps and writes the proposal looks at.
        shares_cores: the write runs on the cores that train (a CPU device): each write's seconds are its
            cost to the steps; else (a GPU) its cost is the measured slowdown of the steps around it.
    """

    def __init__(self, window: int = 8, *, shares_cores: bool = False) -> None:
        self.shares_cores = shares_cores
        self.steps: deque[float] = deque(maxlen=window)
        self.writes: deque[float] = deque(maxlen=max(2, window // 2))
        self.plain: deque[float] = deque(maxlen=window)
        """Recent steps near no snapshot: the baseline of a snapshot's cost."""
        self.costs: deque[float] = deque(maxlen=COSTS)
        """Recent snapshots' seconds of slowdown to the step that took them and the next (GPU)."""
        self.interval = 0
        """The interval last decided (0 before the first decision)."""
        self._held = 1
        self._taken: float | None = None

    def observe_step(self, seconds: float, role: StepRole = "plain") -> None:
        """A step's seconds, and where it lies relative to the snapshots (a ``taken`` step followed by an
        ``after`` step gives one measure of a snapshot's cost, against the median ``plain`` step)."""
        if not (seconds > 0 and math.isfinite(seconds)):
            return
        self.steps.append(seconds)
        if role == "plain":
            self.plain.append(seconds)
        taken, self._taken = self._taken, seconds if role == "taken" else None
        # measured once the writes are steady: the first snapshots allocate their buffers
        if role == "after" and taken is not None and self.writes and len(self.plain) >= BASELINE_STEPS:
            self.costs.append(taken + seconds - 2 * statistics.median(self.plain))

    @property
    def cost(self) -> float | None:
        """A snapshot's seconds of cost to the training: the write's (a CPU device), else the median measured
        slowdown of its two steps over the last :data:`COSTS` snapshots (None until that many were measured)."""
        if self.shares_cores:
            return max(self.writes) if self.writes else None
        return max(0.0, statistics.median(self.costs)) if len(self.costs) == COSTS else None

    def observe_write(self, seconds: float) -> None:
        """A steady write's seconds (not one that allocated its buffers or first touched its memory)."""
        if seconds >= 0 and math.isfinite(seconds):
            self.writes.append(seconds)

    def proposal(self, in_flight: bool) -> int:
        """The veto while a write is in flight; 1 before any write was measured (take one, to measure it);
        else the smallest ``n`` with ``MARGIN * write <= n * step`` (the slowest recent write, the median
        step) and ``cost <= BUDGET * n * step`` (:attr:`cost`, once measured; on a GPU ``step`` is the median
        step near no snapshot); at most ``VETO - 1``; raised at once, lowered only when the need falls to
        ``LOWER`` of it."""
        if in_flight:
            return VETO
        if not self.writes or not self.steps:
            return 1
        write, step, cost = max(self.writes), statistics.median(self.steps), self.cost
        need = MARGIN * write / step
        if cost is not None:  # on a GPU a share of the steps as they are without a snapshot (measured with it)
            need = max(need, cost / (BUDGET * (step if self.shares_cores else statistics.median(self.plain))))
        need = max(1, min(VETO - 1, math.ceil(need)))
        if need > self._held or need <= LOWER * self._held:  # up at once, down only by a clear margin
            self._held = need
        return self._held
