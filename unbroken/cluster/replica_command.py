"""``unbroken simulate-cluster --replica-size K ...`` and ``--validate``: the replica engine's command line.

A projection prints every input with its source and basis, the rules that
carry them to the job's size, the table of the strategies at each job MTBF,
and, for unbroken's best strategy below the target, the phases that hold it
there with what each would have to become. ``--validate`` prints the three
checks of :mod:`unbroken.cluster.validate` and sets the exit code: 0 when
every one is within its bound, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from unbroken.cluster.engine import ENGINE_STRATEGIES
from unbroken.cluster.phases import DEFAULT_INPUTS, load_inputs
from unbroken.cluster.projection import PHASES, engine_costs, phase_budget, project
from unbroken.cluster.failures import parse_mix
from unbroken.cluster.replicas import FAILURE_KINDS, LLAMA3_MIX, ReplicaSpec

__all__ = ["build_parser", "main", "uses_replica_engine"]

_FLAGS = ("--validate", "--replica-size", "--gpus", "--inputs")
_DEFAULT_MIX = ",".join(f"{k}={v}" for k, v in LLAMA3_MIX.items())
CHECKS = ("replay", "phases", "published")


def uses_replica_engine(argv: list[str]) -> bool:
    """Whether ``argv`` asks for the replica engine (a projection by replicas, or the validation)."""
    return any(a == f or a.startswith(f + "=") for a in argv for f in _FLAGS)


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="unbroken simulate-cluster", description=__doc__.splitlines()[0])
    ap.add_argument("--validate", action="store_true", help="replay real runs and published results through the "
                    "engine; exit 1 when one is outside its bound")
    ap.add_argument("--runs", type=Path, nargs="+", default=None, metavar="FILE",
                    help="soak results to replay (default benchmarks/results/soak*.json)")
    ap.add_argument("--checks", default=",".join(CHECKS), help=f"which checks of --validate (default: {','.join(CHECKS)})")
    ap.add_argument("--inputs", type=Path, default=DEFAULT_INPUTS, help="the inputs file (default %(default)s)")
    ap.add_argument("--model", default="llama-7b", help="target model preset (default llama-7b)")
    ap.add_argument("--gpus", type=int, default=100000, help="GPUs of the job (default 100000)")
    ap.add_argument("--replica-size", type=int, default=8, help="ranks of one replica (default 8)")
    ap.add_argument("--gpus-per-node", type=int, default=8, help="GPUs of a node (default 8)")
    ap.add_argument("--micro-batches", type=int, default=4, help="micro-batches per rank per step (default 4)")
    ap.add_argument("--seq-len", type=int, default=4096, help="tokens of a micro-batch (default 4096)")
    ap.add_argument("--job-mtbf-min", default="18,30", help="minutes between the job's failures, one table each "
                    "(default 18,30)")
    ap.add_argument("--mix", default=_DEFAULT_MIX,
                    help=f"shares of {', '.join(FAILURE_KINDS)} (default: Llama 3's interruptions, %(default)s)")
    ap.add_argument("--burst-share", type=float, default=0.2, help="network failures taking a switch (default 0.2)")
    ap.add_argument("--switch-nodes", type=int, default=4, help="nodes under a switch (default 4)")
    ap.add_argument("--lemon-share", type=float, default=0.01, help="share of lemon nodes (default 0.01)")
    ap.add_argument("--lemon-factor", type=float, default=10.0, help="how much more often a lemon fails (default 10)")
    ap.add_argument("--spare-nodes", type=int, default=16, help="spare nodes, paid for (default 16)")
    ap.add_argument("--replenish-h", type=float, default=2.0, help="hours until a spare taken is replaced (default 2)")
    ap.add_argument("--net-repair-h", type=float, default=0.5, help="hours a node stays cut off (default 0.5)")
    ap.add_argument("--group-nodes", type=int, default=16, help="nodes per snapshot coding group (default 16)")
    ap.add_argument("--parity", type=int, default=1, help="parity fragments per coding group (default 1)")
    ap.add_argument("--defer-after-s", type=float, default=0.0, help="hybrid: seconds before a missing replica's "
                    "rows are deferred (default 0: after the step in flight)")
    ap.add_argument("--hours", type=float, default=24.0, help="simulated hours (default 24)")
    ap.add_argument("--seeds", type=int, default=10, help="realisations (default 10)")
    ap.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--strategies", default=",".join(ENGINE_STRATEGIES), help="default: all")
    ap.add_argument("--target", type=float, default=0.99, help="goodput the budget is drawn against (default 0.99)")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    return ap


def _mix(text: str) -> dict[str, float]:
    return parse_mix(text, "KIND=SHARE (e.g. hardware=0.75)")


def _spec(a: argparse.Namespace, mtbf_min: float) -> ReplicaSpec:
    from unbroken.cluster.costs import model_size

    params, state = model_size(a.model)
    spec = ReplicaSpec(gpus=a.gpus, replica_size=a.replica_size, gpus_per_node=a.gpus_per_node, state_bytes=state,
                       params=params, micro_batches=a.micro_batches, tokens_per_micro_batch=a.seq_len,
                       job_mtbf_h=mtbf_min / 60.0, mix=_mix(a.mix), burst_share=a.burst_share,
                       switch_nodes=a.switch_nodes, lemon_share=a.lemon_share, lemon_factor=a.lemon_factor,
                       spare_nodes=a.spare_nodes, replenish_h=a.replenish_h, net_repair_h=a.net_repair_h,
                       group_nodes=a.group_nodes, parity=a.parity, hours=a.hours)
    spec.check_runtime()
    return spec


def _mtbfs(text: str) -> list[float]:
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out or any(not m > 0 for m in out):
        raise ValueError(f"--job-mtbf-min {text!r}: give minutes > 0, comma separated (e.g. 18,30)")
    return out


def main(argv: list[str]) -> dict[str, Any]:
    """Run the projection or the validation of ``argv``; returns what ``--out`` holds (``rc``: the exit code).

    Raises:
        ValueError: bad input, an input without provenance, or a configuration the runtime refuses.
    """
    a = build_parser().parse_args(argv)
    inputs = load_inputs(a.inputs)
    result = _validate(a, inputs) if a.validate else _project(a, inputs)
    result["command"] = "unbroken simulate-cluster " + " ".join(argv)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1))
        print(f"wrote {a.out}")
    return result


def _project(a: argparse.Namespace, inputs: dict[str, Any]) -> dict[str, Any]:
    strategies = tuple(s.strip() for s in a.strategies.split(",") if s.strip())
    specs = [_spec(a, m) for m in _mtbfs(a.job_mtbf_min)]  # every configuration refused before anything runs
    costs, how = engine_costs(inputs, specs[0], defer_after_s=a.defer_after_s)
    s = specs[0]
    print(f"PROJECTION (simulated, not measured): {a.model}, {s.gpus} GPUs in {s.replicas} replicas of "
          f"{s.replica_size} ({s.gpus_per_node} a node, {s.spare_nodes} spare nodes replenished in {s.replenish_h:g} h), "
          f"{s.micro_batches} micro-batches of {s.tokens_per_micro_batch} tokens a rank, shard "
          f"{s.shard_bytes / 1e9:.3g} GB a rank, mix {s.mix}, {a.hours:g} h, {a.seeds} seeds")
    print(f"failure taxonomy (parameters): mix {'given' if a.mix != _DEFAULT_MIX else 'from Llama 3 (arXiv 2407.21783, Table 5)'}; "
          f"assumptions unless given: {s.burst_share:g} of network failures take a switch's {s.switch_nodes} nodes, "
          f"{s.lemon_share:g} of nodes are lemons failing {s.lemon_factor:g}x as often, a cut-off node is back in "
          f"{s.net_repair_h:g} h, a spare taken is replaced in {s.replenish_h:g} h")
    print("inputs (value at this size, basis, scaling, source):")
    for i in inputs.values():
        print(i.line(s.replicas))
    print("rules:")
    for k, v in how.items():
        print(f"  {k:<20} {v}")
    out: dict[str, Any] = {"projection": True, "inputs": {n: i.__dict__ for n, i in inputs.items()}, "rules": how,
                           "tables": {}, "rc": 0}
    for spec in specs:
        pr = project(spec, costs, strategies=strategies, seeds=a.seeds, seed=a.seed)
        print(f"\njob MTBF {spec.job_mtbf_h * 60:g} min:")
        print(f"  {'strategy':<12} {'goodput':>17} {'lost rows':>11} {'deferred rows':>14} {'stalled h':>10} "
              f"{'degraded h':>11} {'failures':>9} {'ckpt every':>10}")
        for name, m in pr.mean.items():
            hw = pr.half_width[name]
            print(f"  {name:<12} {m['goodput']:>9.4f} ± {hw['goodput']:.4f} {m['lost_rows']:>11.4g} "
                  f"{m['deferred_rows']:>14.4g} {m['stalled_s'] / 3600:>10.3g} {m['degraded_s'] / 3600:>11.3g} "
                  f"{m['failures']:>9.1f} {int(m['ckpt_every']) or '':>10}")
        table: dict[str, Any] = {"job_mtbf_min": spec.job_mtbf_h * 60, "mean": pr.mean, "ci95_half_width": pr.half_width}
        best = max((n for n in pr.mean if n in ("spread", "hybrid")), key=lambda n: pr.mean[n]["goodput"], default=None)
        if best is not None and pr.mean[best]["goodput"] < a.target:
            rows = phase_budget(best, spec, costs, target=a.target, seeds=a.seeds, seed=a.seed)
            print(f"  {best} is below {a.target:g}: what each phase costs it, and what it would have to become "
                  "(every other phase held):")
            for r in rows:
                need = float(r["needed"])
                ratio = float(r["value"]) <= 1 and r["phase"] not in PHASES  # a throughput ratio or share: at most 1
                reach = "out of reach alone" if need < 0 or (ratio and need > 1) else f"{need:.4g}"
                print(f"    {str(r['phase']):<42} {float(r['value']):>9.4g}  costs {float(r['points']):.3f} points;"
                      f" for {a.target:g}: {reach}")
            table["budget"] = {"strategy": best, "phases": rows}
        out["tables"][f"{spec.job_mtbf_h * 60:g}"] = table
    return out


def _validate(a: argparse.Namespace, inputs: dict[str, Any]) -> dict[str, Any]:
    from unbroken.cluster.costs import DEFAULT_RESULTS_DIR
    from unbroken.cluster.validate import (all_ok, check_phases, check_published, replay_soak,
                                           validation_json)

    wanted = [c.strip() for c in a.checks.split(",") if c.strip()]
    if not wanted or set(wanted) - set(CHECKS):
        raise ValueError(f"--checks {a.checks!r}: valid are {', '.join(CHECKS)}")
    runs = a.runs if a.runs is not None else sorted(DEFAULT_RESULTS_DIR.glob("soak*.json"))
    checks: dict[str, list[Any]] = {}
    back: list[float] = []
    costs = None
    replays = [replay_soak(p, inputs) for p in runs] if {"replay", "phases"} & set(wanted) else []
    if "replay" in wanted:
        checks["replay"] = [r[0] for r in replays]
    if "phases" in wanted:
        if not replays:
            raise ValueError("--checks phases needs a soak result (--runs FILE) to take its job's phases from")
        _, back, costs = replays[-1]
        results = sorted(Path(runs[-1]).parent.glob("failover*.json"))
        checks["phases"] = check_phases(costs, results, runs[-1], back)
    if "published" in wanted:
        checks["published"] = check_published(inputs, seeds=a.seeds)
    titles = {"replay": "1. recorded runs replayed through the engine (goodput)",
              "phases": "2. modelled recovery phases against measured distributions",
              "published": "3. published systems with their stated costs"}
    for group, cs in checks.items():
        print(titles[group])
        for c in cs:
            print(c.line())
    ok = all_ok(checks)
    print("validation: every check within its bound" if ok else "validation: a check is outside its bound")
    sys.stdout.flush()
    return {"validation": validation_json(checks), "ok": ok, "rc": 0 if ok else 1}
