"""Persistent checkpoints: safetensors files that torch DCP's Hugging Face reader loads, pickle-free.

Layout of one checkpoint, ``<run>/checkpoints/step_<NNNNNNN>/``:
- ``model-*.safetensors`` + ``model.safetensors.index.json``: safetensors files
  (JSON header + raw bytes) written by several threads
  (:mod:`unbroken.checkpoint.writer`), read by DCP's Hugging Face
  reader. Holds the training state
  under the names of :mod:`unbroken.state.training_state`: the model
  parameters (``model.<name>``), the optimizer's state, whatever the optimizer
  (``optim.<name>.exp_avg`` ..., ``optim.<name>.momentum_buffer`` ...), its
  param groups' values and the CPU RNG state (``rng.cpu``).
- ``commit.json``: step, config hash, data position, the state's layout
  (``state``: name, dtype and shape of every entry, so a fresh optimizer
  knows what to load) and the sha256 of every other file (taken while the file
  was written; a part another worker wrote is hashed here), written last,
  durably and atomically
  (:mod:`unbroken.checkpoint.files`). A directory without it is
  incomplete and is never resumed from.

Data-parallel state is replicated, so one worker (the view's leader) writes it.
A save during training copies the state into host buffers kept from one save to
the next (:class:`~unbroken.checkpoint.writer.HostStage`; pinned for a
GPU's state); a background thread then writes the files, commits, and deletes
checkpoints beyond ``keep``, so training continues while bytes reach the disk
and a save commits even if its writer stops leading. The final checkpoint is
written from the live state (nothing trains after it): no copy at all on a CPU,
one pass through pinned blocks on a GPU.

One save is written at a time (:class:`~unbroken.checkpoint.slot.WriteSlot`).
A save waits for the previous write first, up to 2 × ``timeout_s``; if that
write still runs (a slow file system), the save is skipped (one log line,
``skipped_steps``, the ``on_skip`` callback) rather than copied into the host
buffers that write still reads, and the next due checkpoint is tried again.
The final checkpoint (live, no buffer) is never skipped: it gives the older
write up and follows it. A :meth:`~AsyncCheckpointer.wait` that runs out of
patience gives the write up: it counts as not written (``failed_steps``) and
never commits.

Invariants: loading step ``k`` and training to ``K`` equals training to ``K``;
a checkpoint is loaded only if its files match the checksums of its commit;
a committed checkpoint holds one step's state (its buffers are never copied
into while it is written); a save that fails on the storage (disk full, file
too large, I/O error) is logged once, its directory removed, and training
goes on.
"""

from __future__ import annotations

import logging
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from unbroken.checkpoint.files import (
    COMMIT_FILE,
    CheckpointError,
    checkpoint_dir,
    committed_checkpoints,
    prune_checkpoints,
    read_commit,
    remove_checkpoint,
    seal_files,
    verify_files,
    write_commit,
)
from unbroken.checkpoint.dcp import dcp
from unbroken.checkpoint.slot import WriteClaim, WriteSlot
from unbroken.checkpoint.writer import Written, write_state, writer_threads
from unbroken.state.training_state import Restorer, capture, layout_of

__all__ = [
    "COMMIT_FILE",
    "AsyncCheckpointer",
    "CheckpointError",
    "checkpoint_dir",
    "latest_checkpoint",
    "load_checkpoint",
    "read_commit",
    "training_state",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)


DEFAULT_KEEP = 3
"""Committed checkpoints kept when the caller does not say (``train.keep_checkpoints``)."""
SAVE_TIMEOUT_S = 600.0
"""Longest wait for one checkpoint's files to be written (a save waits twice this for the previous one)."""


def training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """The training state as a checkpoint holds it (:func:`unbroken.state.training_state.capture`)."""
    return capture(model, optimizer)


class AsyncCheckpointer:
    """Writes checkpoints in the background, one at a time; each commits itself once on disk.

    Args:
        run_dir: the run directory (checkpoints go to ``run_dir/checkpoints``).
        config_hash: recorded in each commit; a load checks it.
        keep: committed checkpoints kept after each commit (``train.keep_checkpoints``).
        timeout_s: longest wait for one save's files (then it counts as not written).
        on_skip: called with ``step=`` and ``writing=`` (the step still being written) when a save is skipped.
    """

    def __init__(self, run_dir: str | Path, *, config_hash: str, keep: int = DEFAULT_KEEP,
                 timeout_s: float = SAVE_TIMEOUT_S, on_skip: Callable[..., None] | None = None) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1 (train.keep_checkpoints)")
        self.run_dir = Path(run_dir)
        self.config_hash = config_hash
        self.keep = keep
        self.timeout_s = timeout_s
        self.failed_steps: list[int] = []
        """Steps whose checkpoint was not written (storage errors, writes given up on), oldest first."""
        self.skipped_steps: list[int] = []
        """Steps whose save was skipped: the previous write still ran."""
        self.written: dict[int, Written] = {}
        """What each committed save of this checkpointer wrote (bytes, seconds), by step."""
        self.on_skip = on_skip
        self._slot = WriteSlot("checkpoint")

    @property
    def pending_step(self) -> int | None:
        """The step of the save still in flight or not yet collected, or None."""
        return self._slot.pending.step if self._slot.pending else None

    def save(self, step: int, state: dict[str, torch.Tensor], meta: dict[str, Any],
             shards: tuple[int | str, list[str], dict[str, Any]] | None = None, layout: list[list] | None = None,
             live: bool = False) -> None:
        """Stage ``state`` now and write it asynchronously; ``step`` = steps done.

        Waits for the previous save first (up to 2 × ``timeout_s``; still running,
        it goes on and this save is skipped: logged, ``skipped_steps``, ``on_skip``).
        A storage error is logged and the
        save dropped (training goes on; the next save tries again). ``shards``
        (a sharded run: the view's generation, the parts other workers write,
        what the commit records of them) makes the commit wait for every part
        (:func:`unbroken.checkpoint.sharded.collect_shards`): ZeRO-1's ranges
        of the moments, HSDP's shard indices. ``layout``: the whole state's
        (:func:`~unbroken.state.training_state.layout_of`) when ``state`` is
        only the leader's part of it (default: ``state``'s). ``live``: ``state`` does not change until
        :meth:`wait` returns (the final checkpoint): written from it, not from a copy, never skipped (a
        previous write still running is given up on, and this one follows it).
        """
        writing = self._slot.settle(2 * self.timeout_s)
        if writing is not None and not live:
            self.skipped_steps.append(step)
            logger.warning("checkpoint at step %d skipped: the checkpoint at step %d is still being written after "
                           "%.0f s (from the host buffers this save would copy into)", step, writing,
                           2 * self.timeout_s)
            if self.on_skip is not None:
                self.on_skip(step=step, writing=writing)
            return
        if writing is not None:  # the final state needs no buffer and supersedes the older step: that one goes
            self._give_up(writing)
        path = checkpoint_dir(self.run_dir, step)
        commit = {"step": step, "config_hash": self.config_hash, "data_step": step, **meta,
                  "state": layout if layout is not None else layout_of(state)}
        try:
            remove_checkpoint(path)  # a leftover of an earlier attempt at this step
            path.mkdir(parents=True)
            staged = state if live else self._slot.stage.copy(state)
        except Exception as exc:
            self._failed(step, path, exc)
            return
        self._slot.submit(step, self._finish, step, path, commit, staged, shards, reads_stage=not live)

    def poll(self) -> None:
        """Collect a finished save; raise if it failed for another reason than the storage."""
        pending = self._slot.pending
        if pending is not None and pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the pending save is committed (or has failed and been logged), at most 2 × ``timeout_s``;
        a save still not on disk then is given up on: it counts as not written and never commits."""
        step = self.pending_step
        if step is not None and not self._slot.wait(2 * self.timeout_s):
            self._give_up(step)

    def _give_up(self, step: int) -> None:
        """Stop waiting for the save of ``step``, still running: it never commits (unless its commit is under way)."""
        outcome = self._slot.give_up()
        if outcome:
            self.failed_steps.append(step)
            logger.error("checkpoint at step %d still not on disk after %.0f s: given up on, it will not be "
                         "committed", step, 2 * self.timeout_s)
        elif outcome is False:
            logger.error("checkpoint at step %d: its commit still not on disk after %.0f s; not waiting for it "
                         "any longer", step, 2 * self.timeout_s)

    def handover(self) -> None:
        """This worker no longer leads the view: finish (wait for and commit) its pending save now.

        The save then lands before the new leader's saves and retention run,
        not at the end of the run.
        """
        pending = self._slot.pending
        if pending is not None and not pending.given_up:
            logger.info("no longer leading: finishing the checkpoint at step %d", pending.step)
            self.wait()

    def _finish(self, step: int, path: Path, commit: dict[str, Any], state: dict[str, torch.Tensor],
                shards: tuple[int | str, list[str], dict[str, Any]] | None, claim: WriteClaim) -> Written | None:
        """Background: write the files (hashed as written), wait for the other workers' parts, commit, prune.
        None: not written (a storage error, or given up on before its commit)."""
        try:
            written = write_state(path, state)
            known = dict(written.files)
            if shards is not None:
                from unbroken.checkpoint.sharded import collect_shards

                known.update(collect_shards(self.run_dir, step, shards[0], shards[1], path))
                commit.update(shards[2])
            commit["files"] = seal_files(path, known)
            if not claim.commit():
                remove_checkpoint(path)
                logger.warning("checkpoint at step %d given up on before its commit: %s removed", step, path)
                return None
            write_commit(path, commit)
        except Exception as exc:
            self._failed(step, path, exc)
            return None
        self.written[step] = written
        logger.info("checkpoint step %d committed at %s (%.2f GB in %.2f s, %d writers)", step, path,
                    written.bytes / 1e9, written.seconds, written.threads)
        try:
            prune_checkpoints(path.parent, self.keep)
        except OSError as exc:  # the new checkpoint is safe; old ones stay until the next commit
            logger.warning("could not delete old checkpoints after step %d: %s", step, exc)
        return written

    def _failed(self, step: int, path: Path, exc: BaseException) -> None:
        """Log a failed save once and remove its directory; re-raise unless the storage failed."""
        remove_checkpoint(path)
        if not isinstance(exc, (OSError, TimeoutError)):
            logger.error("checkpoint at step %d not written (%s removed)", step, path)
            raise exc
        if step not in self.failed_steps:  # a write given up on is counted once, by the waiter or here
            self.failed_steps.append(step)
        logger.error("checkpoint at step %d not written: %s; removed %s, training goes on and the next "
                     "checkpoint is tried again", step, exc, path)


def verify_checkpoint(path: str | Path) -> dict[str, Any]:
    """Read the commit of checkpoint ``path`` and check its files' checksums; returns the commit.

    Raises:
        CheckpointError: naming the file that is torn, missing or does not match.
    """
    commit = read_commit(path)
    verify_files(path, commit)
    return commit


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    """The newest committed checkpoint of a run whose files match their checksums, or None.

    A damaged one (torn ``commit.json``, a file that does not match) is skipped
    with a warning naming the file, and the previous one is tried.

    Raises:
        CheckpointError: there are committed checkpoints but none is intact.
    """
    root = Path(run_dir) / "checkpoints"
    damaged: list[str] = []
    for path in committed_checkpoints(root):
        try:
            verify_checkpoint(path)
        except CheckpointError as exc:
            logger.warning("skipping checkpoint %s: %s", path.name, exc)
            damaged.append(str(exc))
            continue
        if damaged:
            logger.warning("using the previous committed checkpoint %s instead", path)
        return path
    if damaged:
        raise CheckpointError(f"no intact committed checkpoint under {root}: {'; '.join(damaged)}")
    return None


def _adam_layout(model: torch.nn.Module) -> list[list]:
    """The layout of a checkpoint whose commit records none (written by an earlier version, AdamW's state):
    parameters, then each one's moments and step count, then the CPU RNG state."""
    params = list(model.named_parameters())
    out = [[f"model.{name}", _dtype(p), list(p.shape)] for name, p in params]
    for name, p in params:
        out += [[f"optim.{name}.exp_avg", _dtype(p), list(p.shape)], [f"optim.{name}.exp_avg_sq", _dtype(p),
                list(p.shape)], [f"optim.{name}.step", "float32", []]]
    return out + [["rng.cpu", "uint8", [torch.get_rng_state().numel()]]]


def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _read(path: str | Path, state: dict[str, torch.Tensor]) -> None:
    """Fill ``state``'s tensors from the checkpoint's files (DCP's safetensors reader, no pickle; a thread per
    file up to one per core)."""
    if not state:
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp().load(state, storage_reader=dcp().HuggingFaceStorageReader(str(path), thread_count=writer_threads()),
                   no_dist=True)


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, config_hash: str
) -> dict[str, Any]:
    """Load a committed, verified checkpoint into model and optimizer; returns its commit record.

    The commit's layout (``state``) says what the checkpoint holds, so an optimizer that has no state yet
    gets all of it. A sharded run's checkpoint holds the moments as flat ranges under ``shards/``, an HSDP
    run's every sharded tensor as the parts of its shard indices (:mod:`unbroken.checkpoint.sharded`).

    Raises:
        CheckpointError: the checkpoint is incomplete, damaged or from another config.
    """
    commit = verify_checkpoint(path)
    if commit["config_hash"] != config_hash:
        raise CheckpointError(
            f"{path} was written by a run with config hash {commit['config_hash']}, "
            f"this run has {config_hash}"
        )
    sharded = "shards" in commit
    layout = commit.get("state") or _adam_layout(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    moments = [f"optim.{name}.{key}" for name, _ in params for key in ("exp_avg", "exp_avg_sq")]
    if sharded:  # ZeRO-1's moments: flat ranges under shards/, whatever optimizer wrote or loads them
        layout = [e for e in layout if e[0] not in moments] + [
            [f"optim.{name}.{key}", "float32", list(p.shape)] for name, p in params for key in ("exp_avg", "exp_avg_sq")]
    restorer = Restorer(layout, model, optimizer, torch.device("cpu"), local=False)
    wanted = {name: torch.empty(shape, dtype=getattr(torch, dtype)) for name, dtype, shape, *_ in layout
              if not (sharded and name in moments)}
    parts: dict[str, torch.Tensor] = {}
    local = False
    if "hsdp_parts" in commit:  # every sharded tensor from the parts, the rest from the leader's files
        from unbroken.checkpoint.sharded import hsdp_part_keys, load_hsdp_parts

        held = hsdp_part_keys(path)
        in_parts = {name: restorer.targets[name] for name in wanted if name in held}
        parts, local = load_hsdp_parts(path, int(commit["hsdp_parts"]), in_parts)
        wanted = {name: t for name, t in wanted.items() if name not in in_parts}
    _read(path, wanted)
    for name, t in [*wanted.items(), *parts.items()]:
        restorer.load(name, t, part=local and name in parts)
    if sharded:
        from unbroken.checkpoint.sharded import load_moments

        m, v = load_moments(path, commit["shards"], sum(p.numel() for _, p in params))
        offset = 0
        for name, p in params:
            restorer.load(f"optim.{name}.exp_avg", m[offset:offset + p.numel()].view_as(p))
            restorer.load(f"optim.{name}.exp_avg_sq", v[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
    restorer.finish()
    return commit
