"""Admitting a joiner at a step boundary, on a real store."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from unbroken.jsonl import JsonlWriter
from unbroken.mecefo.takeover import takeover_policy
from unbroken.store.job_store import JobStore
from unbroken.runtime.membership import Membership
from unbroken.runtime.protocol import MAX_SAME_VIEW_RETRIES, RetriesExhausted, StepProtocol
from unbroken.store.view import View


class _Job:
    n_slots, micro_batch, device = 3, 2, torch.device("cpu")
    n_workers = n_slots
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
    assert not store.is_marked_dead(1), "its predecessor's mark went before the proposal (nobody needs it)"


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
    v1 = p.views._next_view(v0, 10)
    assert (v1.gen, v1.members, v1.joiners, v1.from_memory) == (1, (0, 1), (1,), ())


def test_a_member_that_reads_the_marks_again_during_an_admission_keeps_the_joiner(tmp_path: Path):
    """Worker 1's predecessor died; the leader admits worker 1 at step 5. Worker 3 dies as view 1 is
    published, so member 2, which adopts it at once, reads the death marks again: the predecessor's mark must
    be gone by then, or member 2 takes the joiner for dead, the next view leaves it out, and it waits for ever
    with its request cleared."""
    store = JobStore.host("127.0.0.1", 0, clients=4, secret="test")
    v0 = View(gen=0, members=(0, 2, 3), step=4)
    store.publish_initial(v0)
    for w in (0, 1, 2, 3):
        store.beat(w)
    store.mark_dead(1, "its previous incarnation died")
    m2 = Membership(store, 2, heartbeat_timeout_s=5.0)
    assert m2.dead_members(v0) == set()
    store.request_join(1, {"pid": 1})
    p = StepProtocol(Membership(store, 0, heartbeat_timeout_s=5.0), _Job(), policy=takeover_policy("spread"),
                     events=JsonlWriter(tmp_path / "w0.jsonl"), timeout_s=10)
    p.views.view, p.views.voted = v0, v0.step - 1
    seen: dict[str, object] = {}
    propose = store.propose

    def propose_then_member_2_adopts(current: View, new: View) -> View:
        winner = propose(current, new)
        store.mark_dead(3, "another death")
        m2.forget_dead(1)  # as ViewChanges.adopt does for the view's joiners
        seen["dead"] = m2.dead_members(winner)
        return winner

    store.propose = propose_then_member_2_adopts  # type: ignore[method-assign]
    p.views.adopt = lambda view: seen.setdefault("adopted", view)  # type: ignore[method-assign]
    assert p.admit_joiners(5)
    assert seen["adopted"].joiners == (1,)
    assert seen["dead"] == {3}, "the joiner is judged by its own incarnation, not its predecessor's mark"
    store.propose = propose  # type: ignore[method-assign]
    p2 = StepProtocol(m2, _Job(), policy=takeover_policy("spread"), events=JsonlWriter(tmp_path / "w2.jsonl"),
                      timeout_s=10)
    v2 = p2.views._next_view(seen["adopted"], 5)
    assert (v2.members, v2.joiners) == ((0, 1, 2), (1,)), "the next view of the step admits it again"


def test_a_joiner_marked_dead_after_it_asked_is_not_admitted(tmp_path: Path):
    """The incarnation that asked died before the boundary (its mark is newer than its request): admitting it
    would cost a view whose members wait for a process that is gone."""
    store = JobStore.host("127.0.0.1", 0, clients=3, secret="test")
    v0 = View(gen=0, members=(0,), step=4)
    store.publish_initial(v0)
    store.beat(0)
    store.mark_dead(1, "its previous incarnation died")
    store.request_join(1, {"pid": 1})
    store.clear_dead(1)
    store.mark_dead(1, "the joiner died too")
    p = StepProtocol(Membership(store, 0, heartbeat_timeout_s=5.0), _Job(), policy=takeover_policy("spread"),
                     events=JsonlWriter(tmp_path / "w0.jsonl"), timeout_s=10)
    p.adopt(v0)
    assert not p.admit_joiners(5)
    assert p.view.gen == 0 and store.dead_mark(1) == "the joiner died too"
