"""A store connection after a failure: a request the store answered too late never has its answer taken for the
next request's (a real store process stopped with SIGSTOP past the client's timeout, then continued), and a
view whose rendezvous connection the store refuses fails as a view, not as the worker."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from unbroken.jsonl import JsonlWriter
from unbroken.mecefo.takeover import takeover_policy
from unbroken.store.job_store import JobStore
from unbroken.runtime.membership import Membership
from unbroken.runtime.process_group import CollectiveFailed
from unbroken.runtime.protocol import StepProtocol
from unbroken.store.backend import GROUP_CONNECT_TRIES
from unbroken.store.client import StoreClient
from unbroken.store.wire import store_key
from unbroken.store.view import View

pytestmark = pytest.mark.timeout(60)
SECRET = "the job's secret"

SERVER = """
import sys
from unbroken.store.server import StoreServer
server = StoreServer.listen("127.0.0.1", 0, sys.argv[1])
print(server.port, server.launch, flush=True)
sys.stdin.read()  # serves until the test closes its stdin
"""


@pytest.fixture()
def store_process():
    proc = subprocess.Popen([sys.executable, "-c", SERVER, SECRET], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)
    try:
        assert proc.stdout is not None
        port, launch = proc.stdout.readline().split()
        yield proc, int(port), launch
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
        proc.wait(10)


def _wait_stopped(pid: int) -> None:
    """Until every thread of ``pid`` is stopped: kill() returns before the group stop is done, and on a busy
    machine a thread woken by a request could answer it first."""
    while True:
        states = []
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                states.append((task / "stat").read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                pass  # a thread gone meanwhile
        if states and all(st in ("T", "t") for st in states):
            return
        time.sleep(0.001)


def test_an_answer_that_comes_after_the_timeout_is_never_taken_for_the_next_requests(store_process):
    proc, port, launch = store_process
    client = StoreClient("127.0.0.1", port, secret=SECRET, timeout_s=1.0)
    client.set("a", "1")
    assert client.add("n", 5) == 5
    first = client._channel
    assert first is not None
    os.kill(proc.pid, signal.SIGSTOP)  # the store's host paused: it cannot answer within any timeout
    _wait_stopped(proc.pid)
    try:
        with pytest.raises(dist.DistStoreError, match="did not answer in time"):
            client.compare_set("c", "", "late")
    finally:
        os.kill(proc.pid, signal.SIGCONT)  # it now answers the compare-and-set, on the connection given up
    assert client.get("a") == b"1", "the answer to the compare-and-set was taken for the get's"
    assert client.add("n", 100) == 105
    assert client.compare_set("a", "1", "2") == b"2"
    assert client.get("c", timeout_s=30) == b"late", "the store applied the request it answered late"
    assert client.reconnects == 1 and client.launch == launch
    assert first.sock.fileno() == -1, "the connection of the unanswered request was closed, never read again"


def test_a_store_gone_for_good_is_lost_at_once_on_the_next_request(store_process):
    proc, port, _ = store_process
    client = StoreClient("127.0.0.1", port, secret=SECRET, timeout_s=30.0)
    client.set("a", "1")
    proc.kill()
    proc.wait(10)
    for _ in range(2):  # the broken connection, then the one try at a new one (refused: nothing listens)
        with pytest.raises(dist.DistStoreError, match="lost"):
            client.get("a")
    assert client.reconnects == 0


class _Job:
    n_slots, micro_batch, device = 1, 4, torch.device("cpu")
    n_workers = n_slots
    model = optimizer = None

    def gradient_sums(self, step: int, items: list) -> torch.Tensor:
        return torch.ones(3)


def test_a_views_connection_refused_fails_that_view_and_the_next_view_forms(tmp_path: Path):
    store = JobStore.host("127.0.0.1", 0, clients=3, secret=SECRET)
    store.publish_initial(View(gen=0, members=(0,), step=0))
    addr = f"127.0.0.1:{store.port}"
    client = JobStore.connect(addr, timeout_s=20, secret=SECRET)
    m = Membership(client, 0, heartbeat_timeout_s=0.5, heartbeat_store=JobStore.connect(addr, timeout_s=20,
                                                                                         secret=SECRET))
    p = StepProtocol(m, _Job(), policy=takeover_policy("spread"), events=JsonlWriter(tmp_path / "w0.jsonl"),
                     timeout_s=20)
    server = store.backend.server
    assert server is not None
    key, server.key = server.key, store_key("another job's secret")  # every new handshake refused from now on
    try:
        with pytest.raises(CollectiveFailed, match=f"no rendezvous connection .* in {GROUP_CONNECT_TRIES} tries"):
            p.adopt(client.current_view())
        # The server counts a refusal after the refused client may already have seen it: wait for the count.
        while server.refused < GROUP_CONNECT_TRIES:
            time.sleep(0.01)
        assert server.refused == GROUP_CONNECT_TRIES, "each try was a handshake of its own"
        server.key = key
        p.reconfigure_at_start(0, "view 0's group could not connect")
        assert p.view.gen == 1 and p.view.members == (0,) and p.group is not None
        reduced, _ = p.run_step(0)
        assert reduced.tolist() == [1.0, 1.0, 1.0]
    finally:
        server.key = key
        p.views.abandon()
        store.close()
