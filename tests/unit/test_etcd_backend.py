"""The etcd backend's own contract on a real 3-member cluster: addresses, refusals, member loss, group rendezvous."""

from __future__ import annotations

import base64
import json
import socket
import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from unbroken.faults.fail_at import parse_fail_at
from unbroken.faults.store_loss import StoreFaults
from unbroken.store import etcd_backend
from unbroken.store.etcd_backend import EtcdBackend, StoreUnavailable, parse_etcd
from unbroken.store.job_store import JobStore
from unbroken.runtime.membership import Membership
from unbroken.store.view import View
from unbroken.store.backend import StoreAccessDenied

pytestmark = pytest.mark.timeout(120)


def test_addresses_parse_and_bad_ones_name_the_form():
    assert parse_etcd("etcd://a:1,b:2/jobs/x") == ([("a", 1), ("b", 2)], "/jobs/x")
    assert parse_etcd("etcd://[::1]:2379") == ([("::1", 2379)], "/unbroken")
    assert parse_etcd("etcds://a:1/p") == ([("a", 1)], "/p")
    for bad in ("etcd://", "etcd://host", "etcd://h:0", "etcd://h:1,,h:2", "h:2379", "etcds://h"):
        with pytest.raises(ValueError, match=r"etcd\[s\]://HOST:PORT\[,HOST:PORT\.\.\.\]"):
            parse_etcd(bad)


def test_an_address_nobody_answers_fails_within_the_timeout():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    t0 = time.monotonic()
    with pytest.raises(ConnectionError, match=f"store etcd://127.0.0.1:{port}: no etcd member answered within 2 s"):
        JobStore.connect(f"etcd://127.0.0.1:{port}", timeout_s=2, secret="s")
    assert time.monotonic() - t0 < 5


def test_a_job_is_refused_keys_of_another_job_and_a_wrong_secret_finds_nothing(etcd_cluster):
    first = JobStore.create_on_etcd(etcd_cluster.url, timeout_s=5, secret="same", job={"run_dir": "/runs/a"})
    try:
        with pytest.raises(ValueError, match=r'another job \(\{"run_dir": "/runs/a"\}\).*etcdctl del --prefix'):
            JobStore.create_on_etcd(etcd_cluster.url, timeout_s=5, secret="same", job={"run_dir": "/runs/b"})
        with pytest.raises(StoreAccessDenied, match="holds no job under this secret"):
            JobStore.connect(etcd_cluster.url, timeout_s=5, secret="other")
        assert JobStore.connect(etcd_cluster.url, timeout_s=5, secret="same").backend.check(["job"])
    finally:
        first.backend.clear()
    assert first.num_keys() == 0


def test_store_targets_are_checked_against_the_store(monkeypatch, tmp_path):
    (spec,) = parse_fail_at("step=3:store=1:kill")
    assert (spec.target, spec.index) == ("store", 1)
    with pytest.raises(ValueError, match="a store target takes kill only"):
        parse_fail_at("step=3:store=0:stop")
    with pytest.raises(ValueError, match="store=1 out of range; expected 0..0"):
        StoreFaults([spec], members=None, run_dir=tmp_path)
    monkeypatch.delenv("UNBROKEN_STORE_PIDS", raising=False)
    with pytest.raises(ValueError, match="set UNBROKEN_STORE_PIDS"):
        StoreFaults([spec], members=3, run_dir=tmp_path)


def test_operations_go_on_through_a_members_loss_and_adds_count_once(etcd_cluster):
    store = JobStore.create_on_etcd(etcd_cluster.url, timeout_s=10, secret="member-loss", job={"t": 1})
    victim = store.backend.cluster.current  # the member this client talks to
    try:
        assert store.backend.add("n", 5) == 5
        etcd_cluster.kill(victim)
        assert store.backend.add("n", 1) == 6, "the add moved to a live member, counted once"
        assert store.backend.compare_set("k", "", "v") == b"v"
        assert store.backend.cluster.current != victim
    finally:
        etcd_cluster.restart_member(victim)
        store.backend.clear()


def test_a_gloo_group_rendezvous_on_etcd(etcd_cluster):
    """gloo calls the Python store from C++ (two ranks in two threads of this process)."""
    backend = JobStore.create_on_etcd(etcd_cluster.url, timeout_s=10, secret="gloo", job={"t": 1}).backend
    out: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        pg = dist.ProcessGroupGloo(backend.group_store("pg/0"), r, 2, timedelta(seconds=20))
        t = torch.full((3,), float(r + 1))
        pg.allreduce([t]).wait()
        out[r] = t

    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert out[0].tolist() == out[1].tolist() == [3.0, 3.0, 3.0]
    finally:
        backend.clear()


def test_a_missing_key_waits_then_fails_as_a_store_error(etcd_cluster):
    backend = EtcdBackend(etcd_cluster.url, "wait", timeout_s=0.3)
    with pytest.raises(StoreUnavailable) as info:
        backend.get("never")
    assert isinstance(info.value, dist.DistStoreError), "callers handle it as a lost store"


def test_without_quorum_an_operation_waits_visibly_then_fails_within_its_timeout(etcd_cluster, caplog):
    """Two members of three gone: nothing can be written; the client says so and gives up at its timeout."""
    backend = JobStore.create_on_etcd(etcd_cluster.url, timeout_s=2, secret="quorum", job={"t": 1}).backend
    survivor = backend.cluster.current
    lost = [i for i in range(3) if i != survivor]
    try:
        for i in lost:
            etcd_cluster.kill(i)
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable, match="no etcd member answered with quorum for 2 s"):
            backend.compare_set("half", "", "written")
        assert time.monotonic() - t0 < 2 + 2 * 1.0 + 1, "past the timeout by at most one request"
        assert "etcd: no member answers with quorum" in caplog.text
        t0 = time.monotonic()
        with pytest.raises(StoreUnavailable):  # given up once: the clean stop that follows does not wait again
            backend.check(["job"])
        assert time.monotonic() - t0 < 1.0 + 2 * 1.0 + 0.5
    finally:
        for i in lost:
            etcd_cluster.start_member(i)
        etcd_cluster.wait_healthy(range(3), 30)
    # The cluster is whole again; the refused write either never happened or, if the survivor had logged it
    # before losing quorum, was committed whole by the new majority (etcd's ambiguous-request rule).
    assert backend.check(["job"]) and backend.compare_set("half", "", "again") in (b"again", b"written")
    backend.clear()


def test_a_silent_workers_liveness_keys_expire_by_themselves(etcd_cluster):
    """Counters under the beating client's lease: gone ~TTL after its last beat; a gone counter reads as its last
    beat again (its recent history), so it is silence, no death at once (another writer can delete keys too):
    an observer that never watched marks the worker dead once it has watched its heartbeat timeout; a later beat
    takes a new lease."""
    store = JobStore.create_on_etcd(etcd_cluster.url, timeout_s=10, secret="lease", job={"t": 1})
    beater = JobStore.connect(etcd_cluster.url, timeout_s=10, secret="lease")
    view = View(gen=0, members=(0, 1), step=0)
    try:
        store.publish_initial(view)
        beater.lease_liveness(0, 1.5)  # a whole number of seconds, at least 2: TTL 2 s
        for _ in range(3):
            beater.beat(0)
            beater.advance(0, 1)
        assert store.liveness([0]) == [(3, 3)]
        assert Membership(store, 1, heartbeat_timeout_s=30.0).dead_members(view) == set()
        t0 = time.monotonic()
        while store.backend.peek(["hb/0", "prog/0"]) != [None, None] and time.monotonic() - t0 < 10:
            time.sleep(0.1)
        assert 1.5 < time.monotonic() - t0 < 5, "expired about 2 s after the last beat"
        assert store.heartbeats([0]) == [3] and store.liveness([0]) == [(3, 3)], "the last beat, from the history"
        observer = Membership(store, 1, heartbeat_timeout_s=1.0)
        assert observer.dead_members(view) == set(), "gone is silence, not a death at once"
        looked = time.monotonic()
        while observer.dead_members(view) == set():
            time.sleep(0.05)
        assert time.monotonic() - looked >= 1.0
        mark = json.loads(store.dead_mark(0))
        assert (mark["by"], mark["how"]) == (1, "heartbeat") and mark["silent_s"] >= 1.0
        assert beater.beat(0) == 4 and store.heartbeats([0]) == [4], "a new lease once it beats again, counting on"
    finally:
        store.backend.clear()


def _markers(backend: EtcdBackend) -> list[str]:
    """The adders' markers under the job's namespace (keys the job itself never lists)."""
    out = backend.call("kv/range", {"key": backend.prefixed(""), "range_end": backend.prefixed("\xff"), "keys_only": True})
    keys = [base64.b64decode(kv["key"]).decode()[len(backend.ns):] for kv in out.get("kvs", [])]
    return [k for k in keys if "\x00" in k]


def test_a_gone_clients_markers_vanish_and_its_counts_stay(etcd_cluster, monkeypatch):
    """Each adder's marker lives under its lease: once the client is gone (a killed worker, a standby that
    took over), etcd deletes its markers by itself; the counts it made stay, and its own later adds
    still count once."""
    monkeypatch.setattr(etcd_backend, "MARKER_TTL_S", 2)
    store = JobStore.create_on_etcd(etcd_cluster.url, timeout_s=10, secret="markers", job={"t": 1})
    try:
        gone = [JobStore.connect(etcd_cluster.url, timeout_s=10, secret="markers") for _ in range(3)]
        for i, client in enumerate(gone):
            assert client.mark_dead(i, f"worker {i} was killed")
            client.backend.add("joins", 1)
            client.standby_beat(0)
        assert store.deaths() == 3 and len(_markers(store.backend)) == 9
        t0 = time.monotonic()
        while _markers(store.backend) and time.monotonic() - t0 < 15:
            time.sleep(0.2)
        assert _markers(store.backend) == [], "the markers of clients gone for their lease's TTL are deleted"
        assert 1.5 < time.monotonic() - t0 < 10
        assert store.deaths() == 3 and store.backend.add("joins", 0) == 3 and store.standby_beat(0, 0) == 3
        assert gone[0].mark_dead(7, "again") and store.deaths() == 4, "an idle client's next add takes a new lease"
    finally:
        store.backend.clear()


def test_an_add_whose_create_landed_unsealed_with_its_answer_lost_counts_once(etcd_cluster):
    """A counter's create is sealed for the revision its writer guesses; a wrong guess is put right by a second
    write. When the create's answer is lost (the member timed out after applying it) and the client sends it
    again, the resend finds the key moved and the marker says the create landed: unsealed, so every other
    adder would read it as absent and count from 0. It is sealed where it stands: the next adder counts 2."""
    store = JobStore.create_on_etcd(etcd_cluster.url, timeout_s=10, secret="lost-create", job={"t": 1})
    try:
        other = JobStore.connect(etcd_cluster.url, timeout_s=10, secret="lost-create")
        backend, cluster = store.backend, store.backend.cluster
        send, lost = cluster.call, []

        def call(path: str, payload: dict) -> dict:
            puts = [op["request_put"]["key"] for op in payload.get("success", []) if "request_put" in op]
            if path == "kv/txn" and backend.prefixed("arrive/9") in puts and not lost:
                other.backend.set("elsewhere", "x")  # the store moves on: the create's guess is wrong
                lost.append(send(path, payload))  # applied; its answer never arrives
            return send(path, payload)  # ... and the request is sent again

        cluster.call = call
        assert backend.add("arrive/9", 1) == 1 and lost[0].get("succeeded"), "the first send applied the create"
        cluster.call = send
        assert other.backend.add("arrive/9", 1) == 2, "the create that landed counts"
        assert store.arrived(9) == 2 and other.arrived(9) == 2

        # Another adder writes over the unsealed create before the resend (it counted from 0): added again.
        def call_raced(path: str, payload: dict) -> dict:
            puts = [op["request_put"]["key"] for op in payload.get("success", []) if "request_put" in op]
            if path == "kv/txn" and backend.prefixed("arrive/8") in puts and len(lost) == 1:
                other.backend.set("elsewhere", "y")
                lost.append(send(path, payload))
                assert other.backend.add("arrive/8", 1) == 1
            return send(path, payload)

        cluster.call = call_raced
        assert backend.add("arrive/8", 1) == 2 and lost[1].get("succeeded")
        cluster.call = send
        assert store.arrived(8) == 2 and other.backend.add("arrive/8", 1) == 3
    finally:
        store.backend.clear()
