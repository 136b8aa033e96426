"""A worker process's two lives: train as worker ``w`` (:func:`run`), or wait as a warm standby of its node
until handed a worker id (:func:`standby`, then :func:`run` with what it prepared).

Started through :mod:`unbroken.agent.worker_process`; the training itself is :class:`~unbroken.runtime.worker.Trainer`.
:func:`run` turns how a worker ended into the process's exit code (:mod:`unbroken.runtime.worker`'s table) and
writes its report, ``RUN/workers/w<id>.json``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from unbroken.config import Config, config_from_dict, config_hash
from unbroken.job import Prepared, prepare
from unbroken.job.compilation import Compilation, compile_ahead
from unbroken.job.compile_cache import CACHE_FILE
from unbroken.job.consistency import InconsistentJob
from unbroken.job.parallelize import compile_stats
from unbroken.jsonl import JsonlWriter
from unbroken.mecefo.adapter import LlamaAdapter
from unbroken.mecefo.warm_up import takeover_rows, warm_up
from unbroken.models.factory import bind_device
from unbroken.runtime.held_memory import HELD_ENV, HeldMemory
from unbroken.store.job_store import JobStore
from unbroken.runtime.membership import (EXIT_FENCED, EXIT_REJOIN, SHARD_LOST, Fenced, Membership, MissedCommit,
                                         NoLiveWorker)
from unbroken.runtime.nonfinite import NonFiniteStop
from unbroken.runtime.param_check import ParamMismatchStop
from unbroken.runtime.start_phases import StartClock
from unbroken.store.backend import job_secret
from unbroken.runtime.worker import (EXIT_NO_LIVE_WORKER, EXIT_REFUSED, EXIT_STORE_LOST, JoinRefused, Trainer,
                                     WorkerSpec)
from unbroken.sharding.parallelism import kind_of
from unbroken.sharding.state import ShardLost
from unbroken.state.training_state import StateNotCapturable

__all__ = ["Assignment", "load_run_config", "read_run_config", "run", "standby"]

logger = logging.getLogger(__name__)

NO_LIVE_WORKER = "no live worker"
"""The ``how`` of the mark a worker leaves on itself when nobody is left to hand it the state (a joiner whose
view's holders all died) or its own replica left the view: the job is restored, not failed, by the agents."""


def read_run_config(run_dir: Path) -> Config:
    """The run's config, nothing else done (the node's template reads it so: it must stay one thread)."""
    return config_from_dict(json.loads((run_dir / "config.json").read_text()))


def load_run_config(run_dir: Path, world: int) -> Config:
    """The run's config, and this worker's intra-op threads set from it (a worker's share of the cores). Setting
    more than one starts torch's thread pool: only in a process that will not fork."""
    cfg = read_run_config(run_dir)
    torch.set_num_threads(cfg.train.threads_per_worker or max(1, (os.cpu_count() or 1) // world))
    return cfg


def run(spec: WorkerSpec, *, store: JobStore | None = None, prepared: Prepared | None = None,
        setup: Callable[[Trainer], None] | None = None, clock: StartClock | None = None,
        compilation: Compilation | None = None) -> int:
    """Run one worker to completion; returns the process exit code.

    Args:
        store: an open connection to the job store (a standby has one already).
        prepared: data and model a warm standby built before it knew its worker id.
        compilation: what a warm standby compiled ahead (its :class:`~unbroken.job.compilation.Compilation`).
        setup: called with the trainer before it starts (the entry point installs
            fault hooks and the log context there).
        clock: the start's phase clock (a cold start's; :mod:`unbroken.runtime.start_phases`), written
            as a ``start_phases`` event once the worker is admitted.
    """
    cfg = load_run_config(spec.run_dir, spec.world)
    mark = clock.mark if clock is not None else (lambda phase: None)
    mark("config")
    secret = job_secret(spec.run_dir)
    def connect() -> JobStore:
        return JobStore.connect(spec.store, timeout_s=cfg.train.timeout_s, secret=secret,
                                store_timeout_s=cfg.fault.store_timeout_s)

    store = store or connect()
    store.set_store_timeout(cfg.fault.store_timeout_s)  # a standby's connection too
    membership = Membership(store, spec.worker, heartbeat_timeout_s=cfg.fault.heartbeat_timeout_s,
                            progress_timeout_s=cfg.fault.progress_timeout_s,
                            heartbeat_store=connect())
    membership.start_heartbeat()
    mark("store")
    trainer = Trainer.assemble(cfg, spec, membership, prepared)
    mark("job")
    compilation = _compilation(trainer, compilation, secret)
    if compilation is not None:
        mark("compile_cache")
        if _warm_approximations(trainer) is not None:
            mark("approx_compile")
    if setup is not None:
        setup(trainer)
    held = HeldMemory(trainer).install() if os.environ.get(HELD_ENV) else None
    try:
        first = trainer.start()
        if clock is not None:
            mark("admission")
            trainer.event("start_phases", join=spec.join, step=first, pid=os.getpid(), **clock.summary())
        last = trainer.train(first)
    except MissedCommit as exc:
        logger.warning("leaving to rejoin: %s", exc)
        return EXIT_REJOIN
    except Fenced as exc:
        logger.error("fenced: %s", exc)
        return EXIT_FENCED
    except NoLiveWorker as exc:
        # Nobody is left to hand the state over (or this worker left the view with its replica): it leaves
        # marked dead, as for a lost shard below. Once every member of the view is, the agents restore the job
        # from snapshot memory or the checkpoint, or stop it if neither holds anything.
        logger.error("%s; leaving for the job to be restored", exc)
        store.mark_dead(spec.worker, json.dumps({"by": spec.worker, "how": NO_LIVE_WORKER, "detail": str(exc),
                                                 "t": time.time()}))
        return EXIT_NO_LIVE_WORKER
    except ShardLost as exc:
        # Every member of the view finds the same shard lost and leaves so: once all did, the agents restore
        # the job from snapshot memory (or stop it if memory holds nothing newer than the checkpoint).
        logger.error("%s; leaving for the job to be restored from snapshot memory", exc)
        store.mark_dead(spec.worker, json.dumps({"by": spec.worker, "how": SHARD_LOST, "error": str(exc),
                                                 "t": time.time()}))
        return EXIT_NO_LIVE_WORKER
    except JoinRefused as exc:
        logger.error("join refused: %s", exc)
        return EXIT_REFUSED
    except InconsistentJob as exc:
        logger.error("%s", exc)
        store.fail(str(exc))
        return EXIT_REFUSED
    except (NonFiniteStop, ParamMismatchStop) as exc:  # every member stops alike; the first to record it says why
        store.fail(f"stopped: {exc}")
        return EXIT_REFUSED
    except StateNotCapturable as exc:  # the launcher's JobFailed says "the job stopped: ..."
        logger.error("%s", exc)
        store.fail(f"stopped: the optimizer's state cannot be snapshotted, checkpointed or handed over: {exc}")
        return EXIT_REFUSED
    except dist.DistStoreError as exc:  # no answer for fault.store_timeout_s: the job stops (its agent says so)
        logger.error("lost the job store %s: %s", spec.store, str(exc).splitlines()[0])
        return EXIT_STORE_LOST
    finally:
        membership.stop()
    _write_report(spec, cfg, trainer, last, compilation, held)
    return 0


def _compilation(trainer: Trainer, compilation: Compilation | None, secret: str) -> Compilation | None:
    """Under ``train.compile``: the job's compile cache loaded before the first step (unless a standby compiled
    ahead), and after each step the view's leader writes it when it built graphs the cache lacks (its first
    step's, when it compiled from scratch). The first step's ``compiled`` event says what this process compiled
    and how long it took (``graphs``: the graphs dynamo captured so far, the approximate path's warm-up's too)."""
    if compilation is None:
        compilation = Compilation.of(trainer.cfg, trainer.job.device)
        if compilation is None:
            return None
    compilation.moved_to(trainer.job.device)
    if not compilation.cache["loaded"] and compilation.ahead is None:
        compilation.load(trainer.spec.run_dir, secret=secret, config_hash=trainer.hash)
    told = False

    def after_step(step: int) -> None:
        nonlocal told
        if trainer.protocol.view.leader == trainer.spec.worker and compilation.should_write():
            with trainer.m.busy():  # (save never raises: a cache not written leaves later processes compiling)
                written = compilation.save(trainer.spec.run_dir, secret=secret, config_hash=trainer.hash,
                                           writer={"worker": trainer.spec.worker, "pid": os.getpid(), "step": step})
            if written is not None:
                trainer.event("compile_cache_written", step=step, **written)
        if not told:
            told = True
            trainer.event("compiled", step=step, pid=os.getpid(), graphs=compile_stats().get("graphs", 0),
                          **compilation.stats())

    trainer.protocol.on("confirm", after_step)
    return compilation


def _warm_approximations(trainer: Trainer) -> dict[str, Any] | None:
    """A compiling job whose policy approximates compiles its approximate graphs before the first step, not in a
    takeover (:func:`~unbroken.mecefo.warm_up.warm_up`; the ``approx_warmed_up`` event says what it took).
    HSDP: not warmed (its forward and backward are its replica's collectives)."""
    job, me = trainer.job, trainer.spec.worker
    if job.replica is not None or not isinstance(job.adapter, LlamaAdapter):
        return None
    rows = takeover_rows(functools.partial(trainer.protocol.plan.assign, me), me, trainer.spec.world)
    with trainer.m.busy():
        done = warm_up(job.adapter, job.layout, rows, micro_batch=job.micro_batch, batch_fn=job.sampler.batch,
                       device=job.device, precision=trainer.cfg.train.precision, loss_fn=job.loss_fn)
    if done is not None:
        trainer.event("approx_warmed_up", **done)
    return done


def _write_report(spec: WorkerSpec, cfg: Config, trainer: Trainer, last: dict[str, Any],
                  compilation: Compilation | None, held: HeldMemory | None = None) -> None:
    """The finished worker's report (``workers/w<id>.json``), read by the launcher's summary."""
    report = {"worker": spec.worker, "steps": cfg.train.steps, "param_digest": trainer.param_digest(),
              "shard_index": trainer.parallelism.index,
              "last": last, "gen": trainer.protocol.view.gen,
              "snapshots": trainer.snapshots.summary() if trainer.snapshots is not None else {},
              "sharded": trainer.protocol.layout.summary(),
              "peak_memory_bytes": torch.cuda.max_memory_allocated(trainer.job.device)
              if trainer.job.device.type == "cuda" else None,
              "device_bytes": trainer.device_bytes(),
              "held_at_backward": held.result if held is not None else None,
              "store": {"steps": trainer.steps_trained, "main": trainer.store.usage(),
                        "heartbeat": trainer.m.heartbeat_store.usage()},
              "compile": compilation.stats() if compilation is not None else None, **compile_stats()}
    out = spec.run_dir / "workers" / f"w{spec.worker}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out)


@dataclasses.dataclass(frozen=True, kw_only=True)
class Assignment:
    """What a warm standby is handed: the worker it becomes, with what it already holds."""

    spec: WorkerSpec
    store: JobStore
    prepared: Prepared
    faults: str
    """The indices of the fault plan's specs this worker carries out (``"3,7"``; ``""`` for none)."""
    compilation: Compilation | None = None
    """What it compiled ahead (None: the job does not compile)."""


CACHE_POLL_S = 0.1
"""How often a standby of a compiling job looks for the job's compile cache before it compiles ahead."""
STANDBY_POLL_S = 0.02
"""How often a waiting standby looks for an offer: a handover waits at most this long for its claim. The
job's end is checked once per heartbeat, so a waiting standby sends the store about 80 requests a second
(at a 5 ms poll with the end checked every time, about 700: an HTTP request each on an etcd store)."""


def standby(run_dir: Path, world: int, store_addr: str, node: int, prepared: Prepared | None = None,
            forked: bool = False) -> Assignment | None:
    """Be a warm standby of ``node``: prepare, announce, wait to be handed a worker id.

    Contract (see :mod:`unbroken.agent._standby`): announce the pid once warm,
    beat the node's standby counter every heartbeat interval while waiting (a
    standby that stops is replaced by its agent), claim an offer by
    compare-and-set, read the fault indices handed with it. Returns None when
    the job ends first. Under ``train.compile`` it compiles ahead before it announces itself
    (:func:`_compile_ahead`). Once warm it records ``standby_ready`` with the CPU
    seconds its start took (``events/standby<node>.jsonl``; a standby ``forked`` from the node's template
    spent little: the template's ``template_ready`` holds the CPU seconds of the imports) and what it compiled.
    """
    from unbroken.runtime.membership import HEARTBEAT_INTERVAL_S

    cfg = load_run_config(run_dir, world)
    store = JobStore.connect(store_addr, timeout_s=cfg.train.timeout_s, secret=job_secret(run_dir),
                             store_timeout_s=cfg.fault.store_timeout_s)
    device = bind_device(cfg.train.device, node)
    prepared = prepared or prepare(cfg, device)  # or the template's
    compilation = _compile_ahead(run_dir, cfg, store, prepared, device)
    store.standby_beat(node)  # before the announcement: the agent judges a ready standby by its beats
    store.standby_announce(node, os.getpid())
    # What its start cost the machine (the goodput check charges it to the job when the cores are shared).
    events = JsonlWriter(run_dir / "events" / f"standby{node}.jsonl")
    events.write({"kind": "event", "event": "standby_ready", "node": node, "pid": os.getpid(),
                  "cpu_s": round(time.process_time(), 3), "forked": forked,
                  "compile": compilation.stats() if compilation is not None else None})
    events.close()
    next_beat = time.monotonic() + HEARTBEAT_INTERVAL_S
    while True:
        if (now := time.monotonic()) >= next_beat:
            next_beat = now + HEARTBEAT_INTERVAL_S
            if store.finished():
                return None
            store.standby_beat(node)
        got = store.standby_claim(node, os.getpid())
        if got is not None:
            worker, faults, restore_gen = got
            logger.info("standby of node %d becomes worker %d", node, worker)
            spec = WorkerSpec(run_dir=run_dir, worker=worker, world=world, store=store_addr, join=True,
                              restore_gen=restore_gen)
            return Assignment(spec=spec, store=store, prepared=prepared, faults=faults, compilation=compilation)
        time.sleep(STANDBY_POLL_S)


def _compile_ahead(run_dir: Path, cfg: Config, store: JobStore, prepared: Prepared,
                   device: torch.device) -> Compilation | None:
    """A standby of a compiling job waits for the job's compile cache (at most half its start-up deadline,
    ``train.timeout_s``), loads it and compiles ahead on its own device, so the step it takes over with compiles
    nothing. Without a usable cache it compiles nothing here (a compile from scratch could outlast the deadline):
    it then loads the cache, or compiles, when it takes over. None: the job does not compile."""
    compilation = Compilation.of(cfg, device)
    if compilation is None or kind_of(cfg) == "hsdp":  # HSDP: the model compiles sharded, in the trainer
        return compilation
    deadline, path = time.monotonic() + cfg.train.timeout_s / 2, run_dir / CACHE_FILE
    while not path.exists() and time.monotonic() < deadline and not store.finished():
        time.sleep(CACHE_POLL_S)
    if compilation.load(run_dir, secret=job_secret(run_dir), config_hash=config_hash(cfg))["loaded"]:
        try:
            done = compile_ahead(cfg, prepared, device, compilation)
        except Exception as exc:  # the standby still serves: it compiles when it takes over, as without a cache
            logger.warning("compiling ahead failed (%s: %s): compiling when taking over", type(exc).__name__, exc)
            compilation.ahead_failed(exc)
        else:
            logger.info("compiled ahead: %d frames in %.2f s", done["frames"], done["seconds"])
    else:
        logger.info("no usable compile cache of the job (%s): compiling when taking over", compilation.cache["why"])
    return compilation
