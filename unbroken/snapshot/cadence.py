"""``snapshot.every = auto``: the smallest snapshot interval that keeps pace, agreed by every worker.

Each worker measures what its snapshots cost (the seconds from the optimizer
step to the seal: staging off the device, coding, writing into shared memory)
and how long a step takes, and proposes the smallest interval ``n`` whose
``n`` steps cover its write with a margin and, on a CPU device (where the
write takes cores from training), whose steps the write costs at most
:data:`BUDGET` of (:meth:`Cadence.proposal`). A worker
whose last write is still in flight proposes :data:`VETO` ("not now").

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

import torch

__all__ = ["BUDGET", "MARGIN", "VETO", "VOTE_SLOTS", "Cadence", "auto", "cast", "due", "enabled", "tally"]

VOTE_SLOTS = 64
"""Slots of the gradient buffer that carry the proposals: intervals 1 .. VOTE_SLOTS - 1, and the veto."""
VETO = VOTE_SLOTS
"""The proposal of a worker whose last snapshot is still being written: no snapshot this step."""
MARGIN = 1.25
"""A write must fit in ``n`` steps with this much to spare (step times and writes vary)."""
BUDGET = 0.02
"""Where the write competes with training for the same cores (a CPU device), its seconds may cost at most
this share of the steps it covers."""
LOWER = 0.7
"""A proposal comes down only once the need is at most this share of it (no flapping between neighbours)."""


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
        shares_cores: the write runs on the cores that train (a CPU device): each write's seconds are a cost
            to the steps, kept within :data:`BUDGET` of them; on a GPU the host's cores are otherwise idle
            and only the fit counts.
    """

    def __init__(self, window: int = 8, *, shares_cores: bool = False) -> None:
        self.shares_cores = shares_cores
        self.steps: deque[float] = deque(maxlen=window)
        self.writes: deque[float] = deque(maxlen=max(2, window // 2))
        self.interval = 0
        """The interval last decided (0 before the first decision)."""
        self._held = 1

    def observe_step(self, seconds: float) -> None:
        if seconds > 0 and math.isfinite(seconds):
            self.steps.append(seconds)

    def observe_write(self, seconds: float) -> None:
        """A steady write's seconds (not one that allocated its buffers or first touched its memory)."""
        if seconds >= 0 and math.isfinite(seconds):
            self.writes.append(seconds)

    def proposal(self, in_flight: bool) -> int:
        """The veto while a write is in flight; 1 before any write was measured (take one, to measure it);
        else the smallest ``n`` with ``MARGIN * write <= n * step`` (the slowest recent write, the median
        step) and, where the write shares the training's cores, ``write <= BUDGET * n * step``; at most
        ``VETO - 1``; raised at once, lowered only when the need falls to ``LOWER`` of it."""
        if in_flight:
            return VETO
        if not self.writes or not self.steps:
            return 1
        write, step = max(self.writes), statistics.median(self.steps)
        need = MARGIN * write / step
        if self.shares_cores:
            need = max(need, write / (BUDGET * step))
        need = max(1, min(VETO - 1, math.ceil(need)))
        if need > self._held or need <= LOWER * self._held:  # up at once, down only by a clear margin
            self._held = need
        return self._held
