"""A preemption's stop carried in the step's own reduction, on a real store and a real two-process gloo group.

Two child processes play workers 0 (the view's leader) and 1 and run the step protocol with a real
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

port, me, word, events, ask_at, steps = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "word", sys.argv[4], \\
    int(sys.argv[5]), int(sys.argv[6])
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
    n_slots, micro_batch, device = 2, 4, torch.device("cpu")
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
p.adopt(View(gen=0, members=(0, 1), step=0))
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


def _run(tmp_path: Path, carrier: str) -> tuple[dict[int, dict[str, int]], JobStore]:
    store = JobStore.host("127.0.0.1", 0, clients=3, secret="test")
    store.publish_initial(View(gen=0, members=(0, 1), step=0))
    procs = {w: subprocess.Popen([sys.executable, "-c", WORKER, str(store.port), str(w), carrier,
                                  str(tmp_path / f"w{w}.jsonl"), str(ASK_AT), str(STEPS)],
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for w in (0, 1)}
    got = {}
    for w, proc in procs.items():
        out, err = proc.communicate(timeout=100)
        assert proc.returncode == 0, err[-3000:]
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
