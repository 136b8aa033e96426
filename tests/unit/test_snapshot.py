"""Snapshot memory on real shared memory: segments, seals, checksums, torn and failed writes, buffers mapped ahead
(restoring from it: test_snapshot_restore.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from _snapshot_jobs import NODE_OF, snapshot, trained
from unbroken.store.view import View
from unbroken.snapshot.fragment_io import verify_sealed
from unbroken.snapshot.restore import inventory
from unbroken.snapshot.segment import SealedBuffer, job_segments
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of

pytestmark = pytest.mark.timeout(120)


def test_segments_are_private_named_and_sealed(job_id):
    job = trained()
    events = snapshot(job_id, job, done=1)
    names = sorted(p.name for p in job_segments(job_id))
    assert names == sorted(f"unbroken-{job_id}-n{NODE_OF[w]}-w{w}-b0" for w in range(4))  # a fresh worker: b0
    assert all(oct(p.stat().st_mode & 0o777) == "0o600" for p in job_segments(job_id))
    plan = [e for e in events if e["event"] == "snapshot_plan"][0]
    assert (plan["k"], plan["m"], plan["stripes"], plan["protected"]) == (1, 1, 2, True)
    seal = SealedBuffer.open(job_segments(job_id)[0], job_id).seal
    assert seal["step"] == 1 and seal["gen"] == 2 and seal["config_hash"] == "cfg"
    with pytest.raises(Exception, match="sealed by job"):
        SealedBuffer.open(job_segments(job_id)[0], "0" * 12)


def test_mapping_a_buffer_ahead_leaves_the_snapshot_it_holds_as_it_was(job_id):
    """A restarted worker maps its other buffer beside its first write: that buffer may hold the newest sealed
    snapshot, which the mapping (one read per page) must leave intact, bit for bit."""
    from unbroken.snapshot.segment import HEADER_BYTES, Buffer

    job = trained()
    snapshot(job_id, job, done=1)
    path = job_segments(job_id)[0]
    before = path.read_bytes()
    seal = SealedBuffer.open(path, job_id).seal
    name = path.name  # unbroken-<job>-n<node>-w<worker>-b<buffer>
    node, worker, index = (int(part[1:]) for part in name.split("-")[2:5])
    again = Buffer(job_id, node, worker, index)
    again.reserve(len(before) - HEADER_BYTES)  # its own size: mapped as it is, not grown
    assert again.mapped and again.is_mapped
    again.close()
    assert path.read_bytes() == before and SealedBuffer.open(path, job_id).seal == seal


def _held_steps(job_id: str) -> dict[str, int]:
    """Segment name -> the step its seal names, for the sealed buffers of ``job_id`` (intact or not)."""
    out = {}
    for path in job_segments(job_id):
        sealed = SealedBuffer.open(path, job_id)
        if sealed is not None:
            verify_sealed(sealed)
            out[path.name[-2:]] = sealed.seal["step"]
    return out


def test_a_larger_share_after_a_restore_grows_the_newest_buffer_in_place(job_id):
    """After a whole-job restore the plan can shrink (fewer members), so every share grows: the first write of
    the restarted worker goes into its older buffer and maps the other one ahead for the larger size; that
    other buffer holds the snapshot the job was restored from, and must keep it (sealed, every byte intact)
    until a later write replaces it, never be unlinked and recreated."""
    job = trained()
    node_of = {0: 0, 1: 1}

    def snapshotter():
        return Snapshotter(job_id=job_id, node=0, worker=0, node_of=node_of, every=1, redundancy="none", parity=1,
                           config_hash="cfg", state=lambda: tensors_of(job.model, job.optimizer),
                           on_event=lambda *a, **k: None, write_threads=2)

    before = snapshotter()  # two members: worker 0 writes half of the state
    before.take(4, View(gen=1, members=(0, 1), step=4))
    before.close()
    assert _held_steps(job_id) == {"b0": 4}
    small = job_segments(job_id)[0].stat().st_size
    after = snapshotter()  # restored alone from step 4: its share is the whole state now
    after.take(5, View(gen=3, members=(0,), step=5))
    after.wait()
    reserving = after._reserving  # the map-ahead of buffer 0 runs on a write thread beside the write: wait for it
    assert reserving is not None and reserving[0] == 0
    reserving[1].result()
    assert _held_steps(job_id) == {"b0": 4, "b1": 5}, "the restored-from snapshot survives the map-ahead"
    assert job_segments(job_id)[0].stat().st_size > small, "and its buffer was grown for the next write"
    after.take(6, View(gen=3, members=(0,), step=6))
    after.close()
    assert _held_steps(job_id) == {"b0": 6, "b1": 5}


def test_a_failed_write_leaves_the_newest_snapshot_sealed_and_is_retried_in_its_own_buffer(job_id):
    """A write that fails (here: a buffer that cannot grow, as on a full /dev/shm) must not flip the double
    buffer: the next write goes into the same, unsealed or older, buffer, never over the only good copy."""
    import resource

    big = {"x": torch.zeros(1 << 16)}
    small = {"x": torch.zeros(1 << 10)}
    state = {"now": small}
    events: list[str] = []
    snap = Snapshotter(job_id=job_id, node=0, worker=0, node_of={0: 0}, every=1, redundancy="none", parity=1,
                       config_hash="cfg", state=lambda: state["now"], on_event=lambda name, **f: events.append(name))
    view = View(gen=1, members=(0,), step=1)
    snap.take(1, view)
    snap.take(2, view)
    snap.wait()
    assert _held_steps(job_id) == {"b0": 1, "b1": 2}
    old_limit = resource.getrlimit(resource.RLIMIT_FSIZE)
    old_handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    state["now"] = big  # step 3 needs a larger buffer than the files may grow to
    resource.setrlimit(resource.RLIMIT_FSIZE, (job_segments(job_id)[0].stat().st_size, old_limit[1]))
    try:
        snap.take(3, view)
        snap.wait()
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old_limit)
        signal.signal(signal.SIGXFSZ, old_handler)
    assert events.count("snapshot_failed") == 1
    assert _held_steps(job_id) == {"b0": 1, "b1": 2}, "the failed write grew nothing and unsealed nothing"
    state["now"] = small
    snap.take(4, view)
    snap.close()
    assert _held_steps(job_id) == {"b0": 4, "b1": 2}, "step 4 went where step 3 failed, step 2 kept"


def test_a_write_longer_than_the_progress_timeout_never_gets_the_waiting_worker_judged_stuck(job_id):
    """A fixed interval makes the training thread wait for the last snapshot before its next reduction: a first
    write of 1 GB (its buffer mapped as it goes: several progress timeouts long) must not get a healthy worker
    judged stuck by its peers (the wait counts as progress, as a validation or a checkpoint's does)."""
    from unbroken.store.job_store import JobStore
    from unbroken.runtime.membership import Membership

    store = JobStore.host("127.0.0.1", 0, clients=3, secret="s")
    view = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(view)
    addr = f"127.0.0.1:{store.port}"
    waiting = Membership(store, 0, heartbeat_timeout_s=0.2, progress_timeout_s=0.2,
                         heartbeat_store=JobStore.connect(addr, timeout_s=10, secret="s"))
    waiting.start_heartbeat()
    big = {"x": torch.ones(1 << 28)}
    snap = Snapshotter(job_id=job_id, node=0, worker=0, node_of={0: 0}, every=1, redundancy="none", parity=1,
                       config_hash="cfg", state=lambda: big, on_event=lambda *a, **k: None, busy=waiting.busy)
    peer = Membership(JobStore.connect(addr, timeout_s=10, secret="s"), 1, heartbeat_timeout_s=0.2,
                      progress_timeout_s=0.2)
    judged: list[set[int]] = []
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            judged.append(peer.dead_members(view))
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    try:
        peer.dead_members(view)  # first sight of worker 0's counters
        snap.take(1, View(gen=0, members=(0,), step=1))
        watcher.start()
        t0 = time.monotonic()
        snap.fence()  # what the worker does before its next reduction
        waited = time.monotonic() - t0
    finally:
        done.set()
        watcher.join(5)
        waiting.stop()
        snap.close()
        store.close()
    assert waited > 2 * 0.2, f"the write took {waited:.2f} s: too short to tell"
    assert judged and not any(judged), "worker 0 was judged stuck while it waited for its snapshot"


def _resident(path) -> int:
    """Bytes of ``path``'s mapping in this process that are mapped to pages (its ``Rss`` in smaps)."""
    lines = Path("/proc/self/smaps").read_text().splitlines()
    at = next(i for i, line in enumerate(lines) if line.endswith(str(path)))
    return next(int(line.split()[1]) for line in lines[at + 1:] if line.startswith("Rss:")) * 1024


def test_a_buffer_mapped_ahead_stops_when_the_worker_closes(job_id, monkeypatch):
    """The second buffer of a worker is mapped beside its first write, 256 MiB at a time; a worker that closes
    meanwhile stops it at the next piece (a short job ends at once, not after 11 s of mapping), and a write into
    the buffer left short makes a whole new one."""
    from unbroken.snapshot import segment
    from unbroken.snapshot.segment import HEADER_BYTES, Buffer

    piece, size = 64 << 10, 1 << 20
    monkeypatch.setattr(segment, "TOUCH_BYTES", piece)
    whole = Buffer(job_id, 0, 0, 0)
    whole.reserve(size, threading.Event())
    assert whole.path.stat().st_size == HEADER_BYTES + size
    assert _resident(whole.path) == HEADER_BYTES + size, "every page mapped"
    whole.close()

    stopped, stop = Buffer(job_id, 0, 0, 1), threading.Event()
    stop.set()
    stopped.reserve(size, stop)
    assert stopped.is_mapped and stopped.path.stat().st_size == piece, "one piece reserved, then it stopped"
    assert _resident(stopped.path) == 0, "and none of its pages touched"
    payload = stopped.begin(size)
    payload[:] = bytes(range(256)) * (size // 256)
    stopped.seal({"job": job_id, "step": 3})
    del payload
    assert stopped.path.stat().st_size == HEADER_BYTES + size
    stopped.close()
    again = SealedBuffer.open(stopped.path, job_id)
    assert again.seal["step"] == 3



def test_a_writer_killed_mid_copy_leaves_the_buffer_unsealed(job_id, tmp_path):
    """A real process is SIGKILLed while it fills a buffer: the reader never trusts it."""
    script = textwrap.dedent(f"""
        import os, sys, time
        from unbroken.snapshot.segment import HEADER_BYTES, Buffer
        b = Buffer({job_id!r}, 0, 0, 0)
        area = b.begin(1 << 20)
        area[: 1 << 19] = b"x" * (1 << 19)
        print("half", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    assert proc.stdout.readline().strip() == b"half"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    inv = inventory(job_id, 0)
    assert inv["seals"] == [] and inv["problems"] == [f"unbroken-{job_id}-n0-w0-b0: not sealed (a write was interrupted)"]


def test_agents_creating_the_job_id_at_once_all_get_the_first_ones(tmp_path):
    """Agents of one run directory started together (no launcher wrote the id): every one gets the same id, the
    one in the file, and none fails on another's temporary file (here threads, released by one barrier)."""
    import threading

    from unbroken.runtime.snapshot_hooks import job_id as run_job_id

    for attempt in range(20):
        run = tmp_path / f"run{attempt}"
        run.mkdir()
        start, got, errors = threading.Barrier(8), [], []

        def create() -> None:
            start.wait()
            try:
                got.append(run_job_id(run, create=True))
            except Exception as exc:  # noqa: BLE001 (the assertion below names it)
                errors.append(exc)

        threads = [threading.Thread(target=create) for _ in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors and set(got) == {(run / "job_id").read_text().strip()}, (errors, set(got))
        assert sorted(p.name for p in run.iterdir()) == ["job_id"], "no temporary file left"


def test_the_checksum_is_zlibs_crc32_over_any_buffer_threads_at_once():
    import mmap
    import zlib
    from concurrent.futures import ThreadPoolExecutor

    from unbroken.snapshot.segment import crc32

    data = os.urandom(3 << 20) + b"tail"
    with mmap.mmap(-1, len(data)) as mem:  # a writable mapping, as a snapshot buffer is
        mem[:] = data
        parts = [memoryview(mem)[i << 20:(i + 1) << 20] for i in range(4)]
        with ThreadPoolExecutor(4) as pool:
            assert list(pool.map(crc32, parts)) == [zlib.crc32(p) for p in parts]
        del parts
    assert crc32(data) == zlib.crc32(data) and crc32(b"") == 0
