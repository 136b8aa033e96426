"""Persistent checkpoints in ``torch.distributed.checkpoint`` format, pickle-free.

Layout of one checkpoint, ``<run>/checkpoints/step_<NNNNNNN>/``:
- ``model-*.safetensors`` + ``model.safetensors.index.json``: written by DCP's
  safetensors storage (JSON header + raw bytes). Holds the model parameters
  (``model.<name>``), AdamW moments (``optim.<name>.exp_avg`` ...) and the CPU
  RNG state (``rng.cpu``).
- ``commit.json``: step, config hash, data position, written last and
  atomically. A directory without it is incomplete and is never resumed from.

Data-parallel state is replicated, so one worker writes it; the write runs in a
background thread after the state has been copied (``dcp.async_save`` stages
synchronously), so training continues while bytes reach the disk.

Invariant: loading step ``k`` and training to ``K`` equals training to ``K``.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import warnings
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import HuggingFaceStorageReader, HuggingFaceStorageWriter

logger = logging.getLogger(__name__)

COMMIT_FILE = "commit.json"
_ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete or does not match the run."""


def checkpoint_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"step_{step:07d}"


def training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """Flat name -> tensor view of everything a worker needs to continue."""
    state: dict[str, torch.Tensor] = {}
    names = {p: n for n, p in model.named_parameters()}
    for name, p in model.named_parameters():
        state[f"model.{name}"] = p.detach()
    for p, st in optimizer.state.items():
        for key in _ADAM_KEYS:
            if key in st:
                t = st[key]
                state[f"optim.{names[p]}.{key}"] = t if torch.is_tensor(t) else torch.tensor(float(t))
    state["rng.cpu"] = torch.get_rng_state()
    return state


def load_training_state(
    state: dict[str, torch.Tensor], model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> None:
    """Copy a flat state (as produced by :func:`training_state`) into model and optimizer."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state[f"model.{name}"])
    for name, p in params.items():
        keys = {k: state.get(f"optim.{name}.{k}") for k in _ADAM_KEYS}
        if all(v is None for v in keys.values()):
            continue
        optimizer.state[p] = {
            "step": keys["step"].clone().float().cpu(),
            "exp_avg": keys["exp_avg"].clone().to(p.device),
            "exp_avg_sq": keys["exp_avg_sq"].clone().to(p.device),
        }
    torch.set_rng_state(state["rng.cpu"].clone())


class AsyncCheckpointer:
    """Writes checkpoints in the background, one at a time, and commits them."""

    def __init__(self, run_dir: str | Path, *, config_hash: str) -> None:
        self.run_dir = Path(run_dir)
        self.config_hash = config_hash
        self._pending: tuple[Path, dict[str, Any], Future[Any]] | None = None

    def save(self, step: int, state: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
        """Stage ``state`` now and write it asynchronously; ``step`` = steps done."""
        self.wait()
        path = checkpoint_dir(self.run_dir, step)
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            fut = dcp.async_save(state, storage_writer=HuggingFaceStorageWriter(str(path)), no_dist=True)
        commit = {"step": step, "config_hash": self.config_hash, "data_step": step, **meta}
        self._pending = (path, commit, fut)

    def poll(self) -> None:
        """Commit a finished background write; raise if it failed (never silently lost)."""
        if self._pending and self._pending[2].done():
            self.wait()

    def wait(self) -> None:
        """Block until the pending write is on disk, then commit it."""
        if self._pending:
            path, commit, fut = self._pending
            self._pending = None
            fut.result()
            _commit(path, commit)


def _commit(path: Path, commit: dict[str, Any]) -> None:
    tmp = path / (COMMIT_FILE + ".tmp")
    tmp.write_text(json.dumps(commit, indent=1))
    os.replace(tmp, path / COMMIT_FILE)
    logger.info("checkpoint step %d committed at %s", commit["step"], path)


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest committed checkpoint directory of a run, or None."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return None
    done = sorted(p for p in root.glob("step_*") if (p / COMMIT_FILE).is_file())
    return done[-1] if done else None


def read_commit(path: str | Path) -> dict[str, Any]:
    f = Path(path) / COMMIT_FILE
    if not f.is_file():
        raise CheckpointError(f"{path} has no {COMMIT_FILE}: the checkpoint is incomplete")
    return json.loads(f.read_text())


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, config_hash: str
) -> dict[str, Any]:
    """Load a committed checkpoint into model and optimizer; returns its commit record."""
    commit = read_commit(path)
    if commit["config_hash"] != config_hash:
        raise CheckpointError(
            f"{path} was written by a run with config hash {commit['config_hash']}, "
            f"this run has {config_hash}"
        )
    # Build the full key set (optimizer moments may not exist yet before a first step).
    state = training_state(model, optimizer)
    for name, p in model.named_parameters():
        for key in ("exp_avg", "exp_avg_sq"):
            state.setdefault(f"optim.{name}.{key}", torch.zeros_like(p))
        state.setdefault(f"optim.{name}.step", torch.zeros((), dtype=torch.float32))
    state = {k: v.detach().clone() for k, v in state.items()}
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp.load(state, storage_reader=HuggingFaceStorageReader(str(path)), no_dist=True)
    load_training_state(state, model, optimizer)
    return commit
