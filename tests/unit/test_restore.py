"""Restoring from snapshot memory when a member dies during the restore (3 nodes, parity 1).

With three nodes no node holds enough fragments of a stripe to decode it alone,
so each chosen fragment is sent by a member on its node. A member that died in
the restore's admission leaves the next view with the same holders: the
loader must choose only fragments on nodes that still have a live member, and
say plainly when those cannot decode a stripe any more.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import pytest
import torch

from unbroken.store.view import View
from unbroken.snapshot.restore import decide, inventory, restore_from_memory
from unbroken.snapshot.segment import SnapshotCorrupt
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of
from _snapshot_state import ThreadBroadcasts, trained_state

pytestmark = pytest.mark.timeout(120)

NODE_OF = {0: 0, 1: 1, 2: 2}
"""Three nodes of one worker each: k = 2 data fragments and 1 parity fragment per stripe, one per node."""


def _snapshot_of_every_node(job_id: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Every worker snapshots step 1 under a view of all three; the restore spec of the three nodes."""
    snaps = [Snapshotter(job_id=job_id, node=NODE_OF[w], worker=w, node_of=NODE_OF, every=1, redundancy="parity",
                         parity=1, config_hash="cfg", state=lambda: tensors_of(model, optimizer),
                         on_event=lambda name, **f: None) for w in NODE_OF]
    for s in snaps:
        s.take(1, View(gen=2, members=tuple(NODE_OF), step=1))
    for s in snaps:
        s.close()
    invs = [inventory(job_id, n, config_hash="cfg") for n in sorted(set(NODE_OF.values()))]
    spec = decide(invs, checkpoint=None, members_of=lambda nodes: [w for w in NODE_OF if NODE_OF[w] in nodes])
    assert spec["source"] == "memory" and spec["members"] == [0, 1, 2]
    assert {h[2] for h in spec["holders"]} == {0, 1, 2}
    return spec


def _restore(job_id: str, spec: dict, members: tuple[int, ...], me: int,
             broadcast: Callable[[torch.Tensor, int], None]) -> tuple[torch.nn.Module, torch.optim.Optimizer, dict]:
    model, optimizer = trained_state(seed=99)  # another state: the restore must overwrite every byte
    stats = restore_from_memory(spec, job=job_id, node=NODE_OF[me], node_of=NODE_OF, members=members, me=me,
                                broadcast=broadcast, model=model, optimizer=optimizer, device=torch.device("cpu"))
    return model, optimizer, stats


def test_survivors_of_a_restore_read_only_nodes_with_live_members(job_id):
    """Worker 0 (node 0) died during the restore: workers 1 and 2 decode from nodes 1 and 2, parity included."""
    model, optimizer = trained_state(seed=1)
    spec = _snapshot_of_every_node(job_id, model, optimizer)
    members = (1, 2)
    group = ThreadBroadcasts(len(members))
    with ThreadPoolExecutor(len(members)) as pool:
        futures = [pool.submit(_restore, job_id, spec, members, w, group.of(rank)) for rank, w in enumerate(members)]
        results = [f.result(timeout=90) for f in futures]
    want = tensors_of(model, optimizer)
    for got_model, got_optimizer, stats in results:
        got = tensors_of(got_model, got_optimizer)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
        assert stats["rebuilt"] == 1 and stats["received"] == 1  # stripe 0 from fragments 1 and 2 (parity)


def test_a_stripe_the_live_nodes_cannot_decode_is_refused_by_name(job_id):
    model, optimizer = trained_state(seed=1)
    spec = _snapshot_of_every_node(job_id, model, optimizer)
    with pytest.raises(SnapshotCorrupt, match=r"stripe 0 of the snapshot of step 1 can no longer be decoded: it "
                                              r"needs 2 fragments, the nodes with live members \[1\] hold 1"):
        _restore(job_id, spec, (1,), 1, lambda t, src: None)
