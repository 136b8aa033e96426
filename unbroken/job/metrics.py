"""The one writer of a run's ``metrics.jsonl``: ``train`` and ``val`` records and their cadence.

Used by the trainer's leader and by the simulator, so both files carry the
same records. A ``train`` record holds ``kind, step, loss, lr, grad_norm,
tokens_per_s, step_time_s, tokens`` plus the caller's extras (the trainer:
``generation, live_workers, degraded``; the simulator: ``wall_s,
live_workers, degraded, assignment, waited, slowest_worker_s``), and, where
computable, what the writer adds: ``eta_s`` (the steps left at the wall-clock
pace of the lines this writer wrote, validation and checkpoint pauses
included), ``flops_per_s`` (the built-in llama's training FLOPs per token
times ``tokens_per_s``), ``mfu`` (that over the live workers' peak, on a GPU
of known peak) and ``device_memory_bytes`` (this process's peak CUDA
allocation). A ``val``
record holds ``kind, step, val_loss, val_ppl``. :class:`~unbroken.jsonl.JsonlWriter`
adds ``time`` to every line.

Invariants: ``step`` is the number of steps done (1-based); a ``train`` line is
written every ``train.log_every`` steps and at the last step, a ``val`` line
every ``train.val_every`` steps (0: none but the last) and at the last step, a step's
``train`` line before its ``val`` line.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from types import TracebackType
from typing import Any, Callable

import torch

from unbroken.config import Config
from unbroken.jsonl import JsonlWriter
from unbroken.models.llama import count_parameters, model_args

PPL_LOSS_CAP = 50.0
"""Perplexity is ``exp(min(val_loss, PPL_LOSS_CAP))``: a diverged run reports a large finite number."""

Record = dict[str, Any]

PEAK_BF16_FLOPS = {"H100": 989.4e12, "H200": 989.4e12, "H800": 989.4e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 tensor-core peak FLOP/s by card (the vendors' figures, without sparsity): the MFU's denominator."""


def flops_per_token(cfg: Config) -> float | None:
    """Training FLOPs per token of the built-in llama: ``6 N`` (N without the input embedding) plus attention's
    ``12 L D T``; None for another model family (its shape is not in the config)."""
    if cfg.model.family != "llama":
        return None
    args = model_args(cfg.model.preset, vocab_size=cfg.data.vocab_size,
                      **({"max_seq_len": cfg.model.max_seq_len} if cfg.model.max_seq_len else {}))
    n = count_parameters(args) - args.vocab_size * args.dim
    return 6.0 * n + 12.0 * args.n_layers * args.dim * cfg.data.seq_len


def _cuda_peak() -> tuple[float | None, int | None]:
    """This process's CUDA device: its bf16 peak (None if not in the table) and peak allocation; (None, None)
    where the process uses no CUDA device."""
    if not (torch.cuda.is_available() and torch.cuda.is_initialized()):
        return None, None
    device = torch.cuda.current_device()
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_BF16_FLOPS.items() if k in name), None)
    return peak, int(torch.cuda.max_memory_allocated(device))


def train_record(*, step: int, loss: float, lr: float, grad_norm: float, step_time_s: float,
                 tokens_per_step: int, **extra: Any) -> Record:
    """The ``train`` record after ``step`` steps (1-based); ``extra`` fields are appended as given."""
    return {"kind": "train", "step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_step / step_time_s, "step_time_s": step_time_s,
            "tokens": step * tokens_per_step, **extra}


def val_record(step: int, val_loss: float) -> Record:
    """The ``val`` record after ``step`` steps (1-based)."""
    return {"kind": "val", "step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, PPL_LOSS_CAP))}


class MetricsWriter:
    """Appends records to ``path`` on the run's cadence; optionally hands each to ``on_record``.

    Args:
        path: the ``metrics.jsonl`` file (appended to; its folder is created).
        log_every: a ``train`` line every this many steps (>= 1).
        val_every: a ``val`` line every this many steps (0: only at the last step).
        total_steps: the run's last step, which always gets both lines.
        on_record: called with every record as written (``time`` included).

    Raises:
        ValueError: ``log_every < 1`` or ``val_every < 0``.
    """

    def __init__(self, path: str | Path, *, log_every: int, val_every: int, total_steps: int,
                 on_record: Callable[[Record], None] | None = None) -> None:
        if log_every < 1:
            raise ValueError(f"log_every={log_every}: must be >= 1 (train.log_every)")
        if val_every < 0:
            raise ValueError(f"val_every={val_every}: must be >= 0, 0 disables (train.val_every)")
        self.log_every, self.val_every, self.total_steps = log_every, val_every, total_steps
        self.on_record = on_record
        self.flops_per_token: float | None = None
        """Set by :meth:`for_run`: the ``flops_per_s`` and ``mfu`` of ``train`` lines; None: not computable."""
        self._first: tuple[float, int] | None = None  # (wall time, step) of this writer's first train line
        self._out = JsonlWriter(path)

    @classmethod
    def for_run(cls, path: str | Path, cfg: Config, *,
                on_record: Callable[[Record], None] | None = None) -> MetricsWriter:
        """The writer with the cadence of ``cfg.train``."""
        t = cfg.train
        writer = cls(path, log_every=t.log_every, val_every=t.val_every, total_steps=t.steps, on_record=on_record)
        writer.flops_per_token = flops_per_token(cfg)
        return writer

    def log_due(self, done: int) -> bool:
        """Whether the ``train`` line of step ``done`` (1-based) is written."""
        return done % self.log_every == 0 or done == self.total_steps

    def val_due(self, done: int) -> bool:
        """Whether validation runs after step ``done`` (1-based)."""
        return (self.val_every > 0 and done % self.val_every == 0) or done == self.total_steps

    def write(self, record: Record) -> Record:
        """Write a copy of ``record`` (``record`` itself is left as is); returns the line written."""
        line = dict(record)
        if line.get("kind") == "train":
            line.update(self._pace(line))
        self._out.write(line)
        if self.on_record is not None:
            self.on_record(line)
        return line

    def step_done(self, record: Record, val_loss: Callable[[], float] | None) -> Record | None:
        """After a step: its ``train`` line when due, then validation when due.

        Args:
            record: the step's :func:`train_record` (its ``step`` is the steps done).
            val_loss: computes the validation loss; called only when validation is due
                (None: the data has no validation split, no ``val`` line).

        Returns:
            The ``val`` line written, or None when validation was not due.
        """
        done = int(record["step"])
        if self.log_due(done):
            self.write(record)
        if val_loss is None or not self.val_due(done):
            return None
        return self.write(val_record(done, val_loss()))

    def _pace(self, rec: Record) -> Record:
        """ETA, FLOP/s, MFU and device memory of a ``train`` line, those computable (module docstring)."""
        out: Record = {}
        now, step = time.time(), int(rec["step"])
        if step >= self.total_steps:
            out["eta_s"] = 0.0
        elif self._first is None or step <= self._first[1]:
            self._first = (now, step)
        else:
            t0, s0 = self._first
            out["eta_s"] = (now - t0) / (step - s0) * (self.total_steps - step)
        peak, memory = _cuda_peak()
        if self.flops_per_token is not None and isinstance(rec.get("tokens_per_s"), (int, float)):
            out["flops_per_s"] = self.flops_per_token * rec["tokens_per_s"]
            live = rec.get("live_workers")
            devices = len(live) if isinstance(live, list) else live if isinstance(live, int) else None
            if peak is not None and devices:
                out["mfu"] = out["flops_per_s"] / (peak * devices)
        if memory is not None:
            out["device_memory_bytes"] = memory
        return out

    def close(self) -> None:
        self._out.close()

    def __enter__(self) -> MetricsWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()
