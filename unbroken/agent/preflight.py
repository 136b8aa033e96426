"""Run preparation shared by the launchers: validation, the run directory, the store.

:func:`preflight` checks everything that can be checked before anything is
written (config, data, sequence length); :func:`prepare_run_dir` creates or
checks the output directory; :func:`start_store` hosts the coordination store.
Processes are started by :mod:`unbroken.agent.launcher` (one agent per node).

Invariants: a run that fails validation leaves nothing on disk; a resumed run
keeps its saved config (only fields in ``_VOLATILE`` may differ) and its
metrics stop at the checkpoint it resumes from.
"""

from __future__ import annotations

import json
import os
import shutil
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch.distributed as dist

from unbroken.config import Config, config_diff, config_hash
from unbroken.data import BatchSampler, prepare_data
from unbroken.models import model_args
from unbroken.runtime.checkpoint import latest_checkpoint, read_commit
from unbroken.jsonl import read_jsonl


def preflight(cfg: Config) -> dict[str, Any]:
    """Check data and model against the config before anything is written.

    Prepares (or reuses) the tokenizer and token cache, so workers only load them.

    Raises:
        ValueError: with the offending value and the fix.
    """
    d = cfg.data
    margs = model_args(cfg.model.preset, **({"max_seq_len": cfg.model.max_seq_len} if cfg.model.max_seq_len else {}))
    if d.seq_len > margs.max_seq_len:
        raise ValueError(
            f"data.seq_len={d.seq_len} is longer than model {cfg.model.preset!r} allows "
            f"(max_seq_len={margs.max_seq_len}); lower data.seq_len or raise model.max_seq_len"
        )
    data = prepare_data(
        source=d.source, vocab_size=d.vocab_size, val_fraction=d.val_fraction,
        cache_dir=d.cache_dir, token_dtype=d.token_dtype, max_bytes=d.max_bytes,
    )
    # Constructing the samplers validates that both splits hold enough windows.
    BatchSampler(data.train, seed=cfg.train.seed, n_slots=cfg.train.workers, micro_batch=d.micro_batch, seq_len=d.seq_len)
    try:
        BatchSampler(data.val, seed=cfg.train.seed, n_slots=1, micro_batch=d.micro_batch, seq_len=d.seq_len)
    except ValueError as exc:
        raise ValueError(f"validation split too small for one micro-batch: {exc}; raise data.val_fraction") from None
    return {"vocab_size": data.vocab_size, "train_tokens": int(len(data.train)), "val_tokens": int(len(data.val))}


def prepare_run_dir(run_dir: Path, cfg: Config, *, overwrite: bool, resume: bool) -> Path | None:
    """Create or check the run directory; returns the checkpoint to resume from.

    Raises:
        ValueError: the directory holds another run (without ``overwrite``), or
            ``resume`` finds no committed checkpoint or a different config.
    """
    cfg_file = run_dir / "config.json"
    if resume:
        if not cfg_file.is_file():
            raise ValueError(f"--resume {run_dir}: no config.json there; is this a run directory?")
        saved = json.loads(cfg_file.read_text())
        diff = [f for f in config_diff(saved, cfg.to_dict()) if f not in _VOLATILE]
        if diff:
            raise ValueError(f"--resume {run_dir}: the run was made with different values for {', '.join(diff)}")
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise ValueError(f"--resume {run_dir}: no committed checkpoint under {run_dir / 'checkpoints'}")
        _truncate_metrics(run_dir / "metrics.jsonl", int(read_commit(ckpt)["step"]))
        return ckpt
    if run_dir.exists() and any(run_dir.iterdir()):
        if not overwrite:
            what = "a different run" if cfg_file.is_file() and _hash_of(cfg_file) != config_hash(cfg) else "a run"
            raise ValueError(
                f"output directory {run_dir} already holds {what}; pass --overwrite to replace it, "
                f"--resume to continue it, or choose another --out"
            )
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = cfg_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg.to_dict(), indent=1))
    os.replace(tmp, cfg_file)
    return None


_VOLATILE = {"train.host", "train.port", "train.log_every", "train.threads_per_worker", "train.timeout_s", "data.cache_dir"}


def _hash_of(cfg_file: Path) -> str:
    try:
        return config_hash(Config.from_dict(json.loads(cfg_file.read_text())))
    except (ValueError, json.JSONDecodeError):
        return "unreadable"


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics written after the checkpoint we resume from."""
    if path.is_file():
        kept = [r for r in read_jsonl(path) if int(r.get("step", 0)) <= step]
        path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept))


def start_store(host: str, port: int, world: int) -> dist.TCPStore:
    """Host the coordination store; a clear error when the port is taken."""
    try:
        return dist.TCPStore(host, port, world + 1, is_master=True, timeout=timedelta(seconds=30), wait_for_workers=False)
    except (RuntimeError, OSError) as exc:
        raise ValueError(
            f"cannot listen on {host}:{port} ({exc.__class__.__name__}: {str(exc).splitlines()[0]}); "
            f"the port is probably in use: pick another with --train.port=N or 0 for a free one"
        ) from None

