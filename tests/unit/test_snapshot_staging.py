"""What a worker copies off its device for a snapshot (only the bytes it writes), how a restore loads
(stripe by stripe, straight into the live tensors), and, where CUDA is present, on which device and
stream the copies run."""

from __future__ import annotations

import copy
import os
import random

import pytest
import torch

from unbroken.models import build_model
from unbroken.store.view import View
from unbroken.snapshot.erasure import Coding
from unbroken.snapshot.plan import MAX_STRIPE_BYTES, plan_for
from unbroken.snapshot.segment import remove_segments
from unbroken.snapshot.snapshotter import Snapshotter, byte_ranges
from unbroken.snapshot.state_bytes import StateLoader, describe, tensors_of

pytestmark = pytest.mark.timeout(120)


def _trained(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = build_model("debug", vocab_size=512, seq_len=64)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    gen = torch.Generator().manual_seed(seed)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)
    opt.step()
    return model, opt


def test_a_data_fragment_holder_reads_its_fragment_a_parity_holder_its_whole_stripe():
    node_of = {w: w // 2 for w in range(6)}  # 3 nodes x 2 workers, one parity: k=2, m=1, 2 stripes
    plan = plan_for(node_of, node_of, redundancy="parity", parity=1, state_bytes=1000)
    chunk = Coding(plan.k, plan.m).chunk(500)
    mine = plan.assignment(node_of, node_of)
    # node 0 holds fragment 0 of stripe 0 (worker 0) and fragment 1 of stripe 1 (worker 1)
    assert mine[0] == [(0, 0)] and mine[1] == [(1, 1)]
    assert byte_ranges(plan, mine[0]) == [(0, chunk)]
    assert byte_ranges(plan, mine[1]) == [(500 + chunk, 1000)]
    # node 2 holds the parity (fragment 2) of stripe 0 and fragment 0 of stripe 1
    assert mine[4] == [(0, 2)] and byte_ranges(plan, mine[4]) == [(0, 500)]
    assert byte_ranges(plan, mine[5]) == [(500, 500 + chunk)]


@pytest.mark.parametrize("preset,per_node,nodes", [("llama-1b", 8, 4), ("llama-7b", 8, 4)])
def test_each_worker_stages_about_its_share_of_the_state_not_all_of_it(preset: str, per_node: int, nodes: int):
    from unbroken.config import preset as config_preset
    from unbroken.snapshot.capacity import state_bytes

    size = state_bytes(config_preset(preset))
    node_of = {w: w // per_node for w in range(nodes * per_node)}
    plan = plan_for(node_of, node_of, redundancy="parity", parity=1, state_bytes=size)
    staged = [sum(b - a for a, b in byte_ranges(plan, m)) for m in plan.assignment(node_of, node_of).values()]
    # a data holder stages its 1/k of each of its stripes, a parity holder the whole stripe (encoding
    # reads it all): the job stages the state (1 + m) times, not N * L times, and no worker more than
    # its node's 1/L of it
    assert plan.stripes % per_node == 0 and -(-size // plan.stripes) <= MAX_STRIPE_BYTES
    assert max(staged) <= -(-size // per_node) + plan.stripes
    assert size * 2 - plan.stripes * plan.k <= sum(staged) <= 2 * size


def test_a_restore_loads_any_order_of_pieces_exactly_into_the_live_tensors():
    model, opt = _trained(seed=1)
    src = tensors_of(model, opt)
    layout = describe(src)
    flat = bytearray(layout.nbytes)
    offset = 0
    for t in src.values():
        n = t.numel() * t.element_size()
        flat[offset:offset + n] = t.detach().reshape(-1).view(torch.uint8).numpy().tobytes()
        offset += n
    fresh = copy.deepcopy(model)
    with torch.no_grad():
        for p in fresh.parameters():
            p.add_(1.0)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)  # no moments yet: the loader creates them
    ptrs = [p.data_ptr() for p in fresh.parameters()]
    loader = StateLoader(layout.entries, fresh, fresh_opt, torch.device("cpu"))
    pieces = [(a, min(a + 997, layout.nbytes)) for a in range(0, layout.nbytes, 997)]
    random.Random(0).shuffle(pieces)
    for a, b in pieces:
        loader.write(a, bytes(flat[a:b]))
    torch.manual_seed(12345)
    loader.finish()
    got = tensors_of(fresh, fresh_opt)
    assert got.keys() == src.keys()
    assert all(torch.equal(got[k], src[k]) and got[k].dtype == src[k].dtype for k in src)
    assert [p.data_ptr() for p in fresh.parameters()] == ptrs, "written in place, into the live parameters"


def test_a_restore_into_another_shape_is_refused_before_anything_is_written():
    model, opt = _trained(seed=1)
    layout = describe(tensors_of(model, opt)).entries
    other = build_model("debug", vocab_size=256, seq_len=64)
    before = [p.clone() for p in other.parameters()]
    with pytest.raises(ValueError, match=r"does not fit the model: 'model.tok_embeddings.weight' is float32 \(512, "):
        StateLoader(layout, other, torch.optim.AdamW(other.parameters()), torch.device("cpu"))
    assert all(torch.equal(a, b) for a, b in zip(before, other.parameters()))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_snapshot_copies_run_on_the_tensors_device_and_stage_only_the_workers_bytes():
    dev = torch.device("cuda", torch.cuda.device_count() - 1)  # another GPU than 0 wherever there are two
    torch.cuda.set_device(dev)
    model, opt = _trained(seed=1)
    model.to(dev)
    for st in opt.state.values():
        st["exp_avg"], st["exp_avg_sq"] = st["exp_avg"].to(dev), st["exp_avg_sq"].to(dev)
    node_of = {0: 0, 1: 0, 2: 1, 3: 1}
    job = os.urandom(6).hex()
    snap = Snapshotter(job_id=job, node=0, worker=1, node_of=node_of, every=1, redundancy="parity", parity=1,
                       config_hash="cfg", state=lambda: tensors_of(model, opt, dev), on_event=lambda *a, **k: None)
    try:
        snap.take(1, View(gen=0, members=(0, 1, 2, 3), step=1))
        snap.wait()
        thread_device = snap._pool.submit(torch.cuda.current_device).result()
        size = describe(tensors_of(model, opt, dev)).nbytes
        assert snap.stager.stream.device == dev, "the side stream is on the tensors' device"
        assert thread_device == dev.index, "the copying thread made that device current"
        assert 0 < snap.pinned_bytes <= size // 2 + 1, "a worker stages only what it writes (1/L of the state)"
        assert snap.last is not None and snap.last["pinned_bytes"] == snap.pinned_bytes
    finally:
        snap.close()
        remove_segments(job)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("cap", ["all", "third", "none"])
def test_under_auto_a_cuda_snapshot_is_copied_off_the_live_state_and_seals_the_state_of_its_step(cap):
    """``snapshot.every=auto`` on a GPU: the copies run from the live state into pinned memory on a side
    stream, a tail of at most ``snapshot.device_staging_bytes`` device to device first (before anything was
    measured, as much as the cap allows: all of it, a third, or none); the fence makes the next optimizer
    step wait for them on the device; the optimizer then changes the state while the spill lands and the
    write goes on; the seal holds the state of its step, bit for bit."""
    from unbroken.snapshot.cadence import VOTE_SLOTS, cast
    from unbroken.snapshot.restore import decide, inventory, restore_from_memory

    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    model, opt = _trained(seed=2)
    model.to(dev)
    for st in opt.state.values():
        st["exp_avg"], st["exp_avg_sq"] = st["exp_avg"].to(dev), st["exp_avg_sq"].to(dev)
    want = {k: v.detach().cpu().clone() for k, v in tensors_of(model, opt, dev).items()}
    total = describe(tensors_of(model, opt, dev)).nbytes
    limit = {"all": 2 << 30, "third": total // 3, "none": 0}[cap]
    job = os.urandom(6).hex()
    snap = Snapshotter(job_id=job, node=0, worker=0, node_of={0: 0}, every="auto", redundancy="none", parity=1,
                       config_hash="cfg", state=lambda: tensors_of(model, opt, dev), on_event=lambda *a, **k: None,
                       write_threads=4, device_staging_bytes=limit)
    try:
        votes = torch.zeros(VOTE_SLOTS)
        cast(votes, 1)
        snap.take(1, View(gen=0, members=(0,), step=1), votes)
        snap.fence()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)  # the next optimizer step, queued once the fence returned
        snap.wait()
        assert snap.device_bytes == min(limit, total) and snap.pinned_bytes == total, "a bounded spill"
        assert snap.stager.rate is None or snap.stager.rate > 0
        spec = decide([inventory(job, 0, config_hash="cfg")], checkpoint=None, members_of=lambda nodes: [0])
        fresh, fresh_opt = _trained(seed=3)
        fresh.to(dev)
        for st in fresh_opt.state.values():
            st["exp_avg"], st["exp_avg_sq"] = st["exp_avg"].to(dev), st["exp_avg_sq"].to(dev)
        restore_from_memory(spec, job=job, node=0, node_of={0: 0}, members=(0,), me=0, broadcast=None,
                            model=fresh, optimizer=fresh_opt, device=dev)
        got = {k: v.detach().cpu() for k, v in tensors_of(fresh, fresh_opt, dev).items()}
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    finally:
        snap.close()
        remove_segments(job)


def test_under_auto_a_cpu_snapshot_staged_in_blocks_seals_the_state_of_its_step(monkeypatch):
    """The staging buffer in small blocks (every range and read crosses their edges): the fence returns once
    the state is staged, the next optimizer step changes it, and the seal still holds the state of its step."""
    from unbroken.snapshot import staging
    from unbroken.snapshot.cadence import VOTE_SLOTS, cast
    from unbroken.snapshot.restore import decide, inventory, restore_from_memory

    monkeypatch.setattr(staging, "BLOCK_BYTES", 4099)
    model, opt = _trained(seed=2)
    cpu = torch.device("cpu")
    want = {k: v.detach().clone() for k, v in tensors_of(model, opt, cpu).items()}
    job = os.urandom(6).hex()
    node_of = {0: 0, 1: 0, 2: 0}  # one node, three workers: each stages its third of the state
    snaps = [Snapshotter(job_id=job, node=0, worker=w, node_of=node_of, every="auto", redundancy="none",
                         parity=1, config_hash="cfg", state=lambda: tensors_of(model, opt, cpu),
                         on_event=lambda *a, **k: None, write_threads=2) for w in node_of]
    try:
        votes = torch.zeros(VOTE_SLOTS)
        cast(votes, 1)
        for snap in snaps:
            snap.take(1, View(gen=0, members=(0, 1, 2), step=1), votes)
            snap.fence()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(0.5)  # the next optimizer step, once the fences returned
        for snap in snaps:
            snap.wait()
            assert snap.stager.host is not None and len(snap.stager.host.blocks) > 10, "staged in many blocks"
        spec = decide([inventory(job, 0, config_hash="cfg")], checkpoint=None, members_of=lambda nodes: [0])
        fresh, fresh_opt = _trained(seed=3)
        restore_from_memory(spec, job=job, node=0, node_of=node_of, members=(0,), me=0, broadcast=None,
                            model=fresh, optimizer=fresh_opt, device=cpu)
        got = {k: v.detach() for k, v in tensors_of(fresh, fresh_opt, cpu).items()}
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    finally:
        for snap in snaps:
            snap.close()
        remove_segments(job)


_THREADS_PROBE = r"""
import os, sys, torch
from unbroken.store.view import View
from unbroken.snapshot.segment import remove_segments
from unbroken.snapshot.snapshotter import Snapshotter
torch.set_num_threads(2)
state = {f"t{i}": torch.randn(1 << 20) for i in range(4)}  # 4 MiB each: torch would copy them on 2 threads
torch.randn(1 << 20).mul_(2)  # the training thread's own intra-op team, started before
job = os.urandom(6).hex()
threads = lambda: len(os.listdir("/proc/self/task"))
for every in (1, "auto"):  # a fixed interval reads the live tensors; auto stages them in a host buffer first
    snap = Snapshotter(job_id=job + str(every), node=0, worker=0, node_of={0: 0}, every=every, redundancy="none",
                       parity=0, config_hash="t", state=lambda: state, on_event=lambda *a, **k: None)
    snap._pool.submit(int).result()  # the snapshot thread itself, started
    before = threads()
    if every == 1:
        snap.take(1, View(gen=0, members=(0,), step=1))
    else:
        snap.take(1, View(gen=0, members=(0,), step=1), torch.tensor([1]))
    snap.wait()
    print(every, before, threads(), snap.taken)
    snap.close()
    remove_segments(job + str(every))
"""


@pytest.mark.skipif(not os.path.isdir("/proc/self/task") or (os.cpu_count() or 1) < 2, reason="needs Linux, 2 cores")
def test_a_cpu_snapshot_starts_no_intra_op_threads_beside_the_training_ones():
    # torch's copy_ of a large tensor on the snapshot thread would start a second team of intra-op threads for
    # that thread, kept as long as it lives: with the training's own team, the cores oversubscribed, and every
    # step of a one-worker CPU job ran 30-50 % slower while snapshots were on (the state is copied with numpy)
    import subprocess
    import sys
    done = subprocess.run([sys.executable, "-c", _THREADS_PROBE], capture_output=True, text=True, timeout=100,
                          env={**os.environ, "OMP_NUM_THREADS": "2"})
    assert done.returncode == 0, done.stderr
    rows = [line.split() for line in done.stdout.split("\n") if line]
    assert [r[0] for r in rows] == ["1", "auto"]
    for every, before, after, taken in rows:
        assert int(taken) == 1, every
        assert int(after) == int(before), f"every={every}: {before} threads before the snapshot, {after} after"
