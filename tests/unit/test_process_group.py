"""ViewGroup on a real two-rank gloo group: this process is rank 0, a child process rank 1."""

from __future__ import annotations

import subprocess
import sys
import time
import weakref

import torch

from unbroken.store.job_store import JobStore
from unbroken.runtime.process_group import ViewGroup

CHILD = """
import os, sys, time, torch, torch.distributed as dist
from datetime import timedelta
from unbroken.store.job_store import JobStore
from unbroken.runtime.process_group import ViewGroup
port, late = int(sys.argv[1]), float(sys.argv[2])
store = JobStore.connect(f"127.0.0.1:{port}", timeout_s=20, secret="test")
g = ViewGroup(store.group_store(0), gen=0, rank=1, size=2, device=torch.device("cpu"), timeout_s=20)
g.allreduce(torch.full((5,), 2.0), lambda: None)  # each a new tensor: the sum lands in it
if late == 0:
    g.allreduce(torch.full((5,), 20.0), lambda: None)
time.sleep(late)
g.allreduce(torch.full((5,), 2.0), lambda: None)
sys.stdout.flush()
os._exit(0)  # like a worker: no teardown of live gloo pairs, whose threads abort the process when destroyed
"""


class Abandon(Exception):
    pass


def _rank0(late_s: float) -> tuple[ViewGroup, subprocess.Popen[bytes]]:
    store = JobStore.host("127.0.0.1", 0, clients=2, secret="test")
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(store.port), str(late_s)])
    g = ViewGroup(store.group_store(0), gen=0, rank=0, size=2, device=torch.device("cpu"), timeout_s=20)
    g.store = store  # keep the store (and the child's connection) alive as long as the group
    return g, child


def test_allreduce_sums_in_place_into_the_callers_tensor_with_no_copy():
    """No second gradient-sized buffer: the sum lands in the tensor passed (each step passes a new one)."""
    g, child = _rank0(0)
    try:
        x = torch.full((5,), 1.0)
        a = g.allreduce(x, lambda: None)
        y = torch.full((5,), 10.0)
        b = g.allreduce(y, lambda: None)
        g.allreduce(torch.full((5,), 1.0), lambda: None)
    finally:
        assert child.wait(30) == 0
    assert a.data_ptr() == x.data_ptr() and torch.equal(x, torch.full((5,), 3.0)), "summed in the caller's tensor"
    assert b.data_ptr() == y.data_ptr() and torch.equal(y, torch.full((5,), 30.0))


def test_a_collective_missing_a_member_is_abandoned_by_the_check():
    """Rank 1 joins the second all-reduce 2 s late: rank 0's check (the failure detector) gives up first."""
    g, child = _rank0(2.0)
    try:
        g.allreduce(torch.ones(5), lambda: None)
        t0 = time.monotonic()

        def check() -> None:
            if time.monotonic() - t0 > 0.2:
                raise Abandon("member 1 judged dead")

        try:
            g.allreduce(torch.ones(5), check)
            raised = None
        except Abandon as exc:
            raised = exc
        g.abandon()
        assert raised is not None and time.monotonic() - t0 < 1.5
    finally:
        assert child.wait(30) == 0  # its late all-reduce completes the abandoned one: nothing is left blocked


def test_a_group_of_one_needs_no_peer():
    store = JobStore.host("127.0.0.1", 0, clients=1, secret="test")
    g = ViewGroup(store.group_store(0), gen=0, rank=0, size=1, device=torch.device("cpu"), timeout_s=5)
    x = torch.arange(4.0)
    y = g.allreduce(x, lambda: None)
    assert y is x or (torch.equal(y, x) and y.data_ptr() == x.data_ptr()), "a sum of one is not copied"
    assert torch.equal(x, torch.arange(4.0)), "the tensor is left untouched"


GATHER_CHILD = """
import os, sys, time, torch
from unbroken.store.job_store import JobStore
from unbroken.runtime.process_group import ViewGroup
port = int(sys.argv[1])
store = JobStore.connect(f"127.0.0.1:{port}", timeout_s=20, secret="test")
g = ViewGroup(store.group_store(0), gen=0, rank=1, size=2, device=torch.device("cpu"), timeout_s=20)
while store.backend.add("given up", 0) < 1:  # joins the all-gather only once rank 0 gave up on it
    time.sleep(0.005)
g.allgather(torch.tensor([7.0, 8.0]), 3, lambda: None)
sys.stdout.flush()
os._exit(0)
"""


def test_an_all_gather_given_up_on_may_still_complete_late():
    """Rank 0 gives up on its all-gather (a false alarm: rank 1 was only late); once rank 1 takes part, the
    all-gather completes after all, and its output is every rank's shard (a sharded step can be applied)."""
    store = JobStore.host("127.0.0.1", 0, clients=2, secret="test")
    child = subprocess.Popen([sys.executable, "-c", GATHER_CHILD, str(store.port)])
    try:
        g = ViewGroup(store.group_store(0), gen=0, rank=0, size=2, device=torch.device("cpu"), timeout_s=20)
        t0 = time.monotonic()

        def check() -> None:
            if time.monotonic() - t0 > 0.2:
                raise Abandon("member 1 judged dead")

        try:
            g.allgather(torch.tensor([1.0, 2.0, 3.0]), 3, check)
            raised = None
        except Abandon as exc:
            raised = exc
        assert raised is not None
        assert g.late_gather(0.0) is None, "not completed yet: rank 1 has not taken part"
        store.backend.add("given up", 1)
        out = g.late_gather(15.0)
        assert out is not None and torch.equal(out, torch.tensor([1.0, 2.0, 3.0, 7.0, 8.0, 0.0]))
        assert g.late_gather(0.0) is None, "a late result is handed out once"
    finally:
        assert child.wait(30) == 0


STEPS_CHILD = """
import os, sys, torch
from unbroken.store.job_store import JobStore
from unbroken.runtime.process_group import ViewGroup
port = int(sys.argv[1])
store = JobStore.connect(f"127.0.0.1:{port}", timeout_s=20, secret="test")
g = ViewGroup(store.group_store(0), gen=0, rank=1, size=2, device=torch.device("cpu"), timeout_s=20)
for step in range(3):
    g.allreduce(torch.full((6,), 2.0), lambda: None)
    g.allgather(torch.tensor([7.0, 8.0]), 3, lambda: None)
sys.stdout.flush()
os._exit(0)
"""


def _released(refs: list[weakref.ref[torch.Tensor]], within_s: float = 10.0) -> bool:
    """Whether every tensor of ``refs`` dies: gloo's worker thread drops its own reference to a collective
    (and so to its tensors) just after marking it completed, so this waits for that, bounded; a tensor
    something else keeps never dies."""
    deadline = time.monotonic() + within_s
    while any(r() is not None for r in refs) and time.monotonic() < deadline:
        time.sleep(0.001)
    return all(r() is None for r in refs)


def test_a_completed_steps_buffers_die_with_the_callers_last_reference():
    """Two members, three steps of an all-reduce then an all-gather (ZeRO-1's step): once a step's collectives
    completed and the caller dropped their outputs, nothing of them is left alive, before the next step
    allocates its own. (A group keeping its last reduction would hold a second gradient-sized buffer through
    every step: 4.4 GB at 1B parameters.)"""
    store = JobStore.host("127.0.0.1", 0, clients=2, secret="test")
    child = subprocess.Popen([sys.executable, "-c", STEPS_CHILD, str(store.port)])
    try:
        g = ViewGroup(store.group_store(0), gen=0, rank=0, size=2, device=torch.device("cpu"), timeout_s=20)
        before: list[weakref.ref[torch.Tensor]] = []
        for step in range(3):
            assert _released(before), f"step {step - 1}'s buffers outlived it"
            reduced = g.allreduce(torch.full((6,), 1.0), lambda: None)
            gathered = g.allgather(torch.tensor([1.0, 2.0, 3.0]), 3, lambda: None)
            assert torch.equal(reduced, torch.full((6,), 3.0))
            assert torch.equal(gathered, torch.tensor([1.0, 2.0, 3.0, 7.0, 8.0, 0.0]))
            before = [weakref.ref(reduced), weakref.ref(gathered)]
            del reduced, gathered  # the step is applied: its caller lets go
        assert _released(before), "the last step's buffers outlived it"
    except BaseException:
        child.kill()  # it would wait for this member's next collective until its timeout
        child.wait(30)
        raise
    assert child.wait(30) == 0
