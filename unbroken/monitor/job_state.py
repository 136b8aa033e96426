"""What the watchers show of a job, folded from its ``metrics.jsonl`` records and its events.

:class:`JobState` is fed every record and event in the order they were written and keeps the numbers the
sinks publish: the newest ``train`` line's figures, live and degraded workers, counters of failures,
rejoins, restores and failed restores, the last stall, the newest sealed snapshot, when the newest
step came, and each worker's newest store request latency (its ``store_latency`` events: p50 and p99 of the
requests since its previous one). :func:`annotation` says which events are marked next to the loss.

Invariant: pure bookkeeping, no I/O; the same records give the same state.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

Record = dict[str, Any]


def is_failure(ev: Record) -> bool:
    """A worker that died or was fenced (not one that ended cleanly or that its agent stopped)."""
    return ev.get("event") == "worker_exit" and not ev.get("clean") and not ev.get("stopped_by_agent")


def annotation(ev: Record) -> str | None:
    """The text marked on the step axis for an event worth seeing next to the loss; None for the rest."""
    name = ev.get("event")
    if is_failure(ev):
        how = f"signal {ev['signal']}" if ev.get("signal") is not None else f"exit code {ev.get('code')}"
        return f"worker {ev.get('worker')} {'was fenced' if ev.get('fenced') else 'died'} ({how})"
    if name == "rejoined":
        return f"worker {ev.get('worker')} rejoined after {float(ev.get('wait_s', 0.0)):.1f} s"
    if name == "reconfigured":
        return f"new view g{ev.get('gen')}: {len(ev.get('members', []))} live, stall {float(ev.get('seconds', 0)):.2f} s"
    if name == "job_restore":
        return f"job restored from {ev.get('restored_from')} at step {ev.get('step')}"
    if name == "fault_injected":
        return f"fault injected: {ev.get('spec')}"
    return None


@dataclasses.dataclass
class JobState:
    """The job as the watchers see it (module docstring)."""

    workers: int
    step: int = 0
    loss: float | None = None
    tokens_per_s: float | None = None
    mfu: float | None = None
    flops_per_s: float | None = None
    eta_s: float | None = None
    live: int | None = None
    degraded: int = 0
    failures: int = 0
    rejoins: int = 0
    restores: int = 0
    failed_restores: int = 0
    last_failed_restore: str = ""
    stall_s: float = 0.0
    snapshot_step: int | None = None
    snapshot_time: float | None = None
    last_step_time: float | None = None
    """Wall time of the newest ``train`` line (None: none yet)."""
    degraded_steps: int = 0
    store_latency: dict[int, Record] = dataclasses.field(default_factory=dict)
    """Worker -> its newest ``store_latency`` event (``p50_s``, ``p99_s``, ``max_s``, ``calls``, ``step``)."""

    def record(self, rec: Record) -> None:
        if rec.get("kind") != "train":
            return
        self.step = int(rec["step"])
        self.last_step_time = float(rec.get("time", time.time()))
        for name in ("loss", "tokens_per_s", "mfu", "flops_per_s", "eta_s"):
            if isinstance(rec.get(name), (int, float)):
                setattr(self, name, float(rec[name]))
        live = rec.get("live_workers")
        if isinstance(live, (list, int)):
            self.live = len(live) if isinstance(live, list) else live
        if isinstance(rec.get("degraded"), list):
            self.degraded = len(rec["degraded"])
            self.degraded_steps += 1 if rec["degraded"] else 0

    def event(self, ev: Record) -> None:
        name = ev.get("event")
        if is_failure(ev):
            self.failures += 1
        elif name == "rejoined":
            self.rejoins += 1
        elif name == "job_restore":
            self.restores += 1
            failed = ev.get("failed_restores") or []
            if len(failed) > self.failed_restores:
                self.failed_restores = len(failed)
                self.last_failed_restore = str(failed[-1])
        elif name == "reconfigured":
            self.stall_s = float(ev.get("seconds", 0.0))
            if isinstance(ev.get("members"), list):
                self.live = len(ev["members"])
        elif name == "store_latency" and isinstance(ev.get("worker"), int):
            self.store_latency[ev["worker"]] = ev
        elif name == "snapshot_sealed" and isinstance(ev.get("step"), int):
            if self.snapshot_step is None or ev["step"] >= self.snapshot_step:
                self.snapshot_step = ev["step"]
                self.snapshot_time = float(ev.get("sealed_at") or ev.get("time") or time.time())

    def seconds_since_step(self, now: float) -> float | None:
        return None if self.last_step_time is None else max(0.0, now - self.last_step_time)
