"""Who can reach the job's store: only the job's host address, only with the job's secret, only its launch;
and whoever reaches the port without them (a torch TCPStore client, a raw socket that guesses, replays a
recorded connection or tampers with one) reads nothing and changes nothing."""

from __future__ import annotations

import os
import socket
import stat
import threading
import time
from datetime import timedelta

import pytest
import torch.distributed as dist

from unbroken.store.job_store import JobStore
from unbroken.store.backend import SECRET_ENV, StoreAccessDenied, job_secret, save_secret
from unbroken.store import server as store_server
from unbroken.store.server import MAX_PENDING, OK, OPS
from unbroken.store.wire import LAUNCH_ENV, LAUNCH_LEN, MAGIC, NONCE, client_handshake, pack, store_key, unpack
from unbroken.store.view import View

pytestmark = pytest.mark.timeout(60)
SECRET = "the job's secret"


@pytest.fixture()
def store():
    s = JobStore.host("127.0.0.1", 0, clients=2, secret=SECRET)
    s.publish_initial(View(gen=0, members=(0, 1), step=0))
    yield s
    s.close()


def _snapshot(store: JobStore) -> dict[str, bytes]:
    return dict(store.backend.server._data)


def test_the_store_listens_on_the_jobs_host_only(store):
    with socket.create_connection(("127.0.0.1", store.port), timeout=2):
        pass
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(("127.0.0.2", store.port), timeout=2)


def test_a_wrong_secret_or_another_launch_is_refused(store, monkeypatch):
    addr = f"127.0.0.1:{store.port}"
    assert JobStore.connect(addr, timeout_s=5, secret=SECRET).gen() == 0
    with pytest.raises(StoreAccessDenied, match="holds no job under this secret"):
        JobStore.connect(addr, timeout_s=5, secret="a guess")
    monkeypatch.setenv(LAUNCH_ENV, "0" * 32)  # a process of an earlier launch of the job
    with pytest.raises(StoreAccessDenied, match=f"serves launch {store.launch}, not this process's launch 0+"):
        JobStore.connect(addr, timeout_s=5, secret=SECRET)
    assert store.backend.server.refused == 1, "the wrong secret; the other launch never sent a proof"


def test_a_tcpstore_client_lists_nothing_and_writes_nothing(store):
    before = _snapshot(store)
    with pytest.raises((RuntimeError, dist.DistError)):
        raw = dist.TCPStore("127.0.0.1", store.port, None, is_master=False, timeout=timedelta(seconds=1))
        raw.list_keys()
        raw.set("failed", "forged")
        raw.add("deaths", 1)
    assert _snapshot(store) == before and store.failure() is None and store.deaths() == 0


def _hello(port: int) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    hello = b""
    while len(hello) < len(MAGIC) + LAUNCH_LEN + NONCE:
        hello += sock.recv(64)
    return sock, hello


def test_a_guessed_proof_is_refused_and_nothing_it_sends_afterwards_is_read(store):
    before = _snapshot(store)
    sock, hello = _hello(store.port)
    assert hello.startswith(MAGIC) and store.launch.encode() in hello, "the launch id is public, the key is not"
    sock.sendall(os.urandom(NONCE + 32))
    assert sock.recv(1) == b"\0", "refused"
    try:  # whatever follows goes nowhere: the server closed the connection
        sock.sendall(b"\x01" * 4096)
        assert sock.recv(64) == b""
    except OSError:
        pass
    sock.close()
    assert _snapshot(store) == before


class _Recorder:
    """A man in the middle on loopback: relays one client's connection to the store, records what the client
    sent, and can flip one byte of the next frame it relays."""

    def __init__(self, port: int) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port, self.target, self.sent, self.flip_next = self.listener.getsockname()[1], port, bytearray(), False
        threading.Thread(target=self._relay, daemon=True).start()

    def _relay(self) -> None:
        client, _ = self.listener.accept()
        server = socket.create_connection(("127.0.0.1", self.target))

        def pipe(src: socket.socket, dst: socket.socket, record: bool) -> None:
            while data := src.recv(65536):
                if record:
                    self.sent += data
                    if self.flip_next and len(data) > 8:
                        data = data[:-1] + bytes([data[-1] ^ 1])
                        self.flip_next = False
                dst.sendall(data)
            dst.shutdown(socket.SHUT_RDWR)  # (a close would not wake the other direction's recv)

        threading.Thread(target=pipe, args=(server, client, False), daemon=True).start()
        pipe(client, server, True)


def test_a_recorded_connection_replayed_is_refused_and_a_tampered_frame_ends_its_connection(store):
    proxy = _Recorder(store.port)
    client = JobStore.connect(f"127.0.0.1:{proxy.port}", timeout_s=5, secret=SECRET)
    client.fail("stopped: a genuine write through the recorder")
    assert store.failure() == "stopped: a genuine write through the recorder"
    store.backend.delete_key("failed")
    before = _snapshot(store)
    replay = socket.create_connection(("127.0.0.1", store.port), timeout=5)
    replay.recv(len(MAGIC) + LAUNCH_LEN + NONCE)
    replay.sendall(bytes(proxy.sent))  # the client's handshake and its write, byte for byte
    assert replay.recv(1) == b"\0", "the server's fresh nonce makes the recorded proof worthless"
    replay.close()
    assert _snapshot(store) == before, "the replayed write did not happen"
    proxy.flip_next = True
    with pytest.raises(dist.DistStoreError, match="lost"):
        client.fail("stopped: a tampered write")
    assert _snapshot(store) == before, "the tampered frame failed its tag: nothing was applied"


def test_a_flood_of_connections_is_bounded_and_the_job_still_connects(store):
    flood = [socket.create_connection(("127.0.0.1", store.port), timeout=5) for _ in range(200)]
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                late = JobStore.connect(f"127.0.0.1:{store.port}", timeout_s=5, secret=SECRET)
                break
            except (ConnectionError, StoreAccessDenied, OSError):
                assert time.monotonic() < deadline, "the job could not connect while the flood lasted"
                time.sleep(0.2)
        assert late.gen() == 0
    finally:
        for s in flood:
            s.close()


def _received(sock: socket.socket, n: int) -> bytes:
    """``sock``'s first ``n`` bytes, or fewer if the peer closed first."""
    got = b""
    while len(got) < n and (more := sock.recv(n - len(got))):
        got += more
    return got


def test_a_flood_never_drops_a_handshake_the_job_has_begun(store, monkeypatch):
    """Nothing tells the job's slow handshake from an outsider's idle connection: past the bound the newest
    connection is turned away, never one already authenticating (the job's own could be the oldest)."""
    monkeypatch.setattr(store_server, "HANDSHAKE_S", 60.0)  # the job's handshake may wait as long as this test
    hello_len = len(MAGIC) + LAUNCH_LEN + NONCE
    job = socket.create_connection(("127.0.0.1", store.port), timeout=30)
    peeked = job.recv(hello_len, socket.MSG_PEEK | socket.MSG_WAITALL)  # left for the handshake to read
    assert len(peeked) == hello_len, "admitted: its hello came"
    flood = [socket.create_connection(("127.0.0.1", store.port), timeout=30) for _ in range(2 * MAX_PENDING)]
    try:
        # Once each flood connection has its hello or is closed, the server has decided on every one of them.
        seen = [len(_received(s, hello_len)) for s in flood]
        channel, _ = client_handshake(job, store_key(SECRET), store.launch)
        channel.send(pack(OPS["add"], [b"n", b"7"]))
        assert unpack(channel.recv()) == (OK, [b"7"]), "the job's begun handshake went through the flood"
        assert seen == [hello_len] * (MAX_PENDING - 1) + [0] * (MAX_PENDING + 1), "the newest turned away"
        assert store.backend.server.turned_away == MAX_PENDING + 1
    finally:
        job.close()
        for s in flood:
            s.close()


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
    """A rendezvous blocked on a member that never arrives must not stall the main connection's reads: each
    group's rendezvous has a connection of its own."""
    client = JobStore.connect(f"127.0.0.1:{store.port}", timeout_s=10, secret=SECRET)
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
