"""How a worker's training state is laid out across ranks: what the step protocol and the worker ask of it.

One interface, :class:`StateLayout`, three layouts:

- **replicated** (this base class): every member holds the whole state; a committed step is applied from
  the reduced gradient, the leader's checkpoint holds the live tensors;
- **HSDP** (:class:`ShardedModel`, ``train.shard_degree = k``): FSDP2 shards the model inside each replica.
  To the step protocol the state is replicated per shard index (rank ``i`` of every replica holds the same
  shards; the work plan, :class:`unbroken.sharding.hsdp.ReplicaPlan`, groups the reduction by index); each
  rank of the replica that checkpoints writes its shards as a part of the checkpoint, the leader the rest;
- **ZeRO-1** (:class:`unbroken.sharding.state.ShardedState`, ``train.shard_optimizer``): the parameters are
  replicated, the AdamW moments split over the members; the update and the all-gather of the new
  parameters run before the vote, the moments move to the new ranges when the view changes, and a ring of
  copies in snapshot memory protects them.

The step protocol (:mod:`unbroken.runtime.protocol`) calls :meth:`discard`, :meth:`before_reduction`,
:meth:`after_reduction`, :meth:`missed`, :meth:`reshard` and :meth:`settle`; the worker
(:mod:`unbroken.runtime.worker`) :meth:`apply`, :meth:`split`, :meth:`checkpoint_parts`, :meth:`moments_range`,
:meth:`restored`, :meth:`snapshotted` and :meth:`summary`. None of them branches on which layout it has.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

from unbroken.state.parts import is_sharded, local_of

__all__ = ["Check", "Late", "Part", "ShardedModel", "StateLayout", "hsdp_part"]

Part = tuple[str, dict[str, torch.Tensor], dict[str, Any]]
"""A worker's part of a checkpoint: its name, its tensors, what is kept beside them (``part.json``)."""
Check = Callable[[], None]
"""The failure detector: raises when a member died or the view changed."""
Late = Callable[[str, Callable[[float], Any]], Any]
"""``late(what, wait)``: wait (up to a heartbeat timeout) for this worker's own ``what`` to complete after it gave
up on it, recording how long it took; returns what ``wait`` returned."""


class StateLayout:
    """Replicated: every member holds the whole state. The base of every layout (its hooks do nothing).

    Args:
        job: what is trained (:class:`unbroken.job.builder.Job`).
    """

    name = "replicated"
    rejoins_from_memory = True
    """A joiner may load its state from its node's snapshot memory (HSDP: its shard index's; ZeRO-1: no, the
    snapshot holds no moments: a joiner receives its range in the re-shard)."""

    def __init__(self, job: Any) -> None:
        self.job = job

    # -- the step (the protocol) -----------------------------------------------------

    def discard(self) -> None:
        """A new attempt of a step begins: forget what an attempt that did not commit proposed."""

    def before_reduction(self, check: Check) -> None:
        """Just before this worker posts its reduction of a step."""

    def after_reduction(self, step: int, reduced: torch.Tensor, group: Any, check: Check,
                        on_phase: Callable[[str], None]) -> None:
        """After the reduction, before the vote: what must complete here before this worker may vote commit."""

    def missed(self, step: int, reduced: torch.Tensor | None, group: Any, late: Late) -> torch.Tensor | None:
        """The others committed ``step`` while this worker gave up on it (a false alarm): the reduced buffer it
        applies, if its own reduction completed after all, else None (it leaves and rejoins)."""
        if reduced is not None:
            return reduced
        return late("all-reduce", group.late_result) if group is not None else None

    # -- views (the protocol) --------------------------------------------------------

    def reshard(self, view: Any, allreduce: Callable[[torch.Tensor], torch.Tensor],
                broadcast: Callable[[torch.Tensor, int], object]) -> None:
        """In a new view, every member: move the state to the view's layout (nothing to move when replicated)."""

    def settle(self, check: Check) -> None:
        """Before a view's group is abandoned: finish what still travels on it."""

    # -- the worker ------------------------------------------------------------------

    def apply(self, step: int, view: Any, group: Any, reduced: torch.Tensor, *, last: bool) -> tuple[float, float]:
        """Apply committed step ``step`` (``last``: the run's last step); returns (lr, grad norm)."""
        return self.job.apply(step, reduced)

    def split(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Part | None]:
        """The training state as a checkpoint holds it: what the leader writes into the step's directory, and
        this worker's own part (its name, tensors and what is kept beside them; None: nothing)."""
        return state, None

    def checkpoint_parts(self) -> tuple[list[str], dict[str, Any]] | None:
        """The parts other workers write that a checkpoint's commit waits for, and what the commit records of
        them (ZeRO-1: the moments' ranges; HSDP: the shard indices); None: the leader writes everything."""
        return None

    def moments_range(self) -> tuple[int, int, torch.Tensor, torch.Tensor] | None:
        """What every member writes of a checkpoint at a step it is due (ZeRO-1: its range ``lo, hi`` of the
        moments, ``exp_avg`` and ``exp_avg_sq``); None: nothing (the leader and HSDP's replica write it)."""
        return None

    def restored(self, gen: int) -> None:
        """The state was just loaded whole (a restore) in view ``gen``."""

    def snapshotted(self, done: int) -> None:
        """A snapshot of the state after ``done`` steps was taken (every member took it)."""

    def summary(self) -> dict[str, Any] | None:
        """What the worker's report says about the layout (None: nothing)."""
        return None


def hsdp_part(index: int) -> str:
    """The name of shard index ``index``'s part of an HSDP checkpoint or snapshot."""
    return f"i{index}"


class ShardedModel(StateLayout):
    """HSDP: FSDP2 shards the model inside each replica (see the module docstring).

    Args:
        job: what is trained.
        index: this worker's shard index in its replica.
        shard_degree: the ranks of a replica (``k``).
    """

    name = "hsdp"

    def __init__(self, job: Any, *, index: int, shard_degree: int) -> None:
        super().__init__(job)
        self.index, self.shard_degree = index, shard_degree

    def split(self, state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Part | None]:
        """The replicated entries (step counts, RNG) for the leader; this rank's shards of every sharded tensor
        as its part, with the dimension each is split on. No collective: nobody holds the whole model."""
        rest = {k: v for k, v in state.items() if not is_sharded(v)}
        own = {k: local_of(v) for k, v in state.items() if is_sharded(v)}
        dims = {k: v.placements[0].dim for k, v in state.items() if is_sharded(v)}  # type: ignore[attr-defined]
        return rest, (hsdp_part(self.index), own, {"dims": dims})

    def checkpoint_parts(self) -> tuple[list[str], dict[str, Any]] | None:
        return [hsdp_part(i) for i in range(self.shard_degree)], {"hsdp_parts": self.shard_degree}
