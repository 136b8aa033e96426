"""Snapshot benchmark: what per-step in-memory snapshots cost, and what they buy back.

``unbroken bench snapshot --preset tiny --nodes 2 --workers-per-node 2`` measures, in one invocation:

1. **overhead** (real jobs): median step time of steps that overlap a snapshot's
   asynchronous copy relative to steps that do not, in one job
   (``snapshot.every=2``: same processes, cores and groups, so drift cancels);
   and the same for ``torch.distributed.checkpoint`` asynchronous saves
   (``train.checkpoint_every=2``, no snapshots): the time each adds to a step;
2. **bytes per node** of the coded snapshot against a full copy of the state,
   and the target ``(1 + p/(N - p)) / N`` (deterministic);
3. **coding throughput** (in process): Reed-Solomon encode and parity rebuild,
   MB/s of state;
4. **restore time** (in process, the preset's model and AdamW state): from the
   node's own snapshot memory, rebuilt from parity, and loaded from a DCP
   checkpoint on disk;
5. **whole-job kill** (real jobs): every worker SIGKILLed mid-step; steps lost
   beyond the one in flight and seconds from the kill to the next committed
   step, against checkpoint-restart (plain data parallelism restarted from its
   last DCP checkpoint, ``--checkpoint-every``) after one worker's kill;
6. **rejoin**: a killed worker restarted and admitted again, loading the state from its node's
   snapshot memory vs receiving it from a peer (``snapshot.every=0``): the joiner's and the members'
   time to adopt the admitting view;
7. the projection for ``llama-1b`` / ``llama-7b``: bytes per node and seconds
   per snapshot at the measured write throughput (a projection, not a
   measurement).

Three studies of snapshot memory run from the repository, each in one process:
``python -m benchmarks.snapshot_pinned`` (the pinned host bytes and the device staging bytes per worker at
``llama-1b`` and ``llama-7b``, counted), ``python -m benchmarks.snapshot_contention`` (how much a write's
threads slow a launch-like training thread beside them) and ``python -m benchmarks.snapshot_first_writes``
(one worker's first writes, which also map its two buffers).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from unbroken.agent.launcher import launch
from unbroken.bench._args import parse_with_overrides
from unbroken.bench.machine import machine_description
from unbroken.config import Config, load_config, preset
from unbroken.jsonl import read_jsonl
from unbroken.runtime.ledger import read_events
from unbroken.snapshot.capacity import node_bytes, state_bytes
from unbroken.snapshot.erasure import Coding

_GB = 1e9


def _cfg(a: argparse.Namespace, *extra: str) -> Config:
    return load_config(preset_name=a.preset, overrides=a.overrides + [
        f"train.steps={a.steps}", "train.val_every=0", "train.val_batches=1", *extra])


def _train_records(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]


def _alternating(a: argparse.Namespace, tmp: Path, name: str, *extra: str) -> dict[str, Any]:
    """Steps overlapping the work done every 2nd step vs the others, in one job."""
    run = tmp / name
    launch(_cfg(a, *extra), run, nodes=a.nodes, workers_per_node=a.workers_per_node)
    train = _train_records(run)[3:]  # warm-up
    # A record's "step" counts applied steps: the work started after applying an even count overlaps the next step.
    busy = [r["step_time_s"] for r in train if (r["step"] - 1) % 2 == 0]
    idle = [r["step_time_s"] for r in train if (r["step"] - 1) % 2 == 1]
    b, i = statistics.median(busy), statistics.median(idle)
    return {"median_step_s_with": b, "median_step_s_without": i, "ratio": b / i, "added_s": b - i,
            "steps_with": len(busy), "steps_without": len(idle)}


def _overhead(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    snap = _alternating(a, tmp, "snapshot-every-2", "snapshot.every=2")
    dcp = _alternating(a, tmp, "dcp-every-2", "snapshot.every=0", "train.checkpoint_every=2")
    ratio = dcp["added_s"] / snap["added_s"] if snap["added_s"] > 0 else float("inf")
    return {"snapshot": snap, "dcp_async_save": dcp, "dcp_added_over_snapshot_added": ratio}


def _bytes(a: argparse.Namespace) -> dict[str, Any]:
    cfg = _cfg(a)
    n, p = a.nodes, cfg.snapshot.parity
    full = state_bytes(cfg)
    per_node = node_bytes(cfg, n, a.workers_per_node) / 2  # one buffer: the sealed snapshot
    return {"state_bytes": full, "bytes_per_node": per_node, "fraction_of_full_copy": per_node / full,
            "target_fraction": (1 + p / (n - p)) / n if n > p else 1.0}


def _state(cfg: Config) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    from unbroken.job.builder import build_job

    job = build_job(cfg, torch.device("cpu"))
    for prm in job.model.parameters():
        prm.grad = torch.randn_like(prm)
    job.optimizer.step()
    return job.model, job.optimizer


def _in_process(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """Coding throughput and restore times on the preset's real state (one process)."""
    from unbroken.checkpoint.checkpointer import AsyncCheckpointer, latest_checkpoint, load_checkpoint, training_state
    from unbroken.store.view import View
    from unbroken.snapshot.restore import alone, decide, inventory, restore_from_memory
    from unbroken.snapshot.segment import remove_segments
    from unbroken.snapshot.snapshotter import Snapshotter
    from unbroken.snapshot.state_bytes import tensors_of

    cfg = _cfg(a)
    model, opt = _state(cfg)
    raw = os.urandom(int(state_bytes(cfg)))
    k = max(1, min(a.nodes, cfg.snapshot.group_nodes) - cfg.snapshot.parity)  # one coding group's
    coding = Coding(k, cfg.snapshot.parity)
    t0 = time.perf_counter()
    parity, headers = coding.parity(raw, list(range(coding.k, coding.n)))
    enc = time.perf_counter() - t0
    chunk = coding.chunk(len(raw))
    survivors = {i: raw[i * chunk:(i + 1) * chunk] for i in range(1, coding.k)} | parity  # data fragment 0 lost
    t0 = time.perf_counter()
    coding.decode(survivors, len(raw), headers)
    dec = time.perf_counter() - t0
    job = os.urandom(6).hex()
    node_of = {w: w // a.workers_per_node for w in range(a.nodes * a.workers_per_node)}
    snaps = [Snapshotter(job_id=job, node=node_of[w], worker=w, node_of=node_of, every=1,
                         redundancy=cfg.snapshot.redundancy, parity=cfg.snapshot.parity,
                         group_nodes=cfg.snapshot.group_nodes, config_hash="bench",
                         state=lambda: tensors_of(model, opt), on_event=lambda *x, **y: None) for w in node_of]
    view = View(gen=0, members=tuple(node_of), step=1)
    t0 = time.perf_counter()
    for s in snaps:  # one after another: the time of one worker's write, summed over the job
        s.take(1, view)
        s.wait()
    write_s = (time.perf_counter() - t0) / len(snaps)
    written = sum((s.last or {})["bytes"] for s in snaps) / len(snaps)
    for s in snaps:
        s.close()
    try:
        fresh_model, fresh_opt = _state(cfg)
        out = {}
        for source, nodes in (("own_memory", list(range(a.nodes))), ("parity_rebuild", list(range(1, a.nodes)))):
            invs = [inventory(job, n, config_hash="bench") for n in nodes]
            spec = decide(invs, checkpoint=None, members_of=lambda ns: [w for w in node_of if node_of[w] in ns])
            assert spec is not None, f"the snapshot just taken is not restorable from {source}"
            node = nodes[-1] if source == "parity_rebuild" else 0
            mem = [w for w in node_of if node_of[w] == node]
            times = []
            for _ in range(3):  # the median of three: the first pays for page faults and the coder's set-up
                t0 = time.perf_counter()
                restore_from_memory(spec, job=job, node=node, node_of=node_of, members=(mem[0],), me=mem[0],
                                    broadcast=alone, model=fresh_model, optimizer=fresh_opt,
                                    device=torch.device("cpu"))
                times.append(time.perf_counter() - t0)
            out[source] = statistics.median(times)
    finally:
        remove_segments(job)
    saver = AsyncCheckpointer(tmp / "dcp-run", config_hash="bench", keep=1)
    saver.save(1, training_state(model, opt), {"loss": 0.0})
    saver.wait()
    ckpt = latest_checkpoint(tmp / "dcp-run")
    assert ckpt is not None, "the checkpoint just written is not found"
    times = []
    for _ in range(3):  # verified (sha256 of every file) and loaded, as a restart does; warm page cache
        t0 = time.perf_counter()
        load_checkpoint(ckpt, fresh_model, fresh_opt, config_hash="bench")
        times.append(time.perf_counter() - t0)
    out["dcp_disk"] = statistics.median(times)
    mb = len(raw) / 1e6
    return {"state_mb": mb, "encode_mb_s": mb / enc, "rebuild_mb_s": mb / dec,
            "write_mb_s_per_worker": written / 1e6 / write_s, "write_s_per_worker": write_s,
            "restore_s": out, "disk_over_memory": out["dcp_disk"] / out["own_memory"],
            "disk_over_parity_rebuild": out["dcp_disk"] / out["parity_rebuild"]}


def _kill_all(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    at = a.steps // 2 + a.checkpoint_every // 2 + 1  # off the checkpoint grid: checkpoint-restart redoes steps
    kills = ",".join(f"step={at}:worker={w}:kill:phase=backward" for w in range(a.nodes * a.workers_per_node))
    snap = _recovery_run(a, tmp / "kill-all-snapshots", _cfg(a), kills, at)
    ckpt = _recovery_run(a, tmp / "kill-one-checkpoint-restart",
                         _cfg(a, "fault.recovery=restart", f"train.checkpoint_every={a.checkpoint_every}",
                              "snapshot.every=0"), f"step={at}:worker=1:kill:phase=backward", at)
    return {"snapshot_memory": snap, "checkpoint_restart": ckpt,
            "time_ratio": ckpt["seconds_to_next_step"] / snap["seconds_to_next_step"]}


def _recovery_run(a: argparse.Namespace, run: Path, cfg: Config, fail_at: str, at: int) -> dict[str, Any]:
    summary = launch(cfg, run, nodes=a.nodes, workers_per_node=a.workers_per_node, fail_at=fail_at)
    events = read_events(run)
    killed = min(e["time"] for e in events if e.get("event") == "fault_self")
    later = [e for e in events if e.get("kind") == "commit" and e.get("time", 0) > killed]
    restores = [e for e in events if e.get("event") == "job_restore"]
    restart_from = summary.get("job_restarts", [{}])[0].get("restarted_from_step") if "job_restarts" in summary else None
    resumed_at = restores[0]["step"] if restores else restart_from
    return {"killed_at_step": at, "resumed_at_step": resumed_at,
            "lost_steps_beyond_in_flight": (at - resumed_at) if resumed_at is not None else None,
            "seconds_to_next_step": min(e["time"] for e in later) - killed if later else None,
            "steps": summary["steps"]}


def _rejoin(a: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    """A killed worker restarted and admitted again: from its node's memory vs a peer's transfer."""
    out = {}
    steps = max(a.steps, 150)
    for name, extra in (("memory", ()), ("transfer", ("snapshot.every=0",))):
        cfg = load_config(preset_name=a.preset, overrides=a.overrides + [
            f"train.steps={steps}", "train.val_every=0", "train.val_batches=1", *extra])
        run = tmp / f"rejoin-{name}"
        launch(cfg, run, nodes=a.nodes, workers_per_node=a.workers_per_node, fail_at="step=5:worker=1:kill:back=8")
        events = read_events(run)
        adopt = [e for e in events if e.get("event") == "view_adopted" and 1 in e.get("joiners", [])]
        joiner = [e["adopt_s"] for e in adopt if e["worker"] == 1]
        members = [e["adopt_s"] for e in adopt if e["worker"] != 1]
        loads = [e["seconds"] for e in events if e.get("event") == "rejoin_from_memory"]
        out[name] = {"joiner_adopt_s": joiner[0] if joiner else None,
                     "members_adopt_s_max": max(members) if members else None,
                     "memory_load_s": loads[0] if loads else None, "rejoined": bool(joiner)}
    return out


def _projection(write_mb_s: float, nodes: int, per_node: int) -> dict[str, Any]:
    out = {}
    for name in ("llama-1b", "llama-7b"):
        cfg = preset(name)
        node = node_bytes(cfg, nodes, per_node) / 2
        out[name] = {"state_gb": state_bytes(cfg) / _GB, "gb_per_node": node / _GB,
                     "seconds_per_snapshot": node / per_node / (write_mb_s * 1e6)}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="unbroken bench snapshot", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--workers-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--checkpoint-every", type=int, default=5, help="DCP checkpoints of the checkpoint-restart run")
    ap.add_argument("--parts", default="bytes,in_process,overhead,kill,rejoin", help="which measurements to run")
    ap.add_argument("--out", type=Path, default=None, help="default benchmarks/results/snapshot_PRESET.json")
    a, overrides = parse_with_overrides(ap, argv)
    a.overrides = overrides
    parts = a.parts.split(",")
    valid = ("bytes", "in_process", "overhead", "kill", "rejoin")
    unknown = set(parts) - set(valid)
    if unknown:
        raise ValueError(f"--parts: unknown {', '.join(sorted(unknown))}; valid: {', '.join(valid)}")
    result: dict[str, Any] = {"benchmark": "snapshot", "preset": a.preset, "nodes": a.nodes,
                              "workers_per_node": a.workers_per_node, "steps": a.steps,
                              "machine": machine_description()}
    with tempfile.TemporaryDirectory(prefix="unbroken-snapshot-") as tmp:
        if "bytes" in parts:
            result["bytes"] = _bytes(a)
        if "in_process" in parts:
            result["in_process"] = _in_process(a, Path(tmp))
            result["projection"] = _projection(result["in_process"]["write_mb_s_per_worker"], a.nodes,
                                               a.workers_per_node)
        if "overhead" in parts:
            result["overhead"] = _overhead(a, Path(tmp))
        if "kill" in parts:
            result["kill"] = _kill_all(a, Path(tmp))
        if "rejoin" in parts:
            result["rejoin"] = _rejoin(a, Path(tmp))
    out = a.out or Path(f"benchmarks/results/snapshot_{a.preset}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1, default=str))
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1, default=str))
    print(f"wrote {out}")
    return result
