"""``unbroken report RUN_DIR``: what failed, what it cost, and whether anything was lost.

Reads ``config.json``, ``metrics.jsonl`` and the event files of a run:

- failures: each aborted attempt that led to a new view (one per step and view);
- stall per failure: the survivors' gap between the step that failed and the one
  before it, minus the median step time;
- rejoins: time from a worker's death (its self-inflicted fault or its agent's
  record of the exit) to its admission back into the job;
- the ledger check (:func:`unbroken.runtime.ledger.check_ledger`): lost steps,
  rows trained never or twice — all must be 0.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from unbroken.jsonl import read_jsonl
from unbroken.runtime.ledger import check_ledger, read_events


def summarize_run(run_dir: str | Path) -> dict[str, Any]:
    """Failures, stalls, rejoins and the ledger check of one run directory."""
    run_dir = Path(run_dir)
    if not (run_dir / "config.json").is_file():
        raise ValueError(f"{run_dir} is not a run directory (no config.json)")
    cfg = json.loads((run_dir / "config.json").read_text())
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    events = [r for r in read_events(run_dir) if r.get("kind") == "event"]
    steps = {r["step"]: r for r in train}
    normal = statistics.median(r["step_time_s"] for r in train) if train else 0.0
    failures = _failures(events, steps, normal)
    ledger = check_ledger(run_dir, n_slots=cfg["train"]["workers"], micro_batch=cfg["data"]["micro_batch"],
                          steps=cfg["train"]["steps"], start_step=_start_step(run_dir))
    stalls = [f["stall_s"] for f in failures if f["stall_s"] is not None]
    return {
        "run_dir": str(run_dir), "steps": cfg["train"]["steps"], "committed_steps": ledger.committed,
        "normal_step_s": normal, "failures": len(failures), "failure_details": failures,
        "stall_per_failure_s": {"median": statistics.median(stalls) if stalls else None,
                                "max": max(stalls) if stalls else None},
        "rejoins": _rejoins(events), "lost_steps": len(ledger.lost_steps),
        "rows_trained_never": ledger.rows_never, "rows_trained_twice": ledger.rows_twice,
        "degraded_steps": ledger.degraded_steps, "approx_rows": ledger.approx_rows,
        "ledger_ok": ledger.ok, "ledger_examples": ledger.examples,
    }


def _start_step(run_dir: Path) -> int:
    summary = run_dir / "summary.json"
    if summary.is_file():
        resumed = json.loads(summary.read_text()).get("resumed_from")
        if resumed:
            return int(Path(resumed).name.split("_")[-1])
    return 0


def _failures(events: list[dict[str, Any]], steps: dict[int, dict[str, Any]], normal: float) -> list[dict[str, Any]]:
    rejoin_views = {(e["step"], e["gen"]) for e in events
                    if e.get("event") == "view_adopted" and str(e.get("reason", "")).startswith("rejoin")}
    seen: dict[tuple[int, int], dict[str, Any]] = {}
    for e in events:
        if e.get("event") != "attempt_aborted":
            continue
        key = (e["step"], e["gen"])
        if (e["step"], e["gen"] + 1) in rejoin_views:
            continue  # replaced to admit a returning worker: not a failure
        if key not in seen:
            applied = steps.get(e["step"] + 1)
            stall = applied["step_time_s"] - normal if applied else None
            seen[key] = {"step": e["step"], "gen": e["gen"], "reason": e["reason"], "t": e.get("time"),
                         "stall_s": stall}
    reconf = [e for e in events if e.get("event") == "reconfigured"]
    for f in seen.values():
        times = [e["seconds"] for e in reconf if e["step"] == f["step"] and e["gen"] > f["gen"]]
        f["reconfigure_s"] = max(times) if times else None
    # Several views for one step (e.g. two failures) are one stall: keep the first.
    by_step: dict[int, dict[str, Any]] = {}
    for f in sorted(seen.values(), key=lambda f: (f["step"], f["gen"])):
        by_step.setdefault(f["step"], f)
    return list(by_step.values())


def _rejoins(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    deaths: dict[int, list[float]] = {}
    for e in events:
        if e.get("event") in ("fault_self", "worker_exit", "fault_injected") and "worker" in e and "time" in e:
            deaths.setdefault(e["worker"], []).append(e.get("t", e["time"]))
    out = []
    for e in events:
        if e.get("event") == "rejoined":
            before = [t for t in deaths.get(e["worker"], []) if t <= e["time"]]
            out.append({"worker": e["worker"], "step": e["step"], "gen": e["gen"],
                        "down_to_back_s": e["time"] - min(before) if before else None})
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="unbroken report", description="Summarise failures and the ledger of a run.")
    ap.add_argument("run_dir", type=Path)
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = ap.parse_args(argv)
    s = summarize_run(a.run_dir)
    if a.json:
        print(json.dumps(s, indent=1))
        return s
    print(f"run {s['run_dir']}: {s['committed_steps']}/{s['steps']} steps committed, "
          f"normal step {s['normal_step_s'] * 1000:.1f} ms")
    print(f"failures: {s['failures']}  stall per failure: median {_fmt(s['stall_per_failure_s']['median'])}"
          f"  max {_fmt(s['stall_per_failure_s']['max'])}")
    for f in s["failure_details"]:
        print(f"  step {f['step']:>6}  view {f['gen']:>3}  stall {_fmt(f['stall_s'])}  "
              f"reconfigure {_fmt(f['reconfigure_s'])}  {f['reason'][:70]}")
    for r in s["rejoins"]:
        print(f"  worker {r['worker']} back at step {r['step']} after {_fmt(r['down_to_back_s'])}")
    print(f"lost steps: {s['lost_steps']}  rows trained never: {s['rows_trained_never']}  "
          f"twice: {s['rows_trained_twice']}  degraded steps: {s['degraded_steps']}  "
          f"ledger {'OK' if s['ledger_ok'] else 'VIOLATED'}")
    for ex in s["ledger_examples"]:
        print(f"  {ex}")
    return s


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"
