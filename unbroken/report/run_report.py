"""``unbroken report RUN [RUN_B]``: what failed, what it cost, whether anything was lost, as text and a picture.

Reads ``config.json``, ``metrics.jsonl``, the event files (``events/*.jsonl``)
and ``summary.json`` of a run:

- failures: each aborted attempt that led to a new view (one per step and view);
- stall per failure: the survivors' gap between the step that failed and the one
  before it, minus the median step time;
- rejoins: time from a worker's death (its self-inflicted fault or its agent's
  record of the exit) to its admission back into the job, or to the restored
  view it loaded the state in when the whole job was restored meanwhile;
- recoveries: each kill's phases, in seconds after it (death seen, process
  ready, restore or admission decided, state loaded, first step, steps back at
  speed: :mod:`unbroken.report.recovery_phases`);
- compiles (``train.compile``): each process's frames and seconds compiling by
  its first step, graphs from a cache or built, whether it loaded or wrote the
  job's compile cache, and a standby's compile ahead;
- the ledger check (:func:`unbroken.runtime.ledger.check_ledger`): lost steps,
  rows trained never or twice — all must be 0.

One run: the text table, ``RUN/report.json`` (the summary plus the per-step
series of :mod:`unbroken.report.series`) and ``RUN/report.png``
(:func:`unbroken.report.plot.plot_run`). Two runs: the headline numbers
side by side and ``RUN_A/report-vs-<name of B>.png`` (loss and live workers
overlaid). A simulated run (``unbroken simulate``: no event files) is read
from its metrics lines; it has no ledger to check (``ledger_ok`` is None).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
from pathlib import Path
from typing import Any

from unbroken.report import series as rs
from unbroken.report.recovery_phases import recoveries
from unbroken.report.stragglers import straggler_episodes
from unbroken.jsonl import read_jsonl
from unbroken.runtime.ledger import check_ledger, read_events

MAX_RUNS = 2
"""``unbroken report`` draws one run, or overlays two."""


def summarize_run(run_dir: str | Path) -> dict[str, Any]:
    """Failures, stalls, rejoins and the ledger check of one run directory.

    Raises:
        ValueError: ``run_dir`` has no ``config.json``.
    """
    run_dir = Path(run_dir)
    cfg = _read_config(run_dir)
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r.get("kind") == "train"]
    events = [r for r in read_events(run_dir) if r.get("kind") == "event"]
    steps = {r["step"]: r for r in train}
    normal = statistics.median(r["step_time_s"] for r in train) if train else 0.0
    failures = _failures(events, steps, normal)
    stalls = [f["stall_s"] for f in failures if f["stall_s"] is not None]
    return {
        "run_dir": str(run_dir), "steps": cfg["train"]["steps"], "normal_step_s": normal,
        "failures": len(failures), "failure_details": failures,
        "stall_per_failure_s": {"median": statistics.median(stalls) if stalls else None,
                                "max": max(stalls) if stalls else None},
        "rejoins": _rejoins(events), "recoveries": recoveries(read_events(run_dir)), "compiles": _compiles(events),
        "snapshots": _snapshots(run_dir, events), **_ledger(run_dir, cfg, len(train)),
        "stragglers": _stragglers(run_dir, cfg, steps),
    }


def _stragglers(run_dir: Path, cfg: dict[str, Any], steps: dict[int, dict[str, Any]]) -> list[dict[str, Any]]:
    """The run's straggler episodes (:func:`~unbroken.report.stragglers.straggler_episodes`)."""
    if not (run_dir / "events").is_dir():
        return []
    return straggler_episodes(read_events(run_dir), steps, n_slots=_slots(cfg), n_workers=cfg["train"]["workers"],
                              micro_batch=cfg["data"]["micro_batch"], last_step=cfg["train"]["steps"] - 1)


def _slots(cfg: dict[str, Any]) -> int:
    """Micro-batches per step of a saved config (:attr:`unbroken.config.Config.n_slots`; an older run's config
    has no ``train.global_batch``)."""
    mb, global_batch = cfg["data"]["micro_batch"], cfg["train"].get("global_batch", 0)
    return global_batch // mb if global_batch else cfg["train"]["workers"]


def _snapshots(run_dir: Path, events: list[dict[str, Any]]) -> dict[str, Any]:
    """Snapshots taken (workers' reports), restores and where from, parity rebuilds, fallbacks, and what the
    snapshots protect the job against (the launch's ``snapshot_protection`` event, the newest: None before it
    was written)."""
    taken = []
    for path in sorted((run_dir / "workers").glob("w*.json")):
        taken.append(json.loads(path.read_text()).get("snapshots", {}).get("taken", 0))
    restores = [{"step": e["step"], "gen": e["gen"], "source": e["restored_from"], "lost_nodes": e.get("lost_nodes", []),
                 "parity_stripes": e.get("parity_stripes", [])} for e in events if e.get("event") == "job_restore"]
    loaded = [{k: e.get(k) for k in ("worker", "gen", "step", "restored_from", "local", "received", "rebuilt", "seconds")}
              for e in events if e.get("event") == "restored"]
    plans = {e["gen"]: {k: e.get(k) for k in ("gen", "k", "m", "stripes", "groups", "protected")}
             for e in events if e.get("event") == "snapshot_plan"}
    protection = [e for e in events if e.get("event") == "snapshot_protection"]
    return {"taken_per_worker": taken, "plans": [plans[g] for g in sorted(plans)],
            "protection": max(protection, key=lambda e: e.get("t", 0.0), default=None),
            "restores": restores, "loaded": loaded,
            "fallbacks": [e["problem"] for e in events if e.get("event") == "snapshot_fallback"],
            "failed": [e["error"] for e in events if e.get("event") == "snapshot_failed"]}


def _read_config(run_dir: Path) -> dict[str, Any]:
    if not run_dir.is_dir():
        why = "a file, not a directory" if run_dir.exists() else "no such directory"
        raise ValueError(f"{run_dir} is not a run directory ({why})")
    if not (run_dir / "config.json").is_file():
        raise ValueError(f"{run_dir} is not a run directory (no config.json)")
    return json.loads((run_dir / "config.json").read_text())


def _ledger(run_dir: Path, cfg: dict[str, Any], train_lines: int) -> dict[str, Any]:
    """The ledger check's fields; all None for a simulated run (no event files, nothing to check)."""
    if not (run_dir / "events").is_dir():
        return {"committed_steps": train_lines, "lost_steps": None, "rows_trained_never": None,
                "rows_trained_twice": None, "degraded_steps": None, "approx_rows": None, "ledger_ok": None,
                "ledger_examples": []}
    ledger = check_ledger(run_dir, n_slots=_slots(cfg), micro_batch=cfg["data"]["micro_batch"], steps=cfg["train"]["steps"],
                          start_step=_start_step(run_dir), n_workers=cfg["train"]["workers"])
    return {"committed_steps": ledger.committed, "lost_steps": len(ledger.lost_steps),
            "rows_trained_never": ledger.rows_never, "rows_trained_twice": ledger.rows_twice,
            "degraded_steps": ledger.degraded_steps, "approx_rows": ledger.approx_rows,
            "ledger_ok": ledger.ok, "ledger_examples": ledger.examples}


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
    """Each rejoin with the time since the first record of the death it ends (after the previous rejoin), and
    where the joiner's start went (its ``start_phases`` event; a standby's handover has none)."""
    phases = {(e["worker"], e["step"]): e["phases"] for e in events
              if e.get("event") == "start_phases" and e.get("join")}
    down_since: dict[int, float] = {}
    started: dict[int, dict[str, Any]] = {}  # each worker's last worker_start event
    templates: dict[int, dict[str, Any]] = {}  # each node's last template_ready event
    out = []
    for e in sorted((e for e in events if "time" in e), key=lambda e: e.get("t", e["time"])):
        if e.get("event") in ("fault_self", "worker_exit", "fault_injected") and e.get("by") != "worker":
            hit = e.get("targets") if e.get("worker") is None else [e["worker"]]  # a node loss names targets
            for w in hit or []:
                down_since.setdefault(w, e.get("t", e["time"]))
        elif e.get("event") == "worker_start":
            started[e["worker"]] = e
        elif e.get("event") == "template_ready":
            templates[e["node"]] = e
        elif e.get("event") == "restored" and e.get("worker") in down_since:
            # A whole-job restore made it a member again (it loaded the state in the restored view): no rejoin
            # follows, and its time down ends here.
            down_at = down_since.pop(e["worker"])
            out.append({"worker": e["worker"], "step": e["step"], "gen": e["gen"],
                        "down_to_back_s": e["time"] - down_at,
                        "started_as": "restore", "template_phases": None, "start_phases": None})
        elif e.get("event") == "rejoined":
            since = down_since.pop(e["worker"], None)
            start = started.get(e["worker"], {})
            how = "standby" if start.get("standby") else "forked" if start.get("forked") else "fresh process"
            template = templates.get(start.get("node", -1))
            # A template that became ready while the worker was down started for it (a replacement node's).
            template_phases = template["phases"] if template and since is not None and template["t"] >= since \
                else None
            out.append({"worker": e["worker"], "step": e["step"], "gen": e["gen"],
                        "down_to_back_s": e["time"] - since if since is not None else None,
                        "started_as": how if start else None, "template_phases": template_phases,
                        "start_phases": phases.get((e["worker"], e["step"]))})
    return out


def _compiles(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each process's compilation by its first step (its ``compiled`` event), in the order they trained."""
    out = []
    for e in events:
        if e.get("event") == "compiled":
            written, ahead = e.get("written") or {}, e.get("ahead") or {}
            out.append({"worker": e["worker"], "pid": e.get("pid"), "step": e.get("step"), "frames": e.get("frames"),
                        "seconds": e.get("seconds"), "cache_hits": e.get("cache_hits"),
                        "cache_misses": e.get("cache_misses"), "loaded": bool((e.get("cache") or {}).get("loaded")),
                        "wrote": bool(written) and "error" not in written, "ahead_s": ahead.get("seconds")})
    return out


def build_report(run_dir: str | Path) -> dict[str, Any]:
    """:func:`summarize_run` plus what the picture shows: run facts, deaths and the per-step series.

    Raises:
        ValueError: ``run_dir`` is not a run (no ``config.json``, or neither
            ``metrics.jsonl`` nor ``events/``).
    """
    run_dir = Path(run_dir)
    cfg = _read_config(run_dir)
    if not (run_dir / "metrics.jsonl").is_file() and not (run_dir / "events").is_dir():
        raise ValueError(f"{run_dir} is not a run directory (no metrics.jsonl and no events/: nothing to report)")
    report = summarize_run(run_dir)
    steps, n_workers = cfg["train"]["steps"], cfg["train"]["workers"]
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    simulated = not (run_dir / "events").is_dir()
    records = rs.simulated_records(metrics) if simulated else read_events(run_dir)
    states = rs.worker_states(records, n_workers=n_workers, steps=steps)
    loss, val_loss = rs.loss_series(metrics, steps=steps)
    deaths = rs.deaths(records)
    degraded = rs.degraded_series(rs.committed_items(records), steps=steps)
    report.update({
        "name": run_dir.name, "simulated": simulated, "workers": n_workers,
        "workers_per_node": _workers_per_node(run_dir),
        "policy": cfg.get("mecefo", {}).get("policy"), "recovery": cfg.get("fault", {}).get("recovery"),
        "deaths": deaths, "death_count": len(deaths),
        "rejoin_steps": [{"worker": w, "step": s} for w, s in rs.rejoin_steps(records)],
        "final_loss": next((x for x in reversed(loss) if x is not None), None),
        "final_val_loss": next((x for x in reversed(val_loss) if x is not None), None),
        "series": {
            "step": list(range(steps)), "live_workers": rs.live_counts(states, steps=steps),
            "worker_states": states, "stall_s": rs.stall_series(report["failure_details"], steps=steps),
            **{rs.slots_key(mode): n for mode, n in degraded.items()},
            "loss": loss, "val_loss": val_loss,
        },
    })
    return report


def _workers_per_node(run_dir: Path) -> int | None:
    layout = run_dir / "layout.json"
    if not layout.is_file():
        return None
    found = json.loads(layout.read_text()).get("workers_per_node")
    return int(found) if isinstance(found, int) and found > 0 else None


def write_report(run_dir: str | Path) -> dict[str, Any]:
    """Build the report of one run, write ``report.json`` and ``report.png`` into it; returns the report."""
    from unbroken.report.plot import plot_run  # matplotlib only when a picture is drawn

    run_dir = Path(run_dir)
    report = build_report(run_dir)
    report["figure"] = str(plot_run(report, run_dir / "report.png"))
    report["json"] = str(run_dir / "report.json")
    (run_dir / "report.json").write_text(json.dumps(report, indent=1))
    return report


def compare_runs(run_a: str | Path, run_b: str | Path) -> dict[str, Any]:
    """Reports of two runs and their overlay, written to ``run_a/report-vs-<name of run_b>.png``."""
    from unbroken.report.plot import plot_overlay

    a, b = build_report(run_a), build_report(run_b)
    if a["name"] == b["name"]:  # e.g. two runs both called "run": tell them apart by their parents
        a["name"], b["name"] = (f"{Path(r['run_dir']).parent.name}/{r['name']}" for r in (a, b))
    path = Path(run_a) / f"report-vs-{_file_part(Path(run_b).name)}.png"
    plot_overlay([a, b], path)
    ok = [r["ledger_ok"] for r in (a, b)]
    both = False if False in ok else None if None in ok else True  # None: a simulated run has no ledger
    return {"runs": [a, b], "figure": str(path), "ledger_ok": both}


def _file_part(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", name) or "run"


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="unbroken report",
                                 description="Summarise failures and the ledger of a run, and draw it.")
    ap.add_argument("run_dirs", type=Path, nargs="+", metavar="RUN_DIR", help="a run, or two to compare")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    a = ap.parse_args(argv)
    if len(a.run_dirs) > MAX_RUNS:
        raise ValueError(f"unbroken report takes at most {MAX_RUNS} run directories (one to report, two to "
                         f"compare); got {len(a.run_dirs)}: {', '.join(map(str, a.run_dirs))}")
    if len(a.run_dirs) == MAX_RUNS:
        result = compare_runs(*a.run_dirs)
        print(json.dumps(result, indent=1) if a.json else _comparison_text(result))
        return result
    s = write_report(a.run_dirs[0])
    print(json.dumps(s, indent=1) if a.json else _run_text(s))
    return s


def _run_text(s: dict[str, Any]) -> str:
    lines = [f"run {s['run_dir']}: {s['committed_steps']}/{s['steps']} steps committed, "
             f"normal step {s['normal_step_s'] * 1000:.1f} ms",
             f"failures: {s['failures']}  stall per failure: median {_fmt(s['stall_per_failure_s']['median'])}"
             f"  max {_fmt(s['stall_per_failure_s']['max'])}"]
    for f in s["failure_details"]:
        lines.append(f"  step {f['step']:>6}  view {f['gen']:>3}  stall {_fmt(f['stall_s'])}  "
                     f"reconfigure {_fmt(f['reconfigure_s'])}  {f['reason'][:70]}")
    for r in s["rejoins"]:
        parts = [r["started_as"]] if r.get("started_as") else []
        if r.get("template_phases"):
            parts.append("template " + ", ".join(f"{k} {v:.2f} s" for k, v in r["template_phases"].items()))
        if r.get("start_phases"):
            parts.append("start " + ", ".join(f"{k} {v:.2f} s" for k, v in r["start_phases"].items()))
        where = f" ({'; '.join(parts)})" if parts else ""
        lines.append(f"  worker {r['worker']} back at step {r['step']} after {_fmt(r['down_to_back_s'])}{where}")
    for ep in s.get("stragglers", []):
        lines.append(f"  straggler: worker {ep['worker']} from step {ep['since']} "
                     f"{'to ' + str(ep['until']) if ep['until'] is not None else 'to the end'} ({ep['steps']} steps), "
                     f"{ep['rows_moved']} rows moved to the others, step time "
                     f"{'-' if ep['cost'] is None else format(ep['cost'], '.2f')} x the other steps")
    lines += [_recovery_line(r) for r in s.get("recoveries", [])]
    lines += [_compile_line(c) for c in s.get("compiles", [])]
    lines += _snapshot_lines(s["snapshots"])
    if s["ledger_ok"] is None:
        lines.append("ledger: none (a simulated run writes no event files)")
    else:
        lines.append(f"lost steps: {s['lost_steps']}  rows trained never: {s['rows_trained_never']}  "
                     f"twice: {s['rows_trained_twice']}  degraded steps: {s['degraded_steps']}  "
                     f"ledger {rs.ledger_verdict(s['ledger_ok'])}")
    lines += [f"  {ex}" for ex in s["ledger_examples"]]
    lines.append(f"picture: {s['figure']}  data: {s['json']}")
    return "\n".join(lines)


RECOVERY_PHASES = (("death_seen", "death seen"), ("process_ready", "process ready"), ("decided", "decided"),
                   ("state_loaded", "state loaded"), ("first_step", "first step"), ("steps_back", "back at speed"))


def _recovery_line(r: dict[str, Any]) -> str:
    """One kill's recovery: each phase's seconds after the kill (``-``: no event for it)."""
    load = r.get("load") or {}
    loaded = f" ({load['bytes'] / 1e9:.2f} GB at {load['gb_s']:.2f} GB/s)" if load.get("gb_s") else ""
    phases = ", ".join(f"{label} +{_fmt(r.get(key))}" + (loaded if key == "state_loaded" else "")
                       for key, label in RECOVERY_PHASES)
    what = "whole job" if r.get("whole_job") else f"worker{'s' if len(r['workers']) > 1 else ''} {r['workers']}"
    return f"  recovery from a kill at step {r.get('kill_step')} ({what}): {phases}"


def _compile_line(c: dict[str, Any]) -> str:
    """One process's compilation by its first step."""
    notes = [f"compiled ahead as a standby in {_fmt(c['ahead_s'])}"] if c.get("ahead_s") is not None else []
    notes += ["loaded the job's compile cache"] if c["loaded"] else []
    notes += ["wrote the job's compile cache"] if c["wrote"] else []
    return (f"  compile: worker {c['worker']} (pid {c['pid']}, step {c['step']}): {c['frames']} frames in "
            f"{_fmt(c['seconds'])}, {c['cache_hits']} graphs from a cache, {c['cache_misses']} built"
            + (f"; {', '.join(notes)}" if notes else ""))


def _snapshot_lines(sn: dict[str, Any]) -> list[str]:
    taken = sn["taken_per_worker"]
    lines = [f"snapshots: {max(taken) if taken else 0} taken per worker"
             + (f", {len(sn['restores'])} whole-job restore(s)" if sn["restores"] else "")]
    guard = sn.get("protection")
    if guard is not None:  # UNPROTECTED in capitals: the one line of the report that must not be missed
        lines.append(f"  {'protected' if guard['protected'] else 'UNPROTECTED'}: {guard['message']}")
    for r in sn["restores"]:
        lost = f", nodes {r['lost_nodes']} lost" if r["lost_nodes"] else ""
        rebuilt = f", stripes {r['parity_stripes']} rebuilt from parity" if r["parity_stripes"] else ""
        lines.append(f"  restored at step {r['step']} (view {r['gen']}) from {r['source']}{lost}{rebuilt}")
    lines += [f"  fallback: {p}" for p in sn["fallbacks"]] + [f"  snapshot failed: {e}" for e in sn["failed"]]
    return lines


HEADLINE: tuple[tuple[str, Any], ...] = (
    ("steps committed", lambda s: f"{s['committed_steps']}/{s['steps']}"),
    ("policy / recovery", lambda s: f"{s['policy']} / {s['recovery']}"),
    ("normal step", lambda s: f"{s['normal_step_s'] * 1000:.1f} ms"),
    ("failures", lambda s: s["failures"]),
    ("deaths", lambda s: s["death_count"]),
    ("stall median", lambda s: _fmt(s["stall_per_failure_s"]["median"])),
    ("stall max", lambda s: _fmt(s["stall_per_failure_s"]["max"])),
    ("rejoins", lambda s: len(s["rejoins"])),
    ("job restores", lambda s: len(s["snapshots"]["restores"])),
    ("snapshots", lambda s: _protection(s["snapshots"].get("protection"))),
    ("lost steps", lambda s: _dash(s["lost_steps"])),
    ("degraded steps", lambda s: _dash(s["degraded_steps"])),
    ("approx rows", lambda s: _dash(s["approx_rows"])),
    ("final loss", lambda s: _num(s["final_loss"])),
    ("final val loss", lambda s: _num(s["final_val_loss"])),
    ("ledger", lambda s: rs.ledger_verdict(s["ledger_ok"])),
)
"""The rows of the side-by-side comparison: label, value of one report."""


def _comparison_text(result: dict[str, Any]) -> str:
    runs = result["runs"]
    cells = [[str(get(s)) for s in runs] for _, get in HEADLINE]
    width = max(len(r["name"]) for r in runs)
    width = max([width] + [len(c) for row in cells for c in row]) + 2
    lines = [f"{'':<18}" + "".join(f"{r['name']:>{width}}" for r in runs)]
    lines += [f"{label:<18}" + "".join(f"{c:>{width}}" for c in row) for (label, _), row in zip(HEADLINE, cells)]
    lines.append(f"picture: {result['figure']}")
    return "\n".join(lines)


def _protection(guard: dict[str, Any] | None) -> str:
    """``protected``, ``UNPROTECTED``, or ``-`` for a run without the launch's event (simulated, or older)."""
    return "-" if guard is None else "protected" if guard["protected"] else "UNPROTECTED"


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f} s"


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _dash(x: Any) -> str:
    return "-" if x is None else str(x)
