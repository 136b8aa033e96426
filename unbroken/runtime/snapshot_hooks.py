"""Where the state layer meets a worker: its job's identity, its snapshotter, its restore.

A run directory holds ``job_id`` (written once when the run is created, kept
across ``--resume``; it names the job's snapshot segments) and ``layout.json``
(nodes and workers per node, written by the agents), from which a worker
knows its node and every other worker's.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any, Callable, ContextManager

import torch

from unbroken.config import Config
from unbroken.snapshot.cadence import enabled
from unbroken.snapshot.plan import plan_for, shard_of
from unbroken.snapshot.restore import decide, inventory, restore_from_memory, shard_spec
from unbroken.snapshot.segment import SnapshotCorrupt
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of

if TYPE_CHECKING:
    from unbroken.sharding.hsdp import ReplicaLayout

__all__ = ["job_id", "load_from_node_memory", "memory_rejoin_allowed", "memory_rejoin_failed",
           "memory_rejoin_possible", "node_map", "restore_state", "snapshotter_for", "write_threads"]

JOB_ID_FILE = "job_id"
MAX_WRITE_THREADS = 8
"""Threads one worker's snapshot write may use (stripes coded and copied at once)."""


def write_threads(on_node: int) -> int:
    """A GPU worker's snapshot write threads: the node's cores shared by its ``on_node`` workers, at most
    :data:`MAX_WRITE_THREADS`."""
    return max(1, min(MAX_WRITE_THREADS, len(os.sched_getaffinity(0)) // max(1, on_node)))


def job_id(run_dir: Path, *, create: bool = False) -> str:
    """The run's job id (12 hex digits); ``create`` writes one if the run has none yet.

    Raises:
        FileNotFoundError: no job id and ``create`` is False.
    """
    path = Path(run_dir) / JOB_ID_FILE
    if path.is_file():
        text = path.read_text().strip()
        if len(text) == 12 and all(c in "0123456789abcdef" for c in text):
            return text
        raise ValueError(f"{path}: {text!r} is not a job id (12 hex digits); delete it to start a new job")
    if not create:
        raise FileNotFoundError(f"{path} is missing: is {run_dir} a run directory?")
    # Agents of one run directory may start at once: each writes its own file, the first link wins and every
    # one of them returns the winner's id (a rename would let the last overwrite ids the others already use).
    ident = secrets.token_hex(6)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{ident}.tmp")
    tmp.write_text(ident + "\n")
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink(missing_ok=True)
    return job_id(run_dir)


def node_map(run_dir: Path, world: int) -> dict[int, int]:
    """worker id -> node, from the run's ``layout.json`` (one node holding everyone without one)."""
    path = Path(run_dir) / "layout.json"
    per_node = json.loads(path.read_text())["workers_per_node"] if path.is_file() else world
    return {w: w // per_node for w in range(world)}


def snapshotter_for(cfg: Config, run_dir: Path, worker: int, world: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, device: torch.device, config_hash: str,
                    on_event: Callable[..., None], hsdp: ReplicaLayout | None = None,
                    busy: Callable[[], ContextManager[None]] = nullcontext) -> Snapshotter | None:
    """The worker's snapshotter, or None when ``snapshot.every`` is 0. With a sharded optimizer (ZeRO-1) it
    snapshots the replicated state (parameters, steps, RNG) and the ring copies of the moments of the same
    step are kept with it (:mod:`unbroken.snapshot.replicas`). Under HSDP (``hsdp``) it snapshots this
    rank's shards with the workers of its shard index.
    Its write threads: on a GPU the node's cores shared by its workers, at most :data:`MAX_WRITE_THREADS`;
    on a CPU device one."""
    if not enabled(cfg.snapshot.every):
        return None
    shard: dict[str, Any] = {}
    if hsdp is not None and hsdp.shard_degree > 1:
        index = hsdp.index_of(worker)
        shard = {"shard": (index, hsdp.shard_degree), "holders": lambda members: hsdp.shard_peers(index, members)}
    node_of = node_map(run_dir, world)
    on_node = sum(1 for n in node_of.values() if n == node_of[worker])
    cpu = device.type == "cpu"  # training takes the cores: one write thread, its seconds a cost to the steps
    threads = 1 if cpu else write_threads(on_node)
    return Snapshotter(job_id=job_id(run_dir), node=node_of[worker], worker=worker, node_of=node_of,
                       every=cfg.snapshot.every, redundancy=cfg.snapshot.redundancy, parity=cfg.snapshot.parity,
                       group_nodes=cfg.snapshot.group_nodes, config_hash=config_hash,
                       state=lambda: tensors_of(model, optimizer, device),
                       on_event=on_event, write_threads=threads, shares_cores=cpu,
                       moments_in_copies=cfg.train.shard_optimizer, busy=busy,
                       device_staging_bytes=cfg.snapshot.device_staging_bytes, **shard)


def restore_state(spec: dict[str, Any], *, run_dir: Path, worker: int, world: int, members: tuple[int, ...],
                  broadcast: Callable[[torch.Tensor, int], object], model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer, device: torch.device, config_hash: str,
                  shard_index: int = 0) -> dict[str, Any]:
    """Load the state a restored view names (snapshot memory or checkpoint); returns what was done.

    ``members`` are the workers ``broadcast`` reaches, by rank: the view's, or under HSDP the holders of
    shard index ``shard_index`` (one per replica), who load that index's snapshot together."""
    if spec["source"] == "checkpoint":
        from unbroken.checkpoint.checkpointer import load_checkpoint  # local: heavy (DCP)

        load_checkpoint(Path(spec["path"]), model, optimizer, config_hash=config_hash)
        return {"restored_from": "checkpoint", "step": spec["step"], "path": spec["path"]}
    node_of = node_map(run_dir, world)
    on_node = sum(1 for w in members if node_of[w] == node_of[worker])  # they load at once: the cores are shared
    stats = restore_from_memory(shard_spec(spec, shard_index), job=job_id(run_dir), node=node_of[worker],
                                node_of=node_of, members=members, me=worker, broadcast=broadcast, model=model,
                                optimizer=optimizer, device=device, threads_sharing=on_node)
    if "moments" in spec:  # written with ZeRO-1: the moments of the same step from the ring copies
        from unbroken.snapshot.replicas import restore_moments

        stats.update(restore_moments(spec["moments"], job=job_id(run_dir), node_of=node_of, members=members,
                                     me=worker, broadcast=broadcast, model=model, optimizer=optimizer))
    return {"restored_from": "memory", **stats}


def _failed_marker(run_dir: Path, worker: int) -> Path:
    return Path(run_dir) / "snapshots" / f"memory_rejoin_failed.w{worker}"


def memory_rejoin_allowed(run_dir: Path, worker: int) -> bool:
    """False once a load from this node's memory failed for ``worker`` (it then rejoins by transfer)."""
    return not _failed_marker(run_dir, worker).exists()


def memory_rejoin_failed(run_dir: Path, worker: int, why: str) -> None:
    path = _failed_marker(run_dir, worker)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(why + "\n")


def memory_rejoin_possible(cfg: Config, run_dir: Path, world: int, joiner: int, members: tuple[int, ...],
                           step: int, hsdp: ReplicaLayout | None = None) -> bool:
    """Does the joiner's node hold, after ``step`` steps under a view of ``members``, enough fragments of
    every stripe to decode the state alone? (A live member on the node wrote them; ``step`` is a snapshot step.)
    Under HSDP (``hsdp``) the state is the joiner's shard index's, snapshotted by that index's members."""
    s = cfg.snapshot
    if not enabled(s.every) or (s.every != "auto" and step % s.every):
        return False  # under auto the caller knows whether it snapshotted ``step``
    node_of = node_map(run_dir, world)
    if hsdp is not None and hsdp.shard_degree > 1:
        members = hsdp.shard_peers(hsdp.index_of(joiner), members)
    if not any(node_of[w] == node_of[joiner] for w in members):
        return False  # nobody on its node snapshotted that step
    plan = plan_for(members, node_of, redundancy=s.redundancy, parity=s.parity, state_bytes=1,
                    group_nodes=s.group_nodes)
    return all(len(plan.fragments_of(node_of[joiner], i)) >= plan.k_of(i) for i in range(plan.stripes))


def load_from_node_memory(run_dir: Path, worker: int, world: int, step: int, model: torch.nn.Module,
                          optimizer: torch.optim.Optimizer, device: torch.device, config_hash: str,
                          shard: tuple[int, int] = (0, 1)) -> dict[str, Any]:
    """Load the state after ``step`` steps from this node's own snapshot memory (no network). Under HSDP
    (``shard``: this rank's ``(index, degree)``) the state of its shard index: its local shards.

    Raises:
        SnapshotCorrupt: the node's memory holds no complete, intact snapshot of ``step``.
    """
    node_of = node_map(run_dir, world)
    job, node = job_id(run_dir), node_of[worker]
    # The seals decide (authenticated with the job's secret); the load checks every byte it reads, and a
    # mismatch makes the next incarnation ask for a transfer (memory_rejoin_failed)
    inv = inventory(job, node, config_hash=config_hash, verify=False)
    # Only the newest generation's seals of the step: after a restore, seals of the same step from the abandoned
    # timeline (older generations, written by other workers of the node) may still be intact, and complete.
    # Under HSDP only this rank's shard index's, read as a whole state (the others are not its shards).
    seals = [{k: v for k, v in seal.items() if k != "shard"} for seal in inv["seals"]
             if seal["step"] == step and shard_of(seal) == (shard if shard[1] > 1 else (0, 1))]
    newest = max((int(seal["gen"]) for seal in seals), default=None)
    inv["seals"] = [seal for seal in seals if int(seal["gen"]) == newest]
    spec = decide([inv], checkpoint=None, members_of=lambda nodes: [worker])
    if spec is None or spec["step"] != step:
        raise SnapshotCorrupt(f"node {node}'s snapshot memory holds no complete snapshot of step {step}"
                              + (f" ({'; '.join(inv['problems'])})" if inv["problems"] else ""))
    stats = restore_from_memory(spec, job=job, node=node, node_of=node_of, members=(worker,), me=worker,
                                broadcast=lambda t, src: None, model=model, optimizer=optimizer, device=device)
    return {"restored_from": "memory", **stats}
