"""A reduction given up on, then retried, on a real store and a real two-process gloo group: the all-reduce sums
in place into the step's buffer, so the retry starts from the copy of this worker's sums kept on the host before
the reduction was posted (it does not compute them again), and the step's result is bit for bit the
undisturbed one. This process is worker 0, a child process worker 1."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from unbroken.store.job_store import JobStore
from unbroken.store.view import View

pytestmark = pytest.mark.timeout(60)

WORKER = """
import json, os, sys, torch
from pathlib import Path
from unbroken.jsonl import JsonlWriter
from unbroken.mecefo.takeover import takeover_policy
from unbroken.store.job_store import JobStore
from unbroken.runtime.membership import Membership
from unbroken.runtime.process_group import CollectiveFailed
from unbroken.runtime.protocol import StepProtocol

port, me, out = int(sys.argv[1]), int(sys.argv[2]), Path(sys.argv[3])


class Job:
    n_slots, micro_batch, device = 2, 4, torch.device("cpu")
    n_workers = n_slots
    model = optimizer = None
    computed = 0

    def gradient_sums(self, step, items):
        Job.computed += 1
        return torch.full((5,), float((me + 1) * (step + 1)))  # a new buffer of this worker's sums, each call


store = JobStore.connect(f"127.0.0.1:{port}", timeout_s=20, secret="test")
m = Membership(store, me, heartbeat_timeout_s=0.5, heartbeat_store=JobStore.connect(f"127.0.0.1:{port}",
               timeout_s=20, secret="test"))
m.start_heartbeat()
p = StepProtocol(m, Job(), policy=takeover_policy("spread"), events=JsonlWriter(out / f"w{me}.jsonl"), timeout_s=20)
given_up = []


def give_up_once(step):
    if step == 1 and not given_up:  # both members give up on step 1's all-reduce once it is posted
        given_up.append(step)
        raise CollectiveFailed("injected: the reduction is given up on")


p.on("allreduce", give_up_once)
p.adopt(store.current_view())
sums = []
for step in range(3):
    reduced, _ = p.run_step(step)
    sums.append(reduced.tolist())
(out / f"w{me}.json").write_text(json.dumps({"sums": sums, "computed": Job.computed, "gen": p.view.gen}))
m.stop()
os._exit(0)
"""


def test_a_retried_reduction_starts_from_the_kept_sums_and_equals_the_undisturbed_step(tmp_path: Path):
    store = JobStore.host("127.0.0.1", 0, clients=4, secret="test")
    store.publish_initial(View(gen=0, members=(0, 1), step=0))
    procs = [subprocess.Popen([sys.executable, "-c", WORKER, str(store.port), str(w), str(tmp_path)])
             for w in (0, 1)]
    try:
        assert [p.wait(45) for p in procs] == [0, 0]
    finally:
        for p in procs:
            p.kill()
        store.close()
    got = [json.loads((tmp_path / f"w{w}.json").read_text()) for w in (0, 1)]
    want = [[3.0 * (step + 1)] * 5 for step in range(3)]  # (1 + 2) x (step + 1): each worker's sums, once
    assert got[0]["sums"] == got[1]["sums"] == want, "a retry reduced the sums once, not the partial sum again"
    assert got[0]["computed"] == got[1]["computed"] == 3, \
        "step 1's retry reduced the sums kept before its first reduction, without computing them again"
    assert got[0]["gen"] == got[1]["gen"] == 1, "the retry ran in the next view of the same members"
