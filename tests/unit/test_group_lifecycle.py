"""Abandoned view groups are destroyed: threads and sockets stay bounded over many view changes."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch

from unbroken.runtime import process_group
from unbroken.store.job_store import JobStore
from unbroken.runtime.process_group import ViewGroup
from unbroken.store.view import View

ROUNDS = 50

CHILD = """
import os, sys, time, torch
from unbroken.store.job_store import JobStore
from unbroken.runtime.process_group import ViewGroup
port, rounds, linger = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
store = JobStore.connect(f"127.0.0.1:{port}", timeout_s=20, secret="test")
for gen in range(rounds):
    g = ViewGroup(store.group_store(gen), gen=gen, rank=1, size=2, device=torch.device("cpu"), timeout_s=20)
    g.allreduce(torch.ones(1000), lambda: None)
    g.abandon()
time.sleep(linger)  # alive but silent: a peer's pending operation on our last group stays blocked
sys.stdout.flush()
os._exit(0)
"""


def _resources() -> tuple[int, int]:
    """Open file descriptors (sockets included) and OS threads of this process."""
    return len(os.listdir("/proc/self/fd")), len(os.listdir("/proc/self/task"))


def test_fifty_view_changes_leave_no_group_behind():
    store = JobStore.host("127.0.0.1", 0, clients=2, secret="test")
    base = store.num_keys()
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(store.port), str(ROUNDS), "0"])
    try:
        seen, groups = [], []
        for gen in range(ROUNDS):
            g = ViewGroup(store.group_store(gen), gen=gen, rank=0, size=2, device=torch.device("cpu"), timeout_s=20)
            assert torch.equal(g.allreduce(torch.ones(1000), lambda: None), torch.full((1000,), 2.0))
            g.abandon()
            groups.append(g)
            seen.append(_resources())
        # Each group's rendezvous has a connection of its own; the store's server runs in this process too
        # and closes its side of a finished connection as it notices: let it settle (a bounded poll).
        # The count after view 1 may still hold such a closing connection: the bound is no more than then.
        def bounded() -> bool:
            return all(now <= first for now, first in zip(_resources(), seen[0]))

        deadline = time.monotonic() + 10
        while not bounded() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert bounded(), f"fds and threads after view 1 {seen[0]}, after view {ROUNDS} {_resources()}"
        assert not any(g in process_group._PARKED or g.pg is not None for g in groups), "nothing was pending"
    finally:
        assert child.wait(60) == 0
    # Pruning deletes every key a view's group left (gloo's per-rank addresses, NCCL's unique id): only the
    # views this test publishes and the "pruned" mark were added.
    for gen in range(ROUNDS):
        store.backend.set(f"view/{gen}", View(gen=gen, members=(0, 1), step=0, reason="test").to_json())
        # What an NCCL group adds (no GPU here): ProcessGroupNCCL's rank 0 stores its ncclUniqueId under its
        # communicator counter, "0" for the first, in the group's store.
        store.group_store(gen).set("0", b"\0" * 128)
    assert store.prune(ROUNDS) == ROUNDS
    assert store.num_keys() == base + 1


def test_a_group_with_a_pending_operation_is_parked_then_released():
    store = JobStore.host("127.0.0.1", 0, clients=2, secret="test")
    # The peer joins view 0, all-reduces once, then stays alive without taking part in anything.
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(store.port), "1", "60"])
    try:
        g = ViewGroup(store.group_store(0), gen=0, rank=0, size=2, device=torch.device("cpu"), timeout_s=20)
        g.allreduce(torch.ones(1000), lambda: None)
        g._pending = g.pg.allreduce([torch.ones(3)])  # blocked: the peer is silent
        g.abandon()
        assert g in process_group._PARKED and g.pg is not None
        child.kill()  # fenced: its connections close, which fails the pending operation
        child.wait(30)
        with pytest.raises(RuntimeError):
            g._pending.wait()
    finally:
        child.kill()
    other = ViewGroup(store.group_store(1), gen=1, rank=0, size=1, device=torch.device("cpu"), timeout_s=5)
    other.allreduce(torch.ones(3), lambda: None)  # the next step's all-reduce, no view change needed
    assert g not in process_group._PARKED and g.pg is None, "released once its operation ended"
    other.abandon()


def test_a_construction_given_up_on_releases_what_it_built():
    """A member gives up building view 0's group (its check fires: the view changed); the peer it was
    waiting for arrives later and the construction completes in the abandoned thread: that group is
    released at once, so the peer fails fast instead of running into the timeout: in its first collective,
    or, when the release closes the connections while the peer is still meshing them, in its construction."""
    store = JobStore.host("127.0.0.1", 0, clients=2, secret="test")
    arrived = threading.Event()

    def peer(result: dict) -> None:
        arrived.wait(30)
        t0 = time.monotonic()
        try:
            g = ViewGroup(store.group_store(0), gen=0, rank=1, size=2, device=torch.device("cpu"), timeout_s=60)
            g.allreduce(torch.ones(4), lambda: None)
        except process_group.CollectiveFailed as exc:
            result["failed"] = str(exc)
        result["s"] = time.monotonic() - t0

    result: dict = {}
    thread = threading.Thread(target=peer, args=(result,), daemon=True)
    thread.start()

    def check() -> None:
        arrived.set()
        raise RuntimeError("view 1 was published")

    with pytest.raises(RuntimeError, match="view 1 was published") as given_up:
        ViewGroup(store.group_store(0), gen=0, rank=0, size=2, device=torch.device("cpu"), timeout_s=60,
                  check=check)
    thread.join(60)
    assert "failed" in result and result["s"] < 30, f"the peer's collective failed fast: {result}"
    assert given_up.value is not None  # the abandoned frame is still referenced: release did not rely on it
