"""Snapshot memory damaged after the restore was decided: the load rebuilds what it finds damaged, in the same load
(:mod:`unbroken.snapshot._load_damage`), from another holder or the parity; real shared memory, the members of a
view as threads that broadcast to each other.

The seals are authenticated, so the decision trusts them; the bytes are flipped after it, as a bad page or a
stray write would, and each member's load finds the damage only as it reads.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import pytest
import torch

from unbroken.agent._job_error import is_data_error
from unbroken.agent.template_client import Template
from unbroken.store.view import View
from unbroken.snapshot._load_damage import Damage
from unbroken.snapshot.restore import alone, decide, inventory, restore_from_memory
from unbroken.snapshot.segment import HEADER_BYTES, SECRET_ENV, SealedBuffer, SnapshotCorrupt, job_segments
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of
from _snapshot_state import trained_state

pytestmark = pytest.mark.timeout(120)

TWO_NODES = {0: 0, 1: 1, 2: 0, 3: 1}
"""Two nodes of two workers, parity 1: k = 1, two stripes; each node holds one stripe's data fragment and the
other's parity fragment, so every node loads the whole state from its own memory."""
THREE_NODES = {0: 0, 1: 1, 2: 2}
"""Three nodes of one worker, parity 1: k = 2, no node decodes alone: each fragment is sent by its holder."""


@pytest.fixture(autouse=True)
def _secret(monkeypatch) -> None:
    monkeypatch.setenv(SECRET_ENV, "the job's secret")  # every agent and worker of a job has it


def _decided(job_id: str, node_of: dict[int, int], model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Every worker snapshots step 1; the spec decided from the authenticated seals (no byte checked)."""
    for w in node_of:
        snap = Snapshotter(job_id=job_id, node=node_of[w], worker=w, node_of=node_of, every=1, redundancy="parity",
                           parity=1, config_hash="cfg", state=lambda: tensors_of(model, optimizer),
                           on_event=lambda name, **f: None)
        snap.take(1, View(gen=2, members=tuple(node_of), step=1))
        snap.close()
    invs = [inventory(job_id, n, config_hash="cfg", verify=False) for n in sorted(set(node_of.values()))]
    spec = decide(invs, checkpoint=None, members_of=lambda nodes: [w for w in node_of if node_of[w] in nodes])
    assert spec is not None and spec["source"] == "memory" and spec["members"] == sorted(node_of)
    return spec


def _flip_fragment(job_id: str, node: int, stripe: int, fragment: int) -> tuple[str, int, int]:
    """Flip 4 KiB in the middle of that fragment in its segment's file; returns (segment, offset, length)."""
    for path in job_segments(job_id, node=node):
        buf = SealedBuffer.open(path, job_id)
        assert buf is not None
        for st, fr, offset, length, _ in buf.seal["fragments"]:
            if (st, fr) == (stripe, fragment):
                with open(path, "r+b") as fh:
                    at = HEADER_BYTES + offset + length // 2
                    fh.seek(at)
                    data = fh.read(4096)
                    fh.seek(at)
                    fh.write(bytes(b ^ 0xFF for b in data))
                return path.name, offset, length
    raise AssertionError(f"node {node} holds no fragment {fragment} of stripe {stripe}")


class _Broadcasts:
    """The members of one view as threads of this process: ``broadcast(t, src)`` copies rank ``src``'s tensor."""

    def __init__(self, n: int) -> None:
        self.barrier = threading.Barrier(n, timeout=60)
        self.sent: torch.Tensor | None = None
        self.count = 0

    def of(self, rank: int) -> Callable[[torch.Tensor, int], None]:
        def broadcast(t: torch.Tensor, src: int) -> None:
            if rank == src:
                self.sent = t.clone()
                self.count += 1
            self.barrier.wait()
            if rank != src:
                assert self.sent is not None and self.sent.shape == t.shape, "members broadcast out of step"
                t.copy_(self.sent)
            self.barrier.wait()
        return broadcast


def _restore_all(job_id: str, spec: dict, node_of: dict[int, int]) -> list[tuple[dict[str, torch.Tensor], Any]]:
    """Every member restores into a fresh state at once; each member's (state, stats) or the error it raised."""
    members = tuple(sorted(node_of))
    group = _Broadcasts(len(members))

    def one(rank: int, me: int) -> tuple[dict[str, torch.Tensor], Any]:
        model, optimizer = trained_state(seed=99)  # another state: the restore must overwrite every byte
        try:
            stats = restore_from_memory(spec, job=job_id, node=node_of[me], node_of=node_of, members=members, me=me,
                                        broadcast=group.of(rank), model=model, optimizer=optimizer,
                                        device=torch.device("cpu"))
        except SnapshotCorrupt as exc:
            return {}, exc
        return tensors_of(model, optimizer), stats

    with ThreadPoolExecutor(len(members)) as pool:
        futures = [pool.submit(one, rank, w) for rank, w in enumerate(members)]
        return [f.result(timeout=90) for f in futures]


def _exact(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> bool:
    return got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_a_damaged_data_fragment_is_rebuilt_from_the_other_nodes_parity_in_the_same_load(job_id):
    """Node 0's data fragment of stripe 0 is damaged: its members find it as they read it straight into their
    tensors, and every member loads stripe 0 again, sent by node 1 from its parity; nobody fails."""
    model, optimizer = trained_state(seed=1)
    spec = _decided(job_id, TWO_NODES, model, optimizer)
    segment, offset, length = _flip_fragment(job_id, node=0, stripe=0, fragment=0)
    results = _restore_all(job_id, spec, TWO_NODES)
    want = tensors_of(model, optimizer)
    for w, (got, stats) in zip(sorted(TWO_NODES), results):
        assert not isinstance(stats, Exception), f"worker {w}: {stats}"
        assert _exact(got, want), f"worker {w} holds another state"
        assert stats["reloaded"] == 1  # stripe 0, once, by every member (the same broadcasts on all)
        damaged = [f"{segment}: bytes [{offset}, {offset + length}) do not match their checksum"]
        assert stats["damaged"] == (damaged if TWO_NODES[w] == 0 else [])


def test_a_damaged_fragment_a_holder_sends_is_replaced_by_the_parity(job_id):
    """Three nodes: no node decodes alone, each data fragment is sent by its holder. Node 0's is damaged: it
    sends zeros in its place (the others cannot tell), says so when the members agree, and stripe 0 is
    gathered again from fragment 1 and the parity."""
    model, optimizer = trained_state(seed=2)
    spec = _decided(job_id, THREE_NODES, model, optimizer)
    segment, offset, length = _flip_fragment(job_id, node=0, stripe=0, fragment=0)
    results = _restore_all(job_id, spec, THREE_NODES)
    want = tensors_of(model, optimizer)
    for w, (got, stats) in zip(sorted(THREE_NODES), results):
        assert not isinstance(stats, Exception), f"worker {w}: {stats}"
        assert _exact(got, want), f"worker {w} holds another state"
        assert stats["reloaded"] == 1 and stats["rebuilt"] == 1  # the second time through the parity
        assert [segment in d and f"[{offset}, {offset + length})" in d for d in stats["damaged"]] == \
            ([True] if w == 0 else [])


def test_damage_the_parity_cannot_cover_fails_the_load_on_every_member_alike(job_id):
    """Fragment 0 and the parity of stripe 0 are both damaged: the first round finds fragment 0, the second the
    parity, and then the one fragment left cannot decode the stripe: every member raises, none waits forever."""
    model, optimizer = trained_state(seed=3)
    spec = _decided(job_id, THREE_NODES, model, optimizer)
    parity_node = next(nd for st, fr, nd, _ in spec["holders"] if (st, fr) == (0, 2))
    _flip_fragment(job_id, node=0, stripe=0, fragment=0)
    parity_segment, _, _ = _flip_fragment(job_id, node=parity_node, stripe=0, fragment=2)
    results = _restore_all(job_id, spec, THREE_NODES)
    errors = [stats for _, stats in results]
    assert all(isinstance(e, SnapshotCorrupt) for e in errors), errors
    assert all("stripe 0 of the snapshot of step 1 can no longer be decoded" in str(e) for e in errors)
    assert parity_segment in str(errors[parity_node])  # worker i is node i's: the parity's holder names it


def test_a_process_alone_with_no_other_holder_fails_by_name(job_id):
    """A joiner loading from its own node's memory only (no group): nothing to rebuild from, so the load fails,
    naming the damaged segment and range; the next incarnation asks for a transfer."""
    model, optimizer = trained_state(seed=4)
    spec = _decided(job_id, {0: 0, 1: 1}, model, optimizer)
    segment, offset, length = _flip_fragment(job_id, node=0, stripe=0, fragment=0)
    fresh_model, fresh_optimizer = trained_state(seed=99)
    with pytest.raises(SnapshotCorrupt, match=rf"{segment}: bytes \[{offset}, {offset + length}\) do not match"):
        restore_from_memory(spec, job=job_id, node=0, node_of={0: 0, 1: 1}, members=(0,), me=0, broadcast=alone,
                            model=fresh_model, optimizer=fresh_optimizer, device=torch.device("cpu"))


def test_members_agree_on_the_union_of_their_findings():
    mine, theirs = Damage(step=5, stripes=3, fragments=2), Damage(step=5, stripes=3, fragments=2)
    mine.lost(2, 1, "seg-a: bytes [0, 9) do not match their checksum")
    theirs.lost(0, 0, "seg-b: removed")
    theirs.taint(1, "a coder's failure")
    mine.merge(theirs.encode(torch.device("cpu")))
    assert mine.bad == {(2, 1), (0, 0)} and mine.tainted == {0, 1, 2}
    assert mine.found == ["seg-a: bytes [0, 9) do not match their checksum"]  # what this member found itself


@pytest.mark.parametrize("error, data", [("SnapshotCorrupt at /x/fragment_io.py:260 in load_fragments", True),
                                         ("RuntimeError at /x/optim.py:10 in build", False),
                                         ("exit code 1", False), ("signal SIGSEGV", False)])
def test_only_an_error_about_the_data_read_is_a_data_error(error: str, data: bool):
    assert is_data_error(error) is data


def test_forked_workers_that_fail_on_damaged_memory_leave_the_template_in_place(tmp_path):
    template = Template(run_dir=tmp_path, node=0, world=4)
    lost: list[dict] = []
    template._event = lambda name, *args, **fields: lost.append({"event": name, **fields})
    corrupt = "SnapshotCorrupt at /x/unbroken/snapshot/fragment_io.py:260 in load_fragments"
    for _ in range(3):
        template.forked_failed(corrupt)
    assert template.enabled and lost == []
    template.forked_failed("RuntimeError at /x/optim.py:10 in build")
    template.forked_failed("RuntimeError at /x/optim.py:10 in build")
    assert not template.enabled and [e["event"] for e in lost] == ["template_lost"]
