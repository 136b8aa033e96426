"""A write-once key (a view, a member's items, a rendezvous key) that another writer deleted or forged on etcd is read
from the key's history by a waiting read: a delay of a grace, never a stop (a real 3-member cluster)."""

from __future__ import annotations

import base64
import time

import pytest

from unbroken.store import etcd_history
from unbroken.store.etcd_backend import EtcdBackend, StoreUnavailable
from unbroken.store.job_store import JobStore
from unbroken.store.view import View

pytestmark = pytest.mark.timeout(120)


class Intruder:
    """A client of the cluster without the job's secret: it deletes the job's keys and writes its own values."""

    def __init__(self, url: str, ns: str) -> None:
        self.client, self.ns = EtcdBackend(url, "not the job's secret", timeout_s=10), ns

    def _k(self, key: str) -> str:
        return base64.b64encode((self.ns + key).encode()).decode()

    def delete(self, key: str) -> None:
        assert int(self.client.call("kv/deleterange", {"key": self._k(key)}).get("deleted", 0)) == 1, key

    def forge(self, key: str, raw: bytes) -> None:
        self.client.call("kv/put", {"key": self._k(key), "value": base64.b64encode(raw).decode()})


@pytest.fixture
def job(etcd_cluster, request):
    store = JobStore.create_on_etcd(etcd_cluster.url, timeout_s=10, secret=request.node.name, job={"t": 1})
    reader = JobStore.connect(etcd_cluster.url, timeout_s=10, secret=request.node.name)
    yield store, reader, Intruder(etcd_cluster.url, store.backend.ns)
    store.backend.clear()


def test_a_deleted_key_is_read_from_its_history_after_the_grace(job):
    store, reader, intruder = job
    store.backend.set("pg/0/0/0", "rank 0's addresses")
    store.backend.set("pg/0/0/1", "rank 1's addresses")
    intruder.delete("pg/0/0/0")
    t0 = time.monotonic()
    assert reader.backend.get("pg/0/0/0") == b"rank 0's addresses"
    assert time.monotonic() - t0 >= etcd_history.WRITTEN_GRACE_S, "a key gone is waited for first"
    intruder.delete("pg/0/0/1")
    assert reader.backend.multi_get(["pg/0/0/0", "pg/0/0/1"]) == [b"rank 0's addresses", b"rank 1's addresses"]
    rendezvous = reader.group_store(0)
    assert rendezvous.get("0/1") == b"rank 1's addresses", "gloo's get through the group store"


def test_a_key_deleted_and_forged_reads_the_jobs_value(job):
    store, reader, intruder = job
    store.backend.set("pg/0/0/0", "authentic")
    intruder.delete("pg/0/0/0")
    intruder.forge("pg/0/0/0", b"forged" + b"\0" * 32)  # a new creation of the key, not sealed by the job
    assert reader.backend.get("pg/0/0/0") == b"authentic"
    intruder.forge("pg/0/0/0", b"forged again" + b"\0" * 32)  # over it: the key's versions go on
    assert reader.backend.get("pg/0/0/0") == b"authentic", "a later read reads only the newer revisions"


def test_a_key_never_written_still_times_out(job):
    _, reader, _ = job
    reader.backend.timeout_s = 1.5
    with pytest.raises(StoreUnavailable, match=r"etcd keys \['pg/0/0/9'\] did not appear within the timeout"):
        reader.backend.get("pg/0/0/9")
    with pytest.raises(StoreUnavailable, match="did not appear within the timeout"):
        reader.backend.get("config")  # not write-once: never read from history (it was never written anyway)


def test_a_deleted_view_is_read_by_current_view_and_a_proposer(job):
    store, reader, intruder = job
    store.publish_initial(View(gen=0, members=(0, 1), step=0))
    intruder.delete("view/0")
    assert reader.current_view() == View(gen=0, members=(0, 1), step=0)
    new = View(gen=1, members=(0,), step=3)
    assert store.propose(View(gen=0, members=(0, 1), step=0), new) == new
    intruder.delete("view/1")
    assert reader.propose(View(gen=0, members=(0, 1), step=0), View(gen=1, members=(1,), step=3)) == new, \
        "a late proposer reads the view that won, from its history"
    assert reader.current_view() == new


def test_deleted_items_are_read_as_their_newest_value(job):
    store, reader, intruder = job
    store.publish_items(2, 0, 7, [[1, 2]])
    store.publish_items(2, 0, 8, [[3, 4]])  # the next attempt's exchange in the same view: written again
    intruder.delete("items/2/0")
    t0 = time.monotonic()
    while not reader.items_ready(2, (0,)):  # polled, as a worker's exchange does
        assert time.monotonic() - t0 < 10
        time.sleep(0.01)
    assert reader.items(2, 8, (0,)) == {0: [[3, 4]]}


def test_a_pruned_generations_keys_are_not_read_back(job):
    store, reader, _ = job
    store.publish_initial(View(gen=0, members=(0,), step=0))
    store.publish_items(0, 0, 1, [[0, 1]])
    store.prune(1)  # the job's own delete of generation 0's keys
    assert store.backend.peek(["items/0/0"]) == [None]
    reader.backend.timeout_s = 1.5
    with pytest.raises(StoreUnavailable, match="did not appear within the timeout"):
        reader.backend.get("items/0/0")
