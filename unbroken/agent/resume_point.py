"""Where ``--resume`` continues a run: its job's snapshot memory or its newest committed checkpoint.

Snapshot memory (the job's segments in this machine's shared memory, see
:mod:`unbroken.snapshot.segment`) counts when it holds a complete snapshot: a
step of which every stripe has ``k`` fragments, parity included. The newer of
memory and checkpoint wins, memory on a tie (the order of
:func:`unbroken.snapshot.restore.decide`, which the agents then run on every
byte). Under ``fault.recovery=restart`` the job restarts from checkpoints only,
so memory does not count.

Invariant: a run is refused only when neither a complete snapshot nor a
committed checkpoint exists, and the refusal names both places.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from unbroken.config import Config, config_hash
from unbroken.checkpoint.checkpointer import CheckpointError, latest_checkpoint, read_commit
from unbroken.runtime.recovery import recovery
from unbroken.snapshot.segment import SealedBuffer, SnapshotCorrupt, job_segments, segment_dir
from unbroken.runtime.snapshot_hooks import JOB_ID_FILE, job_id

__all__ = ["NothingToResume", "ResumePoint", "memory_snapshot_step", "resume_point"]


class NothingToResume(ValueError):
    """The run has neither a complete snapshot in shared memory nor a committed checkpoint."""


@dataclasses.dataclass(frozen=True, kw_only=True)
class ResumePoint:
    """What a resumed run can continue from (at least one of the two is set)."""

    checkpoint: Path | None
    checkpoint_step: int | None
    memory_step: int | None

    @property
    def from_memory(self) -> bool:
        """Memory holds the newest state (ties go to memory: nothing to read from disk)."""
        return self.memory_step is not None and (self.checkpoint_step is None
                                                 or self.memory_step >= self.checkpoint_step)

    @property
    def step(self) -> int:
        """The step the run continues from."""
        step = self.memory_step if self.from_memory else self.checkpoint_step
        assert step is not None
        return step

    def describe(self) -> str:
        """One phrase for messages: ``snapshot memory of step 96`` or ``the checkpoint .../step_0000080``."""
        if self.from_memory:
            return f"snapshot memory holds a complete snapshot of step {self.memory_step}"
        return f"the newest committed checkpoint is {self.checkpoint} (step {self.checkpoint_step})"


def resume_point(run_dir: Path, cfg: Config, *, memory_usable: bool = True) -> ResumePoint:
    """Where the run in ``run_dir`` (trained with ``cfg``) continues from; ``memory_usable`` False: from a
    checkpoint only (the run resumes on another layout of nodes and workers than its memory was written by).

    Raises:
        NothingToResume: no complete snapshot in memory and no committed checkpoint (names both).
        CheckpointError: committed checkpoints exist but none is intact, and memory holds nothing.
        ValueError: the job's snapshot memory was written under another config (names both hashes).
    """
    memory = None if recovery(cfg.fault.recovery).restarts_job or not memory_usable else \
        memory_snapshot_step(run_dir, cfg)
    try:
        ckpt = latest_checkpoint(run_dir)  # the newest whose files match their checksums
    except CheckpointError as exc:
        if memory is None:
            raise CheckpointError(f"--resume {run_dir}: {exc}") from exc
        ckpt = None
    if ckpt is None and memory is None:
        t = cfg.train
        raise NothingToResume(
            f"--resume {run_dir}: nothing to continue from: no committed checkpoint under "
            f"{run_dir / 'checkpoints'} (the run had train.checkpoint_every={t.checkpoint_every}, "
            f"train.checkpoint_every_s={t.checkpoint_every_s:g}) and "
            + (f"no complete snapshot of its job in shared memory ({_memory_place(run_dir)})" if memory_usable else
               "its snapshot memory is of another layout of nodes and workers (resume on the run's own layout "
               "to continue from memory)")
            + f"; start it again with --out {run_dir} --overwrite")
    ckpt_step = int(read_commit(ckpt)["step"]) if ckpt is not None else None
    return ResumePoint(checkpoint=ckpt, checkpoint_step=ckpt_step, memory_step=memory)


def memory_snapshot_step(run_dir: Path, cfg: Config) -> int | None:
    """The newest step of which this machine's shared memory holds a complete snapshot of the run's job.

    Judged from the seals alone (cheap); the agents' inventories check every byte before a restore and
    fall back to an older buffer or the checkpoint where one does not match.

    Raises:
        ValueError: the job's segments were written under another config (names both hashes).
    """
    if not (run_dir / JOB_ID_FILE).is_file():
        return None
    job, want = job_id(run_dir), config_hash(cfg)
    seals = []
    for path in job_segments(job):
        try:
            buf = SealedBuffer.open(path, job)
        except (SnapshotCorrupt, OSError):
            continue  # reported and skipped by the agents' inventories
        if buf is None:
            continue
        if buf.seal.get("config_hash") != want:
            raise ValueError(f"--resume {run_dir}: shared memory holds snapshots of job {job} written under "
                             f"config {buf.seal.get('config_hash')} ({path.name}), not this run's {want}: "
                             f"resume with the run's own config, or remove them (rm {segment_dir()}/unbroken-{job}-*)")
        seals.append(buf.seal)
    from unbroken.agent.launch_checks import replicas_of
    from unbroken.snapshot.replicas import copies_inventory
    from unbroken.snapshot.restore import restorable_steps

    degree = replicas_of(cfg).shard_degree
    newest = next(restorable_steps(seals, lambda: copies_inventory(job)[0], shard_degree=degree), None)
    return newest[0] if newest else None


def _memory_place(run_dir: Path) -> str:
    if not (run_dir / JOB_ID_FILE).is_file():
        return f"the run has no {JOB_ID_FILE}"
    return f"{segment_dir()}/unbroken-{job_id(run_dir)}-*"
