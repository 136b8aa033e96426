"""What watching a job costs its training: ``python -m benchmarks.monitor_overhead`` runs the same job
(``--preset``, ``--nodes`` x ``--workers-per-node``, ``--steps``; ``--section.field=value`` overrides) with
every watcher of the ``monitor`` section off and on (TensorBoard, W&B offline, a Prometheus endpoint on a free
port, scraped every ``--scrape-s`` seconds while the job runs), alternating, ``--pairs`` times, and prints the
median tokens/s of each and their ratio as JSON.

Target: with every watcher on, the ``debug`` 2 x 2 job's tokens/s at least 0.99 of the same job's without
(the watchers run in one process of their own, beside the launcher, never in a worker).

Invariants: both sides are the same job on the same machine in one invocation; a figure is the summary's
steady-state ``tokens_per_s`` of each run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import threading
import urllib.request
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


def _scraper(run_dir: Path, every_s: float, stop: threading.Event) -> threading.Thread:
    """Scrape the endpoint every ``every_s`` as a Prometheus server would, until ``stop``."""
    def scrape() -> None:
        endpoint = run_dir / "monitor" / "endpoint.json"
        while not stop.wait(every_s):
            try:
                url = json.loads(endpoint.read_text())["url"]
                with urllib.request.urlopen(url, timeout=5) as answer:
                    answer.read()
            except (OSError, ValueError, KeyError):
                pass  # not listening yet
    thread = threading.Thread(target=scrape, name="scrape", daemon=True)
    thread.start()
    return thread


def _run(args: argparse.Namespace, overrides: list[str], watched: bool, out: Path) -> float:
    cfg = load_config(preset_name=args.preset, overrides=[f"train.steps={args.steps}", "train.val_every=0",
                                                          *overrides, *(WATCHERS if watched else [])])
    stop = threading.Event()
    scraper = _scraper(out, args.scrape_s, stop) if watched else None
    try:
        summary = launch(cfg, out, nodes=args.nodes, workers_per_node=args.workers_per_node)
    finally:
        stop.set()
        if scraper is not None:
            scraper.join(10)
    return float(summary["tokens_per_s"])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.monitor_overhead", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="debug")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--workers-per-node", type=int, default=2)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--pairs", type=int, default=2, help="off/on runs, alternating")
    ap.add_argument("--scrape-s", type=float, default=1.0)
    ap.add_argument("--out", type=Path, default=None, help="where the runs go (default: a temporary directory)")
    args, overrides = parse_with_overrides(ap, argv)
    figures: dict[str, list[float]] = {"off": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp:
        root = args.out or Path(tmp)
        for i in range(args.pairs):
            for side in ("off", "on"):
                figures[side].append(_run(args, overrides, side == "on", root / f"{side}{i}"))
    off, on = statistics.median(figures["off"]), statistics.median(figures["on"])
    result = {"job": f"{args.preset} {args.nodes}x{args.workers_per_node}, {args.steps} steps",
              "tokens_per_s_off": figures["off"], "tokens_per_s_on": figures["on"], "median_off": off,
              "median_on": on, "ratio": on / off, "target": TARGET_RATIO, "meets_target": on / off >= TARGET_RATIO,
              "machine": machine_description()}
    print(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
