"""Run preparation shared by the launchers: validation, the run directory, the store.

:func:`preflight` checks everything that can be checked before anything is
written (config, data, sequence length); :func:`prepare_run_dir` creates or
checks the output directory. The coordination store is hosted through
:meth:`unbroken.store.job_store.JobStore.host`.
Processes are started by :mod:`unbroken.agent.launcher` (one agent per node).

Invariants: a run that fails validation leaves nothing on disk; a resumed run
keeps its saved config (only fields in ``_VOLATILE`` may differ) and its
metrics stop at the step it resumes from (snapshot memory or checkpoint).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from unbroken.agent.resume_point import resume_point
from unbroken.config import Config, config_diff, config_from_dict
from unbroken.job.builder import build_data, build_samplers, check_model_fits, check_model_parts, data_info
from unbroken.job.parallelize import check_compile_toolchain, resolve_compile
from unbroken.job.run_dir import prepare_out_dir
from unbroken.models.factory import resolve_device
from unbroken.jsonl import JsonlWriter, read_jsonl
from unbroken.snapshot.segment import remove_segments
from unbroken.runtime.snapshot_hooks import JOB_ID_FILE, job_id


def preflight(cfg: Config) -> dict[str, Any]:
    """Check data and model against the config before anything is written.

    Prepares (or reuses) the tokenizer and token cache, so workers only load them.

    Raises:
        ValueError: with the offending value and the fix.
    """
    check_model_fits(cfg)
    device = resolve_device(cfg.train.device)
    if resolve_compile(cfg.train.compile, device):
        check_compile_toolchain(device.type)
    data = build_data(cfg)
    # Constructing the samplers validates that both splits hold enough windows.
    build_samplers(cfg, data)
    check_model_parts(cfg, data)
    return data_info(data)


def prepare_run_dir(run_dir: Path, cfg: Config, *, overwrite: bool, resume: bool,
                    memory_usable: bool = True) -> Path | None:
    """Create or check the run directory; returns the newest committed checkpoint of a resumed run (None:
    a new run, or none); its agents restore the newer of it and the job's snapshot memory.

    A new run goes through :func:`unbroken.job.run_dir.prepare_out_dir`: only a
    directory holding a run is ever replaced (with ``overwrite``).

    Raises:
        ValueError: the directory holds a run (without ``overwrite``) or is not
            empty and holds no run, or ``resume`` finds a different config, or neither
            a complete snapshot in memory nor a committed checkpoint
            (:class:`~unbroken.agent.resume_point.NothingToResume`).
        CheckpointError: ``resume`` finds committed checkpoints but none intact
            (each damaged one is logged and the previous one tried), and no snapshot in memory.

    ``memory_usable`` False: the run resumes on another layout than its snapshot memory's, from its newest
    checkpoint (that memory is removed: the new layout writes its own).
    """
    cfg_file = run_dir / "config.json"
    if resume:
        if not cfg_file.is_file():
            raise ValueError(f"--resume {run_dir}: no config.json there; is this a run directory?")
        saved = json.loads(cfg_file.read_text())
        diff = [f for f in config_diff(saved, cfg.to_dict()) if f not in _VOLATILE and not f.startswith("monitor.")]
        if config_from_dict(saved).n_slots == cfg.n_slots:  # the same global batch on other workers: the same job
            diff = [f for f in diff if f not in ("train.workers", "train.global_batch")]
        if diff:
            raise ValueError(f"--resume {run_dir}: the run was made with different values for {', '.join(diff)}")
        if config_diff(saved, cfg.to_dict()):  # a field --resume may change (train.shard_optimizer): saved for all
            tmp = cfg_file.with_suffix(".tmp")
            tmp.write_text(json.dumps(cfg.to_dict(), indent=1))
            os.replace(tmp, cfg_file)
        # refuses when neither memory nor a checkpoint holds the run
        point = resume_point(run_dir, cfg, memory_usable=memory_usable)
        if not memory_usable and (run_dir / JOB_ID_FILE).is_file():
            remove_segments(job_id(run_dir))
        for report in (run_dir / "workers").glob("w*.json"):  # fewer workers now: the others' reports go
            if not report.stem[1:].isdigit() or int(report.stem[1:]) >= cfg.train.workers:
                report.unlink()
        _truncate_metrics(run_dir / "metrics.jsonl", point.step)
        marks = JsonlWriter(run_dir / "events" / "resume.jsonl")  # the ledger: what the stopped job did after
        marks.write({"kind": "resume", "step": point.step})      # point.step is trained again
        marks.close()
        return point.checkpoint  # the agents restore the newer of it and memory (node 0 decides)
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


_VOLATILE = {"train.host", "train.port", "train.log_every", "train.threads_per_worker", "train.timeout_s",
             "train.keep_checkpoints", "train.checkpoint_every_s", "train.shard_optimizer", "train.shard_degree",
             "data.cache_dir", "model.parallelize",
             "fault.store_timeout_s", "fault.template", "train.steps"}


def _truncate_metrics(path: Path, step: int) -> None:
    """Drop metrics written after the step we resume from."""
    if path.is_file():
        kept = [r for r in read_jsonl(path) if int(r.get("step", 0)) <= step]
        path.write_text("".join(json.dumps(r, separators=(",", ":")) + "\n" for r in kept))
