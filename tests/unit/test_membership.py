"""Heartbeat judgement, outcome votes and join requests on a real TCPStore."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from unbroken.store.job_store import JobStore
from unbroken.runtime.membership import FIRST_BEAT_FACTOR, Membership, View, beat_interval
from unbroken.store.backend import EmbeddedBackend

TIMEOUT_S = 0.3


@pytest.fixture()
def store():
    s = JobStore.host("127.0.0.1", 0, clients=1, secret="test")
    yield s
    del s


def _watch(m: Membership, view: View, seconds: float, beat: dict[int, int], store: JobStore) -> set[int]:
    """Observe every 20 ms for ``seconds``, beating for the workers in ``beat``."""
    end = time.monotonic() + seconds
    dead: set[int] = set()
    while time.monotonic() < end:
        for w in beat:
            store.beat(w)
        dead = m.dead_members(view)
        time.sleep(0.02)
    return dead


def test_a_silent_peer_is_declared_dead_after_the_timeout_a_beating_one_never(store):
    view = View(gen=0, members=(0, 1, 2), step=0)
    store.publish_initial(view)  # publishing a view creates its members' liveness counters
    for w in view.members:
        store.beat(w)
    m = Membership(store, 0, heartbeat_timeout_s=TIMEOUT_S)
    assert _watch(m, view, TIMEOUT_S * 0.6, {1: 1}, store) == set()
    assert _watch(m, view, TIMEOUT_S, {1: 1}, store) == {2}
    assert store.is_marked_dead(2) and not store.is_marked_dead(1)
    assert store.deaths() == 1


def test_the_observers_own_gap_restarts_the_clocks(store):
    """An observer that was not watching (descheduled, store stalled) cannot tell who was silent."""
    view = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(view)
    for w in view.members:
        store.beat(w)
    m = Membership(store, 0, heartbeat_timeout_s=TIMEOUT_S)
    assert m.dead_members(view) == set()
    time.sleep(TIMEOUT_S * 2)  # worker 1's counter did not move, but neither did this observer look
    assert m.dead_members(view) == set()
    assert not store.is_marked_dead(1)
    # Watching on from here, the silence is real once it lasts the timeout.
    assert _watch(m, view, TIMEOUT_S * 0.6, {}, store) == set()
    assert _watch(m, view, TIMEOUT_S, {}, store) == {1}


def test_first_outcome_vote_decides_for_everyone(store):
    view = View(gen=0, members=(0, 1), step=7)
    store.publish_initial(view)
    assert store.vote(view, 7, "commit") == "commit"
    assert store.vote(view, 7, "abort") == "commit"
    assert store.vote(view, 8, "abort") == "abort"
    assert store.vote(view, 8, "commit") == "abort"


def test_a_join_request_is_seen_through_the_heartbeat_within_an_interval(store):
    leader = Membership(store, 0, heartbeat_timeout_s=TIMEOUT_S)
    leader.start_heartbeat()
    try:
        view = View(gen=0, members=(0, 2), step=0)
        assert leader.pending_joins(view, 3) == []
        Membership(store, 1, heartbeat_timeout_s=TIMEOUT_S).request_join({"pid": 1})
        deadline = time.monotonic() + 2.0
        while (got := leader.pending_joins(view, 3)) == [] and time.monotonic() < deadline:
            time.sleep(0.01)
        assert got == [1]
        store.clear_join(1)
        assert leader.pending_joins(view, 3) == []
        assert leader.pending_joins(View(gen=1, members=(0, 1, 2), step=0), 3) == []
    finally:
        leader.stop()


def test_a_request_made_while_the_view_still_names_the_joiner_is_seen_by_the_next_view(store):
    """Worker 2's new incarnation asks before the view drops its dead predecessor: a check under the old
    view (2 a member) finds no joiner, and the next view must still see the request, the counter unmoved."""
    leader = Membership(store, 0, heartbeat_timeout_s=TIMEOUT_S)  # no heartbeat thread: reads the counter
    Membership(store, 2, heartbeat_timeout_s=TIMEOUT_S).request_join({"pid": 2})
    assert leader.pending_joins(View(gen=0, members=(0, 1, 2), step=5), 3) == []
    assert leader.pending_joins(View(gen=1, members=(0, 1), step=5), 3) == [2]


class _Hiccup(EmbeddedBackend):
    """The real store, whose answers fail for a while (a store restarting, a network blip)."""

    def __init__(self, real: EmbeddedBackend, failing_s: float) -> None:
        super().__init__(real.client, real._secret)
        self.until = time.monotonic() + failing_s
        self.errors = 0

    def add(self, key: str, amount: int) -> int:
        if time.monotonic() < self.until:
            self.errors += 1
            raise RuntimeError("store hiccup")
        return super().add(key, amount)

    def adds(self, pairs: list[tuple[str, int]]) -> list[int]:  # a heartbeat's batched round trip
        if time.monotonic() < self.until:
            self.errors += 1
            raise RuntimeError("store hiccup")
        return super().adds(pairs)


def test_the_heartbeat_survives_a_store_hiccup_shorter_than_the_timeout(store):
    flaky = _Hiccup(store.backend, failing_s=0)
    m = Membership(store, 0, heartbeat_timeout_s=2.0, heartbeat_store=JobStore(flaky))
    m.start_heartbeat()
    try:
        flaky.until = time.monotonic() + 0.6  # the store fails for 0.6 s
        time.sleep(1.2)
        before = store.heartbeats([0])[0]
        time.sleep(0.5)
        assert flaky.errors > 0, "the hiccup happened"
        assert m._hb_thread.is_alive() and store.heartbeats([0])[0] > before, "it beats again after the hiccup"
    finally:
        m.stop()


def test_the_heartbeat_stops_once_the_store_is_gone_for_longer_than_the_timeout(store):
    flaky = _Hiccup(store.backend, failing_s=60)
    m = Membership(store, 0, heartbeat_timeout_s=0.5, heartbeat_store=JobStore(flaky))
    thread = threading.Thread(target=m._beat, daemon=True)
    thread.start()
    thread.join(5.0)
    assert not thread.is_alive(), "gave up after the timeout, not at the first error"
    assert flaky.errors > 2


def test_a_member_that_never_beat_is_dead_after_a_starts_grace_one_that_stopped_after_the_timeout(store):
    """Counters exist from the view's publication (no read waits for the store's timeout); a counter still at 0
    is a start not finished: FIRST_BEAT_FACTOR heartbeat timeouts; one that moved and stopped: one timeout."""
    view = View(gen=0, members=(0, 1, 2), step=0)
    store.publish_initial(view)
    store.beat(2)  # worker 2 started, then stopped beating
    m = Membership(store, 0, heartbeat_timeout_s=TIMEOUT_S)
    assert m.first_beat_timeout_s == FIRST_BEAT_FACTOR * TIMEOUT_S
    t0 = time.monotonic()
    dead: set[int] = set()
    found: dict[int, float] = {}
    while len(found) < 2 and time.monotonic() - t0 < 10.0:
        dead = m.dead_members(view)
        found.update({w: time.monotonic() - t0 for w in dead if w not in found})
        time.sleep(0.02)
    assert dead == {1, 2}
    assert TIMEOUT_S <= found[2] < TIMEOUT_S + 2.0
    assert FIRST_BEAT_FACTOR * TIMEOUT_S <= found[1] < FIRST_BEAT_FACTOR * TIMEOUT_S + 2.0


def test_a_beating_member_whose_main_thread_stands_still_is_dead_after_the_progress_timeout(store):
    view = View(gen=0, members=(0, 1, 2), step=0)
    store.publish_initial(view)
    m = Membership(store, 0, heartbeat_timeout_s=TIMEOUT_S, progress_timeout_s=2 * TIMEOUT_S)
    end = time.monotonic() + 3 * TIMEOUT_S
    while time.monotonic() < end:
        for w in (1, 2):
            store.beat(w)  # both heartbeat threads beat ...
        store.advance(2, 1)  # ... but only worker 2's main thread moves on
        dead = m.dead_members(view)
        time.sleep(0.02)
    assert dead == {1}
    assert json.loads(store.dead_mark(1))["how"] == "no progress"


def test_the_leaders_duties_keep_its_progress_ticking_and_a_real_stall_still_counts(tmp_path):
    """The leader validates and waits for the previous checkpoint save (a slow filesystem) for longer than the
    progress timeout: work, not a hang; its peers waiting for it must not judge it stuck. Once its main thread
    really stands still outside those duties, they do."""
    from types import SimpleNamespace

    from unbroken.runtime.worker import Trainer
    from unbroken.sharding.layout import StateLayout
    from unbroken.sharding.parallelism import Parallelism, ReplicaLayout

    store = JobStore.host("127.0.0.1", 0, clients=3, secret="test")
    view = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(view)
    leader = Membership(store, 0, heartbeat_timeout_s=TIMEOUT_S, progress_timeout_s=2 * TIMEOUT_S,
                        heartbeat_store=JobStore.connect(f"127.0.0.1:{store.port}", timeout_s=5, secret="test"))
    leader.start_heartbeat()
    peer = Membership(store, 1, heartbeat_timeout_s=TIMEOUT_S, progress_timeout_s=2 * TIMEOUT_S)
    judged: list[set[int]] = []
    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.02):
            store.beat(1)
            judged.append(peer.dead_members(view))

    def slow(*args, **kwargs) -> None:
        time.sleep(4 * TIMEOUT_S)

    trainer = SimpleNamespace(
        cfg=SimpleNamespace(train=SimpleNamespace(keep_checkpoints=1, steps=100)), m=leader, store=store,
        metrics=SimpleNamespace(step_done=slow), checkpointer=SimpleNamespace(poll=lambda: None, save=slow,
                                                                               pending_step=None),
        schedule=SimpleNamespace(taken=lambda: None), protocol=SimpleNamespace(layout=StateLayout(None), view=view),
        job=SimpleNamespace(val_sampler=None, model=torch.nn.Linear(1, 1), optimizer=None), hash="h",
        spec=SimpleNamespace(worker=0), last_step=100)
    trainer.job.optimizer = torch.optim.AdamW(trainer.job.model.parameters())
    trainer.parallelism = Parallelism(kind="replicated", worker=0, replicas=ReplicaLayout(2, 1))
    trainer._save = lambda done, last: Trainer._save(trainer, done, last)
    trainer._write_part = lambda done, writer: Trainer._write_part(trainer, done, writer)
    trainer._stage = lambda writer: Trainer._stage(trainer, writer)
    trainer._leader_checkpointer = lambda: Trainer._leader_checkpointer(trainer)
    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        Trainer._lead(trainer, 1, {"loss": 1.0}, "step")  # 8 progress timeouts of validation and save
        assert not any(judged), f"the leader was judged stuck during its duties: {judged}"
        time.sleep(4 * TIMEOUT_S)  # a main thread that really stands still
        assert judged[-1] == {0} and json.loads(store.dead_mark(0))["how"] == "no progress"
    finally:
        stop.set()
        thread.join(timeout=5)
        leader.stop()


def test_a_worker_beats_eight_times_per_heartbeat_timeout_between_100_and_250_ms_apart():
    assert beat_interval(2.0) == 0.25, "the default timeout: 4 beats a second, 8 per timeout"
    assert beat_interval(1.6) == 0.2
    assert beat_interval(0.5) == 0.1 and beat_interval(30.0) == 0.25


def test_a_gap_the_observers_own_heartbeat_beat_through_keeps_the_clocks(store):
    """An observer busy computing between two looks, its heartbeat thread answered by the store all along, was not
    blind: a peer whose counter has not moved since the first look is dead at the second once the silence lasts
    the timeout (not a timeout after the second look); a peer beating meanwhile is not."""
    timeout = 2.0
    view = View(gen=0, members=(0, 1, 2), step=0)
    store.publish_initial(view)
    for w in view.members:
        store.beat(w)
    observer, beating = (Membership(store, w, heartbeat_timeout_s=timeout) for w in (0, 2))
    observer.start_heartbeat()
    beating.start_heartbeat()
    try:
        while True:  # a round in which the observer's own heartbeat stalled (a loaded machine) proves nothing
            first = time.monotonic()
            assert 1 not in observer.dead_members(view)
            time.sleep(timeout * 1.5)
            dead = observer.dead_members(view)
            if observer._beat_through(first, time.monotonic()):
                break
        assert dead == {1}
        mark = json.loads(store.dead_mark(1))
        assert mark["how"] == "heartbeat" and mark["silent_s"] >= timeout
    finally:
        observer.stop()
        beating.stop()
