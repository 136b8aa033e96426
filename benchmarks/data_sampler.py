"""Data sampler benchmark: memory per process and ``batch()`` rate over an emulated 1 T-token corpus.

``python -m benchmarks.data_sampler --out benchmarks/results/data_sampler.json``
builds a :class:`~unbroken.data.BatchSampler` over ``--tokens`` tokens (a
zero-stride view standing in for a memmap of that size: 2 bytes of memory,
every token 0) and measures, on one core (torch and numpy single-threaded):

1. **sampler memory**: the peak of Python-visible allocations (tracemalloc,
   numpy's included) while building the sampler and drawing micro-batches from
   steps spread over many epochs, minus one micro-batch's own output (target
   <= 64 MB); the resident-set growth beside it (noisier: allocator caches);
   and, for comparison, the four cached int64 permutations the sampler kept
   before (computed: ``4 * 8 * n_windows`` bytes);
2. **batch rate**: ``batch(step, slot)`` calls per CPU second of this process
   (target >= 10,000), and per wall second (a shared machine's load lowers it).

The memory figure and the row order are deterministic; the rates are timings.
"""

from __future__ import annotations

import argparse
import json
import time
import tracemalloc
from pathlib import Path
from typing import Any

import numpy as np
import torch

from unbroken.bench.machine import machine_description
from unbroken.data import BatchSampler

__all__ = ["main"]

MEMORY_TARGET_BYTES = 64 << 20
RATE_TARGET_PER_S = 10_000


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _emulated_corpus(n_tokens: int) -> np.ndarray:
    return np.lib.stride_tricks.as_strided(np.zeros(1, np.uint16), shape=(n_tokens,), strides=(0,))


def _steps(sampler: BatchSampler, calls: int) -> list[int]:
    """Steps spread evenly over about 16 epochs, so many epochs' orders are drawn."""
    steps_per_epoch = max(1, sampler.n_windows // (sampler.n_slots * sampler.micro_batch))
    span = 16 * steps_per_epoch
    return [(i * span) // calls for i in range(calls)]


def _memory(args: argparse.Namespace) -> dict[str, Any]:
    rss0 = _rss_bytes()
    tracemalloc.start()
    try:
        sampler = BatchSampler(_emulated_corpus(args.tokens), seed=args.seed, n_slots=args.slots,
                               micro_batch=args.micro_batch, seq_len=args.seq_len)
        for i, step in enumerate(_steps(sampler, args.calls)):
            sampler.batch(step, i % args.slots)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    output = 3 * args.micro_batch * (args.seq_len + 1) * 8  # the rows, then inputs and targets (int64)
    return {"n_windows": sampler.n_windows, "tracemalloc_peak_bytes": peak,
            "sampler_bytes": max(0, peak - output), "rss_growth_bytes": _rss_bytes() - rss0,
            "stored_permutations_before_bytes": 4 * 8 * sampler.n_windows}


def _rate(args: argparse.Namespace) -> dict[str, Any]:
    sampler = BatchSampler(_emulated_corpus(args.tokens), seed=args.seed, n_slots=args.slots,
                           micro_batch=args.micro_batch, seq_len=args.seq_len)
    steps = _steps(sampler, args.calls)
    for step in steps[:100]:  # warm-up: round keys, allocator
        sampler.batch(step, 0)
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for i, step in enumerate(steps):
        sampler.batch(step, i % args.slots)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    return {"calls": args.calls, "batch_per_cpu_s": args.calls / cpu, "batch_per_wall_s": args.calls / wall}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.data_sampler", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=10 ** 12, help="emulated corpus size in tokens")
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--slots", type=int, default=64, help="data-parallel slots per step")
    ap.add_argument("--calls", type=int, default=20_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    result: dict[str, Any] = {"benchmark": "data-sampler", "tokens": args.tokens, "seq_len": args.seq_len,
                              "micro_batch": args.micro_batch, "slots": args.slots, **_memory(args), **_rate(args),
                              "targets": {"sampler_bytes_max": MEMORY_TARGET_BYTES,
                                          "batch_per_cpu_s_min": RATE_TARGET_PER_S},
                              "machine": machine_description()}
    result["ok"] = (result["sampler_bytes"] <= MEMORY_TARGET_BYTES
                    and result["batch_per_cpu_s"] >= RATE_TARGET_PER_S)
    print(f"{args.tokens:.3g} tokens, {result['n_windows']:,} windows of {args.seq_len}: sampler memory "
          f"{result['sampler_bytes'] / 2**20:.2f} MiB (target <= 64; stored permutations were "
          f"{result['stored_permutations_before_bytes'] / 2**30:.1f} GiB), RSS growth "
          f"{result['rss_growth_bytes'] / 2**20:.1f} MiB; batch() {result['batch_per_cpu_s']:,.0f}/CPU s, "
          f"{result['batch_per_wall_s']:,.0f}/wall s (target >= {RATE_TARGET_PER_S:,}/CPU s) -> "
          f"{'ok' if result['ok'] else 'MISSED'}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    return result


if __name__ == "__main__":
    main()
