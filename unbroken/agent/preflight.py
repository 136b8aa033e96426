"""Run preparation shared by the launchers: validation, the run directory, the store.

:func:`preflight` checks everything that can be checked before anything is
written (config, data, sequence length); :func:`prepare_run_dir` creates or
checks the output directory. The coordination store is hosted through
:meth:`unbroken.runtime.job_store.JobStore.host`.
Processes are started by :mod:`unbroken.agent.launcher` (one agent per node).

Invariants: a run that fails validation leaves nothing on disk; a resumed run
keeps its saved config (only fields in ``_VOLATILE`` may differ) and its
metrics stop at the checkpoint it resumes from.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any


from unbroken.config import Config, config_diff, config_hash
from unbroken.job.builder import build_data, build_samplers, check_model_fits, data_info
from unbroken.runtime.checkpoint import latest_checkpoint, read_commit
from unbroken.jsonl import read_jsonl


def preflight(cfg: Config) -> dict[str, Any]:
    """Check data and model against the config before anything is written.

    Prepares (or reuses) the tokenizer and token cache, so workers only load them.

    Raises:
        ValueError: with the offending value and the fix.
    """
    check_model_fits(cfg)
    data = build_data(cfg)
    # Constructing the samplers validates that both splits hold enough windows.
    build_samplers(cfg, data)
    return data_info(data)


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
