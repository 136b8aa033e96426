"""Restore: find the newest complete snapshot, then load it into every worker of the restored view.

Order of sources: the nodes' snapshot memory (each stripe from the node's own
fragments where it holds enough of them, otherwise from surviving nodes'
fragments and parity), then the newest committed persistent checkpoint.

1. :func:`inventory` (each node's agent): the seals of its node's segments of
   the job; a torn, foreign or corrupt buffer is left out and reported, so the
   other buffer (an older step) or another source is used. With ``verify``
   every byte is checked (over a memory map, by several threads:
   :mod:`unbroken.snapshot.fragment_io`); without it a seal authenticated with
   the job's secret is trusted for the decision (the seal is written last, so
   it never describes a torn write) and the bytes are checked as they are
   loaded: a restore decides in milliseconds, and a mismatch found by the load
   is rebuilt in that load from other fragments (step 3); only one they
   cannot rebuild fails it (the next attempt's inventory verifies every byte).
2. :func:`decide` (one agent): the newest step whose snapshot is complete
   among the live nodes' inventories, or the checkpoint if it is newer, as a
   restore spec (JSON) published in the restored view.
3. :func:`restore_from_memory` (every worker of that view): a stripe's
   fragments are all on the nodes of its coding group (``plan.groups``, ``k``
   that group's: :mod:`unbroken.snapshot.plan`), so it is rebuilt within that
   group, from its fragments alone. Per stripe, the
   fragments are read from the worker's own node where it holds ``k`` of them;
   otherwise the first member on a node that can decode sends the stripe over
   the view's group; if no node can alone, each needed fragment is sent by a
   member on its node and every worker decodes. The state is loaded exactly,
   straight into the live tensors. A stripe a member decodes from its own
   node's data fragments needs no decoding: those fragments are read by several
   threads into the tensors themselves (or, on a GPU, through pinned blocks
   copied asynchronously), each checked against its CRC as it is read
   (:func:`unbroken.snapshot.fragment_io.load_fragments`); any other stripe is
   decoded and written one at a time: host memory never holds the whole state.
   A fragment found damaged as it is read (its bytes no longer match their
   checksum) does not end the load: once every stripe is loaded the members
   agree on what was damaged, and load each stripe fed by a damaged fragment
   again, from the fragments left: another holder's, or the parity
   (:mod:`unbroken.snapshot._load_damage`). Only a stripe those can no longer
   decode fails the load.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator

import torch

from unbroken.snapshot._load_damage import Damage, Damaged, agree, undecodable
from unbroken.snapshot.erasure import HEADER, ErasureError
from unbroken.snapshot.fragment_io import FragmentRead, io_threads, load_fragments, verify_sealed
from unbroken.snapshot.plan import SnapshotPlan, complete_steps
from unbroken.snapshot.segment import SealedBuffer, SnapshotCorrupt, job_segments, segment_path
from unbroken.snapshot.state_bytes import StateLoader

__all__ = ["alone", "decide", "inventory", "restorable_steps", "restore_from_memory", "shard_spec"]

logger = logging.getLogger(__name__)


def inventory(job: str, node: int, *, config_hash: str | None = None, threads: int | None = None,
              verify: bool = True) -> dict[str, Any]:
    """The node's sealed, intact buffers of ``job``: ``{"seals": [...], "layouts": {...}, "copies": [...],
    "problems": [...], "seconds": S, "bytes": B}``.

    Each seal gains ``segment`` (its name). ``copies``: the seals of the node's copies of optimizer shards
    (ZeRO-1: :func:`unbroken.snapshot.replicas.copies_inventory`). ``problems`` names each buffer left out
    and why. With ``verify`` every byte is checked, with ``threads`` threads (default: :func:`io_threads`);
    without it only a buffer whose seal is not authenticated with the job's secret (this process has none)
    is (see the module docstring). ``seconds``: what it took; ``bytes``: the bytes checked.
    """
    t0 = time.perf_counter()
    threads = io_threads() if threads is None else threads
    checked = 0
    from unbroken.snapshot.replicas import copies_inventory

    copies, problems = copies_inventory(job, node)
    seals: list[dict[str, Any]] = []
    layouts: dict[str, Any] = {}
    for path in job_segments(job, node):
        try:
            buf = SealedBuffer.open(path, job)
            if buf is None:
                problems.append(f"{path.name}: not sealed (a write was interrupted)")
                continue
            if config_hash is not None and buf.seal.get("config_hash") != config_hash:
                problems.append(f"{path.name}: written under config {buf.seal.get('config_hash')}, "
                                f"not this job's {config_hash}")
                continue
            if verify or not buf.authenticated:
                verify_sealed(buf, threads)
                checked += sum(length for _, length, _ in buf.ranges())
            layouts.setdefault(buf.seal["layout_hash"], buf.layout())
            seals.append({**buf.seal, "segment": path.name})
        except SnapshotCorrupt as exc:
            problems.append(str(exc))
    return {"node": node, "seals": seals, "layouts": layouts, "copies": copies, "problems": problems,
            "seconds": round(time.perf_counter() - t0, 4), "bytes": checked}


def decide(inventories: list[dict[str, Any]], *, checkpoint: tuple[int, str] | None,
           members_of: Callable[[list[int]], list[int]], shard_degree: int = 1) -> dict[str, Any] | None:
    """The restore spec from the live nodes' inventories and the newest checkpoint ``(step, path)``.

    Returns ``{"source": "memory", ...}``, ``{"source": "checkpoint", "step", "path"}`` or None
    (nothing to restore from). Under HSDP (``shard_degree`` k > 1) a memory spec holds, under ``shards``,
    one shard index's part per index (:func:`shard_spec`): each index was snapshotted by its own workers.
    A snapshot written with a sharded optimizer (ZeRO-1, its seals say ``"moments": "copies"``) holds the
    replicated state: its step is restorable only with a copy of every range of the moments of that step
    (:func:`unbroken.snapshot.replicas.moments_spec`, under ``moments``), whatever the job restores into.
    """
    seals = [s for inv in inventories for s in inv["seals"]]
    layouts = {h: lay for inv in inventories for h, lay in inv["layouts"].items()}
    copies = [s for inv in inventories for s in inv.get("copies", [])]
    for step, shards, moments in restorable_steps(seals, copies, shard_degree=shard_degree):
        if checkpoint is not None and step < checkpoint[0]:
            break
        parts = [_part(shards[i], layouts) for i in range(shard_degree)]
        extra = {"moments": moments} if moments is not None else {}
        live_nodes = sorted({inv["node"] for inv in inventories})
        whole = {"source": "memory", "step": step, "gen": parts[0]["gen"], "nodes": live_nodes,
                 "members": members_of(live_nodes), **extra}
        return {**whole, **parts[0]} if shard_degree == 1 else {**whole, "shards": parts}
    if checkpoint is not None:
        return {"source": "checkpoint", "step": checkpoint[0], "path": checkpoint[1]}
    return None


def restorable_steps(seals: list[dict[str, Any]], copies: list[dict[str, Any]] | Callable[[], list[dict[str, Any]]],
                     *, shard_degree: int = 1) -> Iterator[tuple[int, dict[int, Any], dict[str, Any] | None]]:
    """The steps the seals hold a complete snapshot of, newest first, with the moments' copies a step written
    with a sharded optimizer needs (:func:`unbroken.snapshot.replicas.moments_spec`; a step without them is
    passed over) or None. ``copies``: the copies' seals, or a function that lists them (called only if a
    step needs them). Yields ``(step, {index: held}, moments)``."""
    from unbroken.snapshot.replicas import moments_spec

    for step, shards in complete_steps(seals, shard_degree=shard_degree):
        if not any(seal.get("moments") == "copies" for seal in shards[0].values()):
            yield step, shards, None
            continue
        if callable(copies):
            copies = copies()
        found = moments_spec(copies, step=step, gen=int(next(iter(shards[0].values()))["gen"]))
        if found is not None:  # else a range's copy of this step is gone: an older snapshot, or the checkpoint
            yield step, shards, found


def _part(held: dict[tuple[int, int], dict[str, Any]], layouts: dict[str, Any]) -> dict[str, Any]:
    """What the workers of one shard index read: its plan, layout, holders and fragment lengths."""
    some = next(iter(held.values()))
    plan = SnapshotPlan.from_json(some["plan"])
    rebuilt = [st for st in range(plan.stripes) if not all((st, f) in held for f in range(plan.k_of(st)))]
    return {"gen": some["gen"], "layout_hash": some["layout_hash"], "layout": layouts[some["layout_hash"]],
            "plan": some["plan"], "parity_stripes": rebuilt,
            "holders": sorted([st, fr, s["node"], s["segment"]] for (st, fr), s in held.items()),
            "fragment_lengths": {f"{st}/{fr}": length for s in held.values()
                                 for st, fr, _, length, _ in s["fragments"]}}


def shard_spec(spec: dict[str, Any], index: int) -> dict[str, Any]:
    """The memory spec the workers of shard index ``index`` load (the spec itself without HSDP)."""
    if "shards" not in spec:
        return spec
    return {**{k: v for k, v in spec.items() if k != "shards"}, **spec["shards"][index]}


Broadcast = Callable[[torch.Tensor, int], object]


def alone(t: torch.Tensor, src: int) -> None:
    """The broadcast of a restore one process makes by itself, as the first of ``members`` (every read is its
    own): nothing to send. Asked to receive from another member, it raises rather than leave ``t`` unwritten.

    Raises:
        RuntimeError: ``src`` is not 0.
    """
    if src != 0:
        raise RuntimeError(f"a restore made by one process alone needs bytes from member {src}: it has no group "
                           f"to receive them over")


def restore_from_memory(spec: dict[str, Any], *, job: str, node: int, node_of: dict[int, int],
                        members: tuple[int, ...], me: int, broadcast: Broadcast, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, device: torch.device,
                        threads_sharing: int = 1) -> dict[str, Any]:
    """Load the snapshot ``spec`` describes into ``model``/``optimizer``; every member calls it.

    Every member derives the same sequence of broadcasts from ``spec`` alone (the stripes it reads from its
    own node's data fragments, loaded after the others, take none).
    Returns what was done: ``local`` / ``received`` / ``rebuilt`` / ``sent`` stripe counts and bytes,
    ``bytes`` (the state's), ``seconds`` and ``gb_s`` (bytes loaded into the tensors per second);
    ``damaged``: the fragments this member found damaged (segment, byte range, why), ``reloaded``: the
    stripes loaded again without the damaged fragments (every member's count).

    Raises:
        SnapshotCorrupt: damaged fragments leave a stripe that the fragments left cannot decode.
        Whatever ``broadcast`` raises.
    """
    t0 = time.perf_counter()
    loader = _Loader(spec, job=job, node=node, node_of=node_of, members=members, me=me, broadcast=broadcast,
                     device=device)
    state = StateLoader(spec["layout"], model, optimizer, device)  # checks the fit before anything is read
    direct: list[FragmentRead] = []
    for st in range(loader.plan.stripes):  # one stripe in host memory at a time, written straight into the state
        reads = loader.own_data(st)
        if reads is not None:
            direct += reads
        else:
            state.write(loader.plan.stripe_range(st)[0], loader.stripe(st))
    if direct:
        load_fragments(direct, state.targets, threads=io_threads(threads_sharing), device=device,
                       on_mismatch=loader.mismatch)
    loader.reload_damaged(state)
    state.finish()
    seconds = time.perf_counter() - t0
    nbytes = loader.plan.state_bytes
    return {**loader.stats, "damaged": loader.damage.found, "bytes": nbytes, "seconds": seconds,
            "gb_s": round(nbytes / max(seconds, 1e-9) / 1e9, 3), "threads": io_threads(threads_sharing),
            "step": spec["step"]}


class _Loader:
    """One member's reads, broadcasts and decodes of a snapshot's stripes (see the module docstring)."""

    def __init__(self, spec: dict[str, Any], *, job: str, node: int, node_of: dict[int, int],
                 members: tuple[int, ...], me: int, broadcast: Broadcast, device: torch.device) -> None:
        self.spec, self.job, self.node, self.me, self.members = spec, job, node, me, members
        self.broadcast, self.device = broadcast, device
        self.plan = SnapshotPlan.from_json(spec["plan"])
        self.where: dict[int, dict[int, tuple[int, str]]] = {}
        for st, fr, nd, seg in spec["holders"]:
            self.where.setdefault(st, {})[fr] = (nd, seg)
        self.nodes = sorted({node_of[w] for w in members})
        self.first_on: dict[int, int] = {}
        for w in sorted(members):  # one pass: a view may have thousands of nodes
            self.first_on.setdefault(node_of[w], w)
        self.opened: dict[str, SealedBuffer] = {}
        self.stats = {"local": 0, "received": 0, "rebuilt": 0, "sent": 0, "bytes_received": 0, "reloaded": 0}
        self.damage = Damage(step=int(spec["step"]), stripes=self.plan.stripes,
                             fragments=max(len(g) for g in self.plan.groups))  # the largest group's k + m
        self.direct_of: dict[tuple[str, int], tuple[int, int]] = {}
        """``(segment, offset)`` of each fragment read straight into the state -> its ``(stripe, fragment)``."""

    def segment(self, seg: str) -> SealedBuffer:
        if seg not in self.opened:
            try:
                buf = SealedBuffer.open(segment_path(seg), self.job)
            except FileNotFoundError:
                raise SnapshotCorrupt(f"{seg}: removed before the restore read it") from None
            if buf is None or buf.seal["step"] != self.spec["step"]:
                raise SnapshotCorrupt(f"{seg}: no longer holds the snapshot of step {self.spec['step']}")
            self.opened[seg] = buf
        return self.opened[seg]

    def read(self, st: int, fr: int) -> bytes:
        """Fragment ``fr`` of stripe ``st``, from the segment holding it.

        Raises:
            Damaged: it could not be read as sealed (recorded: the stripe is loaded again without it).
        """
        return self._read(st, fr, headers=False) or b""

    def _read(self, st: int, fr: int, *, headers: bool) -> bytes | None:
        """Fragment ``fr`` of stripe ``st``, or (``headers``) the data fragments' headers kept with it (None: none
        were kept); :meth:`read`'s errors."""
        try:
            buf = self.segment(self.where[st][fr][1])
            return buf.headers(st) if headers else buf.fragment(st, fr)
        except SnapshotCorrupt as exc:
            self.damage.lost(st, fr, str(exc))
            raise Damaged from exc

    def mismatch(self, read: FragmentRead) -> None:
        """A fragment read straight into the state does not match its checksum (:func:`load_fragments`)."""
        st, fr = self.direct_of[(read.path.name, read.offset)]
        self.damage.lost(st, fr, f"{read.path.name}: bytes [{read.offset}, {read.offset + read.length}) do not "
                                 f"match their checksum")

    def reload_damaged(self, state: StateLoader) -> None:
        """Load again, in rounds, every stripe some member loaded from a damaged fragment, without the damaged
        fragments (:mod:`unbroken.snapshot._load_damage`); every member calls it once all stripes are loaded.

        Raises:
            SnapshotCorrupt: a round with tainted stripes found no new damage, or the fragments left cannot
                decode a tainted stripe.
        """
        known: set[tuple[int, int]] = set()
        while True:
            agree(self.damage, broadcast=self.broadcast, members=self.members, me=self.me, device=self.device)
            tainted, new = sorted(self.damage.tainted), self.damage.bad - known
            if not tainted:
                return
            if not new:
                raise undecodable(self.damage, SnapshotCorrupt(
                    f"stripes {tainted} of the snapshot of step {self.spec['step']} could not be decoded, and no "
                    f"fragment of theirs was found damaged"))
            known |= new
            for st, fr in new:
                self.where.get(st, {}).pop(fr, None)
            self.damage.tainted.clear()
            for st in tainted:
                try:
                    data = self.stripe(st)
                except SnapshotCorrupt as exc:
                    raise undecodable(self.damage, exc) from exc
                state.write(self.plan.stripe_range(st)[0], data)
                self.stats["reloaded"] += 1
            logger.warning("restore of step %d: stripes %s loaded again without the damaged fragments %s",
                           self.spec["step"], tainted, sorted(new))

    def own_data(self, st: int) -> list[FragmentRead] | None:
        """Stripe ``st``'s bytes as fragments of this node to read straight into the state, when every node
        decodes the stripe from its own memory and this one holds its data fragments, or a parity fragment that
        is the data itself (k = 1); else None (decoded, or sent, by :meth:`stripe`)."""
        lo, hi = self.plan.stripe_range(st)
        k, coding = self.plan.k_of(st), self.plan.coding(st)
        on_node = self._on_node(st)
        if len(self._able(on_node, k)) < len(self.nodes):
            return None
        if set(range(k)) <= on_node[self.node]:
            chosen, skip = list(range(k)), 0
        elif coding.parity_copies_data(min(on_node[self.node])):
            chosen, skip = [min(on_node[self.node])], HEADER
        else:
            return None
        chunk = coding.chunk(hi - lo)
        reads = []
        for i, fr in enumerate(chosen):
            try:
                buf = self.segment(self.where[st][fr][1])
            except SnapshotCorrupt as exc:  # gone, or rewritten: the stripe is loaded again without it
                self.damage.lost(st, fr, str(exc))
                return []
            entry = next((e for e in buf.seal["fragments"] if e[0] == st and e[1] == fr), None)
            if entry is None:
                raise SnapshotCorrupt(f"{buf.path.name} holds no fragment {fr} of stripe {st}")
            start, length = lo + i * chunk, int(entry[3])
            self.direct_of[(buf.path.name, int(entry[2]))] = (st, fr)
            reads.append(FragmentRead(path=buf.path, offset=int(entry[2]), length=length, crc=int(entry[4]),
                                      start=start, useful=max(0, min(length - skip, hi - start)), skip=skip))
        self.stats["local"] += 1
        self.stats["rebuilt"] += skip > 0  # from a parity fragment (read as it is: a copy of the data)
        return reads

    def stripe(self, st: int) -> bytes:
        """Stripe ``st``: from this node's memory, from the one node that can decode it, or from fragments."""
        lo, hi = self.plan.stripe_range(st)
        frags = self.where.get(st, {})
        on_node = self._on_node(st)
        able = self._able(on_node, self.plan.k_of(st))
        if len(able) == len(self.nodes):  # every node decodes from its own memory
            self.stats["local"] += 1
            return self._decode_here(st, on_node[self.node], hi - lo)
        if able:  # the first member on a node that can decodes and sends the stripe
            return self._send(st, on_node[able[0]], self.first_on[able[0]], hi - lo)
        return self._gather(st, frags, hi - lo)

    def _on_node(self, st: int) -> dict[int, set[int]]:
        """node -> the fragments of stripe ``st`` it holds (only its group's nodes hold any)."""
        out: dict[int, set[int]] = {}
        for fr, (nd, _) in self.where.get(st, {}).items():
            out.setdefault(nd, set()).add(fr)
        return out

    def _able(self, on_node: dict[int, set[int]], k: int) -> list[int]:
        """The nodes with a live member that hold ``k`` fragments of a stripe (can decode it alone), in order."""
        return sorted(nd for nd, held in on_node.items() if nd in self.first_on and len(held) >= k)

    def _decode_here(self, st: int, held: set[int], length: int) -> bytes:
        """Stripe ``st`` from fragments ``held`` of this node; zeros if one is damaged (the stripe is tainted)."""
        k = self.plan.k_of(st)
        chosen = _prefer_data(held, k)
        self.stats["rebuilt"] += any(fr >= k for fr in chosen)
        try:
            hdrs = next((h for fr in chosen if fr >= k and (h := self._read(st, fr, headers=True))), None)
            frags = {fr: self.read(st, fr) for fr in chosen}
        except Damaged:
            return bytes(length)
        return self._decode(st, frags, length, hdrs)

    def _decode(self, st: int, frags: dict[int, bytes], length: int, hdrs: bytes | None) -> bytes:
        try:
            return self.plan.coding(st).decode(frags, length, hdrs)
        except ErasureError as exc:  # bytes a member sent in place of a damaged fragment, or a coder's failure
            self.damage.taint(st, str(exc))
            return bytes(length)

    def _send(self, st: int, held: set[int], sender: int, length: int) -> bytes:
        out = torch.empty(length, dtype=torch.uint8, device=self.device)
        if self.me == sender:
            data = self._decode_here(st, held, length)
            out.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
            self.stats["sent"] += 1
        self.broadcast(out, self.members.index(sender))
        if self.me == sender:
            return data
        self.stats["received"] += 1
        self.stats["bytes_received"] += length
        return out.cpu().numpy().tobytes()

    def _share(self, nbytes: int, holder_node: int, read: Callable[[], bytes]) -> bytes:
        """``read()`` on the first member of ``holder_node``, broadcast to every member."""
        t = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        sender = self.first_on[holder_node]
        if self.me == sender:
            try:
                data = read()
            except Damaged:  # the others still receive (zeros): every member makes the same broadcasts
                data = bytes(nbytes)
            t.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        self.broadcast(t, self.members.index(sender))
        self.stats["bytes_received"] += nbytes if self.me != sender else 0
        return t.cpu().numpy().tobytes()

    def _gather(self, st: int, frags: dict[int, tuple[int, str]], length: int) -> bytes:
        """No node can decode alone: each chosen fragment (and a parity holder's headers) is broadcast.

        Only fragments on nodes with a live member are chosen: a member that died during the restore
        leaves its node's memory with nobody to read it (the next view keeps the same holders).

        Raises:
            SnapshotCorrupt: the nodes with live members hold fewer than ``k`` fragments of the stripe.
        """
        k = self.plan.k_of(st)  # of the stripe's coding group: only its nodes hold fragments of it
        live = {fr: held for fr, held in frags.items() if held[0] in self.first_on}
        if len(live) < k:
            group = self.plan.groups[self.plan.group_of(st)]
            alive = [nd for nd in group if nd in self.first_on]
            raise SnapshotCorrupt(
                f"stripe {st} of the snapshot of step {self.spec['step']} can no longer be decoded: it needs "
                f"{k} fragments, the nodes with live members {alive} hold {len(live)} ({sorted(live)}); its "
                f"fragments are on nodes {sorted({nd for nd, _ in frags.values()})} of its coding group "
                f"{list(group)}")
        chosen = _prefer_data(set(live), k)
        hdrs = None
        parity = next((fr for fr in chosen if fr >= k), None)
        if parity is not None:  # the headers kept with that parity fragment travel with it
            nd, seg = frags[parity]

            def headers(seg: str = seg, parity: int = parity) -> bytes:
                kept = self._read(st, parity, headers=True)
                if kept is None:
                    self.damage.lost(st, parity, f"{seg} holds parity fragment {parity} of stripe {st} of the "
                                                 f"snapshot of step {self.spec['step']} without the data "
                                                 f"fragments' headers it needs")
                    raise Damaged
                return kept

            hdrs = self._share(k * HEADER, nd, headers)
        got: dict[int, bytes] = {}
        for fr in chosen:
            nd, seg = frags[fr]

            def fragment(fr: int = fr) -> bytes:  # read by the holder's member only
                return self.read(st, fr)

            got[fr] = self._share(int(self.spec["fragment_lengths"][f"{st}/{fr}"]), nd, fragment)
        self.stats["received"] += 1
        self.stats["rebuilt"] += parity is not None
        return self._decode(st, got, length, hdrs)


def _prefer_data(held: set[int], k: int) -> list[int]:
    """``k`` of the fragments ``held``, data fragments first (no rebuild needed when all are there)."""
    return sorted(held)[:k]
