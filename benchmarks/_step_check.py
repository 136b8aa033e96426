"""What a per-step check costs beside one slot's compute: the harness of ``benchmarks.nonfinite_check`` and
``benchmarks.param_check``.

For each preset, on one device (``--device``, default the CPU with one thread), the job is built as a worker
builds it; then, in one run, the median of ``--steps`` computes of one slot (forward and backward,
:meth:`~unbroken.job.Job.gradient_sums`) beside the median of the check (its wait for the device included),
timed ``repeats`` times per compute (one check is below the clock's resolution).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from unbroken.bench.machine import machine_description
from unbroken.config import load_config
from unbroken.job import Job, prepare
from unbroken.job.builder import build_job
from unbroken.mecefo.gradients import SlotWork

Check = Callable[[Job, torch.Tensor, int], None]
"""``check(job, sums, step)``: the check once, waiting for its result (raises where it finds a fault)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(preset_name: str, device: torch.device, steps: int, overrides: list[str], check: Check,
            repeats: int) -> tuple[Job, torch.Tensor, float, float]:
    """The job, its last sums, the median compute of one slot and the median check."""
    cfg = load_config(preset_name=preset_name, overrides=overrides)
    job = build_job(cfg, device, prepare(cfg, device))
    items = [SlotWork(0, (0, cfg.data.micro_batch))]
    buf = job.gradient_sums(0, items)  # warm-up: the first compute allocates and, on a GPU, initializes
    computes, checks = [], []
    for step in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        buf = job.gradient_sums(step, items)
        _sync(device)
        computes.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(repeats):
            check(job, buf, step)
        checks.append((time.perf_counter() - t0) / repeats)
    return job, buf, statistics.median(computes), statistics.median(checks)


def main(argv: list[str] | None, *, prog: str, description: str, benchmark: str,
         row: Callable[[str, torch.device, int, list[str]], dict[str, Any]],
         line: Callable[[dict[str, Any]], str]) -> dict[str, Any]:
    """A check benchmark's command line: ``row(preset, device, steps, overrides)`` per preset, ``line(row)``
    printed for each, the JSON to ``--out``."""
    ap = argparse.ArgumentParser(prog=prog, description=description)
    ap.add_argument("--presets", nargs="+", default=["debug", "tiny"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=5, help="computes timed per preset (their median)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads on a CPU (a worker's share)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="config overrides (section.field=value) for every preset")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = [row(name, device, args.steps, args.overrides) for name in args.presets]
    for r in rows:
        print(line(r))
    result = {"benchmark": benchmark, "device": str(device), "threads": args.threads, "rows": rows,
              "machine": machine_description()}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result
