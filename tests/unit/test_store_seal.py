"""A writer with access to the job's etcd cluster but without the job's secret (another holder of a client
certificate of the same CA, or anyone on a plain etcd:// port) changes nothing the job acts on: its values,
forged or replayed, are read as absent, replaced where the job writes, counted and reported; a key that holds
nothing else for longer than the store timeout stops the job naming it; another launch's values are never
read; plain etcd:// to another host needs --store-insecure."""

from __future__ import annotations

import base64
import json
import logging
import threading
import time

import pytest
import torch
import torch.distributed as dist

from unbroken.store.etcd_backend import EtcdBackend
from unbroken.store.etcd_history import RESTORED
from unbroken.store.etcd_client import INSECURE_ENV, StoreUnavailable
from unbroken.store.job_store import JobStore, StoreKeyLost
from unbroken.runtime.membership import Membership
from unbroken.runtime.process_group import ViewGroup
from unbroken.store.seal import PENDING_S, SEEN_KEYS, Sealer
from unbroken.store.wire import LAUNCH_ENV
from unbroken.store.view import View

pytestmark = pytest.mark.timeout(120)
SECRET = "the job's secret"


@pytest.fixture()
def store(etcd_cluster, request):
    s = JobStore.create_on_etcd(etcd_cluster.url, timeout_s=10, secret=SECRET, job={"run_dir": request.node.name})
    yield s
    s.backend.clear()


class Writer:
    """A client of the cluster with write access and no secret: it writes raw values under the job's keys."""

    def __init__(self, store: JobStore) -> None:
        self.backend: EtcdBackend = store.backend  # type: ignore[assignment]

    def put(self, key: str, value: bytes | str) -> None:
        raw = value.encode() if isinstance(value, str) else value
        self.backend.call("kv/put", {"key": self.backend.prefixed(key), "value": base64.b64encode(raw).decode()})

    def plant(self, key: str, value: bytes | str) -> None:
        """Write where the key is absent (overwriting an authentic value erases it: a denial of service, like
        deleting keys, that seals do not claim to stop)."""
        raw = value.encode() if isinstance(value, str) else value
        k = self.backend.prefixed(key)
        self.backend.txn([{"key": k, "target": "CREATE", "result": "EQUAL", "create_revision": "0"}],
                          [{"request_put": {"key": k, "value": base64.b64encode(raw).decode()}}], [])

    def delete(self, key: str) -> None:
        self.backend.call("kv/deleterange", {"key": self.backend.prefixed(key)})

    def replay(self, key: str, recorded: bytes) -> None:
        """Delete the key and write ``recorded`` (its first value) there: the key's version is 1 again."""
        self.delete(key)
        self.plant(key, recorded)

    def raw(self, key: str) -> bytes:
        out = self.backend.call("kv/range", {"key": self.backend.prefixed(key)})
        return base64.b64decode(out["kvs"][0]["value"])


def _connect(etcd_cluster) -> JobStore:
    return JobStore.connect(etcd_cluster.url, timeout_s=10, secret=SECRET)


def test_forged_values_of_every_kind_change_nothing(store, etcd_cluster, caplog):
    view0 = View(gen=0, members=(0, 1, 2), step=0)
    store.publish_initial(view0)
    store.beat(1)
    store.beat(1)
    attacker = Writer(store)
    forged = {
        "view/1": View(gen=1, members=(2,), step=0, reason="forged").to_json(),  # a view dropping 0 and 1
        "dead/0": '{"by": 2, "how": "forged"}',  # kill a live worker
        "done": "1",  # end the job
        "failed": "forged failure",  # fail the job
        "config": '{"forged": true}',
        "progress": "999",
        "join/2": '{"pid": 1}',  # ask for the training state
        "hb/1": "0",  # a counter set back
    }
    with caplog.at_level(logging.WARNING):
        for key, value in forged.items():
            attacker.put(key, value)
        other = _connect(etcd_cluster)
        for s in (store, other):  # one client that wrote before, one that never did
            for _ in range(3):
                assert s.gen() == 0 and s.current_view() == view0
                assert not s.is_marked_dead(0) and s.dead_mark(0) is None
                assert not s.is_done() and s.failure() is None and not s.finished()
                assert s.config() is None and s.progress() == 0 and s.join_request(2) is None  # not the forged 999
        assert store.heartbeats([1]) == [2], "a forged heartbeat reads as the last authentic one before it"
        assert store.beat(1) == 3, "and the next beat goes on from the authentic count"
        assert store.heartbeats([1]) == [3]
    reports = [r.getMessage() for r in caplog.records if "not written by this launch" in r.getMessage()]
    # Once per key and client: six keys read by both, hb/1 by one; view/1 by none (gen still says 0).
    assert len(reports) == 13 and len(set(reports)) == 7
    assert store.backend.sealer.bad["done"] >= 3, "and every read of it counted"
    # The job writes over forged values: they are replaced, not obeyed.
    winner = store.propose(view0, View(gen=1, members=(0, 1), step=0, reason="dead [2]"))
    assert winner.members == (0, 1) and store.gen() == 1 and store.current_view() == winner
    assert store.mark_dead(0, '{"by": 1, "how": "heartbeat"}') and other.is_marked_dead(0)
    store.set_done()
    assert store.is_done() and other.is_done()
    assert store.agree_config('{"real": 1}') == '{"real": 1}'


def test_a_recorded_value_replayed_is_rejected(store, etcd_cluster):
    """The writer records the job's sealed ``progress`` of step 5 and writes it back after step 9: the value
    was sealed for the key's first version and now sits at its third; every reader rejects it."""
    store.set_progress(5)
    attacker = Writer(store)
    recorded = attacker.raw("progress")
    store.set_progress(9)
    attacker.put("progress", recorded)
    assert store.progress() is None and _connect(etcd_cluster).progress() is None
    assert store.backend.sealer.bad["progress"] >= 1
    store.set_progress(10)
    assert store.progress() == 10


def test_a_first_value_replayed_after_a_delete_never_splits_a_decision(store, etcd_cluster):
    """Member A votes ``commit`` for view 0's first step; the writer deletes ``outcome/0`` and ``gen`` and writes
    back their first values ("-1:commit" and "0", recorded before): member B's ``abort`` must not win, B brings
    the key back with A's decision from its history and reads ``commit``; ``gen`` comes back as 1, never 0. The
    same replays of ``dead/1`` and ``refused/2`` read as absent to every reader."""
    view = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(view)
    attacker = Writer(store)
    first = {k: attacker.raw(k) for k in ("outcome/0", "gen")}
    b = _connect(etcd_cluster)
    assert store.vote(view, 0, "commit", after=-1) == "commit"
    store.propose(view, View(gen=1, members=(0, 1), step=1))
    assert store.mark_dead(1, "first") and b.is_marked_dead(1)
    first["dead/1"] = attacker.raw("dead/1")
    store.clear_dead(1)
    store.refuse_join(2, "refused once")
    first["refused/2"] = attacker.raw("refused/2")
    store.request_join(2, {"pid": 1})  # deletes the refusal
    for key, raw in first.items():
        attacker.replay(key, raw)
    b.set_store_timeout(1.0)
    assert b.vote(view, 0, "abort", after=-1) == "commit", "the decision A read, brought back"
    for reader in (store, b, _connect(etcd_cluster)):
        assert reader.decided(0) == 0 and reader.gen() == 1
        assert not reader.is_marked_dead(1) and reader.join_refusal(2) is None
    store.publish_initial(view)  # a late initial publication never sends the job back to generation 0
    assert _connect(etcd_cluster).gen() == 1


def test_a_deleted_outcome_or_gen_is_a_delay_and_only_the_original_decision_comes_back(store, etcd_cluster):
    """The writer deletes ``outcome/0`` after step 3 committed and ``gen`` after view 1 was proposed: the next
    reader brings each back with the newest value the job wrote (a vote goes on, ``gen`` reads 1). A restore that
    raced a later decision (its value older than what the key's history holds, here written directly) is read
    as absent by every reader and brought back again with the newer decision; so is a forged value."""
    view = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(view)
    attacker = Writer(store)
    for step in range(4):
        assert store.vote(view, step, "commit") == "commit"
    attacker.delete("outcome/0")
    b = _connect(etcd_cluster)
    assert b.vote(view, 3, "abort") == "commit" and b.vote(view, 4, "commit") == "commit"
    attacker.delete("outcome/0")
    stale = _connect(etcd_cluster)
    stale.backend.write_sealed("outcome/0", None, RESTORED + b"2:commit")  # a restore that lost a race to step 4
    for reader in (store, b, _connect(etcd_cluster)):
        assert reader.decided(0) == 4, "a restored value older than the key's history is never read"
    attacker.put("outcome/0", "9:abort")
    assert store.vote(view, 5, "abort") == "abort" and b.decided(0) == 5
    attacker.put("outcome/0", "9:commit")  # over the job's values of this creation of the key: brought back there
    assert b.decided(0) == 5 and store.decided(0) == 5 and _connect(etcd_cluster).decided(0) == 5
    v1 = store.propose(view, View(gen=1, members=(0, 1), step=6))
    attacker.delete("gen")
    assert _connect(etcd_cluster).gen() == 1 == b.gen()
    attacker.delete("gen")
    v2 = b.propose(v1, View(gen=2, members=(0,), step=6))  # its proposer brings gen back, then moves it on
    assert v2.gen == 2 and store.gen() == 2 and store.current_view() == v2


def test_a_deleted_outcome_key_is_no_fence_but_a_pruned_one_is(store, etcd_cluster):
    """A vote whose outcome key another writer deleted never reads "stale", which fences the voter: it brings
    the key back from its history, or, where the history is compacted away, waits and stops past the store
    timeout naming the key; once ``pruned`` says the view is gone, "stale" is right."""
    view = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(view)
    attacker = Writer(store)
    attacker.delete("outcome/0")
    assert store.vote(view, 0, "commit", after=-1) == "commit"
    attacker.delete("outcome/0")
    store.backend.call("kv/compaction", {"revision": str(store.backend.call("kv/range", {"key": store.backend.prefixed(
        "job")})["header"]["revision"]), "physical": True})
    store.set_store_timeout(0.5)
    with pytest.raises(StoreKeyLost, match=r"outcome/0.*deleted or overwrote it"):
        store.vote(view, 1, "commit")
    store.propose(view, View(gen=1, members=(0, 1), step=0))
    assert store.prune(1) == 1
    assert _connect(etcd_cluster).vote(view, 0, "commit", after=-1) == "stale"


def test_deleted_and_forged_counters_never_kill_a_live_worker_nor_hide_a_silent_one(store, etcd_cluster):
    """Between worker 1's beats the writer forges its counters, replays their recorded first values after a
    delete, and deletes them: an observer never marks it dead (no single read kills, and its beats are
    changes). Once it stops beating, the writer forging its counters all along cannot keep it alive: the
    observer marks it dead a heartbeat timeout after the last authentic change it saw."""
    view = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(view)
    attacker = Writer(store)
    recorded = {k: attacker.raw(k) for k in ("hb/1", "prog/1")}
    worker = _connect(etcd_cluster)
    worker.lease_liveness(1, 10.0)
    observer = Membership(store, 0, heartbeat_timeout_s=10.0, progress_timeout_s=10.0)
    for i in range(10):
        worker.beat(1)
        worker.advance(1, 1)
        assert observer.dead_members(view) == set()
        for key in ("hb/1", "prog/1"):
            [attacker.put, attacker.replay, lambda k, _: attacker.delete(k)][i % 3](key, recorded[key])
        assert observer.dead_members(view) == set(), f"a live worker judged dead on {i % 3}"
    assert not store.is_marked_dead(1)
    stop = threading.Event()

    def forge() -> None:
        while not stop.is_set():
            attacker.put("hb/1", "99")
            attacker.put("prog/1", "99")
            attacker.replay("hb/1", recorded["hb/1"])
            stop.wait(0.01)

    forger = threading.Thread(target=forge)
    forger.start()
    try:
        watcher = Membership(store, 0, heartbeat_timeout_s=1.0, progress_timeout_s=1.0)
        t0 = time.monotonic()
        while watcher.dead_members(view) == set() and time.monotonic() - t0 < 20:
            time.sleep(0.05)
    finally:
        stop.set()
        forger.join(5)
    assert watcher.dead_members(view) == {1}, "a silent worker hidden by forged counters"
    mark = json.loads(store.dead_mark(1))
    assert mark["how"] in ("heartbeat", "no progress") and mark["silent_s"] >= 1.0


def test_counters_deleted_after_every_beat_never_fence_a_worker_its_peers_complete_collectives_with(
        store, etcd_cluster):
    """The writer deletes worker 1's counters after each of its beats for three heartbeat timeouts, so the
    observer never reads them (a silence, on the counters alone); but every step the observer completes a
    reduction with worker 1, which needed it, and that keeps it alive. Once worker 1 is lost (no beats, no
    collective completes) while the writer goes on, the observer declares it dead."""
    view = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(view)
    attacker = Writer(store)
    worker = _connect(etcd_cluster)
    worker.lease_liveness(1, 10.0)
    observer = Membership(store, 0, heartbeat_timeout_s=1.0, progress_timeout_s=1.0)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.0:  # until the counters alone would have been silent for three timeouts
        worker.beat(1)
        worker.advance(1, 1)
        for key in ("hb/1", "prog/1"):
            attacker.delete(key)
        observer.completed_with((1,))  # this step's reduction with worker 1 completed
        assert observer.dead_members(view) == set(), "a worker whose collectives complete judged dead"
        time.sleep(0.02)  # pacing: one step
    assert not store.is_marked_dead(1)
    deadline = time.monotonic() + 30
    while observer.dead_members(view) == set() and time.monotonic() < deadline:  # lost: nothing completes
        attacker.delete("hb/1")
        attacker.plant("prog/1", "99")
        time.sleep(0.02)
    assert observer.dead_members(view) == {1}, "a lost worker hidden by the writer"
    assert json.loads(store.dead_mark(1))["silent_s"] >= 1.0


def test_counters_deleted_after_every_beat_are_read_back_from_their_history_outside_collectives(
        store, etcd_cluster):
    """No collective completes (the members wait for the final checkpoint, say) while the writer deletes worker
    1's counters after each of its beats for three heartbeat timeouts: the observer reads each deleted counter's
    newest beat back from its history and never judges worker 1 silent. Once it stops beating, the deletions hide
    nothing: it is declared dead."""
    view = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(view)
    attacker = Writer(store)
    worker = _connect(etcd_cluster)
    worker.lease_liveness(1, 10.0)
    observer = Membership(store, 0, heartbeat_timeout_s=1.0, progress_timeout_s=1.0)
    t0 = time.monotonic()
    while time.monotonic() - t0 < 3.0:  # until the counters alone would have been gone for three timeouts
        worker.beat(1)
        worker.advance(1, 1)
        for key in ("hb/1", "prog/1"):
            attacker.delete(key)
        assert observer.dead_members(view) == set(), "a beating worker whose counters are deleted judged dead"
        time.sleep(0.02)  # pacing: one beat
    assert not store.is_marked_dead(1)
    deadline = time.monotonic() + 30
    while observer.dead_members(view) == set() and time.monotonic() < deadline:  # lost
        attacker.delete("hb/1")
        attacker.delete("prog/1")
        time.sleep(0.02)
    assert observer.dead_members(view) == {1}, "a lost worker hidden by the writer"
    assert json.loads(store.dead_mark(1))["silent_s"] >= 1.0


def test_a_key_holding_only_forged_values_past_the_store_timeout_stops_the_job_naming_it(store):
    store.publish_initial(View(gen=0, members=(0,), step=0))
    store.set_store_timeout(1.0)
    Writer(store).put("items/0/0", "[0, []]")
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match=r"items/0/0.* has held only values not written by this launch "
                                                r".*etcd user of its own"):
        store.backend.get("items/0/0")
    assert 1.0 <= time.monotonic() - t0 < 6


def test_an_earlier_launch_of_the_job_is_never_read(store, etcd_cluster, monkeypatch, request):
    """The same secret launched again (a resume, or a user's fixed UNBROKEN_JOB_SECRET): the new launch has keys
    of its own; what a process of the earlier launch writes (``failed``, ``done``) never reaches it."""
    store.publish_initial(View(gen=0, members=(0,), step=0))
    old = _connect(etcd_cluster)
    relaunch = JobStore.create_on_etcd(etcd_cluster.url, timeout_s=10, secret=SECRET,
                                       job={"run_dir": request.node.name})
    try:
        assert relaunch.backend.launch != store.backend.launch
        fresh = _connect(etcd_cluster)
        assert fresh.backend.launch == relaunch.backend.launch, "a process that starts now joins the new launch"
        old.fail("stopped: the earlier launch's failure")
        old.set_done()
        assert relaunch.failure() is None and not relaunch.is_done() and not fresh.finished()
        monkeypatch.setenv(LAUNCH_ENV, store.backend.launch)  # a process of the earlier launch, pinned to it
        assert _connect(etcd_cluster).is_done(), "it sees its own launch only"
    finally:
        relaunch.backend.clear()


def test_another_job_with_the_same_secret_is_refused(store, etcd_cluster):
    with pytest.raises(ValueError, match="already holds the keys of another job"):
        JobStore.create_on_etcd(etcd_cluster.url, timeout_s=10, secret=SECRET, job={"run_dir": "/elsewhere"})


def test_plain_etcd_to_another_host_needs_store_insecure(monkeypatch):
    monkeypatch.delenv(INSECURE_ENV, raising=False)
    with pytest.raises(ValueError, match=r"plain etcd:// to 10\.1\.2\.3:2379 .* etcds:// .* --store-insecure"):
        EtcdBackend("etcd://127.0.0.1:2379,10.1.2.3:2379", SECRET, timeout_s=1)
    EtcdBackend("etcd://127.0.0.1:2379,[::1]:2379,localhost:2379", SECRET, timeout_s=1)  # loopback: fine
    EtcdBackend("etcd://10.1.2.3:2379", SECRET, timeout_s=1, insecure=True)
    monkeypatch.setenv(INSECURE_ENV, "1")
    EtcdBackend("etcd://10.1.2.3:2379", SECRET, timeout_s=1)


def test_a_live_workers_counters_rewritten_faster_than_it_beats_never_make_it_look_silent(store, etcd_cluster):
    """Worker 1 beats and advances every 100 ms; the writer rewrites both counters every 10 ms, so a reader
    mostly finds forged values. Forged reads are no observation: the reader (heartbeat timeout 0.5 s, no
    progress limit 0.5 s) never judges the live worker silent."""
    view = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(view)
    attacker = Writer(store)
    writer = _connect(etcd_cluster)
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            writer.beat(1)
            writer.advance(1, 1)
            stop.wait(0.1)

    def forge() -> None:
        while not stop.is_set():
            attacker.put("hb/1", "0")
            attacker.put("prog/1", "0")
            stop.wait(0.01)

    threads = [threading.Thread(target=beat), threading.Thread(target=forge)]
    for t in threads:
        t.start()
    try:
        reader = Membership(store, 0, heartbeat_timeout_s=0.5, progress_timeout_s=0.5)
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:
            assert reader.dead_members(view) == set(), "a live worker judged dead on forged counters"
            time.sleep(0.05)
    finally:
        stop.set()
        for t in threads:
            t.join(5)
    assert not store.is_marked_dead(1)


def test_a_forged_rendezvous_address_is_never_used(store):
    """Two ranks build a gloo group on the job's rendezvous store while the writer keeps planting garbage in both
    ranks' address keys wherever they are absent: the group forms with the authentic addresses and
    all-reduces."""
    attacker = Writer(store)
    stop = threading.Event()

    def forge() -> None:
        while not stop.is_set():
            for r in (0, 1):
                try:
                    attacker.plant(f"pg/0/0/{r}", b"\x00" * 64)
                except dist.DistStoreError:
                    pass
            stop.wait(0.02)

    thread = threading.Thread(target=forge, daemon=True)
    thread.start()
    out: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        g = ViewGroup(store.group_store(0), gen=0, rank=r, size=2, device=torch.device("cpu"), timeout_s=20)
        out[r] = g.allreduce(torch.full((4,), float(r + 1)), lambda: None).clone()
        g.abandon()

    try:
        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        stop.set()
        thread.join(5)
    assert torch.equal(out[0], torch.full((4,), 3.0)) and torch.equal(out[1], torch.full((4,), 3.0))


def test_a_seal_covers_the_key_the_version_the_creation_and_the_value():
    sealer = Sealer(b"k" * 32)
    sealed = sealer.seal("dead/1", "x", 4, 10)
    assert sealer.open("dead/1", sealed, 4, 10) == b"x"
    assert sealer.open("dead/2", sealed, 4, 10) is None, "moved to another key"
    assert sealer.open("dead/1", sealed, 5, 10) is None, "written again: a later version than sealed for"
    assert sealer.open("dead/1", sealed, 4, 11) is None, "the key deleted and created again"
    assert sealer.open("dead/1", b"y" + sealed[1:], 4, 10) is None, "another value"
    assert Sealer(b"o" * 32).open("dead/1", sealed, 4, 10) is None, "another launch's or job's key"
    assert sealer.open("dead/1", b"", 1, 10) is None


def test_a_first_value_replayed_into_the_key_created_again_opens_for_no_reader():
    """A key's first value (version 1, created at revision 7) written back after a delete sits at version 1 of
    a key created later: rejected by a reader that saw the key before and by one that never did; a create that
    lost its guess of the revision is not reported until it stayed ``PENDING_S``, a replay then is."""
    writer, fresh = Sealer(b"k" * 32), Sealer(b"k" * 32)
    first = writer.seal("outcome/3", "4:commit", 1, 7)
    assert writer.open("outcome/3", first, 1, 7) == b"4:commit"
    assert writer.open("outcome/3", writer.seal("outcome/3", "5:commit", 2, 7), 2, 7) == b"5:commit"
    assert writer.open("outcome/3", first, 1, 12) is None and fresh.open("outcome/3", first, 1, 12) is None
    assert fresh.bad == {}, "not reported at once: a create being written again looks the same"
    fresh.bad_since["outcome/3"] -= PENDING_S
    assert fresh.open("outcome/3", first, 1, 12) is None and fresh.bad == {"outcome/3": 1}
    assert fresh.open("outcome/3", writer.seal("outcome/3", "4:commit", 2, 12), 2, 12) == b"4:commit"


def test_a_readers_records_are_bounded():
    sealer = Sealer(b"k" * 32)
    for i in range(3 * SEEN_KEYS):
        assert sealer.open(f"view/{i}", sealer.seal(f"view/{i}", "v", 1, i + 1), 1, i + 1) == b"v"
        assert sealer.open(f"items/{i}", b"forged", 1, i + 1) is None
    assert len(sealer.seen) <= SEEN_KEYS and len(sealer.bad) <= SEEN_KEYS and len(sealer.bad_since) <= SEEN_KEYS
