"""The survivors' stall per crash and per hang over repeated runs, side by side with the normal step and the
targets: ``python -m benchmarks.failover_stall`` (a study beside ``unbroken bench failover``, whose job runner it
uses; the same arguments and ``--section.field=value`` overrides).

Each run is the same job (``--preset``, ``--nodes`` x ``--workers-per-node``, ``--steps``) with one outside
fault: worker 1 SIGKILLed (``--crash-runs`` runs) or SIGSTOPped (``--hang-runs`` runs, under
``fault.heartbeat_timeout_s = --hang-timeout``) by its agent as the step ``5/8`` of the way through begins,
back (forked from its node's template) one step later. Per run, from ``unbroken report``'s figures: the stall
(the gap between the survivors' applied steps around the fault, minus a normal step), the normal step, the
time from the fault to the worker's rejoin and its admission phase, the members' stall at the rejoin step,
the attempts the rejoin aborted (replaced by the admitting view: the target is none), and where the stall
went (the fault to the first attempt given up, then to the step's commit in the new view).

Targets: a crash costs the survivors at most the dead worker's share of a step spread over them plus 50 ms
(``normal / (n - 1) + 0.05``), in the median of the runs; a hang at most the heartbeat timeout plus 0.3 s.

Invariants: pure over the run directories the caller's launcher wrote (figures only from the runs' own
records); a figure a run lacks is left out, never guessed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any, Callable

from unbroken.bench import failover
from unbroken.bench._args import parse_with_overrides
from unbroken.bench.machine import machine_description
from unbroken.jsonl import read_jsonl
from unbroken.runtime.ledger import read_events

__all__ = ["CRASH_MARGIN_S", "HANG_MARGIN_S", "main", "print_stall", "stall_part"]

CRASH_MARGIN_S = 0.05
"""A crash's stall target beyond the dead worker's share of a step spread over the survivors."""
HANG_MARGIN_S = 0.3
"""A hang's stall target beyond the heartbeat timeout."""

Run = Callable[..., dict[str, Any]]


def _admission_aborts(run_dir: Path) -> int:
    """Attempts replaced by a view that admits a returning worker (each aborted a step the members had in
    flight), from the workers' events."""
    events = [e for e in read_events(run_dir) if e.get("kind") == "event"]
    rejoin_views = {(e["step"], e["gen"]) for e in events
                    if e.get("event") == "view_adopted" and str(e.get("reason", "")).startswith("rejoin")}
    return len({(e["step"], e["gen"]) for e in events
                if e.get("event") == "attempt_aborted" and (e["step"], e["gen"] + 1) in rejoin_views})


def _phases(run_dir: Path) -> dict[str, float | None]:
    """Where the fault's stall went, from the run's records: ``detect_s``, from the fault to the first member
    giving up on its attempt; ``recover_s``, from there to the last member's commit of that step (the new
    view, the rows taken over, the reduction)."""
    records = sorted((r for r in read_events(run_dir) if "time" in r), key=lambda r: r["time"])
    fault = next((r for r in records if r.get("event") == "fault_injected"), None)
    aborted = next((r for r in records if fault is not None and r.get("event") == "attempt_aborted"
                    and r["time"] >= fault["time"]), None)
    if fault is None or aborted is None:
        return {"detect_s": None, "recover_s": None}
    commits = [r["time"] for r in records if r.get("kind") == "commit" and r["step"] == aborted["step"]
               and r["gen"] > aborted["gen"]]
    return {"detect_s": aborted["time"] - fault["time"],
            "recover_s": max(commits) - aborted["time"] if commits else None}


def _figures(run: dict[str, Any]) -> dict[str, Any]:
    """One run's figures (module docstring)."""
    report, run_dir = run["report"], Path(run["run_dir"])
    at = {x["step"]: x["time"] for x in read_jsonl(run_dir / "metrics.jsonl") if x["kind"] == "train"}
    rejoins = report["rejoins"]
    return {
        "stall_s": [f["stall_s"] for f in report["failure_details"] if f["stall_s"] is not None],
        "reconfigure_s": [f["reconfigure_s"] for f in report["failure_details"] if f["reconfigure_s"] is not None],
        "normal_step_s": report["normal_step_s"],
        "back_s": [x["down_to_back_s"] for x in rejoins if x["down_to_back_s"] is not None],
        "admission_s": [x["start_phases"]["admission"] for x in rejoins if (x["start_phases"] or {}).get("admission")
                        is not None],
        "rejoin_stall_s": [at[x["step"]] - at[x["step"] - 1] - report["normal_step_s"] for x in rejoins
                           if x["step"] in at and x["step"] - 1 in at],
        "admission_aborts": _admission_aborts(run_dir), **_phases(run_dir),
        "lost_steps": report["lost_steps"], "ledger_ok": report["ledger_ok"],
    }


def _summary(rows: list[dict[str, Any]], target: Callable[[float], float]) -> dict[str, Any]:
    stalls = [s for r in rows for s in r["stall_s"]]
    normal = statistics.median(r["normal_step_s"] for r in rows)

    def median(key: str) -> float | None:
        got = [r[key] for r in rows if r[key] is not None]
        return statistics.median(got) if got else None

    return {"runs": rows, "median_stall_s": statistics.median(stalls) if stalls else None,
            "median_detect_s": median("detect_s"), "median_recover_s": median("recover_s"),
            "normal_step_s": normal, "target_s": target(normal),
            "median_back_s": statistics.median(b for r in rows for b in r["back_s"]) if any(
                r["back_s"] for r in rows) else None,
            "admission_aborts": sum(r["admission_aborts"] for r in rows),
            "lost_steps": sum(r["lost_steps"] or 0 for r in rows),
            "ledger_ok": all(r["ledger_ok"] for r in rows)}


def stall_part(run: Run, cfg: Callable[..., Any], *, steps: int, workers: int, crash_runs: int, hang_runs: int,
               hang_timeout_s: float, tmp: Path) -> dict[str, Any]:
    """Run the crash and hang runs with ``run(tmp, name, config, fail_at=...)`` on configs ``cfg(*overrides)``;
    returns each run's figures and their medians beside the normal step and the targets."""
    if workers < 2:
        raise ValueError(f"the stall runs need 2 workers or more (worker 1 fails), got {workers}")
    at = max(2, steps * 5 // 8)
    crash = [_figures(run(tmp, f"stall_crash{i}", cfg(), fail_at=f"step={at}:worker=1:kill:back={at + 1}"))
             for i in range(crash_runs)]
    hang_cfg = f"fault.heartbeat_timeout_s={hang_timeout_s}"
    hang = [_figures(run(tmp, f"stall_hang{i}", cfg(hang_cfg), fail_at=f"step={at}:worker=1:stop:back={at + 1}"))
            for i in range(hang_runs)]
    out: dict[str, Any] = {"fault_step": at, "workers": workers, "heartbeat_timeout_s": hang_timeout_s}
    if crash:
        out["crash"] = _summary(crash, lambda normal: normal / (workers - 1) + CRASH_MARGIN_S)
    if hang:
        out["hang"] = _summary(hang, lambda normal: hang_timeout_s + HANG_MARGIN_S)
    return out


def print_stall(s: dict[str, Any]) -> None:
    """The part's lines: per fault kind, median stall, normal step and target side by side."""
    for kind in ("crash", "hang"):
        if kind not in s:
            continue
        k = s[kind]
        stalls = [round(x, 3) for r in k["runs"] for x in r["stall_s"]]
        median = k["median_stall_s"]
        print(f"stall per {kind} ({len(k['runs'])} runs, fault at step {s['fault_step']}"
              f"{', heartbeat timeout %.2f s' % s['heartbeat_timeout_s'] if kind == 'hang' else ''}): "
              f"median {'-' if median is None else f'{median:.3f}'} s, normal step {k['normal_step_s']:.3f} s, "
              f"target <= {k['target_s']:.3f} s  (each: {stalls})")
        detect, recover = k["median_detect_s"], k["median_recover_s"]
        if detect is not None and recover is not None:
            print(f"  medians: fault -> first attempt given up {detect:.3f} s, -> the step committed in the new view "
                  f"{recover:.3f} s more")
        back = k["median_back_s"]
        print(f"  worker back after {'-' if back is None else f'{back:.2f}'} s (median); attempts a rejoin aborted: "
              f"{k['admission_aborts']}; lost steps {k['lost_steps']}, ledger {'OK' if k['ledger_ok'] else 'BAD'}")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run the crash and hang runs, print their lines and write the JSON (``--out``)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.failover_stall", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--workers-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--crash-runs", type=int, default=5, help="runs with worker 1 SIGKILLed")
    ap.add_argument("--hang-runs", type=int, default=3, help="runs with worker 1 SIGSTOPped")
    ap.add_argument("--hang-timeout", type=float, default=0.5, help="the hang runs' heartbeat timeout (s)")
    ap.add_argument("--store", default=None, metavar="etcd://HOST:PORT[,...]",
                    help="every job's store on this etcd cluster (default: embedded)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/failover_stall.json"))
    a, overrides = parse_with_overrides(ap, argv)
    a.overrides = overrides
    result: dict[str, Any] = {"benchmark": "failover_stall", "preset": a.preset, "store": a.store or "embedded",
                              "nodes": a.nodes, "workers_per_node": a.workers_per_node,
                              "machine": machine_description()}
    with tempfile.TemporaryDirectory(prefix="unbroken-failover-stall-") as tmp:
        result["stall"] = stall_part(lambda t, name, cfg, **kw: failover._run(a, t, name, cfg, **kw),
                                     lambda *extra: failover._cfg(a, *extra), steps=a.steps,
                                     workers=a.nodes * a.workers_per_node, crash_runs=a.crash_runs,
                                     hang_runs=a.hang_runs, hang_timeout_s=a.hang_timeout, tmp=Path(tmp))
    print_stall(result["stall"])
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
