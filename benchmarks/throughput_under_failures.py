"""Throughput under failures in MeCeFO's setting, per takeover policy: ``python -m benchmarks.throughput_under_failures``.

MeCeFO's headline (the paper's abstract): under its ``high`` failure regime a job loses 4.18 % of its failure-free
throughput. This study runs the same job (``--preset``, default ``tiny``, ``--nodes`` x ``--workers-per-node``
workers, default 2 x 2) failure-free and under each failure trace (``--traces``, default ``high,mid,low``:
:data:`unbroken.faults.trace_presets.TRACE_PRESETS`, drawn over ``--job-hours`` of wall clock, one failure at a time
with ``--max-down 1``, the traces' own rates with ``--max-down none``), once per takeover policy (``--policies``,
default ``neighbor,spread,spread-approx``), and reports each run's tokens/s over the failure-free run's.
Throughput is committed tokens over the wall clock from the first to the last applied step (``metrics.jsonl``).

Where workers share cores (4 workers on this repository's 2-core machine), a dead worker's share of the cores goes
to the survivors, and a run under failures can be faster than the failure-free one: the runs then measure the
machine, not one device per worker. Each policy's row therefore also carries ``model``, its throughput from its
phases as one device per worker would see it: every degraded step costs the covering worker's step, measured
side by side against a normal one by ``unbroken bench takeover`` in the same invocation (one thread, compile off:
``cover`` in the JSON), and every failure the run's measured stall per failure.

Slots: a step's global batch is ``--slots`` micro-batches (default: one per worker). With more slots than workers the
study passes ``train.global_batch = slots * data.micro_batch`` (several micro-batches per worker), so ``4 workers x
8 slots`` (MeCeFO's n = 32) is a flag; a build whose config has no ``train.global_batch`` runs one slot per worker and
refuses another count.

Two comparisons are modelled, not run (the runtime has neither mode), from phases measured in the same invocation,
and marked ``"modelled": true`` in the JSON:

- **drop-the-step** (torchft's way): a failure drops the step in flight (its time spent, its tokens not trained),
  the survivors regroup and go on with their own slots only, so every step of an outage trains ``live / n`` of the
  global batch in a failure-free step's time, until the worker returns;
- **checkpoint-restart from memory** (REFT's way, with a spare for the failed worker): a failure restarts every
  worker, which loads the last step's state from snapshot memory; the step in flight is lost; after the restart the
  job trains at full strength.

Measured phases they use: ``step_s``, the failure-free run's median step time; ``detect_s``, the smallest of the
policies' median stalls per failure under the same trace (a failure's detection, the survivors' agreement on a new
view and its group, plus whatever the policy recomputed: an upper bound of what dropping the step costs besides
the step); ``restart_s``, the median start of a worker that came back in those runs (its ``start_phases``, process
to admission: a start forked from its node's template, the state received from a peer's memory), or where every
worker came back as a warm standby, of the failure-free run's first starts (no state to load: a ``tiny`` model's
state loads from memory in milliseconds; ``restart_s_from`` says which). Per failure, drop
costs ``step_s + detect_s`` and trains ``live / n`` during the outage; restart costs ``step_s + detect_s +
restart_s`` and trains everything. The failures and outages are the trace's own, the runs' trace.

Invariants: every figure of a run comes from that run's records; a modelled row names the measured phases it used;
nothing is modelled from a phase no run measured (the row says so instead).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import tempfile
from pathlib import Path
from typing import Any

from unbroken.agent.launcher import launch
from unbroken.bench._args import parse_with_overrides
from unbroken.bench.machine import machine_description
from unbroken.config import Config, load_config
from unbroken.faults.traces import FailureTrace, generate_trace, step_time_for
from unbroken.jsonl import read_jsonl
from unbroken.report.run_report import summarize_run
from unbroken.runtime.ledger import read_events

__all__ = ["PAPER_LOSS_HIGH", "covered", "drop_the_step", "main", "restart_from_memory", "slot_overrides"]

PAPER_LOSS_HIGH = 0.0418
"""MeCeFO's throughput loss under its high failure rate (the paper's abstract)."""


def slot_overrides(cfg: Config, slots: int) -> list[str]:
    """The overrides that give a step ``slots`` micro-batches: ``train.global_batch`` where the config has it.

    Raises:
        ValueError: ``slots`` is not a multiple of the workers, or differs from them where the config has one
            slot per worker.
    """
    workers = cfg.train.workers
    if slots == workers:
        return []
    if slots < workers or slots % workers:
        raise ValueError(f"--slots={slots}: need a multiple of the {workers} workers")
    if "global_batch" not in {f.name for f in dataclasses.fields(cfg.train)}:
        raise ValueError(f"--slots={slots}: this build trains one slot per worker (no train.global_batch): "
                         f"use --slots={workers}")
    return [f"train.global_batch={slots * cfg.data.micro_batch}"]


def _config(a: argparse.Namespace, *extra: str) -> Config:
    base = [*a.overrides, f"train.steps={a.steps}", "train.val_every=0", "train.val_batches=1",
            f"train.workers={a.nodes * a.workers_per_node}"]
    cfg = load_config(preset_name=a.preset, overrides=base)
    return load_config(preset_name=a.preset, overrides=[*base, *slot_overrides(cfg, a.slots), *extra])


def _trace_overrides(a: argparse.Namespace, trace: str) -> list[str]:
    return [f"fault.trace={trace}", f"fault.job_hours={a.job_hours}",
            *([] if a.max_down == "none" else [f"fault.max_down={a.max_down}"])]


def _run(a: argparse.Namespace, tmp: Path, name: str, cfg: Config, **kw: Any) -> dict[str, Any]:
    run_dir = tmp / name
    summary = launch(cfg, run_dir, nodes=a.nodes, workers_per_node=a.workers_per_node, **kw)
    train = [r for r in read_jsonl(run_dir / "metrics.jsonl") if r["kind"] == "train"]
    span = train[-1]["time"] - train[0]["time"]
    report = summarize_run(run_dir)
    starts = [e for e in read_events(run_dir) if e.get("event") == "start_phases"]
    rejoins = [float(e["total_s"]) for e in starts if e.get("join")]
    return {"tokens_per_s": (train[-1]["tokens"] - train[0]["tokens"]) / span,
            "median_step_s": statistics.median(r["step_time_s"] for r in train),
            "failures": report["failures"], "stall_median_s": report["stall_per_failure_s"]["median"],
            "rejoin_start_s": statistics.median(rejoins) if rejoins else None,
            "first_start_s": statistics.median(float(e["total_s"]) for e in starts if not e.get("join"))
            if any(not e.get("join") for e in starts) else None,
            "degraded_steps": report.get("degraded_steps"), "lost_steps": report.get("lost_steps"),
            "ledger_ok": report.get("ledger_ok"), "job_failures": summary.get("failures")}


def drop_the_step(trace: FailureTrace, *, step_s: float, detect_s: float) -> dict[str, Any]:
    """Throughput of dropping the step in flight at each failure, relative to failure-free (module docstring)."""
    n, steps = trace.n_workers, trace.n_steps
    failures = sum(len(trace.failures_at(s)) for s in range(steps))
    trained = sum((n - len(trace.down_at(s))) / n for s in range(steps))
    seconds = steps * step_s + failures * (step_s + detect_s)
    return {"modelled": True, "throughput_ratio": (trained / steps) / (seconds / (steps * step_s)),
            "failures": failures, "trained_share": trained / steps,
            "phases": {"step_s": step_s, "detect_s": detect_s}}


def restart_from_memory(trace: FailureTrace, *, step_s: float, detect_s: float, restart_s: float) -> dict[str, Any]:
    """Throughput of restarting every worker from snapshot memory at each failure, relative to failure-free."""
    steps = trace.n_steps
    failures = sum(len(trace.failures_at(s)) for s in range(steps))
    seconds = steps * step_s + failures * (step_s + detect_s + restart_s)
    return {"modelled": True, "throughput_ratio": (steps * step_s) / seconds, "failures": failures,
            "phases": {"step_s": step_s, "detect_s": detect_s, "restart_s": restart_s}}


def covered(trace: FailureTrace, *, step_s: float, stall_s: float, cover_ratio: float) -> dict[str, Any]:
    """Throughput of a takeover policy relative to failure-free, from its phases: every degraded step takes the
    covering worker's step (``cover_ratio`` normal steps: the others wait for it at the reduction), every failure
    its stall; nothing is lost. One down worker's ratio stands for every degraded step (exact with
    ``max_down`` 1)."""
    steps = trace.n_steps
    failures = sum(len(trace.failures_at(s)) for s in range(steps))
    degraded = sum(1 for s in range(steps) if trace.down_at(s))
    seconds = (steps - degraded) * step_s + degraded * step_s * cover_ratio + failures * stall_s
    return {"modelled": True, "throughput_ratio": (steps * step_s) / seconds, "failures": failures,
            "phases": {"step_s": step_s, "stall_s": stall_s, "cover_ratio": cover_ratio}}


def _cover_ratios(a: argparse.Namespace, tmp: Path, workers: int) -> dict[str, Any] | None:
    """Each policy's covering step over a normal one, measured side by side (``unbroken bench takeover``, one
    thread, compile off); None with ``--cover-repeats 0``."""
    if not a.cover_repeats:
        return None
    from unbroken.bench import takeover

    r = takeover.main(["--preset", a.preset, "--slots", str(workers), "--threads", "1", "--compile", "off",
                       "--repeats", str(a.cover_repeats), "--policies", a.policies, "--out", str(tmp / "takeover.json"),
                       *[f"--{o}" for o in a.overrides]])
    return {"time_ratio": {p: v["time_ratio"]["off"] for p, v in r["policies"].items()},
            "flop_ratio": {p: v["flop_ratio"] for p, v in r["policies"].items()}, "repeats": a.cover_repeats}


def _trace_of(cfg: Config) -> FailureTrace:
    """The trace the launcher draws for ``cfg`` (:func:`unbroken.agent.launcher.launch`'s arguments)."""
    return generate_trace(cfg.fault.trace, n_workers=cfg.train.workers, n_steps=cfg.train.steps,
                          step_time_s=step_time_for(cfg.train.steps, cfg.fault.job_hours), seed=cfg.train.seed,
                          min_live=1, cluster_workers=cfg.fault.cluster_workers, max_down=cfg.fault.max_down)


def _one_trace(a: argparse.Namespace, tmp: Path, trace: str, base: dict[str, Any],
               cover: dict[str, Any] | None) -> dict[str, Any]:
    rows: dict[str, Any] = {}
    cfg = None
    for policy in a.policies.split(","):
        cfg = _config(a, *_trace_overrides(a, trace), f"mecefo.policy={policy}")
        r = _run(a, tmp, f"{trace}_{policy}", cfg, standby=a.standby)
        rows[policy] = {"throughput_ratio": r["tokens_per_s"] / base["tokens_per_s"], **r}
    assert cfg is not None
    drawn = _trace_of(cfg)
    for policy, ratio in (cover["time_ratio"] if cover is not None else {}).items():
        rows[policy]["model"] = covered(drawn, step_s=base["median_step_s"],
                                        stall_s=max(0.0, rows[policy]["stall_median_s"] or 0.0), cover_ratio=ratio)
    # A stall is a gap minus a normal step: on a noisy machine a few come out below zero (counted as none).
    stalls = [max(0.0, r["stall_median_s"]) for r in rows.values() if r["stall_median_s"] is not None]
    # A worker's start: of those that came back in the trace runs (forked, the state received from a peer) or,
    # where none came back through a cold start (warm standbys), of the failure-free run's first starts.
    starts = [r["rejoin_start_s"] for r in rows.values() if r["rejoin_start_s"] is not None]
    start_source = "rejoins" if starts else "first starts"
    starts = starts or ([base["first_start_s"]] if base["first_start_s"] is not None else [])
    step_s = base["median_step_s"]
    if stalls:
        rows["drop-the-step"] = drop_the_step(drawn, step_s=step_s, detect_s=min(stalls))
    else:
        rows["drop-the-step"] = {"modelled": True, "throughput_ratio": None, "why": "no run measured a stall"}
    if stalls and starts:
        rows["checkpoint-restart-from-memory"] = restart_from_memory(drawn, step_s=step_s, detect_s=min(stalls),
                                                                      restart_s=statistics.median(starts))
        rows["checkpoint-restart-from-memory"]["restart_s_from"] = start_source
    else:
        rows["checkpoint-restart-from-memory"] = {"modelled": True, "throughput_ratio": None,
                                                  "why": "no run measured a stall and a worker's start"}
    return {"failures": sum(len(drawn.failures_at(s)) for s in range(drawn.n_steps)),
            "degraded_fraction": drawn.degraded_fraction(), "down_fraction": drawn.down_fraction(),
            "most_down": drawn.most_down(), "rows": rows}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.throughput_under_failures",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--workers-per-node", type=int, default=2)
    ap.add_argument("--slots", type=int, default=None, help="micro-batches per step (default: one per worker)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--traces", default="high,mid,low")
    ap.add_argument("--policies", default="neighbor,spread,spread-approx")
    ap.add_argument("--job-hours", type=float, default=2.0,
                    help="wall-clock hours each run stands for (scales the traces to --steps)")
    ap.add_argument("--max-down", default="1", help="workers down at once at most (1: one failure at a time; "
                                                    "none: the traces' own rates)")
    ap.add_argument("--standby", action=argparse.BooleanOptionalAction, default=True,
                    help="each node keeps a warm standby (a returning worker starts from it)")
    ap.add_argument("--cover-repeats", type=int, default=6,
                    help="timed repetitions of each policy's covering step (unbroken bench takeover) for the "
                         "policies' modelled rows (0: none)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/throughput_under_failures.json"))
    a, overrides = parse_with_overrides(ap, argv)
    a.overrides = overrides
    a.slots = a.slots or a.nodes * a.workers_per_node
    base_cfg = _config(a)
    result: dict[str, Any] = {
        "benchmark": "throughput_under_failures", "preset": a.preset, "workers": base_cfg.train.workers,
        "slots": a.slots, "micro_batch": base_cfg.data.micro_batch, "steps": a.steps, "job_hours": a.job_hours,
        "max_down": a.max_down, "standby": a.standby, "overrides": a.overrides, "machine": machine_description(),
        "modelled": "drop-the-step and checkpoint-restart-from-memory are modelled from phases measured in the same "
                    "invocation (benchmarks/throughput_under_failures.py's docstring); every other row is a run",
        "paper": {"trace": "high", "throughput_loss": PAPER_LOSS_HIGH}}
    result["load_average"] = {"start": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="unbroken-tuf-") as tmp:
        result["cover"] = cover = _cover_ratios(a, Path(tmp), base_cfg.train.workers)
        base = _run(a, Path(tmp), "failure_free", base_cfg, standby=a.standby)
        result["failure_free"] = base
        result["traces"] = {t: _one_trace(a, Path(tmp), t, base, cover) for t in a.traces.split(",")}
    result["load_average"]["end"] = os.getloadavg()
    _print(result)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1, default=str))
    print(f"wrote {a.out}")
    return result


def _print(r: dict[str, Any]) -> None:
    print(f"{r['preset']}, {r['workers']} workers x {r['slots']} slots, {r['steps']} steps standing for "
          f"{r['job_hours']} h, max_down {r['max_down']}: failure-free {r['failure_free']['tokens_per_s']:.0f} tokens/s")
    for name, t in r["traces"].items():
        print(f"trace {name}: {t['failures']} failures, degraded {t['degraded_fraction']:.0%} of steps")
        for row, v in t["rows"].items():
            print(f"  {row:32s} {_ratio(v)}{'  modelled' if v.get('modelled') else ''}"
                  f"{'  (from its phases: ' + _ratio(v['model']) + ')' if 'model' in v else ''}")
    print(f"MeCeFO's paper, trace high: {r['paper']['throughput_loss']:.2%} loss")



def _ratio(row: dict[str, Any]) -> str:
    ratio = row["throughput_ratio"]
    return "n/a" if ratio is None else f"{ratio:.3f} ({1 - ratio:+.2%} loss)"


if __name__ == "__main__":
    main()
