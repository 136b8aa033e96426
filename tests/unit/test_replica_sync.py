"""ReplicaSync on a real two-rank gloo group: this process is shard index 0 of a replica, a child index 1."""

from __future__ import annotations

import json
import subprocess
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

from unbroken.sharding.hsdp import ReplicaSync

CHILD = """
import json, os, sys, torch, torch.distributed as dist
from datetime import timedelta
from unbroken.sharding.hsdp import ReplicaSync
store = dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=20))
pg = dist.ProcessGroupGloo(dist.PrefixStore("replica", store), 1, 2, timedelta(seconds=20))
sync = ReplicaSync(pg, 2, torch.device("cpu"), timeout_s=20)
out = [sync.agree(True, False), sync.agree(False, False, bad=True), sync.agree(True, False, marks=[1, 0, 1]),
       sync.boundary(1, 7), sync.boundary(0, -1), sync.boundary(1, -1)]
print(json.dumps(out), flush=True)
os._exit(0)  # leaves rank 0 alone in its next collective
"""


def test_the_replica_learns_whether_every_rank_reduced_the_leader_admits_and_a_part_is_not_finite():
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=20))
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(store.port)], stdout=subprocess.PIPE, text=True)
    pg = dist.ProcessGroupGloo(dist.PrefixStore("replica", store), 0, 2, timedelta(seconds=20))
    sync = ReplicaSync(pg, 2, torch.device("cpu"), timeout_s=20)
    mine = [sync.agree(True, True), sync.agree(True, False), sync.agree(True, False, marks=[0, 0, 1]),
            sync.boundary(1, -1), sync.boundary(0, 3), sync.boundary(1, -1)]
    theirs = json.loads(child.communicate(timeout=30)[0])
    # the parameter check's marks are summed over the replica's ranks (runtime/param_check.py)
    assert mine == [(True, True, False, []), (False, False, True, []), (True, False, False, [1, 0, 2]), 7, 3, -2], \
        "a placeholder that arrives is no sender's value"
    assert theirs == [[True, True, False, []], [False, False, True, []], [True, False, False, [1, 0, 2]], 7, 3, -2], \
        "both ranks learn the same"
    assert sync.agree(True, False) is None, "a rank gone: the collective fails, it does not hang"
    assert sync.boundary(1, -1) == -2
