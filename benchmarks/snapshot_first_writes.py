"""A worker's first snapshot writes: ``python -m benchmarks.snapshot_first_writes [--first-writes-mb 1024]``.

The first write into each of a worker's two snapshot buffers also maps it: its pages in shared memory
are reserved and first touched (about 11 s for 16 GB on an H100 host). Under ``snapshot.every=auto`` no
snapshot starts while one is in flight, and only a write that mapped nothing is a steady figure for the
interval: until then the recovery point is as far back as those writes are long, at the start of a job
and again on each replacement's node. With several write threads the snapshotter maps the second buffer
beside the first write (``map_ahead``); this part times one worker's first writes (back to back, under
``auto``) with it and without, in rounds of alternating order, each round on fresh segments, after a
warm-up run that is not counted (the first use of that much memory on a virtual machine cost 5x more
here: 34 s for the first write of 4 GiB, 6.5 s thereafter).

Reports per mode each write's seconds, whether it was steady, the seconds until the first steady write
was sealed, the longest pause of a Python thread running beside the writes (a write that holds the GIL
stops the training thread as long), and the ratio of the two modes' first two writes.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import threading
import time
from pathlib import Path
from typing import Any

import torch

from unbroken.bench.machine import machine_description
from unbroken.store.view import View
from unbroken.snapshot.cadence import VOTE_SLOTS, cast
from unbroken.snapshot.segment import remove_segments
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.runtime.snapshot_hooks import MAX_WRITE_THREADS

__all__ = ["first_writes", "main"]

MODES = ("map_ahead", "in_turn")


class _Beside:
    """A Python thread waking every millisecond beside the writes (as a GPU training thread between its
    launches, using next to no core of its own): its longest pause (seconds), a hold of the GIL."""

    def __init__(self) -> None:
        self.longest = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)

    def _loop(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            now = time.perf_counter()
            self.longest = max(self.longest, now - last)
            last = now
            time.sleep(0.001)

    def __enter__(self) -> _Beside:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _run(state: dict[str, torch.Tensor], threads: int, ahead: bool,
         writes: int) -> tuple[list[float], list[bool], float]:
    job = os.urandom(6).hex()
    snap = Snapshotter(job_id=job, node=0, worker=0, node_of={0: 0}, every="auto", redundancy="none", parity=0,
                       config_hash="bench", state=lambda: state, on_event=lambda *a, **k: None,
                       write_threads=threads, map_ahead=ahead)
    view, votes = View(gen=0, members=(0,), step=0), torch.zeros(VOTE_SLOTS)
    cast(votes, 1)
    cadence = snap.cadence
    assert cadence is not None  # every="auto"
    seconds, steady = [], []
    try:
        with _Beside() as beside:
            for done in range(1, writes + 1):
                counted = len(cadence.writes)
                t0 = time.perf_counter()
                snap.take(done, view, votes)
                snap.wait()
                seconds.append(time.perf_counter() - t0)
                steady.append(len(cadence.writes) > counted)  # a steady write is counted by the cadence
    finally:
        snap.close()
        remove_segments(job)
    return seconds, steady, beside.longest


def first_writes(*, mb: int = 1024, threads: int | None = None, writes: int = 4, rounds: int = 2) -> dict[str, Any]:
    """Each of the first ``writes`` writes of a ``mb`` MiB state, with the second buffer mapped ahead and in
    turn; means over ``rounds`` rounds (alternating order)."""
    cores = len(os.sched_getaffinity(0))
    threads = threads or max(2, min(MAX_WRITE_THREADS, cores // 2))
    if threads < 2:
        raise ValueError("first_writes: mapping ahead needs at least 2 write threads")
    if mb < 1:
        raise ValueError(f"first_writes: a state of {mb} MiB; give --first-writes-mb of at least 1")
    state = {"state": torch.empty(mb << 20, dtype=torch.uint8).random_(0, 256)}
    _run(state, threads, False, 2)  # warm-up: the memory's first use
    seconds: dict[str, list[list[float]]] = {m: [] for m in MODES}
    steady: dict[str, list[list[bool]]] = {m: [] for m in MODES}
    pause: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(rounds):
        for mode in (MODES if r % 2 == 0 else MODES[::-1]):
            s, st, longest = _run(state, threads, mode == "map_ahead", writes)
            seconds[mode].append(s)
            steady[mode].append(st)
            pause[mode].append(longest)

    def settled(s: list[float], st: list[bool]) -> float | None:
        """Seconds until the first steady write was sealed (None: none was)."""
        return sum(s[:st.index(True) + 1]) if True in st else None

    out: dict[str, Any] = {"cores": cores, "write_threads": threads, "state_mb": mb, "writes": writes,
                           "rounds": rounds}
    for mode in MODES:
        to_settled = [settled(s, st) for s, st in zip(seconds[mode], steady[mode])]
        out[mode] = {"write_s": [statistics.mean(col) for col in zip(*seconds[mode])],
                     "steady": [all(col) for col in zip(*steady[mode])],
                     "first_steady_write": [st.index(True) + 1 if True in st else None for st in steady[mode]],
                     "to_settled_s": (statistics.mean(t for t in to_settled if t is not None)
                                      if any(t is not None for t in to_settled) else None),
                     "longest_python_pause_ms": 1e3 * max(pause[mode]),
                     "write_s_rounds": seconds[mode]}
    first_two = {m: sum(out[m]["write_s"][:2]) for m in MODES}
    out["first_two_ratio"] = first_two["map_ahead"] / first_two["in_turn"]
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Measure, print the figures and write the JSON (``--out``)."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.snapshot_first_writes",
                                 description=__doc__.splitlines()[0])
    ap.add_argument("--first-writes-mb", type=int, default=1024, help="the worker's state (MiB)")
    ap.add_argument("--threads", type=int, default=None, help="write threads (default: as a worker's write)")
    ap.add_argument("--writes", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results/snapshot_first_writes.json"))
    a = ap.parse_args(argv)
    result = {"benchmark": "snapshot_first_writes",
              **first_writes(mb=a.first_writes_mb, threads=a.threads, writes=a.writes, rounds=a.rounds),
              "machine": machine_description()}
    print(json.dumps({k: v for k, v in result.items() if k != "machine"}, indent=1))
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))
    print(f"wrote {a.out}")
    return result


if __name__ == "__main__":
    main()
