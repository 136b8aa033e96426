"""The store's request-latency histogram and its reports (:mod:`unbroken.store.latency`), a real client's
requests counted into it, and what the watchers and the status line make of a worker's report."""

from __future__ import annotations

import pytest

from unbroken.console import Console, format_status
from unbroken.monitor.job_state import JobState
from unbroken.store.job_store import JobStore
from unbroken.store.latency import CEIL_S, FLOOR_S, PER_DECADE, LatencyHistogram, LatencyReport

pytestmark = pytest.mark.timeout(60)

BUCKET = 10 ** (1 / PER_DECADE)  # a bucket's width, as a factor


def test_quantiles_are_within_one_bucket_and_never_above_the_largest_request() -> None:
    h = LatencyHistogram()
    assert h.quantile(0.5) is None and h.summary() == {"calls": 0, "p50_s": None, "p99_s": None, "max_s": 0.0}
    for _ in range(98):
        h.add(0.001)
    h.add(0.05)
    h.add(0.2)
    assert h.calls == 100 and h.max_s == 0.2
    assert 0.001 / BUCKET <= h.quantile(0.5) <= 0.001 * BUCKET
    assert 0.05 / BUCKET <= h.quantile(0.99) <= 0.05 * BUCKET
    assert h.quantile(1.0) == 0.2, "the top bucket's middle is past the largest request: clamped to it"
    h.add(0.0)
    h.add(1e9)
    assert h.quantile(0.001) == FLOOR_S and h.max_s == 1e9 and h.quantile(1.0) == CEIL_S


def test_take_hands_over_the_counts_and_starts_again() -> None:
    h = LatencyHistogram()
    h.add(0.002)
    taken = h.take()
    assert taken.calls == 1 and taken.max_s == 0.002 and h.calls == 0 and h.quantile(0.5) is None
    h.add(0.004)
    assert taken.calls == 1 and h.calls == 1, "the taken histogram no longer counts"


def test_a_report_is_due_every_interval_and_at_the_last_step_with_the_requests_since_the_previous_one() -> None:
    h = LatencyHistogram()
    report = LatencyReport(h, every_s=10.0)
    h.add(5.0)  # the start-up's requests (a rendezvous) are not the step's
    assert report.due(100.0) is None
    h.add(0.001)
    assert report.due(105.0) is None
    first = report.due(110.0)
    assert first is not None and first["calls"] == 1 and first["max_s"] == 0.001
    assert report.due(111.0, last=True) is None, "no request since the previous report: nothing to say"
    h.add(0.003)
    last = report.due(112.0, last=True)
    assert last is not None and last["calls"] == 1 and last["max_s"] == 0.003
    assert 0.003 / BUCKET <= last["p99_s"] <= 0.003


def test_a_client_counts_the_requests_that_wait_for_nothing() -> None:
    store = JobStore.host("127.0.0.1", 0, clients=1, secret="s" * 32)
    try:
        latency = store.request_latency()
        assert latency is not None
        before = latency.calls
        store.backend.set("k", "v")
        store.backend.get("k")  # a get waits for its key: not a request's latency
        assert latency.calls == before + 1 and 0 < latency.max_s < 10
    finally:
        store.close()


def test_an_etcd_client_counts_every_request_it_sends(etcd_cluster) -> None:
    """On etcd a wait for a key is a series of reads: each is a request of its own, counted like any other."""
    store = JobStore.create_on_etcd(etcd_cluster.url, timeout_s=10, secret="latency", job={"t": 1})
    try:
        latency = store.request_latency()
        assert latency is not None and latency is store.backend.cluster.latency
        before, trips = latency.calls, store.backend.round_trips
        store.backend.set("k", "v")
        assert store.backend.get("k") == b"v"
        assert latency.calls - before == store.backend.round_trips - trips >= 2, "one count per request"
        assert 0 < latency.max_s < 10 and store.usage()["seconds"] > 0
    finally:
        store.backend.clear()


def test_the_watchers_and_the_status_line_show_each_workers_newest_figures() -> None:
    state = JobState(workers=2)
    for worker, p99 in ((0, 0.002), (1, 0.009), (0, 0.004)):
        state.event({"kind": "event", "event": "store_latency", "worker": worker, "step": 10, "calls": 50,
                     "p50_s": 0.001, "p99_s": p99, "max_s": p99})
    assert {w: e["p99_s"] for w, e in state.store_latency.items()} == {0: 0.004, 1: 0.009}

    rec = {"kind": "train", "step": 3, "loss": 2.0, "tokens_per_s": 1000.0}
    assert "store p99 9.0 ms" in format_status(rec, total=10, workers=2, stall=None, store_p99_s=0.009)
    assert not any(f.startswith("store") for f in format_status(rec, total=10, workers=2, stall=None))
    lines: list[str] = []
    console = Console(total=10, workers=2, live=False, stream=_Lines(lines))
    console.event({"kind": "event", "event": "store_latency", "worker": 1, "step": 2, "p50_s": 0.001, "p99_s": 0.0125})
    console.record(rec)
    assert not any("store_latency" in line for line in lines), "a figure, not a line of its own"
    assert console.state.store_p99 == {1: 0.0125}


def test_the_endpoint_labels_each_workers_quantiles() -> None:
    pytest.importorskip("prometheus_client")
    from unbroken.monitor.prometheus_endpoint import JobCollector

    state = JobState(workers=2)
    state.event({"kind": "event", "event": "store_latency", "worker": 1, "step": 4, "calls": 9, "p50_s": 0.001,
                 "p99_s": 0.02, "max_s": 0.02})
    [family] = [f for f in JobCollector(state).collect() if f.name == "unbroken_store_request_seconds"]
    assert {(s.labels["worker"], s.labels["quantile"]): s.value for s in family.samples} == {
        ("1", "0.5"): 0.001, ("1", "0.99"): 0.02}


class _Lines:
    def __init__(self, lines: list[str]) -> None:
        self.lines = lines

    def write(self, text: str) -> None:
        self.lines.extend(t for t in text.splitlines() if t)

    def flush(self) -> None:
        pass

    def isatty(self) -> bool:
        return False
