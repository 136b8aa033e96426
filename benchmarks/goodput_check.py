"""Goodput check: the cluster simulator's cost model against real multi-process runs under a failure trace.

``python -m benchmarks.goodput_check`` runs one job per takeover policy and one
checkpoint-restart job under a failure trace (default ``tiny``, 4 workers on 2
nodes, ``high``, through ``unbroken bench failover``'s runner), and the same
two jobs without failures as their references, once before and once after the
runs they are compared with (so that a slow drift of the machine's speed moves
both sides alike): the policies' with a warm standby per node, as the policy
runs have; checkpoint-restart's with ``fault.recovery=restart``; both with a
fault planned past their end, which never fires but keeps the fault injector
watching as it does in the runs under the trace. "Relative to failure-free"
compares a job with the same job, same processes, without the failures. It
keeps the run directories and predicts each job's throughput relative to
failure-free from:

* the run's own failure trace (``fault_trace.json``: which worker is down at
  which step; the failures and rejoins the run recorded) and, for
  checkpoint-restart, its restarts;
* the simulator's work model (:func:`unbroken.cluster.degraded.worker_loads`:
  each live worker's load under the runtime's row assignment per policy, at
  MeCeFO's measured FLOPs ratio);
* costs measured by the other benchmarks (``--costs``): detection + stall per
  crash and per admission (``failover``), MeCeFO's FLOPs ratio and SVD share
  (``mecefo-cost``) and a checkpoint-restart's cost (``snapshot``: seconds from
  a kill to the next step minus the steps redone);
* how this machine runs ``k`` workers (the host model, :class:`HostModel`),
  measured by the check itself. On a cluster a worker has its device; here
  the workers share the machine's cores, and a step's time depends on how
  many share them: four single-thread workers on two cores take 2.0-2.4x as
  long as two, not 2x (caches, memory bandwidth). The check runs, for every
  ``k`` from 1 to the job's workers, two short failure-free jobs of ``k``
  workers on one node at one and at two micro-batches, and fits ``T_k(load) =
  F_k + C_k * load``. A degraded step with live loads ``l_1..l_k`` takes
  ``T_k(L)`` seconds, ``L`` the uniform load that keeps the cores busy as long
  (fair sharing: :func:`shared_makespan`); a failure-free step takes the
  reference's. Absolute, not relative to ``T_G(1)``: the reference job has
  per-step costs a one-node job lacks (the snapshot's parity across nodes,
  two agents, the standbys), and a degraded state whose live workers sit on
  one node does not have them either;
* the warm standbys started while the job trains (after a handover): each
  records the CPU seconds its start took (``standby_ready``), and while the
  live workers keep every core busy, fair sharing takes that over the cores
  from the job. (On a cluster the standby starts on its host's CPU, beside
  the devices, and the simulator charges nothing.)

The prediction replays the steps the throughput is measured over (first to
last committed step in ``metrics.jsonl``): a checkpoint-restart that goes back
to step 0 truncates the metrics, so it falls before the measured window, as
in the measurement. The measured ratio is the references' mean time over the
same steps divided by the run's; the check passes when every prediction is
within ``--tolerance`` (relative) of it. Run it on a quiet machine: another
job's load on the cores moves one run and not the other. Even then, two runs
of the same job differ by up to 15% here; ``--repeats N`` runs the whole
check N times (each with its own references and host model) and compares the
means, and ``--reuse --runs-dir A B ...`` pools earlier checks' folders.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from unbroken.cluster.costs import MeasuredCosts, default_cost_files, load_costs
from unbroken.cluster.degraded import step_load, worker_loads
from unbroken.jsonl import read_jsonl

__all__ = ["HostModel", "main", "predict_ratio", "shared_makespan"]


def _train(run_dir: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]


def _outages(run_dir: Path) -> list[tuple[int, int, int]]:
    path = run_dir / "fault_trace.json"
    if not path.exists():
        return []
    return [(o["worker"], o["start_step"], o["end_step"]) for o in json.loads(path.read_text())["outages"]]


def shared_makespan(loads: Sequence[float], cores: int) -> float:
    """Time until every load is done when ``len(loads)`` processes share ``cores`` cores fairly (processor
    sharing: ``n`` running processes each run at ``min(1, cores / n)``), in units of a load on a core."""
    t, done, n = 0.0, 0.0, len(loads)
    for x in sorted(loads):
        t += (x - done) / min(1.0, cores / n)
        done, n = x, n - 1
    return t


@dataclass(frozen=True)
class HostModel:
    """How long a step takes on this machine with ``k`` workers (see the module docstring).

    ``steps[k] = (t1, t2)``: median failure-free step, in seconds, of ``k`` workers computing one and two
    micro-batches each; ``T_k(load) = F_k + C_k * load`` through those two points (``F_k`` clamped at 0,
    with ``C_k`` then the least-squares slope through the origin).
    """

    cores: int
    steps: dict[int, tuple[float, float]]

    def __post_init__(self) -> None:
        if self.cores < 1:
            raise ValueError(f"cores={self.cores}: need at least 1")
        for k, (t1, t2) in self.steps.items():
            if not (t1 > 0 and t2 > 0 and math.isfinite(t1) and math.isfinite(t2)):
                raise ValueError(f"{k} worker(s): step times {t1!r} and {t2!r} s: need two positive, finite times")

    def line(self, k: int) -> tuple[float, float]:
        """``(F_k, C_k)``: seconds per step, and seconds per micro-batch of load."""
        if k not in self.steps:
            raise ValueError(f"no host measurement for {k} live worker(s) (measured: {sorted(self.steps)})")
        t1, t2 = self.steps[k]
        if 2 * t1 >= t2:
            return 2 * t1 - t2, t2 - t1
        return 0.0, (t1 + 2 * t2) / 5

    def step_s(self, loads: Sequence[float]) -> float:
        """A step's seconds when the live workers carry ``loads`` (exact micro-batches each)."""
        k = len(loads)
        f, c = self.line(k)
        return f + c * shared_makespan(loads, self.cores) / max(1.0, k / self.cores)


def predict_ratio(*, policy: str | None, outages: list[tuple[int, int, int]], first: int, last: int,
                  workers: int, rows: int, approx: float, svd: float, stalls: dict[int, float], step_s: float,
                  host: HostModel | None = None, cores: int | None = None, fixed: float = 0.0,
                  restarts: list[tuple[int, int]] | None = None, restart_s: float = 0.0) -> float:
    """Predicted throughput relative to failure-free over the committed steps ``first..last``.

    ``policy`` None is checkpoint-restart: each restart ``(failed_at, restarted_from)`` costs
    ``restart_s`` plus the steps redone, ``failed_at - 1 - restarted_from``; one that goes back to
    step 0 falls before the measured window (its metrics are truncated). Otherwise each step takes
    ``step_s`` times the degraded factor of the workers down at that step (``outages``: worker,
    first step down, step back), plus the one-off ``stalls`` (seconds per step: failures, admissions).
    The factor is the ``host``'s when given, else the simulator's (:func:`step_load`, ``cores``, ``fixed``).
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
        wall += _step_s(policy, down, workers, rows, approx, svd, step_s, host, cores, fixed) + stalls.get(s, 0.0)
    return (last - first) * step_s / wall


def _step_s(policy: str, down: list[int], workers: int, rows: int, approx: float, svd: float, step_s: float,
            host: HostModel | None, cores: int | None, fixed: float) -> float:
    """A step's seconds with the workers ``down`` dead: the failure-free ``step_s`` times the simulator's
    factor, or with a ``host`` its measured step of as many workers at these loads (``step_s`` when none is
    down: the reference job's own step, which holds its per-step costs, such as the snapshot's parity across
    nodes, that a one-node measurement lacks)."""
    if host is None:
        return step_s * step_load(policy, workers=workers, rows=rows, down=down, approx=approx, svd=svd,
                                  cores=cores, fixed=fixed).factor
    if not down:
        return step_s
    return host.step_s(worker_loads(policy, workers=workers, rows=rows, down=down, approx=approx, svd=svd))


def _recorded(run_dir: Path, fig: dict[str, Any], workers: int, cores: int) -> dict[str, Any]:
    """The failures and rejoins the run recorded (its realisation of the trace, which the runtime may add to).

    A worker's outage lasts from its planned failure to its first recorded rejoin at or after the planned
    return; each failure stalls the job by the measured crash or hang stall (by how it was detected),
    each admission of a joiner (``view_adopted`` with joiners) by the measured rejoin stall, each warm
    standby started during the measured steps by its own start's CPU seconds over the ``cores`` (when
    the live workers are at least as many as the cores; ``standby_ready`` events), and each node template
    started then (``template_ready``: the imports a forked standby or worker no longer pays).
    """
    from unbroken.report.run_report import summarize_run

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
    events = read_jsonl(run_dir / "events.jsonl")
    admitted = {(e["gen"], e["step"]) for e in events if e.get("event") == "view_adopted" and e.get("joiners")}
    for _, step in admitted:
        stalls[step] = stalls.get(step, 0.0) + fig["rejoin_stall_s"]
    # A warm standby started while the job trains (after a handover) takes CPU from the workers when they keep
    # every core busy: sharing fairly, the job loses its CPU seconds over the cores.
    train = _train(run_dir)
    startups = []
    # Node templates started while it trains (a replacement node's, a lost template's) are such starts too.
    ready = [e for pattern in ("standby*.jsonl", "agent*.jsonl") for f in sorted((run_dir / "events").glob(pattern))
             for e in read_jsonl(f)]
    for e in ready:
        if e.get("event") not in ("standby_ready", "template_ready") or e.get("cpu_s") is None \
                or not train[0]["time"] < e["time"] <= train[-1]["time"]:
            continue
        step = next(r["step"] for r in train if r["time"] >= e["time"])
        live = workers - sum(1 for w, a, b in outages if a <= step < b)
        charged = e["cpu_s"] / cores if live >= cores else 0.0
        startups.append({"step": step, "cpu_s": e["cpu_s"], "charged_s": charged})
        stalls[step] = stalls.get(step, 0.0) + charged
    return {"outages": outages, "stalls": stalls, "failure_kinds": kinds, "admissions": len(admitted),
            "standby_starts": startups}


def _times(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["time"] for r in _train(run_dir)}


def _measured(run_dir: Path, refs: list[dict[int, float]]) -> dict[str, Any]:
    """The run's time over its measured steps against its references' (mean of the runs before and after it)."""
    train = _train(run_dir)
    first, last = train[0]["step"], train[-1]["step"]
    span = train[-1]["time"] - train[0]["time"]
    spans = [ref[last] - ref[first] for ref in refs]
    ref_span = statistics.fmean(spans)
    return {"first_step": first, "last_step": last, "span_s": span, "reference_spans_s": spans,
            "reference_step_s": ref_span / (last - first), "ratio": ref_span / span}


def _per_state(run_dir: Path, rec: dict[str, Any], policy: str, workers: int, rows: int, fig: dict[str, Any],
               host: HostModel, ref_step_s: float) -> list[dict[str, Any]]:
    """Median step time per set of workers down (steps without a failure or admission), over the reference's
    step, against the model's factor: the degraded-step model alone, apart from the one-off stalls."""
    train = _train(run_dir)
    by_state: dict[tuple[int, ...], list[float]] = {}
    for prev, cur in zip(train, train[1:]):
        st = cur["step"]
        if st in rec["stalls"]:
            continue
        down = tuple(sorted(w for w, a, b in rec["outages"] if a <= st < b))
        by_state.setdefault(down, []).append(cur["time"] - prev["time"])
    return [{"down": list(down), "steps": len(xs), "measured_factor": statistics.median(xs) / ref_step_s,
             "predicted_factor": _step_s(policy, list(down), workers, rows, fig["approx"], fig["svd"], ref_step_s,
                                         host, None, 0.0) / ref_step_s}
            for down, xs in sorted(by_state.items())]


def _median_step(run_dir: Path) -> float:
    """Median interval between committed steps, past the first fifth (at least 3 steps) of warm-up."""
    train = _train(run_dir)
    steps = [b["time"] - a["time"] for a, b in zip(train, train[1:])]
    return statistics.median(steps[max(3, len(steps) // 5):] or steps)


def _host(a: argparse.Namespace, runs: Path, cores: int, micro_batch: int) -> tuple[HostModel, dict[str, Any]]:
    """Measure the host model (see the module docstring), or read its runs back with ``--reuse``."""
    from unbroken.bench.failover import _cfg, _run

    steps = max(20, a.steps // 2)
    workers = a.nodes * a.workers_per_node
    # A job's workers keep the intra-op threads they started with (the cores over the job's workers), so a
    # lone survivor of two computes with one thread where a one-worker job would have two.
    threads = max(1, (os.cpu_count() or 1) // workers)
    table: dict[int, tuple[float, float]] = {}
    used: dict[int, int] = {}
    for k in range(1, workers + 1):
        one_node = argparse.Namespace(**{**vars(a), "nodes": 1, "workers_per_node": k})
        t = []
        for m in (1, 2):
            name = f"host_{k}w_{m}mb"
            if not a.reuse:
                _run(one_node, runs, name, _cfg(one_node, f"data.micro_batch={m * micro_batch}",
                                                f"train.steps={steps}", f"train.threads_per_worker={threads}"))
            t.append(_median_step(runs / name))
        table[k] = (t[0], t[1])
        given = json.loads((runs / name / "config.json").read_text())["train"]["threads_per_worker"]
        used[k] = given or max(1, (os.cpu_count() or 1) // k)  # what the run's workers had (0: the default)
    host = HostModel(cores=cores, steps=table)
    info = {"cores": cores, "rows": micro_batch, "steps": steps, "threads_per_worker_of_the_job": threads,
            "workers": {str(k): {"step_s_1mb": t1, "step_s_2mb": t2, "fixed_s": host.line(k)[0],
                                 "per_micro_batch_s": host.line(k)[1], "threads": used[k]}
                        for k, (t1, t2) in table.items()},
            "source": f"measured: failure-free jobs of k = 1..{len(table)} workers on one node, {steps} steps, "
                      f"at {micro_batch} and {2 * micro_batch} rows per worker, median step"}
    return host, info


def _figures(m: MeasuredCosts) -> dict[str, Any]:
    snap_step = m.get("snapshot.step_s").value
    kill = json.loads(Path(m.get("snapshot.ckpt_restart_s").source.split(" [")[0]).read_text())["kill"]
    redone = kill["checkpoint_restart"]["killed_at_step"] - kill["checkpoint_restart"]["resumed_at_step"] + 1
    return {"approx": m.get("mecefo.approx_ratio").value, "svd": m.get("mecefo.svd_share").value,
            "stall_s": m.get("failover.crash_stall_s").value, "hang_stall_s": m.get("failover.hang_stall_s").value,
            "rejoin_stall_s": m.get("failover.rejoin_stall_s").value,
            "restart_s": m.get("snapshot.ckpt_restart_s").value - redone * snap_step}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.goodput_check", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--workers-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--trace", default="high")
    ap.add_argument("--job-hours", type=float, default=2.0)
    ap.add_argument("--checkpoint-every", type=int, default=10)
    ap.add_argument("--policies", default="neighbor,spread,spread-approx")
    ap.add_argument("--costs", type=Path, nargs="+", default=None, help="default: benchmarks/results/*.json")
    ap.add_argument("--runs-dir", type=Path, nargs="+", default=None,
                    help="keep the runs here (default: a temporary folder); with --reuse, one folder per repeat")
    ap.add_argument("--reuse", action="store_true", help="read the runs already in --runs-dir instead of running")
    ap.add_argument("--repeats", type=int, default=1,
                    help="run the whole check this many times (RUNS/rep<i>) and compare the means")
    ap.add_argument("--tolerance", type=float, default=0.10)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/goodput_check.json"))
    a = ap.parse_args(argv)
    if a.reuse and a.runs_dir is None:
        raise ValueError("--reuse needs --runs-dir DIR [DIR ...] (the folders of earlier goodput-checks)")
    if not a.reuse and a.runs_dir is not None and len(a.runs_dir) > 1:
        raise ValueError("--runs-dir: one folder when running (--repeats puts each repeat in a subfolder)")
    if a.repeats < 1:
        raise ValueError(f"--repeats={a.repeats}: need at least 1")
    if a.nodes * a.workers_per_node < 2:
        raise ValueError(f"{a.nodes} x {a.workers_per_node} workers: a takeover needs at least 2")
    a.store, a.overrides = None, []
    with tempfile.TemporaryDirectory(prefix="unbroken-goodput-") as tmp:
        if a.reuse:
            dirs = list(a.runs_dir)
        else:
            root = a.runs_dir[0] if a.runs_dir else Path(tmp)
            dirs = [root] if a.repeats == 1 else [root / f"rep{i}" for i in range(a.repeats)]
            cores = _cores(a)
            for runs in dirs:  # a repeat's host-model jobs right after its own jobs
                runs.mkdir(parents=True, exist_ok=True)
                _run_jobs(a, runs)
                _host(a, runs, cores, _micro_batch(a))
            a.reuse = True  # the runs are there now: the check reads them back
        result = _check(a, dirs)
    _print(result)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return result


def _cores(a: argparse.Namespace) -> int:
    """The cores of the machine the failover benchmark ran on (the one the cost files describe)."""
    m = load_costs(a.costs if a.costs is not None else default_cost_files(), a.preset)
    return int(m.get("failover.cpu_count").value)


def _micro_batch(a: argparse.Namespace) -> int:
    from unbroken.config import load_config

    return load_config(preset_name=a.preset).data.micro_batch


def _run_jobs(a: argparse.Namespace, runs: Path) -> None:
    """The reference jobs and the jobs under the trace (the host model's jobs: :func:`_host`)."""
    from unbroken.bench.failover import _cfg, _run

    extra = [f"fault.job_hours={a.job_hours}", f"train.checkpoint_every={a.checkpoint_every}"]
    # Each reference runs before and after the runs it is compared with, so that a slow drift of the
    # machine's speed moves both sides alike; it carries a fault that never fires, so that the injector's
    # watching (the agents read the job's progress every 5 ms while a fault is pending) costs it as much.
    dormant = f"step={100 * a.steps}:worker=0:kill"
    _run(a, runs, "ref_standby_0", _cfg(a, *extra), standby=True, fail_at=dormant)
    for policy in a.policies.split(","):
        _run(a, runs, f"trace_{policy}", _cfg(a, *extra, f"fault.trace={a.trace}", f"mecefo.policy={policy}"),
             standby=True)
    _run(a, runs, "ref_standby_1", _cfg(a, *extra), standby=True, fail_at=dormant)
    _run(a, runs, "ref_restart_0", _cfg(a, *extra, "fault.recovery=restart"), fail_at=dormant)
    _run(a, runs, "trace_restart", _cfg(a, *extra, f"fault.trace={a.trace}", "fault.recovery=restart"))
    _run(a, runs, "ref_restart_1", _cfg(a, *extra, "fault.recovery=restart"), fail_at=dormant)


def _check(a: argparse.Namespace, dirs: list[Path]) -> dict[str, Any]:
    """Every repeat's rows (each against its own references and host model), and their means."""
    from unbroken.config import load_config

    cfg = load_config(preset_name=a.preset)
    m = load_costs(a.costs if a.costs is not None else default_cost_files(), a.preset)
    fig = _figures(m)
    cores = int(m.get("failover.cpu_count").value)
    repeats = [_check_one(a, runs, cfg.data.micro_batch, fig, cores) for runs in dirs]
    rows = {}
    for name in repeats[0]["rows"]:
        measured = statistics.fmean(r["rows"][name]["measured"]["ratio"] for r in repeats)
        predicted = statistics.fmean(r["rows"][name]["predicted"] for r in repeats)
        err = predicted / measured - 1.0
        rows[name] = {"measured": measured, "predicted": predicted, "relative_error": err,
                      "ok": abs(err) <= a.tolerance,
                      "repeats": [r["rows"][name]["relative_error"] for r in repeats]}
    return {"benchmark": "goodput-check", "preset": a.preset, "nodes": a.nodes,
            "workers_per_node": a.workers_per_node, "steps": a.steps, "trace": a.trace, "job_hours": a.job_hours,
            "checkpoint_every": a.checkpoint_every, "cores": cores, "tolerance": a.tolerance, "figures": fig,
            "figure_sources": {k: m.get(k).source for k in ("mecefo.approx_ratio", "mecefo.svd_share",
                                                             "failover.crash_stall_s", "failover.hang_stall_s",
                                                             "failover.rejoin_stall_s", "snapshot.ckpt_restart_s",
                                                             "snapshot.step_s")},
            "rows": rows, "ok": all(r["ok"] for r in rows.values()), "runs": repeats}


def _check_one(a: argparse.Namespace, runs: Path, rows_per_mb: int, fig: dict[str, Any],
               cores: int) -> dict[str, Any]:
    workers = a.nodes * a.workers_per_node
    host, host_info = _host(a, runs, cores, rows_per_mb)
    rows = {}
    for name, run in [(p, f"trace_{p}") for p in a.policies.split(",")] + [("checkpoint-restart", "trace_restart")]:
        policy = None if name == "checkpoint-restart" else name
        ref = "ref_restart" if policy is None else "ref_standby"
        meas = _measured(runs / run, [_times(runs / f"{ref}_{i}") for i in (0, 1)])
        if policy is None:
            summary = json.loads((runs / run / "summary.json").read_text())
            restarts = [(r["failed_at_step"], r["restarted_from_step"]) for r in summary["job_restarts"]]
            rec: dict[str, Any] = {"outages": [], "stalls": {}, "restarts": restarts}
        else:
            rec, restarts = _recorded(runs / run, fig, workers, cores), None
        meas["recorded"] = {k: (sorted(v.items()) if isinstance(v, dict) else v) for k, v in rec.items()}
        meas["planned_outages"] = _outages(runs / run)
        pred = predict_ratio(policy=policy, outages=rec["outages"], first=meas["first_step"], last=meas["last_step"],
                             workers=workers, rows=rows_per_mb, approx=fig["approx"], svd=fig["svd"],
                             stalls=rec["stalls"], step_s=meas["reference_step_s"], host=host, restarts=restarts,
                             restart_s=fig["restart_s"])
        if policy is not None:
            meas["per_state"] = _per_state(runs / run, rec, policy, workers, rows_per_mb, fig, host,
                                           meas["reference_step_s"])
        rows[name] = {"measured": meas, "predicted": pred, "relative_error": pred / meas["ratio"] - 1.0}
    return {"runs_dir": str(runs), "host": host_info, "rows": rows}


def _print(r: dict[str, Any]) -> None:
    n = len(r["runs"])
    print(f"goodput check: {r['preset']}, {r['nodes']} x {r['workers_per_node']} workers, trace {r['trace']!r}, "
          f"{r['steps']} steps, {n} repeat(s); throughput relative to the same job without failures")
    print(f"{'run':<20} {'measured':>9} {'predicted':>10} {'rel. error':>11}   per repeat")
    for name, row in r["rows"].items():
        print(f"{name:<20} {row['measured']:>9.3f} {row['predicted']:>10.3f} {row['relative_error']:>+10.1%} "
              f"{'ok' if row['ok'] else 'MISS':<4}  " + " ".join(f"{e:+.1%}" for e in row["repeats"]))
    print(f"within {r['tolerance']:.0%}{' (means over the repeats)' if n > 1 else ''}: {'yes' if r['ok'] else 'no'}")
    for rep in r["runs"]:
        print(f"--- {rep['runs_dir']}")
        refs = {name: row["measured"]["reference_spans_s"] for name, row in rep["rows"].items()}
        print("  reference spans (s, before / after): " + "; ".join(
            f"{name} {a:.1f} / {b:.1f}" for name, (a, b) in refs.items() if name in ("spread", "checkpoint-restart")))
        h = rep["host"]
        print(f"  host model ({h['cores']} cores; {h['source']}):")
        for k, x in h["workers"].items():
            print(f"    {k} worker(s), {x['threads']} thread(s) each: {x['step_s_1mb']:.3f} s at 1 micro-batch, "
                  f"{x['step_s_2mb']:.3f} s at 2 (fixed {x['fixed_s']:.3f} s + {x['per_micro_batch_s']:.3f} s "
                  f"per micro-batch)")
        for name, row in rep["rows"].items():
            starts = row["measured"]["recorded"].get("standby_starts") or []
            if starts:
                cpu, charged = sum(x["cpu_s"] for x in starts), sum(x["charged_s"] for x in starts)
                print(f"  {name}: {len(starts)} warm standby start(s) while training, {cpu:.1f} CPU-s, "
                      f"charged {charged:.1f} s")
        print("  degraded steps alone: median step per set of workers down / failure-free step (measured vs model)")
        for name, row in rep["rows"].items():
            cells = [f"{x['down']}: {x['measured_factor']:.2f} vs {x['predicted_factor']:.2f} ({x['steps']} steps)"
                     for x in row["measured"].get("per_state", [])]
            if cells:
                print(f"    {name:<14} " + "; ".join(cells))


if __name__ == "__main__":
    main()
