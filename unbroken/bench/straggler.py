"""A straggler's cost: one worker slowed ``F`` times, with and without its rows moved to the others.

``unbroken bench straggler --preset debug --workers 4 --factor 2 --steps 100 --slow-from 10`` trains the same
job three times, side by side (the order rotated each repeat): with no slow worker (``none``); with worker 1
slowed ``F`` times from ``--slow-from`` to the end (``--fail-at step=S:worker=1:slow:factor=F``) and
stragglers left alone (``slow``, ``fault.straggler_factor=0``); and the same with its rows moved to the others
(``balanced``, ``fault.straggler_factor`` and ``fault.straggler_steps`` as given). Each run's tokens/s is over
its steps from ``--slow-from`` on (its detection included): the tokens trained over the sum of their step
times. It reports both slowed runs' ratios to ``none`` (the median over the repeats of each repeat's ratio: the
machine's load moves between repeats), each run's ledger check, and the balanced run's straggler episodes
(:mod:`unbroken.runtime.stragglers`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path
from typing import Any

from unbroken.agent.launcher import launch_local
from unbroken.bench._args import parse_with_overrides
from unbroken.bench.machine import machine_description
from unbroken.config import load_config
from unbroken.jsonl import read_jsonl
from unbroken.report.run_report import summarize_run

RUNS = ("none", "slow", "balanced")


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="unbroken bench straggler", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--slow-from", type=int, default=10, help="the first slowed step")
    ap.add_argument("--factor", type=float, default=2.0, help="worker 1's slowdown F (> 1)")
    ap.add_argument("--straggler-factor", type=float, default=1.5, help="fault.straggler_factor of the balanced run")
    ap.add_argument("--straggler-steps", type=int, default=3, help="fault.straggler_steps of the balanced run")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/straggler.json"))
    a, overrides = parse_with_overrides(ap, argv)
    if a.workers < 2 or not a.factor > 1 or not 0 <= a.slow_from < a.steps - 2 or a.repeats < 1:
        raise ValueError(f"--workers {a.workers} --factor {a.factor} --slow-from {a.slow_from} --steps {a.steps} "
                         f"--repeats {a.repeats}: need 2+ workers, F > 1, a first slowed step before the last two, "
                         "1+ repeats")
    common = overrides + [f"train.workers={a.workers}", f"train.steps={a.steps}", "train.val_every=0",
                          "train.val_batches=1"]
    shapes = {"none": [], "slow": ["fault.straggler_factor=0"],
              "balanced": [f"fault.straggler_factor={a.straggler_factor}", f"fault.straggler_steps={a.straggler_steps}"]}
    slow = f"step={a.slow_from}:worker=1:slow:factor={a.factor:g}"
    rates: dict[str, list[float]] = {name: [] for name in RUNS}
    checks: dict[str, list[dict[str, Any]]] = {name: [] for name in RUNS}
    episodes: list[list[dict[str, Any]]] = []
    with tempfile.TemporaryDirectory(prefix="unbroken-bench-") as tmp:
        for i in range(a.repeats):
            for name in RUNS[i % 3:] + RUNS[:i % 3]:
                cfg = load_config(preset_name=a.preset, overrides=common + shapes[name] +
                                  ([f"fault.fail_at={slow}"] if name != "none" else []))
                run = Path(tmp) / f"{name}-{i}"
                launch_local(cfg, run)
                rates[name].append(_rate(run, a.slow_from))
                report = summarize_run(run)
                checks[name].append({"ledger_ok": report["ledger_ok"], "rows_twice": report["rows_trained_twice"],
                                     "rows_never": report["rows_trained_never"]})
                if name == "balanced":
                    episodes.append(report["stragglers"])
    med = {name: statistics.median(v) for name, v in rates.items()}
    ratio = {name: statistics.median(r / n for r, n in zip(rates[name], rates["none"])) for name in RUNS}
    result = {"benchmark": "straggler", "preset": a.preset, "workers": a.workers, "steps": a.steps,
              "slow_from": a.slow_from, "factor": a.factor, "straggler_factor": a.straggler_factor,
              "straggler_steps": a.straggler_steps, "repeats": a.repeats, "overrides": overrides,
              "tokens_per_s": rates, "median_tokens_per_s": med,
              "slow_vs_none": ratio["slow"], "balanced_vs_none": ratio["balanced"],
              "ledger": checks, "episodes": episodes, "machine": machine_description()}
    print(f"{a.workers} workers, worker 1 slowed {a.factor:g}x from step {a.slow_from} of {a.steps}; tokens/s over "
          f"those steps (median of {a.repeats})")
    print(f"{'run':>9} {'tokens/s':>10} {'vs none':>8} {'ledger':>7}")
    for name in RUNS:
        ok = all(c["ledger_ok"] for c in checks[name])
        print(f"{name:>9} {med[name]:>10,.0f} {ratio[name]:>8.3f} {'ok' if ok else 'FAILED':>7}")
    for ep in (episodes[0] if episodes else []):
        print(f"balanced: worker {ep['worker']} slow from step {ep['since']} to "
              f"{ep['until'] if ep['until'] is not None else 'the end'}, {ep['rows_moved']} rows moved")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return result


def _rate(run: Path, first: int) -> float:
    """Tokens per second of the run's steps ``first`` and later (a train record's ``step`` is the steps done)."""
    records = [r for r in read_jsonl(run / "metrics.jsonl") if r.get("kind") == "train" and r["step"] > first]
    if not records:
        raise RuntimeError(f"{run}: no train records past step {first}")
    tokens = sum(r["tokens_per_s"] * r["step_time_s"] for r in records)
    return tokens / sum(r["step_time_s"] for r in records)
