"""The job's coordination store: every key the job uses, behind typed methods.

This is the only module (with its parts :mod:`unbroken.store.worker_keys`, the workers' and agents' keys, and
:mod:`unbroken.store.standby_keys`, the warm standby's) that names coordination keys or calls the store's
``get/set/compare_set/add``; the launcher, the agents, the standby, the step protocol and the workers all go
through :class:`JobStore`. The backend is a :class:`StoreBackend`: the job's embedded store
(:class:`EmbeddedBackend`), hosted by the launcher (or node 0's agent), or an etcd v3 cluster
(:class:`~unbroken.store.etcd_backend.EtcdBackend`, ``--store etcd://...``).

Access (:mod:`unbroken.store.backend`): the embedded store listens on the job's host only and serves only
connections that prove they hold the job's secret, of its launch, so nobody else can read or change anything; on
etcd every key lives under a namespace derived from the secret and every value is sealed.

Key schema (``<g>`` a view generation, ``<w>`` a worker, ``<R>`` a node rank):

============================  ==============================  ==================================================
key                           written by                      holds
============================  ==============================  ==================================================
``job``                       the store's host                the job is here (a wrong secret finds nothing)
``config``                    launcher / node-0 agent         the job's config JSON
``fingerprint/<h>/<name>``    first worker to start (CAS)     what every worker of config hash ``h`` must
                                                              build alike: parameter layout, data rows
``gen``                       view proposers (CAS)            the current generation
``view/<g>``                  view proposers (CAS)            the :class:`View` JSON of generation ``g``
``outcome/<g>``               members (CAS)                   ``"<step>:commit|abort"``: the last step decided in ``g``
``applied/<g>``               view leader's heartbeat thread  steps the leader of ``g`` applied past ``g``'s first
                                                              (a total: a heartbeat sent again counts once)
``arrive/<g>``                members (add)                   how many members reached view ``g``
``items/<g>/<w>``             members                         ``[step, items]`` computed before joining ``g``
``pg/<g>/0/<rank>``           gloo's rendezvous               the rank's transport addresses
``pruned``                    view leaders                    every generation below this one is deleted
                                                              (written before its keys go)
``hb/<w>``                    worker's heartbeat thread       liveness counter (etcd: under the worker's lease)
``prog/<w>``                  worker's heartbeat thread       progress counter of its main thread (phases entered)
``dead/<w>`` + ``deaths``     agents, observing peers         why ``w`` was declared dead; how many marks so far
``join/<w>`` + ``joins``      restarted workers               a join request; how many so far
``refused/<w>``               view leader                     why ``w``'s join request was refused
``progress``                  the restoring agent             the step a restore went back to (the applied
                              (plain data parallelism: leader) steps are read from ``view/<g>`` + ``applied/<g>``)
``done`` / ``failed``         leader / agents, workers        the job finished / cannot go on (why)
``agent/<R>`` (+ ``/pid``)    agents (CAS)                    the registration token of node ``R``'s agent
``hb/agent/<R>``              agents                          the agent's liveness counter
``standby/<R>/ready``         node ``R``'s standby            its pid, once warm
``standby/<R>/assign``        agent, standby (CAS)            an offer (JSON: worker, fault indices, restored
                                                              view), ``"claimed:<pid>"`` taken, ``""``
``hb/standby/<R>``            node ``R``'s standby            its liveness counter while it waits for an offer
``snapinv/<g>/<R>``           node ``R``'s agent              its snapshot memory (sealed buffers) when view ``g`` died
``restore/<g>``               agents (CAS)                    the node whose agent restores the job after view ``g``
============================  ==============================  ==================================================

Invariants: generations only grow; ``view/<g>`` and ``outcome/<g>`` exist
before ``gen`` says ``g``; a step's outcome is decided once, by the first vote;
the store holds O(workers + nodes) keys whatever the step count: one outcome
key per generation (not per step), and every generation below the newest one
in which a step committed is deleted by that view's leader (its members have
all left the older ones: they all completed that step's all-reduce), and no
writer far behind creates a key of a pruned generation again (it deletes what
it wrote once it reads ``pruned`` above it); ``view/<g>`` is created only
while ``gen`` is below ``g``; ``gen`` and ``outcome/<g>`` found gone (another
writer deleted them) are brought back with the newest decision written there
(:meth:`StoreBackend.restore`), never another.
"""

from __future__ import annotations

import json
import time
from typing import Any, Literal

import torch.distributed as dist

from unbroken.store.standby_keys import StandbyKeys, _opt
from unbroken.store.backend import EmbeddedBackend, StoreBackend, is_etcd_address
from unbroken.store.latency import LatencyHistogram
from unbroken.store.view import View
from unbroken.store.worker_keys import WorkerKeys

__all__ = ["JobStore", "Outcome", "StoreKeyLost"]

CURRENT_VIEW_READS = 100
"""A view replaced and pruned between reading ``gen`` and reading it is read again, this many times at most
(each retry sees a newer generation; a missing view can only be a race that the next read wins)."""
LOST_KEY_POLL_S = 0.1
"""A vote that finds its view's outcome key gone (not pruned) reads it again after this long."""
STORE_TIMEOUT_S = 60.0
"""How long a job waits for a key another writer deleted before it stops (``fault.store_timeout_s``'s default)."""

Outcome = Literal["commit", "abort", "stale"]
"""A vote's result; ``stale``: the generation was pruned, so the voter is far behind (fenced)."""

class StoreKeyLost(dist.DistStoreError):
    """A key the job needs to decide held nothing the job wrote for the store timeout (deleted or overwritten by
    another writer): the job stops rather than decide without it."""


class JobStore(StandbyKeys, WorkerKeys):
    """Typed access to one job's coordination state (key schema in the module docstring)."""

    def __init__(self, backend: StoreBackend) -> None:
        self.backend = backend
        self.store_timeout_s = STORE_TIMEOUT_S
        """How long a vote waits for its outcome key if another writer deleted it (:meth:`set_store_timeout`)."""
        self.group_names: tuple[str, ...] = ("",)
        """The names of each view's process groups (:meth:`group_store`), for :meth:`prune`."""

    @classmethod
    def connect(cls, addr: str, *, timeout_s: float, secret: str, store_timeout_s: float | None = None) -> JobStore:
        """Connect to the job's store at ``HOST:PORT`` (see :meth:`EmbeddedBackend.connect`) or on the etcd
        cluster of an ``etcd://`` address (see :meth:`~unbroken.store.etcd_backend.EtcdBackend.connect`);
        ``store_timeout_s``: see :meth:`set_store_timeout` (None: ``timeout_s``)."""
        if is_etcd_address(addr):
            from unbroken.store.etcd_backend import EtcdBackend  # optional dependency, imported on use

            return cls(EtcdBackend.connect(addr, timeout_s=timeout_s, secret=secret, store_timeout_s=store_timeout_s))
        return cls(EmbeddedBackend.connect(addr, timeout_s=timeout_s, secret=secret))

    @classmethod
    def create_on_etcd(cls, addr: str, *, timeout_s: float, secret: str, job: dict[str, Any]) -> JobStore:
        """Open a new job's keys on the etcd cluster at ``addr`` (``job``: who it is, named to a later job
        that collides; see :meth:`~unbroken.store.etcd_backend.EtcdBackend.create`)."""
        from unbroken.store.etcd_backend import EtcdBackend

        return cls(EtcdBackend.create(addr, timeout_s=timeout_s, secret=secret, job=job))

    @classmethod
    def host(cls, host: str, port: int, *, clients: int, secret: str) -> JobStore:
        """Host a job's store on ``host`` only (see :meth:`EmbeddedBackend.host`); :meth:`close` stops it."""
        return cls(EmbeddedBackend.host(host, port, clients=clients, secret=secret))

    def usage(self) -> dict[str, float]:
        """Requests this connection sent and the seconds they took (``seconds`` where the backend times them)."""
        return {"round_trips": int(getattr(self.backend, "round_trips", 0)),
                "seconds": round(float(getattr(self._connection, "seconds", 0.0)), 4)}

    def request_latency(self) -> LatencyHistogram | None:
        """This connection's running histogram of request seconds (None for a backend that keeps none)."""
        return getattr(self._connection, "latency", None)

    @property
    def _connection(self) -> object:  # what sends the requests: the embedded store's client, or etcd's cluster
        return getattr(self.backend, "client", None) or getattr(self.backend, "cluster", None)

    @property
    def launch(self) -> str | None:  # the embedded store's launch id (None on etcd): an agent's processes pin it
        return getattr(self.backend, "launch", None)

    def close(self) -> None:
        """Close this connection (and stop the store if this process hosts it)."""
        close = getattr(self.backend, "close", None)
        if close is not None:
            close()

    @property
    def port(self) -> int:
        return self.backend.port  # type: ignore[attr-defined]

    def num_keys(self) -> int:
        return self.backend.num_keys()

    def set_store_timeout(self, seconds: float) -> None:
        """Let an operation wait up to ``seconds`` for an unanswering store (etcd without quorum) before it
        raises a ``torch.distributed.DistStoreError`` (``fault.store_timeout_s``)."""
        self.backend.set_store_timeout(seconds)
        self.store_timeout_s = seconds

    @property
    def poll_s(self) -> float:
        """The floor on a supervising loop's polling interval for this store (see :attr:`StoreBackend.poll_s`)."""
        return self.backend.poll_s

    # -- config -----------------------------------------------------------------

    def publish_config(self, text: str) -> None:
        self.backend.set("config", text)

    def agree_config(self, text: str) -> str:
        """Publish ``text`` unless a config is there already; returns the job's config."""
        return self.backend.compare_set("config", "", text).decode()

    def config(self) -> str | None:
        return _opt(self.backend, "config")

    def agree_run_dir_token(self, token: str) -> str:
        """Publish the token node 0 wrote into its run directory unless one is there; returns the job's."""
        return self.backend.compare_set("run_dir_token", "", token).decode()

    def run_dir_token(self) -> str | None:
        return _opt(self.backend, "run_dir_token")

    def agree_fingerprint(self, config_hash: str, name: str, text: str) -> str:
        """Publish ``text`` as fingerprint ``name`` of the job unless one is there; returns the job's."""
        return self.backend.compare_set(f"fingerprint/{config_hash}/{name}", "", text).decode()

    def fingerprint(self, config_hash: str, name: str) -> str | None:
        return _opt(self.backend, f"fingerprint/{config_hash}/{name}")

    # -- views ------------------------------------------------------------------

    def has_view(self) -> bool:
        return self._decision("gen") is not None

    def gen(self) -> int:
        raw = self._decision("gen")
        return int(raw if raw is not None else self.backend.get("gen"))  # not yet published: wait for it

    def _decision(self, key: str, gen: int | None = None) -> str | None:
        """Decision key ``key`` (``gen``, or generation ``gen``'s ``outcome/<g>``): its value, brought back
        first with the newest decision written there if another writer deleted or forged it (a store others can
        write to: :meth:`StoreBackend.restore`); None if it holds none (or ``gen`` is pruned)."""
        raw = self.backend.peek([key])[0]
        if raw is None and (gen is None or not self._pruned(gen)) and self.backend.restore(key):
            if gen is not None and not self._kept(gen, key):
                return None
            raw = self.backend.peek([key])[0]
        return None if raw is None else raw.decode()

    def _pruned(self, gen: int) -> bool:
        return gen >= 0 and int(_opt(self.backend, "pruned") or 0) > gen

    def view(self, gen: int) -> View:
        return View.from_json(self.backend.get(f"view/{gen}"))

    def current_view(self) -> View:
        """The newest view (read again if it was replaced and pruned between the two reads; waited for if ``gen``
        still names it: another writer deleted it, and etcd reads it from the key's history meanwhile).

        Raises:
            RuntimeError: ``gen`` names a view that stays missing (the store lost keys).
        """
        for _ in range(CURRENT_VIEW_READS):
            gen = self.gen()
            if (raw := _opt(self.backend, f"view/{gen}")) is not None or self.gen() == gen:
                return View.from_json(raw) if raw is not None else self.view(gen)
        raise RuntimeError(f"the store's current generation {gen} names no view after {CURRENT_VIEW_READS} reads")

    def publish_initial(self, view: View) -> None:
        """Write generation 0 if absent (the launcher or node 0's agent); nothing once ``gen`` was published
        (brought back first if another writer deleted it: a later call never sends the job back)."""
        if self._decision("gen") is not None:
            return
        self._open(self.backend.compare_set(f"view/{view.gen}", "", view.to_json()))
        self.backend.compare_set("gen", "", str(view.gen))

    def propose(self, current: View, new: View) -> View:
        """Replace ``current`` by ``new`` unless someone already replaced it; returns the winner.

        A proposal is created only while ``gen`` still says ``current`` (in the create's transaction on etcd),
        and the view returned is read once ``gen`` says ``new.gen``: by then ``view/<new.gen>`` was decided
        and opened, so one found gone was deleted by another writer or pruned, and creating it again could
        give members of one generation different views. Pruned, the newest view is returned (the proposer
        is far behind); else the proposer waits for the key up to the store timeout.

        Raises:
            StoreKeyLost: ``view/<new.gen>`` stayed gone (not pruned) for the store timeout.
        """
        assert new.gen == current.gen + 1
        key = f"view/{new.gen}"
        deadline = time.monotonic() + self.store_timeout_s
        if int(self._decision("gen") or -1) <= current.gen:
            created = self.backend.create_unless_moved(key, new.to_json(), "gen")  # None: gen moved meanwhile
            if created is not None:
                self._open(created)
                # Echoed: gen is gone (another writer deleted it). This proposer brings it back (its history's
                # newest value, never another) and moves it on, or the members would never see the new view.
                while self.backend.compare_set("gen", str(current.gen), str(new.gen)).decode() == str(current.gen):
                    if self._decision("gen") is None:
                        if time.monotonic() > deadline:
                            raise self._key_lost("gen", "the current generation")
                        time.sleep(LOST_KEY_POLL_S)
        # Read back once gen says new.gen: nobody creates the key after that (a create needs gen below it),
        # so every proposer returns the same view, or none if it was deleted.
        while (raw := _opt(self.backend, key)) is None:
            if int(_opt(self.backend, "pruned") or 0) > new.gen:
                return self.current_view()
            if time.monotonic() > deadline:
                raise self._key_lost(key, f"view {new.gen}, which gen says was published")
            time.sleep(LOST_KEY_POLL_S)
        return View.from_json(raw)

    def _key_lost(self, key: str, what: str) -> StoreKeyLost:
        return StoreKeyLost(f"store key {key!r} ({what}) has held nothing this launch wrote for "
                            f"{self.store_timeout_s:.0f} s: another process with write access to the store deleted "
                            f"or overwrote it; give the job a store of its own (an etcd user on its prefix)")

    def _open(self, raw: bytes) -> View:
        """Open a published view: its outcome key ("the step before its first was committed") and
        its members' liveness counters, so that reading them never waits for a key to appear."""
        view = View.from_json(raw)
        self.backend.compare_set(f"outcome/{view.gen}", "", f"{view.step - 1}:commit")
        for w in view.members:
            self.backend.add(f"hb/{w}", 0)
            self.backend.add(f"prog/{w}", 0)
        return view

    # -- one step ---------------------------------------------------------------

    def vote(self, view: View, step: int, outcome: Literal["commit", "abort"], *, after: int | None = None) -> Outcome:
        """Vote ``outcome`` for ``step`` under ``view``; returns the decided outcome.

        ``outcome/<g>`` holds the last step decided in generation ``g``; a step
        is voted on only once the step voted before it (``after``: default
        ``step - 1``; ``view.step - 1`` for a view's first) committed in ``g``,
        so the compare-and-set from ``"<after>:commit"`` decides ``step``
        exactly once. A later step already decided means ``step`` committed
        (nobody goes past an uncommitted step). A key that holds nothing this
        launch wrote is "stale" only once ``pruned`` covers the view; else
        another writer deleted it, and the vote waits for it (a decision must
        not be taken twice) up to the store timeout.

        Raises:
            StoreKeyLost: the outcome key stayed gone (not pruned) for the store timeout.
        """
        after = step - 1 if after is None else after
        key = f"outcome/{view.gen}"
        deadline = time.monotonic() + self.store_timeout_s
        while True:
            raw = self.backend.compare_set(key, f"{after}:commit", f"{step}:{outcome}").decode()
            decided_step, _, decided = raw.partition(":")
            if int(decided_step) > step:
                return "commit"
            if int(decided_step) == step:
                return decided  # type: ignore[return-value]
            # Echoed: the key holds nothing this launch wrote. Pruned (``pruned`` is written before any key
            # goes), the voter is far behind; else another writer deleted or overwrote it, and deciding
            # without it could contradict what a member already read there: it is brought back with the
            # newest decision its history holds (never another), or waited for, stopping past the timeout.
            if self._pruned(view.gen):
                return "stale"
            if self._decision(key, view.gen) is not None:
                continue
            if time.monotonic() > deadline:
                raise self._key_lost(key, f"the decisions of view {view.gen}")
            time.sleep(LOST_KEY_POLL_S)

    def decided(self, gen: int) -> int | None:
        """The last step decided in generation ``gen`` (``view.step - 1`` until its first vote); None once the
        generation is pruned."""
        raw = self._decision(f"outcome/{gen}", gen)
        return int(raw.partition(":")[0]) if raw else None

    def arrive(self, gen: int) -> int:
        """Count this member in at view ``gen``; returns how many have arrived (0 once ``gen`` is pruned)."""
        count = self.backend.add(f"arrive/{gen}", 1)
        return count if self._kept(gen, f"arrive/{gen}") else 0

    def _kept(self, gen: int, key: str) -> bool:
        """After a write of generation ``gen``'s ``key``: False, and the key deleted again, if ``gen`` is pruned.

        A writer far behind must not re-create a key its generation's pruning deleted (a leak, and a value a
        later reader could take for the generation's). Checked after the write: ``pruned`` is written before
        the prune's deletes, so either this read sees it or the prune deletes what was written before. (A
        negative ``gen``, a ``--resume``'s start before any view, is never pruned.)"""
        if gen < 0 or int(_opt(self.backend, "pruned") or 0) <= gen:
            return True
        self.backend.delete_key(key)
        return False

    def arrived(self, gen: int) -> int:
        # A read that creates nothing (an add of 0 would create the key of a pruned generation again).
        return int(self.backend.peek([f"arrive/{gen}"])[0] or 0)

    def publish_items(self, gen: int, worker: int, step: int, items: list[list[Any]]) -> None:
        self.backend.set(f"items/{gen}/{worker}", json.dumps([step, items]))
        self._kept(gen, f"items/{gen}/{worker}")

    def items_ready(self, gen: int, members: tuple[int, ...]) -> bool:
        return self.backend.check([f"items/{gen}/{w}" for w in members])

    def items(self, gen: int, step: int, members: tuple[int, ...]) -> dict[int, list[list[Any]]]:
        """What each member published for ``step`` in view ``gen``."""
        out = {}
        for w, raw in zip(members, self.backend.multi_get([f"items/{gen}/{w}" for w in members])):
            published_step, items = json.loads(raw)
            assert published_step == step, f"worker {w} published items of step {published_step}, not {step}"
            out[w] = items
        return out

    def group_store(self, gen: int, name: str = "") -> dist.Store:
        """The rendezvous store of view ``gen``'s process group ``name`` (keys ``pg/<g><name>/...``; HSDP's
        groups, one per shard index, are named ``.i<index>``)."""
        return self.backend.group_store(f"pg/{gen}{name}")

    def prune(self, below: int) -> int:
        """Delete every key of the generations below ``below``; returns how many generations went.

        Called by a view's leader once a step committed in that view (see the
        module docstring for why no member still needs them).
        """
        first = int(_opt(self.backend, "pruned") or 0)
        if below > first:
            # Written first: a voter that finds its outcome key gone tells pruning from another writer's
            # delete by it (vote). A leader lost mid-prune leaves the rest of its keys (a bounded leak).
            self.backend.set("pruned", str(below))
        for g in range(first, below):
            raw = _opt(self.backend, f"view/{g}")
            members = View.from_json(raw).members if raw else ()
            keys = [f"view/{g}", f"outcome/{g}", f"applied/{g}", f"arrive/{g}", f"restore/{g}", f"restore/{g}/nodes"]
            keys += [f"snapinv/{g}/{r}" for r in range(int(_opt(self.backend, f"restore/{g}/nodes") or 0))]
            keys += [f"items/{g}/{w}" for w in members]
            for name in self.group_names:
                keys += [f"pg/{g}{name}/0/{r}" for r in range(len(members))]
                keys.append(f"pg/{g}{name}/0")  # NCCL's unique id (its first communicator's counter)
            for key in keys:
                self.backend.delete_key(key)
        return max(0, below - first)

    # -- liveness ---------------------------------------------------------------

    def pulse(self, worker: int, phases: int, applied: tuple[int, int] | None = None) -> int:
        """A heartbeat of ``worker``, its main thread's ``phases`` more phases and a read of the job's join
        requests, in one round trip (a store that batches); returns the join requests so far. ``applied =
        (g, n)``: the leader of view ``g`` has applied ``n`` steps past ``g``'s first (:meth:`set_applied`)."""
        if applied is not None:
            self.set_applied(*applied)
        pairs = [(f"hb/{worker}", 1)] + ([(f"prog/{worker}", phases)] if phases else []) + [("joins", 0)]
        return self.backend.adds(pairs)[-1]

    def set_applied(self, gen: int, steps: int) -> None:
        """The leader of view ``gen`` has applied ``steps`` steps past its first: a total, not an increment, so
        a heartbeat sent again after a failure (whose write may have landed) counts nothing twice; never
        written back once ``gen`` is pruned."""
        self.backend.set(f"applied/{gen}", str(steps))
        self._kept(gen, f"applied/{gen}")

    # -- whole-job restore ------------------------------------------------------

    def publish_inventory(self, gen: int, node: int, nodes: int, text: str) -> None:
        """Node ``node``'s snapshot inventory, once every member of view ``gen`` is dead (not kept once ``gen``
        is pruned: a later view committed a step, so nobody restores ``gen``)."""
        self.backend.set(f"snapinv/{gen}/{node}", text)
        self.backend.compare_set(f"restore/{gen}/nodes", "", str(nodes))
        if not self._kept(gen, f"snapinv/{gen}/{node}"):
            self.backend.delete_key(f"restore/{gen}/nodes")

    def inventories(self, gen: int, nodes: int) -> dict[int, str]:
        """The inventories published so far for view ``gen`` (node -> JSON)."""
        return {r: raw for r in range(nodes) if (raw := _opt(self.backend, f"snapinv/{gen}/{r}")) is not None}

    def claim_restore(self, gen: int, node: int) -> bool:
        """True for the one agent that restores the job after view ``gen`` (first come); False for every agent
        once ``gen`` is pruned (a later view committed a step: nothing to restore)."""
        won = self.backend.compare_set(f"restore/{gen}", "", str(node)).decode() == str(node)
        return self._kept(gen, f"restore/{gen}") and won

    # -- progress and the end ---------------------------------------------------

    def set_progress(self, steps: int) -> None:
        """The job's committed steps are ``steps`` from now on (a restore: its history goes back to that step)."""
        self.backend.set("progress", str(steps))

    def progress(self) -> int | None:
        """The steps the job has applied: the current view's first step plus the steps its leader applied
        since (published by the leader's heartbeat thread as it applies them, off the step's path), or the
        step a restore set, whichever is later; None before any view.

        Applied, not decided: a step's outcome is decided by the first member whose all-reduce completed,
        while the others may still be in theirs; a fault due "at step N" fires once step N - 1 is applied."""
        raw, restored = self.backend.peek(["gen", "progress"])
        gen = raw if raw is not None else self._decision("gen")  # brought back if another writer deleted it
        if gen is None:
            return None if restored is None else int(restored)
        raw, applied = self.backend.peek([f"view/{int(gen)}", f"applied/{int(gen)}"])
        view = raw if raw is not None else _opt(self.backend, f"view/{int(gen)}")  # deleted: etcd reads its history
        reached = View.from_json(view).step + int(applied or 0) if view else 0
        return max(reached, int(restored) if restored is not None else 0)

    def set_done(self) -> None:
        self.backend.set("done", "1")

    def is_done(self) -> bool:
        return self.backend.check(["done"])

    def fail(self, message: str) -> str:
        """Mark the job failed (the first message stays); returns the recorded message."""
        return self.backend.compare_set("failed", "", message).decode()

    def failure(self) -> str | None:
        return _opt(self.backend, "failed")

    def request_stop(self) -> None:
        """Ask the job to stop early with a final checkpoint (a preemption): the view's leader then picks the
        step every member stops after (:meth:`agree_stop`)."""
        self.backend.compare_set("stop/request", "", "1")

    def agree_stop(self, steps: int) -> int:
        """The job stops once ``steps`` steps are applied, unless a step was agreed already; returns the agreed
        one. Only the view's leader calls it, before posting the reduction of step ``steps - 1``, whose buffer
        carries its word (the other members read no stop key; under HSDP each reads the agreed step after that
        reduction completed, so none has passed it)."""
        return int(self.backend.compare_set("stop/at", "", str(steps)).decode())

    def stop_point(self) -> tuple[bool, int | None]:
        """Whether a stop was requested, and the steps after which the job stops (None: not agreed yet). Read by
        the view's leader once per step attempt; by every member only where the reduction carries no word (HSDP)."""
        requested, at = self.backend.peek(["stop/request", "stop/at"])
        return bool(requested), int(at) if at else None

    def finished(self) -> bool:
        """Done or failed."""
        return self.backend.check(["done"]) or self.backend.check(["failed"])
