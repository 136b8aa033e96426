"""The restore decision of the agents (:mod:`unbroken.agent._restore`): it never stops an agent's loop, and it
waits for the inventory of every agent that still beats."""

from __future__ import annotations

import json
import threading
import time

import pytest

from unbroken.agent import _restore
from unbroken.agent._restore import AGENT_SILENT_S, JobRestore
from unbroken.store.job_store import JobStore
from unbroken.store.view import View
from unbroken.runtime.snapshot_hooks import job_id

pytestmark = pytest.mark.timeout(60)

SLOW_S = 1.5 * AGENT_SILENT_S
"""Node 1 checks its (large) snapshot memory for longer than an agent may be silent."""


def test_a_node_that_checks_its_memory_for_long_keeps_beating_and_is_waited_for(tmp_path, monkeypatch):
    def slow_inventory(job: str, node: int, *, config_hash: str | None = None, verify: bool = True) -> dict:
        if node == 1:
            time.sleep(SLOW_S)
        return {"node": node, "seals": [], "layouts": {}, "problems": []}

    monkeypatch.setattr(_restore, "inventory", slow_inventory)
    job_id(tmp_path, create=True)
    host = JobStore.host("127.0.0.1", 0, clients=3, secret="test")
    view = View(gen=3, members=(0, 1), step=7)
    host.publish_initial(view)
    stores = [JobStore.connect(f"127.0.0.1:{host.port}", timeout_s=5, secret="test") for _ in (0, 1)]
    restorers = [JobRestore(stores[r], node=r, nnodes=2, workers_per_node=1, run_dir=tmp_path, config_hash="h",
                            event=lambda *args, **fields: None) for r in (0, 1)]
    failures: dict[int, str] = {}
    gaps: list[float] = []
    done = threading.Event()

    def agent_loop(r: int) -> None:
        """What the agent's loop does: beat, and tick the restore."""
        last = time.monotonic()
        restorers[r].all_dead(view)
        if r == 1:
            gaps.append(time.monotonic() - last)
        while not done.is_set() and time.monotonic() - last < 30:
            now = time.monotonic()
            if r == 1:
                gaps.append(now - last)
            last = now
            stores[r].agent_beat(r)
            if (failure := restorers[r].tick(now)) is not None:
                failures[r] = failure
                done.set()
            time.sleep(0.02)

    agent_loop_0 = threading.Thread(target=agent_loop, args=(0,), daemon=True)
    t0 = time.monotonic()
    agent_loop_0.start()
    time.sleep(0.2)  # node 0 claims the restore
    agent_loop_1 = threading.Thread(target=agent_loop, args=(1,), daemon=True)
    agent_loop_1.start()
    agent_loop_0.join(timeout=40)
    done.set()
    agent_loop_1.join(timeout=40)
    assert max(gaps) < 1.0, f"node 1's agent stopped beating for {max(gaps):.1f} s while it checked its memory"
    assert list(failures) == [0], "node 0 decided"
    assert "in the memory of nodes [0, 1]" in failures[0], f"node 1's inventory was not waited for: {failures[0]}"
    assert time.monotonic() - t0 >= SLOW_S


def test_a_node_whose_agent_is_gone_is_not_waited_for(tmp_path, monkeypatch):
    monkeypatch.setattr(_restore, "inventory", lambda job, node, config_hash=None, verify=True: {
        "node": node, "seals": [], "layouts": {}, "problems": []})
    job_id(tmp_path, create=True)
    store = JobStore.host("127.0.0.1", 0, clients=1, secret="test")
    view = View(gen=3, members=(0, 1), step=7)
    store.publish_initial(view)
    restorer = JobRestore(store, node=0, nnodes=2, workers_per_node=1, run_dir=tmp_path, config_hash="h",
                          event=lambda *args, **fields: None)
    store.agent_beat(1)  # node 1's agent beat once, then was lost with its node
    restorer.all_dead(view)
    t0 = time.monotonic()
    while (failure := restorer.tick(time.monotonic())) is None:
        store.agent_beat(0)
        assert time.monotonic() - t0 < 2 * AGENT_SILENT_S, "still waiting for a silent agent"
        time.sleep(0.02)
    assert "in the memory of nodes [0]" in failure
    assert AGENT_SILENT_S - 0.1 <= time.monotonic() - t0


def test_a_silence_mark_made_for_a_view_a_restore_replaced_is_withdrawn(tmp_path):
    """Node 0's members are dead; it watches worker 1 (node 1) fall silent and marks it dead, but a restore
    published a newer view (a new incarnation of worker 1) meanwhile: the mark was for the dead incarnation,
    and a mark left behind would fail the restored view's admission. It is withdrawn; another's mark stays."""
    job_id(tmp_path, create=True)
    store = JobStore.host("127.0.0.1", 0, clients=1, secret="test")
    old = View(gen=3, members=(0, 1), step=7)
    store.publish_initial(old)
    store.mark_dead(0, "killed")
    restorer = JobRestore(store, node=0, nnodes=2, workers_per_node=1, run_dir=tmp_path, config_hash="h",
                          event=lambda *args, **fields: None)
    restored = View(gen=4, members=(0, 1), step=7, reason="restored", restore={"source": "memory"})
    views = iter([old, restored])  # the restore lands between the watch's look and its mark
    assert restorer.mark_silent(lambda: old, time.monotonic(), 0.05) == []  # first look at worker 1's beat
    time.sleep(0.1)
    assert restorer.mark_silent(lambda: next(views), time.monotonic() + 1, 0.05) == [1]
    assert store.dead_mark(1) is None and not store.is_marked_dead(1), "withdrawn: made for view 3"
    store.mark_dead(1, "someone else's")
    store.unmark_dead(1, json.dumps({"not": "mine"}))
    assert store.dead_mark(1) == "someone else's"


@pytest.mark.parametrize("restored, progress, verify", [
    (False, None, False),  # a job-wide death of a view that trained: the seals decide, each load checks its bytes
    (True, 7, True),  # every member of a restored view died before it trained a step: every byte checked now
    (True, 8, False),  # a restored view that trained on died later: a new story
])
def test_the_inventory_checks_every_byte_only_after_a_restore_that_trained_nothing(tmp_path, monkeypatch,
                                                                                   restored, progress, verify):
    asked: list[bool] = []
    monkeypatch.setattr(_restore, "inventory", lambda job, node, config_hash=None, verify=True: asked.append(verify) or {
        "node": node, "seals": [], "layouts": {}, "problems": []})
    job_id(tmp_path, create=True)
    store = JobStore.host("127.0.0.1", 0, clients=1, secret="test")
    spec = {"source": "memory", "step": 7, "failures": []} if restored else None
    view = View(gen=3, members=(0,), step=7, restore=spec)
    store.publish_initial(view)
    if progress is not None:
        store.set_progress(progress)
    restorer = JobRestore(store, node=0, nnodes=1, workers_per_node=1, run_dir=tmp_path, config_hash="h",
                          event=lambda *args, **fields: None)
    restorer.all_dead(view)
    t0 = time.monotonic()
    while restorer.busy() and restorer.tick(time.monotonic()) is None:
        assert time.monotonic() - t0 < 10
        time.sleep(0.01)
    assert asked == [verify]
