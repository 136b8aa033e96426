"""Who snapshots which bytes under a view, and which snapshot is complete.

Under a view with live workers on nodes ``nodes`` (N of them), the nodes are
split into coding *groups* and the flat state of S bytes is cut into
``stripes`` equal byte ranges, the same number for each group (as many as the
most workers any node has live, times what keeps a stripe under
:data:`MAX_STRIPE_BYTES`): group ``g`` holds stripes ``[g*s, (g+1)*s)``,
``s = stripes / groups``, and nothing of the others. Each stripe is coded
into ``k + m = G`` fragments over the G nodes of its group
(:mod:`unbroken.snapshot.erasure`); the node at position ``j`` of its group
holds:

- ``parity``: fragment ``(j + i) mod G`` of stripe ``i`` (``k = G - p`` data
  fragments, ``m = p`` parity fragments; the rotation spreads the encoding
  work, which only parity holders do, over the group): any ``p`` nodes of
  each group may be lost, each node holds about ``(1 + p/(G - p)) * S / N``
  bytes;
- ``replica``: fragments ``j`` and ``j - 1`` (mod N) of ``k = N`` pieces: any
  one node may be lost, ``2 S / N`` per node;
- ``none``: fragment ``j`` of ``k = N`` pieces: ``S / N`` per node.

Groups (``parity`` only; ``replica`` and ``none`` are one group of all N
nodes, their coding has no limit): at most ``group_nodes`` nodes each
(``snapshot.group_nodes``; the coder takes at most
:data:`~unbroken.snapshot.erasure.MAX_FRAGMENTS` fragments per stripe, one a
node), ``ceil(N / group_nodes)`` of them, sizes as even as possible (they
differ by at most one: the remainder is spread one node apiece over the first
groups, never left as a small group of its own). Node ``nodes[i]`` is in group
``i mod groups``: consecutive nodes (often one rack) land in different groups.
With ``N > group_nodes`` every group holds more than ``group_nodes / 2 - 1``
nodes, so ``group_nodes >= 2 (p + 1)`` (``config.validation``) leaves every
group at least one data fragment. Up to ``group_nodes`` nodes: one group, the
plan of a job without groups.

With too few nodes for the parity asked (``N <= p``), the snapshot is taken
unprotected (``k = N``, ``m = 0``) and says so (``protected`` is False).
Within a node, stripe ``i`` is written by its ``i mod L``-th live worker (L
live workers on it), so each live worker writes about ``1/m`` of the
protected state, m the live workers. A stripe is at most
:data:`MAX_STRIPE_BYTES` (the coder takes at most 2 GiB at once, and a parity
holder stages a whole stripe in host memory to encode it): a large state is
cut into a multiple of ``L`` stripes per group, each worker writing every
``L``-th.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from collections import defaultdict
from typing import Any, Iterable

from unbroken.snapshot.erasure import MAX_FRAGMENTS, Coding

__all__ = ["GROUP_NODES", "MAX_STRIPE_BYTES", "SnapshotPlan", "complete_steps", "plan_for", "split_groups"]

MAX_STRIPE_BYTES = 256 << 20
"""The largest stripe: bounds what a parity holder encodes (and stages) at once; liberasurecode refuses
stripes from 2 GiB on."""
GROUP_NODES = 16
"""``snapshot.group_nodes``' default: the most nodes one stripe is coded over (``parity``)."""


@dataclasses.dataclass(frozen=True)
class SnapshotPlan:
    """The coding and the assignment of one view's snapshots."""

    scheme: str
    m: int
    nodes: tuple[int, ...]
    groups: tuple[tuple[int, ...], ...]
    """The coding groups: a partition of ``nodes`` (one group but under ``parity`` with more than
    ``group_nodes`` nodes)."""
    stripes: int
    state_bytes: int
    protected: bool

    @property
    def k(self) -> int:
        """Data fragments per stripe of the largest group (of every stripe when the groups are one size)."""
        return max(len(g) for g in self.groups) - self.m

    @property
    def group_stripes(self) -> int:
        """Stripes each group holds."""
        return self.stripes // len(self.groups)

    def group_of(self, stripe: int) -> int:
        """The index of the group that codes and holds ``stripe``."""
        return stripe // self.group_stripes

    def k_of(self, stripe: int) -> int:
        """Data fragments of ``stripe``: its group's nodes less the parity."""
        return len(self.groups[self.group_of(stripe)]) - self.m

    def coding(self, stripe: int) -> Coding:
        """The coding of ``stripe`` (its group's)."""
        return _coding(self.k_of(stripe), self.m)

    def stripes_of(self, node: int) -> range:
        """The stripes ``node``'s group holds (the node holds fragments of each)."""
        g = self._index[node]
        return range(g * self.group_stripes, (g + 1) * self.group_stripes)

    def stripe_range(self, i: int) -> tuple[int, int]:
        size = -(-self.state_bytes // self.stripes)
        return min(i * size, self.state_bytes), min((i + 1) * size, self.state_bytes)

    def fragments_of(self, node: int, stripe: int) -> list[int]:
        """Fragment indices of ``stripe`` the node holds (none if the stripe is another group's)."""
        group = self.groups[self.group_of(stripe)]
        if self._index.get(node) != self.group_of(stripe):
            return []
        j, n = group.index(node), len(group)
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
            for i in self.stripes_of(node):
                out[workers[i % len(workers)]] += [(i, f) for f in self.fragments_of(node, i)]
        return out

    @functools.cached_property
    def _index(self) -> dict[int, int]:
        """node -> the index of its group (computed once per plan: a job's plan may have thousands of nodes)."""
        return {node: g for g, group in enumerate(self.groups) for node in group}

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self) | {"nodes": list(self.nodes), "groups": [list(g) for g in self.groups]}

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> SnapshotPlan:
        nodes = tuple(d["nodes"])
        # A seal written before groups existed names one k for all the nodes: one group
        groups = tuple(tuple(g) for g in d.get("groups", [nodes]))
        return cls(**{**{f: v for f, v in d.items() if f != "k"}, "nodes": nodes, "groups": groups})


@functools.lru_cache(maxsize=64)
def _coding(k: int, m: int) -> Coding:
    return Coding(k, m)


def split_groups(nodes: tuple[int, ...], group_nodes: int) -> tuple[tuple[int, ...], ...]:
    """``nodes`` in ``ceil(N / group_nodes)`` groups of sizes as even as possible, node ``i`` in group
    ``i mod groups``.

    Raises:
        ValueError: ``group_nodes`` not in ``1..MAX_FRAGMENTS``.
    """
    if not 1 <= group_nodes <= MAX_FRAGMENTS:
        raise ValueError(f"snapshot.group_nodes={group_nodes}: must be in 1..{MAX_FRAGMENTS} (the coder codes at "
                         f"most {MAX_FRAGMENTS} fragments of a stripe, one a node)")
    count = max(1, -(-len(nodes) // group_nodes))
    return tuple(nodes[g::count] for g in range(count))


def plan_for(members: Iterable[int], node_of: dict[int, int], *, redundancy: str, parity: int,
             state_bytes: int, group_nodes: int = GROUP_NODES) -> SnapshotPlan:
    """The plan of a view whose live workers are ``members`` (``node_of`` maps each to its node); under
    ``parity``, coded in groups of at most ``group_nodes`` nodes (module docstring).

    Raises:
        ValueError: ``group_nodes`` out of range, or a group too small for ``parity`` (the config's
            validation refuses both first).
    """
    members = sorted(members)
    nodes = tuple(sorted({node_of[w] for w in members}))
    per_node: dict[int, int] = defaultdict(int)
    for w in members:
        per_node[node_of[w]] += 1
    n = len(nodes)
    groups: tuple[tuple[int, ...], ...] = (nodes,)
    if redundancy == "parity" and n > parity:
        groups = split_groups(nodes, group_nodes)
        m, protected = parity, True
        if min(len(g) for g in groups) <= parity:
            raise ValueError(f"snapshot.group_nodes={group_nodes}: {n} nodes split into groups of "
                             f"{min(len(g) for g in groups)} nodes, too few for snapshot.parity={parity}: "
                             f"set snapshot.group_nodes >= {2 * (parity + 1)}")
    else:
        m = 0
        protected = redundancy == "replica" and n > 1
    per = max(per_node.values())
    unit = per * len(groups)
    stripes = unit * max(1, -(-state_bytes // (unit * MAX_STRIPE_BYTES)))
    return SnapshotPlan(scheme=redundancy, m=m, nodes=nodes, groups=groups, stripes=stripes,
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
    on plan and layout, every stripe has at least ``k`` distinct fragments (its group's ``k``); the job's is
    complete when each of its ``shard_degree`` indices' is, in one generation. Seals of another degree are not
    this job's layout.
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
        if all(len(per_stripe[i]) >= plan.k_of(i) for i in range(plan.stripes)):
            whole[key[:2]].setdefault(key[2], held)
    # Newest step first; of one step, the newest generation first (a restored job trains a step again under
    # a higher generation than the abandoned timeline that sealed it before).
    return [(step, shards) for (step, gen), shards in sorted(whole.items(), key=lambda t: (-t[0][0], -t[0][1]))
            if len(shards) == shard_degree]
