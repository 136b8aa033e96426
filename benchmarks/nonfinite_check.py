"""What the non-finite check costs a step without a failure: ``python -m benchmarks.nonfinite_check``.

For each preset, on one device (``--device``, default the CPU with one thread), the job's own reduction buffer
of one slot's gradient sums is built as a worker builds it; then, in one run, the median of ``--steps`` computes
of one slot (forward and backward, :meth:`~unbroken.job.Job.gradient_sums`) beside the median of the check every
member runs after each reduction (:func:`~unbroken.runtime.nonfinite.finite`, its wait for the device included).
The ratio is the check's share of one slot's compute; a worker computing more than one slot per step pays it
once, so its share is smaller. The check adds no collective and no store round trip (nothing to time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from unbroken.bench.machine import machine_description
from unbroken.config import load_config
from unbroken.job import prepare
from unbroken.job.builder import build_job
from unbroken.mecefo.gradients import SlotWork
from unbroken.runtime.nonfinite import finite

CHECKS_PER_STEP = 20
"""Checks timed per compute (the median of their mean: a single check is below the clock's resolution)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(preset_name: str, device: torch.device, steps: int, overrides: list[str]) -> dict[str, Any]:
    """One preset's buffer size, median compute of one slot and median check, and their ratio."""
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
        for _ in range(CHECKS_PER_STEP):
            if not finite(buf):
                raise AssertionError(f"{preset_name}: step {step}'s sums are not finite")
        checks.append((time.perf_counter() - t0) / CHECKS_PER_STEP)
    compute_s, check_s = statistics.median(computes), statistics.median(checks)
    return {"preset": preset_name, "buffer_floats": buf.numel(), "compute_one_slot_s": compute_s,
            "check_s": check_s, "check_share_of_one_slot": check_s / compute_s,
            "check_gb_s": 4 * buf.numel() / check_s / 1e9}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.nonfinite_check", description=__doc__.splitlines()[0])
    ap.add_argument("--presets", nargs="+", default=["debug", "tiny"])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--steps", type=int, default=5, help="computes timed per preset (their median)")
    ap.add_argument("--threads", type=int, default=1, help="intra-op threads on a CPU (a worker's share)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("overrides", nargs="*", help="config overrides (section.field=value) for every preset")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    rows = [measure(name, device, args.steps, args.overrides) for name in args.presets]
    for r in rows:
        print(f"{r['preset']}: buffer {r['buffer_floats']:,} floats, check {r['check_s'] * 1e3:.3f} ms "
              f"({r['check_gb_s']:.1f} GB/s), one slot's compute {r['compute_one_slot_s'] * 1e3:.1f} ms -> "
              f"{100 * r['check_share_of_one_slot']:.3f} %")
    result = {"benchmark": "nonfinite-check", "device": str(device), "threads": args.threads, "rows": rows,
              "machine": machine_description()}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
