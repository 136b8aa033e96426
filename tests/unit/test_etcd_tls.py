"""``--store etcds://``: the job's store on an etcd member that speaks TLS only and asks every client for a
certificate signed by its CA (``--client-cert-auth``). Certificates are made here with ``openssl``; the member
runs on loopback."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest

from unbroken.store.job_store import JobStore
from unbroken.store.backend import ETCD_TLS_ENV
from unbroken.store.view import View

pytest.importorskip("etcd3gw", reason="the etcd client is not installed: pip install 'unbroken[etcd]'")
pytestmark = pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl to make certificates")


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


def _ca(d: Path, name: str) -> None:
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-subj", f"/CN={name}",
             "-keyout", f"{name}.key", "-out", f"{name}.pem", cwd=d)


def _signed(d: Path, name: str, ca: str, *, server: bool) -> None:
    ext = d / f"{name}.ext"
    # A member's certificate serves clients and is also its own client (etcd's JSON gateway calls the member's
    # gRPC with it), as etcd's guide says to make them.
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n" + (
        "extendedKeyUsage=serverAuth,clientAuth\n" if server else "extendedKeyUsage=clientAuth\n"))
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", f"/CN={name}", "-keyout", f"{name}.key",
             "-out", f"{name}.csr", cwd=d)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key", "-CAcreateserial",
             "-days", "2", "-extfile", ext.name, "-out", f"{name}.pem", cwd=d)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def tls_etcd(tmp_path_factory):
    from unbroken.store.local_etcd import EtcdNotFound, etcd_binary

    try:
        binary = etcd_binary()
    except EtcdNotFound as exc:
        pytest.skip(str(exc))
    d = tmp_path_factory.mktemp("tls")
    _ca(d, "ca")
    _ca(d, "other-ca")
    _signed(d, "server", "ca", server=True)
    _signed(d, "client", "ca", server=False)
    _signed(d, "stranger", "other-ca", server=False)
    client, peer = _free_port(), _free_port()
    proc = subprocess.Popen([
        binary, "--name", "tls0", "--data-dir", str(d / "data"),
        "--listen-client-urls", f"https://127.0.0.1:{client}", "--advertise-client-urls", f"https://127.0.0.1:{client}",
        "--listen-peer-urls", f"http://127.0.0.1:{peer}", "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
        "--initial-cluster", f"tls0=http://127.0.0.1:{peer}",
        "--cert-file", str(d / "server.pem"), "--key-file", str(d / "server.key"),
        "--client-cert-auth", "--trusted-ca-file", str(d / "ca.pem"),
        "--logger", "zap", "--log-outputs", str(d / "etcd.log")], stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the port accepts once the member serves
        assert proc.poll() is None, f"etcd exited: {(d / 'etcd.log').read_text()[-2000:] if (d / 'etcd.log').exists() else ''}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", client)) == 0:
                break
        time.sleep(0.05)
    yield d, f"127.0.0.1:{client}"
    proc.kill()
    proc.wait(10)


def _use(monkeypatch, d: Path, who: str, ca: str = "ca") -> None:
    monkeypatch.setenv(ETCD_TLS_ENV["ca"], str(d / f"{ca}.pem"))
    monkeypatch.setenv(ETCD_TLS_ENV["cert"], str(d / f"{who}.pem"))
    monkeypatch.setenv(ETCD_TLS_ENV["key"], str(d / f"{who}.key"))


def test_a_job_runs_its_store_over_tls_with_a_client_certificate(tls_etcd, monkeypatch):
    d, hostport = tls_etcd
    _use(monkeypatch, d, "client")
    addr = f"etcds://{hostport}/tls-test"
    host = JobStore.create_on_etcd(addr, timeout_s=20, secret="s", job={"run_dir": "/tmp/x"})
    store = JobStore.connect(addr, timeout_s=20, secret="s")
    view = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(view)
    assert host.current_view() == view and store.beat(1) == 1 and host.heartbeats([1]) == [1]


def test_clients_without_a_certificate_of_the_ca_are_refused(tls_etcd, monkeypatch):
    d, hostport = tls_etcd
    with pytest.raises(ValueError, match="UNBROKEN_ETCD_CA is not set; UNBROKEN_ETCD_CERT is not set"):
        JobStore.connect(f"etcds://{hostport}", timeout_s=2, secret="s")
    _use(monkeypatch, d, "stranger")  # a certificate of another CA: the member refuses the handshake
    with pytest.raises(ConnectionError, match="no etcd member answered"):
        JobStore.connect(f"etcds://{hostport}", timeout_s=2, secret="s")
    with pytest.raises(ConnectionError, match="no etcd member answered"):  # plain HTTP to a TLS port
        JobStore.connect(f"etcd://{hostport}", timeout_s=2, secret="s")
