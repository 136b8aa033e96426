"""Who owns which slice of the flat parameter vector, and who keeps a copy of it.

The flat vector is every trainable parameter in ``model.named_parameters()``
order (the gradient layout's order), ``total`` elements. Under a view of ``m``
members (ascending worker ids) the member of rank ``r`` owns the contiguous
range :func:`shard_range` ``(total, m, r)``: sizes differ by at most one
element, and the ranges cover ``[0, total)`` in rank order.

A shard's moments are unique state: the ring (:func:`ring_buddies`) names the
member that keeps a copy of each, on the next node that has members (the same
position there, modulo its member count), so the loss of one whole node loses
no shard. On a single node the ring runs over the members themselves (a
worker's death is covered, not the node's).
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict
from typing import Iterable

__all__ = ["Sharding", "ring_buddies", "shard_range"]


def shard_range(total: int, m: int, r: int) -> tuple[int, int]:
    """``[lo, hi)`` of rank ``r`` of ``m`` over ``total`` elements (the first ``total % m`` get one more)."""
    if m < 1 or not 0 <= r < m:
        raise ValueError(f"rank {r} of {m} members is not a rank")
    base, extra = divmod(total, m)
    lo = r * base + min(r, extra)
    return lo, lo + base + (1 if r < extra else 0)


@dataclasses.dataclass(frozen=True)
class Sharding:
    """The ranges of one set of members (ascending worker ids) over ``total`` elements."""

    members: tuple[int, ...]
    total: int

    def range_of(self, worker: int) -> tuple[int, int]:
        return shard_range(self.total, len(self.members), self.members.index(worker))

    @property
    def padded(self) -> int:
        """The length every member contributes to an all-gather (the largest shard)."""
        return -(-self.total // len(self.members))

    def ranges(self) -> list[tuple[int, int, int]]:
        """``[(worker, lo, hi)]`` in rank order."""
        return [(w, *self.range_of(w)) for w in self.members]


def ring_buddies(members: Iterable[int], node_of: dict[int, int]) -> dict[int, int]:
    """worker -> the member that keeps its shard's copy (empty with one member)."""
    members = sorted(members)
    if len(members) < 2:
        return {}
    by_node: dict[int, list[int]] = defaultdict(list)
    for w in members:
        by_node[node_of[w]].append(w)
    nodes = sorted(by_node)
    if len(nodes) == 1:
        return {w: members[(i + 1) % len(members)] for i, w in enumerate(members)}
    out = {}
    for j, n in enumerate(nodes):
        nxt = by_node[nodes[(j + 1) % len(nodes)]]
        for i, w in enumerate(by_node[n]):
            out[w] = nxt[i % len(nxt)]
    return out
