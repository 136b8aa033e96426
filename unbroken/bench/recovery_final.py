"""The final checkpoint: ``unbroken bench recovery --parts final`` (see :mod:`unbroken.bench.recovery`).

- In this process (:func:`write_figures`): the preset's state (model and AdamW moments after one step) written
  the way the runtime writes its final checkpoint (:func:`~unbroken.checkpoint.writer.write_state`
  from the live state, several writers, each file hashed as it is written, then sealed) and the way torch
  DCP's Hugging Face writer writes it (``async_save`` staging a copy, the files written, then every file read
  again for its sha256: the runtime's path before), alternately, ``repeats`` times each, into one directory
  (``--checkpoint-dir``: put it where checkpoints go; the default is the system's temporary directory).
- In a job (:func:`end_phases`): seconds from the last step's commit to the final checkpoint's commit, to the
  last worker's exit and to the launcher's return.
"""

from __future__ import annotations

import shutil
import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from unbroken.config import Config
from unbroken.checkpoint.dcp import dcp
from unbroken.job.builder import build_job
from unbroken.models.factory import resolve_device
from unbroken.checkpoint.files import seal_files
from unbroken.checkpoint.writer import write_state
from unbroken.state.training_state import capture

__all__ = ["end_phases", "write_figures"]


def _ours(state: dict[str, torch.Tensor], out: Path) -> float:
    t0 = time.perf_counter()
    written = write_state(out, state)
    seal_files(out, written.files)
    return time.perf_counter() - t0


def _dcp(state: dict[str, torch.Tensor], out: Path) -> float:
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp().async_save(state, storage_writer=dcp().HuggingFaceStorageWriter(str(out)), no_dist=True).result()
    seal_files(out)
    return time.perf_counter() - t0


def write_figures(cfg: Config, directory: Path | None = None, *, repeats: int = 3) -> dict[str, Any]:
    """Seconds and GB/s of the two ways of writing ``cfg``'s state (see the module docstring), alternately."""
    device = resolve_device(cfg.train.device)
    job = build_job(cfg, device)
    for p in job.model.parameters():
        p.grad = torch.randn_like(p)
    job.optimizer.step()
    state = capture(job.model, job.optimizer)
    size = sum(t.numel() * t.element_size() for t in state.values())
    times: dict[str, list[float]] = {"unbroken": [], "dcp_hf": []}
    root = Path(tempfile.mkdtemp(prefix="unbroken-final-", dir=directory))
    try:
        for i in range(repeats):
            for name, write in [("unbroken", _ours), ("dcp_hf", _dcp)][:: 1 if i % 2 == 0 else -1]:
                out = root / f"{name}-{i}"
                out.mkdir()
                times[name].append(round(write(state, out), 4))
                shutil.rmtree(out)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    best = {k: min(v) for k, v in times.items()}
    return {"state_bytes": size, "directory": str(directory or tempfile.gettempdir()), "seconds": times,
            "gb_s": {k: round(size / v / 1e9, 3) for k, v in best.items()},
            "dcp_over_unbroken": round(best["dcp_hf"] / best["unbroken"], 2)}


def end_phases(events: list[dict[str, Any]], steps: int, returned_at: float) -> dict[str, Any] | None:
    """Seconds from the first commit of the last step to the final checkpoint's commit, to the last worker's
    exit and to ``returned_at`` (the launcher's return); None when the run has no commit of its last step."""
    last = [e["time"] for e in events if e.get("kind") == "commit" and e.get("step") == steps - 1]
    if not last:
        return None
    t0 = min(last)
    final = [e for e in events if e.get("event") == "final_checkpoint"]
    exits = [e["t"] for e in events if e.get("event") == "worker_exit" and e.get("clean")]

    def since(t: float | None) -> float | None:
        return None if t is None else round(t - t0, 4)

    return {"checkpoint_committed": since(final[-1]["t"] if final else None),
            "checkpoint_gb": round(final[-1]["bytes"] / 1e9, 3) if final else None,
            "checkpoint_write_gb_s": final[-1]["gb_s"] if final else None,
            "writers": final[-1]["writers"] if final else None,
            "workers_exited": since(max(exits) if exits else None), "job_returned": since(returned_at)}
