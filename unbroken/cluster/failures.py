"""The failure process of the cluster simulator: seeded Poisson arrivals of crashes, hangs, node and job losses.

Model (every assumption, stated)
--------------------------------
* A job of ``G`` data-parallel workers (each one replica: one GPU, or a
  model-parallel group counted as one), ``workers_per_node`` to a node. Worker
  ``i`` is on node ``i // workers_per_node``.
* Failures arrive as a Poisson process in wall clock with rate ``G / MTBF_w``
  (``MTBF_w`` the mean time between failures of one worker; a job MTBF ``M``
  means ``MTBF_w = G * M``). Arrivals are independent of the job's state.
* Each arrival is of one kind, drawn with the fractions of ``mix``:
  ``crash`` (a worker's process dies: a GPU error, an OOM; detected when its
  sockets close), ``hang`` (a worker stops making progress; detected by the
  heartbeat / progress timeout), ``node`` (a machine is lost with all its
  workers; detected as a hang: a dead machine closes no socket) and ``job``
  (a software failure that takes every worker down at once: a bug, a hung
  collective). A crash or hang hits a worker drawn uniformly; a node loss a
  node drawn uniformly. A hit on a worker that is already down is dropped
  (counted), as in :mod:`unbroken.faults.traces`.
* A crashed or hung worker's hardware is fine: its process restarts (from a
  warm standby process, or cold) and rejoins. A lost node comes back after
  ``repair_h`` hours; with a free warm spare node its workers restart on the
  spare at once and the spare is busy until the lost node is repaired.
* Spare nodes are paid for: their GPU-hours are in the denominator of goodput.

Invariants: :func:`generate_events` is a pure function of its arguments;
events are sorted by time; every time is in ``[0, duration)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

__all__ = ["KINDS", "Event", "FailureSpec", "generate_events", "parse_mix"]

KINDS = ("crash", "hang", "node", "job")

DEFAULT_MIX = {"crash": 0.4, "hang": 0.2, "node": 0.3, "job": 0.1}


@dataclass(frozen=True, kw_only=True)
class FailureSpec:
    """A job and its failure process.

    Attributes:
        workers: data-parallel workers G.
        workers_per_node: workers lost together by a node loss.
        worker_mtbf_h: mean time between failures of one worker, hours (job MTBF = this / G).
        mix: fraction of arrivals of each kind in :data:`KINDS` (sums to 1).
        repair_h: hours until a lost node is back (replaced or repaired).
        spare_nodes: warm spare nodes held by the job (paid for).
        duration_h: simulated wall-clock hours.
    """

    workers: int
    workers_per_node: int = 8
    worker_mtbf_h: float
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    repair_h: float = 2.0
    spare_nodes: int = 0
    duration_h: float = 24.0

    def __post_init__(self) -> None:
        problems = []
        if self.workers < 1:
            problems.append(f"workers={self.workers} must be >= 1")
        if not 1 <= self.workers_per_node:
            problems.append(f"workers_per_node={self.workers_per_node} must be >= 1")
        if not (self.worker_mtbf_h > 0 and math.isfinite(self.worker_mtbf_h)):
            problems.append(f"MTBF={self.worker_mtbf_h!r} h per worker must be a finite number > 0 "
                            "(give --mtbf-h or --job-mtbf-h > 0)")
        unknown = set(self.mix) - set(KINDS)
        if unknown or any(not v >= 0 for v in self.mix.values()) or not math.isclose(sum(self.mix.values()), 1.0):
            problems.append(f"mix={self.mix} must give fractions >= 0 of {', '.join(KINDS)} summing to 1 "
                            "(e.g. --mix crash=0.4,hang=0.2,node=0.3,job=0.1)")
        if not self.repair_h > 0:
            problems.append(f"repair_h={self.repair_h!r} must be > 0")
        if self.spare_nodes < 0:
            problems.append(f"spare_nodes={self.spare_nodes} must be >= 0")
        if not self.duration_h > 0:
            problems.append(f"duration_h={self.duration_h!r} must be > 0")
        if problems:
            raise ValueError("; ".join(problems))
        # Workers down at once on average (Little's law), node losses with no spare dominating: a job
        # whose failures outrun its repairs has no survivor to take over and no steady state.
        per_node = min(self.workers_per_node, self.workers)
        down = self.workers / self.worker_mtbf_h * self.mix.get("node", 0.0) * self.repair_h * per_node
        if down >= self.workers:
            raise ValueError(
                f"more failures than workers: {down:.3g} workers down at once on average (node losses at "
                f"{self.workers / self.worker_mtbf_h * self.mix.get('node', 0.0):.3g}/h, repaired in "
                f"{self.repair_h} h, {per_node} workers each) of {self.workers}; raise the MTBF, "
                f"shorten --repair-h or lower the node fraction of --mix")

    @property
    def job_mtbf_h(self) -> float:
        """Mean time between failures of the whole job, hours."""
        return self.worker_mtbf_h / self.workers

    @property
    def nodes(self) -> int:
        """Nodes of the job (the last may be partly filled)."""
        return -(-self.workers // self.workers_per_node)


@dataclass(frozen=True)
class Event:
    """One failure arrival: wall-clock seconds, kind, and the worker or node it hits (``job``: -1)."""

    t: float
    kind: str
    target: int


def generate_events(spec: FailureSpec, seed: int) -> list[Event]:
    """The arrivals of one seeded realisation of ``spec``, sorted by time."""
    rng = np.random.default_rng(seed)
    duration = spec.duration_h * 3600.0
    n = int(rng.poisson(duration / (spec.job_mtbf_h * 3600.0)))
    times = np.sort(rng.uniform(0.0, duration, size=n))  # a Poisson process given its count
    p = np.array([spec.mix.get(k, 0.0) for k in KINDS])
    kinds = rng.choice(len(KINDS), size=n, p=p / p.sum())
    workers = rng.integers(0, spec.workers, size=n)
    nodes = rng.integers(0, spec.nodes, size=n)
    out = []
    for t, k, w, nd in zip(times, kinds, workers, nodes):
        kind = KINDS[int(k)]
        out.append(Event(float(t), kind, int(nd) if kind == "node" else (-1 if kind == "job" else int(w))))
    return out


def parse_mix(text: str, example: str) -> dict[str, float]:
    """``--mix KIND=SHARE,...`` as a dict; ``example`` (``crash=0.5``) is named in the error.

    Raises:
        ValueError: a part that is not ``KIND=NUMBER``.
    """
    out = {}
    for part in filter(None, text.split(",")):
        key, sep, value = part.partition("=")
        try:
            out[key.strip()] = float(value)
        except ValueError:
            sep = ""
        if not sep:
            raise ValueError(f"--mix {text!r}: {part!r} is not {example}")
    return out
