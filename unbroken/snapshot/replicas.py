"""The ring copies of other members' optimizer shards, in the holder's node's snapshot memory.

After each committed step every member sends its shard's moments (``exp_avg``
then ``exp_avg_sq``, float32) to its ring buddy (:func:`~unbroken.sharding.ranges.ring_buddies`)
while the next step computes; the buddy writes what it received into one of
its replica buffers (``unbroken-<job>-n<node>-w<worker>-r<b>``, owned by
the node's agent like every snapshot segment), sealed last, every byte under
a crc32 (:mod:`unbroken.snapshot.segment`). Buffers 0 and 1 alternate with
the step, so the previous step's copies stay readable while the next ones are
written; the copies of a step whose snapshot was taken (``pinned``) go to
buffers 2 and 3 instead, alternating with the snapshots, so the moments of
the two newest snapshot steps stay in memory with the snapshots of the rest
of the state.

**Restore from memory** (a whole-job failure, ``--resume``): the snapshot
(:mod:`unbroken.snapshot`) holds the replicated state (parameters, steps, RNG);
the copies hold the moments. :func:`copies_inventory` lists a node's sealed
copies (every byte checked), :func:`moments_spec` finds, for the snapshot's
step and view, copies of every range of one sharding, and
:func:`restore_moments` loads them: each range is read by the first member of
the restored view on its holder's node and broadcast to every member, which
then holds the whole moments (the first view's re-sharding slices them).

Seal: ``{"kind": "replica", "job", "node", "worker", "step", "gen",
"members", "owners": [[owner, lo, hi, offset, nbytes, crc32], ...]}``; ``step``
counts the steps applied (the moments after ``step`` steps), ``members`` is
the sharding the ranges belong to. Nothing is pickled.

After a restore (or ``--resume``) the buffers may still hold copies of the
abandoned timeline, sealed under older generations and possibly of a higher
step than any the restored job has reached: :meth:`ReplicaStore.forget_before`
makes :meth:`ReplicaStore.read` ignore every seal from before the restored
view's generation (every later copy is sealed under it or a newer one).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from unbroken.snapshot.segment import (Buffer, SealedBuffer, SnapshotCorrupt, crc32, job_segments, segment_name,
                                       segment_path)

__all__ = ["ReplicaStore", "copies_inventory", "moments_spec", "restore_moments"]

BUFFERS = 4
"""0 and 1: every step's copies, by the step's parity; 2 and 3: a snapshot step's, alternating."""

logger = logging.getLogger(__name__)


class ReplicaStore:
    """The replica buffers of one worker (the holder)."""

    def __init__(self, job: str, node: int, worker: int) -> None:
        self.job, self.node, self.worker = job, node, worker
        self.buffers = [Buffer(job, node, worker, b, kind="r") for b in range(BUFFERS)]
        self.written = 0
        self._pins = 0
        self.since_gen = 0
        """Seals of older generations are ignored (the job was restored in this one)."""

    def forget_before(self, gen: int) -> None:
        """The job was restored in view ``gen``: copies sealed before it belong to an abandoned timeline."""
        self.since_gen = max(self.since_gen, gen)

    def write(self, done: int, gen: int, members: tuple[int, ...],
              copies: dict[int, tuple[int, int, torch.Tensor]], *, pinned: bool = False) -> None:
        """Seal ``copies`` (owner -> (lo, hi, moments of ``2 * (hi - lo)`` float32)) as the state after ``done``
        steps; ``pinned``: a snapshot of step ``done`` was taken (kept until the snapshot after the next)."""
        if not copies:
            return
        t0 = time.perf_counter()
        sizes = {o: t.numel() * t.element_size() for o, (_, _, t) in copies.items()}
        if pinned:
            b = 2 + self._pins % 2
            self._pins += 1
        else:
            b = done % 2
        area = self.buffers[b].begin(sum(sizes.values()))
        owners, offset = [], 0
        for o, (lo, hi, t) in sorted(copies.items()):
            n = sizes[o]
            dst = area[offset:offset + n]
            torch.frombuffer(dst, dtype=torch.uint8).copy_(t.detach().cpu().contiguous().view(torch.uint8))
            owners.append([o, lo, hi, offset, n, crc32(dst)])
            offset += n
        self.buffers[b].seal({"v": 1, "kind": "replica", "job": self.job, "node": self.node, "worker": self.worker,
                              "step": done, "gen": gen, "members": list(members), "owners": owners,
                              "t": time.time()})
        self.written += 1
        logger.debug("replicas of %s after step %d sealed in %.4f s", sorted(copies), done,
                     time.perf_counter() - t0)

    def read(self, owner: int, lo: int, hi: int, members: tuple[int, ...]) -> tuple[int, torch.Tensor] | None:
        """The newest intact copy of ``owner``'s range ``[lo, hi)`` under ``members``: (steps applied, moments)."""
        best: tuple[int, torch.Tensor] | None = None
        for b in range(BUFFERS):
            path = segment_path(segment_name(self.job, self.node, self.worker, b, "r"))
            if not path.exists():
                continue
            try:
                buf = SealedBuffer.open(path, self.job)
                if buf is None or tuple(buf.seal.get("members", ())) != tuple(members):
                    continue
                if int(buf.seal.get("gen", -1)) < self.since_gen:
                    logger.info("replica buffer %s: a copy of step %s from view %s, before the restore in view "
                                "%d: ignored", path.name, buf.seal.get("step"), buf.seal.get("gen"), self.since_gen)
                    continue
                for o, a, z, offset, n, crc in buf.seal["owners"]:
                    if (o, a, z) == (owner, lo, hi) and (best is None or buf.seal["step"] > best[0]):
                        data = torch.frombuffer(bytearray(buf.read(offset, n, crc)), dtype=torch.float32)
                        best = (int(buf.seal["step"]), data)
            except SnapshotCorrupt as exc:
                logger.error("replica buffer %s unusable: %s", path.name, exc)
        return best

    def close(self) -> None:
        for b in self.buffers:
            b.close()


def copies_inventory(job: str, node: int | None = None) -> tuple[list[dict[str, Any]], list[str]]:
    """The sealed replica buffers of ``job`` on ``node`` (None: every node's on this machine), every byte
    checked: their seals, each with ``segment`` (its name), and the problems found (a buffer left out, and
    why)."""
    seals, problems = [], []
    for path in job_segments(job, node, kind="r"):
        try:
            buf = SealedBuffer.open(path, job)
            if buf is None:
                continue  # never written, or a write interrupted: the other buffers serve
            for _, _, _, offset, n, crc in buf.seal["owners"]:
                buf.read(offset, n, crc)
            seals.append({**buf.seal, "segment": path.name})
        except (SnapshotCorrupt, KeyError, TypeError, ValueError) as exc:
            problems.append(f"{path.name}: {exc}")
    return seals, problems


def moments_spec(seals: list[dict[str, Any]], *, step: int, gen: int) -> dict[str, Any] | None:
    """The copies a restore of the snapshot of ``step`` (taken in view ``gen``) loads the moments from: for
    each range of the sharding of that view, a copy sealed for ``step`` in ``gen``; None if a range has none
    (its holder's node is gone, or the copy was torn). The ranges cover ``[0, total)`` in order.

    Returns ``{"step", "gen", "members", "ranges": [[owner, lo, hi, node, segment, offset, nbytes, crc32]]}``."""
    found: dict[tuple[int, ...], dict[int, list[Any]]] = {}
    for s in seals:
        if s.get("kind") != "replica" or int(s["step"]) != step or int(s["gen"]) != gen:
            continue
        ranges = found.setdefault(tuple(s["members"]), {})
        for owner, lo, hi, offset, n, crc in s["owners"]:
            ranges.setdefault(owner, [owner, lo, hi, s["node"], s["segment"], offset, n, crc])
    for members, ranges in found.items():
        if set(ranges) != set(members):
            continue
        ordered = sorted(ranges.values(), key=lambda r: r[1])
        if ordered[0][1] == 0 and all(a[2] == b[1] for a, b in zip(ordered, ordered[1:])):
            return {"step": step, "gen": gen, "members": list(members), "ranges": ordered}
    return None


def restore_moments(spec: dict[str, Any], *, job: str, node_of: dict[int, int], members: tuple[int, ...],
                    me: int, broadcast: Callable[[torch.Tensor, int], object], model: torch.nn.Module,
                    optimizer: Any) -> dict[str, Any]:
    """Load the moments :func:`moments_spec` names into ``optimizer``, just loaded from the snapshot (its steps
    set): each range is read on its holder's node by the first member there and broadcast to every member
    (every member derives the same broadcasts from ``spec``). A sharded AdamW (holding the whole range after
    the load) takes them into its flat moments; a replicated one (a ``--resume`` without
    ``train.shard_optimizer``) into each parameter's ``exp_avg`` and ``exp_avg_sq``, in the sharded AdamW's
    order (the trainable parameters, as ``named_parameters`` lists them). Returns what was done.

    Raises:
        SnapshotCorrupt: a copy changed since it was sealed, or the ranges do not cover the parameters.
    """
    t0 = time.perf_counter()
    params = [p for p in model.parameters() if p.requires_grad]
    total = sum(p.numel() for p in params)
    if spec["ranges"][-1][2] != total:
        raise SnapshotCorrupt(f"the copies cover {spec['ranges'][-1][2]} elements of the moments, the model's "
                              f"trainable parameters {total}")
    write = _moment_writer(params, optimizer)
    device = params[0].device if params else torch.device("cpu")
    sent = received = 0
    for owner, lo, hi, node, segment, offset, n, crc in spec["ranges"]:
        on_node = [w for w in members if node_of[w] == node]
        if not on_node:
            raise SnapshotCorrupt(f"the copy of worker {owner}'s moments is on node {node}, where no member of "
                                  f"the restored view runs")
        sender = min(on_node)
        t = torch.empty(2 * (hi - lo), dtype=torch.float32, device=device)
        if me == sender:
            buf = SealedBuffer.open(segment_path(segment), job)
            if buf is None or int(buf.seal["step"]) != spec["step"]:
                raise SnapshotCorrupt(f"{segment}: no longer holds the copies of step {spec['step']}")
            t.copy_(torch.frombuffer(bytearray(buf.read(offset, n, crc)), dtype=torch.float32))
            sent += n
        broadcast(t, members.index(sender))
        received += n if me != sender else 0
        write(lo, hi, t[:hi - lo], t[hi - lo:])
    return {"moment_ranges": len(spec["ranges"]), "moment_bytes_sent": sent, "moment_bytes_received": received,
            "moment_seconds": time.perf_counter() - t0}


def _moment_writer(params: list[torch.nn.Parameter], optimizer: Any
                   ) -> Callable[[int, int, torch.Tensor, torch.Tensor], None]:
    """``write(lo, hi, exp_avg, exp_avg_sq)``: the moments of ``[lo, hi)`` of the flat trainable parameters
    into ``optimizer``'s state."""
    if hasattr(optimizer, "load_full"):  # the sharded AdamW, holding every range after the snapshot's load
        if (optimizer.lo, optimizer.hi) != (0, optimizer.total):
            raise SnapshotCorrupt(f"the optimizer holds [{optimizer.lo}, {optimizer.hi}) of {optimizer.total}")

        def flat(lo: int, hi: int, m: torch.Tensor, v: torch.Tensor) -> None:
            optimizer.exp_avg[lo:hi].copy_(m)
            optimizer.exp_avg_sq[lo:hi].copy_(v)
        return flat
    offsets, at = [], 0
    for p in params:
        st = optimizer.state[p]
        for key in ("exp_avg", "exp_avg_sq"):
            if not torch.is_tensor(st.get(key)) or st[key].shape != p.shape:
                st[key] = torch.zeros_like(p, memory_format=torch.preserve_format)
        offsets.append(at)
        at += p.numel()

    def per_parameter(lo: int, hi: int, m: torch.Tensor, v: torch.Tensor) -> None:
        for p, off in zip(params, offsets):
            a, b = max(lo, off), min(hi, off + p.numel())
            if a < b:
                st = optimizer.state[p]
                st["exp_avg"].view(-1)[a - off:b - off].copy_(m[a - lo:b - lo])
                st["exp_avg_sq"].view(-1)[a - off:b - off].copy_(v[a - lo:b - lo])
    return per_parameter
