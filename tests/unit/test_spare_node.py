"""A spare node's wait: it takes the first node whose agent and workers are gone, never a live one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from unbroken.agent.rendezvous import StartRefused, wait_for_lost_node
from unbroken.store.job_store import JobStore


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


@pytest.fixture()
def store():
    s = JobStore.host("127.0.0.1", 0, clients=3, secret="test")
    yield s
    del s


def _wait(store: JobStore, tmp_path, **kwargs) -> int | None:
    return wait_for_lost_node(store, nnodes=3, workers_per_node=2, pid_dir=tmp_path,
                              interrupted=kwargs.pop("interrupted", lambda: False), **kwargs)


def test_takes_the_node_whose_agent_and_workers_are_known_dead(store, tmp_path):
    here = socket.gethostname()
    store.claim_node(0, f"{here}:{os.getpid()}:a")  # alive: this process
    store.claim_node(1, f"{here}:{_dead_pid()}:b")  # its agent is gone ...
    (tmp_path / "w2").write_text(f"{os.getpid()}\n")  # ... but one of its workers still runs
    (tmp_path / "w3").write_text(f"{_dead_pid()}\n")
    store.claim_node(2, f"{here}:{os.getpid()}:c")
    found: list[int | None] = []
    waiter = threading.Thread(target=lambda: found.append(_wait(store, tmp_path, silence_s=60)))
    waiter.start()
    time.sleep(0.3)  # a bounded look: nothing is taken while node 1's worker 2 lives
    assert not found
    (tmp_path / "w2").write_text(f"{_dead_pid()}\n")
    waiter.join(10)
    assert found == [1]


def test_a_node_given_back_or_silent_on_another_machine_is_taken(store, tmp_path):
    store.claim_node(0, f"{socket.gethostname()}:{os.getpid()}:a")
    store.claim_node(1, "other-host:123:b")  # another machine's: only its silence tells
    store.claim_node(2, f"{socket.gethostname()}:{os.getpid()}:c")
    for node in (0, 2):
        store.agent_beat(node)
    t0 = time.monotonic()
    stop = threading.Event()

    def beat() -> None:  # nodes 0 and 2 keep beating; node 1 never does
        while not stop.is_set():
            store.agent_beat(0)
            store.agent_beat(2)
            time.sleep(0.05)

    beater = threading.Thread(target=beat)
    beater.start()
    try:
        assert _wait(store, tmp_path, silence_s=0.5) == 1
        assert time.monotonic() - t0 >= 0.5
    finally:
        stop.set()
        beater.join()
    store.release_node(0, f"{socket.gethostname()}:{os.getpid()}:a")
    assert _wait(store, tmp_path, silence_s=60) == 0, "a rank given back is free"


def test_nodes_not_yet_registered_are_not_lost_and_the_end_frees_the_spare(store, tmp_path):
    store.claim_node(0, f"{socket.gethostname()}:{os.getpid()}:a")
    store.set_done()
    assert _wait(store, tmp_path, silence_s=0.1) is None


def test_an_interrupted_spare_stops_waiting(store, tmp_path):
    store.claim_node(0, f"{socket.gethostname()}:{os.getpid()}:a")
    with pytest.raises(StartRefused, match="interrupted"):
        _wait(store, tmp_path, silence_s=60, interrupted=lambda: True)
