"""A real job under an attacker who reaches its store's port all through the run: nothing changes.

The attacker tries everything a local process can: a torch ``TCPStore`` client that lists the keys and
writes ``failed``, ``done``, dead marks, views and counter adds (as in the attack that stopped a job at step
141 before the store authenticated its clients); raw connections that guess the proof; the byte stream of a
genuine connection it recorded (a client holding the secret wrote ``failed`` through the attacker's relay),
replayed again and again; and bursts of idle connections. The 2-node x 1-worker job ends as every scenario
must (:func:`_faults.check_invariants`) with no failure at all, and every attempt of the attacker was
refused. On etcd, where anyone with access to the cluster can write, a 2-node x 2-worker job goes on through
forged, replayed and deleted counters, decision keys, views, items and rendezvous keys (:class:`EtcdAttacker`).
"""

from __future__ import annotations

import base64
import os
import socket
import threading
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist
from _faults import check_invariants, failover_config, run_job

from unbroken.store.job_store import JobStore
from unbroken.store.backend import job_secret
from unbroken.store.wire import LAUNCH_LEN, MAGIC, NONCE

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

STEPS = 40
HELLO = len(MAGIC) + LAUNCH_LEN + NONCE


class Attacker:
    """Every technique, in turn, until stopped; counts what it tried and what got through."""

    def __init__(self, port: int, recorded: bytes) -> None:
        self.port, self.recorded = port, recorded
        self.tried = {"tcpstore": 0, "guess": 0, "replay": 0, "flood": 0}
        self.accepted = 0
        self.stop = threading.Event()

    def run(self) -> None:
        while not self.stop.is_set():
            self._tcpstore()
            self._guess()
            self._replay()
            self._flood()
            self.stop.wait(0.05)

    def _tcpstore(self) -> None:
        self.tried["tcpstore"] += 1
        try:
            raw = dist.TCPStore("127.0.0.1", self.port, None, is_master=False, timeout=timedelta(seconds=0.5))
            raw.list_keys()
            for key, value in (("failed", "forged: stop"), ("done", "1"), ("dead/0", "{}"), ("gen", "9")):
                raw.set(key, value)
            raw.add("deaths", 1)
            self.accepted += 1
        except (RuntimeError, dist.DistError):
            pass

    def _refused(self, payload: bytes) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=2) as s:
                got = b""
                while len(got) < HELLO:
                    chunk = s.recv(HELLO - len(got))
                    if not chunk:
                        return True
                    got += chunk
                s.sendall(payload)
                return s.recv(1) != b"\1"
        except OSError:
            return True

    def _guess(self) -> None:
        self.tried["guess"] += 1
        self.accepted += not self._refused(os.urandom(NONCE + 32) + b"\0" * 64)

    def _replay(self) -> None:
        self.tried["replay"] += 1
        self.accepted += not self._refused(self.recorded)

    def _flood(self) -> None:
        self.tried["flood"] += 1
        socks = []
        try:
            for _ in range(80):
                socks.append(socket.create_connection(("127.0.0.1", self.port), timeout=2))
        except OSError:
            pass
        for s in socks:
            s.close()


def _record_a_genuine_connection(port: int, secret: str) -> bytes:
    """What a genuine client (holding the secret) sends when it writes a key: recorded by a relay."""
    listener = socket.create_server(("127.0.0.1", 0))
    sent = bytearray()

    def relay() -> None:
        client, _ = listener.accept()
        server = socket.create_connection(("127.0.0.1", port))

        def back() -> None:
            while data := server.recv(65536):
                client.sendall(data)
            client.shutdown(socket.SHUT_RDWR)

        threading.Thread(target=back, daemon=True).start()
        while data := client.recv(65536):
            sent.extend(data)
            server.sendall(data)
        server.shutdown(socket.SHUT_RDWR)

    thread = threading.Thread(target=relay, daemon=True)
    thread.start()
    genuine = JobStore.connect(f"127.0.0.1:{listener.getsockname()[1]}", timeout_s=10, secret=secret)
    genuine.backend.set("attacker/probe", "a genuine write")  # a key the job never reads
    genuine.close()
    thread.join(10)
    return bytes(sent)


def test_an_attacker_who_reaches_the_port_changes_nothing(tmp_path, corpus_overrides):
    run_dir = tmp_path / "run"
    cfg = failover_config(corpus_overrides, STEPS)
    attackers: list[tuple[Attacker, threading.Thread]] = []

    def on_event(e: dict) -> None:
        if e.get("event") == "view_adopted" and not attackers:  # the job is up: attack its store from now on
            port = int(next((run_dir / "logs").glob("w0.log")).read_text().split("--store 127.0.0.1:")[1].split()[0])
            attacker = Attacker(port, _record_a_genuine_connection(port, job_secret(run_dir)))
            thread = threading.Thread(target=attacker.run, daemon=True)
            thread.start()
            attackers.append((attacker, thread))

    try:
        job = run_job(cfg, run_dir, nodes=2, workers_per_node=1, on_event=on_event)
    finally:
        for attacker, thread in attackers:
            attacker.stop.set()
            thread.join(30)
    check_invariants(job, live=[0, 1])
    assert job.summary["failures"] == 0, "the attack made no worker fail"
    assert not job.events("attempt_aborted") and not job.events("worker_exit", clean=False)
    [(attacker, _)] = attackers
    assert all(n > 0 for n in attacker.tried.values()), attacker.tried
    assert attacker.accepted == 0, "no attempt of the attacker was ever accepted"


class EtcdAttacker:
    """A client of the job's etcd cluster without the job's secret: it finds the job's keys by listing the
    cluster, and after every write of the job to a worker's counter it writes a forged value over it, except
    every ``EVERY``-th time, when it deletes the counter or writes back the counter's first value after a delete;
    it also plants forged death marks, refusals and ``deaths`` counts. Three attacks run until what each needs
    has happened (the job's sealed payloads are readable, so it follows the job's applied steps):

    - the victim's counters are deleted after every one of its beats from the job's ``FROM``-th applied step
      until ``STEPS - UNTIL_LEFT`` are applied (no sign of life in the store all that time: before the failure
      detector counted completed collectives, a death);
    - ``gen`` is deleted after every write until it was brought back ``BACK`` times;
    - ``outcome/<g>`` is deleted after every ``OUTCOME_EVERY``-th decision until it was brought back ``BACK``
      times (before, the voters waited and the job stopped after the store timeout).

    Paced by the job's own writes, so whatever the machine's speed it answers each of them. Another thread of it
    (:meth:`run_write_once`) deletes every view, items and rendezvous key (``view/``, ``items/``, ``pg/``) right
    after each write of the job there, all through the run, the view change of a worker's loss included
    (before, their readers waited for a key written and deleted before they read it, and the job stopped after
    the store timeout)."""

    ACTIONS = ("forge", "replay", "delete")
    EVERY = 8
    FROM, UNTIL_LEFT = 3, 20
    OUTCOME_EVERY = 4
    BACK = 3

    def __init__(self, url: str, workers: list[int], victim: int) -> None:
        from unbroken.store.etcd_backend import EtcdBackend

        self.backend = EtcdBackend(url, "not the job's secret", timeout_s=10)
        self.workers, self.victim = workers, victim
        self.done = {a: 0 for a in (*self.ACTIONS, "plant", "victim", "gen", "outcome")}
        self.back = {"gen": 0, "outcome": 0}  # the decision keys the job brought back after a delete
        self.victim_window = [False, False]  # the victim deletions began, ended
        self.first: dict[str, bytes] = {}
        self.last: dict[str, str] = {}  # key -> mod_revision of the job's write the attacker answered last
        self.decisions = 0
        self.deleted_at: dict[str, int] = {}  # decision key -> the revision of the attacker's last delete
        self.stop = threading.Event()
        self.ns = ""
        self.write_once = EtcdBackend(url, "not the job's secret", timeout_s=10)  # its own client, for its thread
        self.deleted: dict[str, int] = {"view": 0, "items": 0, "pg": 0}  # the job's writes deleted, per kind

    def _k(self, key: str) -> str:
        return base64.b64encode((self.ns + key).encode()).decode()

    def _kv(self, key: str) -> dict | None:
        return (self.backend.call("kv/range", {"key": self._k(key)}).get("kvs") or [None])[0]

    def _put(self, key: str, raw: bytes, *, create: bool = False) -> None:
        put = {"request_put": {"key": self._k(key), "value": base64.b64encode(raw).decode()}}
        guard = [{"key": self._k(key), "target": "CREATE", "result": "EQUAL", "create_revision": "0"}] if create else []
        self.backend.call("kv/txn", {"compare": guard, "success": [put], "failure": []})

    def _delete(self, key: str) -> None:
        self.backend.call("kv/deleterange", {"key": self._k(key)})

    def _find_namespace(self) -> None:
        out = self.backend.call("kv/range", {"key": base64.b64encode(b"/unbroken/").decode(),
                                              "range_end": base64.b64encode(b"/unbroken0").decode(), "keys_only": True})
        for kv in out.get("kvs", []):
            key = base64.b64decode(kv["key"]).decode(errors="replace")
            if key.endswith("/hb/0"):
                self.ns = key[:-len("hb/0")]

    @staticmethod
    def _payload(kv: dict | None) -> bytes | None:
        """What the job wrote (a seal hides nothing: it is 32 bytes of version, creation and tag at the end)."""
        raw = base64.b64decode(kv["value"]) if kv is not None and kv.get("value") else b""
        return raw[:-32] if len(raw) >= 32 else None

    def _applied(self) -> int:
        payload = self._payload(self._kv("applied/0"))
        return int(payload) if payload is not None and payload.isdigit() else 0

    def run(self) -> None:
        while not self.stop.is_set():
            if not self.ns:
                self._find_namespace()
            else:
                applied = self._applied()
                self.victim_window[0] |= applied >= self.FROM
                # Over once view 0 is (its applied steps pruned: the job moved to another view).
                self.victim_window[1] |= applied >= STEPS_ETCD - self.UNTIL_LEFT or (self.victim_window[0]
                                                                                     and self._kv("applied/0") is None)
                for w in self.workers:
                    for key in (f"hb/{w}", f"prog/{w}"):
                        self._answer(key, victim=w == self.victim and self.victim_window[0]
                                     and not self.victim_window[1])
                    self._put(f"dead/{w}", b'{"by": 9, "how": "forged"}', create=True)
                    self._put(f"refused/{w}", b"forged refusal", create=True)
                    self._put("deaths", b"1000")
                    self.done["plant"] += 1
                self._decision("gen")
                self._decision("outcome/0")
            self.stop.wait(0.01)

    def run_write_once(self) -> None:
        """Delete every ``view/``, ``items/`` and ``pg/`` key of the job as soon as it is written (one read of the
        three prefixes every few milliseconds: the job's readers poll every 2 to 50 ms)."""
        answered: set[tuple[str, str]] = set()
        while not self.stop.is_set():
            if self.ns:
                ranges = [{"request_range": {"key": self._k(p), "range_end": self._k(p[:-1] + "0"),
                                             "keys_only": True}} for p in ("view/", "items/", "pg/")]
                out = self.write_once.call("kv/txn", {"compare": [], "success": ranges, "failure": []})
                for kvs in (r.get("response_range", {}).get("kvs", []) for r in out.get("responses", [])):
                    for kv in kvs:
                        if (kv["key"], kv["mod_revision"]) in answered:
                            continue
                        answered.add((kv["key"], kv["mod_revision"]))
                        self.write_once.call("kv/deleterange", {"key": kv["key"]})
                        kind = base64.b64decode(kv["key"]).decode()[len(self.ns):].partition("/")[0]
                        self.deleted[kind] += 1
            self.stop.wait(0.003)

    def _fresh(self, key: str) -> dict | None:
        """The key's kv if the job wrote it since the attacker's last look (None: gone, seen, or its own)."""
        kv = self._kv(key)
        if kv is None or kv["mod_revision"] == self.last.get(key) or self._payload(kv) is None:
            return None
        self.last[key] = kv["mod_revision"]
        return kv

    def _decision(self, key: str) -> None:
        """Delete a decision key after the job's writes until the job brought it back ``BACK`` times (a creation
        of the key after the attacker's delete: nothing else of the job creates it again)."""
        name = key.partition("/")[0]
        if self.back[name] >= self.BACK or (kv := self._fresh(key)) is None:
            return
        if key in self.deleted_at:
            self.back[name] += int(kv["create_revision"]) > self.deleted_at.pop(key)
        elif name == "outcome":
            self.decisions += 1
            if self.decisions % self.OUTCOME_EVERY:
                return
        self.deleted_at[key] = int(self.backend.call("kv/deleterange", {"key": self._k(key)})["header"]["revision"])
        self.done[name] += 1

    def _answer(self, key: str, *, victim: bool) -> None:
        """One action on ``key`` if the job wrote it since the attacker's last one: the victim's, a delete."""
        kv = self._fresh(key)
        if kv is None or len(base64.b64decode(kv["value"])) < 24:
            return  # gone, already answered, or not the job's value (the attacker's own)
        self.first.setdefault(key, base64.b64decode(kv["value"]))
        if victim:
            self._delete(key)
            self.done["victim"] += 1
            return
        n = sum(self.done[a] for a in self.ACTIONS)
        action = "forge" if n % self.EVERY else ("replay", "delete")[n // self.EVERY % 2]
        if action == "forge":
            self._put(key, b"99")
        else:
            self._delete(key)
            if action == "replay":
                self._put(key, self.first[key], create=True)
        self.done[action] += 1


STEPS_ETCD = 80
KILL = 62
"""Worker 1 is killed at step ``KILL`` (once the victim's window is over): a view change, its view, items and
rendezvous keys deleted right after they are written."""


def test_a_writer_without_the_secret_on_etcd_never_fences_a_live_worker(tmp_path, corpus_overrides, etcd_cluster):
    """A 2-node x 2-worker job on a real 3-member etcd cluster while :class:`EtcdAttacker` deletes, forges and
    replays its workers' counters after every beat, deletes one worker's counters after every beat for most of
    the run, deletes ``gen`` and ``outcome/0`` until each was brought back three times, plants death marks, and
    deletes every view, items and rendezvous key right after it is written, through worker 1's kill at step
    ``KILL`` and the view change that follows: the job ends as every scenario must
    (:func:`_faults.check_invariants`: every step, the ledger exactly once, identical parameters), no live
    worker is marked dead or fenced, and the attacker did every kind of thing."""
    cfg = failover_config(corpus_overrides, STEPS_ETCD, "fault.heartbeat_timeout_s=2.5",
                          "fault.progress_timeout_s=6.0", "train.timeout_s=30")
    attacker = EtcdAttacker(etcd_cluster.url, [0, 1, 2, 3], victim=3)
    threads = [threading.Thread(target=attacker.run, daemon=True),
               threading.Thread(target=attacker.run_write_once, daemon=True)]
    for thread in threads:
        thread.start()
    try:
        job = run_job(cfg, tmp_path / "run", nodes=2, workers_per_node=2, store=etcd_cluster.url,
                      fail_at=f"step={KILL}:worker=1:kill:phase=forward")
    finally:
        attacker.stop.set()
        for thread in threads:
            thread.join(30)
    check_invariants(job, live=[0, 2, 3])
    assert job.summary["failures"] == 1, "the planned kill only"
    assert not job.events("fence"), "no live worker fenced"
    assert {e["step"] for e in job.events("attempt_aborted")} <= {KILL}, "no attempt aborted but the kill's"
    assert [e["worker"] for e in job.events("worker_exit", clean=False)] == [1]
    marks = [line for log in (job.run_dir / "logs").glob("w*.log") for line in log.read_text().splitlines()
             if "declared worker" in line and "declared worker 1 dead" not in line]
    assert not marks, "no live worker was marked dead, not even once the job was done"
    assert attacker.victim_window == [True, True], "the victim's counters deleted from step 3 to step 60"
    assert attacker.back == {"gen": 3, "outcome": 3}, "gen and outcome/0 each brought back three times"
    assert all(n >= 3 for n in attacker.done.values()), attacker.done
    assert attacker.deleted["view"] >= 2 and attacker.deleted["items"] >= 3 and attacker.deleted["pg"] >= 7, \
        f"every view, member's items and rank's rendezvous key deleted right after written: {attacker.deleted}"
    assert _read_from_history(job.run_dir), "a reader read a deleted key from its etcd history"


def _read_from_history(run_dir: Path) -> int:
    """How many of the job's processes' logs say they read a key another writer deleted from its history."""
    return sum("read from its etcd history" in log.read_text() for log in (run_dir / "logs").glob("*.log"))
