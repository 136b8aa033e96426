"""Where the state layer meets a worker: its job's identity, its snapshotter, its restore.

A run directory holds ``job_id`` (written once when the run is created, kept
across ``--resume``; it names the job's snapshot segments) and ``layout.json``
(nodes and workers per node, written by the agents), from which a worker
knows its node and every other worker's.
"""

from __future__ import annotations

import json
import secrets
from pathlib import Path
from typing import Any, Callable

import torch

from unbroken.config import Config
from unbroken.snapshot.restore import restore_from_memory
from unbroken.snapshot.snapshotter import Snapshotter
from unbroken.snapshot.state_bytes import tensors_of

__all__ = ["job_id", "node_map", "restore_state", "snapshotter_for"]

JOB_ID_FILE = "job_id"


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
    ident = secrets.token_hex(6)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(ident + "\n")
    tmp.replace(path)
    return ident


def node_map(run_dir: Path, world: int) -> dict[int, int]:
    """worker id -> node, from the run's ``layout.json`` (one node holding everyone without one)."""
    path = Path(run_dir) / "layout.json"
    per_node = json.loads(path.read_text())["workers_per_node"] if path.is_file() else world
    return {w: w // per_node for w in range(world)}


def snapshotter_for(cfg: Config, run_dir: Path, worker: int, world: int, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer, device: torch.device, config_hash: str,
                    on_event: Callable[..., None]) -> Snapshotter | None:
    """The worker's snapshotter, or None when ``snapshot.every`` is 0."""
    if cfg.snapshot.every <= 0:
        return None
    node_of = node_map(run_dir, world)
    return Snapshotter(job_id=job_id(run_dir), node=node_of[worker], worker=worker, node_of=node_of,
                       every=cfg.snapshot.every, redundancy=cfg.snapshot.redundancy, parity=cfg.snapshot.parity,
                       config_hash=config_hash, state=lambda: tensors_of(model, optimizer, device),
                       on_event=on_event)


def restore_state(spec: dict[str, Any], *, run_dir: Path, worker: int, world: int, members: tuple[int, ...],
                  broadcast: Callable[[torch.Tensor, int], object], model: torch.nn.Module,
                  optimizer: torch.optim.Optimizer, device: torch.device, config_hash: str) -> dict[str, Any]:
    """Load the state a restored view names (snapshot memory or checkpoint); returns what was done."""
    if spec["source"] == "checkpoint":
        from unbroken.runtime.checkpoint import load_checkpoint  # local: heavy (DCP)

        load_checkpoint(Path(spec["path"]), model, optimizer, config_hash=config_hash)
        return {"source": "checkpoint", "step": spec["step"], "path": spec["path"]}
    node_of = node_map(run_dir, world)
    stats = restore_from_memory(spec, job=job_id(run_dir), node=node_of[worker], node_of=node_of, members=members,
                                me=worker, broadcast=broadcast, model=model, optimizer=optimizer, device=device)
    return {"source": "memory", **stats}
