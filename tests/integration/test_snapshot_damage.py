"""Snapshot memory damaged on one node before a whole-job kill: real processes, real SIGKILLs, real /dev/shm.

Every worker of a 2-node x 2-worker job (``snapshot.every=5``) hangs in step
12 (its main thread blocked; its snapshot thread finishes the snapshot of step
10). Once every worker's buffer of step 10 is sealed, 64 KiB in the middle of
each fragment of node 0's buffers are flipped through their files in
/dev/shm, and every worker is SIGKILLed. The agents restore the job at step
10 (the seals are authenticated: the decision trusts them); node 0's workers
find the damage as they load, and in the same load every member agrees on it
and node 0's share comes again from node 1's memory. No worker dies of it,
node 0 keeps its template (the workers started after the kill are forked from
it), and the ledger is exactly-once.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from _faults import MICRO_BATCH as MB
from _faults import check_invariants, run_job
from unbroken.config import load_config
from unbroken.snapshot.segment import HEADER_BYTES, SealedBuffer, job_segments
from unbroken.runtime.snapshot_hooks import job_id

pytestmark = [pytest.mark.slow, pytest.mark.timeout(360)]

WORKERS = (0, 1, 2, 3)
SNAPSHOT_STEP = 10
"""The newest snapshot when every worker hangs in step 12 (``snapshot.every=5``)."""
FLIP_BYTES = 64 << 10
SEAL_WAIT_S = 120.0
"""How long the snapshot thread of a hung worker may take to seal step 10 (it needs no other process)."""


def _sealed_steps(job: str, worker: int, node: int) -> set[int]:
    steps = set()
    for path in job_segments(job, node=node):
        if f"-w{worker}-" not in path.name:
            continue
        try:
            buf = SealedBuffer.open(path, job)
        except (OSError, RuntimeError):
            continue  # being written
        if buf is not None:
            steps.add(int(buf.seal["step"]))
    return steps


def _flip_node_memory(job: str, node: int) -> list[tuple[int, str, int, int]]:
    """Flip ``FLIP_BYTES`` in the middle of every fragment of the node's sealed buffers; (step, segment, offset,
    length) of each fragment flipped."""
    flipped = []
    for path in job_segments(job, node=node):
        buf = SealedBuffer.open(path, job)
        assert buf is not None, f"{path.name} is not sealed"
        for _, _, offset, length, _ in buf.seal["fragments"]:
            n = min(FLIP_BYTES, length // 2)
            at = HEADER_BYTES + offset + (length - n) // 2
            with open(path, "r+b") as fh:
                fh.seek(at)
                data = fh.read(n)
                fh.seek(at)
                fh.write(bytes(b ^ 0xFF for b in data))
            flipped.append((int(buf.seal["step"]), path.name, int(offset), int(length)))
    return flipped


class _DamageThenKill:
    """Reacts to the job's events: once every worker hangs and has sealed step 10, damages node 0's memory and
    SIGKILLs every worker (on a thread of its own: the launcher's loop goes on)."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.hung: set[int] = set()
        self.flipped: list[tuple[int, str, int, int]] = []
        self.killed: list[int] = []
        self.error: BaseException | None = None
        self.done = threading.Event()
        self._thread: threading.Thread | None = None

    def __call__(self, e: dict[str, Any]) -> None:
        if e.get("event") == "fault_self" and e.get("how") == "block":
            self.hung.add(int(e["worker"]))
            if self.hung == set(WORKERS) and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="damage-then-kill", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            job = job_id(self.run_dir)
            deadline = time.monotonic() + SEAL_WAIT_S
            while not all(SNAPSHOT_STEP in _sealed_steps(job, w, w // 2) for w in WORKERS):
                assert time.monotonic() < deadline, f"step {SNAPSHOT_STEP} not sealed by every worker"
                time.sleep(0.05)
            self.flipped = _flip_node_memory(job, node=0)
            for w in WORKERS:
                pid = int((self.run_dir / "pids" / f"w{w}").read_text().split()[0])
                os.kill(pid, signal.SIGKILL)
                self.killed.append(pid)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            self.error = exc
        finally:
            self.done.set()


def test_memory_damaged_on_one_node_is_rebuilt_from_parity_in_the_same_load(tmp_path, corpus_overrides):
    steps = 20
    cfg = load_config(preset_name="debug", overrides=[
        *corpus_overrides, f"train.steps={steps}", "train.val_every=0", "train.val_batches=1",
        "optim.warmup_steps=2", "optim.eps=1e-6", f"data.micro_batch={MB}", "data.seq_len=32",
        "mecefo.policy=spread", "train.workers=4", "snapshot.every=5",
        "fault.progress_timeout_s=600"])  # the hang is ended by the test's SIGKILL, never by detection
    run_dir = tmp_path / "run"
    react = _DamageThenKill(run_dir)
    hang = ",".join(f"step=12:worker={w}:block" for w in WORKERS)
    job = run_job(cfg, run_dir, nodes=2, workers_per_node=2, fail_at=hang, restart="on-failure", on_event=react)
    assert react.done.is_set() and react.error is None, react.error
    check_invariants(job, live=list(WORKERS))

    # Both of node 0's buffers, both fragments each (stripe 0's data, stripe 1's parity)
    assert sorted(step for step, _, _, _ in react.flipped) == [SNAPSHOT_STEP - 5] * 2 + [SNAPSHOT_STEP] * 2
    step_10 = [(name, offset, length) for step, name, offset, length in react.flipped if step == SNAPSHOT_STEP]
    assert sorted(name.split("-")[-2] for name, _, _ in step_10) == ["w0", "w1"]
    [restore] = job.events("job_restore")
    assert (restore["restored_from"], restore["step"]) == ("memory", SNAPSHOT_STEP)
    restored = {e["worker"]: e for e in job.events("restored")}
    assert sorted(restored) == list(WORKERS)
    for w, e in restored.items():
        assert e["restored_from"] == "memory" and e["step"] == SNAPSHOT_STEP
        assert e["reloaded"] == 2, e  # both stripes, loaded again from node 1 in the same load, on every member
        if w in (0, 1):  # the damage each of node 0's workers found, by segment and byte range
            assert sorted(e["damaged"]) == sorted(f"{name}: bytes [{offset}, {offset + length}) do not match their "
                                                  f"checksum" for name, offset, length in step_10), e["damaged"]
        else:
            assert e["damaged"] == []

    assert not job.events("worker_error"), "a worker died of an error of its own"
    exits = [e for e in job.events("worker_exit") if not e["clean"]]
    assert set(react.killed) <= {e["pid"] for e in exits}
    assert all(e["error"] is None for e in exits), [e for e in exits if e["error"] is not None]
    assert not job.events("template_lost"), "a node lost its template"
    killed_at = {e["worker"]: e["t"] for e in exits if e["pid"] in react.killed}
    for w in WORKERS:  # each worker's every start after its SIGKILL is a fork of its node's template
        later = [e for e in job.events("worker_start", worker=w) if e["t"] > killed_at[w]]
        assert later and all(e["forked"] for e in later), (w, later)
