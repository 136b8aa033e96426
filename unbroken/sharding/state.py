"""A worker's sharded optimizer state across steps and views (what the step protocol calls).

Per step ``s`` (:mod:`unbroken.runtime.protocol`):

1. before posting its reduction, a member seals the copies of step ``s - 1``'s
   shards it received (:meth:`ShardedState.seal_replicas`): so a reduction of
   step ``s`` completes only once every member holds its buddies' moments
   after ``s`` steps, and a commit of ``s`` implies them sealed;
2. after the reduction, :meth:`ShardedState.update`: the gradients from the
   reduced buffer, clipping on the whole gradient (every member holds it),
   AdamW on the member's range (out of place), then an all-gather of the new
   parameters; only a member whose all-gather completed votes ``commit``;
3. once committed, :meth:`ShardedState.commit` installs the parameters and the
   range's moments, keeps the step's gradient over the ranges whose copies
   this member holds (one step's replay: about 1/m of the gradient, never the
   reduced buffer, which dies with the step), and sends the new moments to the
   ring buddy while the next step computes.

When the view changes (:meth:`ShardedState.reshard`, inside ``adopt``), the
members of the new view move the moments of the last committed step from the
old ranges to the new ones: each old range is broadcast by its owner, or, if
the owner is gone, by the buddy holding its copy; a copy one step behind is
brought forward with the gradient its holder kept of that range (the
moments' update needs nothing else). The old ranges stay held until the
first step of the new view commits, so a view that fails while forming is
re-sharded again from them. A range with neither its owner nor its copy left
(more failures than the ring covers) raises :class:`ShardLost`: the job
stops, ``--resume`` continues from the persistent checkpoint.
"""

from __future__ import annotations

import json
import logging
from typing import Any, Callable

import torch

from unbroken.mecefo.gradients import apply_reduced
from unbroken.models.optim import set_lr
from unbroken.sharding.adamw import Proposal, ShardedAdamW
from unbroken.sharding.layout import Check, Late, StateLayout
from unbroken.sharding.ranges import Sharding, ring_buddies
from unbroken.snapshot.replicas import ReplicaStore

__all__ = ["ShardLost", "ShardedState"]

logger = logging.getLogger(__name__)

Kept = dict[int, tuple[int, int, list[torch.Tensor | None]]]
"""Per owner whose copy this worker holds: its range ``(lo, hi)`` and a step's gradient over it
(:meth:`~unbroken.sharding.adamw.ShardedAdamW.range_grads`)."""


class ShardLost(Exception):
    """A shard's moments are gone with its owner and every copy: more failures than the redundancy covers."""


class ShardedState(StateLayout):
    """The sharded optimizer state of one worker: ZeRO-1's :class:`~unbroken.sharding.layout.StateLayout`.

    Args:
        job: what is trained (its optimizer a :class:`ShardedAdamW`).
        worker: this worker's id; ``node_of`` maps every worker to its node.
        replicas: where this worker keeps its buddies' copies.
        on_event: receives events (re-sharding, ranges rebuilt from copies).
    """

    def __init__(self, job: Any, *, worker: int, node_of: dict[int, int], replicas: ReplicaStore,
                 on_event: Callable[..., None]) -> None:
        if not isinstance(job.optimizer, ShardedAdamW):
            raise TypeError("sharded optimizer state needs the job's optimizer to be a ShardedAdamW")
        super().__init__(job)
        self.opt, self.me, self.node_of = job.optimizer, worker, node_of
        self.replicas, self.on_event = replicas, on_event
        self.active: Sharding | None = None
        """The sharding steps are proposed under (None: this worker holds every range)."""
        self.held: tuple[Sharding | None, int, int, torch.Tensor, torch.Tensor] = (
            None, 0, self.opt.total, self.opt.exp_avg, self.opt.exp_avg_sq)
        """The last committed step's sharding and this worker's range and moments under it."""
        self.last_grads: tuple[int, Kept] | None = None
        """The last committed step and its gradient over the ranges whose copies this worker holds."""
        self._pending: tuple[int, Proposal, torch.Tensor, float, float, Kept] | None = None
        # A proposal whose all-gather was given up on (its step may still commit, and the gather complete late).
        self._ungathered: tuple[int, Proposal, Sharding, float, float, Kept] | None = None
        self._outgoing: dict[str, Any] | None = None
        self._snapshotted = -1
        """The last step whose snapshot was taken: its copies are pinned (kept with the snapshot)."""
        self._replayed: list[int] = []
        self.rebuilt = 0
        self.replica_failures = 0
        """Ring copies received but not sealed (shared memory full)."""

    name = "zero1"
    rejoins_from_memory = False

    # -- the layout's hooks (what the step protocol and the worker call) ---------------

    def before_reduction(self, check: Check) -> None:
        self.seal_replicas(check)

    def after_reduction(self, step: int, reduced: torch.Tensor, group: Any, check: Check,
                        on_phase: Callable[[str], None]) -> None:
        self.update(step, reduced, group, check, on_phase=on_phase)

    def missed(self, step: int, reduced: torch.Tensor | None, group: Any, late: Late) -> torch.Tensor | None:
        """Applying needs this worker's all-gather, not only its reduction: done, or completed late."""
        if self.ready(step) or (group is not None and late("all-gather", lambda t: self.late(step, group, t))):
            return reduced
        return None

    def apply(self, step: int, view: Any, group: Any, reduced: torch.Tensor, *, last: bool) -> tuple[float, float]:
        return self.commit(step, view, group, replicate=not last)

    def moments_range(self) -> tuple[int, int, torch.Tensor, torch.Tensor] | None:
        return self.opt.lo, self.opt.hi, self.opt.exp_avg, self.opt.exp_avg_sq

    def restored(self, gen: int) -> None:
        self.reset_full(restored_gen=gen)

    def snapshotted(self, done: int) -> None:
        self._snapshotted = done

    # -- a step -----------------------------------------------------------------------

    def update(self, step: int, reduced: torch.Tensor, group: Any, check: Check,
               on_phase: Callable[[str], None] = lambda phase: None) -> None:
        """Propose step ``step`` on this worker's range and all-gather every range's new parameters
        (``on_phase("update")`` before the update, ``on_phase("allgather")`` with the all-gather in flight)."""
        on_phase("update")
        lr = self.job.schedule(step)
        norm = self._gradients(reduced)
        set_lr(self.opt, lr)
        proposal = self.opt.propose()
        sharding = self._sharding
        self._ungathered = (step, proposal, sharding, lr, norm, self._kept(sharding))
        gathered = group.allgather(proposal.params, sharding.padded, check, lambda: on_phase("allgather"))
        self._gathered(gathered)

    def late(self, step: int, group: Any, timeout_s: float) -> bool:
        """This worker gave up on its all-gather of ``step`` (a false alarm: the others committed the step):
        its own all-gather may still complete, and then it holds the same parameters as everybody. True if it
        did (the step can be applied here after all)."""
        if self._ungathered is None or self._ungathered[0] != step:
            return False
        gathered = group.late_gather(timeout_s)
        if gathered is None:
            return False
        self._gathered(gathered)
        return True

    def _gathered(self, gathered: torch.Tensor) -> None:
        assert self._ungathered is not None
        step, proposal, sharding, lr, norm, kept = self._ungathered
        flat = torch.cat([gathered[r * sharding.padded:r * sharding.padded + hi - lo]
                          for r, (_, lo, hi) in enumerate(sharding.ranges())])
        self._pending, self._ungathered = (step, proposal, flat, lr, norm, kept), None

    def ready(self, step: int) -> bool:
        """Has this worker's update and all-gather of ``step`` completed (it may apply the step)?"""
        return self._pending is not None and self._pending[0] == step

    def commit(self, step: int, view: Any, group: Any, *, replicate: bool = True) -> tuple[float, float]:
        """Install committed step ``step``; start sending the new moments to the ring buddy (unless
        ``replicate`` is False: the job's last step). Returns (lr, grad norm)."""
        if self._pending is None or not self.ready(step):
            raise RuntimeError(f"step {step} was not proposed here")
        _, proposal, flat, lr, norm, kept = self._pending
        self._pending = None
        self.opt.commit(proposal, flat)
        self.held = (self.active, self.opt.lo, self.opt.hi, self.opt.exp_avg, self.opt.exp_avg_sq)
        self.last_grads = (step, kept)
        if self.active is not None and replicate:
            try:
                self._send_copies(step + 1, view, group)
            except Exception as exc:  # a peer is gone already: the failure detector handles it at the next wait
                logger.warning("copies of step %d's shards not sent: %s", step, exc)
                self._outgoing = None
        return lr, norm

    def _gradients(self, reduced: torch.Tensor) -> float:
        """``.grad`` of every parameter from a reduced buffer, clipped as the replicated step clips; the norm."""
        layout = self.job.layout
        apply_reduced(layout, reduced)
        params = [p for p in layout.params if p.grad is not None]
        clip = self.job.cfg.optim.grad_clip
        return float(torch.nn.utils.clip_grad_norm_(params, clip if clip > 0 else float("inf"), foreach=False))

    def _kept(self, sharding: Sharding) -> Kept:
        """The current (clipped) gradient over each range whose copy this worker receives under ``sharding``:
        all a replay of the step needs here (:meth:`_range_data`). Nothing when the ranges are not shared."""
        if self.active is None:
            return {}
        buddies = ring_buddies(sharding.members, self.node_of)
        return {o: (lo, hi, self.opt.range_grads(lo, hi))
                for o in sharding.members if buddies.get(o) == self.me for lo, hi in [sharding.range_of(o)]}

    # -- the ring ---------------------------------------------------------------------

    def _send_copies(self, done: int, view: Any, group: Any) -> None:
        """Every member: one all-to-all in which each sends its range's moments to its ring buddy only."""
        sharding = self.active
        assert sharding is not None  # called for an active sharding only
        buddies = ring_buddies(sharding.members, self.node_of)
        if not buddies:
            return
        size = len(view.members)
        in_splits, out_splits = [0] * size, [0] * size
        mine = torch.cat([self.opt.exp_avg, self.opt.exp_avg_sq])
        in_splits[view.rank_of(buddies[self.me])] = mine.numel()
        owners = [o for o in sharding.members if buddies[o] == self.me]
        for o in owners:
            lo, hi = sharding.range_of(o)
            out_splits[view.rank_of(o)] = 2 * (hi - lo)
        out = torch.empty(sum(out_splits), dtype=torch.float32, device=mine.device)
        work = group.post_alltoall(out, mine, out_splits, in_splits)
        received, at = {}, 0
        for o in owners:  # rank order = ascending worker ids = the order of ``owners``
            lo, hi = sharding.range_of(o)
            received[o] = (lo, hi, out[at:at + 2 * (hi - lo)])
            at += 2 * (hi - lo)
        self._outgoing = {"works": [work], "copies": received, "done": done, "gen": view.gen,
                          "members": sharding.members, "group": group, "keep": mine}

    def seal_replicas(self, check: Check) -> None:
        """Wait for the last step's ring transfers; seal the copies received (before this step's reduction)."""
        out, self._outgoing = self._outgoing, None
        if out is None:
            return
        out["group"].wait_side(out["works"], check, "shard copy")
        try:
            self.replicas.write(out["done"], out["gen"], out["members"], out["copies"],
                                pinned=out["done"] == self._snapshotted)
        except OSError as exc:  # a full /dev/shm: as for snapshots, reported and training goes on less protected
            self.replica_failures += 1
            logger.error("copies of %s's shards after step %d not sealed: %s (training goes on; a failure of "
                         "their owner now stops the job unless the copy one step behind serves)",
                         sorted(out["copies"]), out["done"], exc)
            self.on_event("replica_failed", step=out["done"], owners=sorted(out["copies"]),
                          error=f"{type(exc).__name__}: {exc}")

    def settle(self, check: Check) -> None:
        """Before the group is abandoned: seal what the last ring transfers delivered; drop them if a peer died."""
        try:
            self.seal_replicas(check)
        except Exception as exc:  # a peer of the transfer died: its copy of that step is not had here
            logger.warning("copies of the last step's shards not sealed: %s", exc)

    # -- views --------------------------------------------------------------------------

    def reset_full(self, *, restored_gen: int | None = None) -> None:
        """The optimizer was just loaded whole (a checkpoint): every range is held here, nothing is pending.
        ``restored_gen``: the restored view's generation; ring copies sealed before it are never read."""
        if restored_gen is not None:
            self.replicas.forget_before(restored_gen)
        self.held = (None, 0, self.opt.total, self.opt.exp_avg, self.opt.exp_avg_sq)
        self.active, self.last_grads, self._pending, self._outgoing = None, None, None, None
        self._ungathered = None

    def checkpoint_parts(self) -> tuple[list[str], dict[str, Any]]:
        """The ranges of the current sharding (a checkpoint's commit waits for each member's)."""
        ranges = [(lo, hi) for _, lo, hi in self._sharding.ranges()]
        return [f"{lo}-{hi}" for lo, hi in ranges], {"shards": [[lo, hi] for lo, hi in ranges]}

    @property
    def _sharding(self) -> Sharding:
        """The sharding steps are proposed under (before any view: this worker alone holds everything)."""
        return self.active or Sharding((self.me,), self.opt.total)

    def discard(self) -> None:
        """Forget a proposal of an attempt that did not commit (a new attempt of the step begins)."""
        self._pending, self._ungathered = None, None

    def reshard(self, view: Any, allreduce: Callable[[torch.Tensor], torch.Tensor],
                broadcast: Callable[[torch.Tensor, int], object]) -> None:
        """Move the last committed step's moments to ``view``'s ranges (every member calls it)."""
        joiners = set(view.joiners)
        source = next(w for w in view.members if w not in view.joiners)
        old = self._agree_old(view, source, broadcast)
        new = Sharding(tuple(view.members), self.opt.total)
        if old == new and not view.joiners:
            self.active = new
            return
        if old is None:  # every non-joiner holds every range (a fresh or restored job): slice locally
            if not view.joiners:
                self._set_range(new, *self._slice_full(new))
                return
            old = Sharding((source,), self.opt.total)
        holders = self._holders(old, view, joiners)
        mine, problems, self._replayed = {}, [], []
        for owner, a, z in old.ranges():
            if holders[owner] == self.me:
                try:
                    mine[owner] = self._range_data(owner, a, z, old, view)
                except ShardLost as exc:
                    problems.append(str(exc))
        # Every member learns whether every range can be sent before any is: nobody waits on a holder that cannot.
        failed = allreduce(torch.tensor([float(len(problems))], device=self.opt.exp_avg.device))
        if float(failed[0]) > 0:
            raise ShardLost("; ".join(problems) or f"{int(failed[0])} optimizer shard(s) have no usable copy left")
        lo, hi = new.range_of(self.me)
        m = torch.empty(hi - lo, dtype=torch.float32, device=self.opt.exp_avg.device)
        v = torch.empty_like(m)
        for owner, a, z in old.ranges():
            holder = holders[owner]
            data = mine[owner] if holder == self.me else \
                torch.empty(2 * (z - a), dtype=torch.float32, device=m.device)
            broadcast(data, view.rank_of(holder))
            x, y = max(a, lo), min(z, hi)
            if x < y:
                m[x - lo:y - lo].copy_(data[x - a:y - a])
                v[x - lo:y - lo].copy_(data[(z - a) + x - a:(z - a) + y - a])
        self._set_range(new, m, v)
        rebuilt = sorted(o for o, h in holders.items() if h != o)
        self.rebuilt += len(rebuilt)
        self.on_event("resharded", gen=view.gen, step=view.step, members=list(new.members), range=[lo, hi],
                      from_copies=rebuilt, replayed=self._replayed)

    def _agree_old(self, view: Any, source: int, broadcast: Callable[[torch.Tensor, int], object]) -> Sharding | None:
        """The sharding of the last committed step, as the view's first non-joiner holds it (joiners know none)."""
        device = self.opt.exp_avg.device
        held = self.held[0]
        text = json.dumps(list(held.members) if held is not None else None).encode()
        length = torch.tensor([len(text)], dtype=torch.int64, device=device)
        broadcast(length, view.rank_of(source))
        raw = torch.frombuffer(bytearray(text), dtype=torch.uint8).to(device) if self.me == source else \
            torch.empty(int(length.item()), dtype=torch.uint8, device=device)
        broadcast(raw, view.rank_of(source))
        members = json.loads(bytes(raw.cpu().numpy()).decode())
        return None if members is None else Sharding(tuple(members), self.opt.total)

    def _holders(self, old: Sharding, view: Any, joiners: set[int]) -> dict[int, int]:
        """Who sends each old range: its owner if still a member, else its ring buddy (or :class:`ShardLost`)."""
        present = {w for w in view.members if w not in joiners}
        buddies = ring_buddies(old.members, self.node_of)
        holders, lost = {}, []
        for owner in old.members:
            if owner in present:
                holders[owner] = owner
            elif buddies.get(owner) in present:
                holders[owner] = buddies[owner]
            else:
                lost.append(owner)
        if lost:
            raise ShardLost(f"the optimizer shards of workers {lost} are lost with their copies (held by workers "
                            f"{[buddies.get(o) for o in lost]}): more workers failed at once than the ring covers "
                            f"(one copy of each shard, on the next node)")
        return holders

    def _range_data(self, owner: int, lo: int, hi: int, old: Sharding, view: Any) -> torch.Tensor:
        """This holder's moments of ``owner``'s old range ``[lo, hi)`` after ``view.step`` steps, as one tensor."""
        if owner == self.me:
            _, a, _, m, v = self.held
            return torch.cat([m[lo - a:hi - a], v[lo - a:hi - a]])
        got = self.replicas.read(owner, lo, hi, old.members)
        done = got[0] if got else None
        if got is not None and done == view.step:
            return got[1].to(self.opt.exp_avg.device)
        kept = self.last_grads[1].get(owner) if self.last_grads and self.last_grads[0] == done else None
        if got is not None and done == view.step - 1 and kept is not None and kept[:2] == (lo, hi):
            data = got[1].to(self.opt.exp_avg.device).clone()
            self.opt.replay_moments(lo, hi, data[:hi - lo], data[hi - lo:], kept[2])
            self._replayed.append(owner)
            return data
        raise ShardLost(f"worker {self.me} holds no usable copy of worker {owner}'s optimizer shard after "
                        f"{view.step} steps (newest copy: {done})")

    def _slice_full(self, new: Sharding) -> tuple[torch.Tensor, torch.Tensor]:
        _, a, _, m, v = self.held
        lo, hi = new.range_of(self.me)
        return m[lo - a:hi - a].clone(), v[lo - a:hi - a].clone()

    def _set_range(self, sharding: Sharding, m: torch.Tensor, v: torch.Tensor) -> None:
        lo, hi = sharding.range_of(self.me)
        self.opt.set_range(lo, hi, m, v)
        self.active = sharding

    def summary(self) -> dict[str, Any]:
        return {"range": [self.opt.lo, self.opt.hi], "members": list(self.active.members) if self.active else None,
                "replicas_written": self.replicas.written, "replicas_failed": self.replica_failures,
                "ranges_from_copies": self.rebuilt}
