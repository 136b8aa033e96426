"""How training state is laid out across ranks: replicated, HSDP's FSDP2 shards, ZeRO-1's sharded moments.

- :mod:`~unbroken.sharding.parallelism`: where a worker stands (replicated,
  ZeRO-1 or HSDP; its replica, shard, work plan and state layout), built once
  from the config: the worker asks it instead of ``train.shard_degree``;
  :mod:`~unbroken.sharding.replica_layout` (which replica and shard index each
  worker has) and :mod:`~unbroken.sharding.work_plan` (who computes what, and
  who reduces with whom) are its parts;
- :mod:`~unbroken.sharding.layout`: the one interface the step protocol and
  the worker call (:class:`~unbroken.sharding.layout.StateLayout`), and the
  replicated and HSDP layouts;
- :mod:`~unbroken.state.parts`: a tensor's part on this rank (a DTensor's
  local shard, or all of it), for the gradient layout, checkpoints and
  snapshots;
- :mod:`~unbroken.sharding.hsdp`: HSDP's replicas (their layout, rendezvous,
  FSDP2 recipe) and its work plan;
- ZeRO-1: :mod:`~unbroken.sharding.ranges` (which flat range each member
  owns under a view, and which peer holds each member's copy: the ring to
  the next node), :mod:`~unbroken.sharding.adamw` (AdamW on a flat range,
  out of place, equal to ``torch.optim.AdamW`` element for element),
  :mod:`~unbroken.snapshot.replicas` (the ring copies in the holders'
  snapshot memory), :mod:`~unbroken.sharding.state` (its layout: update and
  all-gather before the vote, copies sealed before the next reduction,
  re-sharding when the view changes), :mod:`~unbroken.checkpoint.sharded`
  (each member's range of the moments in a checkpoint).
"""

from unbroken.sharding.adamw import Proposal, ShardedAdamW
from unbroken.sharding.ranges import Sharding, ring_buddies, shard_range

__all__ = ["Proposal", "ShardedAdamW", "Sharding", "ring_buddies", "shard_range"]
