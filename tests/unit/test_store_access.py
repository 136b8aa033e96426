"""Who can reach the job's store: only the job's host address, only with the job's secret."""

from __future__ import annotations

import os
import socket
import stat
from datetime import timedelta

import pytest
import torch.distributed as dist

from unbroken.runtime.job_store import JobStore
from unbroken.runtime.store_backend import SECRET_ENV, StoreAccessDenied, job_secret, save_secret
from unbroken.runtime.view import View
from unbroken.runtime.store_seal import Sealer


@pytest.fixture()
def store():
    s = JobStore.host("127.0.0.1", 0, clients=2, secret="the job's secret")
    s.publish_initial(View(gen=0, members=(0, 1), step=0))
    yield s
    del s


def test_the_store_listens_on_the_jobs_host_only(store):
    with socket.create_connection(("127.0.0.1", store.port), timeout=2):
        pass
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", store.port), timeout=2)


def test_a_wrong_secret_is_refused(store):
    addr = f"127.0.0.1:{store.port}"
    assert JobStore.connect(addr, timeout_s=5, secret="the job's secret").gen() == 0
    with pytest.raises(StoreAccessDenied, match="holds no job under this secret"):
        JobStore.connect(addr, timeout_s=5, secret="a guess")


def test_a_client_without_the_secret_changes_nothing(store):
    raw = dist.TCPStore("127.0.0.1", store.port, None, is_master=False, timeout=timedelta(seconds=5))
    for key, value in (("dead/1", "forged"), ("deaths", "1"), ("gen", "7"), ("failed", "forged"),
                       ("join/1", "{}"), ("done", "1")):
        raw.set(key, value)
    assert not store.is_marked_dead(1) and store.deaths() == 0
    assert store.gen() == 0 and store.failure() is None and not store.is_done()
    assert store.join_requests([0, 1]) == []
    assert raw.get("dead/1") == b"forged", "its keys exist, outside the job's namespace"


def test_the_secret_file_is_the_owners_alone(tmp_path, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    with pytest.raises(StoreAccessDenied, match=SECRET_ENV):
        job_secret(tmp_path)
    made = job_secret(tmp_path / "run", create=True)
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "secret").st_mode) == 0o600
    assert job_secret(tmp_path / "run") == made
    save_secret(tmp_path / "run", "another")
    assert job_secret(tmp_path / "run") == "another"
    assert stat.S_IMODE(os.stat(tmp_path / "run" / "secret").st_mode) == 0o600
    monkeypatch.setenv(SECRET_ENV, "from the environment")
    assert job_secret(tmp_path / "run") == "from the environment"


def test_a_group_rendezvous_never_holds_the_failure_detectors_reads(store):
    """A rendezvous blocked on a member that never arrives (a TCPStore client holds its lock for a whole wait)
    must not stall the main connection's reads: each group's rendezvous has a connection of its own."""
    import threading
    import time

    client = JobStore.connect(f"127.0.0.1:{store.port}", timeout_s=10, secret="the job's secret")
    rendezvous = client.group_store(7)
    waiting = threading.Event()

    def wait_for_a_dead_member() -> None:
        waiting.set()
        try:
            rendezvous.wait(["addr/1"], timedelta(seconds=3))
        except (RuntimeError, dist.DistStoreError):
            pass  # timed out, as it should

    thread = threading.Thread(target=wait_for_a_dead_member, daemon=True)
    thread.start()
    waiting.wait(5)
    slowest, t_end = 0.0, time.monotonic() + 0.5
    while time.monotonic() < t_end:  # the detector reads the store all along
        t0 = time.monotonic()
        client.gen()
        slowest = max(slowest, time.monotonic() - t0)
    thread.join(10)
    assert slowest < 0.5, f"a read of the store waited {slowest:.2f} s behind the rendezvous"


def test_a_client_connecting_before_the_host_wrote_the_jobs_marker_waits_for_it():
    """Node 0 hosting the store without a launcher: node 1 may connect between the store's listening and the
    job's marker; it must wait, not be told its secret is wrong."""
    import threading

    from unbroken.runtime.store_backend import READY_KEY, TCPStoreBackend, _namespace

    master = dist.TCPStore("127.0.0.1", 0, None, is_master=True, wait_for_workers=False)
    got: list[object] = []

    def connect() -> None:
        try:
            got.append(TCPStoreBackend.connect(f"127.0.0.1:{master.port}", timeout_s=20, secret="late"))
        except Exception as exc:  # noqa: BLE001 - the assertion below shows it
            got.append(exc)

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(0.5)
    assert thread.is_alive() and not got, "the client waits for the host to be ready"
    master.set(_namespace("late") + "job", Sealer("late").seal("job", "1"))  # what the host does next
    master.set(READY_KEY, "1")
    thread.join(20)
    assert isinstance(got[0], TCPStoreBackend), got
