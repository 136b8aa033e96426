"""The typed job store on a real TCPStore and a real 3-member etcd cluster: key schema, votes, races between
processes, pruning."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unbroken.jsonl import JsonlWriter
from unbroken.mecefo.takeover import takeover_policy
from unbroken.store.job_store import JobStore
from unbroken.runtime.membership import Membership
from unbroken.runtime.protocol import StepProtocol
from unbroken.store.view import View


@pytest.fixture(params=["tcp", "etcd"])
def store(request):
    """A fresh job store on each backend; ``store.addr`` is the address a client connects to."""
    if request.param == "tcp":
        s = JobStore.host("127.0.0.1", 0, clients=3, secret="test")
        s.addr = f"127.0.0.1:{s.port}"
        yield s
        del s
        return
    cluster = request.getfixturevalue("etcd_cluster")
    s = JobStore.create_on_etcd(cluster.url, timeout_s=10, secret=f"test-{request.node.name}", job={"test": 1})
    s.addr = cluster.url
    yield s
    s.backend.clear()


def test_views_open_their_outcome_and_proposals_agree(store):
    v0 = View(gen=0, members=(0, 1, 2), step=5)
    store.publish_initial(v0)
    store.publish_initial(View(gen=0, members=(0,), step=9))  # a second publisher changes nothing
    assert store.current_view() == v0
    mine = View(gen=1, members=(0, 2), step=5, reason="dead [1]")
    theirs = View(gen=1, members=(0, 1), step=5, reason="dead [2]")
    assert store.propose(v0, mine) == mine
    assert store.propose(v0, theirs) == mine, "the first proposal wins"
    assert store.gen() == 1
    assert store.vote(mine, 5, "abort") == "abort"
    assert store.vote(mine, 5, "commit") == "abort"


def test_progress_counts_the_steps_the_views_leader_applied_not_the_ones_decided(store):
    """A step's outcome is decided by the first member whose all-reduce completed, while others may still be in
    theirs: the job's progress (what faults "at step N" and the launcher go by) is the applied steps, published
    by the leader's heartbeat thread (a restore sets it back)."""
    assert store.progress() is None
    v0 = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(v0)
    assert store.progress() == 0
    assert store.vote(v0, 0, "commit") == "commit" and store.progress() == 0, "decided, not yet applied"
    leader = Membership(store, 0, heartbeat_timeout_s=2.0)
    leader.applied(0, v0.step, 1)
    leader._publish()
    assert store.progress() == 1
    leader.applied(0, v0.step, 3)
    leader._publish()
    leader._publish()  # nothing new: nothing added twice
    assert store.progress() == 3
    v1 = store.propose(v0, View(gen=1, members=(0,), step=3, reason="dead [1]"))
    assert store.progress() == 3
    leader.applied(1, v1.step, 5)
    leader._publish()
    assert store.progress() == 5
    store.set_progress(7)  # a restore's step, later than what the view reached
    assert store.progress() == 7


def test_a_vote_on_a_pruned_view_is_stale_and_creates_nothing(store):
    v0 = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(v0)
    v1 = store.propose(v0, View(gen=1, members=(0, 1), step=3))
    assert store.vote(v1, 3, "commit") == "commit"
    assert store.vote(v1, 2, "abort") == "commit", "a later step decided: this one committed"
    before = store.num_keys()
    assert store.prune(1) == 1 and store.prune(1) == 0
    after = store.num_keys()
    assert after == before - 2 + 1, "view/0 and outcome/0 gone, the prune marker set"
    assert store.vote(v0, 0, "abort") == "stale"
    assert store.num_keys() == after, "the stale vote re-created nothing"


def test_node_registration_and_standby_offer(store):
    assert store.claim_node(0, "a") == "a" and store.claim_node(0, "b") == "a"
    assert not store.node_released(0) and store.node_released(1)
    store.release_node(0, "a")
    assert store.node_released(0)
    store.standby_announce(0, 42)
    assert store.standby_ready_pid(0) == "42"
    offer = store.standby_offer(0, 3, "1,4", restore_gen=7)
    assert offer and not store.standby_offer(0, 2, "")
    assert store.standby_settle(0, offer, 42, retract=False) is None, "not claimed yet"
    assert store.standby_claim(0, 42) == (3, "1,4", 7), "the refused second offer changed nothing"
    assert store.standby_settle(0, offer, 42, retract=True) is True
    assert store.standby_ready_pid(0) is None
    offer = store.standby_offer(0, 5, "")
    assert offer and store.standby_settle(0, offer, 42, retract=True) is False
    assert store.standby_claim(0, 42) is None, "a retracted offer cannot be claimed"


RACER = """
import json, sys
from unbroken.store.job_store import JobStore
from unbroken.store.view import View
addr, me, rounds, secret = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
store = JobStore.connect(addr, timeout_s=20, secret=secret)
store.backend.add("ready", 1)
while store.backend.add("ready", 0) < 2:
    pass
won = []
current = View(gen=0, members=(0, 1, 2), step=0)
for r in range(rounds):
    mine = View(gen=r + 1, members=(me,), step=r, reason=f"proposed by {me}")
    current = store.propose(current, mine)
    won.append([current.reason, store.vote(current, r, "commit" if me == 0 else "abort")])
print(json.dumps(won))
"""


@pytest.mark.timeout(600)
def test_compare_and_set_races_between_two_processes_have_one_winner(store, request):
    store.publish_initial(View(gen=0, members=(0, 1, 2), step=0))
    rounds = 300 if "tcp" in request.node.name else 40  # etcd: each round is several round trips
    secret = "test" if "tcp" in request.node.name else f"test-{request.node.name}"
    procs = [subprocess.Popen([sys.executable, "-c", RACER, store.addr, str(me), str(rounds), secret],
                              stdout=subprocess.PIPE, text=True) for me in (0, 1)]
    outs = [json.loads(p.communicate()[0]) for p in procs]  # the racers end when their rounds do
    assert all(p.returncode == 0 for p in procs)
    assert outs[0] == outs[1], "both processes saw the same winning view and outcome in every round"
    for reason, outcome in outs[0]:
        assert reason in ("proposed by 0", "proposed by 1")
        assert outcome in ("commit", "abort")
    assert store.gen() == rounds


class _Job:
    """A job of one slot whose gradient is a constant: the protocol's bookkeeping is what is measured."""

    n_slots, micro_batch, device = 1, 2, torch.device("cpu")
    n_workers = n_slots
    model = optimizer = None

    def gradient_sums(self, step: int, items: list) -> torch.Tensor:
        return torch.ones(4)


def test_the_key_count_stays_bounded_over_steps_and_view_changes(store, tmp_path: Path, request):
    m = Membership(store, 0, heartbeat_timeout_s=0.05)
    store.beat(0)
    p = StepProtocol(m, _Job(), policy=takeover_policy("spread"), events=JsonlWriter(tmp_path / "w0.jsonl"),
                     timeout_s=10)
    store.publish_initial(View(gen=0, members=(0,), step=0))
    p.adopt(store.current_view())
    counts = []
    n = 1000 if "tcp" in request.node.name else 250  # etcd: the same view changes in fewer steps (its round trips)
    for step in range(n):
        if step % (n // 5) == n // 10:
            p.reconfigure_at_start(step, "test: a new view")  # a membership change mid-run
        reduced, _ = p.run_step(step)
        assert torch.equal(reduced, torch.ones(4))
        counts.append(store.num_keys())
    assert p.view.gen == 5
    # After the first view change the count never moves again: each new view's keys replace the old ones
    # (they are pruned at the new view's first commit), and no key is per step.
    assert set(counts[n // 10:]) == {counts[-1]}
    if "tcp" in request.node.name:
        g = p.view.gen
        assert sorted(store.backend.server._data) == sorted([
            f"arrive/{g}", "deaths", "gen", "hb/0", f"items/{g}/0", f"outcome/{g}", f"pg/{g}/0/0", "prog/0",
            "pruned", f"view/{g}"]), "one view's keys, the liveness counters, the deaths counter and the prune marker"
    else:  # etcd: step 0 may still count a key of the group's rendezvous that goes soon after
        assert counts[0] + 2 <= counts[-1] <= counts[0] + 3
