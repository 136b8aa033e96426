"""The replica engine: one discrete-event pass of a recovery strategy over a job of replicas and its failures.

Time runs in wall-clock seconds; rows accrue at the current rate between
events (failures, returns, deferrals), so a pass over a day of a 100,000-GPU
job is a few hundred events. What each strategy does (assumptions, stated):

* ``spread`` (unbroken): the job stalls for detection and the view change;
  the survivors compute the lost replica's micro-batches of the step in
  flight (``ceil(k m / live) / m`` of a step); until the replica is back, its
  rows are spread over the survivors every step (the slowest survivor sets
  the step: :func:`unbroken.cluster.degraded.step_load`). No row is lost.
* ``hybrid`` (unbroken): as ``spread``, but a replica missing for longer than
  ``defer_after_s`` has its rows deferred: the step runs at full speed on the
  survivors' rows and the deferred rows are trained later, exactly once; the
  job then does ``(R - k) / R`` of its work, as many GPUs as are alive.
* ``drop-step`` (torchft, FT-HSDP): the step in flight is dropped everywhere
  (its part done is lost), the job stalls for detection and the view change,
  and a missing replica's rows are lost each step until it is back. A
  replica is restarted cold (no warm standby).
* ``ckpt-memory``: synchronous training; any failure stops the job: it
  restarts from an in-memory checkpoint taken every ``K`` steps (Daly's
  interval for its save cost), redoing the steps since; a lost node is first
  replaced by a spare.
* ``ckpt-disk``: the same from persistent storage (save and restore at the
  storage's per-GPU bandwidth).

A replica lost with its node waits for a spare node (the earliest one free;
the pool is replenished ``replenish_h`` after a spare is taken), or, cut off by
the network, for the network's repair if that comes first. A returning
replica is admitted at a step boundary: the members stall ``admission_s``
(once for every replica back at the same moment). Goodput = rows trained /
rows a failure-free plain loop trains on the job's GPUs in the same time,
times ``gpus / (gpus + spare GPUs)``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from unbroken.cluster.degraded import step_load
from unbroken.cluster.replicas import ReplicaEvent, ReplicaSpec
from unbroken.cluster.strategies import daly_interval_s

__all__ = ["ENGINE_STRATEGIES", "EngineCosts", "EngineOutcome", "run_engine"]

ENGINE_STRATEGIES = ("spread", "hybrid", "drop-step", "ckpt-memory", "ckpt-disk")


@dataclass(frozen=True, kw_only=True)
class EngineCosts:
    """Every figure one pass uses, in seconds at the job's scale (built by :func:`unbroken.cluster.projection`).

    ``ratio_*``: failure-free throughput relative to a plain loop; ``load_s``: one rank's shard loaded;
    ``save_memory_s`` / ``save_disk_s``: the blocking part of one checkpoint, ``write_*_s`` its whole write
    (the next save waits for it); ``restart_*_s``: a whole job
    back to its first step (restore included); ``cores``: GPUs sharing this many cores (a CPU replay), or None.
    """

    step_s: float
    ratio_unbroken: float = 1.0
    ratio_drop_step: float = 1.0
    detect_crash_s: float
    detect_hang_s: float
    reconfigure_s: float
    start_warm_s: float
    start_cold_s: float
    cuda_warm_s: float
    cuda_cold_s: float
    load_s: float
    admission_s: float
    restart_memory_s: float
    restart_disk_s: float
    save_memory_s: float
    save_disk_s: float
    write_memory_s: float = 0.0
    write_disk_s: float = 0.0
    defer_after_s: float = 60.0
    cores: int | None = None

    def rejoin_s(self, *, warm: bool, kind: str) -> float:
        """From a failure to the replica ready to be admitted (detection, process start, CUDA, state load)."""
        detect = self.detect_crash_s if kind == "software" else self.detect_hang_s
        start = self.start_warm_s + self.cuda_warm_s if warm else self.start_cold_s + self.cuda_cold_s
        return detect + start + self.load_s


@dataclass
class EngineOutcome:
    """One strategy's pass: goodput and where the rest went (rows; seconds)."""

    goodput: float = 0.0
    rows: float = 0.0
    lost_rows: float = 0.0
    deferred_rows: float = 0.0
    redone_rows: float = 0.0
    stalled_s: float = 0.0
    degraded_s: float = 0.0
    failures: int = 0
    ckpt_every: int = 0
    back_s: list[float] = field(default_factory=list)

    def as_dict(self) -> dict[str, float]:
        """The figures, without the per-loss list."""
        return {k: float(v) for k, v in asdict(self).items() if k != "back_s"}


class _Pass:
    def __init__(self, strategy: str, spec: ReplicaSpec, c: EngineCosts) -> None:
        if strategy not in ENGINE_STRATEGIES:
            raise ValueError(f"strategy {strategy!r}; valid: {', '.join(ENGINE_STRATEGIES)}")
        self.s, self.spec, self.c = strategy, spec, c
        self.R, self.m = spec.replicas, spec.micro_batches
        self.t = self.steps = self.blocked_until = 0.0
        self.down: dict[int, float] = {}  # replica -> time ready to be admitted
        self.lost_at: dict[int, float] = {}
        self.spares = [0.0] * spec.spare_nodes
        self.last_admission = -1.0
        self.out = EngineOutcome()
        self.sync = strategy.startswith("ckpt")
        self.every = 0
        if self.sync:
            save = c.save_memory_s if strategy == "ckpt-memory" else c.save_disk_s
            write = c.write_memory_s if strategy == "ckpt-memory" else c.write_disk_s
            # Daly's interval for the blocking part, but no sooner than the previous save's write is done
            self.every = max(1, round(daly_interval_s(max(save, 1e-9), spec.job_mtbf_h * 3600.0) / c.step_s),
                             math.ceil(write / c.step_s))
            self.out.ckpt_every = self.every
            self.save = save

    # -- the rate between events --------------------------------------------------------------------------
    def _wall_rows(self) -> tuple[float, float]:
        """(seconds per step, rows per step) in the current state."""
        c, k = self.c, len(self.down)
        if k >= self.R:
            return math.inf, 0.0
        if self.sync:
            return c.step_s + self.save / self.every, float(self.R * self.m)
        if self.s == "drop-step":
            return c.step_s / c.ratio_drop_step, float((self.R - k) * self.m)
        deferred = sum(1 for r in self.down if self.s == "hybrid" and self.t >= self.lost_at[r] + c.defer_after_s)
        spread = k - deferred
        factor = 1.0
        if spread:
            factor = step_load("spread", workers=self.R - deferred, rows=self.m, down=list(range(spread)), approx=1.0,
                               svd=0.0, cores=c.cores).factor
        elif c.cores is not None:
            factor = step_load("spread", workers=self.R - deferred, rows=self.m, down=[], approx=1.0, svd=0.0,
                               cores=c.cores).factor
        return c.step_s / c.ratio_unbroken * factor, float((self.R - deferred) * self.m)

    def advance(self, to: float) -> None:
        start = max(self.t, self.blocked_until)
        self.out.stalled_s += max(0.0, min(to, self.blocked_until) - self.t)
        if to > start:
            wall, rows = self._wall_rows()
            if math.isfinite(wall):
                n = (to - start) / wall
                self.steps += n
                self.out.rows += n * rows
                gone = n * (self.R * self.m - rows)
                if self.s == "hybrid":
                    self.out.deferred_rows += gone
                else:
                    self.out.lost_rows += gone
                if self.down:
                    self.out.degraded_s += to - start
            else:
                self.out.stalled_s += to - start
        self.t = max(self.t, to)

    # -- events -------------------------------------------------------------------------------------------
    def _replicas_of(self, e: ReplicaEvent) -> list[int]:
        if e.kind in ("software", "hang"):
            return [e.replica]
        size, per = self.spec.replica_size, self.spec.gpus_per_node
        out: set[int] = set()
        for n in e.nodes:
            if size <= per:
                out.update(range(n * (per // size), min(self.R, (n + 1) * (per // size))))
            else:
                out.add(min(self.R - 1, n // (size // per)))
        return sorted(out)

    def _spare_at(self, t: float) -> float:
        """When a spare node is free for a node lost at ``t``; it is taken, and replenished later."""
        if not self.spares:
            return math.inf
        i = min(range(len(self.spares)), key=lambda j: self.spares[j])
        ready = max(t, self.spares[i])
        self.spares[i] = ready + self.spec.replenish_h * 3600.0
        return ready

    def _node_ready(self, e: ReplicaEvent) -> float:
        """When every node ``e`` took is replaced (or, cut off by the network, reachable again)."""
        ready = e.t
        for _ in e.nodes:
            at = self._spare_at(e.t)
            if e.kind == "network":
                at = min(at, e.t + self.spec.net_repair_h * 3600.0)
            ready = max(ready, at)
        return ready

    def _block(self, t: float, seconds: float) -> None:
        self.blocked_until = max(self.blocked_until, t) + seconds

    def on_failure(self, e: ReplicaEvent) -> None:
        c = self.c
        hit = [r for r in self._replicas_of(e) if r not in self.down]
        if not hit and not self.sync:
            return
        self.out.failures += 1
        detect = c.detect_crash_s if e.kind == "software" else c.detect_hang_s
        wait = self._node_ready(e) - e.t if e.nodes else 0.0
        if self.sync:
            keep = math.floor(self.steps / self.every) * self.every
            self.out.redone_rows += (self.steps - keep) * self.R * self.m
            self.out.rows -= (self.steps - keep) * self.R * self.m
            self.steps = keep
            restart = c.restart_memory_s if self.s == "ckpt-memory" else c.restart_disk_s
            self._block(e.t, detect + wait + restart)
            return
        live = self.R - len(self.down) - len(hit)
        if self.s == "drop-step":
            frac = self.steps - math.floor(self.steps)
            _, rows = self._wall_rows()
            self.steps -= frac
            self.out.rows -= frac * rows
            self.out.lost_rows += frac * rows
            self._block(e.t, detect + c.reconfigure_s)
        else:
            extra = math.ceil(len(hit) * self.m / live) / self.m if live > 0 else 0.0
            self._block(e.t, detect + c.reconfigure_s + extra * c.step_s / c.ratio_unbroken)
        warm = self.s != "drop-step"
        ready = e.t + max(detect, wait) + c.rejoin_s(warm=warm, kind=e.kind) - detect  # a spare, then the start
        for r in hit:
            self.down[r] = ready
            self.lost_at[r] = e.t

    def on_back(self, r: int) -> None:
        back = self.down.pop(r)
        self.out.back_s.append(back - self.lost_at.pop(r))
        if back != self.last_admission:
            self.last_admission = back
            self._block(back, self.c.admission_s)

    def next_change(self, until: float) -> tuple[float, int | None]:
        """The next return (time, replica) or deferral (time, None) before ``until``; (until, None) if none."""
        best: tuple[float, int | None] = (until, None)
        for r, back in self.down.items():
            if back < best[0]:
                best = (back, r)
            if self.s == "hybrid":
                d = self.lost_at[r] + self.c.defer_after_s
                if self.t < d < best[0]:
                    best = (d, None)
        return best


def run_engine(strategy: str, spec: ReplicaSpec, costs: EngineCosts, events: list[ReplicaEvent]) -> EngineOutcome:
    """One pass of ``strategy`` over ``events`` (sorted by time) for ``spec.hours``.

    Raises:
        ValueError: unknown strategy.
    """
    p = _Pass(strategy, spec, costs)
    end = spec.hours * 3600.0
    for e in [*events, None]:
        until = end if e is None else e.t
        while True:
            t, r = p.next_change(until)
            p.advance(t)
            if r is not None:
                p.on_back(r)
            elif t >= until:
                break
        if e is not None:
            p.on_failure(e)
    o = p.out
    ideal = spec.replicas * spec.micro_batches * end / costs.step_s
    o.goodput = o.rows / ideal * spec.gpus / (spec.gpus + spec.spare_nodes * spec.gpus_per_node)
    return o
