"""Files an agent writes into or reads from the run directory besides logs and events."""

from __future__ import annotations

import json
import os
from pathlib import Path

from unbroken.jsonl import read_jsonl

__all__ = ["fired_before", "write_layout"]


def fired_before(run_dir: Path, node: int) -> set[str]:
    """Specs this node fired (or saw fire) in earlier attempts of the run: a resume must not repeat them."""
    events = read_jsonl(run_dir / "events" / f"agent{node}.jsonl")
    return {e["spec"] for e in events if e.get("event") in ("fault_injected", "worker_exit") and e.get("spec")}


def write_layout(run_dir: Path, node: int, nnodes: int, workers_per_node: int) -> None:
    """``layout.json``: nodes and workers per node, identical from every agent (read by ``unbroken chaos``
    to map node targets to workers, and by workers to place snapshot stripes)."""
    path = run_dir / "layout.json"
    tmp = path.with_name(f".layout.{node}.tmp")
    tmp.write_text(json.dumps({"nodes": nnodes, "workers_per_node": workers_per_node}))
    os.replace(tmp, path)
