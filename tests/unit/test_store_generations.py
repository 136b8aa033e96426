"""A generation's keys on a real embedded store and a real 3-member etcd cluster: the leader's applied steps
count once however often a heartbeat is sent again, a writer far behind never brings back a pruned
generation's keys, and a view another writer deleted is never replaced by a different one (on etcd it is read
from the key's history, or waited for where that history is compacted)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pytest
import torch.distributed as dist

from unbroken.store.job_store import JobStore, StoreKeyLost
from unbroken.runtime.membership import Membership
from unbroken.store.view import View

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(params=["tcp", "etcd"])
def store(request):
    if request.param == "tcp":
        s = JobStore.host("127.0.0.1", 0, clients=2, secret="test")
        yield s
        s.close()
        return
    cluster = request.getfixturevalue("etcd_cluster")
    s = JobStore.create_on_etcd(cluster.url, timeout_s=10, secret=f"gen-{request.node.name}", job={"test": 1})
    yield s
    s.backend.clear()


def _lose_answers(store: JobStore, times: int) -> None:
    """The next ``times`` writes of ``store``'s backend land, and their answer is lost (an error instead):
    a connection dropped after the store applied the request, or a later add of the same heartbeat failing."""
    left = [times]

    def lossy(op: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any) -> Any:
            out = op(*args)
            if left[0] > 0:
                left[0] -= 1
                raise dist.DistStoreError("the answer was lost")
            return out
        return call

    backend: Any = store.backend
    backend.adds, backend.set = lossy(backend.adds), lossy(backend.set)


def test_a_heartbeat_sent_again_after_a_lost_answer_counts_the_applied_steps_once(store):
    v0 = View(gen=0, members=(0, 1), step=4)
    store.publish_initial(v0)
    leader = Membership(store, 0, heartbeat_timeout_s=2.0)
    leader.applied(0, v0.step, 7)  # steps 4, 5 and 6 applied
    _lose_answers(store, 2)
    for _ in range(2):
        with pytest.raises(dist.DistStoreError, match="lost"):
            leader._publish()
    leader._publish()  # the heartbeat thread's retry
    leader._publish()
    assert store.progress() == 7


def test_a_writer_far_behind_never_brings_back_a_pruned_generations_keys(store):
    v0 = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(v0)
    stale = Membership(store, 0, heartbeat_timeout_s=2.0)
    stale.applied(0, 0, 1)
    stale._publish()
    v1 = store.propose(v0, View(gen=1, members=(1,), step=1, reason="dead [0]"))
    assert store.vote(v1, 1, "commit") == "commit" and store.prune(1) == 1
    assert store.backend.peek(["applied/0", "arrive/0", "items/0/0"]) == [None] * 3
    stale.applied(0, 0, 2)  # the old leader, far behind, applied another step of view 0
    stale._publish()
    assert store.backend.peek(["applied/0"]) == [None], "the old leader's step is not written back"
    assert store.arrive(0) == 0 and store.arrived(0) == 0
    store.publish_items(0, 0, 1, [])
    assert store.backend.peek(["applied/0", "arrive/0", "items/0/0"]) == [None] * 3
    assert store.progress() == 1
    # An agent far behind finds view 0's members all dead: its inventory and its claim to restore are not kept.
    store.publish_inventory(0, 1, 2, "{}")
    assert not store.claim_restore(0, 1), "a pruned generation is restored by nobody"
    assert store.backend.peek(["snapinv/0/1", "restore/0", "restore/0/nodes"]) == [None] * 3
    assert store.inventories(0, 2) == {}
    store.publish_inventory(-1, 1, 2, "{}")  # a --resume's start (generation -1) is never pruned
    assert store.claim_restore(-1, 1) and store.inventories(-1, 2) == {1: "{}"}


def test_a_deleted_view_is_never_replaced_by_another_proposal(etcd_cluster, request):
    """Member A's proposal of view 1 won (and ``gen`` says 1); another writer deletes ``view/1``: member B's
    own proposal of view 1 must not create it anew (A and B would build different groups for generation 1), it
    reads A's from the key's history; where that history is compacted away a proposer waits for the key and
    stops, naming it; a proposer whose next generation was pruned reads the newest view instead of writing it
    back."""
    secret = f"gen-{request.node.name}"
    a = JobStore.create_on_etcd(etcd_cluster.url, timeout_s=10, secret=secret, job={"test": 1})
    try:
        b = JobStore.connect(etcd_cluster.url, timeout_s=10, secret=secret)
        v0 = View(gen=0, members=(0, 1, 2), step=3)
        a.publish_initial(v0)
        mine = View(gen=1, members=(0, 1), step=3, reason="dead [2]")
        assert a.propose(v0, mine) == mine and a.gen() == 1
        a.backend.call("kv/deleterange", {"key": a.backend.prefixed("view/1")})  # type: ignore[attr-defined]
        assert b.propose(v0, View(gen=1, members=(1, 2), step=3, reason="dead [0]")) == mine, "A's, from history"
        assert a.backend.peek(["view/1"]) == [None], "nothing was created in its place"
        revision = a.backend.read_many(["job"]) and a.backend.revision  # type: ignore[attr-defined]
        a.backend.call("kv/compaction", {"revision": str(revision), "physical": True})  # type: ignore[attr-defined]
        c = JobStore.connect(etcd_cluster.url, timeout_s=10, secret=secret)
        c.set_store_timeout(1.0)
        t0 = time.monotonic()
        with pytest.raises(StoreKeyLost, match=r"view/1.*deleted or overwrote it"):
            c.propose(v0, View(gen=1, members=(1, 2), step=3, reason="dead [0]"))
        assert time.monotonic() - t0 >= 1.0
        assert a.backend.peek(["view/1"]) == [None], "nothing was created in its place"
        v2 = View(gen=2, members=(0, 1), step=3, reason="rebuilt")
        a.backend.set("view/2", v2.to_json())
        a.backend.set("gen", "2")
        a.prune(2)
        assert b.propose(v0, View(gen=1, members=(1, 2), step=3)) == v2
        assert a.backend.peek(["view/1"]) == [None]
    finally:
        a.backend.clear()


def test_a_proposal_is_created_only_while_gen_is_as_its_proposer_read_it(etcd_cluster, request):
    """Proposer B read ``gen`` (0) before A's view 1 advanced it; the writer deletes ``view/1``: B's create,
    in one transaction with a compare of ``gen``, creates nothing."""
    secret = f"gen-{request.node.name}"
    a = JobStore.create_on_etcd(etcd_cluster.url, timeout_s=10, secret=secret, job={"test": 1})
    try:
        b = JobStore.connect(etcd_cluster.url, timeout_s=10, secret=secret)
        v0 = View(gen=0, members=(0, 1, 2), step=3)
        a.publish_initial(v0)
        assert b.gen() == 0
        assert a.propose(v0, View(gen=1, members=(0, 1), step=3)).members == (0, 1)
        a.backend.call("kv/deleterange", {"key": a.backend.prefixed("view/1")})  # type: ignore[attr-defined]
        theirs = View(gen=1, members=(1, 2), step=3)
        assert b.backend.create_unless_moved("view/1", theirs.to_json(), "gen") is None
        assert a.backend.peek(["view/1"]) == [None]
    finally:
        a.backend.clear()
