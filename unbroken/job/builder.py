"""The one builder of a training job: config → data, samplers, model, adapter, optimizer, schedule.

The trainer (:mod:`unbroken.runtime.worker`), the single-process simulator
(:mod:`unbroken.job.simulator`) and the launchers' preflight
(:mod:`unbroken.agent.preflight`) all build through these functions, so what
they train is the same thing by construction.

Invariants:

- :func:`build_job` is a pure function of the config and the device: two calls
  give bitwise-equal parameters (the model draws from a private generator
  seeded with ``train.seed``) and the same batches (the samplers are stateless
  functions of ``(step, slot)``);
- the order is fixed: data, samplers, model, adapter, gradient layout,
  optimizer; a :class:`Prepared` (what a warm standby builds before it knows
  which worker it will be) stands in for the data and the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from unbroken.config import Config, OptimConfig
from unbroken.data import BatchSampler, PreparedData, prepare_data
from unbroken.mecefo.adapter import LlamaAdapter
from unbroken.mecefo.gradients import GradLayout, SlotWork, apply_step, compute_gradient_sums
from unbroken.models import build_model, model_args, validation_loss
from unbroken.models.optim import build_optimizer, lr_at


@dataclass(frozen=True, kw_only=True)
class Schedule:
    """The learning rate of every step: linear warm-up, then cosine decay to ``lr * min_lr_ratio``."""

    lr: float
    warmup_steps: int
    min_lr_ratio: float
    total_steps: int

    @classmethod
    def from_config(cls, optim: OptimConfig, total_steps: int) -> Schedule:
        return cls(lr=optim.lr, warmup_steps=optim.warmup_steps, min_lr_ratio=optim.min_lr_ratio,
                   total_steps=total_steps)

    def __call__(self, step: int) -> float:
        """Learning rate of optimizer step ``step`` (0-based)."""
        return lr_at(step, lr=self.lr, warmup_steps=self.warmup_steps, min_lr_ratio=self.min_lr_ratio,
                     total_steps=self.total_steps)


def schedule_for(cfg: Config) -> Schedule:
    """The run's schedule: the ``optim`` section over ``train.steps`` steps."""
    return Schedule.from_config(cfg.optim, cfg.train.steps)


def check_model_fits(cfg: Config) -> None:
    """Check ``data.seq_len`` against the model's ``max_seq_len`` without building the model.

    Raises:
        ValueError: ``data.seq_len`` is longer than the model allows (names both values and the fix).
    """
    overrides = {"max_seq_len": cfg.model.max_seq_len} if cfg.model.max_seq_len else {}
    margs = model_args(cfg.model.preset, **overrides)
    if cfg.data.seq_len > margs.max_seq_len:
        raise ValueError(
            f"data.seq_len={cfg.data.seq_len} is longer than model {cfg.model.preset!r} allows "
            f"(max_seq_len={margs.max_seq_len}); lower data.seq_len or raise model.max_seq_len"
        )


def build_data(cfg: Config) -> PreparedData:
    """Tokenizer and token streams of the ``data`` section (prepared once, then loaded from the cache)."""
    d = cfg.data
    return prepare_data(source=d.source, vocab_size=d.vocab_size, val_fraction=d.val_fraction,
                        cache_dir=d.cache_dir, token_dtype=d.token_dtype, max_bytes=d.max_bytes)


def build_samplers(cfg: Config, data: PreparedData) -> tuple[BatchSampler, BatchSampler]:
    """The training sampler (``train.workers`` slots) and the validation sampler (one slot).

    Raises:
        ValueError: a split holds fewer windows than one global batch (training)
            or one micro-batch (validation: raise ``data.val_fraction``).
    """
    d, seed = cfg.data, cfg.train.seed
    train = BatchSampler(data.train, seed=seed, n_slots=cfg.train.workers, micro_batch=d.micro_batch,
                         seq_len=d.seq_len)
    try:
        val = BatchSampler(data.val, seed=seed, n_slots=1, micro_batch=d.micro_batch, seq_len=d.seq_len)
    except ValueError as exc:
        raise ValueError(f"validation split too small for one micro-batch: {exc}; raise data.val_fraction") from None
    return train, val


def data_info(data: PreparedData) -> dict[str, int]:
    """``vocab_size``, ``train_tokens`` and ``val_tokens`` of prepared data (as preflight and summaries report)."""
    return {"vocab_size": data.vocab_size, "train_tokens": int(len(data.train)), "val_tokens": int(len(data.val))}


@dataclass(kw_only=True)
class Prepared:
    """What a warm standby builds before it knows which worker it will be."""

    data: PreparedData
    model: torch.nn.Module


def prepare(cfg: Config, device: torch.device) -> Prepared:
    """Load the data and build the model: the slow part of a worker's start besides imports."""
    data = build_data(cfg)
    return Prepared(data=data, model=_build_model(cfg, data, device))


def _build_model(cfg: Config, data: PreparedData, device: torch.device) -> torch.nn.Module:
    return build_model(cfg.model.preset, vocab_size=data.vocab_size, seq_len=cfg.data.seq_len,
                       max_seq_len=cfg.model.max_seq_len, seed=cfg.train.seed, device=device)


@dataclass(kw_only=True)
class Job:
    """Everything one worker (or the simulator) trains with."""

    cfg: Config
    device: torch.device
    data: PreparedData
    sampler: BatchSampler
    val_sampler: BatchSampler
    model: torch.nn.Module
    adapter: LlamaAdapter
    layout: GradLayout
    optimizer: torch.optim.AdamW
    schedule: Schedule

    @property
    def info(self) -> dict[str, int]:
        """See :func:`data_info`."""
        return data_info(self.data)

    @property
    def n_slots(self) -> int:
        return self.cfg.train.workers

    @property
    def micro_batch(self) -> int:
        return self.cfg.data.micro_batch

    def gradient_sums(self, step: int, items: list[SlotWork]) -> torch.Tensor:
        """One worker's gradient sums of ``items`` of ``step`` (:func:`~unbroken.mecefo.gradients.compute_gradient_sums`)."""
        return compute_gradient_sums(self.model, self.adapter, self.layout, items, step=step,
                                     micro_batch=self.micro_batch, batch_fn=self.sampler.batch, device=self.device)

    def apply(self, step: int, reduced: torch.Tensor) -> tuple[float, float]:
        """Apply the reduced buffer of ``step`` (schedule's lr, clipping, AdamW); returns (lr, grad norm)."""
        lr = self.schedule(step)
        return lr, apply_step(self.layout, reduced, self.optimizer, lr=lr, grad_clip=self.cfg.optim.grad_clip)

    def loss(self, reduced: torch.Tensor) -> float:
        """The step's token-mean training loss, from a reduced buffer."""
        return self.layout.loss_sum(reduced) / self.layout.token_count(reduced)

    def validation_loss(self) -> float:
        """Token-mean loss of the first ``train.val_batches`` validation micro-batches."""
        return validation_loss(self.model, self.val_sampler.batch, self.cfg.train.val_batches, self.device)


def build_job(cfg: Config, device: torch.device, prepared: Prepared | None = None) -> Job:
    """Build the job of ``cfg`` on ``device``, reusing ``prepared`` (its data and model object) when given.

    Raises:
        ValueError: data too small for the samplers, or a model that does not
            fit ``data.seq_len`` (the fix named).
    """
    data = prepared.data if prepared is not None else build_data(cfg)
    # Samplers before the model: a too-small split fails before the slow part.
    sampler, val_sampler = build_samplers(cfg, data)
    model = prepared.model if prepared is not None else _build_model(cfg, data, device)
    adapter = LlamaAdapter(model, rank=cfg.mecefo.rank, tau=cfg.mecefo.tau)
    layout = GradLayout(model, adapter)
    o = cfg.optim
    optimizer = build_optimizer(model, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    return Job(cfg=cfg, device=device, data=data, sampler=sampler, val_sampler=val_sampler, model=model,
               adapter=adapter, layout=layout, optimizer=optimizer, schedule=schedule_for(cfg))
