"""The one builder of a training job: config → data, samplers, model, adapter, optimizer, schedule
(:mod:`unbroken.job.schedule`).

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

Each part is ours or the user's: ``data.factory`` replaces the corpus and its
samplers, ``model.family`` picks our LLaMA, Hugging Face's
``LlamaForCausalLM`` (``hf-llama``) or ``model.factory`` (``custom``), and
``optim.factory`` replaces AdamW (:mod:`unbroken.job.user_parts`). A model
without LLaMA blocks gets an exact-only adapter, which a policy that
approximates refuses at build time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable

import torch

from unbroken.config import Config
from unbroken.data import PreparedData, prepare_data
from unbroken.data import BatchSampler
from unbroken.data.blend import BlendSampler, training_sampler
from unbroken.job.user_parts import BuildContext, CheckedSource, user_data, user_model, user_optimizer
from unbroken.mecefo.adapter import ExactOnlyAdapter, LlamaAdapter, adapter_for
from unbroken.job.parallelize import parallelize, resolve_compile
from unbroken.job.schedule import Schedule, schedule_for
from unbroken.mecefo.gradients import GradLayout, LossFn, SlotWork, apply_step, compute_gradient_sums, token_loss_sum
from unbroken.mecefo.takeover import takeover_policy
from unbroken.models import build_model, model_args, validation_loss
from unbroken.models.optim import build_optimizer
from unbroken.models.precision import check_precision
from unbroken.snapshot.cadence import VOTE_SLOTS, cast
from unbroken.snapshot.cadence import auto as auto_cadence

logger = logging.getLogger(__name__)

TrainData = PreparedData | CheckedSource
"""Our prepared corpus, or the user's source (``data.factory``)."""


def check_model_fits(cfg: Config) -> None:
    """Check ``data.seq_len`` against the model's ``max_seq_len`` without building the model.

    Raises:
        ValueError: ``data.seq_len`` is longer than the model allows (names both values and the fix).
    """
    if cfg.model.family == "custom":
        return  # the user's model: its own business
    overrides = {"max_seq_len": cfg.model.max_seq_len} if cfg.model.max_seq_len else {}
    margs = model_args(cfg.model.preset, **overrides)
    if cfg.data.seq_len > margs.max_seq_len:
        raise ValueError(
            f"data.seq_len={cfg.data.seq_len} is longer than model {cfg.model.preset!r} allows "
            f"(max_seq_len={margs.max_seq_len}); lower data.seq_len or raise model.max_seq_len"
        )


def build_data(cfg: Config, device: torch.device | None = None) -> TrainData:
    """Tokenizer and token streams of the ``data`` section (prepared once, then loaded from the cache),
    or the source ``data.factory`` returns."""
    if cfg.data.factory:
        return user_data(cfg, device or torch.device("cpu"))
    d = cfg.data
    return prepare_data(source=d.source, vocab_size=d.vocab_size, val_fraction=d.val_fraction,
                        cache_dir=d.cache_dir, token_dtype=d.token_dtype, max_bytes=d.max_bytes,
                        tokenizer=d.tokenizer or None)


def build_samplers(cfg: Config, data: TrainData) -> tuple[Any, Any]:
    """The training sampler (:attr:`Config.n_slots` slots) and the validation sampler (one slot; None: no validation).

    A user's source is its own training sampler; its validation sampler is its
    ``validation_batch`` when it has one.

    Raises:
        ValueError: a split holds fewer windows than one global batch (training)
            or one micro-batch (validation: raise ``data.val_fraction``).
    """
    if isinstance(data, CheckedSource):
        return data, (_Validation(data) if data.has_validation else None)
    d, seed = cfg.data, cfg.train.seed
    train = training_sampler(data.train, seed=seed, n_slots=cfg.n_slots, micro_batch=d.micro_batch,
                         seq_len=d.seq_len)
    try:
        val = training_sampler(data.val, seed=seed, n_slots=1, micro_batch=d.micro_batch, seq_len=d.seq_len)
    except ValueError as exc:
        raise ValueError(f"validation split too small for one micro-batch: {exc}; raise data.val_fraction") from None
    return train, val


def check_model_parts(cfg: Config, data: TrainData) -> None:
    """What can be checked of the model before any worker starts (preflight).

    A ``hf_path`` directory is checked without loading its weights; a user's
    model is built once on the CPU, so that a factory that fails, or a model
    without LLaMA blocks under a policy that approximates, is reported before
    anything is written.

    Also says, in one logged line, what sets the run's learning rate (the job's schedule, or the optimizer
    of ``optim.factory`` itself).

    Raises:
        ValueError: naming the field, the value and the fix.
    """
    logger.info("%s", schedule_for(cfg).describe())
    m = cfg.model
    if m.family == "hf-llama":
        from unbroken.models.hf_llama import check_hf_dir, require_transformers  # optional dependency

        require_transformers()
        if m.hf_path is None:
            return
        if data.vocab_size is None:
            raise ValueError("model.family='hf-llama' needs the data's vocabulary; give the data source a "
                             "vocab_size attribute")
        check_hf_dir(m.hf_path, vocab_size=data.vocab_size, seq_len=cfg.data.seq_len)
    elif m.family == "custom":
        model = _build_model(cfg, data, torch.device("cpu"))
        adapter_for(model, rank=cfg.mecefo.rank, tau=cfg.mecefo.tau,
                    approximates=takeover_policy(cfg.mecefo.policy).approximates, policy=cfg.mecefo.policy)


class _Validation:
    """A user's ``validation_batch(index)`` as a one-slot sampler."""

    def __init__(self, source: CheckedSource) -> None:
        self.source = source

    def batch(self, index: int, slot: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        return self.source.validation_batch(index)


def data_info(data: TrainData) -> dict[str, int]:
    """``vocab_size``, ``train_tokens`` and ``val_tokens`` of prepared data (as preflight and summaries report);
    a user's source reports its ``vocab_size`` only (when it states one)."""
    if isinstance(data, CheckedSource):
        return {"vocab_size": data.vocab_size} if data.vocab_size else {}
    return {"vocab_size": data.vocab_size, "train_tokens": int(len(data.train)), "val_tokens": int(len(data.val))}


@dataclass(kw_only=True)
class Prepared:
    """What a warm standby builds before it knows which worker it will be."""

    data: TrainData
    model: torch.nn.Module


def prepare(cfg: Config, device: torch.device) -> Prepared:
    """Load the data and build the model: the slow part of a worker's start besides imports."""
    data = build_data(cfg, device)
    return Prepared(data=data, model=_build_model(cfg, data, device))


def _build_model(cfg: Config, data: TrainData, device: torch.device) -> torch.nn.Module:
    """The model of ``model.family`` (see the module docstring)."""
    m, vocab = cfg.model, data.vocab_size
    if m.family == "custom":
        return user_model(cfg, BuildContext(cfg=cfg, device=device, seed=cfg.train.seed, vocab_size=vocab))
    if vocab is None:
        raise ValueError(f"model.family={m.family!r} needs the data's vocabulary; give the data source a "
                         "vocab_size attribute")
    if m.family == "hf-llama":
        from unbroken.models.hf_llama import build_hf_llama, load_hf_llama  # optional dependency

        if m.hf_path is not None:
            return load_hf_llama(m.hf_path, vocab_size=vocab, seq_len=cfg.data.seq_len, device=device)
        overrides: dict[str, object] = {"vocab_size": vocab}
        if m.max_seq_len is not None:
            overrides["max_seq_len"] = m.max_seq_len
        return build_hf_llama(model_args(m.preset, **overrides), seed=cfg.train.seed, device=device)
    model = build_model(m.preset, vocab_size=vocab, seq_len=cfg.data.seq_len,
                        max_seq_len=m.max_seq_len, seed=cfg.train.seed, device=device)
    if m.init_from is not None:
        from unbroken.models.hf_import import load_hf_weights

        load_hf_weights(model, m.init_from)
    return model


@dataclass(kw_only=True)
class Job:
    """Everything one worker (or the simulator) trains with."""

    cfg: Config
    device: torch.device
    data: TrainData
    sampler: BatchSampler | BlendSampler | CheckedSource
    val_sampler: Any
    """A one-slot sampler of validation batches; None: the data has no validation split."""
    model: torch.nn.Module
    adapter: LlamaAdapter | ExactOnlyAdapter
    layout: GradLayout
    optimizer: torch.optim.Optimizer
    schedule: Schedule
    loss_fn: LossFn = token_loss_sum
    """The summed token cross-entropy (compiled with the blocks under ``train.compile``)."""
    replica: Any = None
    """HSDP: the replica's process group (its ranks' FSDP2 world); each buffer's weights, loss and token
    count are summed over it, so a rank's buffer speaks for its whole replica (its gradient shards already
    do: FSDP2 reduce-scatters sums)."""
    vote: Callable[[], int] | None = None
    """This worker's snapshot interval proposal, cast into each gradient buffer's vote slots
    (``snapshot.every=auto``, :mod:`unbroken.snapshot.cadence`): the worker's snapshotter's."""

    @property
    def info(self) -> dict[str, int]:
        """See :func:`data_info`."""
        return data_info(self.data)

    @property
    def n_slots(self) -> int:
        """Micro-batches per step (the global batch over ``data.micro_batch``)."""
        return self.cfg.n_slots

    @property
    def n_workers(self) -> int:
        """The job's workers (ids ``0 .. n_workers - 1``)."""
        return self.cfg.train.workers

    @property
    def micro_batch(self) -> int:
        return self.cfg.data.micro_batch

    def gradient_sums(self, step: int, items: list[SlotWork]) -> torch.Tensor:
        """One worker's gradient sums of ``items`` of ``step`` (:func:`~unbroken.mecefo.gradients.compute_gradient_sums`)."""
        return compute_gradient_sums(self.model, self.adapter, self.layout, items, step=step,
                                     micro_batch=self.micro_batch, batch_fn=self.sampler.batch, device=self.device,
                                     precision=self.cfg.train.precision, loss_fn=self.loss_fn,
                                     scalars_done=self._scalars_done)

    def _scalars_done(self, buf: torch.Tensor) -> Callable[[], object] | None:
        """A buffer's scalars are final: cast this worker's snapshot vote; HSDP: sum them over the replica, in
        the background while the last backward pass runs (every rank of the replica posts it at the same
        point among FSDP2's collectives)."""
        if self.vote is not None and self.layout.n_votes:
            cast(self.layout.votes(buf), self.vote())
        if self.replica is None:
            return None
        import torch.distributed as dist

        return dist.all_reduce(buf[self.layout.n_grad:], group=self.replica, async_op=True).wait

    def _reshard(self) -> None:
        """HSDP: FSDP2 leaves the root's whole parameters registered after a forward pass without backward
        (validation): the model holds its shards again, the optimizer's and the state's tensors."""
        from torch.distributed.fsdp import FSDPModule

        for unit in self.model.modules():
            if isinstance(unit, FSDPModule):
                unit.reshard()

    def apply(self, step: int, reduced: torch.Tensor) -> tuple[float, float]:
        """Apply the reduced buffer of ``step`` (schedule's lr, clipping, AdamW); returns (lr, grad norm).

        Under schedule ``none`` the optimizer's own rate stays, and the first group's is the one returned."""
        lr = self.schedule(step) if self.schedule.sets_lr else None
        norm = apply_step(self.layout, reduced, self.optimizer, lr=lr, grad_clip=self.cfg.optim.grad_clip)
        return (lr if lr is not None else float(self.optimizer.param_groups[0]["lr"])), norm

    def loss(self, reduced: torch.Tensor) -> float:
        """The step's token-mean training loss, from a reduced buffer."""
        return self.layout.loss_sum(reduced) / self.layout.token_count(reduced)

    def validation_loss(self) -> float:
        """Token-mean loss of the first ``train.val_batches`` validation micro-batches (nan without validation data)."""
        if self.val_sampler is None:
            return float("nan")
        loss = validation_loss(self.model, self.val_sampler.batch, self.cfg.train.val_batches, self.device,
                               self.cfg.train.precision)
        if self.replica is not None:
            self._reshard()
        return loss


def build_job(cfg: Config, device: torch.device, prepared: Prepared | None = None,
              shard: Callable[[torch.nn.Module], object] | None = None, replica: Any = None,
              vote: Callable[[], int] | None = None) -> Job:
    """Build the job of ``cfg`` on ``device``, reusing ``prepared`` (its data and model object) when given.
    HSDP: ``shard`` shards the model over its replica, ``replica`` is the replica's group (:attr:`Job.replica`);
    ``vote``: this worker's snapshot interval proposal (:attr:`Job.vote`).

    Raises:
        ValueError: data too small for the samplers, a model that does not
            fit ``data.seq_len``, bf16 on a GPU without it, or a model without
            LLaMA blocks under a policy that approximates (the fix named).
    """
    check_precision(cfg.train.precision, device)
    data = prepared.data if prepared is not None else build_data(cfg, device)
    # Samplers before the model: a too-small split fails before the slow part.
    sampler, val_sampler = build_samplers(cfg, data)
    model = prepared.model if prepared is not None else _build_model(cfg, data, device)
    compiled = resolve_compile(cfg.train.compile, device)
    parallelize(model, compile=compiled, activation_checkpointing=cfg.train.activation_checkpointing)
    if shard is not None:  # HSDP: FSDP2 over the replica's mesh, after compile and checkpointing (torchtitan's order)
        shard(model)
    m = cfg.mecefo
    adapter = adapter_for(model, rank=m.rank, tau=m.tau, approximates=takeover_policy(m.policy).approximates,
                          policy=m.policy)
    layout = GradLayout(model, adapter, votes=VOTE_SLOTS if auto_cadence(cfg) else 0,
                        timings=cfg.train.workers if cfg.fault.straggler_factor and shard is None else 0,
                        checksums=2 * cfg.train.workers if cfg.param_check_interval else 0)
    o = cfg.optim
    if o.factory:
        optimizer = user_optimizer(cfg, model, BuildContext(cfg=cfg, device=device, seed=cfg.train.seed,
                                                             vocab_size=data.vocab_size))
    elif cfg.train.shard_optimizer:
        from unbroken.sharding.adamw import ShardedAdamW

        optimizer = ShardedAdamW(model, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    else:
        optimizer = build_optimizer(model, lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                    weight_decay=o.weight_decay, fused=device.type == "cuda")
    return Job(cfg=cfg, device=device, data=data, sampler=sampler, val_sampler=val_sampler, model=model,
               adapter=adapter, layout=layout, optimizer=optimizer, schedule=schedule_for(cfg),
               loss_fn=torch.compile(token_loss_sum) if compiled else token_loss_sum, replica=replica, vote=vote)
