"""Recovery strategies side by side: one discrete-event pass over a failure realisation per strategy.

Time runs in wall-clock seconds; training progress accrues at one step per
``step wall time`` while the job is not blocked. What each strategy does on a
failure (model assumptions, stated):

* ``checkpoint-restart``: plain data parallelism with a persistent checkpoint
  every ``K`` steps (the blocking part of each save, ``ckpt_save_s``, is
  spread over the ``K`` steps). Any failure stops the job: it is detected
  (``detect_*``), the work since the last checkpoint is redone, every worker
  restarts and restores from the checkpoint (``restart_disk_s``); a lost node
  must first be replaced (a free spare, else its repair). The checkpoint grid
  restarts from the restored step (``K`` steps after it).
* ``step-discard`` (torchft's behaviour): the step in flight is dropped (its
  partial work and its whole batch are lost), the job stalls for detection,
  then goes on with the live replicas only: a dead replica's rows are lost
  every step until it rejoins (``rejoin_*``: restart and a state transfer
  from a peer). A whole-job failure restarts from a persistent checkpoint
  (interval by Young/Daly for the whole-job failure rate).
* ``neighbor`` / ``spread`` / ``spread-approx`` (unbroken): the job stalls for
  detection and the view change, the step in flight is completed by the
  survivors, and later steps are degraded (:mod:`unbroken.cluster.degraded`)
  until the dead worker rejoins; no row is lost. Admitting a rejoining
  worker (or a node's workers, together) stalls the job by ``rejoin_stall_s``
  (the same for ``step-discard``: the joiner gets the state from a peer). Every step pays the
  protocol's overhead and its share of a snapshot (one every ``snapshot_every``
  steps). A whole-job failure restores every worker from snapshot memory and
  redoes the steps since the newest snapshot (with one per step: only the
  step in flight).
* ``spread-disk``: ``spread`` without snapshot memory: no snapshot overhead,
  and whole-job failures restore from a persistent checkpoint (Young/Daly).

Any failure kind is detected by ``detect_crash_s`` (``crash``) or
``detect_hang_s`` (``hang``, ``node``, ``job``). Failures that strike while
the job is blocked are handled the same way (their stall adds up). A crashed
or hung process that is still down when a whole-job restart finishes comes back
with it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

from unbroken.cluster.degraded import step_load
from unbroken.cluster.failures import Event, FailureSpec
from unbroken.cluster.scaling import SimCosts

__all__ = ["STRATEGIES", "Outcome", "Strategy", "daly_interval_s", "simulate_strategy", "young_interval_s"]


def young_interval_s(save_s: float, mtbf_s: float) -> float:
    """Young's optimal checkpoint interval ``sqrt(2 C M)`` (seconds of work between checkpoints)."""
    _check_interval_args(save_s, mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s)


def daly_interval_s(save_s: float, mtbf_s: float) -> float:
    """Daly's (2006) higher-order optimum interval.

    ``sqrt(2CM) (1 + sqrt(C/2M)/3 + (C/2M)/9) - C`` for ``C < 2M``, else ``M``.
    """
    _check_interval_args(save_s, mtbf_s)
    if save_s >= 2.0 * mtbf_s:
        return mtbf_s
    x = save_s / (2.0 * mtbf_s)
    return math.sqrt(2.0 * save_s * mtbf_s) * (1.0 + math.sqrt(x) / 3.0 + x / 9.0) - save_s


def _check_interval_args(save_s: float, mtbf_s: float) -> None:
    if not save_s > 0:
        raise ValueError(f"checkpoint save cost {save_s!r} s must be > 0")
    if not mtbf_s > 0:
        raise ValueError(f"MTBF {mtbf_s!r} s must be > 0")


@dataclass(frozen=True)
class Strategy:
    """A recovery strategy: ``kind`` in checkpoint / discard / takeover; ``ckpt_every`` steps (None: none)."""

    name: str
    kind: str
    policy: str | None = None
    ckpt_every: int | None = None
    memory: bool = False
    snapshot_every: int = 1


STRATEGIES = ("checkpoint-restart", "step-discard", "neighbor", "spread", "spread-approx", "spread-disk")


@dataclass
class Outcome:
    """What one strategy achieved in one realisation (samples = rows)."""

    goodput: float = 0.0
    samples: float = 0.0
    lost_samples: float = 0.0
    redone_samples: float = 0.0
    approx_samples: float = 0.0
    degraded_s: float = 0.0
    blocked_s: float = 0.0
    failures: int = 0
    dropped_failures: int = 0

    def as_dict(self) -> dict[str, float]:
        """Plain JSON-ready fields."""
        return asdict(self)


class _Run:
    """The state of one strategy's pass over one realisation."""

    def __init__(self, st: Strategy, spec: FailureSpec, c: SimCosts, cores: int | None,
                 standby: bool) -> None:
        self.st, self.spec, self.c, self.cores, self.standby = st, spec, c, cores, standby
        self.t = 0.0
        self.steps = 0.0
        self.blocked_until = 0.0
        self.down: dict[int, float] = {}  # worker -> time back
        self.node_down: set[int] = set()  # the workers of ``down`` lost with their node
        self.last_admission = -1.0  # workers back at the same moment are admitted in one view change
        self.spares = [0.0] * spec.spare_nodes  # time each spare node is free again
        self.out = Outcome()
        self.batch = spec.workers * c.rows
        takeover = st.kind == "takeover"
        self.overhead = ((c.protocol_s.value if takeover else 0.0)
                         + (c.snapshot_s.value / st.snapshot_every if st.memory else 0.0)
                         + (c.ckpt_save_s.value / st.ckpt_every if st.ckpt_every else 0.0))

    def _load(self) -> tuple[float, int, int]:
        """(step wall time, rows trained per step, rows approximated per step) in the current state."""
        k, g = len(self.down), self.spec.workers
        if k >= g:
            return math.inf, 0, 0
        if self.st.kind == "takeover" and k:
            ld = step_load(self.st.policy or "spread", workers=g, rows=self.c.rows, down=list(self.down),
                           approx=self.c.approx_ratio.value, svd=self.c.svd_share.value, cores=self.cores)
            return self.c.step_s.value * ld.factor + self.overhead, self.batch, ld.approx_rows
        trained = self.batch if self.st.kind != "discard" else (g - k) * self.c.rows
        return self.c.step_s.value + self.overhead, trained, 0

    def advance(self, to: float) -> None:
        """Train from ``self.t`` to ``to`` in the current state."""
        start = max(self.t, self.blocked_until)
        self.out.blocked_s += max(0.0, min(to, self.blocked_until) - self.t)
        if to > start:
            wall, trained, approx = self._load()
            if math.isfinite(wall):
                n = (to - start) / wall
                self.steps += n
                self.out.samples += n * trained
                self.out.approx_samples += n * approx
                self.out.lost_samples += n * (self.batch - trained)
                if self.down:
                    self.out.degraded_s += to - start
            else:
                self.out.blocked_s += to - start
        self.t = max(self.t, to)

    def _detect(self, kind: str) -> float:
        return self.c.detect_crash_s.value if kind == "crash" else self.c.detect_hang_s.value

    def _block(self, te: float, seconds: float) -> None:
        self.blocked_until = max(self.blocked_until, te) + seconds

    def _rollback(self, every: int | None) -> None:
        """Back to the last checkpoint (``every`` steps), or to the start of the step in flight."""
        keep = math.floor(self.steps / every) * every if every else math.floor(self.steps)
        redo = self.steps - keep
        self.out.redone_samples += redo * self.batch
        self.out.samples -= redo * self.batch
        self.steps = keep

    def _node_wait(self, te: float) -> float:
        """Seconds until a lost node's workers can run again elsewhere: a free spare now, else its repair."""
        repair = self.spec.repair_h * 3600.0
        for i, free in enumerate(self.spares):
            if free <= te:
                self.spares[i] = te + repair
                return 0.0
        return repair

    def _hit(self, e: Event) -> list[int]:
        if e.kind == "node":
            w = self.spec.workers_per_node
            ids = range(e.target * w, min(self.spec.workers, (e.target + 1) * w))
        else:
            ids = range(e.target, e.target + 1)
        return [i for i in ids if i not in self.down]

    def on_failure(self, e: Event) -> None:
        """Apply arrival ``e`` (the clock already advanced to ``e.t``)."""
        st, c = self.st, self.c
        if e.kind == "job" or st.kind == "checkpoint":
            self.out.failures += 1
            every = st.ckpt_every if (st.kind == "checkpoint" or not st.memory) else st.snapshot_every
            self._rollback(every)
            restart = c.restart_memory_s.value if (st.kind == "takeover" and st.memory) else c.restart_disk_s.value
            wait = self._node_wait(e.t) if e.kind == "node" else 0.0
            self._block(e.t, self._detect(e.kind) + wait + restart)
            for w, back in list(self.down.items()):  # restarted processes come back with the job
                if w not in self.node_down and back > self.blocked_until:
                    self.down[w] = self.blocked_until
            return
        ids = self._hit(e)
        if not ids:
            self.out.dropped_failures += 1
            return
        self.out.failures += 1
        if st.kind == "discard":  # the step in flight is dropped: its partial work and its whole batch
            frac = self.steps - math.floor(self.steps)
            live_rows = (self.spec.workers - len(self.down)) * c.rows
            self.steps -= frac
            self.out.samples -= frac * live_rows
            self.out.lost_samples += self.batch - frac * (self.batch - live_rows)
        detect = self._detect(e.kind)
        self._block(e.t, detect)
        if e.kind == "node":
            wait = self._node_wait(e.t)
            back = e.t + detect + wait + c.rejoin_cold_s.value
            self.node_down.update(ids)
        else:
            back = e.t + detect + (c.rejoin_warm_s.value if self.standby else c.rejoin_cold_s.value)
        for w in ids:
            self.down[w] = back

    def on_back(self, worker: int) -> None:
        """Worker ``worker`` is back at full strength: admitting it stalls the job (once per admission)."""
        back = self.down.pop(worker, None)
        if back is not None and back != self.last_admission:
            self.last_admission = back
            self._block(back, self.c.rejoin_stall_s.value)
        self.node_down.discard(worker)


def simulate_strategy(st: Strategy, spec: FailureSpec, costs: SimCosts, events: list[Event], *,
                      cores: int | None = None, standby: bool = True) -> Outcome:
    """One strategy's outcome over ``events`` (sorted), for ``spec.duration_h`` hours.

    Goodput = rows trained / rows a failure-free plain data-parallel job trains in the same time on
    ``G`` workers, times ``G / (G + spare workers)`` (spares are paid for).

    Raises:
        ValueError: a takeover strategy with fewer than 2 workers.
    """
    if st.kind == "takeover" and spec.workers < 2:
        raise ValueError(f"strategy {st.name!r} needs at least 2 workers to take over a dead one's rows "
                         f"(workers={spec.workers}); use --workers >= 2 or checkpoint-restart")
    run = _Run(st, spec, costs, cores, standby)
    end = spec.duration_h * 3600.0
    for e in events:
        _returns_until(run, e.t)
        run.advance(e.t)
        run.on_failure(e)
    _returns_until(run, end)
    run.advance(end)
    o = run.out
    ideal = spec.workers * costs.rows * end / costs.step_s.value
    paid = spec.workers / (spec.workers + spec.spare_nodes * spec.workers_per_node)
    o.goodput = o.samples / ideal * paid
    return o


def _returns_until(run: _Run, t: float) -> None:
    """Process every return before ``t`` in time order (training advances to each)."""
    while run.down:
        w, back = min(run.down.items(), key=lambda kv: kv[1])
        if back > t:
            return
        run.advance(back)
        run.on_back(w)
