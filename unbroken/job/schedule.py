"""The learning rate of every step, from the ``optim`` section: one :class:`Schedule` per run.

Invariants:

- ``Schedule(...)(step)`` is a pure function of the step and the fields, so a
  resumed, restored or joining worker sets the same rate as everyone else;
- a schedule of kind ``none`` sets no rate at all: the user's optimizer
  (``optim.factory``) keeps the one it was built with, and :meth:`Schedule.sets_lr`
  says so to the code that applies a step;
- under ``wsd`` the rate of a step before ``train.steps - decay_steps`` does
  not depend on ``train.steps``, which is what lets ``--resume`` extend a run.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Literal

from unbroken.config import Config, OptimConfig
from unbroken.models.optim import DecayShape, lr_at, lr_constant, lr_linear, lr_wsd

logger = logging.getLogger(__name__)

Kind = Literal["cosine", "wsd", "linear", "constant", "none"]
"""``optim.schedule`` once ``auto`` is resolved (:func:`resolve_kind`)."""


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """The learning rate of every step (``kind`` picks the curve; see ``OptimConfig.schedule``)."""

    lr: float
    warmup_steps: int
    min_lr_ratio: float
    total_steps: int
    kind: Kind = "cosine"
    decay_steps: int = 0
    """``wsd`` only: the final decay's length."""
    decay_shape: DecayShape = "linear"

    @classmethod
    def from_config(cls, optim: OptimConfig, total_steps: int) -> Schedule:
        return cls(lr=optim.lr, warmup_steps=optim.warmup_steps, min_lr_ratio=optim.min_lr_ratio,
                   total_steps=total_steps, kind=resolve_kind(optim), decay_steps=optim.decay_steps,
                   decay_shape=optim.decay_shape)

    @property
    def sets_lr(self) -> bool:
        """False: the optimizer keeps its own learning rate (``kind='none'``)."""
        return self.kind != "none"

    def __call__(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based).

        Raises:
            ValueError: the schedule is ``none`` (it sets no rate; check :attr:`sets_lr` first).
        """
        lr, warmup, ratio, total = self.lr, self.warmup_steps, self.min_lr_ratio, self.total_steps
        if self.kind == "cosine":
            return lr_at(step, lr=lr, warmup_steps=warmup, min_lr_ratio=ratio, total_steps=total)
        if self.kind == "wsd":
            return lr_wsd(step, lr=lr, warmup_steps=warmup, min_lr_ratio=ratio, total_steps=total,
                          decay_steps=self.decay_steps, decay_shape=self.decay_shape)
        if self.kind == "linear":
            return lr_linear(step, lr=lr, warmup_steps=warmup, min_lr_ratio=ratio, total_steps=total)
        if self.kind == "constant":
            return lr_constant(step, lr=lr, warmup_steps=warmup)
        raise ValueError(f"schedule {self.kind!r} sets no learning rate: the optimizer keeps its own")

    def describe(self) -> str:
        """One line saying what sets the learning rate of the run."""
        if not self.sets_lr:
            return ("learning rate: optim.factory's optimizer keeps its own (optim.schedule=none); name a schedule "
                    "in optim.schedule to have the job set it every step")
        peak = f"peak {self.lr:g} after {self.warmup_steps} warm-up steps"
        if self.kind == "constant":
            return f"learning rate: constant, {peak}"
        floor = f"to {self.lr * self.min_lr_ratio:g}"
        if self.kind == "wsd":
            return (f"learning rate: wsd, {peak}, stable until step {self.total_steps - self.decay_steps}, then "
                    f"{self.decay_shape} decay {floor} at the last step")
        return f"learning rate: {self.kind}, {peak}, decay {floor} at step {self.total_steps}"


def resolve_kind(optim: OptimConfig) -> Kind:
    """``optim.schedule`` with ``auto`` resolved: ``cosine`` for the built-in AdamW, ``none`` (the optimizer's
    own rate) for ``optim.factory``."""
    if optim.schedule == "auto":
        return "none" if optim.factory else "cosine"
    return optim.schedule


def schedule_for(cfg: Config) -> Schedule:
    """The run's schedule: the ``optim`` section over ``train.steps`` steps."""
    return Schedule.from_config(cfg.optim, cfg.train.steps)
