"""Silently wrong parameters: the replicas' parameter checksums compared in the step's own reduction.

Every ``fault.param_check_every`` steps each member writes an exact checksum of its parameters
(:func:`checksum`) into its own two slots of the reduction buffer's checksums
(:meth:`~unbroken.mecefo.gradients.GradLayout.checksums`: two floats per worker, 0 in the others'), after its
forward and backward passes, before the reduction: one more read of the parameters, no message more. After the
reduction every member holds the same vector, so every member decides the same (:func:`judge`):

* the live members' checksums all equal: the step goes on (to the non-finite check and the vote);
* they differ and a strict majority agrees: the step is not applied (its reduction holds gradients computed
  with a wrong parameter). The first time at a step, where the members' parameters are replicated (plain data
  parallelism, no ZeRO-1), the corruption is undone in place (``repair``): the majority's first member
  broadcasts its parameters into the others' (:meth:`ParamCheck.repair`; event ``param_repaired``) and the
  attempt is done again by the same members with the same rows, so the run ends bit for bit as the run without
  the fault. Again at that step, or where it cannot be repaired, each member outside the majority marks itself
  dead (``how``: ``param-mismatch``; event ``param_mismatch_fenced``) and leaves fenced (exit 3; its agent
  restarts it and it rejoins with the state from a peer); the others move to the view without it as after any
  death, the takeover covering its rows for the same step;
* they differ with no strict majority (two members, or a tie): nobody can tell which is wrong, so the **job
  stops**, naming the step and the workers (the agents keep the snapshot memory for ``unbroken train --resume``).

The checksum: each parameter's bytes read as 32-bit integers (16-bit or 8-bit ones where its size is not a
multiple of 4 bytes) and summed modulo ``2**32`` (int32 sums that wrap: exact, and the same in any order of
addition, so on any device), the parameters' sums summed alike; the 32-bit result travels as its two 16-bit
halves, which float32 holds exactly (the reduction adds only zeros to them). A single flipped bit changes one
word by ``+-2**k`` with ``k`` below its width (the sign bit too, by two's complement), so the sum modulo
``2**32`` by a nonzero amount: at least one half differs. (A sum folded into one 24-bit slot does not have this
property for every fold: a carry across the fold's boundary can cancel the change.) Several flips cancel with
probability about ``2**-32``.

Under HSDP (:class:`~unbroken.sharding.replica_layout.ReplicaLayout`) each rank checksums its own shards,
and a rank's reduction sums the buffers of its shard index's workers, one per live replica: each rank judges
its index's checksums (:meth:`ParamCheck.find`), and the ranks of a replica pool their findings in the word
they exchange after every reduction (:meth:`ParamCheck.marks`: whether any index had no strict majority, and
which replicas an index found wrong), so every rank of every replica acts alike (:meth:`ParamCheck.settle`): an
index's checksums are the same on every replica, and every replica has a rank of every index. A replica found
wrong leaves whole (each of its ranks marks itself dead), as after any death of one of its ranks. Under
``fault.recovery=restart`` (plain data parallelism) the checksums are written but not compared.

Invariants: a step whose members' checksums differ is never voted on, so never applied; every member takes the
same decision from the same reduced vector; a step with the check costs one read of the parameters and a few
floats of the buffer.
"""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Hashable, Iterable, Literal, Mapping, Protocol, Sequence

import torch

from unbroken.runtime.membership import Fenced, MemberDied, Membership
from unbroken.sharding.replica_layout import ReplicaLayout
from unbroken.state.parts import local_of

__all__ = ["Finding", "HALF", "PARAM_MISMATCH", "ParamCheck", "ParamMismatchStop", "Verdict", "checksum", "judge"]

logger = logging.getLogger(__name__)

HALF = 1 << 16
"""The checksum travels as two halves below this (float32 holds each exactly)."""
PARAM_MISMATCH = "param-mismatch"
"""The ``how`` of the mark a member leaves on itself when its parameters differ from the majority's."""


class ParamMismatchStop(RuntimeError):
    """The members' parameters differ and no strict majority agrees: the job stops (the message names the step and
    the workers)."""


class Checksums(Protocol):
    """Where a reduction buffer carries the workers' checksums (:class:`~unbroken.mecefo.gradients.GradLayout`)."""

    def checksums(self, buf: torch.Tensor) -> torch.Tensor: ...


def _words(t: torch.Tensor) -> torch.Tensor:
    """``t``'s bytes as integers: 32-bit words where its size allows, else 16-bit, else bytes."""
    flat = t.detach().reshape(-1)
    n_bytes = flat.numel() * flat.element_size()
    if n_bytes % 4 == 0:
        return flat.view(torch.int32)
    return flat.view(torch.int16 if n_bytes % 2 == 0 else torch.uint8)


def checksum(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """The tensors' exact checksum (module docstring): a 0-d int32 tensor on their device, their words' sum modulo
    ``2**32``; nothing waits for the device."""
    parts = [_words(t).sum(dtype=torch.int32) for t in tensors]
    if not parts:
        return torch.zeros((), dtype=torch.int32)
    return torch.stack(parts).sum(dtype=torch.int32)


def halves(value: torch.Tensor) -> torch.Tensor:
    """A checksum's two 16-bit halves (low, high), each in ``[0, HALF)``, as two float32 (on its device)."""
    return torch.stack([value & (HALF - 1), (value >> 16) & (HALF - 1)]).float()


@dataclass(frozen=True)
class Verdict:
    """What the members do with a step's reduced checksums (:func:`judge`)."""

    decision: Literal["agree", "repair", "fence", "stop"]
    wrong: tuple[int, ...] = ()
    """``repair``, ``fence``: the members outside the majority; ``stop``: every member (none can be told right)."""


def judge(values: Mapping[int, Hashable]) -> Verdict:
    """The rule on the live members' checksums (``{worker: checksum}``): all equal, ``agree``; else, when more than
    half of them hold one value, ``fence`` the others; else ``stop``."""
    counts = Counter(values.values())
    if len(counts) <= 1:
        return Verdict("agree")
    value, n = counts.most_common(1)[0]
    if 2 * n > len(values):
        return Verdict("fence", tuple(sorted(w for w, v in values.items() if v != value)))
    return Verdict("stop", tuple(sorted(values)))


@dataclass(frozen=True)
class Finding:
    """What a member read in a checked step's reduction: the checksums it compares (``{worker: checksum}``: the
    view's members, or under HSDP its shard index's, one per live replica) and the rule's verdict on them."""

    values: Mapping[int, int]
    verdict: Verdict


class ParamCheck:
    """One member's side of the check (module docstring), called by the step protocol around each reduction.

    Args:
        membership: this worker's failure detector (its marks fence).
        buffers: where the reduction buffers carry the checksums.
        params: this worker's parameters (under HSDP the checksum reads their local shards).
        every: check every this many steps (>= 1).
        event: writes one event of this worker (``event(name, **fields)``).
        replicas: HSDP's layout (None: plain data parallelism, every member compared with every other).
        repairs: whether a mismatch may be undone in place (the members' parameters replicated: not under HSDP
            or ZeRO-1).
    """

    def __init__(self, membership: Membership, buffers: Checksums, params: Sequence[torch.Tensor], *, every: int,
                 event: Callable[..., None], replicas: ReplicaLayout | None = None, repairs: bool = False) -> None:
        if every < 1:
            raise ValueError(f"param check every {every} steps: must be >= 1")
        self.m, self.buffers, self.params, self.every, self.event = membership, buffers, params, every, event
        self.replicas, self.repairs = replicas, repairs and replicas is None
        self._repaired_at: int | None = None  # the step whose mismatch was last repaired (again there: fenced)

    def checks(self, step: int) -> bool:
        """Whether ``step``'s reduction carries the checksums."""
        return step % self.every == 0

    def stamp(self, step: int, local: torch.Tensor) -> None:
        """Before ``local`` is posted: this worker's checksum in its slot (0 in the others', and everywhere on a
        step without the check)."""
        slots = self.buffers.checksums(local)
        slots.zero_()
        if self.checks(step):
            me = self.m.worker
            slots[2 * me : 2 * me + 2] = halves(checksum(local_of(p) for p in self.params))  # read as they are now

    def find(self, step: int, reduced: torch.Tensor, members: Sequence[int]) -> Finding | None:
        """After the reduction: the checksums this member compares and the verdict on them (None: ``step`` is not
        checked, or there is nobody to compare with)."""
        if self.replicas is not None:  # the workers of this rank's shard index, one per live replica
            members = self.replicas.shard_peers(self.replicas.index_of(self.m.worker), members)
        if not self.checks(step) or len(members) < 2:
            return None
        slots = self.buffers.checksums(reduced).tolist()
        values = {w: round(slots[2 * w]) + HALF * round(slots[2 * w + 1]) for w in members}
        return Finding(values, judge(values))

    def marks(self, finding: Finding | None) -> list[int]:
        """HSDP: this rank's part of its replica's word (summed over the replica's ranks): whether its index's
        checksums had no strict majority, then a mark per replica its index found wrong (``[]`` without HSDP)."""
        if self.replicas is None:
            return []
        out = [0] * (1 + self.replicas.replicas)
        if finding is not None and finding.verdict.decision == "stop":
            out[0] = 1
        elif finding is not None and finding.verdict.decision == "fence":
            for w in finding.verdict.wrong:
                out[1 + self.replicas.replica_of(w)] = 1
        return out

    def settle(self, step: int, gen: int, finding: Finding | None,
               pooled: Sequence[int] | None = None) -> Verdict | None:
        """After the reduction (under HSDP after the replica's word, ``pooled`` its summed :meth:`marks`), before
        anything looks at its gradients: None if the checksums agree; a ``repair`` verdict if the members are to
        undo the mismatch (:meth:`repair`) and do the attempt again.

        Raises:
            Fenced: this worker's parameters (its replica's, under HSDP) differ from the majority's: it leaves.
            MemberDied: another member's (replica's) do: the members move to the view without it.
            ParamMismatchStop: they differ with no strict majority: the job stops.
        """
        verdict = None if finding is None else finding.verdict
        if self.replicas is not None and pooled:  # what every rank of every replica found, alike everywhere
            layout = self.replicas
            wrong = tuple(w for r, n in enumerate(pooled[1:]) if n for w in layout.replica_members(r))
            verdict = Verdict("stop", verdict.wrong if verdict is not None and verdict.decision == "stop" else ()) \
                if pooled[0] else Verdict("fence", wrong) if wrong else None
        if verdict is None or verdict.decision == "agree":
            return None
        if verdict.decision == "fence" and self.repairs and self._repaired_at != step:
            self._repaired_at = step
            verdict = Verdict("repair", verdict.wrong)
        me, values = self.m.worker, {} if finding is None else finding.values
        fields = {"step": step, "gen": gen, "checksums": {str(w): v for w, v in values.items()},
                  "decision": verdict.decision, "wrong": list(verdict.wrong)}
        self.event("param_mismatch", **fields)
        logger.error("step %d: the members' parameter checksums differ (%s): %s", step,
                     ", ".join(f"worker {w}: {v}" for w, v in values.items()) or "another shard index's",
                     verdict.decision)
        if verdict.decision == "repair":
            self.event("attempt_aborted", step=step, gen=gen, param_mismatch=True, reason="parameter checksums "
                       f"differ: workers {_names(verdict.wrong)} take the majority's parameters, the step is done "
                       "again with the same rows")
            return verdict
        if verdict.decision == "fence":
            if me in verdict.wrong:
                theirs = next((values[w] for w in values if w not in verdict.wrong), None)
                reason = (f"its parameters at step {step} differ from those of the majority of the view's members "
                          + (f"(checksum {values[me]}, theirs {theirs})" if me in values and theirs is not None
                             else "(in another shard of its replica)"))
                self.event("param_mismatch_fenced", step=step, gen=gen, reason=reason)
                self.m.mark_dead(me, json.dumps({"by": me, "how": PARAM_MISMATCH, "step": step, "t": time.time()}))
                raise Fenced(f"worker {me}: {reason}")
            one = len(verdict.wrong) == 1
            raise MemberDied(f"step {step}'s parameter checksums differ in view {gen}: worker{'' if one else 's'} "
                             f"{_names(verdict.wrong)} {'disagrees' if one else 'disagree'} with the majority and "
                             f"{'is' if one else 'are'} fenced")
        sums = ", ".join(str(values[w]) for w in verdict.wrong)
        named = f"workers {_names(verdict.wrong)} differ (checksums {sums})" if verdict.wrong else \
            "replicas differ in one shard"
        message = (f"step {step}: the parameters of {named} and no strict majority of the view's members agrees, "
                   "so none can be told wrong; the step was not applied")
        self.event("attempt_aborted", step=step, gen=gen, reason=message)
        self.event("param_mismatch_stop", step=step, gen=gen, message=message)
        raise ParamMismatchStop(message)

    def repair(self, step: int, gen: int, verdict: Verdict, peers: Sequence[int],
               broadcast: Callable[[torch.Tensor, int], object]) -> None:
        """Undo a mismatch in place: the majority's first member broadcasts its parameters (group rank in
        ``peers``) into those of the members outside it; every member of the group takes part (the others
        receive into scratch, so what they hold is never written).

        Raises:
            Whatever ``broadcast`` raises (a collective that failed: the members move to a new view, where a
            mismatch again at this step fences).
        """
        me, source = self.m.worker, min(w for w in peers if w not in verdict.wrong)
        with torch.no_grad():
            for p in self.params:
                t = local_of(p)
                broadcast(t if me == source or me in verdict.wrong else torch.empty_like(t), peers.index(source))
        if me in verdict.wrong:
            self.event("param_repaired", step=step, gen=gen, source=source,
                       checksum=int(checksum(local_of(p) for p in self.params)) % (HALF * HALF))
            logger.warning("step %d: this worker's parameters differed from the majority's: worker %d's taken",
                           step, source)


def _names(workers: Sequence[int]) -> str:
    return ", ".join(map(str, workers[:-1])) + (" and " if len(workers) > 1 else "") + str(workers[-1])
