"""What watching a job costs its training: ``python -m benchmarks.monitor_overhead`` runs the same job
(``--preset``, ``--nodes`` x ``--workers-per-node``, ``--steps``; ``--section.field=value`` overrides) with
every watcher of the ``monitor`` section off and on (TensorBoard, W&B offline, a Prometheus endpoint on a free
port, scraped every ``--scrape-s`` seconds while the job runs), in ``--pairs`` pairs, and prints the tokens/s
of each run and the ratio as JSON.

Target: with every watcher on, the ``debug`` 2 x 2 job's tokens/s at least 0.99 of the same job's without
(the watchers run in one process of their own, at a lower priority, beside the launcher, never in a worker).

Fairness: both sides are the same job (same config, same seed) on the same machine in one invocation; a figure
is the summary's steady-state ``tokens_per_s`` of a run (the median step after the first fifth: start-up and
warm-up excluded); the pairs alternate their order (off-on, on-off, ...), so neither side always runs second;
``ratio`` is the median of the pairs' ratios, each pair's two runs being neighbours in time on a machine whose
other load drifts (``ratio_of_medians`` is printed beside it). The scraper is a process of its own, as a
Prometheus server is, not a thread of the launcher that hosts the job's store. On a machine other work shares,
the runs' spread can exceed the 1 % sought, so each watched run's monitor also says what it cost
(``RUN/monitor/usage.json``): ``monitor_machine_share`` is its CPU seconds while the job trained with every
sink started over the machine's CPU seconds in that time, what it could take from a job that fills the machine
at most (it runs at a lower priority than the workers); ``monitor_startup_cpu_s`` the rest (mostly importing
the sinks' libraries, once per job, while the workers start).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from unbroken.agent.launcher import launch
from unbroken.bench._args import parse_with_overrides
from unbroken.bench.machine import machine_description
from unbroken.config import load_config

__all__ = ["TARGET_RATIO", "main"]

TARGET_RATIO = 0.99
WATCHERS = ["monitor.tensorboard=true", "monitor.wandb=true", "monitor.wandb_mode=offline",
            "monitor.prometheus_port=0"]


SCRAPE = """
import json, select, sys, urllib.request
endpoint, every_s = sys.argv[1], float(sys.argv[2])
while not select.select([sys.stdin], [], [], every_s)[0]:  # anything on stdin (or its end): stop
    try:
        with open(endpoint) as fh:
            url = json.load(fh)["url"]
        with urllib.request.urlopen(url, timeout=5) as answer:
            answer.read()
    except (OSError, ValueError, KeyError):
        pass  # not listening yet
"""
"""The scraper's program: the endpoint every ``every_s`` seconds, as a Prometheus server would, until its
standard input closes."""


def _scraper(run_dir: Path, every_s: float) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", SCRAPE, str(run_dir / "monitor" / "endpoint.json"), str(every_s)],
                            stdin=subprocess.PIPE)


def _run(args: argparse.Namespace, overrides: list[str], watched: bool,
         out: Path) -> tuple[float, tuple[float, float] | None]:
    """The run's steady-state tokens/s, and with the watchers on their share of the machine while it trained and
    the CPU seconds of their start."""
    cfg = load_config(preset_name=args.preset, overrides=[f"train.steps={args.steps}", "train.val_every=0",
                                                          *overrides, *(WATCHERS if watched else [])])
    scraper = _scraper(out, args.scrape_s) if watched else None
    try:
        summary = launch(cfg, out, nodes=args.nodes, workers_per_node=args.workers_per_node)
    finally:
        if scraper is not None:
            assert scraper.stdin is not None
            scraper.stdin.close()
            try:
                scraper.wait(timeout=10)
            except subprocess.TimeoutExpired:
                scraper.kill()
                scraper.wait(timeout=10)
    share = None
    if watched:
        usage = json.loads((out / "monitor" / "usage.json").read_text())
        if usage.get("steady_s"):  # (none: the job ended before every sink started)
            share = (usage["steady_cpu_s"] / (usage["steady_s"] * (os.cpu_count() or 1)),
                     usage["cpu_s"] - usage["steady_cpu_s"])
    return float(summary["tokens_per_s"]), share


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.monitor_overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--workers-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--pairs", type=int, default=5, help="off/on pairs, their order alternating")
    ap.add_argument("--scrape-s", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    args, overrides = parse_with_overrides(ap, argv)
    figures: dict[str, list[float]] = {"off": [], "on": []}
    shares: list[tuple[float, float]] = []
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        for i in range(args.pairs):
            for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
                tokens_per_s, share = _run(args, overrides, side == "on", root / f"{side}{i}")
                figures[side].append(tokens_per_s)
                shares += [share] if share is not None else []
    off, on = statistics.median(figures["off"]), statistics.median(figures["on"])
    pair_ratios = [b / a for a, b in zip(figures["off"], figures["on"])]
    ratio = statistics.median(pair_ratios)
    result = {"job": f"{args.preset} {args.nodes}x{args.workers_per_node}, {args.steps} steps",
              "tokens_per_s_off": figures["off"], "tokens_per_s_on": figures["on"], "pair_ratios": pair_ratios,
              "median_off": off, "median_on": on, "ratio": ratio, "ratio_of_medians": on / off,
              "target": TARGET_RATIO, "meets_target": ratio >= TARGET_RATIO,
              "monitor_machine_share": [round(x, 5) for x, _ in shares],
              "monitor_startup_cpu_s": [round(x, 3) for _, x in shares],
              "load_average_1m": round(os.getloadavg()[0], 2), "machine": machine_description()}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
