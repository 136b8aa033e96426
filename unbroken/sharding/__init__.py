"""Sharded optimizer state (ZeRO-1): each live worker keeps the AdamW moments of its slice of the parameters.

- :mod:`~unbroken.sharding.ranges`: which flat range each member owns under a
  view, and which peer holds each member's replica (the ring to the next node);
- :mod:`~unbroken.sharding.adamw`: AdamW on a flat range, out of place, equal to
  ``torch.optim.AdamW`` element for element;
- :mod:`~unbroken.sharding.replicas`: the ring copies of every shard in the
  holders' snapshot memory;
- :mod:`~unbroken.sharding.state`: the worker's side of it all, called by the
  step protocol (update and all-gather before the vote, replicas sealed before
  the next reduction, re-sharding when the view changes).
"""

from unbroken.sharding.adamw import Proposal, ShardedAdamW
from unbroken.sharding.ranges import Sharding, ring_buddies, shard_range

__all__ = ["Proposal", "ShardedAdamW", "Sharding", "ring_buddies", "shard_range"]
