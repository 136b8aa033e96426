"""One training process: runs the step protocol, writes metrics and checkpoints.

Its parts (the job, where it stands, the step protocol, snapshots, checkpoints) are built once by
:func:`unbroken.runtime.assembly.assemble`; the :class:`Trainer` receives them and only trains. Started by an agent through :mod:`unbroken.agent.worker_process`. Worker ``w``
owns slot ``w``; each step it computes the items the step protocol assigns
(its own slot, or more while peers are down), the protocol reduces and commits
them across the live workers, and every member applies the same reduced
gradient, so parameters stay identical everywhere.

A worker started with ``--join`` (a restart or a replacement) asks to join,
is admitted at a step boundary and receives the full training state from a
live peer before it trains.

Exit codes: 0 done, 3 fenced (declared dead by the others), 4 no live worker
left, 5 join refused (another config than the job's), 1 any other error.

Invariants: every member holds bitwise-identical parameters after every step;
the view's first member writes metrics, progress and checkpoints; a preemption stops
every member after the same step, learnt from that step's reduction (only the leader
reads the stop keys: :meth:`~unbroken.runtime.view_changes.ViewChanges.announce`).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch

from unbroken.checkpoint.checkpointer import AsyncCheckpointer, training_state
from unbroken.checkpoint.files import COMMIT_FILE, checkpoint_dir
from unbroken.checkpoint.schedule import Due
from unbroken.checkpoint.sharded import ShardCheckpointer
from unbroken.config import Config
from unbroken.job import MetricsWriter, Prepared, train_record
from unbroken.job.consistency import LayoutMismatch, check_consistency
from unbroken.mecefo.takeover import degraded_homes
from unbroken.runtime.assembly import WorkerParts, assemble
from unbroken.runtime.digest import param_digest
from unbroken.runtime.membership import Fenced, Membership, NoLiveWorker, View, ViewChanged
from unbroken.runtime.process_group import CollectiveFailed
from unbroken.runtime.protocol import MemberDied
from unbroken.runtime.start_phases import process_age_s
from unbroken.runtime.worker_spec import WorkerSpec
from unbroken.state.parts import local_of
from unbroken.state.training_state import check_capturable, layout_of
from unbroken.store.latency import LatencyReport

__all__ = ["EXIT_NO_LIVE_WORKER", "EXIT_REFUSED", "EXIT_STORE_LOST", "JoinRefused", "StepLogContext", "Trainer",
           "WorkerSpec"]

logger = logging.getLogger(__name__)

EXIT_NO_LIVE_WORKER = 4
EXIT_REFUSED = 5
EXIT_STORE_LOST = 6
"""The job store did not answer for ``fault.store_timeout_s``."""
JOIN_POLL_S = 0.01


class JoinRefused(RuntimeError):
    """The job's leader turned this worker's join request down (the message says why)."""


class StepLogContext(logging.Filter):
    """Gives every log record ``where``: who logs, at which generation and step (``w3 g7 step 412``)."""

    def __init__(self, who: str) -> None:
        super().__init__()
        self.who = who
        self.trainer: Trainer | None = None  # the records before it is built say "starting"

    def follow(self, trainer: Trainer) -> None:
        """From now on, say where ``trainer`` stands."""
        self.trainer = trainer

    def filter(self, record: logging.LogRecord) -> bool:
        where = self.trainer.protocol.where() if self.trainer is not None else None
        record.where = f"{self.who} starting" if where is None else f"{self.who} g{where[0]} step {where[1]}"
        return True


class Trainer:
    """The job of one worker (:class:`unbroken.job.Job`), its step protocol, and the leader's duties.

    One step in a straight line (:meth:`train`): ``protocol.run_step`` (assign,
    compute, ledger, all-reduce, vote) → ``job.apply`` (optimizer step) →
    commit record → leader's metrics and checkpoints → admissions.

    Args:
        parts: everything it trains with (:func:`~unbroken.runtime.assembly.assemble`; :meth:`assemble` builds
            them and the trainer at once).
    """

    def __init__(self, parts: WorkerParts) -> None:
        self.parts = parts
        self.cfg, self.spec, self.m = parts.cfg, parts.spec, parts.membership
        self.store = parts.membership.store
        self.parallelism, self.job, self.hash = parts.parallelism, parts.job, parts.config_hash
        self.events, self.snapshots, self.protocol = parts.events, parts.snapshots, parts.protocol
        self.schedule, self.shard_checkpoints = parts.schedule, parts.shard_checkpoints
        self.metrics: MetricsWriter | None = None
        self.checkpointer: AsyncCheckpointer | None = None
        self.steps_trained: int | None = None
        """Steps this incarnation trained (set once it finished: the report's store usage per step)."""
        self.last_step = self.cfg.train.steps  # a preemption's agreed step ends the job earlier
        self._final_digest: str | None = None
        latency = self.store.request_latency()
        self.store_latency = None if latency is None else LatencyReport(latency)
        """The ``store_latency`` events: this worker's store requests' p50/p99, every few seconds."""

    @classmethod
    def assemble(cls, cfg: Config, spec: WorkerSpec, membership: Membership,
                 prepared: Prepared | None = None) -> Trainer:
        """The trainer of ``spec.worker`` with every part built (:func:`~unbroken.runtime.assembly.assemble`)."""
        return cls(assemble(cfg, spec, membership, prepared))

    def event(self, event: str, **fields: Any) -> None:
        """One event in this worker's log (``events/w<id>.jsonl``)."""
        self.parts.event(event, **fields)

    def _skipped(self, what: str) -> Callable[..., None]:
        """The ``checkpoint_skipped`` event of a save of ``what`` (the leader's ``state``, a worker's ``part``)
        skipped because its previous write still ran (``step=``, ``writing=``: a slow file system)."""
        return functools.partial(self.event, "checkpoint_skipped", what=what)

    # -- start ----------------------------------------------------------------

    def start(self) -> int:
        """Enter the job (first view or as a joiner); returns the first step to train."""
        t0 = time.perf_counter()
        self._check_consistency()
        check_capturable(self.job.optimizer)  # its groups now, its state after the first step (train)
        if not self.spec.join:
            view = self._wait_view(lambda v: self.spec.worker in v.members)
            try:
                self.protocol.adopt(view)
            except (CollectiveFailed, ViewChanged, MemberDied) as exc:
                # A member died (or was judged dead) before the first step: go on without it, as in
                # any step; its agent restarts it and it rejoins.
                self.protocol.reconfigure_at_start(view.step, f"{type(exc).__name__}: {exc}")
            if view.restore is not None:  # as in the joiner's restore below
                self.protocol.exchange_first()
            return view.step
        current = self.store.gen() if self.store.has_view() else -1
        joins_after, restores_after = current, self._restores_after(current)
        self.m.request_join({"pid": os.getpid(), "config_hash": self.hash, "t": time.time(),
                             "memory": self.parts.state.rejoins_from_memory()})
        failed: View | None = None  # the view whose admission of this incarnation failed last
        while True:
            view = self._wait_view(functools.partial(self._admits_me, joins_after, restores_after, failed))
            try:
                self.protocol.adopt(view)
            except (CollectiveFailed, ViewChanged, MemberDied) as exc:
                if view.restore is None or not self._restore_failed(view, exc):
                    # Someone died during the admission: the next view of that step admits us again.
                    logger.warning("admission in view %d failed (%s); waiting for the next", view.gen, exc)
                    joins_after = restores_after = view.gen
                    failed = view if view.restore is None else None
                    continue
            if view.restore is not None:
                # The job came back from a snapshot: a member like any other. It exchanges first, as a member
                # that reached this step's view through a failed attempt does (every member must, or one
                # waits in the exchange while another waits in the all-reduce).
                self.protocol.exchange_first()
                return view.step
            break
        self.protocol.exchange_first()
        self.events.write({"kind": "event", "event": "rejoined", "worker": self.spec.worker, "gen": view.gen,
                           "step": view.step, "wait_s": time.perf_counter() - t0})
        return view.step

    def _admits_me(self, joins_after: int, restores_after: int, failed: View | None, v: View) -> bool:
        """Does ``v`` admit this joiner: as a joiner newer than ``joins_after``, as a member of a restored view
        newer than ``restores_after``, or (raising) is it stranded in ``failed`` (:meth:`_stranded`)?"""
        return (v.gen > joins_after and self.spec.worker in v.joiners) or (
            v.gen > restores_after and v.restore is not None and self.spec.worker in v.members) or self._stranded(
            v, failed)

    def _restores_after(self, current: int) -> int:
        """The newest generation whose restored view this incarnation must not enter.

        Only a view newer than the current one can admit a joiner (it has not asked yet): the current one may
        name this worker as a joiner for its predecessor, admitted just before it died. A restored view names
        every member afresh, so the current one is this incarnation's too, unless its predecessor entered it:
        then its death was marked after the view was published (the restoring agent clears every member's mark
        first), or a step was decided in it. Entering such a view would train its steps again, or wait for
        members that are gone; the next restored view is this incarnation's. A worker its agent started for a
        restored view (``restore_gen``) enters that one.
        """
        if self.spec.restore_gen is not None:
            return min(current, self.spec.restore_gen - 1)
        if current < 0:
            return current
        view = self.store.current_view()
        if view.restore is None or view.gen != current:
            return current
        fresh = self.store.decided(view.gen) == view.step - 1 and not self.store.is_marked_dead(self.spec.worker)
        return current - 1 if fresh else current

    def _stranded(self, current: View, failed: View | None) -> bool:
        """False, unless ``current`` is the view whose admission of this joiner failed and every member of it
        that held the state is marked dead: nobody is left to propose the next view of its step, and its
        joiners would wait for good.

        Raises:
            NoLiveWorker: then. The joiner leaves marked dead (:mod:`unbroken.runtime.worker_entry`); once
                every member of the view is, the agents restore the job from snapshot memory, as when every
                worker dies.
        """
        if failed is None or current.gen != failed.gen:
            return False
        holders = tuple(w for w in current.members if w not in current.joiners)
        if not self.store.all_marked_dead(holders):
            return False
        raise NoLiveWorker(f"only workers still waiting for the state are left: view {current.gen}'s members "
                           f"{list(holders)} that held it are dead")

    def _restore_failed(self, view: View, exc: Exception) -> bool:
        """The admission of restored ``view`` failed: move to the next view of its step, as in any step.

        Every member of a restored view is a joiner, so nobody else would propose it. True: this worker
        is a member of the next view (its state loaded there); False: a newer view leaves it out, and it
        waits to be admitted as a joiner (its join request stands).
        """
        if self.store.gen() > view.gen:
            return False  # already replaced: follow the newer views as a joiner
        try:
            self.protocol.reconfigure_at_start(view.step, f"restore admission failed: {type(exc).__name__}: {exc}")
        except Fenced as fenced:
            logger.warning("admission in restored view %d failed (%s), and %s", view.gen, exc, fenced)
            return False
        return True

    def _check_consistency(self) -> None:
        """Same parameter layout and data rows as the job's (:mod:`unbroken.job.consistency`); a joiner
        whose layout differs is refused, any other difference fails the job."""
        try:
            check_consistency(self.store, self.hash, list(self.job.model.named_parameters()),
                              self.job.sampler.batch, self.job.micro_batch, joining=self.spec.join)
        except LayoutMismatch as exc:
            if self.spec.join:
                raise JoinRefused(str(exc)) from None
            raise

    def _wait_view(self, accept: Callable[[View], bool]) -> View:
        deadline = time.monotonic() + max(self.cfg.train.timeout_s, 600.0 if self.spec.join else 0.0)
        while time.monotonic() < deadline:
            if self.store.finished():
                raise SystemExit(0)
            if self.spec.join and (refusal := self.store.join_refusal(self.spec.worker)) is not None:
                raise JoinRefused(refusal)
            if self.store.has_view():
                view = self.store.current_view()
                if self.spec.worker not in view.members and view.gen > 0 and self.spec.join is False:
                    raise Fenced(f"worker {self.spec.worker} is not in view {view.gen}")
                if accept(view):
                    return view
            time.sleep(JOIN_POLL_S)
        raise TimeoutError(f"worker {self.spec.worker} was not admitted within the timeout")

    # -- the loop -------------------------------------------------------------

    def train(self, start: int) -> dict[str, Any]:
        """Train from step ``start`` to the end; returns the last train record."""
        steps = self.cfg.train.steps
        last: dict[str, Any] = {}
        t_prev = time.perf_counter()
        for step in range(start, steps):
            reduced, _ = self.protocol.run_step(step)
            view, done = self.protocol.view, step + 1
            # a preemption's stop, as the step's leader said in its reduction: every member stops alike
            stop = self.protocol.views.stops_after(reduced, step)
            self.last_step = done if stop else self.last_step
            due = self.schedule.due(done)  # every member runs the schedule: a new leader goes on in step
            due = "step" if stop else due  # the final checkpoint of a stopped job
            lr, grad_norm = self.protocol.layout.apply(step, view, self.protocol.group, reduced,
                                                       last=done == steps or stop)
            self.protocol.announced(reduced)  # whether this step's boundary admits joiners: every member alike
            if view.leader == self.spec.worker:
                self.m.applied(view.gen, view.step, done)  # how far the job got (agents' faults, the launcher)
            if step == start:
                check_capturable(self.job.optimizer)  # the state the optimizer made: before anything captures it
            if due and (moments := self.protocol.layout.moments_range()) is not None:
                with self.m.busy():  # ZeRO-1: every member writes its range of the moments
                    self._parts_writer().save(done, view.gen, *moments)
            # A preemption's last step is saved by the final checkpoint at once: no snapshot to wait for or compete
            # with its write (every member knows the stop from the same reduction: all skip it alike).
            if self.snapshots is not None and not stop and self.snapshots.take(done, view,
                                                                               self.job.layout.host_votes(reduced)):
                self.protocol.layout.snapshotted(done)  # ZeRO-1: the moments' copies of this step are kept
            self.events.write({"kind": "commit", "step": step, "gen": view.gen, "worker": self.spec.worker})
            if self.store_latency is not None and (latency := self.store_latency.due(
                    time.monotonic(), last=stop or done == steps)) is not None:
                self.event("store_latency", step=done, gen=view.gen, **latency)
            if step == start and self.spec.join:  # a restarted or replacement worker's first step: its recovery ends
                self.event("first_step_after_recovery", step=step, gen=view.gen, process_s=process_age_s())
            now = time.perf_counter()
            last = train_record(step=done, loss=self.job.loss(reduced), lr=lr, grad_norm=grad_norm,
                                step_time_s=now - t_prev, tokens_per_step=self.job.sampler.tokens_per_step,
                                generation=view.gen, live_workers=len(view.members),
                                degraded=degraded_homes(self.job.n_slots, self.job.n_workers, view.members))
            del reduced  # the step's buffer goes before the next one is allocated (its views, the gradients, too)
            if self.snapshots is not None:
                self.snapshots.observe_step(done, now - t_prev)
            t_prev = now
            if view.leader == self.spec.worker:
                self._lead(done, last, due)
            elif self.parallelism.same_replica(view.leader, self.spec.worker):
                self._second(done, due)  # the leader's validation and checkpoint run over its whole replica
            else:
                if due:
                    self.schedule.taken()  # the leader checkpoints this step
                if self.checkpointer is not None:
                    with self.m.busy():
                        self.checkpointer.handover()  # stopped leading: commit the save begun while leading
            if stop:
                steps = done
                break
            if done < steps:
                self.protocol.admit_joiners(done)
        self.steps_trained = steps - start
        with self.m.busy():
            self.protocol.finish(steps)
            # The report's digest while the final checkpoint is written (the leader's in its writer's threads; the
            # others only wait for done): the parameters no longer change, and the worker's end comes sooner.
            self._final_digest = self.param_digest()
            self._finish(steps, last)
            if self.shard_checkpoints is not None:  # after the final checkpoint's parts (HSDP: written in _finish)
                self.shard_checkpoints.close()
        if self.snapshots is not None:
            self.snapshots.close(finished=True)
        if self.metrics:
            self.metrics.close()
        return last

    def _finish(self, steps: int, last: dict[str, Any]) -> None:
        """After the last step: the final checkpoint is committed, then ``done`` is set.

        Every member stays until ``done``: the leader waits for its final save and sets it; if the leader
        dies first, the first member of the view not found dead writes the final checkpoint itself (every
        member applied the last step: its state is the leader's) and sets ``done``, so the final state never
        lives in shared memory only. Each member watches the others through the failure detector meanwhile.
        """
        view = self.protocol.view
        while not self.store.is_done():
            dead = self.m.dead_members(view)
            dead = self.protocol.plan.widen(dead)  # HSDP: a replica with a dead rank writes nothing
            writer = next((w for w in view.members if w not in dead), self.spec.worker)
            if writer == self.spec.worker:
                if view.leader != self.spec.worker:
                    logger.warning("the leader (worker %d) died before the final checkpoint was committed: "
                                   "writing it", view.leader)
                    self.event("final_checkpoint_takeover", step=steps, leader=view.leader)
                    missing = self._final_committed(steps) is None
                    # HSDP: its replica's ranks write their parts with it
                    missing = bool(self.protocol.replica_broadcast(writer, int(missing)))
                    if missing:
                        self._save(steps, last)  # the metrics keep what the leader wrote
                if self.checkpointer is not None:
                    self.checkpointer.wait()
                    written = self.checkpointer.written.get(steps)
                    if written is not None:  # this worker wrote it (not an earlier leader)
                        self.event("final_checkpoint", step=steps, bytes=written.bytes, write_s=round(
                            written.seconds, 4), gb_s=written.gb_s, writers=written.threads)
                self.store.set_done()
                return
            if view.leader != writer and self.parallelism.same_replica(writer, self.spec.worker):
                # HSDP: a rank of the replica that writes in the leader's stead writes its part, once
                if self.protocol.replica_broadcast(writer, -1):
                    self._write_part(steps, writer)
                while not self.store.is_done() and not self.m.dead_members(view) & {writer}:
                    time.sleep(FINISH_POLL_S)
                continue
            time.sleep(FINISH_POLL_S)

    def _final_committed(self, steps: int) -> Path | None:
        """The committed checkpoint of step ``steps``, if one is on disk."""
        path = checkpoint_dir(self.spec.run_dir, steps)
        return path if (path / COMMIT_FILE).is_file() else None

    def _lead(self, done: int, last: dict[str, Any], due: Due | None) -> None:
        """Duties of the view's first member: metrics, validation, checkpoints (``due``: see
        :class:`~unbroken.checkpoint.schedule.CheckpointSchedule`), progress.

        They may take long (a validation pass, a save that first waits for the previous one on a slow
        filesystem) and enter no phase of a step: they run inside :meth:`Membership.busy`, so the members
        waiting for the leader in the next step never judge it stuck."""
        with self.m.busy():
            if self.metrics is None:
                self.metrics = MetricsWriter.for_run(self.spec.run_dir / "metrics.jsonl", self.cfg)
            # Validation on the leader only: it must not depend on who else is alive.
            self.metrics.step_done(last, self.job.validation_loss if self.job.val_sampler is not None else None)
            checkpointer = self._leader_checkpointer()
            checkpointer.poll()
            if due == "step" or (due == "time" and checkpointer.pending_step is None):  # never waits for time
                self._save(done, last)

    def _second(self, done: int, due: Due | None) -> None:
        """HSDP: a rank of the leader's replica joins the collectives of the leader's duties, in their order:
        validation (a forward pass of the sharded model), then its part of the checkpoint."""
        with self.m.busy():
            t = self.cfg.train
            if self.job.val_sampler is not None and ((t.val_every > 0 and done % t.val_every == 0)
                                                     or done == t.steps):
                self.job.validation_loss()
            if due == "step":
                self.schedule.taken()
                self._write_part(done, self.protocol.view.leader)

    def _write_part(self, done: int, writer: int) -> tuple[dict[str, torch.Tensor], list[list]]:
        """This worker's part of the checkpoint of ``done`` steps that ``writer`` commits (HSDP: its shards),
        staged now and written in the background (the final one from the live state: no step follows it);
        returns what the writer writes itself (the rest) and the whole state's layout."""
        state = training_state(self.job.model, self.job.optimizer)
        rest, own = self.protocol.layout.split(state)
        if own is not None:
            self._parts_writer().save_part(done, self._stage(writer), *own, live=done == self.last_step)
        return rest, layout_of(state)

    def _stage(self, writer: int) -> int | str:
        """Where the parts of a checkpoint ``writer`` commits are staged (:meth:`Parallelism.checkpoint_stage`)."""
        return self.parallelism.checkpoint_stage(self.protocol.view.gen, writer)

    def _leader_checkpointer(self) -> AsyncCheckpointer:
        """The checkpointer of the state the leader writes (made when this worker first leads or saves)."""
        if self.checkpointer is None:
            self.checkpointer = AsyncCheckpointer(self.spec.run_dir, config_hash=self.hash,
                                                  keep=self.cfg.train.keep_checkpoints, on_skip=self._skipped("state"))
        return self.checkpointer

    def _parts_writer(self) -> ShardCheckpointer:
        """Where this worker writes its parts of a checkpoint (a layout that has parts is a sharded run's)."""
        if self.shard_checkpoints is None:
            raise AssertionError("a part of a checkpoint, but this run's workers write none")
        return self.shard_checkpoints

    def _save(self, done: int, last: dict[str, Any]) -> None:
        checkpointer = self._leader_checkpointer()
        self.schedule.taken()
        parts = self.protocol.layout.checkpoint_parts()
        shards = (self._stage(self.spec.worker), *parts) if parts is not None else None
        rest, layout = self._write_part(done, self.spec.worker)
        checkpointer.save(done, rest, {"loss": last["loss"]}, shards=shards, layout=layout,
                          live=done == self.last_step)

    def device_bytes(self) -> dict[str, int]:
        """The runtime's own memory beside the model and optimizer (on the training device): the step's
        reduction buffer (the gradients are views of it), gradients copied in beside it, snapshot staging."""
        layout = self.job.layout
        staging = self.snapshots.device_bytes if self.snapshots is not None else 0
        return {"reduction_buffer": 4 * layout.size, "gradients_copied": layout.copied_bytes,
                "gradients_beside_buffer": 0 if layout.views_possible else 4 * layout.n_grad,
                "snapshot_staging": staging}

    def param_digest(self) -> str:
        """A digest of every trainable parameter's bytes, in order; under HSDP of this worker's shards (equal
        across the workers of one shard index): :func:`~unbroken.runtime.digest.param_digest`."""
        if self._final_digest is not None:  # the parameters after the last step (train)
            return self._final_digest
        return param_digest([local_of(p).detach() for p in self.job.layout.params])


FINISH_POLL_S = 0.1
"""How often a member waiting for the final checkpoint looks at ``done`` and the others' liveness."""
