"""A membership view: one generation of who trains, from which step, who joins."""

from __future__ import annotations

import dataclasses
import json

__all__ = ["View"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class View:
    """One membership generation: who trains, from which step, who joins.

    ``members`` are ascending worker ids; ``members[0]`` is the view's leader
    (metrics, checkpoints, admissions, pruning of the store).
    """

    gen: int
    members: tuple[int, ...]
    step: int
    joiners: tuple[int, ...] = ()
    reason: str = ""
    restore: dict | None = None
    from_memory: tuple[int, ...] = ()
    """Joiners that load the state of ``step`` from their own node's snapshot memory instead of a peer."""
    """Set on a view that brings the job back after every member died (or at ``--resume``): where
    its members load the state from (:func:`unbroken.snapshot.restore.decide`'s spec)."""

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> View:
        d = json.loads(text)
        return cls(gen=d["gen"], members=tuple(d["members"]), step=d["step"],
                   joiners=tuple(d.get("joiners", ())), reason=d.get("reason", ""),
                   restore=d.get("restore"), from_memory=tuple(d.get("from_memory", ())))

    def rank_of(self, worker: int) -> int:
        return self.members.index(worker)

    @property
    def leader(self) -> int:
        return self.members[0]
