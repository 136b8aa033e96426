"""What covering a failed worker costs a step on this device, in time and in FLOPs: ``unbroken bench takeover``.

With ``train.compile`` (the default on CUDA) each block's exact forward runs compiled, and MeCeFO's
approximate mode (attention's backward skipped, the FFN recomputed, its weight gradient low-rank) as a
graph of its own (:mod:`unbroken.mecefo.compiled`), so a failure switches modes without recompiling.
This measures, in one process on the job's device with the job's own model, optimizer-free compute
(:meth:`~unbroken.job.builder.Job.gradient_sums`, as a worker runs it), side by side in alternating
order, with compile off and on (``--compile``):

- **normal**: a worker's own micro-batch, exact;
- **covering**, per takeover policy (``--policies``): the items of the busiest survivor when one
  worker is dead (``neighbor``: its own micro-batch and the dead worker's, both approximate;
  ``spread``: its own and a share of the dead one's, exact; ``spread-approx``: the share
  approximate).

A step during a failure lasts as long as its slowest worker, the covering one: ``time_ratio``
(covering / normal, ratio of medians; ``time_ratio_of_minima`` resists bursts of other load on a
shared machine, and on a CPU ``cpu_time_ratio``, the same in this process's CPU seconds, resists it
best with ``--threads 1``) is what each such step costs against a step without failure;
``flop_ratio`` is the same ratio in FLOPs (FlopCounterMode on the same items, eager), the cost the
arithmetic alone would set; ``time_over_flop_ratio`` says how far the implementation is from it.
``flop_ratio_with_svd`` adds the SVDs that refresh the FFN bases, amortised over tau (not timed: the
bases are made before timing). Also reported: the graphs compiled while each ran first (exact items
of fewer rows than a micro-batch compile once more, with a dynamic batch dimension, and never again;
approximate items likewise, in their own graph) and whether the approximate blocks ran compiled.

``unbroken bench takeover --preset llama-1b --precision bf16 --data.seq_len=1024`` on a GPU;
``unbroken bench takeover --preset tiny --threads 1 --out benchmarks/results/takeover_cpu.json`` on a CPU.
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
from unbroken.config import Config, load_config
from unbroken.job.builder import build_job
from unbroken.job.parallelize import check_compile_toolchain, compile_stats
from unbroken.mecefo.adapter import LlamaAdapter
from unbroken.mecefo.costs import count_flops, svd_flops_per_refresh
from unbroken.mecefo.gradients import SlotWork, slot_rows
from unbroken.mecefo.takeover import takeover_policy
from unbroken.models.factory import resolve_device

__all__ = ["main"]


def _timed(device: torch.device, run: Callable[[], object]) -> tuple[float, float]:
    """Wall-clock seconds of ``run`` and the CPU seconds this process spent in it (all its threads)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    t0, c0 = time.perf_counter(), time.process_time()
    run()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, time.process_time() - c0


def _parse(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    ap = argparse.ArgumentParser(prog="unbroken bench takeover", description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--precision", default="fp32", help="train.precision: fp32 or bf16")
    ap.add_argument("--slots", type=int, default=8, help="workers of the step (the policy's slots)")
    ap.add_argument("--policies", default="neighbor,spread,spread-approx", help="takeover policies to measure")
    ap.add_argument("--compile", choices=("off", "on", "both"), default="both",
                    help="train.compile for the measured job: off, on, or both one after the other")
    ap.add_argument("--repeats", type=int, default=10, help="timed runs of each, after one warm-up each")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/takeover.json"))
    a, overrides = parse_with_overrides(ap, argv)
    if a.slots < 2:
        ap.error("--slots: at least 2 (a takeover needs a survivor)")
    if a.threads < 0:
        ap.error(f"--threads {a.threads}: must be >= 0")
    return a, overrides


def _flops(cfg: Config, device: torch.device, work: dict[str, list[SlotWork]]) -> dict[str, Any]:
    """FLOPs of each kind's items (FlopCounterMode, eager: the arithmetic the timed runs do), and of the SVDs
    that refresh the FFN bases once every tau steps (amortised per step: a worker that approximates pays them)."""
    job = build_job(cfg, device)
    job.adapter.prepare(0)
    flops = {k: count_flops(lambda: job.gradient_sums(0, items)) for k, items in work.items()}
    svd = svd_flops_per_refresh(job.adapter) / cfg.mecefo.tau if isinstance(job.adapter, LlamaAdapter) else 0.0
    return {"flops": flops, "svd_flops_per_step": svd}


def _measure(cfg: Config, device: torch.device, work: dict[str, list[SlotWork]], repeats: int) -> dict[str, Any]:
    """Each kind's items timed in alternating order, after a warm-up each (which compiles what it needs)."""
    job = build_job(cfg, device)
    seconds: dict[str, list[float]] = {k: [] for k in work}
    cpu_seconds: dict[str, list[float]] = {k: [] for k in work}
    frames: dict[str, int] = {}
    job.adapter.prepare(0)  # the FFN bases, before anything is timed
    for kind, items in work.items():  # warm-up: compiles the exact graph (and its dynamic-batch twin)
        before = compile_stats().get("graphs", 0)
        _timed(device, lambda: job.gradient_sums(0, items))
        frames[kind] = compile_stats().get("graphs", 0) - before
    for r in range(repeats):
        for kind in (list(work) if r % 2 == 0 else list(work)[::-1]):
            wall, cpu = _timed(device, lambda: job.gradient_sums(1 + r, work[kind]))
            seconds[kind].append(wall)
            cpu_seconds[kind].append(cpu)
    path = getattr(job.adapter, "approx_path", None)
    return {"seconds": seconds, "median_s": {k: statistics.median(v) for k, v in seconds.items()},
            "cpu_seconds": cpu_seconds, "median_cpu_s": {k: statistics.median(v) for k, v in cpu_seconds.items()},
            "graphs_compiled_in_warmup": frames, "approx_compiled": bool(path is not None and path.compiled),
            "approx_fallback": None if path is None else path.fallback_reason,
            **({"peak_memory_bytes": torch.cuda.max_memory_allocated(device)} if device.type == "cuda" else {})}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a, overrides = _parse(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    base = overrides + [f"train.workers={a.slots}", f"train.precision={a.precision}", "train.val_every=0"]
    cfg = load_config(preset_name=a.preset, overrides=base)
    mb, dead = cfg.data.micro_batch, a.slots - 1
    work = {"normal": takeover_policy("spread").assign(n_slots=a.slots, live=range(a.slots), micro_batch=mb)[0]}
    workers = {}
    for name in [p.strip() for p in a.policies.split(",") if p.strip()]:  # an unknown name fails here, at once
        degraded = takeover_policy(name).assign(n_slots=a.slots, live=range(dead), micro_batch=mb)
        workers[name], work[name] = max(degraded.items(), key=lambda kv: sum(i.n_rows for i in kv[1]))
    device = resolve_device(cfg.train.device)
    settings = {"off": [False], "on": [True], "both": [False, True]}[a.compile]
    if True in settings:
        check_compile_toolchain(device.type)
    cost = _flops(load_config(preset_name=a.preset, overrides=base + ["train.compile=false"]), device, work)
    runs = {("on" if c else "off"): _measure(load_config(preset_name=a.preset, overrides=base + [
        f"train.compile={str(c).lower()}"]), device, work, a.repeats) for c in settings}
    flops, svd = cost["flops"], cost["svd_flops_per_step"]
    approximates = {k: any(i.mode == "approx" for i in items) for k, items in work.items()}
    policies = {}
    for name in workers:
        flop_ratio = flops[name] / flops["normal"]
        time_ratio = {c: r["median_s"][name] / r["median_s"]["normal"] for c, r in runs.items()}
        of_minima = {c: min(r["seconds"][name]) / min(r["seconds"]["normal"]) for c, r in runs.items()}
        cpu = {c: r["median_cpu_s"][name] / r["median_cpu_s"]["normal"] for c, r in runs.items()}
        policies[name] = {"flop_ratio": flop_ratio, "time_ratio": time_ratio, "time_ratio_of_minima": of_minima,
                          **({"cpu_time_ratio": cpu} if device.type == "cpu" else {}),
                          "time_over_flop_ratio": {c: t / flop_ratio for c, t in time_ratio.items()},
                          "flop_ratio_with_svd": (flops[name] + (svd if approximates[name] else 0.0)) / flops["normal"]}
    result = {
        "benchmark": "takeover", "preset": a.preset, "precision": a.precision, "device": str(device),
        "compile": [c == "on" for c in runs], "slots": a.slots, "threads": torch.get_num_threads(),
        "micro_batch": mb, "seq_len": cfg.data.seq_len, "dead_worker": dead, "covering_worker": workers,
        "items": {k: slot_rows(v) for k, v in work.items()}, "repeats": a.repeats, "policies": policies,
        "flops": flops, "svd_flops_per_step": svd, "runs": runs, "machine": machine_description(),
    }
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    _print(a, device, work, result)
    return result


def _print(a: argparse.Namespace, device: torch.device, work: dict[str, list[SlotWork]],
           result: dict[str, Any]) -> None:
    print(f"{a.preset} on {device} ({a.precision}), {a.slots} slots, worker {result['dead_worker']} dead; "
          f"median of {a.repeats}; covering / normal in time and in FLOPs:")
    for c, run in result["runs"].items():
        median = run["median_s"]
        approx = "" if c == "off" else f" (approximate blocks {'compiled' if run['approx_compiled'] else 'eager'})"
        print(f" compile {c}{approx}")
        for kind, items in work.items():
            p = result["policies"].get(kind)
            cpu = f"  cpu x{p['cpu_time_ratio'][c]:.3f}" if p and "cpu_time_ratio" in p else ""
            ratios = f"time x{p['time_ratio'][c]:.3f}{cpu}  flops x{p['flop_ratio']:.3f}" if p else ""
            print(f"  {kind:>13}: {median[kind] * 1e3:8.1f} ms {ratios:>42}  graphs compiled first "
                  f"{run['graphs_compiled_in_warmup'][kind]}  items {slot_rows(items)}")
    print(f"wrote {a.out}")
