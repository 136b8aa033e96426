"""A worker's parts, each built once and handed to the next: nothing is set on a part after it is built.

:func:`assemble` builds, in order: the device; where the worker stands (:class:`~unbroken.sharding.parallelism.
Parallelism`, and under HSDP its replica's world); the job (with its snapshot vote, under
``snapshot.every=auto``); the event log; the snapshotter; the state's layout across ranks; where the state
comes from when the view changes (:class:`~unbroken.runtime.state_source.StateSource`); the step protocol
(the recovery mode's, with its plan, layout, replica collectives, admission word and state source); the
checkpoint schedule. The :class:`~unbroken.runtime.worker.Trainer` receives them as :class:`WorkerParts` and
only trains.

Invariant: the job and the snapshotter name each other (the snapshotter copies the job's state, the job
casts the snapshotter's vote into each gradient buffer); the job's vote is a call resolved when a step runs,
once both are built.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from typing import Any, Callable

import torch

from unbroken.checkpoint.checkpointer import load_checkpoint
from unbroken.checkpoint.schedule import CheckpointSchedule, newest_checkpoint_age_s
from unbroken.checkpoint.sharded import ShardCheckpointer
from unbroken.config import Config, config_hash
from unbroken.job import Job, Prepared, build_job
from unbroken.jsonl import JsonlWriter
from unbroken.mecefo.takeover import takeover_policy
from unbroken.models.factory import bind_device, place_model
from unbroken.runtime.membership import Membership
from unbroken.runtime.param_check import ParamCheck
from unbroken.runtime.protocol import StepProtocol
from unbroken.runtime.recovery import recovery
from unbroken.runtime.snapshot_hooks import job_id, node_map, snapshotter_for
from unbroken.runtime.worker_spec import WorkerSpec
from unbroken.runtime.state_source import StateSource
from unbroken.runtime.stragglers import Stragglers
from unbroken.sharding.layout import StateLayout
from unbroken.sharding.parallelism import Parallelism, parallelism_for
from unbroken.snapshot.cadence import auto as auto_cadence
from unbroken.snapshot.replicas import ReplicaStore
from unbroken.snapshot.snapshotter import Snapshotter

__all__ = ["WorkerParts", "assemble"]

logger = logging.getLogger(__name__)

Event = Callable[..., None]
"""``event(name, **fields)``: one event in the worker's log."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerParts:
    """Everything a worker trains with, built by :func:`assemble`."""

    cfg: Config
    spec: WorkerSpec
    membership: Membership
    parallelism: Parallelism
    job: Job
    config_hash: str
    events: JsonlWriter
    """This worker's ledger and event log (``events/w<id>.jsonl``)."""
    event: Event
    snapshots: Snapshotter | None
    """None: the run takes no snapshots (``snapshot.every`` 0)."""
    layout: StateLayout
    state: StateSource
    protocol: StepProtocol
    schedule: CheckpointSchedule
    shard_checkpoints: ShardCheckpointer | None
    """Workers that write parts of a checkpoint: ZeRO-1's ranges of the moments, HSDP's shards."""


def assemble(cfg: Config, spec: WorkerSpec, membership: Membership, prepared: Prepared | None = None) -> WorkerParts:
    """Build worker ``spec.worker``'s parts (module docstring); ``prepared``: what a warm standby built ahead."""
    store = membership.store
    device = bind_device(cfg.train.device, spec.worker)
    if prepared is not None:
        place_model(prepared.model, device)  # a standby built it on its node's guess
    parallelism = parallelism_for(cfg, spec.world, spec.worker)
    shard, replica = _join_replica(cfg, spec, parallelism, membership, device) if parallelism.hsdp else (None, None)
    snapshots: Snapshotter | None = None

    def vote() -> int:  # the snapshotter's interval proposal, cast into each gradient buffer (resolved per step)
        assert snapshots is not None
        return snapshots.vote()

    job = build_job(cfg, device, prepared, shard=shard, replica=replica, vote=vote if auto_cadence(cfg) else None)
    hash_ = config_hash(cfg)
    if spec.resume is not None:
        load_checkpoint(spec.resume, job.model, job.optimizer, config_hash=hash_)
    events = JsonlWriter(spec.run_dir / "events" / f"w{spec.worker}.jsonl")
    event = functools.partial(_event, events, spec.worker)
    snapshots = snapshotter_for(cfg, spec.run_dir, spec.worker, spec.world, job.model, job.optimizer, device, hash_,
                                event, hsdp=parallelism.replicas, busy=membership.busy)
    layout = parallelism.state_layout(
        job, node_of=node_map(spec.run_dir, spec.world), on_event=event,
        replica_store=lambda: ReplicaStore(job_id(spec.run_dir), node_map(spec.run_dir, spec.world)[spec.worker],
                                           spec.worker))
    state = StateSource(cfg=cfg, run_dir=spec.run_dir, world=spec.world, parallelism=parallelism, job=job,
                        snapshots=snapshots, store=store, layout=layout, events=events, event=event,
                        config_hash=hash_)
    policy = takeover_policy(cfg.mecefo.policy)
    protocol = recovery(cfg.fault.recovery).protocol_class()(
        membership, job, policy=policy, events=events, timeout_s=cfg.train.timeout_s, config_hash=hash_,
        backend=cfg.train.backend, plan=parallelism.plan(policy, n_slots=job.n_slots, micro_batch=job.micro_batch,
                                                          n_workers=job.n_workers),
        layout=layout, replica=_replica_sync(cfg, parallelism, job, device, membership),
        announcer=job.layout,  # admissions announced in the reduction (runtime/view_changes.py)
        state=state, stragglers=_stragglers(cfg, job, event),
        param_check=_param_check(cfg, job, membership, event, parallelism))
    if snapshots is not None:
        # Before this step's reduction completes, the last step's snapshot is consistent: with a fixed
        # interval sealed (a commit of step s+1 means every member sealed its share of step s, the restore
        # point); under auto staged (copied off the live state), its write going on while steps run.
        protocol.on("allreduce", functools.partial(_fence, snapshots))
    t = cfg.train  # a sharded run checkpoints by steps only: its members must agree on the step
    schedule = CheckpointSchedule(every=t.checkpoint_every, steps=t.steps,
                                  every_s=0.0 if parallelism.checkpoints_by_steps else t.checkpoint_every_s,
                                  age_s=newest_checkpoint_age_s(spec.run_dir) if spec.join else 0.0)
    shard_checkpoints = (ShardCheckpointer(spec.run_dir, on_skip=functools.partial(event, "checkpoint_skipped",
                                                                                   what="part"))
                         if parallelism.writes_parts else None)
    return WorkerParts(cfg=cfg, spec=spec, membership=membership, parallelism=parallelism, job=job,
                       config_hash=hash_, events=events, event=event, snapshots=snapshots, layout=layout,
                       state=state, protocol=protocol, schedule=schedule, shard_checkpoints=shard_checkpoints)


def _event(events: JsonlWriter, worker: int, event: str, **fields: Any) -> None:
    events.write({"kind": "event", "event": event, "worker": worker, "t": time.time(), **fields})


def _fence(snapshots: Snapshotter, step: int) -> None:
    snapshots.fence()


def _join_replica(cfg: Config, spec: WorkerSpec, parallelism: Parallelism, membership: Membership,
                  device: torch.device) -> tuple[Callable[[torch.nn.Module], object], Any]:
    """HSDP: form this worker's replica world (its ``k`` ranks, FSDP2's collectives); returns how the model
    is sharded over it, and its process group."""
    from unbroken.sharding.hsdp import join_replica, shard_model

    t0 = time.perf_counter()
    mesh = join_replica(membership.store.backend.group_store("hsdp"), replica=parallelism.replica,
                        incarnation=spec.replica_incarnation, index=parallelism.index,
                        shard_degree=parallelism.shard_degree, device=device, timeout_s=cfg.train.timeout_s)
    logger.info("replica %d (incarnation %s) formed in %.2f s: this worker is its shard %d of %d",
                parallelism.replica, spec.replica_incarnation, time.perf_counter() - t0, parallelism.index,
                parallelism.shard_degree)
    parallelize = None
    if cfg.model.parallelize:
        from unbroken.job.references import resolve

        parallelize = resolve(cfg.model.parallelize, field="model.parallelize")
    return (lambda model: shard_model(model, mesh, parallelize)), mesh.get_group()


def _replica_sync(cfg: Config, parallelism: Parallelism, job: Job, device: torch.device,
                  membership: Membership) -> Any:
    """HSDP: the step protocol's collectives over this worker's replica (None otherwise)."""
    if not parallelism.hsdp:
        return None
    from unbroken.sharding.hsdp import ReplicaSync

    return ReplicaSync(job.replica, parallelism.shard_degree, device, cfg.train.timeout_s, waiting=membership.advance)


def _param_check(cfg: Config, job: Job, membership: Membership, event: Callable[..., None],
                 parallelism: Parallelism) -> ParamCheck | None:
    """The replicas' parameter checksums compared in each reduction (``fault.param_check_every``; the job's
    buffers carry them), or None: off. Under HSDP each rank checksums its own shards."""
    if not cfg.param_check_interval or not job.layout.n_checksums:
        return None
    return ParamCheck(membership, job.layout, job.layout.params, every=cfg.param_check_interval, event=event,
                      replicas=parallelism.replicas if parallelism.hsdp else None,
                      repairs=not parallelism.hsdp and not parallelism.zero1)


def _stragglers(cfg: Config, job: Job, event: Callable[..., None]) -> Stragglers | None:
    """The straggler decision (``fault.straggler_factor``; the job's buffers carry the timings), or None: off."""
    f = cfg.fault
    if not f.straggler_factor or not job.layout.n_timings:
        return None
    return Stragglers(n_workers=job.n_workers, n_slots=job.n_slots, micro_batch=job.micro_batch,
                      factor=f.straggler_factor, steps=f.straggler_steps, on_event=event, buffers=job.layout,
                      replace_s=f.straggler_replace_s)
