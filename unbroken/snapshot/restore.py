"""Restore: find the newest complete snapshot, then load it into every worker of the restored view.

Order of sources: the nodes' snapshot memory (each stripe from the node's own
fragments where it holds enough of them, otherwise from surviving nodes'
fragments and parity), then the newest committed persistent checkpoint.

1. :func:`inventory` (each node's agent): the seals of its node's segments of
   the job, every byte checked; a torn or corrupt buffer is left out and
   reported, so the other buffer (an older step) or another source is used.
2. :func:`decide` (one agent): the newest step whose snapshot is complete
   among the live nodes' inventories, or the checkpoint if it is newer, as a
   restore spec (JSON) published in the restored view.
3. :func:`restore_from_memory` (every worker of that view): per stripe, the
   fragments are read from the worker's own node where it holds ``k`` of them;
   otherwise the first member on a node that can decode sends the stripe over
   the view's group; if no node can alone, each needed fragment is sent by a
   member on its node and every worker decodes. The state is loaded exactly.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

import torch

from unbroken.snapshot.erasure import HEADER, Coding
from unbroken.snapshot.plan import SnapshotPlan, complete_steps
from unbroken.snapshot.segment import SHM_DIR, SealedBuffer, SnapshotCorrupt, job_segments
from unbroken.snapshot.state_bytes import load_into

__all__ = ["decide", "inventory", "restore_from_memory"]

logger = logging.getLogger(__name__)


def inventory(job: str, node: int, *, config_hash: str | None = None) -> dict[str, Any]:
    """The node's sealed, intact buffers of ``job``: ``{"seals": [...], "layouts": {...}, "problems": [...]}``.

    Each seal gains ``segment`` (its name). ``problems`` names each buffer left out and why.
    """
    seals, layouts, problems = [], {}, []
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
            buf.verify()
            layouts.setdefault(buf.seal["layout_hash"], buf.layout())
            seals.append({**buf.seal, "segment": path.name})
        except SnapshotCorrupt as exc:
            problems.append(str(exc))
    return {"node": node, "seals": seals, "layouts": layouts, "problems": problems}


def decide(inventories: list[dict[str, Any]], *, checkpoint: tuple[int, str] | None,
           members_of: Callable[[list[int]], list[int]]) -> dict[str, Any] | None:
    """The restore spec from the live nodes' inventories and the newest checkpoint ``(step, path)``.

    Returns ``{"source": "memory", ...}``, ``{"source": "checkpoint", "step", "path"}`` or None
    (nothing to restore from).
    """
    seals = [s for inv in inventories for s in inv["seals"]]
    layouts = {h: lay for inv in inventories for h, lay in inv["layouts"].items()}
    complete = complete_steps(seals)
    if complete and (checkpoint is None or complete[0][0] >= checkpoint[0]):
        step, held = complete[0]
        some = next(iter(held.values()))
        live_nodes = sorted({inv["node"] for inv in inventories})
        plan = SnapshotPlan.from_json(some["plan"])
        rebuilt = [st for st in range(plan.stripes)
                   if not all((st, f) in held for f in range(plan.k))]
        return {"source": "memory", "step": step, "gen": some["gen"], "layout_hash": some["layout_hash"],
                "layout": layouts[some["layout_hash"]], "plan": some["plan"], "nodes": live_nodes,
                "members": members_of(live_nodes), "parity_stripes": rebuilt,
                "holders": sorted([st, fr, s["node"], s["segment"]] for (st, fr), s in held.items()),
                "fragment_lengths": {f"{st}/{fr}": length for s in held.values()
                                     for st, fr, _, length, _ in s["fragments"]}}
    if checkpoint is not None:
        return {"source": "checkpoint", "step": checkpoint[0], "path": checkpoint[1]}
    return None


Broadcast = Callable[[torch.Tensor, int], object]


def restore_from_memory(spec: dict[str, Any], *, job: str, node: int, node_of: dict[int, int],
                        members: tuple[int, ...], me: int, broadcast: Broadcast, model: torch.nn.Module,
                        optimizer: torch.optim.Optimizer, device: torch.device) -> dict[str, Any]:
    """Load the snapshot ``spec`` describes into ``model``/``optimizer``; every member calls it.

    Returns what was done: ``local`` / ``received`` / ``rebuilt`` stripe counts and bytes.

    Raises:
        SnapshotCorrupt: a fragment's bytes no longer match their checksum.
        Whatever ``broadcast`` raises.
    """
    t0 = time.perf_counter()
    plan = SnapshotPlan.from_json(spec["plan"])
    coding = Coding(plan.k, plan.m)
    where: dict[int, dict[int, tuple[int, str]]] = {}
    for st, fr, nd, seg in spec["holders"]:
        where.setdefault(st, {})[fr] = (nd, seg)
    opened: dict[str, SealedBuffer] = {}

    def segment(seg: str) -> SealedBuffer:
        if seg not in opened:
            buf = SealedBuffer.open(SHM_DIR / seg, job)
            if buf is None or buf.seal["step"] != spec["step"]:
                raise SnapshotCorrupt(f"{seg}: no longer holds the snapshot of step {spec['step']}")
            opened[seg] = buf
        return opened[seg]

    def read(seg: str, st: int, fr: int) -> bytes:
        return segment(seg).fragment(st, fr)

    def local_decode(st: int, frs: list[int], length: int) -> bytes:
        """Decode stripe ``st`` from fragments ``frs`` held on this node (with a parity holder's headers)."""
        hdrs = next((h for fr in frs if fr >= plan.k and (h := segment(where[st][fr][1]).headers(st))), None)
        return coding.decode({fr: read(where[st][fr][1], st, fr) for fr in frs}, length, hdrs)

    nodes_of_members = sorted({node_of[w] for w in members})
    first_on = {nd: min(w for w in members if node_of[w] == nd) for nd in nodes_of_members}
    stats = {"local": 0, "received": 0, "rebuilt": 0, "bytes_received": 0}
    stripes: list[bytes] = []
    for st in range(plan.stripes):
        lo, hi = plan.stripe_range(st)
        frags = where.get(st, {})
        on_node = {nd: {fr for fr, (n2, _) in frags.items() if n2 == nd} for nd in nodes_of_members}
        able = [nd for nd in nodes_of_members if len(on_node[nd]) >= plan.k]
        if len(able) == len(nodes_of_members):  # every node decodes from its own memory
            mine = _prefer_data(on_node[node], plan.k)
            data = local_decode(st, mine, hi - lo)
            stats["local"] += 1
            stats["rebuilt"] += any(fr >= plan.k for fr in mine[:plan.k])
        elif able:  # one node decodes and sends the stripe
            src_node = able[0]
            out = torch.empty(hi - lo, dtype=torch.uint8, device=device)
            sender = first_on[src_node]
            if me == sender:
                mine = _prefer_data(on_node[node], plan.k)
                data = local_decode(st, mine, hi - lo)
                out.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
                stats["rebuilt"] += any(fr >= plan.k for fr in mine)
                stats["sent"] = stats.get("sent", 0) + 1
            broadcast(out, members.index(sender))
            if me != sender:
                data = out.cpu().numpy().tobytes()
                stats["received"] += 1
                stats["bytes_received"] += hi - lo
        else:  # fragments from several nodes
            chosen = _prefer_data(set(frags), plan.k)
            got = {}
            hdr_src = next((fr for fr in chosen if fr >= plan.k), None)
            hdrs = None
            if hdr_src is not None:  # the headers kept with that parity fragment travel with it
                nd, seg = frags[hdr_src]
                h_t = torch.empty(plan.k * HEADER, dtype=torch.uint8, device=device)
                if node == nd and me == first_on[nd]:
                    h_t.copy_(torch.frombuffer(bytearray(segment(seg).headers(st)), dtype=torch.uint8))
                broadcast(h_t, members.index(first_on[nd]))
                hdrs = h_t.cpu().numpy().tobytes()
            for fr in chosen:
                nd, seg = frags[fr]
                length = int(spec["fragment_lengths"][f"{st}/{fr}"])
                buf_t = torch.empty(length, dtype=torch.uint8, device=device)
                if node == nd and me == first_on[nd]:
                    buf_t.copy_(torch.frombuffer(bytearray(read(seg, st, fr)), dtype=torch.uint8))
                broadcast(buf_t, members.index(first_on[nd]))
                got[fr] = buf_t.cpu().numpy().tobytes()
                stats["bytes_received"] += length
            data = coding.decode(got, hi - lo, hdrs)
            stats["received"] += 1
            stats["rebuilt"] += any(fr >= plan.k for fr in chosen)
        stripes.append(data)
    load_into(b"".join(stripes), spec["layout"], model, optimizer, device)
    return {**stats, "seconds": time.perf_counter() - t0, "step": spec["step"]}


def _prefer_data(held: set[int], k: int) -> list[int]:
    """``k`` of the fragments ``held``, data fragments first (no rebuild needed when all are there)."""
    return sorted(held)[:k]
