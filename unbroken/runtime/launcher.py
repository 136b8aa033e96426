"""Local launcher: validates a run, hosts the store, spawns and supervises workers.

``unbroken train`` on one machine needs no torchrun: this module checks
everything that can be checked before anything is written (config, data,
sequence length, output directory, port), then starts the coordination store,
spawns one worker process per slot and follows their metrics.

Invariants: a run that fails validation leaves nothing on disk; when a worker
fails, every other worker is stopped and the error names the worker and the
tail of its log; no worker outlives :func:`launch_local`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch.distributed as dist

from unbroken.config import Config, config_diff, config_hash
from unbroken.data import BatchSampler, prepare_data
from unbroken.models import model_args
from unbroken.runtime.checkpoint import latest_checkpoint, read_commit
from unbroken.jsonl import JsonlTail, read_jsonl

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0
"""Longest a worker may take from spawn to its first metrics line before we give up."""


class WorkerFailed(RuntimeError):
    """A worker process exited with an error; carries its rank, exit code and log tail."""

    def __init__(self, rank: int, returncode: int, log_tail: str) -> None:
        super().__init__(f"worker {rank} exited with code {returncode}; last log lines:\n{log_tail}")
        self.rank, self.returncode, self.log_tail = rank, returncode, log_tail


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


def launch_local(
    cfg: Config,
    run_dir: str | Path,
    *,
    overwrite: bool = False,
    resume: bool = False,
    on_record: Callable[[dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Train ``cfg`` with ``cfg.train.workers`` local worker processes.

    Returns:
        The summary also written to ``<run_dir>/summary.json``.
    Raises:
        ValueError: invalid input (nothing written); WorkerFailed: a worker died.
    """
    run_dir = Path(run_dir)
    info = preflight(cfg)
    store = start_store(cfg.train.host, cfg.train.port, cfg.train.workers)
    resume_from = prepare_run_dir(run_dir, cfg, overwrite=overwrite, resume=resume)
    procs = _spawn(cfg, run_dir, f"{cfg.train.host}:{store.port}", resume_from)
    t0 = time.time()
    try:
        _supervise(procs, run_dir, cfg, on_record)
    finally:
        _stop_all(procs)
    summary = _summarise(run_dir, cfg, info, time.time() - t0, resume_from)
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
    del store
    return summary


def _spawn(cfg: Config, run_dir: Path, store_addr: str, resume_from: Path | None) -> list[tuple[subprocess.Popen[bytes], Path]]:
    logs = run_dir / "logs"
    logs.mkdir(exist_ok=True)
    procs = []
    for rank in range(cfg.train.workers):
        cmd = [sys.executable, "-m", "unbroken.runtime.worker", "--run-dir", str(run_dir), "--rank", str(rank),
               "--world", str(cfg.train.workers), "--store", store_addr]
        if resume_from is not None:
            cmd += ["--resume", str(resume_from)]
        log = logs / f"w{rank}.log"
        with log.open("ab") as fh:
            procs.append((subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL), log))
    return procs


def _supervise(procs: list[tuple[subprocess.Popen[bytes], Path]], run_dir: Path, cfg: Config,
               on_record: Callable[[dict[str, Any]], None] | None) -> None:
    tail = JsonlTail(run_dir / "metrics.jsonl")
    last_progress = time.time()
    while True:
        records = tail.read_new()
        if records:
            last_progress = time.time()
        for rec in records:
            if on_record:
                on_record(rec)
        codes = [p.poll() for p, _ in procs]
        for rank, code in enumerate(codes):
            if code not in (None, 0):
                raise WorkerFailed(rank, code, _log_tail(procs[rank][1]))
        if all(c == 0 for c in codes):
            for rec in tail.read_new():
                if on_record:
                    on_record(rec)
            return
        limit = max(STARTUP_TIMEOUT_S, cfg.train.timeout_s)
        if time.time() - last_progress > limit:
            raise TimeoutError(f"no progress from the workers for {limit:.0f} s; see {run_dir / 'logs'}")
        time.sleep(0.05)


def _stop_all(procs: list[tuple[subprocess.Popen[bytes], Path]], grace_s: float = 5.0) -> None:
    for p, _ in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.time() + grace_s
    for p, _ in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=grace_s)


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"(log unreadable: {exc})"


def _summarise(run_dir: Path, cfg: Config, info: dict[str, Any], wall_s: float, resume_from: Path | None) -> dict[str, Any]:
    records = read_jsonl(run_dir / "metrics.jsonl")
    train = [r for r in records if r["kind"] == "train"]
    val = [r for r in records if r["kind"] == "val"]
    reports = [json.loads(p.read_text()) for p in sorted((run_dir / "workers").glob("w*.json"))]
    digests = sorted({r["param_digest"] for r in reports})
    steady = [r["tokens_per_s"] for r in train[len(train) // 5 :]] or [0.0]
    return {
        "run_dir": str(run_dir), "config_hash": config_hash(cfg), "workers": cfg.train.workers,
        "steps": train[-1]["step"] if train else 0, "resumed_from": str(resume_from) if resume_from else None,
        "final_loss": train[-1]["loss"] if train else None,
        "val_loss": val[-1]["val_loss"] if val else None, "val_ppl": val[-1]["val_ppl"] if val else None,
        "tokens_per_s": sorted(steady)[len(steady) // 2], "wall_s": wall_s,
        "workers_agree": len(digests) == 1, "param_digest": digests[0] if len(digests) == 1 else digests,
        "checkpoint": str(latest_checkpoint(run_dir)) if latest_checkpoint(run_dir) else None, **info,
    }
