"""Pinned host memory and device staging bytes per worker for snapshots, counted (not timed):
``python -m benchmarks.snapshot_pinned``.

- **pinned**: on a GPU, the pinned host bytes one worker stages per snapshot for ``llama-1b`` and ``llama-7b``
  at 8 workers per node (the whole state before, only the bytes it writes now), and the host bytes a restore
  holds at once (the whole state twice before, one stripe now);
- **device staging**: the device bytes one worker holds for staging under ``auto`` at 1 and 8 workers per node
  (its whole share before; now the tail a step window cannot carry, at most ``snapshot.device_staging_bytes``,
  at stated bandwidth and step-time assumptions).

What snapshots cost and buy back in real jobs: ``unbroken bench snapshot``.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path
from typing import Any

from unbroken.bench.machine import machine_description
from unbroken.config import preset
from unbroken.snapshot.capacity import state_bytes
from unbroken.snapshot.plan import plan_for
from unbroken.snapshot.snapshotter import byte_ranges
from unbroken.snapshot.staging import Stager

from benchmarks.plain_loop import _PEAK_BF16, flops_per_token

_GB = 1e9


def _pinned(nodes: tuple[int, ...] = (2, 4, 16), per_node: int = 8) -> dict[str, Any]:
    """Pinned bytes per worker and restore host bytes, before and after staging only what is written."""
    out: dict[str, Any] = {}
    for name in ("llama-1b", "llama-7b"):
        cfg = preset(name)
        size = state_bytes(cfg)
        for n in nodes:
            node_of = {w: w // per_node for w in range(n * per_node)}
            plan = plan_for(node_of, node_of, redundancy=cfg.snapshot.redundancy, parity=cfg.snapshot.parity,
                            state_bytes=size, group_nodes=cfg.snapshot.group_nodes)
            staged = [sum(b - a for a, b in byte_ranges(plan, m)) for m in plan.assignment(node_of, node_of).values()]
            stripe = -(-size // plan.stripes)
            out[f"{name} {n}x{per_node}"] = {
                "state_gb": size / _GB, "pinned_gb_per_worker_before": size / _GB,
                "pinned_gb_per_worker_after_max": max(staged) / _GB,
                "pinned_gb_per_worker_after_mean": statistics.mean(staged) / _GB,
                "pinned_gb_per_node_before": per_node * size / _GB,
                "pinned_gb_per_node_after": sum(staged[:per_node]) / _GB,
                "restore_host_gb_per_worker_before": 2 * size / _GB, "restore_host_gb_per_worker_after": stripe / _GB,
                "stripes": plan.stripes, "k": plan.k, "m": plan.m}
    return out


D2H_BYTES_S = 50e9
"""A GPU's copies to pinned host memory (PCIe 5 x16), the device staging projection's assumption."""
MFU = 0.4
TOKENS_PER_GPU = 8 * 1024
"""The step the device staging projection assumes: 8 x 1024 tokens per GPU at 40 % of an H100's bf16 peak."""


def _device_staging(per_node_counts: tuple[int, ...] = (1, 8), nodes: int = 2) -> dict[str, Any]:
    """Device bytes a worker holds for snapshot staging under ``auto`` (deterministic, from the plan and stated
    assumptions: :data:`D2H_BYTES_S`, a step of :data:`TOKENS_PER_GPU` at :data:`MFU` of an H100), before (the
    whole share copied device to device whenever it fitted) and now (the tail a step window cannot carry, at most
    ``snapshot.device_staging_bytes``), with the step's wait for what is left."""
    out: dict[str, Any] = {}
    for name in ("llama-1b", "llama-7b"):
        cfg = preset(name)
        size, cap = state_bytes(cfg), cfg.snapshot.device_staging_bytes
        step_s = flops_per_token(cfg) * TOKENS_PER_GPU / (MFU * _PEAK_BF16["H100"])
        for per_node in per_node_counts:
            node_of = {w: w // per_node for w in range(nodes * per_node)}
            plan = plan_for(node_of, node_of, redundancy=cfg.snapshot.redundancy, parity=cfg.snapshot.parity,
                            state_bytes=size, group_nodes=cfg.snapshot.group_nodes)
            share = max(sum(b - a for a, b in byte_ranges(plan, m)) for m in plan.assignment(node_of, node_of).values())
            stager = Stager()
            stager.rate = D2H_BYTES_S
            spill = stager.spill_for(share, cap, step_s)
            left = max(0.0, (share - spill) / D2H_BYTES_S - step_s)
            out[f"{name} {per_node} per node"] = {
                "share_gb": share / _GB, "step_s": round(step_s, 4), "device_staging_gb_before": share / _GB,
                "device_staging_gb": spill / _GB, "cap_gb": cap / _GB, "optimizer_step_waits_s": round(left, 4)}
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Count, print the device staging lines and write the JSON (``--out``)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.snapshot_pinned", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/snapshot_pinned.json"))
    a = ap.parse_args(argv)
    result = {"benchmark": "snapshot_pinned", "pinned": _pinned(), "device_staging": _device_staging(),
              "machine": machine_description()}
    print(json.dumps(result["pinned"], indent=1))
    for case, r in result["device_staging"].items():
        print(f"{case}: a {r['share_gb']:.2f} GB share, {r['device_staging_gb']:.2f} GB on the device "
              f"(was {r['device_staging_gb_before']:.2f}), the next optimizer step waits "
              f"{r['optimizer_step_waits_s']:.3f} s per snapshot (a {r['step_s']:.3f} s step)")
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
