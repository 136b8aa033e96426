"""Sharded optimizer state benchmark: bytes per worker, step time, stall per crash with shard recovery.

``unbroken bench sharded --presets tiny,debug --nodes 2 --workers-per-node 2`` measures, in one invocation:

1. **bytes** (deterministic): optimizer-state bytes per worker, replicated vs
   sharded (the largest range's moments, the ``step`` counters, and the ring
   copy the worker holds of a peer's range), taken from the real optimizer
   objects under the job's sharding; and the projection for ``llama-1b`` and
   ``llama-7b`` at 8, 64 and 1,024 workers (bytes per GPU of fp32 parameters,
   gradient buffers, moments and the ring copy; a projection, not a measurement);
2. **steady** (real jobs, first preset): failure-free median step time,
   sharded vs replicated, in alternating jobs (``--pairs`` pairs, ABAB...),
   the ratio of each pair and their median;
3. **crash** (real jobs, first preset): a worker SIGKILLed mid-step in a
   sharded job and in a replicated one: stall per crash (the failed step's
   time beyond the median), lost steps, rows trained never or twice (ledger),
   and which ranges came from copies;
4. **restore** (a real job, first preset, one worker per node): every worker of a sharded job
   SIGKILLed with the reduction of the middle step in flight (``snapshot.every=1``,
   no checkpoint before the end): where the job was restored from (snapshot
   memory: the parameters from the snapshot, each range's moments from its ring
   copy of the same step), steps redone, lost steps, rows trained never or twice.

Snapshots (``snapshot.every``, default ``auto``) run in every job, sharded or not.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

import torch

from unbroken.agent.launcher import launch
from unbroken.bench._args import parse_with_overrides
from unbroken.report.run_report import summarize_run
from unbroken.bench.machine import machine_description
from unbroken.config import Config, load_config, preset
from unbroken.jsonl import read_jsonl
from unbroken.models import model_args
from unbroken.models.llama import count_parameters
from unbroken.runtime.ledger import read_events
from unbroken.sharding import ShardedAdamW, Sharding, ring_buddies

__all__ = ["main", "projection"]

PROJECT_PRESETS = ("llama-1b", "llama-7b")
PROJECT_WORKERS = (8, 64, 1024)
STALL_TARGET_S = 0.5
STEP_TARGET = 1.05


def _cfg(a: argparse.Namespace, name: str, *extra: str) -> Config:
    return load_config(preset_name=name, overrides=a.overrides + [
        f"train.steps={a.steps}", "train.val_every=0", "train.val_batches=1",
        f"train.workers={a.nodes * a.workers_per_node}", *extra])


def _bytes(a: argparse.Namespace, name: str) -> dict[str, Any]:
    """Optimizer-state bytes per worker of the preset's real model, replicated vs sharded."""
    from unbroken.job.builder import build_job

    cfg = _cfg(a, name, "train.shard_optimizer=true")
    job = build_job(cfg, torch.device("cpu"))
    opt = job.optimizer
    assert isinstance(opt, ShardedAdamW)  # train.shard_optimizer=true
    m = cfg.train.workers
    node_of = {w: w // a.workers_per_node for w in range(m)}
    sharding, buddies = Sharding(tuple(range(m)), opt.total), ring_buddies(range(m), node_of)
    ranges = {w: hi - lo for w, lo, hi in sharding.ranges()}
    copies = {w: sum(ranges[o] for o, h in buddies.items() if h == w) for w in range(m)}
    steps = 4 * len(opt.flat)  # one float32 step counter per parameter tensor, on every worker
    replicated = 8 * opt.total + steps
    per_worker = [8 * ranges[w] + steps for w in range(m)]
    copy = [8 * copies[w] for w in range(m)]
    worst = max(range(m), key=lambda w: per_worker[w] + copy[w])
    return {"parameters": opt.total, "workers": m, "replicated_bytes": replicated,
            "sharded_bytes": per_worker[worst], "ring_copy_bytes": copy[worst],
            "sharded_plus_copy_over_replicated": (per_worker[worst] + copy[worst]) / replicated,
            "target_fraction": 2 / m, "per_worker": {"moments_and_steps": per_worker, "ring_copy": copy}}


def projection(preset_name: str, workers: int) -> dict[str, Any]:
    """Bytes per GPU of one data-parallel worker of ``preset_name`` (fp32 master weights, gradient sums and
    reduced gradient, AdamW moments), replicated vs sharded; the sharded run's ring copy of a peer's range
    lives in the node's host memory (snapshot memory), not on the GPU."""
    cfg = preset(preset_name)
    n = count_parameters(model_args(cfg.model.preset, vocab_size=cfg.data.vocab_size))
    params, grads, moments = 4 * n, 8 * n, 8 * n
    shard = -(-moments // workers)
    return {"parameters": n, "workers": workers, "param_bytes": params, "gradient_bytes": grads,
            "replicated": {"moments": moments, "total": params + grads + moments},
            "sharded": {"moments": shard, "total": params + grads + shard, "ring_copy_host": shard}}


def _job(a: argparse.Namespace, tmp: Path, run_name: str, cfg: Config, **kw: Any) -> dict[str, Any]:
    run = tmp / run_name
    launch(cfg, run, nodes=a.nodes, workers_per_node=a.workers_per_node, **kw)
    train = [r for r in read_jsonl(run / "metrics.jsonl") if r["kind"] == "train"]
    return {"run": run, "median_step_s": statistics.median(r["step_time_s"] for r in train[3:])}


def _steady(a: argparse.Namespace, tmp: Path, name: str) -> dict[str, Any]:
    ratios: list[float] = []
    medians: dict[str, list[float]] = {"replicated": [], "sharded": []}
    for i in range(a.pairs):
        rep = _job(a, tmp, f"replicated-{i}", _cfg(a, name))["median_step_s"]
        sh = _job(a, tmp, f"sharded-{i}", _cfg(a, name, "train.shard_optimizer=true"))["median_step_s"]
        medians["replicated"].append(rep)
        medians["sharded"].append(sh)
        ratios.append(sh / rep)
    return {"ratios": ratios, "ratio_median": statistics.median(ratios), "median_step_s": medians,
            "target": STEP_TARGET}


def _crash(a: argparse.Namespace, tmp: Path, name: str) -> dict[str, Any]:
    at = a.steps // 2
    out: dict[str, Any] = {}
    for kind, extra in (("replicated", ()), ("sharded", ("train.shard_optimizer=true",))):
        run = _job(a, tmp, f"crash-{kind}", _cfg(a, name, "mecefo.policy=spread", *extra), restart="never",
                   fail_at=f"step={at}:worker=1:kill:phase=forward")["run"]
        report = summarize_run(run)
        copies = sorted({w for e in read_events(run) if e.get("event") == "resharded" for w in e["from_copies"]})
        out[kind] = {"stall_s": [f["stall_s"] for f in report["failure_details"]],
                     "lost_steps": report["lost_steps"],
                     "rows_never_or_twice": report["rows_trained_never"] + report["rows_trained_twice"],
                     "ranges_from_copies": copies}
    out["target_stall_s"] = STALL_TARGET_S
    return out


def _restore(a: argparse.Namespace, tmp: Path, name: str) -> dict[str, Any]:
    """One worker per node (each the other's ring buddy): with more, the kills land milliseconds apart, and
    two buddies dead before the rest stop the job (``ShardLost``) before the others are killed."""
    at = a.steps // 2
    whole = ",".join(f"step={at}:worker={w}:kill:phase=allreduce" for w in range(a.nodes))
    cfg = _cfg(a, name, "train.shard_optimizer=true", "mecefo.policy=spread", "snapshot.every=1",
               "train.checkpoint_every_s=0", f"train.workers={a.nodes}")
    run = tmp / "restore"
    launch(cfg, run, nodes=a.nodes, workers_per_node=1, restart="on-failure", fail_at=whole)
    report = summarize_run(run)
    loaded = [e for e in read_events(run) if e.get("event") == "restored"]
    restores = report["snapshots"]["restores"]
    return {"at_step": at, "restores": restores, "steps_redone": [at - r["step"] for r in restores],
            "moment_ranges_from_copies": sorted({e.get("moment_ranges", 0) for e in loaded}),
            "moment_bytes_broadcast": sum(e.get("moment_bytes_sent", 0) for e in loaded),
            "lost_steps": report["lost_steps"],
            "rows_never_or_twice": report["rows_trained_never"] + report["rows_trained_twice"]}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="unbroken bench sharded", description=__doc__.splitlines()[0])
    ap.add_argument("--presets", default="tiny,debug", help="bytes for each; jobs with the first")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--workers-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--pairs", type=int, default=2, help="alternating replicated/sharded job pairs (steady)")
    ap.add_argument("--parts", default="bytes,steady,crash,restore", help="which measurements to run")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/sharded.json"))
    a, overrides = parse_with_overrides(ap, argv)
    a.overrides = overrides
    parts, names = a.parts.split(","), a.presets.split(",")
    unknown = set(parts) - {"bytes", "steady", "crash", "restore"}
    if unknown:
        raise ValueError(f"--parts: unknown {', '.join(sorted(unknown))}; valid: bytes, steady, crash, restore")
    result: dict[str, Any] = {"benchmark": "sharded", "presets": names, "nodes": a.nodes,
                              "workers_per_node": a.workers_per_node, "steps": a.steps,
                              "machine": machine_description()}
    if "bytes" in parts:
        result["bytes"] = {n: _bytes(a, n) for n in names}
        result["projection"] = {p: {str(w): projection(p, w) for w in PROJECT_WORKERS} for p in PROJECT_PRESETS}
    with tempfile.TemporaryDirectory(prefix="unbroken-sharded-") as tmp:
        if "steady" in parts:
            result["steady"] = _steady(a, Path(tmp), names[0])
        if "crash" in parts:
            result["crash"] = _crash(a, Path(tmp), names[0])
        if "restore" in parts:
            result["restore"] = _restore(a, Path(tmp), names[0])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=str))
    _print(result)
    print(f"wrote {a.out}")
    return result


def _print(r: dict[str, Any]) -> None:
    for name, b in r.get("bytes", {}).items():
        print(f"{name}: {b['parameters']:,} parameters, {b['workers']} workers: optimizer state per worker "
              f"replicated {b['replicated_bytes']:,} B, sharded {b['sharded_bytes']:,} B + ring copy "
              f"{b['ring_copy_bytes']:,} B = {b['sharded_plus_copy_over_replicated']:.3f} of replicated "
              f"(target 2/m = {b['target_fraction']:.3f})")
    for p, by_w in r.get("projection", {}).items():
        for w, x in by_w.items():
            print(f"projection {p} x {w} workers: GiB per GPU replicated {x['replicated']['total'] / 2**30:.1f}, "
                  f"sharded {x['sharded']['total'] / 2**30:.1f} (moments {x['sharded']['moments'] / 2**30:.2f}; "
                  f"ring copy {x['sharded']['ring_copy_host'] / 2**30:.2f} in host memory)")
    if "steady" in r:
        s = r["steady"]
        print(f"failure-free step time sharded / replicated: {s['ratio_median']:.3f} (pairs "
              f"{[round(x, 3) for x in s['ratios']]}; target <= {s['target']})")
    if "crash" in r:
        for kind in ("replicated", "sharded"):
            c = r["crash"][kind]
            print(f"{kind:>10}: stall per crash {[round(x, 3) for x in c['stall_s'] if x is not None]} s, "
                  f"lost steps {c['lost_steps']}, rows never/twice {c['rows_never_or_twice']}, "
                  f"ranges from copies {c['ranges_from_copies']}")
    if "restore" in r:
        x = r["restore"]
        print(f"every worker killed at step {x['at_step']}: restored from "
              f"{[(y['source'], y['step']) for y in x['restores']]}, steps redone {x['steps_redone']}, moments "
              f"from {x['moment_ranges_from_copies']} ring copies ({x['moment_bytes_broadcast']:,} B broadcast), "
              f"lost steps {x['lost_steps']}, rows never/twice {x['rows_never_or_twice']}")
