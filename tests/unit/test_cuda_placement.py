"""On CUDA only: where a worker's tensors live after a standby handover and after a state transfer,
and a survivor of an NCCL peer killed mid-all-reduce carries on.

The kill scenario needs two GPUs: NCCL refuses two ranks of one communicator on one device
(seen on one H100, NCCL 2.28.9: ``ncclInvalidUsage ... Duplicate GPU detected : rank 0 and rank 1
both on CUDA device 60`` at the first all-reduce of ``kill_scenario(0, 0)``).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch

from unbroken.agent.worker_process import NCCL_ENVIRONMENT, survive_nccl_failures
from unbroken.config import OptimConfig
from unbroken.models import build_model
from unbroken.models.factory import bind_device, place_model
from unbroken.models.optim import build_optimizer
from unbroken.store.job_store import JobStore
from unbroken.runtime.process_group import CollectiveFailed, ViewGroup
from unbroken.runtime.state_transfer import transfer_state

pytestmark = [pytest.mark.timeout(120),
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

VOCAB = 4096


def _optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    o = OptimConfig()
    return build_optimizer(model, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, device: torch.device) -> None:
    model(torch.randint(0, VOCAB, (2, 8), device=device)).sum().backward()
    opt.step()
    opt.zero_grad()


def _assert_on(device: torch.device, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        assert t.device == device, f"{name} on {t.device}"
    for p in model.parameters():
        st = opt.state[p]
        assert st["exp_avg"].device == device and st["exp_avg_sq"].device == device
        assert st["step"].device == torch.device("cpu"), "AdamW (not fused) keeps its step count on the host"
    assert torch.cuda.current_device() == device.index


@pytest.mark.parametrize("built_on", ["standby-gpu", "cpu"])
def test_a_standbys_model_ends_on_the_device_of_the_worker_it_becomes(built_on: str):
    node, worker = 0, torch.cuda.device_count() - 1  # different GPUs wherever there are two
    where = bind_device("cuda", node) if built_on == "standby-gpu" else torch.device("cpu")
    model = build_model("debug", vocab_size=VOCAB, seq_len=8, seed=1, device=where)
    device = bind_device("cuda", worker)
    assert device == torch.device("cuda", worker)
    place_model(model, device)
    opt = _optimizer(model)
    _step(model, opt, device)
    _assert_on(device, model, opt)


def test_a_joiner_holds_the_transferred_state_on_its_device_bit_exact():
    device = bind_device("cuda", 0)
    src = build_model("debug", vocab_size=VOCAB, seq_len=8, seed=1, device=device)
    src_opt = _optimizer(src)
    for _ in range(2):
        _step(src, src_opt, device)
    sent: list[torch.Tensor] = []
    transfer_state(lambda t, s: sent.append(t.clone()), src, src_opt, src=0, rank=0, receive=False,
                   device=device, chunk_bytes=1 << 18)
    assert all(t.device == device for t in sent), "every broadcast on the group's device"
    cuda_rng = torch.cuda.get_rng_state(device)
    torch.rand(5, device=device)
    dst = build_model("debug", vocab_size=VOCAB, seq_len=8, seed=2, device=device)
    dst_opt = _optimizer(dst)
    replay = iter(sent)
    transfer_state(lambda t, s: t.copy_(next(replay)), dst, dst_opt, src=0, rank=1, receive=True,
                   device=device, chunk_bytes=1 << 18)
    assert torch.equal(torch.cuda.get_rng_state(device), cuda_rng)
    _assert_on(device, dst, dst_opt)
    for p, q in zip(src.parameters(), dst.parameters()):
        assert torch.equal(p, q) and torch.equal(src_opt.state[p]["exp_avg_sq"], dst_opt.state[q]["exp_avg_sq"])
    _step(dst, dst_opt, device)  # and it trains on from there
    _assert_on(device, dst, dst_opt)


CHILD = """
import os, signal, sys, time, torch
from unbroken.agent.worker_process import survive_nccl_failures
survive_nccl_failures()
from unbroken.store.job_store import JobStore
from unbroken.runtime.process_group import ViewGroup
port, gen, dev, die = (int(a) for a in sys.argv[1:5])
torch.cuda.set_device(dev)
store = JobStore.connect(f"127.0.0.1:{port}", timeout_s=30, secret="test")
g = ViewGroup(store.group_store(gen), gen=gen, rank=1, size=2, device=torch.device("cuda", dev), timeout_s=30)
g.allreduce(torch.ones(4, device=f"cuda:{dev}"), lambda: None)
torch.cuda.synchronize()
if die:
    time.sleep(0.5)  # rank 0 is in its all-reduce by now
    g.allreduce(torch.ones(64 << 20, device=f"cuda:{dev}"), lambda: None,
                after_post=lambda: os.kill(os.getpid(), signal.SIGKILL))
sys.stdout.flush()
os._exit(0)
"""


class PeerDied(Exception):
    pass


def kill_scenario(dev0: int, dev1: int) -> dict[str, float]:
    """Rank 0 here on ``cuda:dev0``, rank 1 a child on ``cuda:dev1`` killed mid-all-reduce; returns timings.

    Rank 0's check sees the child gone and abandons the all-reduce (or NCCL fails it first: then
    :class:`CollectiveFailed`); the group is aborted, and a new view's group with a fresh peer works.
    """
    survive_nccl_failures()
    device = bind_device("cuda", dev0)
    store = JobStore.host("127.0.0.1", 0, clients=3, secret="test")
    child = _child(store.port, 0, dev1, die=True)
    g = ViewGroup(store.group_store(0), gen=0, rank=0, size=2, device=device, timeout_s=30)
    assert torch.equal(g.allreduce(torch.ones(4, device=device), lambda: None).cpu(), torch.full((4,), 2.0))

    def check() -> None:
        if child.poll() is not None:
            raise PeerDied(f"rank 1 exited with {child.returncode}")

    t0 = time.perf_counter()
    with pytest.raises((PeerDied, CollectiveFailed)) as failed:
        g.allreduce(torch.ones(64 << 20, device=device), check)
    t_detect = time.perf_counter() - t0
    g.abandon()
    t_abort = time.perf_counter() - t0 - t_detect
    assert child.wait(30) == -9
    fresh = _child(store.port, 1, dev1, die=False)
    t1 = time.perf_counter()
    g1 = ViewGroup(store.group_store(1), gen=1, rank=0, size=2, device=device, timeout_s=30)
    got = g1.allreduce(torch.ones(4, device=device), lambda: None).cpu()
    t_new = time.perf_counter() - t1
    assert fresh.wait(60) == 0 and torch.equal(got, torch.full((4,), 2.0))
    return {"failed_with": type(failed.value).__name__, "detect_s": t_detect, "abort_s": t_abort,
            "new_group_s": t_new}


def _child(port: int, gen: int, dev: int, *, die: bool) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", CHILD, str(port), str(gen), str(dev), str(int(die))],
                            env={**os.environ, **NCCL_ENVIRONMENT})


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="NCCL needs a distinct GPU per rank")
def test_the_survivor_of_an_nccl_peer_killed_mid_all_reduce_carries_on(monkeypatch: pytest.MonkeyPatch):
    for name, value in NCCL_ENVIRONMENT.items():
        monkeypatch.setenv(name, value)
    times = kill_scenario(0, 1)
    assert times["detect_s"] < 5 and times["abort_s"] < 10
