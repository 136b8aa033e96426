"""The job's compile cache: a process's first compiled step cold, with the job's cache on a fresh machine, and warm.

Run on a machine with CUDA: ``python scripts/gpu/compile_cache.py`` (``--device cpu --preset debug`` on a CPU).
Each run is a fresh process with inductor and Triton cache directories of its own (a new machine's), training
one step of ``--preset`` with ``train.compile`` on:

1. ``cold``: compiles from scratch, then writes the job's compile cache (:mod:`unbroken.job.compile_cache`);
2. ``cache``: empty directories, the job's cache loaded before the first step (a replacement node's worker: Triton
   kernels come bundled in the Mega-Cache on a GPU, the built kernels with it on a CPU);
3. ``local``: the cold run's directories again and no job cache (a later process on the same machine).

Prints each run's first and second step, the seconds dynamo spent compiling, the frames compiled and the graphs
found in a cache, then one JSON line. ``ok``: the cached run built no graph and its first step beat the cold one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SECRET = "compile-cache-check"


def _child(a: argparse.Namespace) -> None:
    import torch

    from unbroken.config import config_hash, load_config
    from unbroken.job import build_job
    from unbroken.job.compilation import Compilation
    from unbroken.mecefo.gradients import SlotWork
    from unbroken.models.factory import bind_device

    cfg = load_config(preset_name=a.preset, overrides=[
        "train.compile=true", f"train.device={a.device}", f"train.precision={a.precision}", "train.workers=1",
        f"data.micro_batch={a.micro_batch}", f"data.seq_len={a.seq_len}", f"data.max_bytes={a.max_bytes}"])
    device = bind_device(cfg.train.device)
    compilation = Compilation(device)
    if a.child == "cache":
        compilation.load(a.run_dir, secret=SECRET, config_hash=config_hash(cfg))
    job = build_job(cfg, device)
    steps = []
    for step in range(2):
        _sync(torch, device)
        t0 = time.perf_counter()
        job.apply(step, job.gradient_sums(step, [SlotWork(slot=0, rows=(0, a.micro_batch))]))
        _sync(torch, device)
        steps.append(round(time.perf_counter() - t0, 3))
    written = None
    if a.child == "cold":
        written = compilation.save(a.run_dir, secret=SECRET, config_hash=config_hash(cfg), writer={"check": True})
    s = compilation.stats()
    print(json.dumps({"run": a.child, "first_step_s": steps[0], "second_step_s": steps[1], "compile_s": s["seconds"],
                      "frames": s["frames"], "cache_hits": s["cache_hits"], "cache_misses": s["cache_misses"],
                      "loaded": s["cache"].get("loaded"), "kernels_placed": s["cache"].get("kernels"),
                      "cache_bytes": (written or s["cache"]).get("bytes")}))


def _sync(torch: object, device: object) -> None:
    if device.type == "cuda":  # type: ignore[attr-defined]
        torch.cuda.synchronize(device)  # type: ignore[attr-defined]


def _run(a: argparse.Namespace, run: str, dirs: Path, run_dir: Path) -> dict[str, object]:
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(dirs / "inductor"), "TRITON_CACHE_DIR": str(dirs / "triton")}
    argv = [sys.executable, __file__, "--child", run, "--run-dir", str(run_dir), "--device", a.device,
            "--preset", a.preset, "--precision", a.precision, "--micro-batch", str(a.micro_batch),
            "--seq-len", str(a.seq_len), "--max-bytes", str(a.max_bytes)]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=a.timeout)
    if done.returncode != 0:
        raise RuntimeError(f"the {run} run failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    ap.add_argument("--preset", default=None, help="default: llama-1b on cuda, debug on cpu")
    ap.add_argument("--precision", default=None, choices=["fp32", "bf16"], help="default: bf16 on cuda")
    ap.add_argument("--micro-batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=None, help="default: 512 on cuda, 32 on cpu")
    ap.add_argument("--max-bytes", type=int, default=1_500_000, help="the corpus slice")
    ap.add_argument("--timeout", type=float, default=900.0, help="each run's limit, seconds")
    ap.add_argument("--child", choices=["cold", "cache", "local"], default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-dir", type=Path, default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    cuda = a.device == "cuda"
    a.preset = a.preset or ("llama-1b" if cuda else "debug")
    a.precision = a.precision or ("bf16" if cuda else "fp32")
    a.seq_len = a.seq_len or (512 if cuda else 32)
    if a.child is not None:
        _child(a)
        return
    with tempfile.TemporaryDirectory(prefix="unbroken-compile-cache-") as tmp:
        root = Path(tmp)
        runs = {"cold": _run(a, "cold", root / "machine-a", root),
                "cache": _run(a, "cache", root / "machine-b", root),
                "local": _run(a, "local", root / "machine-a", root)}
    for r in runs.values():
        print(f"{r['run']:>5}: first step {r['first_step_s']:7.2f} s (compiling {r['compile_s']:6.2f} s, {r['frames']} "
              f"frames, {r['cache_hits']} graphs from a cache, {r['cache_misses']} built), next {r['second_step_s']} s",
              flush=True)
    cold, cached = runs["cold"], runs["cache"]
    print(json.dumps({"check": "compile_cache", "device": a.device, "preset": a.preset, "precision": a.precision,
                      **{f"{k}_first_step_s": r["first_step_s"] for k, r in runs.items()},
                      **{f"{k}_compile_s": r["compile_s"] for k, r in runs.items()},
                      "cache_bytes": cold["cache_bytes"], "kernels_placed": cached["kernels_placed"],
                      "ok": bool(cached["loaded"]) and cached["cache_misses"] == 0
                      and cached["first_step_s"] < cold["first_step_s"]}))


if __name__ == "__main__":
    main()
