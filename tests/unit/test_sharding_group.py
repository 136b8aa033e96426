"""Sharded optimizer state over real gloo groups: the update, the all-gather, the ring copies, re-sharding.

Four processes (two per node) train a small model on gradients that are a
pure function of the step, so a replicated ``torch.optim.AdamW`` fed the same
gradients is the exact reference. Worker 1 leaves after step 2 either once its
shard's copy of that step reached its buddy (the copy is used as is) or before
sending it (the buddy's copy of the step before is brought forward with the
kept reduced gradient). The three survivors re-shard, train two more steps,
and must hold bit for bit the reference's parameters and moments.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from unbroken.mecefo.adapter import ExactOnlyAdapter
from unbroken.mecefo.gradients import GradLayout, apply_step
from unbroken.models.optim import build_optimizer
from unbroken.runtime.held_memory import held_storages
from unbroken.runtime.process_group import ViewGroup
from unbroken.store.view import View
from unbroken.sharding import ShardedAdamW
from unbroken.snapshot.replicas import ReplicaStore
from unbroken.sharding.state import ShardedState
from unbroken.snapshot.segment import remove_segments

pytestmark = pytest.mark.timeout(120)

STEPS, LEAVE_AFTER, WORLD = 5, 2, 4
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(9, 7), torch.nn.LayerNorm(7), torch.nn.Linear(7, 5))


def _reduced(layout: GradLayout, step: int) -> torch.Tensor:
    """The reduced buffer of ``step``: the same everywhere (a pure function of the step)."""
    g = torch.Generator().manual_seed(100 + step)
    buf = torch.randn(layout.size, generator=g)
    buf[layout.n_grad:] = 4.0  # group weights, loss, tokens
    return buf


def _lr(step: int) -> float:
    return 1e-2 * (step + 1) / STEPS


def _member(rank: int, store_path: str, out: str, job: str, early: bool) -> None:
    torch.set_num_threads(1)
    model = _model()
    layout = GradLayout(model, ExactOnlyAdapter(model))
    opt = ShardedAdamW(model, **HYPER)
    fake_job = SimpleNamespace(optimizer=opt, layout=layout, schedule=_lr,
                               cfg=SimpleNamespace(optim=SimpleNamespace(grad_clip=1.0)))
    node_of = {w: w // 2 for w in range(WORLD)}
    state = ShardedState(fake_job, worker=rank, node_of=node_of, replicas=ReplicaStore(job, node_of[rank], rank),
                         on_event=lambda *a, **k: None)
    store = dist.FileStore(store_path, WORLD)
    none = lambda: None  # noqa: E731
    members = tuple(range(WORLD))
    view = View(gen=0, members=members, step=0)
    group = ViewGroup(dist.PrefixStore("g0", store), gen=0, rank=rank, size=WORLD, device=torch.device("cpu"),
                      timeout_s=30)

    def adopt(view: View, group: ViewGroup) -> None:
        state.reshard(view, lambda t: group.allreduce(t, none).clone(),
                      lambda t, src: group.broadcast_into(t, src, none))

    adopt(view, group)
    whole = 0  # the most gradient-sized tensors alive after a committed step (its reduced buffer, or a copy)
    for step in range(STEPS):
        if step == LEAVE_AFTER + 1:  # worker 1 is gone: the survivors form view 1
            state.settle(none)
            group.abandon()
            view = View(gen=1, members=(0, 2, 3), step=step)
            group = ViewGroup(dist.PrefixStore("g1", store), gen=1, rank=view.rank_of(rank), size=3,
                              device=torch.device("cpu"), timeout_s=30)
            adopt(view, group)
        else:
            state.seal_replicas(none)
        state.update(step, _reduced(layout, step), group, none)
        if step == LEAVE_AFTER:  # every member's all-gather completed: the step commits everywhere
            store.add("gathered", 1)
            if rank == 1:
                store.wait(["gathered"])
                while store.add("gathered", 0) < WORLD:
                    time.sleep(0.01)
                if early:
                    os._exit(0)  # committed elsewhere, its copy of this step never sent
        state.commit(step, view, group, replicate=step < STEPS - 1)
        whole = max(whole, held_storages(torch.device("cpu"), []).count(4 * layout.size))
        if rank == 1 and step == LEAVE_AFTER:
            state.seal_replicas(none)  # its own copy of the step reached its buddy
            os._exit(0)
    result = {"params": [p.detach().reshape(-1).tolist() for p in model.parameters()],
              "range": [opt.lo, opt.hi], "exp_avg": opt.exp_avg.tolist(), "exp_avg_sq": opt.exp_avg_sq.tolist(),
              "summary": state.summary(), "gradient_sized_kept": whole}
    Path(out, f"w{rank}.json").write_text(json.dumps(result))


@pytest.mark.parametrize("early", [False, True], ids=["copy-of-the-step", "copy-one-step-behind"])
def test_survivors_reshard_from_ring_copies_bit_for_bit(tmp_path: Path, early: bool) -> None:
    job = secrets.token_hex(6)
    # forkserver: children forked from a clean server process (no threads of earlier tests inherited, as with
    # fork), which imported torch once (not per child, as with spawn).
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "torch.distributed", "unbroken.sharding.state", "unbroken.runtime.process_group"])
    procs = [ctx.Process(target=_member, args=(r, str(tmp_path / "store"), str(tmp_path), job, early))
             for r in range(WORLD)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(90)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        remove_segments(job)
    assert [p.exitcode for p in procs] == [0] * WORLD

    ref = _model()
    layout = GradLayout(ref, ExactOnlyAdapter(ref))
    opt = build_optimizer(ref, **HYPER)
    for step in range(STEPS):
        apply_step(layout, _reduced(layout, step), opt, lr=_lr(step), grad_clip=1.0)
    want_p = [p.detach().reshape(-1).tolist() for p in ref.parameters()]
    want_m = torch.cat([opt.state[p]["exp_avg"].reshape(-1) for p in ref.parameters()])
    want_v = torch.cat([opt.state[p]["exp_avg_sq"].reshape(-1) for p in ref.parameters()])
    covered = []
    for w in (0, 2, 3):
        got = json.loads((tmp_path / f"w{w}.json").read_text())
        assert got["params"] == want_p
        lo, hi = got["range"]
        covered.append((lo, hi))
        assert torch.equal(torch.tensor(got["exp_avg"]), want_m[lo:hi])
        assert torch.equal(torch.tensor(got["exp_avg_sq"]), want_v[lo:hi])
        assert got["summary"]["members"] == [0, 2, 3]
        assert got["gradient_sized_kept"] == 0, "a step's replay keeps the copies' ranges only, not the whole gradient"
    assert sorted(covered) == [(0, covered[0][1]), (covered[0][1], covered[1][1]), (covered[1][1], want_m.numel())]
    # worker 3 (worker 1's buddy on the other node) sent worker 1's range in the re-shard
    assert json.loads((tmp_path / "w3.json").read_text())["summary"]["ranges_from_copies"] == 1
