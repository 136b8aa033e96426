"""A preemption's stop carried in the step's own reduction, on a real store and a real two-process gloo group.

Child processes play workers 0 (the view's leader), 1 (and 2) and run the step protocol with a real
:class:`~unbroken.mecefo.gradients.GradLayout` as the word's carrier. The leader asks the job to stop before
step 3; each worker counts the store reads of its own connection that name a stop key.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from unbroken.store.job_store import JobStore
from unbroken.store.view import View

pytestmark = pytest.mark.timeout(120)

ASK_AT, STEPS = 3, 10

WORKER = """
import json, os, sys, torch
from unbroken.jsonl import JsonlWriter
from unbroken.mecefo.gradients import GradLayout
from unbroken.mecefo.takeover import takeover_policy
from unbroken.runtime.membership import Membership
from unbroken.runtime.protocol import StepProtocol
from unbroken.store.job_store import JobStore
from unbroken.store.view import View

port, me, word, events, ask_at, steps, n, leader_dies = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "word", \\
    sys.argv[4], int(sys.argv[5]), int(sys.argv[6]), int(sys.argv[7]), sys.argv[8] == "dies"
store = JobStore.connect(f"127.0.0.1:{port}", timeout_s=20, secret="test")
stop_reads = []
peek = store.backend.peek
def counting_peek(keys):
    stop_reads.extend(k for k in keys if k.startswith("stop/"))
    return peek(keys)
store.backend.peek = counting_peek


class OneGroup:
    group_names = ("all",)

    def group_of(self, name):
        return 0


class Job:
    n_slots, micro_batch, device = n, 4, torch.device("cpu")
    n_workers = n_slots
    model, optimizer = torch.nn.Linear(2, 1), None
    layout = GradLayout(model, OneGroup())

    def gradient_sums(self, step, items):
        buf = self.layout.new_buffer()
        buf[: self.layout.n_grad] = 1.0
        return buf


job = Job()
store.beat(me)
p = StepProtocol(Membership(store, me, heartbeat_timeout_s=60.0), job, policy=takeover_policy("spread"),
                 events=JsonlWriter(events), timeout_s=30, announcer=job.layout if word else None)
def agree_and_die(step):  # the leader agrees the stop after the step in flight, then dies before posting it
    if step == ask_at:
        store.agree_stop(step + 1)
        store.mark_dead(me, "killed by the test")  # as its agent would
        os._exit(0)


if me == 0 and leader_dies:
    p.on("backward", agree_and_die)
p.adopt(View(gen=0, members=tuple(range(n)), step=0))
applied = 0
for step in range(steps):
    if me == 0 and step == ask_at:
        store.request_stop()  # as an agent does on a preemption's signal
    reduced, _ = p.run_step(step)
    applied = step + 1
    if p.views.stops_after(reduced, step):
        break
print(json.dumps({"applied": applied, "stop_reads": len(stop_reads)}))
sys.stdout.flush()
os._exit(0)
"""


def _run(tmp_path: Path, carrier: str, n: int = 2, leader_dies: bool = False) -> tuple[dict[int, dict[str, int]],
                                                                                         JobStore]:
    store = JobStore.host("127.0.0.1", 0, clients=n + 1, secret="test")
    store.publish_initial(View(gen=0, members=tuple(range(n)), step=0))
    procs = {w: subprocess.Popen([sys.executable, "-c", WORKER, str(store.port), str(w), carrier,
                                  str(tmp_path / f"w{w}.jsonl"), str(ASK_AT), str(STEPS), str(n),
                                  "dies" if leader_dies else "lives"],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in range(n)}
    got = {}
    for w, proc in procs.items():
        out, err = proc.communicate(timeout=100)
        assert proc.returncode == 0, err[-3000:]
        if out.strip():
            got[w] = json.loads(out.strip().splitlines()[-1])
    return got, store


def test_only_the_leader_reads_the_stop_keys_and_every_member_stops_after_the_same_step(tmp_path):
    got, store = _run(tmp_path, "word")
    assert store.stop_point() == (True, ASK_AT + 1), "the leader agreed the step in flight as the last"
    assert got[0]["applied"] == got[1]["applied"] == ASK_AT + 1, got
    assert got[1]["stop_reads"] == 0, "a member learns the stop from the step's reduction, not from the store"
    assert got[0]["stop_reads"] == 2 * (ASK_AT + 1), "the leader reads both stop keys once per step"


def test_without_a_word_every_member_reads_the_agreed_step_and_stops_alike(tmp_path):
    """No word in the reduction (as under HSDP): the store's agreed step, read by every member, stops them."""
    got, store = _run(tmp_path, "none")
    assert store.stop_point() == (True, ASK_AT + 1)
    assert got[0]["applied"] == got[1]["applied"] == ASK_AT + 1, got
    assert got[1]["stop_reads"] == 2 * (ASK_AT + 1), "one read after each step's reduction"


def test_a_stop_its_dead_leader_agreed_is_carried_by_the_step_retried_in_the_next_view(tmp_path):
    """Worker 0, the leader, agrees the stop after step 3 and dies before posting that step's reduction: the
    survivors retry the step in a view of their own, whose leader reads the agreed step and says it is the last."""
    got, store = _run(tmp_path, "word", n=3, leader_dies=True)
    assert 0 not in got, "worker 0 died in step 3"
    assert store.stop_point() == (True, ASK_AT + 1) and store.gen() == 1, "the step was retried in view 1"
    assert got[1]["applied"] == got[2]["applied"] == ASK_AT + 1, got
    assert got[2]["stop_reads"] == 0 and got[1]["stop_reads"] > 0, got
