"""Snapshots under HSDP: the workers of each shard index snapshot their shard together, apart from the others.

2 nodes x 2 workers, ``train.shard_degree = 2``: replica r is node r, shard index i is held by workers i and
2 + i (one per node). The two indices' states have the same shapes here (so the same layout hash), different
values: only the seal's shard index keeps them apart. A step is restorable only once every index's snapshot
of it is complete; a job of another shard degree passes over them.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import pytest
import torch

from _snapshot_state import trained_state
from unbroken.store.view import View
from unbroken.snapshot.plan import complete_steps
from unbroken.snapshot.restore import decide, inventory, restore_from_memory, shard_spec
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of

pytestmark = pytest.mark.timeout(120)

NODE_OF = {0: 0, 1: 0, 2: 1, 3: 1}
K = 2


def _snapshotters(job_id: str, states: dict[int, tuple]) -> list[Snapshotter]:
    """One per worker; worker w holds shard index w % K (whose state is ``states[w % K]``)."""
    out = []
    for w in NODE_OF:
        model, optimizer = states[w % K]
        out.append(Snapshotter(job_id=job_id, node=NODE_OF[w], worker=w, node_of=NODE_OF, every=1,
                               redundancy="parity", parity=1, config_hash="cfg",
                               state=lambda m=model, o=optimizer: tensors_of(m, o), on_event=lambda name, **f: None,
                               shard=(w % K, K), holders=lambda members, i=w % K: [m for m in members if m % K == i]))
    return out


def _inventories(job_id: str) -> list[dict]:
    return [inventory(job_id, n, config_hash="cfg") for n in (0, 1)]


def _restore(job_id: str, spec: dict, index: int) -> list[dict[str, torch.Tensor]]:
    """The holders of ``index`` (threads of this process) load its snapshot; the state each ends with."""
    members = tuple(w for w in NODE_OF if w % K == index)
    barrier, box = threading.Barrier(len(members), timeout=60), {}

    def broadcast_of(rank: int) -> Callable[[torch.Tensor, int], None]:
        def broadcast(t: torch.Tensor, src: int) -> None:
            if rank == src:
                box["t"] = t.clone()
            barrier.wait()
            if rank != src:
                t.copy_(box["t"])
            barrier.wait()
        return broadcast

    def one(me: int) -> dict[str, torch.Tensor]:
        model, optimizer = trained_state(seed=99)  # another state: every byte must be overwritten
        restore_from_memory(shard_spec(spec, index), job=job_id, node=NODE_OF[me], node_of=NODE_OF, members=members,
                            me=me, broadcast=broadcast_of(members.index(me)), model=model, optimizer=optimizer,
                            device=torch.device("cpu"))
        return {k: v.clone() for k, v in tensors_of(model, optimizer).items() if k != "rng.cpu"}

    with ThreadPoolExecutor(len(members)) as pool:
        return list(pool.map(one, members))


def test_each_shard_index_is_snapshotted_and_restored_by_its_own_holders(job_id):
    states = {0: trained_state(seed=1), 1: trained_state(seed=2)}
    snaps = _snapshotters(job_id, states)
    view = View(gen=3, members=tuple(NODE_OF), step=5)
    for s in snaps:
        s.take(5, view)
    for s in snaps[:3]:  # step 6: every worker but 3 (index 1 on node 1)
        s.take(6, View(gen=3, members=tuple(NODE_OF), step=6))
    for s in snaps:
        s.close()

    seals = [s for inv in _inventories(job_id) for s in inv["seals"]]
    assert sorted((s["worker"], s["step"], tuple(s["shard"])) for s in seals) == [
        (0, 5, (0, 2)), (0, 6, (0, 2)), (1, 5, (1, 2)), (1, 6, (1, 2)), (2, 5, (0, 2)), (2, 6, (0, 2)),
        (3, 5, (1, 2))]
    # Index 1 of step 6 is only on node 0 (parity 1 over its holders' 2 nodes: k = 1, either node decodes): the
    # step is complete for both indices. Without worker 1's buffer of step 6, index 1 of step 6 is missing.
    assert [step for step, _ in complete_steps(seals, shard_degree=2)] == [6, 5]
    no_w1_at_6 = [s for s in seals if not (s["worker"] == 1 and s["step"] == 6)]
    assert [step for step, _ in complete_steps(no_w1_at_6, shard_degree=2)] == [5]
    assert complete_steps(seals, shard_degree=1) == []  # another layout: not this job's

    spec = decide(_inventories(job_id), checkpoint=None, shard_degree=2,
                  members_of=lambda nodes: [w for w in NODE_OF if NODE_OF[w] in nodes])
    assert (spec["source"], spec["step"], spec["members"], len(spec["shards"])) == ("memory", 6, [0, 1, 2, 3], 2)
    for index in (0, 1):
        part = shard_spec(spec, index)
        writers = {int(seg.split("-w")[1].split("-")[0]) for *_, seg in part["holders"]}
        assert writers <= {index, index + K} and part["step"] == 6, part["holders"]
        want = {k: v for k, v in tensors_of(*states[index]).items() if k != "rng.cpu"}
        for got in _restore(job_id, spec, index):
            assert got.keys() == want.keys()
            assert all(torch.equal(got[k], want[k]) for k in want), index
    assert decide(_inventories(job_id), checkpoint=None, shard_degree=1, members_of=lambda nodes: []) is None
