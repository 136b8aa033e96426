"""Admitting a joiner at a step boundary, on a real store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unbroken.jsonl import JsonlWriter
from unbroken.mecefo.takeover import takeover_policy
from unbroken.runtime.job_store import JobStore
from unbroken.runtime.membership import Membership
from unbroken.runtime.protocol import MAX_SAME_VIEW_RETRIES, RetriesExhausted, StepProtocol
from unbroken.runtime.view import View


class _Job:
    n_slots, micro_batch, device = 3, 2, torch.device("cpu")
    model = optimizer = None

    def gradient_sums(self, step: int, items: list) -> torch.Tensor:
        return torch.ones(2)


def test_a_joiner_outrun_by_a_concurrent_reconfiguration_keeps_its_request(tmp_path: Path):
    """Worker 0 leads view 0; worker 1 (restarted) asks to join; a concurrent reconfiguration that does not
    admit it wins view 1 just before the leader proposes the admission."""
    store = JobStore.host("127.0.0.1", 0, clients=3, secret="test")
    v0 = View(gen=0, members=(0,), step=4)
    store.publish_initial(v0)
    store.beat(0)
    p = StepProtocol(Membership(store, 0, heartbeat_timeout_s=5.0), _Job(), policy=takeover_policy("spread"),
                     events=JsonlWriter(tmp_path / "w0.jsonl"), timeout_s=10)
    p.adopt(v0)
    store.mark_dead(1, "its previous incarnation died")
    store.request_join(1, {"pid": 1})
    store.propose(v0, View(gen=1, members=(0,), step=5, reason="another member's reconfiguration"))
    assert p.admit_joiners(5)
    assert p.view.gen == 1 and p.view.joiners == (), "the winner is the other view"
    assert store.join_requests([1]) == [1], "the request stands: the next boundary admits it"
    assert store.is_marked_dead(1), "and its predecessor's mark stays until it is admitted"


def test_a_joiner_with_another_config_is_refused_and_told_why(tmp_path: Path):
    store = JobStore.host("127.0.0.1", 0, clients=3, secret="test")
    v0 = View(gen=0, members=(0,), step=4)
    store.publish_initial(v0)
    store.beat(0)
    p = StepProtocol(Membership(store, 0, heartbeat_timeout_s=5.0), _Job(), policy=takeover_policy("spread"),
                     events=JsonlWriter(tmp_path / "w0.jsonl"), timeout_s=10, config_hash="job-hash")
    p.adopt(v0)
    store.request_join(1, {"pid": 1, "config_hash": "other-hash"})
    assert not p.admit_joiners(5), "nobody admitted"
    assert p.view.gen == 0 and store.join_requests([1]) == []
    refusal = store.join_refusal(1)
    assert "'other-hash'" in refusal and "'job-hash'" in refusal
    store.request_join(1, {"pid": 2, "config_hash": "job-hash"})
    assert store.join_refusal(1) is None, "a new request starts afresh"


def test_views_of_the_same_members_are_retried_a_bounded_number_of_times(tmp_path: Path):
    """Collectives keep failing and nobody is found dead: the worker leaves instead of looping forever."""
    store = JobStore.host("127.0.0.1", 0, clients=1, secret="test")
    v0 = View(gen=0, members=(0,), step=3)
    store.publish_initial(v0)
    m = Membership(store, 0, heartbeat_timeout_s=0.05)
    p = StepProtocol(m, _Job(), policy=takeover_policy("spread"), events=JsonlWriter(tmp_path / "w0.jsonl"),
                     timeout_s=10)
    p.adopt(v0)
    for attempt in range(MAX_SAME_VIEW_RETRIES):
        p.reconfigure_at_start(3, f"collective failed ({attempt})")
    assert p.view.gen == MAX_SAME_VIEW_RETRIES
    with pytest.raises(RetriesExhausted, match="nobody found dead"):
        p.reconfigure_at_start(3, "collective failed again")


def test_joiners_of_an_admission_a_member_died_in_get_the_state_by_transfer(tmp_path: Path):
    """View 0 admits worker 1 at step 10 from its node's snapshot memory; worker 2, which was to seal its part
    of that snapshot there, hangs before it does. The view without worker 2 still admits worker 1, by transfer
    (its memory holds no complete snapshot of step 10)."""
    store = JobStore.host("127.0.0.1", 0, clients=3, secret="test")
    v0 = View(gen=0, members=(0, 1, 2), step=10, joiners=(1,), reason="rejoin [1]", from_memory=(1,))
    store.publish_initial(v0)
    for w in (0, 1, 2):
        store.beat(w)
    p = StepProtocol(Membership(store, 0, heartbeat_timeout_s=5.0), _Job(), policy=takeover_policy("spread"),
                     events=JsonlWriter(tmp_path / "w0.jsonl"), timeout_s=10)
    store.mark_dead(2, "hung")
    v1 = p._next_view(v0, 10)
    assert (v1.gen, v1.members, v1.joiners, v1.from_memory) == (1, (0, 1), (1,), ())
