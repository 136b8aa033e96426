"""``unbroken simulate-cluster``: goodput of recovery strategies at cluster scale, from measured costs.

Prints the figures used (each with the benchmark file and key it came from,
or the parameter or scaling rule), then a table of goodput, lost, redone and
approximated samples and degraded time with 95% intervals over seeds; writes
JSON (``--out``) and a goodput-vs-cluster-size plot (``--plot``). Every
result is a projection, not a measurement.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from unbroken.cluster.costs import default_cost_files, load_costs
from unbroken.cluster.failures import DEFAULT_MIX, KINDS, FailureSpec, parse_mix
from unbroken.cluster.montecarlo import SimOptions, build_strategies, run_monte_carlo
from unbroken.cluster.report import costs_lines, estimates_json, plot_sweep, table_lines
from unbroken.cluster.scaling import TargetHardware, scale_costs
from unbroken.cluster.strategies import STRATEGIES

__all__ = ["build_parser", "main"]

SWEEP_DEFAULT = "64,256,1024,4096,16384,65536,100000"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="unbroken simulate-cluster", description=__doc__.splitlines()[0],
                                 epilog="With --replica-size, --gpus, --inputs or --validate: the replica engine "
                                        "(recovery phases with their sources; unbroken simulate-cluster "
                                        "--replica-size 8 --help lists its options)")
    ap.add_argument("--model", default="llama-7b", help="target model preset (default llama-7b)")
    ap.add_argument("--costs", type=Path, nargs="+", default=None, metavar="FILE",
                    help="benchmark JSON files to read costs from (default: benchmarks/results/*.json)")
    ap.add_argument("--workers", type=int, default=16384, help="data-parallel workers G (default 16384)")
    ap.add_argument("--workers-per-node", type=int, default=8, help="workers lost with a node (default 8)")
    mt = ap.add_mutually_exclusive_group()
    mt.add_argument("--job-mtbf-h", type=float, default=None, help="mean hours between failures of the job "
                    "at --workers (default 3.0)")
    mt.add_argument("--mtbf-h", type=float, default=None, help="mean hours between failures of one worker")
    ap.add_argument("--mix", default=",".join(f"{k}={v}" for k, v in DEFAULT_MIX.items()),
                    help=f"fractions of failure kinds {', '.join(KINDS)} (default %(default)s; an assumption)")
    ap.add_argument("--repair-h", type=float, default=2.0, help="hours until a lost node is back (default 2)")
    ap.add_argument("--spare-nodes", type=int, default=0, help="warm spare nodes (paid for; default 0)")
    ap.add_argument("--no-standby", action="store_true", help="no warm standby process per node: cold restarts")
    ap.add_argument("--hours", type=float, default=24.0, help="simulated wall-clock hours (default 24)")
    ap.add_argument("--seeds", type=int, default=20, help="realisations (default 20)")
    ap.add_argument("--seed", type=int, default=0, help="first seed (default 0)")
    ap.add_argument("--strategies", default=",".join(STRATEGIES), help="default: all")
    ap.add_argument("--ckpt-every", type=int, default=None,
                    help="also checkpoint-restart with this checkpoint interval in steps (Young/Daly always shown)")
    ap.add_argument("--snapshot-every", type=int, default=1, help="unbroken: a snapshot every N steps (default 1)")
    hw = ap.add_argument_group("target hardware (parameters, not measured here)")
    for name, default, text in (("gpu-tflops", 989.0, "peak TFLOP/s per worker"), ("mfu", 0.4, "MFU"),
                                ("seq-len", 4096, "tokens per row"), ("rows", 4, "rows per worker per step"),
                                ("step-s", None, "failure-free step seconds (default from FLOPs)"),
                                ("net-gbs", 25.0, "GB/s of a peer-to-peer state transfer"),
                                ("snapshot-gbs", None, "GB/s of a snapshot write (default: measured)"),
                                ("ckpt-gbs", None, "GB/s of a checkpoint save (default: measured)"),
                                ("disk-gbs", None, "GB/s of a checkpoint restore (default: measured)"),
                                ("startup-s", None, "seconds to restart a whole job (default: measured)")):
        hw.add_argument(f"--{name}", type=type(default) if default is not None else float, default=default,
                        help=f"{text} (default {default if default is not None else 'see text'})")
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON")
    ap.add_argument("--plot", type=Path, default=None, help="goodput vs cluster size (--sweep), PNG")
    ap.add_argument("--sweep", default=SWEEP_DEFAULT, help="cluster sizes of --plot, at the same MTBF per worker and "
                    "the same share of spare nodes")
    return ap


def _mix(text: str) -> dict[str, float]:
    return parse_mix(text, "KIND=FRACTION (e.g. crash=0.5)")


def _spec(a: argparse.Namespace, workers: int) -> FailureSpec:
    if a.mtbf_h is not None:
        worker_mtbf = a.mtbf_h
    else:
        job = 3.0 if a.job_mtbf_h is None else a.job_mtbf_h
        if not job > 0:
            raise ValueError(f"--job-mtbf-h={job!r} must be > 0 (hours between failures of the job)")
        worker_mtbf = job * a.workers
    return FailureSpec(workers=workers, workers_per_node=a.workers_per_node, worker_mtbf_h=worker_mtbf,
                       mix=_mix(a.mix), repair_h=a.repair_h, spare_nodes=a.spare_nodes, duration_h=a.hours)


def _hardware(a: argparse.Namespace) -> TargetHardware:
    return TargetHardware(gpu_tflops=a.gpu_tflops, mfu=a.mfu, seq_len=a.seq_len, rows=a.rows, step_s=a.step_s,
                          net_gbs=a.net_gbs, snapshot_gbs=a.snapshot_gbs, ckpt_gbs=a.ckpt_gbs,
                          disk_gbs=a.disk_gbs, startup_s=a.startup_s)


def _options(a: argparse.Namespace) -> SimOptions:
    return SimOptions(strategies=tuple(s.strip() for s in a.strategies.split(",") if s.strip()), seeds=a.seeds,
                      seed=a.seed, ckpt_every=a.ckpt_every, snapshot_every=a.snapshot_every,
                      standby=not a.no_standby)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the simulation of ``argv``; returns what ``--out`` holds.

    Raises:
        ValueError: bad input (each message names the value and the fix).
    """
    from unbroken.cluster.replica_command import main as replica_main, uses_replica_engine

    if uses_replica_engine(list(sys.argv[2:] if argv is None else argv)):  # replicas, phases, --validate
        return replica_main(list(sys.argv[2:] if argv is None else argv))
    a = build_parser().parse_args(argv)
    spec, hw, opts = _spec(a, a.workers), _hardware(a), _options(a)
    files = a.costs if a.costs is not None else default_cost_files()
    if not files:
        raise ValueError("no costs file: run the benchmarks (unbroken bench failover, snapshot, mecefo-cost) "
                         "or pass --costs FILE ...")
    measured = load_costs(files, a.model)
    costs = scale_costs(measured, model=a.model, workers=a.workers, workers_per_node=a.workers_per_node, hw=hw)
    build_strategies(spec, costs, opts)  # bad input (G < 2 for a takeover strategy) before anything is printed
    print(f"PROJECTION (simulated, not measured): {a.model}, {a.workers} workers ({a.workers_per_node} per node, "
          f"{a.spare_nodes} spare nodes), job MTBF {spec.job_mtbf_h:.3g} h, mix {spec.mix}, {a.hours:g} h, "
          f"{a.seeds} seeds")
    print("costs used:")
    print("\n".join(costs_lines(costs)))
    est = run_monte_carlo(spec, costs, opts)
    print("\n".join(table_lines(est, batch_rows=a.workers * costs.rows, hours=a.hours)))
    command = "unbroken simulate-cluster " + " ".join(argv if argv is not None else sys.argv[2:])
    result: dict[str, Any] = {"projection": True, "command": command,
                              "model": a.model, "spec": {**spec.__dict__, "job_mtbf_h": spec.job_mtbf_h},
                              "options": opts.__dict__, "hardware": hw.__dict__,
                              "costs": {k: {"value": f.value, "unit": f.unit, "source": f.source}
                                        for k, f in costs.figures().items()},
                              "cost_files_not_used": measured.unused, "results": estimates_json(est)}
    if a.plot is not None:
        result["sweep"] = _sweep(a, measured, hw, opts)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(result, indent=1, default=list))
        print(f"wrote {a.out}")
    return result


def _sweep(a: argparse.Namespace, measured: Any, hw: TargetHardware, opts: SimOptions) -> dict[str, Any]:
    sizes = [int(x) for x in a.sweep.split(",") if x.strip()]
    per_worker = _spec(a, a.workers).worker_mtbf_h
    out, sweep = {}, {}
    for g in sizes:
        # The same share of spare nodes at every size (at least one when any is asked for).
        spares = max(1, round(a.spare_nodes * g / a.workers)) if a.spare_nodes else 0
        spec = FailureSpec(workers=g, workers_per_node=a.workers_per_node, worker_mtbf_h=per_worker,
                           mix=_mix(a.mix), repair_h=a.repair_h, spare_nodes=spares, duration_h=a.hours)
        costs = scale_costs(measured, model=a.model, workers=g, workers_per_node=a.workers_per_node, hw=hw)
        sweep[g] = run_monte_carlo(spec, costs, opts)
        out[str(g)] = {"job_mtbf_h": spec.job_mtbf_h, "spare_nodes": spares, "results": estimates_json(sweep[g])}
        print(f"  G={g:>6}: " + ", ".join(f"{e.name.split(' (')[0]} {e.mean['goodput']:.4f}" for e in sweep[g]))
    plot_sweep(sweep, a.plot, title=f"PROJECTION: {a.model}, MTBF {per_worker / 24 / 365:.2f} years per worker, "
               f"{a.spare_nodes} spare nodes per {a.workers} workers, "
               f"snapshot every {a.snapshot_every}, {a.seeds} seeds")
    print(f"wrote {a.plot}")
    return out
