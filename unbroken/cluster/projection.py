"""The replica engine's projection: inputs to costs at the job's scale, seeds, the table, and what holds goodput down.

:func:`engine_costs` turns the inputs (:mod:`unbroken.cluster.phases`) into
the seconds one pass uses at a job's size (rules below, each printed with the
result); :func:`project` runs every strategy over the same seeded failures;
:func:`phase_budget` says, for one strategy, how many goodput points each
phase costs (the pass again with that phase at zero) and what the phase would
have to become for the strategy to reach a target.

Rules (``S`` the state's bytes, ``k`` the replica size, ``G`` the GPUs, ``R``
the replicas): step ``= 6 P tokens_per_rank / (peak * mfu)``; a rank's shard
``S / k`` loads at ``load_gbs`` (a rejoin) and, after a whole-job restart,
comes from storage (``ckpt-disk``: inside ``job_restart_s``) or host memory
(``ckpt-memory``: ``job_restart_s - S/k / storage_gbs + S/k / load_gbs``); a
checkpoint writes each shard once, ``S / G`` per GPU, staged at ``stage_gbs``
(the blocking part) and written at ``memory_write_gbs`` or ``storage_gbs``;
the view change and the admission scale with the ``R`` replicas taking part.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from unbroken.cluster.engine import ENGINE_STRATEGIES, EngineCosts, EngineOutcome, run_engine
from unbroken.cluster.phases import Input
from unbroken.cluster.replicas import ReplicaSpec, replica_events

__all__ = ["PHASES", "Projection", "engine_costs", "phase_budget", "project"]

_GB = 1e9

# Engine fields that are recovery phases, with the input that sets each (for the budget).
PHASES = {"detect_crash_s": "detect_crash_s", "detect_hang_s": "detect_hang_s", "reconfigure_s": "reconfigure_s",
          "start_warm_s": "process_start_warm_s", "start_cold_s": "process_start_cold_s",
          "cuda_warm_s": "cuda_warm_s", "cuda_cold_s": "cuda_cold_s", "load_s": "load_gbs",
          "admission_s": "admission_s", "restart_memory_s": "job_restart_s", "restart_disk_s": "job_restart_s"}


def engine_costs(inputs: dict[str, Input], spec: ReplicaSpec, *, defer_after_s: float = 60.0,
                 cores: int | None = None, cuda: bool = True,
                 step_s: float | None = None) -> tuple[EngineCosts, dict[str, str]]:
    """The engine's seconds for ``spec`` and how each was had (name -> rule and sources).

    ``cuda=False``: a CPU job (no CUDA context, no compile); ``step_s``: a measured failure-free step
    instead of the FLOPs rule.
    """
    v = {n: i.at(spec.replicas) for n, i in inputs.items()}
    tokens = spec.micro_batches * spec.tokens_per_micro_batch
    step = step_s if step_s is not None else 6.0 * spec.params * tokens / (v["peak_tflops"] * 1e12 * v["mfu"])
    shard, per_gpu = spec.shard_bytes, spec.state_bytes / spec.gpus
    load = shard / (v["load_gbs"] * _GB)
    from_storage = shard / (v["storage_gbs"] * _GB)
    restart_memory = max(0.0, v["job_restart_s"] - from_storage) + load
    c = EngineCosts(step_s=step, ratio_unbroken=v["overhead_unbroken"], ratio_drop_step=v["overhead_drop_step"],
                    detect_crash_s=v["detect_crash_s"], detect_hang_s=v["detect_hang_s"],
                    reconfigure_s=v["reconfigure_s"], start_warm_s=v["process_start_warm_s"],
                    start_cold_s=v["process_start_cold_s"], cuda_warm_s=v["cuda_warm_s"] if cuda else 0.0,
                    cuda_cold_s=v["cuda_cold_s"] if cuda else 0.0, load_s=load,
                    admission_s=v["admission_s"], restart_memory_s=restart_memory,
                    restart_disk_s=v["job_restart_s"], save_memory_s=per_gpu / (v["stage_gbs"] * _GB),
                    save_disk_s=per_gpu / (v["stage_gbs"] * _GB),
                    write_memory_s=per_gpu / (v["memory_write_gbs"] * _GB),
                    write_disk_s=per_gpu / (v["storage_gbs"] * _GB), defer_after_s=defer_after_s, cores=cores)
    how = {
        "step_s": (f"measured failure-free step {step:.4g} s" if step_s is not None else
                   f"6 * {spec.params:.4g} params * {tokens} tokens a rank / ({v['peak_tflops']:g} TFLOP/s * mfu "
                   f"{v['mfu']:g})"),
        "load_s": f"shard {shard / _GB:.4g} GB (S / replica size {spec.replica_size}) / load_gbs {v['load_gbs']:g}",
        "restart_memory_s": f"job_restart_s {v['job_restart_s']:g} - shard from storage {from_storage:.4g} s + "
                            f"shard from memory {load:.4g} s",
        "save_disk_s": f"{per_gpu / 1e6:.4g} MB a GPU (S / G) staged at stage_gbs {v['stage_gbs']:g}; written at "
                       f"storage_gbs {v['storage_gbs']:g} ({c.write_disk_s:.3g} s) / memory_write_gbs "
                       f"{v['memory_write_gbs']:g} ({c.write_memory_s:.3g} s)",
        "reconfigure_s": f"{v['reconfigure_s']:.4g} s at {spec.replicas} replicas",
        "admission_s": f"{v['admission_s']:.4g} s at {spec.replicas} replicas",
    }
    if not cuda:
        how["cuda"] = "a CPU job: no CUDA context, no compile"
    return c, how


@dataclass
class Projection:
    """Every strategy's mean and 95% half-width over seeds (goodput and the rest), and the pass's setup."""

    spec: ReplicaSpec
    costs: EngineCosts
    seeds: int
    mean: dict[str, dict[str, float]] = field(default_factory=dict)
    half_width: dict[str, dict[str, float]] = field(default_factory=dict)


def project(spec: ReplicaSpec, costs: EngineCosts, *, strategies: tuple[str, ...] = ENGINE_STRATEGIES,
            seeds: int = 10, seed: int = 0) -> Projection:
    """Every strategy over the same ``seeds`` realisations of ``spec``.

    Raises:
        ValueError: unknown strategy, or seeds < 1.
    """
    unknown = [s for s in strategies if s not in ENGINE_STRATEGIES]
    if unknown or seeds < 1:
        raise ValueError(f"strategies {unknown or list(strategies)}, seeds={seeds}: valid strategies are "
                         f"{', '.join(ENGINE_STRATEGIES)}, seeds >= 1")
    rows: dict[str, list[dict[str, float]]] = {s: [] for s in strategies}
    for i in range(seeds):
        events = replica_events(spec, seed + i)
        for s in strategies:
            rows[s].append(run_engine(s, spec, costs, events).as_dict())
    out = Projection(spec, costs, seeds)
    for s in strategies:
        out.mean[s], out.half_width[s] = {}, {}
        for k in rows[s][0]:
            xs = np.array([r[k] for r in rows[s]])
            out.mean[s][k] = float(xs.mean())
            out.half_width[s][k] = float(1.96 * xs.std(ddof=1) / math.sqrt(len(xs))) if len(xs) > 1 else 0.0
    return out


def _mean_goodput(strategy: str, spec: ReplicaSpec, costs: EngineCosts, seeds: int, seed: int) -> float:
    outs: list[EngineOutcome] = [run_engine(strategy, spec, costs, replica_events(spec, seed + i))
                                 for i in range(seeds)]
    return float(np.mean([o.goodput for o in outs]))


def phase_budget(strategy: str, spec: ReplicaSpec, costs: EngineCosts, *, target: float = 0.99, seeds: int = 10,
                 seed: int = 0) -> list[dict[str, float | str]]:
    """Goodput points each phase costs ``strategy`` and the value it would have to reach for ``target``.

    A phase's cost is the goodput gained with it at zero (same seeds); its value for the target is found on
    the line through both passes (goodput is close to linear in a stall's length), holding every other phase:
    ``needed`` < 0 means the target is out of this phase's reach alone. The failure-free ratio and the paid
    spare nodes are in the list too (as ratios).
    """
    base = _mean_goodput(strategy, spec, costs, seeds, seed)
    out: list[dict[str, float | str]] = []
    gap = target - base
    for name in PHASES:
        value = getattr(costs, name)
        if value <= 0:
            continue
        changes: dict[str, Any] = {name: 0.0}
        zero = _mean_goodput(strategy, spec, dataclasses.replace(costs, **changes), seeds, seed)
        points = zero - base
        if points < 1e-5:  # under 0.001 points: the phase does not hold the strategy down
            continue
        needed = value - gap / points * value
        out.append({"phase": name, "value": value, "points": points * 100, "needed": needed})
    ratio_name = "ratio_drop_step" if strategy == "drop-step" else "ratio_unbroken"
    if not strategy.startswith("ckpt"):
        ratio = getattr(costs, ratio_name)
        out.append({"phase": ratio_name, "value": ratio, "points": (base / ratio - base) * 100,
                    "needed": ratio * target / base})
    paid = spec.gpus / (spec.gpus + spec.spare_nodes * spec.gpus_per_node)
    if paid < 1:
        out.append({"phase": "spare GPUs paid (share of GPUs training)", "value": paid,
                    "points": (base / paid - base) * 100, "needed": paid * target / base})
    return sorted(out, key=lambda r: -float(r["points"]))
