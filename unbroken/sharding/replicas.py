"""The ring copies of other members' optimizer shards, in the holder's node's snapshot memory.

After each committed step every member sends its shard's moments (``exp_avg``
then ``exp_avg_sq``, float32) to its ring buddy (:func:`~unbroken.sharding.ranges.ring_buddies`)
while the next step computes; the buddy writes what it received into one of
its two replica buffers (``unbroken-<job>-n<node>-w<worker>-r<b>``, owned by
the node's agent like every snapshot segment), sealed last, every byte under
a crc32 (:mod:`unbroken.snapshot.segment`). The buffer alternates with the
step, so the previous step's copies stay readable while the next ones are
written.

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

import torch

from unbroken.snapshot.segment import Buffer, SealedBuffer, SnapshotCorrupt, crc32, segment_name, segment_path

__all__ = ["ReplicaStore"]

logger = logging.getLogger(__name__)


class ReplicaStore:
    """The replica buffers of one worker (the holder)."""

    def __init__(self, job: str, node: int, worker: int) -> None:
        self.job, self.node, self.worker = job, node, worker
        self.buffers = [Buffer(job, node, worker, b, kind="r") for b in (0, 1)]
        self.written = 0
        self.since_gen = 0
        """Seals of older generations are ignored (the job was restored in this one)."""

    def forget_before(self, gen: int) -> None:
        """The job was restored in view ``gen``: copies sealed before it belong to an abandoned timeline."""
        self.since_gen = max(self.since_gen, gen)

    def write(self, done: int, gen: int, members: tuple[int, ...],
              copies: dict[int, tuple[int, int, torch.Tensor]]) -> None:
        """Seal ``copies`` (owner -> (lo, hi, moments of ``2 * (hi - lo)`` float32)) as the state after ``done`` steps."""
        if not copies:
            return
        t0 = time.perf_counter()
        sizes = {o: t.numel() * t.element_size() for o, (_, _, t) in copies.items()}
        area = self.buffers[done % 2].begin(sum(sizes.values()))
        owners, offset = [], 0
        for o, (lo, hi, t) in sorted(copies.items()):
            n = sizes[o]
            dst = area[offset:offset + n]
            torch.frombuffer(dst, dtype=torch.uint8).copy_(t.detach().cpu().contiguous().view(torch.uint8))
            owners.append([o, lo, hi, offset, n, crc32(dst)])
            offset += n
        self.buffers[done % 2].seal({"v": 1, "kind": "replica", "job": self.job, "node": self.node,
                                     "worker": self.worker, "step": done, "gen": gen, "members": list(members),
                                     "owners": owners, "t": time.time()})
        self.written += 1
        logger.debug("replicas of %s after step %d sealed in %.4f s", sorted(copies), done,
                     time.perf_counter() - t0)

    def read(self, owner: int, lo: int, hi: int, members: tuple[int, ...]) -> tuple[int, torch.Tensor] | None:
        """The newest intact copy of ``owner``'s range ``[lo, hi)`` under ``members``: (steps applied, moments)."""
        best: tuple[int, torch.Tensor] | None = None
        for b in (0, 1):
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
