"""What a finished launch reports (``summary.json``): the run's figures, whether its workers agree, the
failures and restarts its agents recorded, and its snapshots."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from unbroken.config import Config, config_hash
from unbroken.faults.fail_at import parse_fail_at
from unbroken.jsonl import read_jsonl
from unbroken.checkpoint.checkpointer import latest_checkpoint
from unbroken.checkpoint.files import committed_checkpoints

__all__ = ["agent_counts", "snapshot_summary", "summarise"]


def agent_counts(run_dir: Path, since: float, workers_per_node: int) -> dict[str, int]:
    """Failures, restarts and injected faults of this launch, from the agents' (and chaos') events."""
    failures = restarts = injected = handovers = 0
    for path in sorted((run_dir / "events").glob("agent*.jsonl")):
        for e in read_jsonl(path):
            if e.get("kind") != "event" or e.get("t", 0) < since:
                continue
            if e["event"] == "worker_exit" and not e.get("clean") and not e.get("stopped_by_agent"):
                failures += 1
            elif e["event"] == "fault_injected":
                injected += 1
                if e.get("lost_node"):
                    failures += len(e.get("targets", []))  # a lost node's agent records no exits
            elif e["event"] == "worker_start" and e.get("join"):
                restarts += 1
            elif e["event"] == "standby_assign":
                handovers += 1
    for e in read_jsonl(run_dir / "events" / "chaos.jsonl"):
        if e.get("event") == "fault_injected" and e.get("t", 0) >= since:
            injected += 1
            (spec,) = parse_fail_at(e["spec"])
            if spec.target == "node" and spec.how == "kill":
                failures += workers_per_node  # the agent went down with them: nobody recorded their exits
    return {"failures": failures, "restarts": restarts, "faults_injected": injected, "standby_handovers": handovers}


def summarise(run_dir: Path, cfg: Config, info: dict[str, Any], wall_s: float, resume_from: Path | None, *,
              nodes: int, t0: float, verify: bool = True) -> dict[str, Any]:
    """The summary of the launch that started at ``t0`` (its agents' events from then on). ``verify=False`` (a
    preempted job, whose grace is short): its ``checkpoint`` is the newest committed one, not read back (its
    final save hashed the bytes it wrote; a ``--resume`` checks them)."""
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    reports = [json.loads(p.read_text()) for p in sorted((run_dir / "workers").glob("w*.json"))]
    # Under HSDP each worker holds its shard index's part: the workers of one index must agree.
    per_index: dict[int, set[str]] = {}
    for r in reports:
        per_index.setdefault(int(r.get("shard_index", 0)), set()).add(r["param_digest"])
    agree = bool(per_index) and all(len(d) == 1 for d in per_index.values())
    digests = sorted(d for ds in per_index.values() for d in ds)
    steady = [r["tokens_per_s"] for r in train[len(train) // 5 :]] or [0.0]
    ckpt = latest_checkpoint(run_dir) if verify else next(iter(committed_checkpoints(run_dir / "checkpoints")), None)
    return {
        "run_dir": str(run_dir), "config_hash": config_hash(cfg), "workers": cfg.train.workers,
        "nodes": nodes, "workers_per_node": cfg.train.workers // nodes,
        "steps": train[-1]["step"] if train else 0, "resumed_from": str(resume_from) if resume_from else None,
        "final_loss": train[-1]["loss"] if train else None,
        "val_loss": val[-1]["val_loss"] if val else None, "val_ppl": val[-1]["val_ppl"] if val else None,
        "tokens_per_s": sorted(steady)[len(steady) // 2], "wall_s": wall_s,
        "workers_agree": agree, "param_digest": digests[0] if len(digests) == 1 else digests,
        "checkpoint": str(ckpt) if ckpt else None, **agent_counts(run_dir, t0, cfg.train.workers // nodes), **info,
        "peak_memory_bytes": max((r.get("peak_memory_bytes") or 0 for r in reports), default=0) or None,
        "device_bytes": _largest(r.get("device_bytes") or {} for r in reports),
        "compiled_frames": max((r.get("compiled_frames", 0) for r in reports), default=0),
        "snapshots": snapshot_summary(cfg, reports),
    }


def snapshot_summary(cfg: Config, reports: list[dict[str, Any]]) -> dict[str, Any]:
    """The snapshot setting, and under ``auto`` the interval the workers last agreed on, whether every worker had
    measured a steady write (``settled``: else the interval is the first one, 1, while the first writes into
    fresh memory are measured), the steps between the last two snapshots, the recovery point (twice the larger
    of interval and spacing: a whole-job failure goes back at most that far), and the largest of the workers'
    measured costs of a snapshot to the training (``cost_s``)."""
    snaps = [r.get("snapshots") or {} for r in reports]
    out: dict[str, Any] = {"every": cfg.snapshot.every, "taken": max((s.get("taken", 0) for s in snaps), default=0)}
    if cfg.snapshot.every == "auto":
        interval = max((s.get("interval", 0) for s in snaps), default=0)
        spacing = max((s.get("spacing_steps") or 0 for s in snaps), default=0)
        writes = [s["write_s"] for s in snaps if s.get("write_s") is not None]
        costs = [s["cost_s"] for s in snaps if s.get("cost_s") is not None]
        out.update(interval=interval, settled=bool(snaps) and all(s.get("settled") for s in snaps),
                   spacing_steps=spacing or None, recovery_point_steps=2 * max(interval, spacing),
                   skipped=max((s.get("skipped", 0) for s in snaps), default=0),
                   slowest_write_s=max(writes) if writes else None, cost_s=max(costs) if costs else None,
                   device_staging_bytes=max((s.get("device_staging_bytes", 0) for s in snaps), default=0))
    return out


def _largest(parts: Any) -> dict[str, int]:
    """Per kind, the largest of the workers' own device bytes (their reports' ``device_bytes``)."""
    out: dict[str, int] = {}
    for d in parts:
        for k, v in d.items():
            out[k] = max(out.get(k, 0), int(v or 0))
    return out
