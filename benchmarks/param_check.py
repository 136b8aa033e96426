"""What the parameter check costs a step without a failure: ``python -m benchmarks.param_check``.

For each preset, on one device (``--device``, default the CPU with one thread), the job is built as a worker
builds it; then, in one run, the median of ``--steps`` computes of one slot (forward and backward,
:meth:`~unbroken.job.Job.gradient_sums`) beside the median of the checksum every member computes before each
reduction that carries the check (:func:`~unbroken.runtime.param_check.checksum` over its parameters, its wait for
the device included). The ratio is the check's share of one slot's compute; a worker computing more than one slot
per step pays it once, so its share is smaller. The comparison after the reduction reads one float per worker and
the check adds no collective and no store round trip (nothing to time).
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
from unbroken.runtime.param_check import checksum

CHECKS_PER_STEP = 10
"""Checksums timed per compute (the median of their mean)."""


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(preset_name: str, device: torch.device, steps: int, overrides: list[str]) -> dict[str, Any]:
    """One preset's parameter count, median compute of one slot and median checksum, and their ratio."""
    cfg = load_config(preset_name=preset_name, overrides=overrides)
    job = build_job(cfg, device, prepare(cfg, device))
    params = job.layout.params
    items = [SlotWork(0, (0, cfg.data.micro_batch))]
    job.gradient_sums(0, items)  # warm-up: the first compute allocates and, on a GPU, initializes
    computes, checks = [], []
    for step in range(steps):
        _sync(device)
        t0 = time.perf_counter()
        job.gradient_sums(step, items)
        _sync(device)
        computes.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        for _ in range(CHECKS_PER_STEP):
            int(checksum(params))  # the value lands in the buffer; int() waits for it
        checks.append((time.perf_counter() - t0) / CHECKS_PER_STEP)
    compute_s, check_s = statistics.median(computes), statistics.median(checks)
    n_bytes = sum(p.numel() * p.element_size() for p in params)
    return {"preset": preset_name, "param_bytes": n_bytes, "compute_one_slot_s": compute_s,
            "check_s": check_s, "check_share_of_one_slot": check_s / compute_s, "check_gb_s": n_bytes / check_s / 1e9}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.param_check", description=__doc__.splitlines()[0])
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
        print(f"{r['preset']}: parameters {r['param_bytes'] / 1e6:.1f} MB, checksum {r['check_s'] * 1e3:.3f} ms "
              f"({r['check_gb_s']:.1f} GB/s), one slot's compute {r['compute_one_slot_s'] * 1e3:.1f} ms -> "
              f"{100 * r['check_share_of_one_slot']:.3f} %")
    result = {"benchmark": "param-check", "device": str(device), "threads": args.threads, "rows": rows,
              "machine": machine_description()}
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
