"""Persistent checkpoints in ``torch.distributed.checkpoint`` format, pickle-free.

Layout of one checkpoint, ``<run>/checkpoints/step_<NNNNNNN>/``:
- ``model-*.safetensors`` + ``model.safetensors.index.json``: written by DCP's
  safetensors storage (JSON header + raw bytes). Holds the model parameters
  (``model.<name>``), AdamW moments (``optim.<name>.exp_avg`` ...) and the CPU
  RNG state (``rng.cpu``).
- ``commit.json``: step, config hash, data position and the sha256 of every
  other file, written last, durably and atomically
  (:mod:`unbroken.runtime.checkpoint_files`). A directory without it is
  incomplete and is never resumed from.

Data-parallel state is replicated, so one worker (the view's leader) writes it.
``dcp.async_save`` stages a copy synchronously; a background thread then
writes the files, fsyncs and checksums them, commits, and deletes checkpoints
beyond ``keep``, so training continues while bytes reach the disk and a save
commits even if its writer stops leading.

Invariants: loading step ``k`` and training to ``K`` equals training to ``K``;
a checkpoint is loaded only if its files match the checksums of its commit;
a save that fails on the storage (disk full, file too large, I/O error) is
logged once, its directory removed, and training goes on.
"""

from __future__ import annotations

import dataclasses
import logging
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout  # not the builtin before 3.11
from pathlib import Path
from typing import Any

import torch

from unbroken.runtime.checkpoint_files import (
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
from unbroken.dcp import dcp
from unbroken.sharding.parts import is_sharded, laid_out_as, local_of, local_part

__all__ = [
    "COMMIT_FILE",
    "AsyncCheckpointer",
    "CheckpointError",
    "checkpoint_dir",
    "latest_checkpoint",
    "load_checkpoint",
    "load_training_state",
    "read_commit",
    "training_state",
    "verify_checkpoint",
]

logger = logging.getLogger(__name__)

ADAM_KEYS = ("exp_avg", "exp_avg_sq", "step")


def step_device(optimizer: torch.optim.Optimizer, p: torch.Tensor) -> torch.device:
    """Where AdamW keeps ``p``'s step count: on the parameter's device when fused or capturable, else the host."""
    on_device = any(g.get("fused") or g.get("capturable") for g in optimizer.param_groups)
    return p.device if on_device else torch.device("cpu")


def _save_errors() -> tuple[type[BaseException], ...]:
    """What a failed save raises: any error, or DCP's ``CheckpointException`` (a ``BaseException``)."""
    return (Exception, dcp().CheckpointException)
DEFAULT_KEEP = 3
"""Committed checkpoints kept when the caller does not say (``train.keep_checkpoints``)."""
SAVE_TIMEOUT_S = 600.0
"""Longest wait for one checkpoint's files to be written."""


def training_state(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, torch.Tensor]:
    """Flat name -> tensor view of everything a worker needs to continue, in the model's parameter order (not
    the order the optimizer's state was created in, which differs between a worker that trained from the start
    and one that loaded the state: the snapshot holders of one state must lay it out alike)."""
    state: dict[str, torch.Tensor] = {}
    params = list(model.named_parameters())
    for name, p in params:
        state[f"model.{name}"] = p.detach()
    for name, p in params:
        st = optimizer.state.get(p, {})
        for key in ADAM_KEYS:
            if key in st:
                t = st[key]
                state[f"optim.{name}.{key}"] = t if torch.is_tensor(t) else torch.tensor(float(t))
    state["rng.cpu"] = torch.get_rng_state()
    return state


def load_training_state(
    state: dict[str, torch.Tensor], model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, local: bool = False
) -> None:
    """Copy a flat state (as produced by :func:`training_state`) into model and optimizer. ``local``: its
    entries for sharded parameters are already this rank's parts (not whole tensors)."""
    params = dict(model.named_parameters())
    part = (lambda t, p: t if is_sharded(p) else local_part(t, p)) if local else local_part
    with torch.no_grad():
        for name, p in params.items():
            local_of(p).copy_(part(state[f"model.{name}"], p))
    if hasattr(optimizer, "load_full"):  # a sharded optimizer: flat moments, per-parameter steps
        optimizer.load_full({name: (state.get(f"optim.{name}.exp_avg"), state.get(f"optim.{name}.exp_avg_sq"),
                                       state.get(f"optim.{name}.step")) for name in params})
        torch.set_rng_state(state["rng.cpu"].clone())
        return
    for name, p in params.items():
        keys = {k: state.get(f"optim.{name}.{k}") for k in ADAM_KEYS}
        if all(v is None for v in keys.values()):
            continue
        optimizer.state[p] = {
            "step": keys["step"].clone().float().to(step_device(optimizer, p)),
            "exp_avg": laid_out_as(p, part(keys["exp_avg"], p).clone().to(local_of(p).device)),
            "exp_avg_sq": laid_out_as(p, part(keys["exp_avg_sq"], p).clone().to(local_of(p).device)),
        }
    torch.set_rng_state(state["rng.cpu"].clone())


def whole(t: torch.Tensor) -> torch.Tensor:
    """An empty tensor of ``t``'s whole shape and dtype (on the host for a DTensor), to load into."""
    return torch.empty(t.shape, dtype=t.dtype) if is_sharded(t) else t.detach().clone()


@dataclasses.dataclass(frozen=True)
class _Pending:
    step: int
    path: Path
    future: Future[bool]


class AsyncCheckpointer:
    """Writes checkpoints in the background, one at a time; each commits itself once on disk.

    Args:
        run_dir: the run directory (checkpoints go to ``run_dir/checkpoints``).
        config_hash: recorded in each commit; a load checks it.
        keep: committed checkpoints kept after each commit (``train.keep_checkpoints``).
        timeout_s: longest wait for one save's files (then it counts as not written).
    """

    def __init__(self, run_dir: str | Path, *, config_hash: str, keep: int = DEFAULT_KEEP,
                 timeout_s: float = SAVE_TIMEOUT_S) -> None:
        if keep < 1:
            raise ValueError(f"keep={keep}: must be >= 1 (train.keep_checkpoints)")
        self.run_dir = Path(run_dir)
        self.config_hash = config_hash
        self.keep = keep
        self.timeout_s = timeout_s
        self.failed_steps: list[int] = []
        """Steps whose checkpoint was not written (storage errors), oldest first."""
        self._pending: _Pending | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def pending_step(self) -> int | None:
        """The step of the save still in flight or not yet collected, or None."""
        return self._pending.step if self._pending else None

    def save(self, step: int, state: dict[str, torch.Tensor], meta: dict[str, Any],
             shards: tuple[int, list[str], dict[str, Any]] | None = None) -> None:
        """Stage ``state`` now and write it asynchronously; ``step`` = steps done.

        Waits for the previous save first. A storage error is logged and the
        save dropped (training goes on; the next save tries again). ``shards``
        (a sharded run: the view's generation, the parts other workers write,
        what the commit records of them) makes the commit wait for every part
        (:func:`unbroken.sharding.checkpoint.collect_shards`): ZeRO-1's ranges
        of the moments, HSDP's shard indices.
        """
        self.wait()
        path = checkpoint_dir(self.run_dir, step)
        commit = {"step": step, "config_hash": self.config_hash, "data_step": step, **meta}
        try:
            remove_checkpoint(path)  # a leftover of an earlier attempt at this step
            path.mkdir(parents=True)
            with warnings.catch_warnings():
                warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
                fut = dcp().async_save(state, storage_writer=dcp().HuggingFaceStorageWriter(str(path)), no_dist=True)
        except _save_errors() as exc:
            self._failed(step, path, exc)
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="checkpoint")
        self._pending = _Pending(step, path, self._pool.submit(self._finish, step, path, commit, fut, shards))

    def poll(self) -> None:
        """Collect a finished save; raise if it failed for another reason than the storage."""
        if self._pending and self._pending.future.done():
            self.wait()

    def wait(self) -> None:
        """Block until the pending save is committed (or has failed and been logged)."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        try:
            pending.future.result(timeout=2 * self.timeout_s)
        except FutureTimeout:
            if pending.future.done():
                raise
            logger.error("checkpoint at step %d still not on disk after %.0f s; not waiting for it any longer",
                         pending.step, 2 * self.timeout_s)

    def handover(self) -> None:
        """This worker no longer leads the view: finish (wait for and commit) its pending save now.

        The save then lands before the new leader's saves and retention run,
        not at the end of the run.
        """
        if self._pending is not None:
            logger.info("no longer leading: finishing the checkpoint at step %d", self._pending.step)
            self.wait()

    def _finish(self, step: int, path: Path, commit: dict[str, Any], fut: Future[Any],
                shards: tuple[int, list[str], dict[str, Any]] | None = None) -> bool:
        """Background: wait for the files, fsync and checksum them, commit, prune. False: not written."""
        try:
            _wait_written(fut, self.timeout_s)
            if shards is not None:
                from unbroken.sharding.checkpoint import collect_shards

                collect_shards(self.run_dir, step, shards[0], shards[1], path)
                commit.update(shards[2])
            commit["files"] = seal_files(path)
            write_commit(path, commit)
        except _save_errors() as exc:
            self._failed(step, path, exc)
            return False
        logger.info("checkpoint step %d committed at %s", step, path)
        try:
            prune_checkpoints(path.parent, self.keep)
        except OSError as exc:  # the new checkpoint is safe; old ones stay until the next commit
            logger.warning("could not delete old checkpoints after step %d: %s", step, exc)
        return True

    def _failed(self, step: int, path: Path, exc: BaseException) -> None:
        """Log a failed save once and remove its directory; re-raise unless the storage failed."""
        remove_checkpoint(path)
        err = _storage_error(exc)
        if err is None and not isinstance(exc, TimeoutError):
            logger.error("checkpoint at step %d not written (%s removed)", step, path)
            raise exc
        err = err or exc
        self.failed_steps.append(step)
        logger.error("checkpoint at step %d not written: %s; removed %s, training goes on and the next "
                     "checkpoint is tried again", step, err, path)


def _wait_written(fut: Future[Any], timeout_s: float) -> None:
    try:
        fut.result(timeout=timeout_s)
    except FutureTimeout:
        if fut.done():
            raise
        raise TimeoutError(f"its files were not written within {timeout_s:.0f} s") from None


def _storage_error(exc: BaseException) -> OSError | None:
    """The OS error behind a failed save (disk full, file too large, I/O, timeout), or None."""
    if isinstance(exc, OSError):
        return exc
    if isinstance(exc, dcp().CheckpointException):
        causes = [e for e, _ in exc.failures.values()]
        if causes and all(isinstance(e, OSError) for e in causes):
            return causes[0]  # type: ignore[return-value]
    return None


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


def _load_hsdp(path: str | Path, commit: dict[str, Any], model: torch.nn.Module,
               optimizer: torch.optim.Optimizer) -> None:
    """Load an HSDP checkpoint: the leader's step counts and RNG, every sharded tensor from the parts."""
    from unbroken.sharding.checkpoint import load_hsdp_parts

    wanted: dict[str, torch.Tensor] = {}
    rest: dict[str, torch.Tensor] = {"rng.cpu": torch.get_rng_state()}
    for name, p in model.named_parameters():
        wanted[f"model.{name}"] = p
        for key in ("exp_avg", "exp_avg_sq"):
            wanted[f"optim.{name}.{key}"] = p
        rest[f"optim.{name}.step"] = torch.zeros((), dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp().load(rest, storage_reader=dcp().HuggingFaceStorageReader(str(path)), no_dist=True)
    parts, local = load_hsdp_parts(path, int(commit["hsdp_parts"]), wanted)
    load_training_state({**rest, **parts}, model, optimizer, local=local)


def load_checkpoint(
    path: str | Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, *, config_hash: str
) -> dict[str, Any]:
    """Load a committed, verified checkpoint into model and optimizer; returns its commit record.

    Raises:
        CheckpointError: the checkpoint is incomplete, damaged or from another config.
    """
    commit = verify_checkpoint(path)
    if commit["config_hash"] != config_hash:
        raise CheckpointError(
            f"{path} was written by a run with config hash {commit['config_hash']}, "
            f"this run has {config_hash}"
        )
    # Build the full key set (optimizer moments may not exist yet before a first step). A sharded run's
    # checkpoint holds the moments as flat ranges under shards/, an HSDP run's every sharded tensor as the
    # parts of its shard indices (unbroken.sharding.checkpoint).
    if "hsdp_parts" in commit:
        _load_hsdp(path, commit, model, optimizer)
        return commit
    sharded = "shards" in commit
    state = {k: v for k, v in training_state(model, optimizer).items() if not k.endswith(".exp_avg")
             and not k.endswith(".exp_avg_sq")}
    for name, p in model.named_parameters():
        if not sharded:
            for key in ("exp_avg", "exp_avg_sq"):
                state.setdefault(f"optim.{name}.{key}", torch.zeros(p.shape, dtype=p.dtype) if is_sharded(p)
                                 else torch.zeros_like(p))
        state.setdefault(f"optim.{name}.step", torch.zeros((), dtype=torch.float32))
    state = {k: whole(v) for k, v in state.items()}  # a model sharded by FSDP2 loads whole tensors, keeps its part
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
        dcp().load(state, storage_reader=dcp().HuggingFaceStorageReader(str(path)), no_dist=True)
    if sharded:
        from unbroken.sharding.checkpoint import load_moments

        params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        m, v = load_moments(path, commit["shards"], sum(p.numel() for _, p in params))
        offset = 0
        for name, p in params:
            state[f"optim.{name}.exp_avg"] = m[offset:offset + p.numel()].view_as(p)
            state[f"optim.{name}.exp_avg_sq"] = v[offset:offset + p.numel()].view_as(p)
            offset += p.numel()
    load_training_state(state, model, optimizer)
    return commit
