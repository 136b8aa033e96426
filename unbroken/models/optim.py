"""AdamW with linear warm-up and cosine decay, built identically on every worker.

Plain arguments only: ``models/`` knows nothing of the run's config (the job
builder, :mod:`unbroken.job.builder`, passes the ``optim`` section's fields).

Invariant: the learning rate of step ``s`` is a pure function of ``s`` and the
schedule's arguments, so a resumed or replacement worker needs only the step
number to rebuild the schedule.
"""

from __future__ import annotations

import math

import torch


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
