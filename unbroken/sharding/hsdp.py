"""HSDP: FSDP2 shards the model inside each replica; unbroken's data parallelism runs across replicas.

Layout, for a shard degree ``k`` (:class:`~unbroken.sharding.replica_layout.ReplicaLayout`): ``workers = R x k``;
replica ``r`` is the ``k`` consecutive workers ``r*k .. r*k + k - 1``, all on
one node (``k`` divides the workers per node: the replica is the fault unit,
and one agent fences and restarts all of it); worker ``w``'s shard index is
``w % k``. Replicas spanning nodes are refused (:func:`~unbroken.sharding.replica_layout.check_layout`).

Inside a replica (:func:`join_replica`): its ``k`` ranks form a
``torch.distributed`` world of their own, on a store prefix per replica
incarnation (the way torchft gives each replica group its own world), with a
1-D device mesh over it; :func:`shard_model` applies the user's
``parallelize(model, mesh)`` (default :func:`fsdp_llama`: ``fully_shard`` per
transformer block, then the root, torchtitan's recipe) and makes every FSDP
unit reduce-scatter **sums** (no division: the step divides by the tokens it
trained, as unbroken's data parallelism does). A dead rank takes its replica
down: FSDP's collectives inside it cannot be finished without it.

Across replicas: after the backward passes of a step (one per micro-batch,
the ranks of a replica in lockstep: FSDP accumulates the reduce-scattered
sums in the sharded gradients), :class:`GradientShards` lays a rank's local
gradient shards out in one flat buffer; the step protocol sums the buffers of
the workers with the same shard index on the view's group of that index,
under its two-phase commit (no FSDP all-reduce hook: a collective inside the
backward pass could not be abandoned), and installs the sum back before the
optimizer's step. Every rank of every live replica applies step ``s`` or none
does, as in plain data parallelism.

Invariants: a rank's flat buffer has the same length and order on every
replica (FSDP shards each parameter the same way for the same mesh size);
nothing here copies a parameter (the optimizer and a state transfer see the
model's own DTensors).
"""

from __future__ import annotations

import dataclasses
import time
from datetime import timedelta
from typing import Callable, Mapping, Sequence

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, fully_shard
from torch.distributed.tensor import DTensor

from unbroken.completion import completion_error
from unbroken.mecefo.adapter import transformer_blocks
from unbroken.mecefo.gradients import SlotWork
from unbroken.mecefo.takeover import TakeoverPolicy
from unbroken.sharding.replica_layout import ReplicaLayout, check_layout
from unbroken.state.parts import laid_out_as

__all__ = ["GradientShards", "Parallelize", "ReplicaLayout", "ReplicaPlan", "ReplicaSync", "check_layout", "fsdp_llama",
           "join_replica", "replica_assignment", "replica_completion", "shard_model"]

Parallelize = Callable[[torch.nn.Module, DeviceMesh], object]
"""A user's recipe (torchtitan's ``parallelize_llama``): shards ``model`` in place over ``mesh``."""


def replica_assignment(policy: TakeoverPolicy, layout: ReplicaLayout, live: Sequence[int],
                       micro_batch: int, n_slots: int | None = None) -> dict[int, list[SlotWork]]:
    """Each live worker's work for one step of ``n_slots`` slots (default: one per worker) under HSDP.

    The takeover policy runs over replicas (a replica with any rank not in ``live`` is down as a whole:
    the fault unit) and the step's ``n_slots / k`` replica slots; rank ``i`` of a live replica then takes,
    of every replica slot ``j`` the policy gives its replica, slot ``j * k + i``, with the same rows and mode.
    So the ranks of a replica compute the same rows of their own shard index's slots, and FSDP's
    collectives inside it stay in lockstep; each worker's slot id is as without sharding (the ledger checks
    every ``(step, slot, row)`` as before).
    """
    k = layout.shard_degree
    up = sorted({layout.replica_of(w) for w in live
                 if set(layout.replica_members(layout.replica_of(w))) <= set(live)})
    per_replica = policy.assign(n_slots=_replica_slots(layout, n_slots), live=up, micro_batch=micro_batch,
                                n_workers=layout.replicas)
    return {r * k + i: [SlotWork(slot=item.slot * k + i, rows=item.rows, mode=item.mode) for item in items]
            for r, items in per_replica.items() for i in range(k)}


def replica_completion(policy: TakeoverPolicy, layout: ReplicaLayout, live: Sequence[int], micro_batch: int,
                       done: Mapping[int, Sequence[SlotWork]], n_slots: int | None = None) -> dict[int, list[SlotWork]]:
    """Each live worker's extra work to finish a step under HSDP, given what every live worker computed.

    As :func:`replica_assignment`, over replicas: replica ``r`` has done what its rank 0 did (its ranks
    computed the same rows of their own slots), the policy completes the replicas' step, and rank ``i``
    of a live replica takes its index's slot of each item given to its replica. A worker of a replica
    that is not whole gets nothing.
    """
    k = layout.shard_degree
    up = sorted({layout.replica_of(w) for w in live
                 if set(layout.replica_members(layout.replica_of(w))) <= set(live)})
    done_r = {r: [SlotWork(slot=item.slot // k, rows=item.rows, mode=item.mode) for item in done.get(r * k, ())]
              for r in up}
    extra = policy.complete(n_slots=_replica_slots(layout, n_slots), micro_batch=micro_batch, live=up, done=done_r,
                            n_workers=layout.replicas)
    out: dict[int, list[SlotWork]] = {w: [] for w in live}
    for r, items in extra.items():
        for i in range(k):
            out[r * k + i] = [SlotWork(slot=item.slot * k + i, rows=item.rows, mode=item.mode) for item in items]
    return out


def _replica_slots(layout: ReplicaLayout, n_slots: int | None) -> int:
    """The step's slots over replicas: ``n_slots / k`` (``n_slots`` a multiple of ``k``, checked at start)."""
    return layout.replicas if n_slots is None else n_slots // layout.shard_degree


@dataclasses.dataclass(frozen=True)
class ReplicaPlan:
    """The step protocol's work plan under HSDP (:class:`unbroken.runtime.work_plan.SlotPlan`'s contract).

    Work goes to whole replicas (:func:`replica_assignment`, :func:`replica_completion`); a death takes
    its replica with it; joiners are admitted only as whole replicas; each worker reduces its gradient
    shards with the workers of its shard index, one per live replica, on a group of their own.
    """

    policy: TakeoverPolicy
    layout: ReplicaLayout
    micro_batch: int
    n_slots: int | None = None
    """Slots per step (a multiple of the shard degree); None: one per worker."""

    def assign(self, me: int, live: Sequence[int], keep: Mapping[int, int] | None = None) -> list[SlotWork]:
        """``keep`` (slow workers' rows) is not used: stragglers are not rebalanced under HSDP."""
        return list(replica_assignment(self.policy, self.layout, live, self.micro_batch, self.n_slots).get(me, []))

    def complete(self, me: int, live: Sequence[int], done: Mapping[int, Sequence[SlotWork]]) -> list[SlotWork]:
        return replica_completion(self.policy, self.layout, live, self.micro_batch, done, self.n_slots)[me]

    def widen(self, dead: set[int]) -> set[int]:
        """Every worker of a replica with a dead worker."""
        return self.layout.whole_replicas(sorted(dead)) & set(range(self.layout.workers))

    def admissible(self, joiners: Sequence[int], members: Sequence[int]) -> list[int]:
        """The joiners whose whole replica is asking (or, for a rank, already in the view)."""
        asking = set(joiners) | set(members)
        return [j for j in joiners if set(self.layout.replica_members(self.layout.replica_of(j))) <= asking]

    def same_replica(self, a: int, b: int) -> bool:
        return self.layout.replica_of(a) == self.layout.replica_of(b)

    def shard_index(self, worker: int) -> int:
        """``worker``'s rank in its replica (its shard index)."""
        return self.layout.index_of(worker)

    def peers(self, me: int, members: Sequence[int]) -> tuple[str, tuple[int, ...]]:
        """The name of ``me``'s reduction group within a view, and its members (one per live replica)."""
        index = self.layout.index_of(me)
        return f".i{index}", self.layout.shard_peers(index, members)


class ReplicaSync:
    """The step protocol's own collectives over a replica's world (its ``k`` ranks, FSDP2's group).

    - :meth:`agree`, once per attempt of a step after each rank's reduction of its shard index's part
      completed or failed: do all of them hold their part (then every part of the step is defined: a
      completed reduction means every member of its index's group contributed), and does the view's leader
      admit joiners at the step's end? One small all-reduce, in place of a count in the job store that every
      member would wait on, and of a broadcast from the leader at every step boundary. It also carries
      whether any rank found its reduced part not finite (:mod:`unbroken.runtime.nonfinite`), and what the
      ranks found of the replicas' parameter checksums (:mod:`unbroken.runtime.param_check`).
    - :meth:`boundary`: the leader's view generation at a step boundary it announced (a broadcast), and the
      final checkpoint's writer's word to its siblings.

    Each waits for its collective without giving up on it (the other ranks of the replica are in it too, or
    on their way: one that died takes the replica down, its agent fences the others), keeping the failure
    detector's progress moving; ``None`` or ``-2``: the collective failed or outlived ``timeout_s``.

    Args:
        group: the replica's process group.
        size: its ranks (``k``).
        device: where its collectives run.
        timeout_s: the longest a collective may take.
        waiting: called while waiting (the membership's ``advance``).
    """

    def __init__(self, group: dist.ProcessGroup, size: int, device: torch.device, timeout_s: float,
                 waiting: Callable[[], None] = lambda: None) -> None:
        self.group, self.size, self.device, self.timeout_s, self.waiting = group, size, device, timeout_s, waiting

    def agree(self, ok: bool, flag: bool = False, bad: bool = False,
              marks: Sequence[int] = ()) -> tuple[bool, bool, bool, list[int]] | None:
        """(is every rank's ``ok`` true, is any rank's ``flag``, is any rank's ``bad``, the ranks' ``marks``
        summed: every rank gives as many), or None (the collective failed)."""
        t = torch.tensor([int(ok), int(flag), int(bad), *marks], dtype=torch.int64, device=self.device)
        if not self._run(lambda: dist.all_reduce(t, group=self.group, async_op=True)):
            return None
        done, flags, bads, *summed = t.tolist()
        return done == self.size, flags > 0, bads > 0, summed

    def boundary(self, index: int, value: int) -> int:
        """``value`` (>= 0) of the rank with shard index ``index`` (a broadcast; the others pass -1), or -2: the
        broadcast failed, or what arrived is no sender's value (the placeholder of a rank it never reached)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        if not self._run(lambda: dist.broadcast(t, group_src=index, group=self.group, async_op=True)):
            return -2
        got = int(t.item())
        return got if got >= 0 else -2

    def _run(self, start: Callable[[], dist.Work]) -> bool:
        """Post a collective and wait until it completed without error, by the job's one completion rule
        (:func:`~unbroken.completion.completion_error`: on NCCL the work's result, not its future):
        True, or False (failed, or past the timeout)."""
        try:
            work = start()
            deadline = time.monotonic() + self.timeout_s
            while not work.is_completed():
                self.waiting()
                if time.monotonic() > deadline:
                    return False
                if self.device.type == "cpu":
                    try:
                        work.wait(timedelta(seconds=0.02))
                    except RuntimeError:
                        pass  # timed out, or failed: is_completed() and the completion rule decide
                else:
                    time.sleep(0.001)
        except RuntimeError:
            return False
        return completion_error(work, self.device.type == "cuda") is None  # a replica always runs on NCCL there


def join_replica(store: dist.Store, *, replica: int, incarnation: int | str, index: int, shard_degree: int,
                 device: torch.device, timeout_s: float) -> DeviceMesh:
    """Form this rank's replica world (the default process group) and return its 1-D mesh.

    ``incarnation`` names the replica's start (a restarted replica rendezvouses on fresh keys).
    """
    backend = "nccl" if device.type == "cuda" else "gloo"
    prefix = dist.PrefixStore(f"replica/{replica}/{incarnation}", store)
    dist.init_process_group(backend, store=prefix, rank=index, world_size=shard_degree,
                            timeout=timedelta(seconds=timeout_s))
    world = dist.group.WORLD
    assert world is not None  # formed just above
    return DeviceMesh.from_group(world, device.type)


def fsdp_llama(model: torch.nn.Module, mesh: DeviceMesh) -> None:
    """The default recipe: ``fully_shard`` each transformer block (our LLaMA, Hugging Face's), then the root."""
    for block in transformer_blocks(model):
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)


def shard_model(model: torch.nn.Module, mesh: DeviceMesh, parallelize: Parallelize | None = None) -> torch.nn.Module:
    """Shard ``model`` over ``mesh`` with ``parallelize`` (default :func:`fsdp_llama`); every FSDP unit then
    reduce-scatters sums (FSDP's own division off). Returns ``model``.

    Raises:
        ValueError: the recipe left no FSDP unit, or a parameter outside every unit.
    """
    (parallelize or fsdp_llama)(model, mesh)
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if not units:
        raise ValueError("parallelize(model, mesh) applied no fully_shard: nothing would be sharded")
    for unit in units:
        unit.set_force_sum_reduction_for_comms(True)
        unit.set_gradient_divide_factor(1.0)
    loose = [n for n, p in model.named_parameters() if not isinstance(p, DTensor)]
    if loose:
        raise ValueError(f"parallelize(model, mesh) left parameters outside every FSDP unit: {', '.join(loose[:4])}"
                         f"{' ...' if len(loose) > 4 else ''}; fully_shard the root too")
    return model


class GradientShards:
    """A rank's local gradient shards as one flat buffer, in parameter order (the protocol reduces it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.sizes = [p.to_local().numel() for p in self.params]  # type: ignore[attr-defined]
        self.numel = sum(self.sizes)

    def flatten(self, out: torch.Tensor) -> torch.Tensor:
        """Copy the local gradient shards into ``out[:numel]`` (zeros for a parameter without one)."""
        offset = 0
        for p, n in zip(self.params, self.sizes):
            dst = out[offset:offset + n]
            if p.grad is None:
                dst.zero_()
            else:
                dst.copy_(p.grad.to_local().reshape(-1))  # type: ignore[attr-defined]
            offset += n
        return out

    def install(self, flat: torch.Tensor, scale: float = 1.0) -> None:
        """Set every parameter's gradient shard to its slice of ``flat`` times ``scale``."""
        offset = 0
        for p, n in zip(self.params, self.sizes):
            local = flat[offset:offset + n].view(p.to_local().shape) * scale  # type: ignore[attr-defined]
            if p.grad is None:
                p.grad = laid_out_as(p, local)
            else:
                p.grad.to_local().copy_(local)  # type: ignore[attr-defined]
            offset += n


def local_rows(rows: int, shard_degree: int, index: int) -> int:
    """Rows of a parameter's dim 0 that shard ``index`` holds (FSDP2's ``torch.chunk`` rule: chunks of
    ``ceil(rows / k)``, the last ones shorter or empty)."""
    chunk = -(-rows // shard_degree)
    return max(0, min(rows, (index + 1) * chunk) - index * chunk)


def shard_bytes(shapes: Sequence[tuple[int, ...]], shard_degree: int, *, element_bytes: int = 4) -> int:
    """The most bytes any shard index holds of parameters of ``shapes`` (one copy: parameters, or gradients,
    or one AdamW moment)."""
    per_index = [0] * shard_degree
    for shape in shapes:
        rest = 1
        for d in shape[1:]:
            rest *= d
        for i in range(shard_degree):
            per_index[i] += local_rows(shape[0], shard_degree, i) * rest
    return max(per_index) * element_bytes
