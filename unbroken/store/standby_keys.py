"""The warm standby's keys in the job store (part of :class:`~unbroken.store.job_store.JobStore`; the key
schema is in that module's docstring, the contract in :mod:`unbroken.agent._standby`).

Invariant: an offer is taken whole or not at all (one value, claimed by compare-and-set), and a claim that
slips in before the agent retracts its offer is honoured (the retraction is a compare-and-set too).
"""

from __future__ import annotations

import json

from unbroken.store.backend import StoreBackend

__all__ = ["StandbyKeys"]


def _opt(backend: StoreBackend, key: str) -> str | None:
    # get() on a missing key blocks until the store's timeout: check first.
    return backend.get(key).decode() if backend.check([key]) else None


class StandbyKeys:
    """The standby's part of the job store (mixed into :class:`~unbroken.store.job_store.JobStore`)."""

    backend: StoreBackend

    def standby_announce(self, node: int, pid: int) -> None:
        self.backend.set(f"standby/{node}/ready", str(pid))

    def standby_ready_pid(self, node: int) -> str | None:
        return _opt(self.backend, f"standby/{node}/ready")

    def standby_clear_ready(self, node: int) -> None:
        self.backend.delete_key(f"standby/{node}/ready")

    def standby_offer(self, node: int, worker: int, faults: str, restore_gen: int | None = None) -> str | None:
        """Offer ``worker`` (with its fault indices, and the restored view it is started for, if any) to node
        ``node``'s standby, in one value (a claim takes all of it or nothing); returns the offer (for
        :meth:`standby_settle`), or None if another offer is pending."""
        offer = json.dumps({"worker": worker, "faults": faults, "restore_gen": restore_gen}, sort_keys=True)
        return offer if self.backend.compare_set(f"standby/{node}/assign", "", offer).decode() == offer else None

    def standby_claim(self, node: int, pid: int) -> tuple[int, str, int | None] | None:
        """The standby's side: take a pending offer; returns (worker, fault indices, restored view) or None."""
        key = f"standby/{node}/assign"
        offer = _opt(self.backend, key)
        me = f"claimed:{pid}"
        if not offer or not offer.startswith("{") or self.backend.compare_set(key, offer, me).decode() != me:
            return None
        terms = json.loads(offer)
        return int(terms["worker"]), str(terms["faults"]), terms["restore_gen"]

    def standby_settle(self, node: int, offer: str, pid: int, *, retract: bool) -> bool | None:
        """The agent's side of ``offer`` (:meth:`standby_offer`): True claimed by ``pid``, False retracted, None
        still pending."""
        key, claimed = f"standby/{node}/assign", f"claimed:{pid}"
        value = self.backend.get(key).decode()
        if value != claimed:
            if not retract:
                return None
            # If the claim slipped in just now, the compare-and-set returns it and it is honoured.
            value = self.backend.compare_set(key, offer, "").decode()
        if value != claimed:
            return False
        self.backend.compare_set(key, claimed, "")
        self.standby_clear_ready(node)
        return True

    def standby_beat(self, node: int, amount: int = 1) -> int:
        """Node ``node``'s standby beats while it waits (``amount=0``: read; never blocks)."""
        return self.backend.add(f"hb/standby/{node}", amount)
