"""What a snapshot's write costs the training thread beside it: ``python -m benchmarks.snapshot_contention``.

On a GPU the training thread mostly launches kernels: small, latency-bound host work. A snapshot's
write runs beside it on several threads, each copying staged bytes into shared memory and
checksumming them. This part times a launch-like loop (small tensor operations, no intra-op
parallelism, as a GPU host thread) alone and while the write threads run over a staged buffer,
side by side in rounds of alternating order, with two ways of copying:

- ``snapshot``: the snapshotter's own reader (:meth:`unbroken.snapshot.staging.Staging.reader`) and
  checksum, what every write does;
- ``torch_copy``: the same with ``torch``'s ``copy_`` into the mapping (what the reader did before,
  and the obvious way to write it): each call runs on a team of intra-op threads as many as the
  cores, so the write threads together oversubscribe the cores the training thread needs.

Reports each loop's seconds, its slowdown against the loop alone, and the write's GB/s.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any, Callable

import torch

from unbroken.bench.machine import machine_description
from unbroken.snapshot.segment import crc32
from unbroken.snapshot.staging import Staging
from unbroken.runtime.snapshot_hooks import MAX_WRITE_THREADS

__all__ = ["contention", "main"]

_CHUNK = 64 << 20
"""Bytes each write call covers (a stripe's fragment is at most 256 MiB)."""


def _torch_reader(staged: Staging) -> Callable[[memoryview, int, int], None]:
    def read(out: memoryview, a: int, b: int) -> None:
        dst = torch.frombuffer(out, dtype=torch.uint8)
        for piece, before in staged.pieces(a, b - a):
            dst[before:before + piece.numel()].copy_(piece)

    return read


def _launch_loop(iters: int) -> float:
    """Seconds of ``iters`` small operations (each a few microseconds of host work, as a kernel launch)."""
    x = torch.randn(8, 8)
    t0 = time.perf_counter()
    for _ in range(iters):
        x = (x @ x).tanh_()
    return time.perf_counter() - t0


def _write_while(loop: Callable[[], float], read: Callable[[memoryview, int, int], None], view: memoryview,
                 threads: int) -> tuple[float, float]:
    """The loop's seconds while ``threads`` threads write the staged bytes over and over; the write's GB/s."""
    stop, written, lock = threading.Event(), [0], threading.Lock()
    size = len(view)

    def write(first: int) -> None:
        at = first * _CHUNK % size
        while not stop.is_set():
            hi = min(at + _CHUNK, size)
            out = view[at:hi]
            read(out, at, hi)
            crc32(out)
            with lock:
                written[0] += hi - at
            at = hi % size

    pool = [threading.Thread(target=write, args=(i,), daemon=True) for i in range(threads)]
    t0 = time.perf_counter()
    for t in pool:
        t.start()
    seconds = loop()
    stop.set()
    for t in pool:
        t.join()
    return seconds, written[0] / (time.perf_counter() - t0) / 1e9


def contention(*, mb: int = 512, threads: int | None = None, iters: int = 200000, rounds: int = 5) -> dict[str, Any]:
    """The launch loop alone and beside each writer, ``rounds`` rounds (ABBA order); means and ratios."""
    cores = len(os.sched_getaffinity(0))
    threads = threads or max(1, min(MAX_WRITE_THREADS, cores // 2))
    size = mb << 20
    staged = Staging(size)
    for block in staged.blocks:
        block.random_(0, 256)
    mem = mmap.mmap(-1, size)  # anonymous shared memory, as a snapshot segment's mapping
    view = memoryview(mem)
    readers = {"snapshot": staged.reader([(0, size, 0)]), "torch_copy": _torch_reader(staged)}
    kinds = ["alone", *readers]
    loop = lambda: _launch_loop(iters)  # noqa: E731
    loop()  # warm-up
    seconds: dict[str, list[float]] = {k: [] for k in kinds}
    rates: dict[str, list[float]] = {k: [] for k in readers}
    for r in range(rounds):
        for kind in (kinds if r % 2 == 0 else kinds[::-1]):
            if kind == "alone":
                seconds[kind].append(loop())
                continue
            s, rate = _write_while(loop, readers[kind], view, threads)
            seconds[kind].append(s)
            rates[kind].append(rate)
    del view
    mem.close()
    alone = statistics.mean(seconds["alone"])
    return {"cores": cores, "write_threads": threads, "staged_mb": mb, "loop_iterations": iters, "rounds": rounds,
            "torch_threads": torch.get_num_threads(),
            "loop_s": {k: statistics.mean(v) for k, v in seconds.items()},
            "loop_s_rounds": seconds,
            "slowdown": {k: statistics.mean(seconds[k]) / alone for k in readers},
            "write_gb_s": {k: statistics.mean(v) for k, v in rates.items()}}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure, print the figures and write the JSON (``--out``)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.snapshot_contention", description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=512, help="staged bytes the write threads copy (MiB)")
    ap.add_argument("--threads", type=int, default=None, help="write threads (default: as a worker's write)")
    ap.add_argument("--iters", type=int, default=200000, help="operations of the launch-like loop")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/snapshot_contention.json"))
    a = ap.parse_args(argv)
    result = {"benchmark": "snapshot_contention",
              **contention(mb=a.mb, threads=a.threads, iters=a.iters, rounds=a.rounds),
              "machine": machine_description()}
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
