"""Goodput check: the cluster simulator's cost model against real multi-process runs under a failure trace.

``unbroken bench goodput-check`` runs (through ``unbroken bench failover``'s
trace part: the same jobs, the same runner) a failure-free job, one job per
takeover policy and one checkpoint-restart job under a failure trace (default
``tiny``, 4 workers on 2 nodes, ``high``), keeps their run directories, and
predicts each job's throughput relative to failure-free from:

* the run's own failure trace (``fault_trace.json``: which worker is down at
  which step) and, for checkpoint-restart, the checkpoint interval;
* the simulator's step-cost model (:func:`unbroken.cluster.degraded.step_load`:
  the runtime's row assignment per policy, MeCeFO's measured FLOPs ratio, and
  the machine's cores shared by the workers);
* costs measured by the other benchmarks (``--costs``): detection + stall per
  crash (``failover``), MeCeFO's FLOPs ratio (``mecefo-cost``) and a
  checkpoint-restart's cost (``snapshot``: seconds from a kill to the next
  step minus the steps redone);
* the share of a step that does not grow with its rows (the optimizer step,
  the reduction, the snapshot copy), measured by the check itself: two short
  failure-free jobs of as many workers as the machine has cores (so no two
  share a core), at the micro-batch and at twice it; a step of ``T1`` and
  ``T2`` seconds gives ``fixed = 2 - T2 / T1``, since ``T = F + C * rows``.
  ``--fixed-share`` gives it instead (the projections default to 0: the whole
  step scales with the rows a worker computes, the conservative choice).

The prediction replays the steps the throughput is measured over (first to
last committed step in ``metrics.jsonl``): a checkpoint-restart that goes back
to step 0 truncates the metrics, so it falls before the measured window, as
in the measurement. Two measured ratios are printed: the benchmark's (tokens/s
of the run over the failure-free run's, two runs at different times on a
shared machine) and one normalised inside the run (the median step before the
first failure as the failure-free step), which load drift between runs does
not move. The check passes when the prediction is within ``--tolerance``
(relative) of the in-run ratio.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
from pathlib import Path
from typing import Any

from unbroken.bench.failover import _trace as run_trace
from unbroken.cluster.costs import MeasuredCosts, default_cost_files, load_costs
from unbroken.cluster.degraded import step_load
from unbroken.jsonl import read_jsonl

__all__ = ["main", "predict_ratio"]


def _train(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def _outages(run_dir: Path) -> list[tuple[int, int, int]]:
    path = run_dir / "fault_trace.json"
    if not path.exists():
        return []
    return [(o["worker"], o["start_step"], o["end_step"]) for o in json.loads(path.read_text())["outages"]]


def predict_ratio(*, policy: str | None, outages: list[tuple[int, int, int]], first: int, last: int,
                  workers: int, rows: int, cores: int | None, fixed: float, approx: float, svd: float,
                  stalls: dict[int, float], step_s: float, restarts: list[tuple[int, int]] | None = None,
                  restart_s: float = 0.0) -> float:
    """Predicted throughput relative to failure-free over the committed steps ``first..last``.

    ``policy`` None is checkpoint-restart: each restart ``(failed_at, restarted_from)`` costs
    ``restart_s`` plus the steps redone, ``failed_at - 1 - restarted_from``; one that goes back to
    step 0 falls before the measured window (its metrics are truncated). Otherwise each step takes
    ``step_s`` times the degraded factor of the workers down at that step (``outages``: worker,
    first step down, step back), plus the one-off ``stalls`` (seconds per step: failures, admissions).
    """
    if policy is None:
        wall = (last - first) * step_s
        for failed_at, back_to in restarts or []:
            if back_to > 0 and first <= failed_at <= last:
                wall += restart_s + (failed_at - 1 - back_to) * step_s
        return (last - first) * step_s / wall
    wall = 0.0
    for s in range(first + 1, last + 1):
        down = [w for w, a, b in outages if a <= s < b]
        f = step_load(policy, workers=workers, rows=rows, down=down, approx=approx, svd=svd, cores=cores,
                      fixed=fixed).factor
        wall += step_s * f + stalls.get(s, 0.0)
    return (last - first) * step_s / wall


def _recorded(run_dir: Path, fig: dict[str, Any]) -> dict[str, Any]:
    """The failures and rejoins the run recorded (its realisation of the trace, which the runtime may add to).

    A worker's outage lasts from its planned failure to its first recorded rejoin at or after the planned
    return; each failure stalls the job by the measured crash or hang stall (by how it was detected),
    each admission of a joiner (``view_adopted`` with joiners) by the measured rejoin stall.
    """
    from unbroken.bench.report import summarize_run

    rep = summarize_run(run_dir)
    back: dict[int, list[int]] = {}
    for r in rep["rejoins"]:
        back.setdefault(int(r["worker"]), []).append(int(r["step"]))
    outages = []
    for w, a, b in _outages(run_dir):
        later = [s for s in back.get(w, []) if s >= b]
        outages.append((w, a, min(later) if later else b))
    stalls: dict[int, float] = {}
    kinds = []
    for f in rep["failure_details"]:
        hang = not str(f["reason"]).startswith("CollectiveFailed")
        kinds.append("hang" if hang else "crash")
        stalls[f["step"]] = stalls.get(f["step"], 0.0) + (fig["hang_stall_s"] if hang else fig["stall_s"])
    admitted = {(e["gen"], e["step"]) for e in read_jsonl(run_dir / "events.jsonl")
                if e.get("event") == "view_adopted" and e.get("joiners")}
    for _, step in admitted:
        stalls[step] = stalls.get(step, 0.0) + fig["rejoin_stall_s"]
    return {"outages": outages, "stalls": stalls, "failure_kinds": kinds, "admissions": len(admitted)}


def _measured(run_dir: Path, none_step_s: float) -> dict[str, Any]:
    train = _train(run_dir)
    first, last = train[0]["step"], train[-1]["step"]
    span = train[-1]["time"] - train[0]["time"]
    starts = [a for _, a, _ in _outages(run_dir) if a > first]
    before = [b["time"] - a["time"] for a, b in zip(train, train[1:]) if b["step"] < min(starts, default=10**9)]
    own = statistics.median(before[1:] or before) if before else math.nan  # the first interval is warm-up
    return {"first_step": first, "last_step": last, "span_s": span,
            "ratio_vs_failure_free_run": (last - first) * none_step_s / span,
            "failure_free_step_in_run_s": own, "ratio_in_run": (last - first) * own / span}


def _per_state(run_dir: Path, rec: dict[str, Any], policy: str, workers: int, rows: int, cores: int,
               fig: dict[str, Any], fixed: float, own_step_s: float) -> list[dict[str, Any]]:
    """Median step time per set of workers down (steps without a failure or admission), over the run's
    failure-free step, against the model's factor: the degraded-step model alone, robust to the spikes
    other jobs' load puts into single steps."""
    train = _train(run_dir)
    by_state: dict[tuple[int, ...], list[float]] = {}
    for prev, cur in zip(train, train[1:]):
        st = cur["step"]
        if st in rec["stalls"]:
            continue
        down = tuple(sorted(w for w, a, b in rec["outages"] if a <= st < b))
        by_state.setdefault(down, []).append(cur["time"] - prev["time"])
    out = []
    for down, xs in sorted(by_state.items()):
        f = step_load(policy, workers=workers, rows=rows, down=list(down), approx=fig["approx"], svd=fig["svd"],
                      cores=cores, fixed=fixed).factor
        out.append({"down": list(down), "steps": len(xs), "measured_factor": statistics.median(xs) / own_step_s,
                    "predicted_factor": f})
    return out


def fixed_share_of(t1: float, t2: float) -> float:
    """The share of a step that does not grow with its rows, from steps of ``t1`` s at ``rows`` and ``t2`` s
    at ``2 * rows`` (``T = F + C * rows``: ``F / t1 = 2 - t2 / t1``), clamped to ``[0, 0.95]``.

    Raises:
        ValueError: a step time that is not a positive number.
    """
    if not (t1 > 0 and t2 > 0 and math.isfinite(t1) and math.isfinite(t2)):
        raise ValueError(f"step times {t1!r} and {t2!r} s: need two positive, finite times")
    return min(0.95, max(0.0, 2.0 - t2 / t1))


def _median_step(run_dir: Path) -> float:
    """Median interval between committed steps, past the first fifth (at least 3 steps) of warm-up."""
    train = _train(run_dir)
    steps = [b["time"] - a["time"] for a, b in zip(train, train[1:])]
    return statistics.median(steps[max(3, len(steps) // 5):] or steps)


def _fixed_share(a: argparse.Namespace, runs: Path, cores: int, micro_batch: int) -> dict[str, Any]:
    """Measure the fixed share (see the module docstring), or read the runs back with ``--reuse``."""
    from unbroken.bench.failover import _cfg, _run

    workers = max(1, min(cores, a.nodes * a.workers_per_node))
    one_node = argparse.Namespace(**{**vars(a), "nodes": 1, "workers_per_node": workers})
    steps = max(20, a.steps // 2)
    times: dict[int, list[float]] = {1: [], 2: []}
    for rep in range(2):  # interleaved, so that a drift of the machine's load moves both alike
        for k in (1, 2):
            name = f"fixed_rows{k}_{rep}"
            if not a.reuse:
                _run(one_node, runs, name, _cfg(one_node, f"data.micro_batch={k * micro_batch}",
                                                f"train.steps={steps}"))
            times[k].append(_median_step(runs / name))
    t1, t2 = statistics.fmean(times[1]), statistics.fmean(times[2])
    return {"fixed_share": fixed_share_of(t1, t2), "step_s_rows": times[1], "step_s_2rows": times[2],
            "workers": workers, "rows": micro_batch, "steps": steps,
            "source": f"measured: {workers} failure-free worker(s) on one node, median step {t1:.3f} s at "
                      f"{micro_batch} rows and {t2:.3f} s at {2 * micro_batch} (mean of 2 runs each)"}


def _figures(m: MeasuredCosts) -> dict[str, Any]:
    snap_step = m.get("snapshot.step_s").value
    kill = json.loads(Path(m.get("snapshot.ckpt_restart_s").source.split(" [")[0]).read_text())["kill"]
    redone = kill["checkpoint_restart"]["killed_at_step"] - kill["checkpoint_restart"]["resumed_at_step"] + 1
    return {"approx": m.get("mecefo.approx_ratio").value, "svd": m.get("mecefo.svd_share").value,
            "stall_s": m.get("failover.crash_stall_s").value, "hang_stall_s": m.get("failover.hang_stall_s").value,
            "rejoin_stall_s": m.get("failover.rejoin_stall_s").value,
            "restart_s": m.get("snapshot.ckpt_restart_s").value - redone * snap_step}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="unbroken bench goodput-check", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--workers-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--trace", default="high")
    ap.add_argument("--job-hours", type=float, default=2.0)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--policies", default="neighbor,spread,spread-approx")
    ap.add_argument("--costs", type=Path, nargs="+", default=None, help="default: benchmarks/results/*.json")
    ap.add_argument("--runs-dir", type=Path, default=None, help="keep the runs here (default: a temporary folder)")
    ap.add_argument("--reuse", action="store_true", help="read the runs already in --runs-dir instead of running")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--fixed-share", type=float, default=None,
                    help="share of a failure-free step that does not grow with the rows computed (default: "
                    "measured by two short failure-free jobs, see above)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/goodput_check.json"))
    a = ap.parse_args(argv)
    if a.fixed_share is not None and not 0.0 <= a.fixed_share < 1.0:
        raise ValueError(f"--fixed-share={a.fixed_share}: need a share in [0, 1)")
    if a.reuse and a.runs_dir is None:
        raise ValueError("--reuse needs --runs-dir DIR (the folder of an earlier goodput-check)")
    a.store, a.overrides = None, []
    with tempfile.TemporaryDirectory(prefix="unbroken-goodput-") as tmp:
        runs = a.runs_dir or Path(tmp)
        if not a.reuse:
            runs.mkdir(parents=True, exist_ok=True)
            run_trace(a, runs)
        result = _check(a, runs)
    _print(result)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return result


def _check(a: argparse.Namespace, runs: Path) -> dict[str, Any]:
    from unbroken.config import load_config

    cfg = load_config(preset_name=a.preset)
    workers = a.nodes * a.workers_per_node
    m = load_costs(a.costs if a.costs is not None else default_cost_files(), a.preset)
    fig = _figures(m)
    none = _train(runs / "trace_none")
    none_step = (none[-1]["time"] - none[0]["time"]) / (none[-1]["step"] - none[0]["step"])
    cores = int(m.get("failover.cpu_count").value)
    if a.fixed_share is None:
        fixed = _fixed_share(a, runs, cores, cfg.data.micro_batch)
    else:
        fixed = {"fixed_share": a.fixed_share, "source": "given (--fixed-share)"}
    share = fixed["fixed_share"]
    rows = {}
    for name, run in [(p, f"trace_{p}") for p in a.policies.split(",")] + [("checkpoint-restart", "trace_restart")]:
        meas = _measured(runs / run, none_step)
        policy = None if name == "checkpoint-restart" else name
        if policy is None:
            summary = json.loads((runs / run / "summary.json").read_text())
            restarts = [(r["failed_at_step"], r["restarted_from_step"]) for r in summary["job_restarts"]]
            rec: dict[str, Any] = {"outages": [], "stalls": {}, "restarts": restarts}
        else:
            rec, restarts = _recorded(runs / run, fig), None
        meas["recorded"] = {k: (sorted(v.items()) if isinstance(v, dict) else v) for k, v in rec.items()}
        meas["planned_outages"] = _outages(runs / run)
        pred = {key: predict_ratio(policy=policy, outages=rec["outages"], first=meas["first_step"],
                                   last=meas["last_step"], workers=workers, rows=cfg.data.micro_batch, cores=cores,
                                   fixed=share, approx=fig["approx"], svd=fig["svd"], stalls=rec["stalls"],
                                   step_s=step_s, restarts=restarts, restart_s=fig["restart_s"])
                for key, step_s in (("vs_failure_free_run", none_step),
                                    ("in_run", meas["failure_free_step_in_run_s"]))}
        if policy is not None:
            meas["per_state"] = _per_state(runs / run, rec, policy, workers, cfg.data.micro_batch, cores, fig,
                                           share, meas["failure_free_step_in_run_s"])
        err = pred["in_run"] / meas["ratio_in_run"] - 1.0
        rows[name] = {"measured": meas, "predicted": pred, "relative_error_in_run": err,
                      "relative_error_vs_failure_free_run": pred["vs_failure_free_run"]
                      / meas["ratio_vs_failure_free_run"] - 1.0, "ok": abs(err) <= a.tolerance}
    return {"benchmark": "goodput-check", "preset": a.preset, "nodes": a.nodes,
            "workers_per_node": a.workers_per_node, "steps": a.steps, "trace": a.trace, "job_hours": a.job_hours,
            "checkpoint_every": a.checkpoint_every, "cores": cores, "tolerance": a.tolerance, "figures": fig,
            "fixed_share": share, "fixed_share_measurement": fixed,
            "figure_sources": {k: m.get(k).source for k in ("mecefo.approx_ratio", "mecefo.svd_share",
                                                             "failover.crash_stall_s", "failover.hang_stall_s",
                                                             "failover.rejoin_stall_s", "snapshot.ckpt_restart_s",
                                                             "snapshot.step_s")},
            "failure_free_step_s": none_step, "rows": rows, "ok": all(r["ok"] for r in rows.values())}


def _print(r: dict[str, Any]) -> None:
    print(f"goodput check: {r['preset']}, {r['nodes']} x {r['workers_per_node']} workers, trace {r['trace']!r}, "
          f"{r['steps']} steps; throughput relative to failure-free, measured vs predicted by the simulator's model")
    print(f"{'run':<20} {'measured (vs ff run)':>21} {'predicted':>10} {'measured (in run)':>18} "
          f"{'predicted':>10} {'rel. error':>11}")
    for name, row in r["rows"].items():
        mm, p = row["measured"], row["predicted"]
        print(f"{name:<20} {mm['ratio_vs_failure_free_run']:>21.3f} {p['vs_failure_free_run']:>10.3f} "
              f"{mm['ratio_in_run']:>18.3f} {p['in_run']:>10.3f} {row['relative_error_in_run']:>+10.1%} "
              f"{'ok' if row['ok'] else 'MISS'}")
    print(f"within {r['tolerance']:.0%}: {'yes' if r['ok'] else 'no'}; fixed share of a step "
          f"{r['fixed_share']:.3f} ({r['fixed_share_measurement']['source']})")
    print("degraded steps alone: median step per set of workers down / failure-free step (measured vs model)")
    for name, row in r["rows"].items():
        cells = [f"{x['down']}: {x['measured_factor']:.2f} vs {x['predicted_factor']:.2f} ({x['steps']} steps)"
                 for x in row["measured"].get("per_state", [])]
        if cells:
            print(f"  {name:<14} " + "; ".join(cells))
