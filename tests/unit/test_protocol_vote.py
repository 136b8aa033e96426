"""The commit vote of the step protocol on a real store and a real two-process gloo group.

This process is worker 0; a child process plays worker 1.
"""

from __future__ import annotations

import json
import subprocess
import time
import sys
from pathlib import Path

import pytest
import torch

from unbroken.jsonl import JsonlWriter
from unbroken.mecefo.takeover import takeover_policy
from unbroken.store.job_store import JobStore
from unbroken.runtime.membership import Fenced, Membership, View
from unbroken.runtime.protocol import MemberDied, StepProtocol

CHILD = """
import os, sys, torch, torch.distributed as dist
from unbroken.store.job_store import JobStore
from unbroken.runtime.process_group import ViewGroup
from unbroken.store.view import View
port, mode = int(sys.argv[1]), sys.argv[2]
store = JobStore.connect(f"127.0.0.1:{port}", timeout_s=20, secret="test")
store.beat(1)
store.arrive(0)
g = ViewGroup(store.group_store(0), gen=0, rank=1, size=2, device=torch.device("cpu"), timeout_s=20)
if mode in ("reduce", "false-alarm"):
    g.allreduce(torch.full((3,), 2.0), lambda: None)
    assert store.vote(View(gen=0, members=(0, 1), step=0), 0, "commit") == "commit"
    store.backend.add("child voted", 1)
sys.stdout.flush()
os._exit(0)  # mode "leave": gone before the all-reduce, its connections closed
"""


class _Job:
    """The protocol's view of a job: two slots of four rows, a constant gradient."""

    n_slots, micro_batch, device = 2, 4, torch.device("cpu")
    n_workers = n_slots
    model = optimizer = None

    def gradient_sums(self, step: int, items: list) -> torch.Tensor:
        return torch.full((3,), 1.0)


def _protocol(tmp_path: Path, store: JobStore) -> StepProtocol:
    m = Membership(store, 0, heartbeat_timeout_s=5.0)
    store.beat(0)
    return StepProtocol(m, _Job(), policy=takeover_policy("spread"), events=JsonlWriter(tmp_path / "events.jsonl"),
                        timeout_s=20)


def _run(tmp_path: Path, mode: str, pre_vote: str | None, hook=None):
    store = JobStore.host("127.0.0.1", 0, clients=2, secret="test")
    view = View(gen=0, members=(0, 1), step=0)
    store.publish_initial(view)
    if pre_vote:
        store.vote(view, 0, pre_vote)  # another member (not modelled here) voted first
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(store.port), mode])
    p = _protocol(tmp_path, store)
    if hook is not None:
        p.on("allreduce", lambda step: hook(store))
    p.adopt(view)
    try:
        return p.run_step(0), store
    finally:
        assert child.wait(30) == 0


def test_both_reduce_and_the_first_commit_vote_decides(tmp_path):
    (reduced, items), store = _run(tmp_path, "reduce", None)
    assert torch.equal(reduced, torch.full((3,), 3.0))
    assert [(i.slot, i.rows, i.mode) for i in items] == [(0, (0, 4), "exact")]
    assert store.vote(View(gen=0, members=(0, 1), step=0), 0, "abort") == "commit"
    (work,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()
               if '"work"' in line]
    assert (work["step"], work["gen"], work["items"]) == (0, 0, [[0, 0, 4, "exact"]])


def test_told_commit_without_holding_the_reduced_gradient_the_worker_leaves(tmp_path):
    """Others completed the all-reduce and committed; this worker's failed: it must not apply anything."""
    with pytest.raises(Fenced, match="rejoins with the state"):
        _run(tmp_path, "leave", "commit")


def test_a_false_alarm_after_the_others_committed_costs_no_restart(tmp_path):
    """This worker gives up on the all-reduce (it wrongly thinks a peer died) after posting its part; the
    peer completes the all-reduce and commits. The worker's own all-reduce completes too: it applies the
    step like everybody else instead of leaving to rejoin."""

    def false_alarm(store: JobStore) -> None:
        while store.backend.add("child voted", 0) < 1:
            time.sleep(0.005)
        raise MemberDied("worker 1 looked dead (it was not)")

    (reduced, _), store = _run(tmp_path, "false-alarm", None, hook=false_alarm)
    assert torch.equal(reduced, torch.full((3,), 3.0))
    (late,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()
               if '"late_result"' in line]
    assert late["ok"] and late["seconds"] < 1.0
