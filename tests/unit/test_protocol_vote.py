"""The commit vote of the step protocol on a real store and a real two-process gloo group.

This process is worker 0; a child process plays worker 1.
"""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from unbroken.jsonl import JsonlWriter
from unbroken.runtime.membership import Fenced, Membership, View
from unbroken.runtime.protocol import StepProtocol

CHILD = """
import os, sys, torch, torch.distributed as dist
from datetime import timedelta
from unbroken.runtime.process_group import ViewGroup
port, mode = int(sys.argv[1]), sys.argv[2]
store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=20))
store.add("hb/1", 1)
store.add("arrive/0", 1)
g = ViewGroup(store, gen=0, rank=1, size=2, device=torch.device("cpu"), timeout_s=20)
if mode == "reduce":
    g.allreduce(torch.full((3,), 2.0), lambda: None)
    assert store.compare_set("outcome/0/0", "", "commit").decode() == "commit"
sys.stdout.flush()
os._exit(0)  # mode "leave": gone before the all-reduce, its connections closed
"""


def _protocol(tmp_path: Path, store: dist.TCPStore) -> StepProtocol:
    m = Membership(store, 0, heartbeat_timeout_s=5.0)
    store.add("hb/0", 1)
    return StepProtocol(membership=m, n_slots=2, micro_batch=4, policy="spread", device=torch.device("cpu"),
                        timeout_s=20, compute=lambda step, items: torch.full((3,), 1.0),
                        pack_state=lambda: torch.zeros(1), load_state=lambda t: None,
                        events=JsonlWriter(tmp_path / "events.jsonl"))


def _run(tmp_path: Path, mode: str, pre_vote: str | None):
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, timeout=timedelta(seconds=20),
                          wait_for_workers=False)
    if pre_vote:
        store.set("outcome/0/0", pre_vote)  # another member (not modelled here) voted first
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(store.port), mode])
    p = _protocol(tmp_path, store)
    view = View(gen=0, members=(0, 1), step=0)
    p.m.publish_initial(view)
    p.adopt(view)
    try:
        return p.run_step(0), store
    finally:
        assert child.wait(30) == 0


def test_both_reduce_and_the_first_commit_vote_decides(tmp_path):
    (reduced, items), store = _run(tmp_path, "reduce", None)
    assert torch.equal(reduced, torch.full((3,), 3.0))
    assert [(i.slot, i.rows, i.mode) for i in items] == [(0, (0, 4), "exact")]
    assert store.get("outcome/0/0") == b"commit"
    (work,) = [json.loads(line) for line in (tmp_path / "events.jsonl").read_text().splitlines()
               if '"work"' in line]
    assert (work["step"], work["gen"], work["items"]) == (0, 0, [[0, 0, 4, "exact"]])


def test_told_commit_without_holding_the_reduced_gradient_the_worker_leaves(tmp_path):
    """Others completed the all-reduce and committed; this worker's failed: it must not apply anything."""
    with pytest.raises(Fenced, match="rejoins with the state"):
        _run(tmp_path, "leave", "commit")
