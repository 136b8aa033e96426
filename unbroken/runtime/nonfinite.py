"""Non-finite steps: a step whose reduced gradient (or loss) is not finite is applied nowhere.

After each attempt's reduction, before its vote, every member looks at the reduced buffer once (one pass:
:func:`finite`). The buffer is the same on every member (plain data parallelism and ZeRO-1 reduce it whole),
so every member finds the same and decides the same, with no word exchanged. An attempt found not finite is
aborted before any optimizer step and handled by :func:`decide`:

* the first time at a step it is a **transient**: the attempt is done again in the same view with the same
  rows, each worker computing its own items afresh (the ledger keeps the one record it has of them: the
  attempt that commits contains exactly those rows);
* every attempt of a step after that **counts the culprits**: before posting its reduction each member
  checks its own sums, and one that finds them not finite adds to the buffer's word
  (:meth:`~unbroken.mecefo.gradients.GradLayout.count_nonfinite`), so every member learns from the reduced
  buffer how many members' rows gave non-finite values;
* if it recurs with exactly one member's rows, that member is **corrupt**: it marks itself dead (``how``:
  ``non-finite``) and leaves fenced (exit 3; its agent replaces it), and the others move to the view without
  it as after any death: the takeover covers its rows, for the same step;
* if it recurs on any other rows (several members', none in particular, or again after a member was fenced
  at this step), the **job stops**: a member whose own rows were not finite records the failure with the
  step and its slots (the others wait for it a moment, then record it without the slots); the agents keep
  the snapshot memory for ``unbroken train --resume``.

Under HSDP each rank sees only its shard of the reduced gradient: the replica's word on its reductions
carries whether each rank found its shard finite (:meth:`~unbroken.runtime.view_changes.ViewChanges.replica_word`),
so every rank of every replica decides alike; the culprits are not counted there, so a recurring non-finite
step stops the job.

Events (each member's own log): ``attempt_aborted`` (``nonfinite``: true) for each attempt found not finite,
``nonfinite_step`` with the decision (``retry``, ``fence``, ``stop``), how many members counted their rows
not finite (``culprits``; None where not counted) and whether this member's were (``own``);
``nonfinite_fenced`` from the member that leaves; the job's failure message names the step and the slots.

Invariants: a step whose reduction is not finite is never voted on, so never applied; every member takes the
same decision at the same attempt; the cost of a step without a failure is one pass over the reduced buffer
(a float32 sum; the element-wise check runs only when that sum is not finite).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Literal, Protocol, Sequence

import torch

from unbroken.mecefo.gradients import SlotWork, slot_rows
from unbroken.runtime.membership import Fenced, MemberDied, Membership

__all__ = ["NONFINITE", "Decision", "NonFiniteStop", "NonFiniteSteps", "decide", "finite"]

logger = logging.getLogger(__name__)

NONFINITE = "non-finite"
"""The ``how`` of the mark a member leaves on itself when its rows gave non-finite values twice."""
STOP_WAIT_S = 5.0
"""How long a member whose own rows were finite waits for a culprit to record the job's failure (with its
slots) before recording it itself."""

Decision = Literal["retry", "fence", "stop"]


class NonFiniteStop(RuntimeError):
    """A step's reduced gradient stayed not finite: the job stops (the message names the step and the slots)."""


class CountingWord(Protocol):
    """Where a reduction buffer counts the members whose own sums are not finite
    (:class:`~unbroken.mecefo.gradients.GradLayout`)."""

    def count_nonfinite(self, buf: torch.Tensor) -> None: ...
    def nonfinite_count(self, buf: torch.Tensor) -> int: ...


def finite(buf: torch.Tensor) -> bool:
    """Whether every element of ``buf`` is finite: one float32 sum (NaN and infinities carry through a sum); only
    when the sum is not finite, which a finite buffer reaches by overflow alone, each element is looked at."""
    return bool(torch.isfinite(buf.sum())) or bool(torch.isfinite(buf).all())


def decide(earlier: int, culprits: int | None) -> Decision:
    """What the members do with an attempt of a step whose reduced buffer is not finite.

    Args:
        earlier: attempts of this step found not finite before this one.
        culprits: how many members found their own sums not finite in this attempt (None: not counted: the
            first attempt, or a layout whose reduction carries no count).

    Returns:
        ``retry`` the first time (a transient: the same rows again); ``fence`` the second time when exactly one
        member's rows were not finite (it leaves, the takeover covers its rows); ``stop`` otherwise.
    """
    if earlier == 0:
        return "retry"
    if earlier == 1 and culprits == 1:
        return "fence"
    return "stop"


class NonFiniteSteps:
    """One member's side of the rule (module docstring), called by the step protocol around each reduction.

    Args:
        membership: this worker's failure detector (its store records a stop; its marks fence).
        word: where the reduction buffer counts culprits (None: not counted, e.g. under HSDP).
        event: writes one event of this worker (``event(name, **fields)``).
    """

    def __init__(self, membership: Membership, word: CountingWord | None,
                 event: Callable[..., None]) -> None:
        self.m, self.word, self.event = membership, word, event
        self._step = -1
        self._found = 0  # attempts of self._step found not finite
        self._own: bool | None = None  # this attempt: were this worker's own sums not finite (None: not checked)

    @property
    def counting(self) -> bool:
        """Whether this attempt counts the culprits (an earlier attempt of its step was not finite)."""
        return self._found > 0 and self.word is not None

    def before_reduction(self, step: int, local: torch.Tensor) -> None:
        """Just before ``local`` is posted (its word written): in an attempt that counts, check this worker's
        own sums and count them in the word if they are not finite."""
        if step != self._step:
            self._step, self._found = step, 0
        self._own = None
        if self.counting:
            assert self.word is not None
            self._own = not finite(local)
            if self._own:
                self.word.count_nonfinite(local)

    def after_reduction(self, step: int, gen: int, reduced: torch.Tensor, items: Sequence[SlotWork],
                        is_finite: bool | None = None) -> bool:
        """After the reduction, before the vote: False if ``reduced`` is finite (the step goes on); True if the
        attempt is to be done again with the same rows.

        Args:
            is_finite: the replica's word on it (HSDP); None: look at ``reduced``.

        Raises:
            Fenced: this worker's rows were not finite again, and only its: it leaves (marked dead).
            MemberDied: another member's were: the members move to the view without it.
            NonFiniteStop: the job stops.
        """
        if step != self._step:
            self._step, self._found = step, 0
        if (finite(reduced) if is_finite is None else is_finite):
            return False
        culprits = self.word.nonfinite_count(reduced) if self.counting and self.word is not None else None
        decision = decide(self._found, culprits)
        self._found += 1
        attempt = {"step": step, "gen": gen, "attempt": self._found}
        self.event("nonfinite_step", **attempt, decision=decision, culprits=culprits, own=self._own,
                   items=slot_rows(items) if self._own else None)
        logger.warning("step %d: the reduced gradient is not finite (attempt %d, %s members' rows counted not "
                       "finite): %s", step, self._found, "no" if culprits is None else culprits, decision)
        if decision == "retry":
            self.event("attempt_aborted", **attempt, nonfinite=True,
                       reason="non-finite reduced gradient: the step is done again with the same rows")
            return True
        if decision == "fence":
            if self._own:
                self._fence(step, gen, items)
            raise MemberDied(f"step {step}'s reduced gradient was not finite again in view {gen}, from one "
                             "member's rows only: that member is fenced")
        raise self._stop(step, gen, items, culprits)

    def _fence(self, step: int, gen: int, items: Sequence[SlotWork]) -> None:
        reason = (f"its rows of step {step} ({_slots(items)}) gave non-finite gradients twice, no other member's "
                  "did: treated as corrupt")
        self.event("nonfinite_fenced", step=step, gen=gen, items=slot_rows(items), reason=reason)
        self.m.mark_dead(self.m.worker, json.dumps({"by": self.m.worker, "how": NONFINITE, "step": step,
                                                    "items": slot_rows(items), "t": time.time()}))
        raise Fenced(f"worker {self.m.worker}: {reason}")

    def _stop(self, step: int, gen: int, items: Sequence[SlotWork], culprits: int | None) -> NonFiniteStop:
        """The job's failure, recorded by a culprit with its slots (the others wait a moment for it)."""
        again = "after a member was fenced for it" if self._found > 2 else "on the retry with the same rows"
        if culprits is None:
            whose = "whose rows could not be told"
        elif culprits == 0:
            whose = "though every member's own sums were finite (their sum overflowed)"
        else:
            whose = f"from the rows of {culprits} member(s)"
        message = f"step {step}'s reduced gradient was not finite again {again}, {whose}"
        store = self.m.store
        if self._own:
            message += f"; worker {self.m.worker}'s {_slots(items)} gave non-finite gradients"
        elif culprits:
            deadline = time.monotonic() + STOP_WAIT_S
            while store.failure() is None and time.monotonic() < deadline:
                self.m.advance()
                time.sleep(0.01)
        detail: dict[str, Any] = {"step": step, "gen": gen, "culprits": culprits}
        self.event("attempt_aborted", **detail, attempt=self._found, nonfinite=True, reason=message)
        self.event("nonfinite_stop", **detail, message=message)
        logger.error("%s: the job stops", message)
        return NonFiniteStop(message)


def _slots(items: Sequence[SlotWork]) -> str:
    slots = sorted({i.slot for i in items})
    return f"slot{'s' if len(slots) != 1 else ''} {', '.join(map(str, slots))}"
