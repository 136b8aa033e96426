"""The keys of each worker and each node's agent in the job store (part of
:class:`~unbroken.store.job_store.JobStore`; the key schema is in that
module's docstring): liveness counters, death marks, join requests and refusals,
and the agents' registrations. The generations' keys (views, votes, restores)
stay in :mod:`unbroken.store.job_store`.

Invariant: a death mark is made once (the first mark wins) and counted in
``deaths``; a join request records the death mark present when it was made.
"""

from __future__ import annotations

import json
from typing import Any

from unbroken.store.backend import StoreBackend
from unbroken.store.standby_keys import _opt

__all__ = ["WorkerKeys"]


class WorkerKeys:
    """The workers' and agents' part of the job store (mixed into :class:`~unbroken.store.job_store.JobStore`)."""

    backend: StoreBackend

    # -- liveness ---------------------------------------------------------------

    def beat(self, worker: int) -> int:
        return self.backend.add(f"hb/{worker}", 1)

    def heartbeats(self, workers: list[int]) -> list[int]:
        """Heartbeat counters (0 for a worker that never beat or whose lease expired; never waits for a key)."""
        return [int(raw or 0) for raw in self.backend.get_present([f"hb/{w}" for w in workers])]

    def lease_liveness(self, worker: int, ttl_s: float) -> None:
        """``worker``'s liveness counters vanish by themselves ``ttl_s`` after its last beat (a store with
        leases; see :meth:`StoreBackend.lease_keys`); call on the connection that beats."""
        self.backend.lease_keys([f"hb/{worker}", f"prog/{worker}"], ttl_s)

    def advance(self, worker: int, phases: int) -> int:
        """Count ``phases`` more phases entered by ``worker``'s main thread."""
        return self.backend.add(f"prog/{worker}", phases)

    def liveness(self, members: tuple[int, ...] | list[int]) -> list[tuple[int | None, int | None]]:
        """(heartbeat, progress) counters of members of a published view, in one round trip; None for a counter
        that is gone (its lease expired, or another writer deleted it), negative for one holding a value this
        launch did not write (:data:`~unbroken.store.backend.UNSEEN`)."""
        values = [None if raw is None else int(raw)
                  for raw in self.backend.get_present([f"{k}/{w}" for w in members for k in ("hb", "prog")])]
        return [(values[2 * i], values[2 * i + 1]) for i in range(len(members))]

    def mark_dead(self, worker: int, reason: str) -> bool:
        """Declare ``worker`` dead (first mark wins); True if this call made the mark."""
        if self.backend.compare_set(f"dead/{worker}", "", reason).decode() != reason:
            return False
        self.backend.add("deaths", 1)
        return True

    def deaths(self) -> int:
        return self.backend.add("deaths", 0)

    def dead_mark(self, worker: int) -> str | None:
        return _opt(self.backend, f"dead/{worker}") or None

    def is_marked_dead(self, worker: int) -> bool:
        return self.backend.check([f"dead/{worker}"])

    def all_marked_dead(self, workers: tuple[int, ...]) -> bool:
        return bool(workers) and self.backend.check([f"dead/{w}" for w in workers])

    def clear_dead(self, worker: int) -> None:
        self.backend.delete_key(f"dead/{worker}")

    def unmark_dead(self, worker: int, reason: str) -> None:
        """Withdraw this caller's own mark (``reason``, as written); another's stays. (Emptied by
        compare-and-set, then deleted: a mark another observer slips in between is lost, and its detector
        marks that worker again a heartbeat timeout later.)"""
        if self.backend.compare_set(f"dead/{worker}", reason, "").decode() == "":
            self.backend.delete_key(f"dead/{worker}")

    # -- joins ------------------------------------------------------------------

    def request_join(self, worker: int, info: dict[str, Any]) -> None:
        """Ask to join (``info``: pid, config hash, time); clears an earlier refusal. The request records the
        death mark present now (``predecessor_mark``): the predecessor's, so that a later one tells that the
        incarnation which asked died too."""
        self.backend.delete_key(f"refused/{worker}")
        info = {**info, "predecessor_mark": self.dead_mark(worker)}
        self.backend.set(f"join/{worker}", json.dumps(info))
        self.backend.add("joins", 1)

    def join_request(self, worker: int) -> dict[str, Any] | None:
        raw = _opt(self.backend, f"join/{worker}")
        return None if raw is None else json.loads(raw)

    def refuse_join(self, worker: int, reason: str) -> None:
        """Turn ``worker``'s request down for good (it reads :meth:`join_refusal` and leaves)."""
        self.backend.set(f"refused/{worker}", reason)
        self.backend.delete_key(f"join/{worker}")

    def join_refusal(self, worker: int) -> str | None:
        return _opt(self.backend, f"refused/{worker}")

    def joins(self) -> int:
        return self.backend.add("joins", 0)

    def join_requests(self, candidates: list[int]) -> list[int]:
        """The ``candidates`` that asked to join."""
        return [w for w in candidates if self.backend.check([f"join/{w}"])]

    def clear_join(self, worker: int) -> None:
        self.backend.delete_key(f"join/{worker}")

    # -- agents -----------------------------------------------------------------

    def claim_node(self, node: int, token: str, expected: str = "") -> str:
        """Compare-and-set node ``node``'s registration from ``expected`` to ``token``; returns the holder."""
        return self.backend.compare_set(f"agent/{node}", expected, token).decode()

    def set_node_pid(self, node: int, text: str) -> None:
        self.backend.set(f"agent/{node}/pid", text)

    def node_pid(self, node: int) -> str | None:
        return _opt(self.backend, f"agent/{node}/pid")

    def release_node(self, node: int, token: str) -> None:
        self.backend.compare_set(f"agent/{node}", token, "")

    def node_holder(self, node: int) -> str | None:
        """The token of node ``node``'s agent; "" once given back; None if never taken."""
        return _opt(self.backend, f"agent/{node}")

    def node_released(self, node: int) -> bool:
        """Never taken, or given back."""
        return _opt(self.backend, f"agent/{node}") in (None, "")

    def agent_beat(self, node: int, amount: int = 1) -> int:
        return self.backend.add(f"hb/agent/{node}", amount)
