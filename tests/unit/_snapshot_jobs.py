"""What the snapshot memory tests share: four workers on two nodes snapshotting a trained debug state, and the
restore read back from their nodes' memory."""

from __future__ import annotations

import copy
import dataclasses

import torch

from unbroken.models import build_model
from unbroken.snapshot.restore import alone, decide, inventory, restore_from_memory
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of
from unbroken.store.view import View

NODE_OF = {0: 0, 1: 0, 2: 1, 3: 1}


@dataclasses.dataclass
class TrainedState:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer


_BASE: list = []


def trained(seed: int = 0, steps: int = 1) -> TrainedState:
    """The debug model (built once) after ``steps`` AdamW steps on seeded random gradients."""
    if not _BASE:
        _BASE.append(build_model("debug", vocab_size=512, seq_len=64))
    model = copy.deepcopy(_BASE[0])
    job = TrainedState(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in job.model.parameters():
            p.grad = torch.randn(p.shape, generator=gen)
        job.optimizer.step()
    return job


def snapshot(job_id: str, job, done: int, *, redundancy: str = "parity", members=(0, 1, 2, 3),
             gen: int = 2) -> list[dict]:
    """Every worker of ``members`` snapshots ``job``'s state as step ``done`` of view ``gen``; their events."""
    events: list[dict] = []
    snaps = [Snapshotter(job_id=job_id, node=NODE_OF[w], worker=w, node_of=NODE_OF, every=1, redundancy=redundancy,
                         parity=1, config_hash="cfg", state=lambda: tensors_of(job.model, job.optimizer),
                         on_event=lambda name, **f: events.append({"event": name, **f})) for w in members]
    view = View(gen=gen, members=tuple(members), step=done)
    for s in snaps:
        s.take(done, view)
    for s in snaps:
        s.close()
    return events


def restore_spec(job_id: str, nodes=(0, 1), checkpoint=None):
    """The restore decided from ``nodes``' inventories, and the inventories."""
    invs = [inventory(job_id, n, config_hash="cfg") for n in nodes]
    return decide(invs, checkpoint=checkpoint, members_of=lambda ns: [w for w in NODE_OF if NODE_OF[w] in ns]), invs


def restore_into(job_id: str, spec, node: int, me: int):
    """Worker ``me`` loads as one process alone (the other workers of its node would load alike)."""
    fresh = trained(seed=99)  # different state: the restore must overwrite every byte
    stats = restore_from_memory(spec, job=job_id, node=node, node_of=NODE_OF, members=(me,), me=me,
                                broadcast=alone, model=fresh.model, optimizer=fresh.optimizer,
                                device=torch.device("cpu"))
    return fresh, stats


def same_state(a, b) -> bool:
    ta, tb = tensors_of(a.model, a.optimizer), tensors_of(b.model, b.optimizer)
    return ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) and ta[k].dtype == tb[k].dtype for k in ta)
