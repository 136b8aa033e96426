"""The state layer on real shared memory: seal, checksums, torn writes, parity rebuild, restore order."""

from __future__ import annotations

import copy
import dataclasses
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

from unbroken.config import load_config, preset
from unbroken.models import build_model
from unbroken.runtime.ledger import check_ledger
from unbroken.store.view import View
from unbroken.snapshot.capacity import check_snapshot_config, node_bytes, state_bytes
from unbroken.snapshot.erasure import Coding, ErasureError
from unbroken.snapshot.fragment_io import verify_sealed
from unbroken.snapshot.plan import plan_for
from unbroken.snapshot.restore import alone, decide, inventory, restore_from_memory
from unbroken.snapshot.segment import SealedBuffer, SnapshotCorrupt, job_segments, remove_segments, segment_dir
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of

pytestmark = pytest.mark.timeout(120)

NODE_OF = {0: 0, 1: 0, 2: 1, 3: 1}


@dataclasses.dataclass
class _State:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


_BASE: list = []


def _trained(seed: int = 0, steps: int = 1) -> _State:
    """The debug model (built once) after ``steps`` AdamW steps on seeded random gradients."""
    if not _BASE:
        _BASE.append(build_model("debug", vocab_size=512, seq_len=64))
    model = copy.deepcopy(_BASE[0])
    job = _State(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in job.model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        job.optimizer.step()
    return job


def _snapshot(job_id: str, job, done: int, *, redundancy: str = "parity", members=(0, 1, 2, 3),
              gen: int = 2) -> list[dict]:
    events: list[dict] = []
    snaps = [Snapshotter(job_id=job_id, node=NODE_OF[w], worker=w, node_of=NODE_OF, every=1, redundancy=redundancy,
                         parity=1, config_hash="cfg", state=lambda: tensors_of(job.model, job.optimizer),
                         on_event=lambda name, **f: events.append({"event": name, **f})) for w in members]
    view = View(gen=gen, members=tuple(members), step=done)
    for s in snaps:
        s.take(done, view)
    for s in snaps:
        s.close()
    return events


def _spec(job_id: str, nodes=(0, 1), checkpoint=None):
    invs = [inventory(job_id, n, config_hash="cfg") for n in nodes]
    return decide(invs, checkpoint=checkpoint, members_of=lambda ns: [w for w in NODE_OF if NODE_OF[w] in ns]), invs


def _restore_into(job_id: str, spec, node: int, me: int):
    """Worker ``me`` loads as one process alone (the other workers of its node would load alike)."""
    fresh = _trained(seed=99)  # different state: the restore must overwrite every byte
    stats = restore_from_memory(spec, job=job_id, node=node, node_of=NODE_OF, members=(me,), me=me,
                                broadcast=alone, model=fresh.model, optimizer=fresh.optimizer,
                                device=torch.device("cpu"))
    return fresh, stats


def _same_state(a, b) -> bool:
    ta, tb = tensors_of(a.model, a.optimizer), tensors_of(b.model, b.optimizer)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) and ta[k].dtype == tb[k].dtype for k in ta)


def test_segments_are_private_named_and_sealed(job_id):
    job = _trained()
    events = _snapshot(job_id, job, done=1)
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

    job = _trained()
    _snapshot(job_id, job, done=1)
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
    job = _trained()
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


@pytest.mark.parametrize("redundancy", ["parity", "replica"])
def test_restore_from_own_memory_is_exact(job_id, redundancy):
    job = _trained()
    _snapshot(job_id, job, done=1, redundancy=redundancy)
    spec, _ = _spec(job_id)
    assert spec["source"] == "memory" and spec["step"] == 1
    restored, stats = _restore_into(job_id, spec, node=0, me=0)
    assert _same_state(job, restored)
    # Parity rotates over the nodes: node 0 holds stripe 0's data and stripe 1's parity.
    assert stats["local"] == 2 and stats["rebuilt"] == (1 if redundancy == "parity" else 0)


def test_parity_rebuilds_a_lost_node_exactly(job_id):
    job = _trained()
    _snapshot(job_id, job, done=1)
    remove_segments(job_id, node=0)  # node 0 and its memory are gone
    spec, _ = _spec(job_id, nodes=(1,))
    assert spec["members"] == [2, 3] and spec["parity_stripes"] == [0]  # stripe 1's data lives on node 1
    restored, stats = _restore_into(job_id, spec, node=1, me=2)
    assert _same_state(job, restored) and stats["rebuilt"] == 1


def test_no_redundancy_cannot_survive_a_lost_node(job_id):
    job = _trained()
    _snapshot(job_id, job, done=1, redundancy="none")
    spec, _ = _spec(job_id)  # complete only with both nodes: each holds one of the two pieces
    assert spec["step"] == 1 and {h[2] for h in spec["holders"]} == {0, 1}
    remove_segments(job_id, node=0)
    spec, _ = _spec(job_id, nodes=(1,), checkpoint=(0, "/ckpt/step-0"))
    assert spec == {"source": "checkpoint", "step": 0, "path": "/ckpt/step-0"}
    assert _spec(job_id, nodes=(1,))[0] is None


def test_corrupt_buffer_falls_back_to_the_other_buffer_and_says_so(job_id):
    job = _trained()
    _snapshot(job_id, job, done=1)
    older = _trained()  # the state of step 1, kept to compare
    for p in job.model.parameters():
        p.grad = torch.ones_like(p)
    job.optimizer.step()
    _snapshot(job_id, job, done=2)
    victim = segment_dir() / f"unbroken-{job_id}-n0-w0-b1"  # step 2 lives in buffer 1 (step 1 in buffer 0)
    with open(victim, "r+b") as fh:
        fh.seek(-100, os.SEEK_END)
        byte = fh.read(1)
        fh.seek(-100, os.SEEK_END)
        fh.write(bytes([byte[0] ^ 0xFF]))
    spec, invs = _spec(job_id)
    assert any("do not match their checksum" in p for p in invs[0]["problems"])
    # Step 2 is still complete through node 1's parity; lose that too and step 1 (buffer 0) is next.
    assert spec["step"] == 2 and spec["parity_stripes"] == [0]
    restored, _ = _restore_into(job_id, spec, node=1, me=2)
    assert _same_state(job, restored)
    for w in (2, 3):
        (segment_dir() / f"unbroken-{job_id}-n1-w{w}-b1").unlink()
    spec, _ = _spec(job_id)
    assert spec["step"] == 1
    restored, _ = _restore_into(job_id, spec, node=0, me=0)
    assert _same_state(older, restored)


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


def test_plan_bytes_per_node_follow_the_formula():
    node_of = {w: w // 2 for w in range(6)}  # 3 nodes of 2 workers
    plan = plan_for(node_of, node_of, redundancy="parity", parity=1, state_bytes=6_000_000)
    assert (plan.k, plan.m, plan.stripes) == (2, 1, 2)
    per_node = plan.stripes * len(plan.fragments_of(0, 0)) * (plan.state_bytes // plan.stripes // plan.k)
    assert per_node == pytest.approx((1 + 1 / 2) * 6_000_000 / 3)
    # Stripe i's parity (fragment 2) sits on node (2 - i) mod 3: the encoding work rotates.
    assert plan.assignment(node_of, node_of) == {0: [(0, 0)], 1: [(1, 1)], 2: [(0, 1)], 3: [(1, 2)],
                                                  4: [(0, 2)], 5: [(1, 0)]}
    alone = plan_for([0, 1], node_of, redundancy="parity", parity=1, state_bytes=100)
    assert (alone.k, alone.m, alone.protected) == (1, 0, False)


def test_erasure_needs_k_fragments():
    data = os.urandom(10_001)
    c = Coding(2, 1)
    chunk = c.chunk(len(data))
    raw = data.ljust(2 * chunk, b"\0")
    parity, headers = c.parity(data, [2])
    pieces = {0: raw[:chunk], 1: raw[chunk:], 2: parity[2]}
    assert c.decode({0: pieces[0], 1: pieces[1]}, len(data)) == data  # the data fragments are the bytes
    assert c.decode({1: pieces[1], 2: pieces[2]}, len(data), headers) == data
    with pytest.raises(ErasureError, match="needs 2 of its 3 fragments"):
        c.decode({2: pieces[2]}, len(data), headers)
    with pytest.raises(ErasureError, match="needs the data fragments' headers"):
        c.decode({1: pieces[1], 2: pieces[2]}, len(data))


def test_bad_snapshot_settings_are_refused_with_the_fix():
    cfg = load_config(preset_name="debug", overrides=["snapshot.parity=2"])
    with pytest.raises(ValueError, match="snapshot.parity=2 needs more than 2 nodes"):
        check_snapshot_config(cfg, nodes=2, workers_per_node=2)
    assert check_snapshot_config(preset("debug"), nodes=1, workers_per_node=4) > 0  # one node: nothing to protect across
    big = preset("llama-7b")
    assert state_bytes(big) > 12 * 6_000_000_000
    with pytest.raises(ValueError, match=r"snapshots need .* MiB of shared memory per node .*snapshot.every=0"):
        check_snapshot_config(big, nodes=2, workers_per_node=2)
    assert node_bytes(preset("debug"), 2, 2) > 2 * state_bytes(preset("debug"))
    with pytest.raises(ValueError, match="snapshot.every=-1"):
        load_config(preset_name="debug", overrides=["snapshot.every=-1"])
    with pytest.raises(ValueError, match="snapshot.redundancy"):
        load_config(preset_name="debug", overrides=["snapshot.redundancy=raid"])


def test_ledger_counts_the_history_after_a_restore(tmp_path):
    from unbroken.jsonl import JsonlWriter

    w = JsonlWriter(tmp_path / "events" / "w0.jsonl")
    for step, gen in ((0, 0), (1, 0), (1, 1)):  # step 1 committed in gen 0, then the job restored at step 1
        w.write({"kind": "work", "step": step, "gen": gen, "worker": 0, "items": [[0, 0, 2, "exact"]]})
        if (step, gen) != (1, 1):
            w.write({"kind": "commit", "step": step, "gen": gen, "worker": 0})
    w.write({"kind": "restore", "step": 1, "gen": 1, "worker": 0})
    w.write({"kind": "commit", "step": 1, "gen": 1, "worker": 0})
    w.close()
    check = check_ledger(tmp_path, n_slots=1, micro_batch=2, steps=2)
    assert check.ok and check.conflicting_steps == []


def test_resume_refuses_snapshot_memory_of_another_config(tmp_path):
    from unbroken.agent.preflight import prepare_run_dir
    from unbroken.runtime.snapshot_hooks import job_id as run_job_id

    cfg = load_config(preset_name="debug")
    run = tmp_path / "run"
    assert prepare_run_dir(run, cfg, overwrite=False, resume=False) is None
    ident = run_job_id(run)
    try:
        with pytest.raises(ValueError, match="no committed checkpoint .* and no complete snapshot of its job"):
            prepare_run_dir(run, cfg, overwrite=False, resume=True)
        _snapshot(ident, _trained(), done=1)  # sealed under config hash "cfg", not this run's
        with pytest.raises(ValueError, match=f"shared memory holds snapshots of job {ident} written under config cfg"):
            prepare_run_dir(run, cfg, overwrite=False, resume=True)
        # Overwriting the run starts a new job: the old job's memory is freed with it.
        prepare_run_dir(run, cfg, overwrite=True, resume=False)
        assert job_segments(ident) == [] and run_job_id(run) != ident
    finally:
        remove_segments(ident)


def test_a_joiner_loads_the_boundary_from_its_own_node_when_the_node_can_decode_alone(job_id, tmp_path):
    from unbroken.runtime import snapshot_hooks as th

    run = tmp_path / "run"
    run.mkdir()
    (run / "job_id").write_text(job_id + "\n")
    (run / "layout.json").write_text('{"nodes": 2, "workers_per_node": 2}')
    cfg = preset("debug")
    everyone = (0, 1, 2, 3)
    assert th.memory_rejoin_possible(cfg, run, 4, 1, everyone, 7)  # 2 nodes, k = 1: a node decodes alone
    assert not th.memory_rejoin_possible(cfg, run, 4, 1, (2, 3), 7)  # nobody on its node snapshotted step 7
    cfg.snapshot.every = 2
    assert not th.memory_rejoin_possible(cfg, run, 4, 1, everyone, 7)  # step 7 is not a snapshot step
    (run / "layout.json").write_text('{"nodes": 4, "workers_per_node": 1}')
    cfg.snapshot.every = 1
    assert not th.memory_rejoin_possible(cfg, run, 4, 1, everyone, 7)  # k = 3: needs other nodes' fragments
    # HSDP, one node of 2 replicas x 2 ranks: index 1's state is snapshotted by its members only (worker 1 of
    # the live replica 0, for the joiner 3), all on the node: it decodes alone.
    from unbroken.sharding.hsdp import ReplicaLayout

    (run / "layout.json").write_text('{"nodes": 1, "workers_per_node": 4}')
    assert th.memory_rejoin_possible(cfg, run, 4, 3, (0, 1), 7, ReplicaLayout(4, 2))
    (run / "layout.json").write_text('{"nodes": 2, "workers_per_node": 2}')  # a replica per node: nobody on it
    assert not th.memory_rejoin_possible(cfg, run, 4, 3, (0, 1), 7, ReplicaLayout(4, 2))
    job = _trained()
    _snapshot(job_id, job, done=7)
    fresh = _trained(seed=5)
    done = th.load_from_node_memory(run, 1, 4, 7, fresh.model, fresh.optimizer, torch.device("cpu"), "cfg")
    assert _same_state(job, fresh) and done["received"] == 0
    with pytest.raises(SnapshotCorrupt, match="no complete snapshot of step 8"):
        th.load_from_node_memory(run, 1, 4, 8, fresh.model, fresh.optimizer, torch.device("cpu"), "cfg")
    assert th.memory_rejoin_allowed(run, 1)
    th.memory_rejoin_failed(run, 1, "test")
    assert not th.memory_rejoin_allowed(run, 1) and th.memory_rejoin_allowed(run, 2)


def test_a_joiner_loads_the_restored_timelines_snapshot_not_the_abandoned_one(job_id, tmp_path):
    """Step 7 was sealed under view 2 (worker 0 the node's writer), then the job was restored at an earlier
    step and trained step 7 again, differently, under view 9 (worker 1 the writer; worker 0 down). Both are
    complete on node 0: worker 0, rejoining at step 7 from its node's memory, loads view 9's."""
    from unbroken.runtime import snapshot_hooks as th

    run = tmp_path / "run"
    run.mkdir()
    (run / "job_id").write_text(job_id + "\n")
    (run / "layout.json").write_text('{"nodes": 2, "workers_per_node": 2}')
    abandoned, restored = _trained(seed=1), _trained(seed=2)
    _snapshot(job_id, abandoned, done=7, members=(0, 2, 3), gen=2)
    _snapshot(job_id, restored, done=7, members=(1, 2, 3), gen=9)
    fresh = _trained(seed=5)
    th.load_from_node_memory(run, 0, 4, 7, fresh.model, fresh.optimizer, torch.device("cpu"), "cfg")
    assert _same_state(restored, fresh) and not _same_state(abandoned, fresh)


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
