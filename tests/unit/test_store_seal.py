"""An attacker who knows the job's namespace (``TCPStore.list_keys`` shows it) and writes every kind of key
changes nothing the job acts on: values without the job's seal are read as absent, tombstoned where the
job writes, and never make a worker dead, a job done or failed, a view current, or a peer's address."""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from unbroken.runtime.job_store import JobStore
from unbroken.runtime.membership import Membership
from unbroken.runtime.process_group import ViewGroup
from unbroken.runtime.store_seal import Sealer
from unbroken.runtime.view import View


@pytest.fixture()
def store():
    s = JobStore.host("127.0.0.1", 0, clients=4, secret="the job's secret")
    yield s
    del s


def _attacker(store: JobStore) -> tuple[dist.TCPStore, str]:
    """A raw client of the store's port, and the job's namespace (which it can list)."""
    raw = dist.TCPStore("127.0.0.1", store.port, None, is_master=False, timeout=timedelta(seconds=10))
    return raw, store.backend.ns


def test_forged_values_of_every_kind_change_nothing(store):
    view0 = View(gen=0, members=(0, 1, 2), step=0)
    store.publish_initial(view0)
    store.beat(1)
    store.beat(1)
    raw, ns = _attacker(store)
    forged = {
        "view/1": View(gen=1, members=(2,), step=0, reason="forged").to_json(),  # a view dropping 0 and 1
        "dead/0": '{"by": 2, "how": "forged"}',  # kill a live worker
        "done": "1",  # end the job
        "failed": "forged failure",  # fail the job
        "outcome/0": "0:commit",  # decide a step
        "config": '{"forged": true}',
        "progress": "999",
        "join/2": '{"pid": 1}',  # ask for the training state
    }
    for key, value in forged.items():  # planted where absent (overwriting would erase: see the next test)
        raw.compare_set(ns + key, "", value)
    raw.set(ns + "hb/1", "0")  # a counter overwritten: its writer and readers keep the authentic count
    other = JobStore.connect(f"127.0.0.1:{store.port}", timeout_s=10, secret="the job's secret")
    for s in (store, other):  # one client that wrote before, one that never did
        assert s.gen() == 0 and s.current_view() == view0
        assert not s.is_marked_dead(0) and s.dead_mark(0) is None
        assert not s.is_done() and s.failure() is None and not s.finished()
        assert s.config() is None and s.progress() is None and s.join_request(2) is None
    assert store.heartbeats([1]) == [-1], "a forged heartbeat is no observation (neither a value nor gone)"
    assert store.beat(1) == 3, "and the next beat goes on from the authentic count"
    assert store.heartbeats([1]) == [3]
    # The job writes over forged values: they are replaced, not obeyed.
    winner = store.propose(view0, View(gen=1, members=(0, 1), step=0, reason="dead [2]"))
    assert winner.members == (0, 1) and store.gen() == 1 and store.current_view() == winner
    assert store.mark_dead(0, '{"by": 1, "how": "heartbeat"}') and other.is_marked_dead(0)
    store.set_done()
    # TCPStore's set is not answered: another client sees it once a later request of the writer's was answered.
    assert store.is_done() and other.is_done()
    assert store.agree_config('{"real": 1}') == '{"real": 1}'


def test_a_live_workers_counters_rewritten_faster_than_it_beats_never_make_it_look_silent(store):
    """Worker 1 beats and advances every 100 ms; an attacker rewrites both counters every 5 ms, so a reader
    mostly finds forged values. Forged reads are no observation: the reader (heartbeat timeout 0.3 s, no
    progress limit 0.3 s) never judges the live worker silent. (Taking a forged read for the last authentic
    value made it look still between its beats, and the attack fenced a live worker.)"""
    view = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(view)
    raw, ns = _attacker(store)
    writer = JobStore.connect(f"127.0.0.1:{store.port}", timeout_s=10, secret="the job's secret")
    stop = threading.Event()

    def beat() -> None:
        while not stop.is_set():
            writer.beat(1)
            writer.advance(1, 1)
            stop.wait(0.1)

    def forge() -> None:
        while not stop.is_set():
            raw.set(ns + "hb/1", "0")
            raw.set(ns + "prog/1", "0")
            stop.wait(0.005)

    threads = [threading.Thread(target=beat), threading.Thread(target=forge)]
    for t in threads:
        t.start()
    try:
        reader = Membership(store, 0, heartbeat_timeout_s=0.3, progress_timeout_s=0.3)
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            assert reader.dead_members(view) == set(), "a live worker judged dead on forged counters"
            time.sleep(0.02)
    finally:
        stop.set()
        for t in threads:
            t.join(5)
    assert not store.is_marked_dead(1)


def test_a_forged_rendezvous_address_is_never_used(store):
    """Two ranks build a gloo group on the job's rendezvous store while an attacker keeps planting both ranks'
    address keys wherever they are absent (or tombstoned): the group forms with the authentic addresses and
    all-reduces. (Overwriting an authentic value erases it: that can stop a job, as flooding the port can; what
    the seal guarantees is that nothing forged is used.)"""
    raw, ns = _attacker(store)
    stop = threading.Event()

    def forge() -> None:
        while not stop.is_set():
            for r in (0, 1):
                raw.compare_set(f"{ns}pg/0/0/{r}", "", b"\x00" * 64)
            stop.wait(0.001)

    attacker = threading.Thread(target=forge, daemon=True)
    attacker.start()
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
        attacker.join(5)
    assert torch.equal(out[0], torch.full((4,), 3.0)) and torch.equal(out[1], torch.full((4,), 3.0))


def test_a_seal_covers_the_key_and_the_value():
    sealer = Sealer("s")
    sealed = sealer.seal("dead/1", "x")
    assert sealer.open("dead/1", sealed) == b"x"
    assert sealer.open("dead/2", sealed) is None, "moved to another key"
    assert sealer.open("dead/1", b"y" + sealed[1:]) is None, "another value"
    assert Sealer("other secret").open("dead/1", sealed) is None
    assert sealer.open("dead/1", b"") is None and sealer.open("dead/1", None) is None
    assert sealer.seal("k", "v") != sealer.seal("k", "v"), "each write has its own nonce"


class _Counted(dist.Store):
    """A real store that counts the round trips made through it."""

    def __init__(self, inner: dist.Store) -> None:
        super().__init__()
        self.inner, self.trips = inner, 0

    def compare_set(self, key, expected, desired):
        self.trips += 1
        return self.inner.compare_set(key, expected, desired)

    def check(self, keys):
        self.trips += 1
        return self.inner.check(keys)

    def get(self, key):
        self.trips += 1
        return self.inner.get(key)


def test_a_counter_its_owner_adds_to_costs_one_round_trip_and_stale_hints_still_sum_right(store):
    """An add tries the raw value this client last saw (one round trip when nobody wrote since); a stale one
    costs a second (the failed swap answers the current value), never a wrong sum; a deleted key counts from
    the last value seen; a read is one round trip."""
    owner = JobStore.connect(f"127.0.0.1:{store.port}", timeout_s=10, secret="the job's secret")
    other = JobStore.connect(f"127.0.0.1:{store.port}", timeout_s=10, secret="the job's secret")
    counted = _Counted(owner.backend.store)
    owner.backend.store = counted
    assert owner.beat(3) == 1 and counted.trips == 2, "the first add reads, then swaps"
    counted.trips = 0
    assert [owner.beat(3) for _ in range(5)] == [2, 3, 4, 5, 6] and counted.trips == 5
    assert other.backend.add("hb/3", 10) == 16, "another client's add"
    counted.trips = 0
    assert owner.beat(3) == 17 and counted.trips == 2, "a stale hint: the failed swap answers the current value"
    counted.trips = 0
    assert owner.backend.add("hb/3", 0) == 17 and counted.trips == 1, "a read: one round trip"
    other.backend.delete_key("hb/3")
    assert owner.beat(3) == 18, "a deleted counter counts from the last value this client saw"
    # A vote: the first compare-and-set decides; a later voter's swap on its hint fails and reads the decision.
    view = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(view)
    assert owner.vote(view, 0, "commit") == "commit" and other.vote(view, 0, "abort") == "commit"
    counted.trips = 0
    assert other.vote(view, 1, "abort") == "abort"
    assert owner.vote(view, 1, "commit") == "abort" and counted.trips == 1, "its hint (step 0's commit) is stale"
