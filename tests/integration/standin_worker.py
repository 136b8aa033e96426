"""A stand-in for ``unbroken.agent.worker_process`` in agent tests: heartbeats and waits, no model.

Takes the real worker's command line (``--run-dir --worker --world --store
[--join] [--faults-file F --faults I,J] [--resume]``, or ``--standby --node-rank R``)
and plays the worker's side of the agent contract through the job store:
writes its stacks on a fence's signal, beats, asks to join when joining,
signals itself for its faults once the progress reaches their step, beats
the node's standby counter and claims offers as a standby, and exits 0 when
the job is done or failed. Every
incarnation records its argv in ``run_dir/standin/w<id>.<pid>.json``.

Like a worker started as a fresh process it imports torch (the store's
client is torch's) before it connects and beats, so a process stopped in its
first second never beats; it imports nothing of the trainer.
``STANDIN_STANDBY_IGNORES_SIGTERM=1`` (inherited through the agent) makes a
standby ignore SIGTERM until it becomes a worker: an agent that waited for it
to exit would block. ``STANDIN_STANDBY_CLAIM_GATE=PATH`` makes a standby
claim nothing while ``PATH`` does not exist (it beats on): an offer stays
pending for as long as a test needs.
"""

from __future__ import annotations

import argparse
import dataclasses
import faulthandler
import json
import os
import signal
import sys
import time
from pathlib import Path

from unbroken.agent._process import STACK_SIGNAL
from unbroken.faults.fail_at import fault_selection
from unbroken.store.job_store import JobStore
from unbroken.store.backend import job_secret

SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}
DEADLINE_S = 120.0  # never outlive a broken test
BEAT_S = 0.1  # as the real worker's heartbeat thread and standby
IGNORE_SIGTERM_ENV = "STANDIN_STANDBY_IGNORES_SIGTERM"
CLAIM_GATE_ENV = "STANDIN_STANDBY_CLAIM_GATE"


def record(run_dir: Path, worker: int, argv: list[str], **extra: object) -> None:
    out = run_dir / "standin" / f"w{worker}.{os.getpid()}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")  # renamed into place: a test never reads half a record
    tmp.write_text(json.dumps({"pid": os.getpid(), "argv": argv, **extra}))
    os.replace(tmp, out)


def wait_assignment(store: JobStore, node: int, t0: float) -> tuple[int, str, int | None] | None:
    if os.environ.get(IGNORE_SIGTERM_ENV) == "1":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    store.standby_beat(node)
    store.standby_announce(node, os.getpid())
    next_beat = time.monotonic() + BEAT_S
    gate = os.environ.get(CLAIM_GATE_ENV)
    while time.monotonic() - t0 < DEADLINE_S and not store.finished():
        if time.monotonic() >= next_beat:
            next_beat = time.monotonic() + BEAT_S
            store.standby_beat(node)
        got = store.standby_claim(node, os.getpid()) if gate is None or os.path.exists(gate) else None
        if got is not None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # a worker now
            return got
        time.sleep(0.005)
    return None


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--run-dir", type=Path, required=True)
    ap.add_argument("--worker", type=int, default=None)
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--store", required=True)
    ap.add_argument("--join", action="store_true")
    ap.add_argument("--restore-gen", type=int, default=None)
    ap.add_argument("--faults-file", type=Path, default=None)
    ap.add_argument("--faults", default="")
    ap.add_argument("--resume", default=None)
    ap.add_argument("--standby", action="store_true")
    ap.add_argument("--node-rank", type=int, default=None)
    a = ap.parse_args()
    # as the real worker, before its first beat: a fence for a hang asks for the stacks first (without a
    # handler the signal would kill a process that is about to stop, and it would not die of the SIGKILL)
    faulthandler.register(STACK_SIGNAL, all_threads=True)
    t0 = time.monotonic()
    store = JobStore.connect(a.store, timeout_s=10, secret=job_secret(a.run_dir))
    worker, faults, join = a.worker, a.faults, a.join
    if a.standby:
        got = wait_assignment(store, a.node_rank, t0)
        if got is None:
            return 0
        (worker, faults, _), join = got, True
    assert worker is not None
    pending = list(fault_selection(a.faults_file, faults))
    if join:  # before the record of this incarnation: a test that sees the record may look for the request
        store.request_join(worker, {"pid": os.getpid()})
    record(a.run_dir, worker, sys.argv[1:], join=join, faults=[dataclasses.asdict(f) for f in pending],
           standby=a.standby)
    while time.monotonic() - t0 < DEADLINE_S:
        store.beat(worker)
        if store.finished():
            return 0
        progress = store.progress() or 0
        for f in [f for f in pending if f.step <= progress]:
            pending.remove(f)
            os.kill(os.getpid(), SIGNALS[f.how])
        time.sleep(0.02)
    return 1


if __name__ == "__main__":
    sys.exit(main())
