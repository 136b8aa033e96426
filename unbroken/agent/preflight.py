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
from pathlib import Path
from typing import Any

from unbroken.config import Config, config_diff, config_hash
from unbroken.job.builder import build_data, build_samplers, check_model_fits, check_model_parts, data_info
from unbroken.job.run_dir import prepare_out_dir
from unbroken.runtime.checkpoint import CheckpointError, latest_checkpoint, read_commit
from unbroken.jsonl import read_jsonl
from unbroken.snapshot.segment import SHM_DIR, SealedBuffer, SnapshotCorrupt, job_segments, remove_segments
from unbroken.snapshot.trainer_hooks import JOB_ID_FILE, job_id


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
    check_model_parts(cfg, data)
    return data_info(data)


def prepare_run_dir(run_dir: Path, cfg: Config, *, overwrite: bool, resume: bool) -> Path | None:
    """Create or check the run directory; returns the checkpoint to resume from.

    A new run goes through :func:`unbroken.job.run_dir.prepare_out_dir`: only a
    directory holding a run is ever replaced (with ``overwrite``).

    Raises:
        ValueError: the directory holds a run (without ``overwrite``) or is not
            empty and holds no run, or ``resume`` finds no committed checkpoint
            or a different config.
        CheckpointError: ``resume`` finds committed checkpoints but none intact
            (each damaged one is logged and the previous one tried).
    """
    cfg_file = run_dir / "config.json"
    if resume:
        if not cfg_file.is_file():
            raise ValueError(f"--resume {run_dir}: no config.json there; is this a run directory?")
        saved = json.loads(cfg_file.read_text())
        diff = [f for f in config_diff(saved, cfg.to_dict()) if f not in _VOLATILE]
        if diff:
            raise ValueError(f"--resume {run_dir}: the run was made with different values for {', '.join(diff)}")
        if config_diff(saved, cfg.to_dict()):  # a field --resume may change (train.shard_optimizer): saved for all
            tmp = cfg_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(cfg.to_dict(), indent=1))
            os.replace(tmp, cfg_file)
        memory = _snapshot_memory(run_dir, cfg)
        try:
            ckpt = latest_checkpoint(run_dir)  # the newest whose files match their checksums
        except CheckpointError as exc:
            if not memory:
                raise CheckpointError(f"--resume {run_dir}: {exc}") from exc
            ckpt = None
        if ckpt is None and not memory:
            raise ValueError(f"--resume {run_dir}: no committed checkpoint under {run_dir / 'checkpoints'} "
                             f"and no snapshot of this job in shared memory")
        if ckpt is not None:
            _truncate_metrics(run_dir / "metrics.jsonl", int(read_commit(ckpt)["step"]))
        return ckpt
    old_job = job_id(run_dir) if (run_dir / JOB_ID_FILE).is_file() else None
    prepare_out_dir(run_dir, cfg, overwrite=overwrite, continue_hint=", --resume to continue it")
    if old_job is not None:  # an overwritten run: its snapshot memory goes with it
        remove_segments(old_job)
    (run_dir / JOB_ID_FILE).unlink(missing_ok=True)
    job_id(run_dir, create=True)  # a new job: its snapshot segments get a new name
    tmp = cfg_file.with_suffix(".tmp")
    tmp.write_text(json.dumps(cfg.to_dict(), indent=1))
    os.replace(tmp, cfg_file)
    return None


def _snapshot_memory(run_dir: Path, cfg: Config) -> bool:
    """Does shared memory hold sealed snapshot buffers of this run's job? Refuses another config's.

    Raises:
        ValueError: the job's segments were written under another config (names both hashes).
    """
    if not (run_dir / JOB_ID_FILE).is_file():
        return False
    job, want = job_id(run_dir), config_hash(cfg)
    found = False
    for path in job_segments(job):
        try:
            buf = SealedBuffer.open(path, job)
        except SnapshotCorrupt:
            continue  # reported and skipped by the agents' inventories
        if buf is None:
            continue
        if buf.seal.get("config_hash") != want:
            raise ValueError(f"--resume {run_dir}: shared memory holds snapshots of job {job} written under "
                             f"config {buf.seal.get('config_hash')} ({path.name}), not this run's {want}: "
                             f"resume with the run's own config, or remove them (rm {SHM_DIR}/unbroken-{job}-*)")
        found = True
    return found


_VOLATILE = {"train.host", "train.port", "train.log_every", "train.threads_per_worker", "train.timeout_s",
             "train.keep_checkpoints", "train.shard_optimizer", "data.cache_dir", "fault.store_timeout_s"}


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics written after the checkpoint we resume from."""
    if path.is_file():
        kept = [r for r in read_jsonl(path) if int(r.get("step", 0)) <= step]
        path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept))
