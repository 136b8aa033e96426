"""What a restore's load found damaged in snapshot memory, and every member's agreement on it.

A restore is one load made by every member of the restored view together
(:func:`unbroken.snapshot.restore.restore_from_memory`): each member reads
fragments of its own node's memory, and some of them send what they read or
decode to the others. The seals decided the restore (they are authenticated,
so the decision is quick); the bytes are checked as they are read, so a
fragment whose bytes no longer match their checksum (or whose segment no
longer holds the snapshot) is found by the member that reads it, in the
middle of that load. The load goes on: the member records the fragment as
damaged and the stripe it fed as tainted (the bytes it wrote, or sent, are
wrong), and sends what it has (zeros for what it could not read), so that
every member makes the same broadcasts as before.

When every stripe has been loaded, each member sends its findings to all
(:func:`agree`: one broadcast per member of ``stripes * (k + m + 1)`` bytes; a
restore of one process sends nothing). All then hold the same damaged
fragments and tainted stripes, drop the damaged fragments from the holders,
and load each tainted stripe again from the fragments left, another holder's
or the parity (a node that can no longer decode a stripe alone receives it
from one that can, or the fragments are gathered), the same way on every
member. A round may find more damage (the parity itself); the next round goes
without that too.

Invariants: every member leaves :func:`agree` with the same sets, so every
member makes the same broadcasts and fails, or not, alike; a round with
tainted stripes but no new damaged fragment, or a stripe the fragments left
can no longer decode, fails the load with :class:`SnapshotCorrupt` (the
restore then falls back as for any failed load: the next attempt's inventory
checks every byte, and an older snapshot or the checkpoint is chosen); each
damaged fragment is logged once, by the member that found it, naming the
segment and the byte range.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from unbroken.snapshot.segment import SnapshotCorrupt

__all__ = ["Damage", "Damaged", "agree", "undecodable"]

logger = logging.getLogger(__name__)


class Damaged(Exception):
    """A read of a fragment failed and was recorded (:meth:`Damage.lost`): its stripe is tainted."""


@dataclasses.dataclass
class Damage:
    """One member's view of the damage found in a load: its own findings, then everyone's (:func:`agree`)."""

    step: int
    stripes: int
    fragments: int
    """Fragments per stripe (k + m)."""
    bad: set[tuple[int, int]] = dataclasses.field(default_factory=set)
    """``(stripe, fragment)`` that cannot be read as sealed."""
    tainted: set[int] = dataclasses.field(default_factory=set)
    """Stripes some member loaded (or sent) from a damaged fragment: to be loaded again."""
    found: list[str] = dataclasses.field(default_factory=list)
    """What this member found, as it found it: the segment, the byte range, why."""

    def lost(self, stripe: int, fragment: int, why: str) -> None:
        """Fragment ``fragment`` of ``stripe`` could not be read as sealed (``why`` names the segment and range)."""
        if (stripe, fragment) not in self.bad:
            self.found.append(why)
            logger.warning("restore of step %d: fragment %d of stripe %d is damaged (%s); the stripe is loaded "
                           "again without it", self.step, fragment, stripe, why)
        self.bad.add((stripe, fragment))
        self.tainted.add(stripe)

    def taint(self, stripe: int, why: str) -> None:
        """``stripe`` could not be decoded from what was read or received."""
        logger.warning("restore of step %d: stripe %d could not be decoded (%s)", self.step, stripe, why)
        self.tainted.add(stripe)

    def encode(self, device: torch.device) -> torch.Tensor:
        """The findings as flags: ``bad`` by ``stripe * fragments + fragment``, then ``tainted`` by stripe."""
        flags = torch.zeros(self.stripes * (self.fragments + 1), dtype=torch.uint8)
        for st, fr in self.bad:
            flags[st * self.fragments + fr] = 1
        for st in self.tainted:
            flags[self.stripes * self.fragments + st] = 1
        return flags.to(device)

    def merge(self, flags: torch.Tensor) -> None:
        """Add another member's findings (:meth:`encode`)."""
        on = flags.cpu().nonzero().flatten().tolist()
        edge = self.stripes * self.fragments
        self.bad |= {divmod(int(i), self.fragments) for i in on if i < edge}
        self.tainted |= {int(i) - edge for i in on if i >= edge}


def agree(damage: Damage, *, broadcast: Callable[[torch.Tensor, int], object], members: tuple[int, ...], me: int,
          device: torch.device) -> None:
    """Every member's findings into ``damage``, on every member (one broadcast from each; none alone).

    Raises:
        Whatever ``broadcast`` raises.
    """
    if len(members) == 1:
        return
    size = damage.stripes * (damage.fragments + 1)
    for src, member in enumerate(members):
        flags = damage.encode(device) if member == me else torch.zeros(size, dtype=torch.uint8, device=device)
        broadcast(flags, src)
        damage.merge(flags)


def undecodable(damage: Damage, exc: SnapshotCorrupt) -> SnapshotCorrupt:
    """The error of a load that damage left unable to decode a stripe: ``exc`` with what this member found."""
    found = f"; damaged: {'; '.join(damage.found)}" if damage.found else ""
    return SnapshotCorrupt(f"{exc}{found}")
