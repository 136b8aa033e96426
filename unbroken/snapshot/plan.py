"""Who snapshots which bytes under a view, and which snapshot is complete.

Under a view with live workers on nodes ``nodes`` (N of them), the flat state
of S bytes is cut into ``stripes`` equal byte ranges (as many as the most
workers any node has live). Each stripe is coded into ``k + m`` fragments
(:mod:`unbroken.snapshot.erasure`); the node at position ``j`` of ``nodes``
holds:

- ``parity``: fragment ``(j + i) mod N`` of stripe ``i`` (``k = N - p`` data
  fragments, ``m = p`` parity fragments; the rotation spreads the encoding
  work, which only parity holders do, over the nodes): any ``p`` nodes may be
  lost, each node holds about ``(1 + p/(N - p)) * S / N`` bytes;
- ``replica``: fragments ``j`` and ``j - 1`` (mod N) of ``k = N`` pieces: any
  one node may be lost, ``2 S / N`` per node;
- ``none``: fragment ``j`` of ``k = N`` pieces: ``S / N`` per node.

With too few nodes for the parity asked (``N <= p``), the snapshot is taken
unprotected (``k = N``, ``m = 0``) and says so (``protected`` is False).
Within a node, stripe ``i`` is written by its ``i mod L``-th live worker (L
live workers on it), so each live worker writes about ``1/m`` of the
protected state, m the live workers. A stripe is at most
:data:`MAX_STRIPE_BYTES` (the coder takes at most 2 GiB at once, and a parity
holder stages a whole stripe in host memory to encode it): a large state is
cut into a multiple of ``L`` stripes, each worker writing every ``L``-th.
"""

from __future__ import annotations

import dataclasses
import json
from collections import defaultdict
from typing import Any, Iterable

__all__ = ["MAX_STRIPE_BYTES", "SnapshotPlan", "complete_steps", "plan_for"]

MAX_STRIPE_BYTES = 256 << 20
"""The largest stripe: bounds what a parity holder encodes (and stages) at once; liberasurecode refuses
stripes from 2 GiB on."""


@dataclasses.dataclass(frozen=True)
class SnapshotPlan:
    """The coding and the assignment of one view's snapshots."""

    scheme: str
    k: int
    m: int
    nodes: tuple[int, ...]
    stripes: int
    state_bytes: int
    protected: bool

    def stripe_range(self, i: int) -> tuple[int, int]:
        size = -(-self.state_bytes // self.stripes)
        return min(i * size, self.state_bytes), min((i + 1) * size, self.state_bytes)

    def fragments_of(self, node: int, stripe: int) -> list[int]:
        """Fragment indices of ``stripe`` the node holds."""
        j, n = self.nodes.index(node), len(self.nodes)
        if self.scheme == "replica" and n > 1:
            return [j, (j - 1) % n]
        return [(j + stripe) % n] if self.m else [j]

    def assignment(self, members: Iterable[int], node_of: dict[int, int]) -> dict[int, list[tuple[int, int]]]:
        """worker -> [(stripe, fragment)] it writes."""
        by_node: dict[int, list[int]] = defaultdict(list)
        for w in sorted(members):
            by_node[node_of[w]].append(w)
        out: dict[int, list[tuple[int, int]]] = {w: [] for w in members}
        for node, workers in by_node.items():
            for i in range(self.stripes):
                out[workers[i % len(workers)]] += [(i, f) for f in self.fragments_of(node, i)]
        return out

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"nodes": list(self.nodes)}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SnapshotPlan:
        return cls(**{**d, "nodes": tuple(d["nodes"])})


def plan_for(members: Iterable[int], node_of: dict[int, int], *, redundancy: str, parity: int,
             state_bytes: int) -> SnapshotPlan:
    """The plan of a view whose live workers are ``members`` (``node_of`` maps each to its node)."""
    members = sorted(members)
    nodes = tuple(sorted({node_of[w] for w in members}))
    per_node: dict[int, int] = defaultdict(int)
    for w in members:
        per_node[node_of[w]] += 1
    n = len(nodes)
    if redundancy == "parity" and n > parity:
        k, m, protected = n - parity, parity, True
    else:
        k, m = n, 0
        protected = redundancy == "replica" and n > 1
    per = max(per_node.values())
    stripes = per * max(1, -(-state_bytes // (per * MAX_STRIPE_BYTES)))
    return SnapshotPlan(scheme=redundancy, k=k, m=m, nodes=nodes, stripes=stripes,
                        state_bytes=state_bytes, protected=protected)


Held = dict[tuple[int, int], dict[str, Any]]
"""``(stripe, fragment) -> the seal of a buffer holding it``: one shard's complete snapshot of one step."""


def shard_of(seal: dict[str, Any]) -> tuple[int, int]:
    """``(index, degree)`` of the state a seal's snapshot holds: under HSDP (``train.shard_degree = k``) the
    workers of shard index ``i`` snapshot their shard together, apart from the other indices; else ``(0, 1)``."""
    index, degree = seal.get("shard", (0, 1))
    return int(index), int(degree)


def complete_steps(seals: Iterable[dict[str, Any]], *, shard_degree: int = 1) -> list[tuple[int, dict[int, Held]]]:
    """The steps for which the given seals hold a complete snapshot of the whole job, newest first.

    The snapshot of shard index ``i`` of step ``t`` is complete when, among seals of ``t`` and ``i`` that agree
    on plan and layout, every stripe has at least ``k`` distinct fragments; the job's is complete when each of
    its ``shard_degree`` indices' is, in one generation. Seals of another degree are not this job's layout.
    Returns ``[(t, {index: {(stripe, fragment): seal}})]``.
    """
    groups: dict[tuple, Held] = defaultdict(dict)
    for s in seals:
        index, degree = shard_of(s)
        if degree != shard_degree:
            continue
        key = (s["step"], s["gen"], index, s["layout_hash"], json.dumps(s["plan"], sort_keys=True))
        for stripe, frag, *_ in s["fragments"]:
            groups[key].setdefault((stripe, frag), s)
    whole: dict[tuple[int, int], dict[int, Held]] = defaultdict(dict)
    for key, held in groups.items():
        plan = SnapshotPlan.from_json(next(iter(held.values()))["plan"])
        per_stripe: dict[int, set[int]] = defaultdict(set)
        for stripe, frag in held:
            per_stripe[stripe].add(frag)
        if all(len(per_stripe[i]) >= plan.k for i in range(plan.stripes)):
            whole[key[:2]].setdefault(key[2], held)
    # Newest step first; of one step, the newest generation first (a restored job trains a step again under
    # a higher generation than the abandoned timeline that sealed it before).
    return [(step, shards) for (step, gen), shards in sorted(whole.items(), key=lambda t: (-t[0][0], -t[0][1]))
            if len(shards) == shard_degree]
