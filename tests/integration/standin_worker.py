"""A stand-in for ``unbroken.runtime.worker`` in agent tests: heartbeats and waits, no model.

Takes the real worker's command line (``--run-dir --worker --world --store
[--join] [--faults] [--resume]``, or ``--standby --node-rank R``) and plays the
worker's side of the agent contract: beats ``hb/<w>``, posts ``join/<w>`` when
joining, signals itself for its ``--faults`` once ``progress`` reaches their
step, claims standby assignments, and exits 0 when ``done`` or ``failed`` is
set. Every incarnation records its argv in ``run_dir/standin/w<id>.<pid>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path

import torch.distributed as dist

from unbroken.faults.fail_at import parse_fail_at

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
DEADLINE_S = 120.0  # never outlive a broken test


def connect(addr: str) -> dist.TCPStore:
    host, port = addr.rsplit(":", 1)
    return dist.TCPStore(host, int(port), None, is_master=False, timeout=timedelta(seconds=10))


def record(run_dir: Path, worker: int, argv: list[str], **extra: object) -> None:
    out = run_dir / "standin" / f"w{worker}.{os.getpid()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"pid": os.getpid(), "argv": argv, **extra}))


def finished(store: dist.TCPStore) -> bool:
    return store.check(["done"]) or store.check(["failed"])


def wait_assignment(store: dist.TCPStore, node: int, t0: float) -> tuple[int, str] | None:
    key = f"standby/{node}/assign"
    store.set(f"standby/{node}/ready", str(os.getpid()))
    claim = f"claimed:{os.getpid()}"
    while time.monotonic() - t0 < DEADLINE_S and not finished(store):
        if store.check([key]):
            value = store.get(key).decode()
            if value.isdigit() and store.compare_set(key, value, claim).decode() == claim:
                faults = store.get(f"standby/{node}/faults").decode()
                return int(value), faults
        time.sleep(0.005)
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--worker", type=int, default=None)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--join", action="store_true")
    ap.add_argument("--faults", default="")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--standby", action="store_true")
    ap.add_argument("--node-rank", type=int, default=None)
    a = ap.parse_args()
    t0 = time.monotonic()
    store = connect(a.store)
    worker, faults, join = a.worker, a.faults, a.join
    if a.standby:
        got = wait_assignment(store, a.node_rank, t0)
        if got is None:
            return 0
        (worker, faults), join = got, True
    assert worker is not None
    record(a.run_dir, worker, sys.argv[1:], join=join, faults=faults, standby=a.standby)
    if join:
        store.set(f"join/{worker}", json.dumps({"pid": os.getpid()}))
    pending = list(parse_fail_at(faults))
    while time.monotonic() - t0 < DEADLINE_S:
        store.add(f"hb/{worker}", 1)
        if finished(store):
            return 0
        progress = int(store.get("progress")) if store.check(["progress"]) else 0
        for f in [f for f in pending if f.step <= progress]:
            pending.remove(f)
            os.kill(os.getpid(), SIGNALS[f.how])
        time.sleep(0.02)
    return 1


if __name__ == "__main__":
    sys.exit(main())
