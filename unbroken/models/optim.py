"""AdamW and its learning-rate schedules (cosine, warmup-stable-decay, linear, constant), built identically
on every worker.

Plain arguments only: ``models/`` knows nothing of the run's config (the job
builder, :mod:`unbroken.job.builder`, passes the ``optim`` section's fields).

Invariant: the learning rate of step ``s`` is a pure function of ``s`` and the
schedule's arguments, so a resumed or replacement worker needs only the step
number to rebuild the schedule. Under :func:`lr_wsd` the decay is anchored to the
run's end, so raising ``total_steps`` leaves the learning rate of every step
before the old decay's start unchanged (a run is extended in its stable phase).
"""

from __future__ import annotations

import math
from typing import Literal

import torch

DecayShape = Literal["linear", "cosine", "sqrt"]
"""How :func:`lr_wsd` falls from the peak to the floor: ``linear``; ``cosine`` (half a period);
``sqrt`` (``1 - sqrt(progress)``: most of the fall early)."""


def lr_at(step: int, *, lr: float, warmup_steps: int, min_lr_ratio: float, total_steps: int) -> float:
    """Learning rate used by optimizer step ``step`` (0-based).

    Args:
        step: the optimizer step, 0-based.
        lr: peak learning rate, reached at the end of the warm-up.
        warmup_steps: linear warm-up length (0: none).
        min_lr_ratio: final learning rate as a fraction of ``lr``.
        total_steps: steps of the whole run; the cosine decay ends there.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    decay_steps = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    floor = lr * min_lr_ratio
    return floor + (lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def lr_linear(step: int, *, lr: float, warmup_steps: int, min_lr_ratio: float, total_steps: int) -> float:
    """As :func:`lr_at` with a straight line from the peak (end of warm-up) to ``lr * min_lr_ratio`` (step
    ``total_steps``) instead of the cosine."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    floor = lr * min_lr_ratio
    return floor + (lr - floor) * (1.0 - progress)


def lr_constant(step: int, *, lr: float, warmup_steps: int) -> float:
    """Linear warm-up to ``lr``, then ``lr`` for good."""
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    return lr


def lr_wsd(step: int, *, lr: float, warmup_steps: int, min_lr_ratio: float, total_steps: int, decay_steps: int,
           decay_shape: DecayShape = "linear") -> float:
    """Warmup-stable-decay: linear warm-up, ``lr`` until step ``total_steps - decay_steps``, then a fall over
    the last ``decay_steps`` steps that reaches ``lr * min_lr_ratio`` at the last step (``total_steps - 1``).

    Only the decay depends on ``total_steps``: a longer run keeps the same rates up to the old decay's start.

    Args:
        decay_steps: steps of the final decay (>= 1); the first of them is already below the peak.
        decay_shape: see :data:`DecayShape`.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    start = total_steps - decay_steps
    if step < start:
        return lr
    progress = min(1.0, (step - start + 1) / max(1, decay_steps))
    if decay_shape == "cosine":
        remaining = 0.5 * (1.0 + math.cos(math.pi * progress))
    elif decay_shape == "sqrt":
        remaining = 1.0 - math.sqrt(progress)
    else:
        remaining = 1.0 - progress
    floor = lr * min_lr_ratio
    return floor + (lr - floor) * remaining


def build_optimizer(
    model: torch.nn.Module, *, lr: float, betas: tuple[float, float], eps: float, weight_decay: float,
    fused: bool = False,
) -> torch.optim.AdamW:
    """AdamW; matrices and embeddings decay (by ``weight_decay``), norm gains do not.

    ``fused``: one fused kernel for every parameter (CUDA). Each element's update
    is computed alone, in a fixed order of operations, so workers given the same
    reduced gradient stay bit-identical; otherwise ``foreach=False`` keeps the
    arithmetic order identical across processes and runs (the CPU default).
    """
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    if fused:
        return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, foreach=False)


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
