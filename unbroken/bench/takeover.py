"""What covering a failed worker costs a step on this device: ``unbroken bench takeover``.

With ``train.compile`` (the default on CUDA) each block's exact forward runs compiled; MeCeFO's
approximate mode (attention's backward skipped, the FFN recomputed, its weight gradient low-rank)
runs the blocks eager, so a failure switches modes without recompiling. This measures, in one
process on the job's device with the job's own model, optimizer-free compute
(:meth:`~unbroken.job.builder.Job.gradient_sums`, as a worker runs it), side by side in alternating
order:

- **normal**: a worker's own micro-batch, exact;
- **covering**, per takeover policy (``--policies``): the items of the busiest survivor when one
  worker is dead (``neighbor``: its own micro-batch and the dead worker's, both approximate;
  ``spread``: its own and a share of the dead one's, exact; ``spread-approx``: the share
  approximate).

A step during a failure lasts as long as its slowest worker, the covering one: ``covering /
normal`` is what each such step costs against a step without failure. Also reported: the frames
compiled while each ran first: approximate items compile nothing (they run eager); exact items of
fewer rows than a micro-batch (``spread``'s share) compile once more, with a dynamic batch
dimension, and never again.

``unbroken bench takeover --preset llama-1b --precision bf16 --data.seq_len=1024`` on a GPU; on a
CPU, compile is off unless ``--train.compile=true``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path
from typing import Any, Callable

import torch

from unbroken.bench._args import parse_with_overrides
from unbroken.bench.machine import machine_description
from unbroken.config import load_config
from unbroken.job.builder import build_job
from unbroken.job.parallelize import compile_stats, resolve_compile
from unbroken.mecefo.gradients import slot_rows
from unbroken.mecefo.takeover import takeover_policy
from unbroken.models.factory import resolve_device

__all__ = ["main"]


def _timed(device: torch.device, run: Callable[[], object]) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="unbroken bench takeover", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--precision", default="fp32", help="train.precision: fp32 or bf16")
    ap.add_argument("--slots", type=int, default=8, help="workers of the step (the policy's slots)")
    ap.add_argument("--policies", default="neighbor,spread,spread-approx", help="takeover policies to measure")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs of each, after one warm-up each")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/takeover.json"))
    a, overrides = parse_with_overrides(ap, argv)
    if a.slots < 2:
        ap.error("--slots: at least 2 (a takeover needs a survivor)")
    cfg = load_config(preset_name=a.preset, overrides=overrides + [
        f"train.workers={a.slots}", f"train.precision={a.precision}", "train.val_every=0"])
    mb, dead = cfg.data.micro_batch, a.slots - 1
    work = {"normal": takeover_policy("spread").assign(n_slots=a.slots, live=range(a.slots), micro_batch=mb)[0]}
    workers = {}
    for name in [p.strip() for p in a.policies.split(",") if p.strip()]:  # an unknown name fails here, at once
        degraded = takeover_policy(name).assign(n_slots=a.slots, live=range(dead), micro_batch=mb)
        workers[name], work[name] = max(degraded.items(), key=lambda kv: sum(i.n_rows for i in kv[1]))
    device = resolve_device(cfg.train.device)
    job = build_job(cfg, device)
    seconds: dict[str, list[float]] = {k: [] for k in work}
    frames: dict[str, int] = {}
    job.adapter.prepare(0)  # the FFN bases, before anything is timed
    for kind, items in work.items():  # warm-up: compiles the exact graph (and its dynamic-batch twin)
        before = compile_stats().get("compiled_frames", 0)
        _timed(device, lambda: job.gradient_sums(0, items))
        frames[kind] = compile_stats().get("compiled_frames", 0) - before
    for r in range(a.repeats):
        for kind in (list(work) if r % 2 == 0 else list(work)[::-1]):
            seconds[kind].append(_timed(device, lambda: job.gradient_sums(1 + r, work[kind])))
    median = {k: statistics.median(v) for k, v in seconds.items()}
    result = {
        "benchmark": "takeover", "preset": a.preset, "precision": a.precision, "device": str(device),
        "compile": resolve_compile(cfg.train.compile, device), "slots": a.slots,
        "micro_batch": mb, "seq_len": cfg.data.seq_len, "dead_worker": dead, "covering_worker": workers,
        "items": {k: slot_rows(v) for k, v in work.items()}, "seconds": seconds, "median_s": median,
        "covering_over_normal": {k: median[k] / median["normal"] for k in workers},
        "frames_compiled_in_warmup": frames, "machine": machine_description(),
        **({"peak_memory_bytes": torch.cuda.max_memory_allocated(device)} if device.type == "cuda" else {}),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"{a.preset} on {device} ({a.precision}, compile {'on' if result['compile'] else 'off'}), "
          f"{a.slots} slots, worker {dead} dead; median of {a.repeats}:")
    for kind, items in work.items():
        ratio = f"x{median[kind] / median['normal']:.3f}" if kind != "normal" else ""
        print(f"  {kind:>13}: {median[kind] * 1e3:8.1f} ms {ratio:>7}  frames compiled first {frames[kind]}  "
              f"items {slot_rows(items)}")
    print(f"wrote {a.out}")
    return result
