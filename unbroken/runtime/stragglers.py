"""Stragglers ridden through: a persistently slow worker gets fewer rows, the others more, in the same step.

Every worker measures its compute time per row of each step (the seconds from its first forward to its
last backward over the rows it computed) and writes it into its slot of the reduction buffer's timings
(:meth:`~unbroken.mecefo.gradients.GradLayout.timings`: one float per worker, every other member writes
0), so the step's one all-reduce hands every member the same vector, with nothing more sent. Each member
feeds the vectors of the steps its view committed to one :class:`Stragglers` and asks it, before the next
step, how many rows of each home slot a slow worker keeps (:meth:`Stragglers.keep`); the rows it gives up
go to the others, exact (:func:`~unbroken.mecefo.takeover.rebalance`). The decision is a pure function of
the vectors since the view began, and every member of a view has seen the same ones (a joiner enters at a
view's first step; a view change starts over), so every member computes the same assignment and the
ledger keeps every ``(step, slot, row)`` once.

Rule, with ``factor`` F and ``steps`` N (``fault.straggler_factor``, ``fault.straggler_steps``):

- a view's first N committed steps are not counted (a joiner's first steps in its process pay for its
  allocations and caches, several times a step's compute: counted, they would flag every replacement);
- a worker's time per row is smoothed (an exponential mean over about N steps) and compared with the
  median of the live workers' smoothed times;
- a worker above F times the median for N committed steps in a row is *slow*; a slow worker at or below
  ``(1 + F) / 2`` times the median for N steps in a row is not slow any more (hysteresis);
- a slow worker keeps, of each home slot's ``micro_batch`` rows, its share of the step's rows in
  proportion to its speed (all workers finishing at once), at least 1 row (so it is still measured);
  the others share the rest evenly.

Events (the view's leader writes them): ``straggler`` when a worker turns slow (its ratio to the median,
the rows it keeps per slot), ``straggler_end`` when it is not slow any more, with the steps and rows moved.
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Callable, Protocol, Sequence

import torch

__all__ = ["Episode", "Stragglers", "Timings"]


class Timings(Protocol):
    """Where a reduction buffer carries the workers' timings (:class:`~unbroken.mecefo.gradients.GradLayout`)."""

    def timings(self, buf: torch.Tensor) -> torch.Tensor: ...

    def host_timings(self, buf: torch.Tensor) -> list[float]: ...


@dataclasses.dataclass
class Episode:
    """A worker's time as a straggler: from ``start`` (a step), ``rows_moved`` rows handed to the others."""

    worker: int
    start: int
    keep: int
    ratio: float
    rows_moved: int = 0
    since_s: float = 0.0
    """When this member found it slow (its own monotonic clock)."""


class Stragglers:
    """The straggler decision of one member (the same in every member of a view: see the module docstring).

    Args:
        n_workers: the job's workers.
        n_slots: slots per step.
        micro_batch: rows per slot.
        factor: ``F`` (> 1).
        steps: ``N`` (>= 1).
        on_event: ``on_event(name, **fields)`` for the view leader's events (None: none).
        buffers: where the reduction buffers carry the timings (None: :meth:`stamp` and :meth:`reduced` are
            not used; :meth:`observe` is given the vectors).
        replace_s: a straggler this many seconds is replaced (the step protocol acts on it; 0: never).
    """

    def __init__(self, *, n_workers: int, n_slots: int, micro_batch: int, factor: float, steps: int,
                 on_event: Callable[..., None] | None = None, buffers: Timings | None = None,
                 replace_s: float = 0.0) -> None:
        if not factor > 1 or steps < 1:
            raise ValueError(f"straggler factor {factor} must be > 1 and steps {steps} >= 1")
        self.n_workers, self.n_slots, self.micro_batch = n_workers, n_slots, micro_batch
        self.factor, self.steps, self.on_event, self.buffers = factor, steps, on_event, buffers
        self.replace_s = replace_s
        """A straggler this long leaves the job and is replaced (``fault.straggler_replace_s``; 0: never)."""
        self.release = (1.0 + factor) / 2.0
        self._alpha = 2.0 / (steps + 1.0)
        self.gen: int | None = None
        self.warm = 0
        """The current view's committed steps seen, up to ``steps`` (until then none is counted)."""
        self.mean: dict[int, float] = {}
        self.above: dict[int, int] = {}
        self.below: dict[int, int] = {}
        self.slow: dict[int, Episode] = {}

    def stamp(self, buf: torch.Tensor, me: int, seconds: float, rows: int) -> None:
        """Before the reduction: ``me`` computed ``rows`` rows in ``seconds`` (written as its timing)."""
        assert self.buffers is not None
        timings = self.buffers.timings(buf)
        timings.zero_()
        if rows > 0:
            timings[me] = seconds / rows

    def reduced(self, gen: int, step: int, members: Sequence[int], buf: torch.Tensor, *, leader: bool) -> None:
        """Step ``step`` of view ``gen`` committed with reduced ``buf``: :meth:`observe` its timings."""
        assert self.buffers is not None
        self.observe(gen, step, members, self.buffers.host_timings(buf), leader=leader)

    def _reset(self, gen: int, step: int, leader: bool) -> None:
        for ep in list(self.slow.values()):
            self._end(ep, step, leader, "view change")
        self.gen, self.warm, self.mean, self.above, self.below, self.slow = gen, 0, {}, {}, {}, {}

    def keep(self, gen: int, members: Sequence[int]) -> dict[int, int]:
        """Rows per home slot each slow member of view ``gen`` keeps next step (others: all, not listed)."""
        if gen != self.gen:
            return {}
        return {w: ep.keep for w, ep in self.slow.items() if w in members}

    def observe(self, gen: int, step: int, members: Sequence[int], per_row: Sequence[float], *,
                leader: bool) -> None:
        """Step ``step`` of view ``gen`` committed; ``per_row``: the reduced timings (seconds per row by worker;
        0: the worker computed nothing or is not a member)."""
        if gen != self.gen:
            self._reset(gen, step, leader)
        if self.warm < self.steps:
            self.warm += 1
            return
        live = [w for w in members if per_row[w] > 0]
        for w in live:
            x = float(per_row[w])
            self.mean[w] = x if w not in self.mean else self.mean[w] + self._alpha * (x - self.mean[w])
        for ep in self.slow.values():
            ep.rows_moved += (self.micro_batch - ep.keep) * len(range(ep.worker, self.n_slots, self.n_workers))
        if len(live) < 2:
            return
        median = statistics.median(self.mean[w] for w in live)
        if median <= 0:
            return
        for w in live:
            ratio = self.mean[w] / median
            if w not in self.slow:
                self.above[w] = self.above.get(w, 0) + 1 if ratio > self.factor else 0
                if self.above[w] >= self.steps:
                    self.below[w] = 0
                    self.slow[w] = Episode(worker=w, start=step + 1, keep=0, ratio=ratio, since_s=time.monotonic())
                    if leader and self.on_event is not None:
                        self.on_event("straggler", slow=w, step=step + 1, gen=gen, ratio=round(ratio, 3))
            else:
                self.below[w] = self.below.get(w, 0) + 1 if ratio <= self.release else 0
                if self.below[w] >= self.steps:
                    self.above[w] = 0
                    self._end(self.slow.pop(w), step + 1, leader, "caught up")
        self._shares(live)

    def slow_for_s(self, worker: int) -> float | None:
        """How long ``worker`` has been a straggler (by this member's clock), or None: it is not one."""
        ep = self.slow.get(worker)
        return None if ep is None else time.monotonic() - ep.since_s

    def _shares(self, live: Sequence[int]) -> None:
        """Each slow worker's rows per home slot: its share of the step in proportion to its speed."""
        if not self.slow:
            return
        speed = {w: 1.0 / self.mean[w] for w in live}
        fast = statistics.median(speed[w] for w in live if w not in self.slow) if len(self.slow) < len(live) \
            else max(speed.values())
        for w in live:  # workers not slow count at the median speed of their kind: they share evenly
            if w not in self.slow:
                speed[w] = fast
        total = sum(speed.values())
        rows = self.n_slots * self.micro_batch
        for w, ep in self.slow.items():
            if w not in speed:
                continue
            homes = len(range(w, self.n_slots, self.n_workers))
            share = rows * speed[w] / total / max(1, homes)
            ep.keep = max(1, min(self.micro_batch, int(share)))

    def _end(self, ep: Episode, step: int, leader: bool, why: str) -> None:
        if leader and self.on_event is not None:
            self.on_event("straggler_end", slow=ep.worker, step=step, since=ep.start, steps=step - ep.start,
                          rows_moved=ep.rows_moved, why=why)
