"""Sharded optimizer state: ranges, the ring, AdamW on a range, shard copies, checkpoints, config."""

from __future__ import annotations

import copy
import secrets

import pytest
import torch

from unbroken.config import config_hash, load_config
from unbroken.models.optim import build_optimizer
from unbroken.checkpoint.checkpointer import AsyncCheckpointer, load_checkpoint, training_state
from unbroken.sharding import ShardedAdamW, Sharding, ring_buddies, shard_range
from unbroken.checkpoint.sharded import ShardCheckpointer, load_moments
from unbroken.snapshot.replicas import ReplicaStore
from unbroken.snapshot.segment import SealedBuffer, remove_segments, segment_name, segment_path

HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.LayerNorm(5), torch.nn.Linear(5, 3))


def test_shard_ranges_partition_in_rank_order() -> None:
    assert [shard_range(10, 3, r) for r in range(3)] == [(0, 4), (4, 7), (7, 10)]
    assert [shard_range(2, 3, r) for r in range(3)] == [(0, 1), (1, 2), (2, 2)]
    s = Sharding((1, 4, 6), 10)
    assert s.ranges() == [(1, 0, 4), (4, 4, 7), (6, 7, 10)] and s.padded == 4 and s.range_of(6) == (7, 10)
    with pytest.raises(ValueError, match="rank 3 of 3"):
        shard_range(10, 3, 3)


def test_ring_copies_go_to_the_next_node() -> None:
    node_of = {0: 0, 1: 0, 2: 1, 3: 1, 4: 2}
    assert ring_buddies([0, 1, 2, 3], node_of) == {0: 2, 1: 3, 2: 0, 3: 1}
    assert ring_buddies([0, 2, 3], node_of) == {0: 2, 2: 0, 3: 0}  # node 0 has one member left
    assert ring_buddies([0, 1, 2, 3, 4], node_of) == {0: 2, 1: 3, 2: 4, 3: 4, 4: 0}
    assert ring_buddies([0, 1], node_of) == {0: 1, 1: 0}  # one node: a ring over its members
    assert ring_buddies([3], node_of) == {}


@pytest.mark.parametrize("m", [1, 2, 3, 5])
def test_sharded_adamw_equals_adamw_bit_for_bit(m: int) -> None:
    ref = _model()
    opt_ref = build_optimizer(ref, **HYPER)
    shards = [copy.deepcopy(ref) for _ in range(m)]
    opts = [ShardedAdamW(s, **HYPER) for s in shards]
    sharding = Sharding(tuple(range(m)), opts[0].total)
    for r, o in enumerate(opts):
        lo, hi = sharding.range_of(r)
        o.set_range(lo, hi, torch.zeros(hi - lo), torch.zeros(hi - lo))
    for step in range(4):
        x = torch.randn(4, 7, generator=torch.Generator().manual_seed(step))
        for model in [ref, *shards]:
            model.zero_grad(set_to_none=True)
            model(x).pow(2).sum().backward()
            if step == 2:  # a parameter without gradient this step: AdamW leaves it (and its step) alone
                model[1].weight.grad = None
        opt_ref.step()
        proposals = [o.propose() for o in opts]
        flat = torch.cat([p.params for p in proposals])
        for o, p in zip(opts, proposals):
            o.commit(p, flat)
    want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    for s in shards:
        assert torch.equal(torch.cat([p.detach().reshape(-1) for p in s.parameters()]), want)
    want_m = torch.cat([opt_ref.state[p]["exp_avg"].reshape(-1) for p in ref.parameters()])
    assert torch.equal(torch.cat([o.exp_avg for o in opts]), want_m)
    steps = [float(opt_ref.state[p]["step"]) for p in ref.parameters()]
    assert [float(opts[0].state[p]["step"]) for p in shards[0].parameters()] == steps
    assert steps[2] == 3.0 and steps[0] == 4.0


def test_replayed_moments_equal_the_owners() -> None:
    model = _model()
    opt = ShardedAdamW(model, **HYPER)
    model(torch.randn(3, 7)).sum().backward()
    m0, v0 = torch.rand(opt.total), torch.rand(opt.total)
    opt.set_range(0, opt.total, m0.clone(), v0.clone())
    owner = opt.propose()
    lo, hi = 10, 50
    m, v = m0[lo:hi].clone(), v0[lo:hi].clone()
    opt.replay_moments(lo, hi, m, v)
    assert torch.equal(m, owner.exp_avg[lo:hi]) and torch.equal(v, owner.exp_avg_sq[lo:hi])


def test_sharded_step_needs_the_whole_range() -> None:
    opt = ShardedAdamW(_model(), **HYPER)
    opt.set_range(0, 5, torch.zeros(5), torch.zeros(5))
    with pytest.raises(RuntimeError, match="needs the whole range"):
        opt.step()


def test_replica_store_keeps_the_newest_intact_copy() -> None:
    job = secrets.token_hex(6)
    store = ReplicaStore(job, 1, 3)
    try:
        a, b = torch.arange(8, dtype=torch.float32), torch.arange(8, 16, dtype=torch.float32)
        store.write(4, 0, (0, 3), {0: (0, 4, a)})
        store.write(5, 0, (0, 3), {0: (0, 4, b)})
        assert (segment_path(segment_name(job, 1, 3, 1, "r"))).stat().st_mode & 0o777 == 0o600
        done, got = store.read(0, 0, 4, (0, 3))
        assert done == 5 and torch.equal(got, b)
        assert store.read(0, 0, 4, (0, 1, 3)) is None, "a copy made under another sharding is not used"
        with open(segment_path(segment_name(job, 1, 3, 1, "r")), "r+b") as fh:  # one byte of step 5's copy flips
            fh.seek(64 << 10)
            byte = fh.read(1)
            fh.seek(64 << 10)
            fh.write(bytes([byte[0] ^ 0xFF]))
        done, got = store.read(0, 0, 4, (0, 3))
        assert done == 4 and torch.equal(got, a)
    finally:
        store.close()
        remove_segments(job)


def test_ring_copies_of_the_timeline_a_restore_abandoned_are_ignored() -> None:
    """Before a whole-job restore at step 4 (view 5) the job reached step 6 under view 2: buffer 0 still holds
    that copy when the restored job seals its copy of step 5 in buffer 1. A failure in step 5 must find the
    copy of step 5 (the abandoned step 6 is newer, and no use: ShardLost)."""
    from types import SimpleNamespace

    from unbroken.sharding.state import ShardedState

    job = secrets.token_hex(6)
    store = ReplicaStore(job, 1, 3)
    try:
        abandoned, restored = torch.full((8,), 6.0), torch.full((8,), 5.0)
        store.write(6, 2, (0, 3), {0: (0, 4, abandoned)})
        model = _model()
        state = ShardedState(SimpleNamespace(optimizer=ShardedAdamW(model, **HYPER)), worker=3,
                             node_of={0: 0, 3: 1}, replicas=store, on_event=lambda *a, **k: None)
        state.reset_full(restored_gen=5)  # what the trainer does on loading the restored state
        store.write(5, 5, (0, 3), {0: (0, 4, restored)})
        done, got = store.read(0, 0, 4, (0, 3))
        assert done == 5 and torch.equal(got, restored)
    finally:
        store.close()
        remove_segments(job)


def test_a_snapshot_steps_copies_are_pinned_and_a_restore_finds_every_range_of_that_step() -> None:
    """Copies of every step alternate in buffers 0 and 1; a snapshot step's go to 2 and 3, so the moments of
    the two newest snapshot steps stay while later steps' copies come and go. :func:`moments_spec` takes a
    step only with a copy of every range of one sharding, sealed in the snapshot's view."""
    from unbroken.snapshot.replicas import copies_inventory, moments_spec

    job = secrets.token_hex(6)
    holders = {3: ReplicaStore(job, 1, 3), 0: ReplicaStore(job, 0, 0)}  # 3 keeps 0's copy, 0 keeps 3's
    try:
        for done in range(1, 8):  # a snapshot every 3 steps (3, 6): their copies pinned
            pinned = done % 3 == 0
            holders[3].write(done, 2, (0, 3), {0: (0, 4, torch.full((8,), float(done)))}, pinned=pinned)
            holders[0].write(done, 2, (0, 3), {3: (4, 10, torch.full((12,), -float(done)))}, pinned=pinned)
        copies = copies_inventory(job, 1)[0] + copies_inventory(job, 0)[0]
        # buffer 0: step 4 (2 before it); 1: step 7 (1, 5 before it); pinned 2 and 3: steps 3 and 6
        assert sorted(c["step"] for c in copies) == [3, 3, 4, 4, 6, 6, 7, 7]
        spec = moments_spec(copies, step=6, gen=2)
        assert spec is not None and spec["members"] == [0, 3]
        assert [(o, lo, hi, node) for o, lo, hi, node, *_ in spec["ranges"]] == [(0, 0, 4, 1), (3, 4, 10, 0)]
        assert moments_spec(copies, step=5, gen=2) is None, "step 5's copies were overwritten by step 7's"
        assert moments_spec(copies, step=3, gen=2) is not None, "the snapshot before the last one"
        assert moments_spec(copies, step=6, gen=1) is None, "sealed in another view: another timeline"
        assert moments_spec(copies_inventory(job, 1)[0], step=6, gen=2) is None, "node 0 (3's copy) is gone"
        # A replicated optimizer takes the moments too (a --resume without train.shard_optimizer).
        from unbroken.snapshot.replicas import restore_moments

        model = torch.nn.Sequential(torch.nn.Linear(2, 2, bias=False), torch.nn.Linear(2, 3, bias=False))  # 4 + 6
        opt = build_optimizer(model, **HYPER)

        def broadcast(t: torch.Tensor, src: int) -> None:  # worker 3 (rank 1) sends 0's copy, kept on its node 1
            if src == 1:
                _, lo, hi, node, segment, offset, n, crc = spec["ranges"][0]
                data = SealedBuffer.open(segment_path(segment), job).read(offset, n, crc)
                t.copy_(torch.frombuffer(bytearray(data), dtype=torch.float32))

        done = restore_moments(spec, job=job, node_of={0: 0, 3: 1}, members=(0, 3), me=0, broadcast=broadcast,
                               model=model, optimizer=opt)
        w = model[1].weight
        assert torch.equal(opt.state[model[0].weight]["exp_avg"], torch.full((2, 2), 6.0))
        assert torch.equal(opt.state[w]["exp_avg"], torch.full((3, 2), -6.0))
        assert torch.equal(opt.state[w]["exp_avg_sq"], torch.full((3, 2), -6.0))
        assert done["moment_ranges"] == 2 and done["moment_bytes_sent"] == 48 and done["moment_bytes_received"] == 32
    finally:
        for h in holders.values():
            h.close()
        remove_segments(job)


@pytest.fixture
def full_shared_memory(tmp_path, monkeypatch):
    """Snapshot memory on a 64 KiB tmpfs (where this test may mount one), else a ``posix_fallocate`` that
    fails with ENOSPC as a full /dev/shm does."""
    import errno
    import os
    import subprocess

    from unbroken.snapshot import segment

    tiny = tmp_path / "tiny-shm"
    tiny.mkdir()
    mounted = os.geteuid() == 0 and subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(tiny)],
                                                   capture_output=True).returncode == 0
    if mounted:
        monkeypatch.setattr(segment, "SHM_DIR", tiny)
    else:
        def no_space(fd: int, offset: int, length: int) -> None:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "posix_fallocate", no_space)
    yield "tmpfs" if mounted else "injected"
    if mounted:
        subprocess.run(["umount", str(tiny)], check=True)


def test_a_full_shared_memory_leaves_the_ring_copy_unsealed_and_training_goes_on(full_shared_memory) -> None:
    """ENOSPC while sealing the copies received (1 MiB, more than the memory holds): reported as an event,
    never raised into the step (the worker would crash, restart and crash again)."""
    from types import SimpleNamespace

    from unbroken.sharding.state import ShardedState

    job, events = secrets.token_hex(6), []
    store = ReplicaStore(job, 1, 3)
    state = ShardedState(SimpleNamespace(optimizer=ShardedAdamW(_model(), **HYPER)), worker=3, node_of={0: 0, 3: 1},
                         replicas=store, on_event=lambda name, **f: events.append({"event": name, **f}))
    group = SimpleNamespace(wait_side=lambda works, check, what: None)
    state._outgoing = {"works": [], "copies": {0: (0, 1 << 17, torch.zeros(1 << 18))}, "done": 5, "gen": 1,
                       "members": (0, 3), "group": group, "keep": None}
    try:
        state.seal_replicas(lambda: None)
        assert [e["event"] for e in events] == ["replica_failed"], full_shared_memory
        assert "No space left on device" in events[0]["error"] and events[0]["step"] == 5
        assert state.summary()["replicas_failed"] == 1 and store.written == 0
        assert store.read(0, 0, 1 << 17, (0, 3)) is None
    finally:
        store.close()
        remove_segments(job)


def _trained(optimizer_cls: str) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = _model()
    opt = build_optimizer(model, **HYPER) if optimizer_cls == "adamw" else ShardedAdamW(model, **HYPER)
    for step in range(2):
        model.zero_grad(set_to_none=True)
        model(torch.randn(4, 7, generator=torch.Generator().manual_seed(step))).pow(2).sum().backward()
        opt.step()
    return model, opt


@pytest.mark.parametrize("into", ["adamw", "sharded"])
def test_sharded_checkpoint_resumes_replicated_or_sharded(tmp_path, into: str) -> None:
    model, opt = _trained("sharded")
    ranges = [(0, 30), (30, 61), (61, opt.total)]
    writer = ShardCheckpointer(tmp_path)
    for lo, hi in ranges:
        writer.save(2, 7, lo, hi, opt.exp_avg[lo:hi], opt.exp_avg_sq[lo:hi])
    writer.close()
    ckpt = AsyncCheckpointer(tmp_path, config_hash="h")
    ckpt.save(2, training_state(model, opt), {"loss": 1.0},
              shards=(7, [f"{lo}-{hi}" for lo, hi in ranges], {"shards": [list(r) for r in ranges]}))
    ckpt.wait()
    path = tmp_path / "checkpoints" / "step_0000002"
    fresh = _model()
    target = build_optimizer(fresh, **HYPER) if into == "adamw" else ShardedAdamW(fresh, **HYPER)
    load_checkpoint(path, fresh, target, config_hash="h")
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters()))
    if into == "adamw":
        got = torch.cat([target.state[p]["exp_avg_sq"].reshape(-1) for p in fresh.parameters()])
    else:
        got = target.exp_avg_sq
    assert torch.equal(got, opt.exp_avg_sq)


def test_replicated_checkpoint_resumes_sharded(tmp_path) -> None:
    model, opt = _trained("adamw")
    ckpt = AsyncCheckpointer(tmp_path, config_hash="h")
    ckpt.save(2, training_state(model, opt), {"loss": 1.0})
    ckpt.wait()
    fresh = _model()
    target = ShardedAdamW(fresh, **HYPER)
    load_checkpoint(tmp_path / "checkpoints" / "step_0000002", fresh, target, config_hash="h")
    assert torch.equal(target.exp_avg, torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in model.parameters()]))
    assert [float(target.state[p]["step"]) for p in fresh.parameters()] == [2.0] * 6


def test_a_checkpoint_missing_a_range_is_refused(tmp_path) -> None:
    with pytest.raises(ValueError, match=r"cover \[30, 40\) twice or not at all"):
        load_moments(tmp_path, [[0, 30], [40, 61]], 61)
    with pytest.raises(ValueError, match="cover 61 elements, the model has 70"):
        load_moments(tmp_path, [[0, 61]], 70)


def test_shard_optimizer_config() -> None:
    plain = load_config(preset_name="debug")
    sharded = load_config(preset_name="debug", overrides=["train.shard_optimizer=true"])
    assert config_hash(plain) == config_hash(sharded), "where the moments live does not change what is trained"
    with pytest.raises(ValueError, match="train.shard_optimizer=true with optim.factory='m:f': sharding needs"):
        load_config(preset_name="debug", overrides=["train.shard_optimizer=true", "optim.factory=m:f"])


def test_the_training_state_is_laid_out_in_the_models_order_whatever_order_the_optimizer_state_was_made_in() -> None:
    """A worker that loaded the state (a rejoin, a restore) created the optimizer's state in another order than
    one that trained from the start; the snapshot holders of one state must describe it alike."""
    model = _model()
    trained = build_optimizer(model, **HYPER)  # state created by a step: param_groups order (decay group first)
    model(torch.randn(2, 7)).sum().backward()
    trained.step()
    loaded = build_optimizer(model, **HYPER)
    for p in reversed(list(model.parameters())):  # created in another order, as a loader may
        loaded.state[p] = {k: v.clone() for k, v in trained.state[p].items()}
    assert list(training_state(model, trained)) == list(training_state(model, loaded))
    names = [k for k in training_state(model, trained) if k.startswith("optim.")]
    assert names[:4] == ["optim.0.weight.exp_avg", "optim.0.weight.exp_avg_sq", "optim.0.weight.step",
                         "optim.0.bias.exp_avg"], names
