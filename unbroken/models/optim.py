"""AdamW with linear warm-up and cosine decay, built identically on every worker.

Invariant: the learning rate of step ``s`` is a pure function of ``s`` and the
config, so a resumed or replacement worker needs only the step number to
rebuild the schedule.
"""

from __future__ import annotations

import math

import torch

from unbroken.config import OptimConfig


def lr_at(step: int, *, cfg: OptimConfig, total_steps: int) -> float:
    """Learning rate used by optimizer step ``step`` (0-based)."""
    if cfg.warmup_steps > 0 and step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    decay_steps = max(1, total_steps - cfg.warmup_steps)
    progress = min(1.0, (step - cfg.warmup_steps) / decay_steps)
    floor = cfg.lr * cfg.min_lr_ratio
    return floor + (cfg.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def build_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW; matrices and embeddings decay, norm gains do not."""
    decay, no_decay = [], []
    for _, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # foreach=False keeps the arithmetic order identical across processes and runs.
    return torch.optim.AdamW(
        groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, foreach=False
    )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set the learning rate of every parameter group."""
    for group in optimizer.param_groups:
        group["lr"] = lr
