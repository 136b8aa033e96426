"""The state transfer over a real two-rank gloo group: this process is rank 0, a child process rank 1.

Rank 0 sends a trained state to the child, which loads it and sends it back into a fresh model
here: what comes back is bit-exact (parameters, moments, steps, RNG), and it crossed in chunks
no larger than asked. A source that dies mid-transfer fails the receiver's broadcast.
"""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from unbroken.config import OptimConfig
from unbroken.models import build_model
from unbroken.models.optim import build_optimizer
from unbroken.store.job_store import JobStore
from unbroken.runtime.process_group import CollectiveFailed, ViewGroup
from unbroken.runtime.state_transfer import transfer_state

pytestmark = pytest.mark.timeout(90)

CPU = torch.device("cpu")
VOCAB = 4096  # embeddings and output of 1 MiB each: they cross in place, the rest packed
CHUNK = 256 << 10

CHILD = """
import os, sys, torch
from unbroken.config import OptimConfig
from unbroken.models import build_model
from unbroken.models.optim import build_optimizer
from unbroken.store.job_store import JobStore
from unbroken.runtime.process_group import ViewGroup
from unbroken.runtime.state_transfer import transfer_state
port, chunk, die_after = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
store = JobStore.connect(f"127.0.0.1:{port}", timeout_s=20, secret="test")
g = ViewGroup(store.group_store(0), gen=0, rank=1, size=2, device=torch.device("cpu"), timeout_s=20)
model = build_model("debug", vocab_size=4096, seq_len=8, seed=2)
o = OptimConfig()
opt = build_optimizer(model, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
sent = 0
def cast(t, src):
    global sent
    if die_after and sent == die_after:
        os._exit(9)  # a source lost mid-transfer
    sent += 1
    g.broadcast_into(t, src, lambda: None)
if not die_after:
    transfer_state(cast, model, opt, src=0, rank=1, receive=True, device=torch.device("cpu"), chunk_bytes=chunk)
transfer_state(cast, model, opt, src=1, rank=1, receive=False, device=torch.device("cpu"), chunk_bytes=chunk)
sys.stdout.flush()
os._exit(0)  # like a worker: no teardown of live gloo pairs
"""


def _optimizer(model: torch.nn.Module) -> torch.optim.AdamW:
    o = OptimConfig()
    return build_optimizer(model, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)


def _trained(seed: int):
    model = build_model("debug", vocab_size=VOCAB, seq_len=8, seed=seed)
    opt = _optimizer(model)
    for _ in range(3):
        model(torch.randint(0, VOCAB, (2, 8))).sum().backward()
        opt.step()
        opt.zero_grad()
    return model, opt


class Counted:
    """``ViewGroup.broadcast_into`` with the sizes of every broadcast recorded."""

    def __init__(self, group: ViewGroup) -> None:
        self.group, self.sizes = group, []

    def __call__(self, t: torch.Tensor, src: int) -> torch.Tensor:
        self.sizes.append(t.numel() * t.element_size())
        return self.group.broadcast_into(t, src, lambda: None)


def _pair(die_after: int) -> tuple[ViewGroup, subprocess.Popen[bytes]]:
    store = JobStore.host("127.0.0.1", 0, clients=2, secret="test")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(store.port), str(CHUNK), str(die_after)])
    g = ViewGroup(store.group_store(0), gen=0, rank=0, size=2, device=CPU, timeout_s=20)
    g.store = store  # keep the store (and the child's connection) alive as long as the group
    return g, child


def test_state_goes_to_a_joiner_and_comes_back_bit_exact_in_bounded_chunks():
    torch.manual_seed(0)
    model, opt = _trained(1)
    rng = torch.get_rng_state()
    g, child = _pair(0)
    try:
        out = Counted(g)
        sent = transfer_state(out, model, opt, src=0, rank=0, receive=False, device=CPU, chunk_bytes=CHUNK)
        torch.rand(11)  # this process's RNG moves on; the one coming back is the one sent
        back_model = build_model("debug", vocab_size=VOCAB, seq_len=8, seed=7)
        back_opt = _optimizer(back_model)
        back = Counted(g)
        got = transfer_state(back, back_model, back_opt, src=1, rank=0, receive=True, device=CPU,
                             chunk_bytes=CHUNK)
    finally:
        assert child.wait(60) == 0
    state_bytes = sum(p.nbytes + sum(t.nbytes for t in opt.state[p].values()) for p in model.parameters())
    groups = 2 * (8 + 16 + 8 + 8)  # lr, betas, eps, weight decay of AdamW's two groups
    assert sent.bytes == got.bytes == state_bytes + groups + rng.nbytes, "each tensor once, in its own dtype"
    assert len(out.sizes) == sent.broadcasts + 2, "the header (length, JSON) and then the state"
    assert max(out.sizes[2:]) <= CHUNK and sent.broadcasts >= -(-sent.bytes // CHUNK) > 20
    assert sent.buffer_bytes <= CHUNK and got.buffer_bytes <= CHUNK
    assert out.sizes == back.sizes
    assert torch.equal(torch.get_rng_state(), rng)
    for p, q in zip(model.parameters(), back_model.parameters()):
        assert torch.equal(p, q)
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.equal(opt.state[p][key], back_opt.state[q][key]), key
    assert float(back_opt.state[next(back_model.parameters())]["step"]) == 3.0


def test_a_source_lost_mid_transfer_fails_the_receivers_broadcast():
    model = build_model("debug", vocab_size=VOCAB, seq_len=8, seed=3)
    opt = _optimizer(model)
    g, child = _pair(5)
    try:
        with pytest.raises(CollectiveFailed, match="broadcast"):
            transfer_state(lambda t, src: g.broadcast_into(t, src, lambda: None), model, opt, src=1, rank=0,
                           receive=True, device=CPU, chunk_bytes=CHUNK)
        g.abandon()
    finally:
        assert child.wait(60) == 9


STALLING_SOURCE = """
import os, sys, time, torch
from pathlib import Path
from unbroken.config import OptimConfig
from unbroken.models import build_model
from unbroken.models.optim import build_optimizer
from unbroken.store.job_store import JobStore
from unbroken.runtime.process_group import ViewGroup
from unbroken.runtime.state_transfer import transfer_state
port, stall_at, marks = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])
store = JobStore.connect(f"127.0.0.1:{port}", timeout_s=20, secret="test")
g = ViewGroup(store.group_store(0), gen=0, rank=1, size=2, device=torch.device("cpu"), timeout_s=20)
model = build_model("debug", vocab_size=4096, seq_len=8, seed=2)
o = OptimConfig()
opt = build_optimizer(model, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
sent = 0
def cast(t, src):
    global sent
    if sent == stall_at:  # a source that stops mid-transfer (judged dead meanwhile), then goes on
        (marks / "stalled").touch()
        while not (marks / "go").exists():
            time.sleep(0.01)
    g.broadcast_into(t, src, lambda: None)
    if sent == stall_at:
        (marks / "sent").touch()
    sent += 1
transfer_state(cast, model, opt, src=1, rank=1, receive=False, device=torch.device("cpu"), chunk_bytes=1 << 18)
os._exit(0)
"""


def test_an_abandoned_transfers_late_bytes_never_land_in_the_live_state(tmp_path):
    """The source stalls in the first in-place slice of the embeddings; the joiner gives up on it (its
    detector raises) and abandons the transfer, then trains on (its parameters change); the source comes back
    and its broadcast completes into what the joiner posted. The joiner's parameters stay its own: every
    receive goes into the transfer's own buffer first, copied into the state only once it completed."""
    store = JobStore.host("127.0.0.1", 0, clients=2, secret="test")
    child = subprocess.Popen([sys.executable, "-c", STALLING_SOURCE, str(store.port), "2", str(tmp_path)])
    g = ViewGroup(store.group_store(0), gen=0, rank=0, size=2, device=CPU, timeout_s=20)
    model = build_model("debug", vocab_size=VOCAB, seq_len=8, seed=3)
    opt = _optimizer(model)
    stalled = tmp_path / "stalled"

    def detector() -> None:
        if stalled.exists() and time.time() - stalled.stat().st_mtime > 0.3:
            raise CollectiveFailed("the source is judged dead")

    try:
        with pytest.raises(CollectiveFailed, match="judged dead"):
            transfer_state(lambda t, src: g.broadcast_into(t, src, detector), model, opt, src=1, rank=0,
                           receive=True, device=CPU, chunk_bytes=1 << 18)
        pending = g._pending
        assert pending is not None, "the receive of the stalled slice is still posted"
        g.abandon()
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(7.0)  # what the joiner trains on afterwards (a later view, a new state)
        (tmp_path / "go").touch()
        pending.wait()  # the late broadcast completed into what was posted
        assert all(bool((p == 7.0).all()) for p in model.parameters()), "late bytes landed in the live state"
    finally:
        child.kill()
        child.wait(30)
        store.close()
