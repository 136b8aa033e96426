"""The parts of a job a user brings: model, data and optimizer factories named in the config.

``model.factory``, ``data.factory`` and ``optim.factory`` hold references
(:mod:`unbroken.job.references`); every worker resolves them and calls the
functions with a :class:`BuildContext`. What they return is checked here, so a
wrong return type fails with the field's name at start, not in the middle of
the step protocol.

Invariant: a factory sees only the context (config, device, data facts), never
which worker calls it, so a deterministic factory builds the same thing in
every worker; :mod:`unbroken.job.consistency` checks that it did.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from unbroken.config import Config
from unbroken.data.source import DataSource, as_source
from unbroken.job.references import resolve

__all__ = ["BuildContext", "CheckedSource", "user_data", "user_model", "user_optimizer"]


@dataclasses.dataclass(frozen=True, kw_only=True)
class BuildContext:
    """What a user's factory is told.

    Attributes:
        cfg: the run's whole configuration.
        device: where the worker computes (the model factory may build there; it is moved anyway).
        seed: ``train.seed``: seed every random draw of the factory with it.
        vocab_size: the data's vocabulary when known (``data.source`` data, or a
            source with a ``vocab_size`` attribute), else None.
    """

    cfg: Config
    device: torch.device
    seed: int
    vocab_size: int | None = None


class CheckedSource:
    """A user's :class:`~unbroken.data.source.DataSource` whose answers are checked (shape, dtype, row count)."""

    def __init__(self, source: DataSource, *, n_slots: int, micro_batch: int) -> None:
        self.source, self.n_slots, self.micro_batch = source, n_slots, micro_batch
        self.seq_len: int | None = getattr(source, "seq_len", None)
        self.vocab_size: int | None = getattr(source, "vocab_size", None)

    @property
    def tokens_per_step(self) -> int:
        if self.seq_len is None:
            self.batch(0, 0, (0, 1))
        return self.n_slots * self.micro_batch * int(self.seq_len or 0)

    @property
    def has_validation(self) -> bool:
        return callable(getattr(self.source, "validation_batch", None))

    def batch(self, step: int, slot: int, rows: tuple[int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The source's rows, checked.

        Raises:
            ValueError: not a pair of 2-D integer tensors of ``b - a`` rows and equal shapes.
        """
        rows = (0, self.micro_batch) if rows is None else (int(rows[0]), int(rows[1]))
        x, y = (torch.as_tensor(t) for t in self.source.batch(step, slot, rows))
        self._check(x, y, f"batch({step}, {slot}, {rows})", rows[1] - rows[0])
        return x.long(), y.long()

    def validation_batch(self, index: int, _slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = (torch.as_tensor(t) for t in getattr(self.source, "validation_batch")(index))  # optional: checked
        self._check(x, y, f"validation_batch({index})", None)
        return x.long(), y.long()

    def _check(self, x: torch.Tensor, y: torch.Tensor, call: str, n_rows: int | None) -> None:
        ok = (x.dim() == 2 and x.shape == y.shape and not x.is_floating_point() and not y.is_floating_point()
              and (n_rows is None or x.shape[0] == n_rows))
        if not ok:
            raise ValueError(f"data source {type(self.source).__name__}.{call} returned shapes "
                             f"{tuple(x.shape)}, {tuple(y.shape)} ({x.dtype}); it must return (inputs, targets), "
                             f"two integer tensors of shape ({n_rows or 'rows'}, seq_len)")
        if self.seq_len is None:
            self.seq_len = int(x.shape[1])


def user_data(cfg: Config, device: torch.device) -> CheckedSource:
    """Call ``data.factory`` and wrap what it returns (see :func:`unbroken.data.source.as_source`).

    Raises:
        ValueError: bad reference, or a return value that is neither a source nor a dataset.
    """
    factory = resolve(cfg.data.factory, field="data.factory")
    ctx = BuildContext(cfg=cfg, device=device, seed=cfg.train.seed)
    source = as_source(factory(ctx), seed=cfg.train.seed, n_slots=cfg.n_slots, micro_batch=cfg.data.micro_batch)
    return CheckedSource(source, n_slots=cfg.n_slots, micro_batch=cfg.data.micro_batch)


def user_model(cfg: Config, ctx: BuildContext) -> torch.nn.Module:
    """Call ``model.factory`` and move the model to ``ctx.device`` in float32 training mode.

    Raises:
        ValueError: bad reference, a return value that is not a module, or a module without trainable parameters.
    """
    model = resolve(cfg.model.factory, field="model.factory")(ctx)
    if not isinstance(model, torch.nn.Module):
        raise ValueError(f"model.factory={cfg.model.factory!r} returned a {type(model).__name__}; "
                         "return a torch.nn.Module whose forward maps token ids (B, T) to logits (B, T, V)")
    if not any(p.requires_grad for p in model.parameters()):
        raise ValueError(f"model.factory={cfg.model.factory!r} returned a model without trainable parameters")
    return model.to(ctx.device).train()


def user_optimizer(cfg: Config, model: torch.nn.Module, ctx: BuildContext) -> torch.optim.Optimizer:
    """Call ``optim.factory(model, ctx)``.

    Raises:
        ValueError: a return value that is not a ``torch.optim.Optimizer``.
    """
    opt: Any = resolve(cfg.optim.factory, field="optim.factory")(model, ctx)
    if not isinstance(opt, torch.optim.Optimizer):
        raise ValueError(f"optim.factory={cfg.optim.factory!r} returned a {type(opt).__name__}; "
                         "return a torch.optim.Optimizer over the model's parameters")
    return opt
